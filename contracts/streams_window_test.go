package contracts

import (
	"testing"
	"time"
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
