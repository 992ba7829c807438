package state

import (
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestQueuedAtTheEpochStillTimesOut: a job queued at the Unix epoch
// itself (a clock or an event at 1970-01-01T00:00:00Z) times out like any
// other, before and after a rebuild: its 8-byte queue time is not the 0
// that says "unknown" (review of 11ae979).
func TestQueuedAtTheEpochStillTimesOut(t *testing.T) {
	for _, restart := range []bool{false, true} {
		for _, at := range []time.Time{time.Unix(0, 0).UTC(), time.Unix(0, 1).UTC(), time.Date(1969, 12, 31, 23, 0, 0, 0, time.UTC)} {
			h := newHarness(t)
			h.now = at
			h.inventory("n1", "p", h100, 81920, 1)
			r := job("j", 2, h100) // never fits
			r.PlacementTimeout = contracts.Duration(time.Minute)
			h.submit("a", r)
			h.cycle()
			if restart {
				h.restart()
			}
			h.now = h.now.Add(2 * time.Minute)
			h.cycle()
			if ev := h.last("a", "j"); ev.Type != contracts.EventFailed || ev.Reason != contracts.ReasonPlacementTimeout {
				t.Errorf("restart=%t, queued at %s: after 2m (placement timeout 1m) the last event is %s %s",
					restart, at.Format(time.RFC3339Nano), ev.Type, ev.Reason)
			}
		}
	}
}

// TestMovesRecordGoesWhenServed: a job moved off a drained machine
// points to no moves record once it runs again and its migrated event is
// out (the move published, the nodes to avoid served), not for the rest
// of its attempt (review of dd52a83).
func TestMovesRecordGoesWhenServed(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.PreemptGrace = 20 * time.Second })
	a := placeRunning(h, "j", false)
	h.st.ApplyNodeAdmin("n1", &contracts.NodeAdmin{NodeID: "n1", Cordoned: true, Drain: true, Reason: "maintenance"})
	h.cycle()
	if h.st.jobs[Key("a", "j")].mv == nil {
		t.Fatal("a job being moved has no moves record")
	}
	h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonDrained, StartedAt: h.now, EndedAt: h.now})
	h.release(a, contracts.ReasonDrained, nil)
	h.cycle()
	next := h.items("a", "j", 2)
	h.commit(next[0])
	h.started(next[0], h.now)
	if ev := h.last("a", "j"); ev.Type != contracts.EventMigrated {
		t.Fatalf("last event %s, want migrated", ev.Type)
	}
	if mv := h.st.jobs[Key("a", "j")].mv; mv != nil {
		t.Errorf("running again after migrated, the job still points to a moves record: %+v", *mv)
	}
}
