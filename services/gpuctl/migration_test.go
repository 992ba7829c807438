package gpuctl

import (
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestMigrationLine(t *testing.T) {
	at := time.Date(2026, 11, 22, 8, 0, 0, 0, time.UTC)
	from := []contracts.Placement{{NodeID: "n7"}}
	tests := []struct {
		name string
		m    contracts.Migration
		done int
		want string
	}{
		{"restored", contracts.Migration{Reason: contracts.ReasonSpotInterruption, FromAttempt: 1, From: from, RestoredFrom: "ckpt-3"}, 1,
			"1 done; last: spot_interruption from attempt 1 on n7, restored ckpt-3"},
		{"under way", contracts.Migration{Reason: contracts.ReasonSpotInterruption, FromAttempt: 2, From: from, Deadline: &at}, 1,
			"1 done; last: spot_interruption from attempt 2 on n7, under way (machine goes at " + formatTime(&at) + ")"},
		{"restarted", contracts.Migration{Reason: contracts.ReasonGPUUnhealthy, FromAttempt: 1}, 0,
			"0 done; last: gpu_unhealthy from attempt 1"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := migration(&tc.m, tc.done); got != tc.want {
				t.Fatalf("got %q\nwant %q", got, tc.want)
			}
		})
	}
}
