package gpuctl

import (
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestEventLinePull: a pulling event shows its image and how much of it
// the pull has, so `gpuctl watch` shows a container's pull progress.
func TestEventLinePull(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, tc := range []struct {
		pull *contracts.PullProgress
		want string
	}{
		{&contracts.PullProgress{Image: "gpuplane.localhost/busybox:latest"}, " pulling attempt=1 image=gpuplane.localhost/busybox:latest pulled=0.0/?MB"},
		{&contracts.PullProgress{Image: "r.example/a:v1", Done: 1_250_000, Total: 2_000_000}, " pulling attempt=1 image=r.example/a:v1 pulled=1.2/2.0MB"},
		{nil, " pulling attempt=1"},
	} {
		got := eventLine(contracts.JobEvent{Type: contracts.EventPulling, Attempt: 1, Time: at, Pull: tc.pull})
		if _, rest, _ := strings.Cut(got, " "); " "+rest != tc.want {
			t.Errorf("eventLine(%+v) = %q, want ...%q", tc.pull, got, tc.want)
		}
	}
}
