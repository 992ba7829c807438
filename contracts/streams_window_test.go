package contracts

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// TestDuplicateWindows: only the agents' sample streams (heartbeats,
// telemetry) keep message IDs for the short window; every other stream,
// the logs of record included, keeps them for DuplicateWindow, which the
// services' retried publishes rely on.
func TestDuplicateWindows(t *testing.T) {
	want := map[string]time.Duration{StreamHeartbeats: SampleDuplicateWindow, StreamTelemetry: SampleDuplicateWindow}
	for _, opts := range []StreamOptions{{}, {Replicas: 3, Memory: true}} {
		for _, c := range Streams(opts) {
			w, ok := want[c.Name]
			if !ok {
				w = DuplicateWindow
			}
			if c.Duplicates != w {
				t.Errorf("%s: duplicate window %s, want %s", c.Name, c.Duplicates, w)
			}
		}
	}
	if SampleDuplicateWindow >= DuplicateWindow {
		t.Errorf("SampleDuplicateWindow %s is not shorter than DuplicateWindow %s", SampleDuplicateWindow, DuplicateWindow)
	}
}

// TestStreamByteBounds: the aging streams whose subjects grow with the
// fleet or the jobs and that nothing must read in full (run output, the
// ops events) are bounded by bytes too, by default and as asked; the
// streams of record never are (an overflow would lose accepted work).
func TestStreamByteBounds(t *testing.T) {
	for _, tt := range []struct {
		name string
		opts StreamOptions
		want map[string]int64
	}{
		{"defaults", StreamOptions{}, map[string]int64{StreamLogs: 1 << 30, StreamOps: 1 << 30}},
		{"asked", StreamOptions{LogsMaxBytes: 5 << 20, OpsMaxBytes: 7 << 20}, map[string]int64{StreamLogs: 5 << 20, StreamOps: 7 << 20}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			for _, c := range Streams(tt.opts) {
				want, ok := tt.want[c.Name]
				if !ok {
					want = -1
				}
				if c.MaxBytes != want {
					t.Errorf("%s: max bytes %d, want %d", c.Name, c.MaxBytes, want)
				}
				if ok && c.Discard != jetstream.DiscardOld {
					t.Errorf("%s: bounded by bytes with discard %s; the oldest must go, not the publish", c.Name, c.Discard)
				}
			}
		})
	}
}
