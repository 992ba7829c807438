package state

import (
	"slices"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// fragmented leaves one free GPU on each of two 2-GPU nodes: small jobs
// s1 on n1 and s2 on n2, both started.
func fragmented(h *harness, checkpoint bool) (s1, s2 contracts.Allocation) {
	h.t.Helper()
	h.inventory("n1", "p", "H100-80GB", 81920, 2)
	one := func(id string) contracts.Allocation {
		req := job(id, 1, "any")
		req.Run.Checkpoint = checkpoint
		req.Run.Duration = contracts.Duration(time.Hour)
		h.submit("small", req)
		h.cycle()
		a := h.item("small", id)
		h.commit(a)
		h.started(a, h.now)
		return a
	}
	s1 = one("s1")
	h.st.ApplyNodeAdmin("n1", &contracts.NodeAdmin{NodeID: "n1", Cordoned: true})
	h.inventory("n2", "p", "H100-80GB", 81920, 2)
	s2 = one("s2")
	h.st.ApplyNodeAdmin("n1", nil)
	if s1.NodeID != "n1" || s2.NodeID != "n2" {
		h.t.Fatalf("setup: s1 on %s, s2 on %s", s1.NodeID, s2.NodeID)
	}
	return s1, s2
}

func TestDefragmentationMovesASmallJobWhenWorthIt(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MinRuntime = 0 })
	s1, s2 := fragmented(h, true)
	h.submit("big", job("b", 2, "any"))
	h.cycle()
	if j, _ := h.st.Job("big", "b"); j.Pending.Code != contracts.PendingInsufficientGPUs {
		t.Fatalf("big job pending %+v", j.Pending)
	}
	// No alert: nothing moves, however long the job waits.
	h.now = h.now.Add(time.Minute)
	h.cycle()
	if len(h.commandsFor(s1.ID))+len(h.commandsFor(s2.ID)) != 0 {
		t.Fatal("moved without a defragment alert")
	}
	h.st.ApplyDefrag("p", "pool_fragmented/p", true)
	h.cycle()
	// One move (1 GPU x 30 s overhead) for a 2-GPU job that waited 60 s:
	// worth it. The first node in order is freed: s1 moves.
	if got := kinds(h.commandsFor(s1.ID)); !slices.Equal(got, []string{"checkpoint_run:defragment"}) {
		t.Fatalf("s1 commands %v (s2: %v)", got, kinds(h.commandsFor(s2.ID)))
	}
	if len(h.commandsFor(s2.ID)) != 0 {
		t.Fatal("both small jobs moved")
	}
	if ev := h.last("small", "s1"); ev.Type != contracts.EventMigrating || ev.Reason != contracts.ReasonDefragment {
		t.Fatalf("s1: %+v", ev)
	}
	if j, _ := h.st.Job("big", "b"); j.Pending.Code != contracts.PendingPreempting {
		t.Fatalf("big job pending %+v", j.Pending)
	}
	h.checkpointed(s1, "c1", true)
	h.ended(s1, contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonDefragment, StartedAt: h.now, EndedAt: h.now})
	h.release(s1, contracts.ReasonDefragment, nil)
	h.cycle()
	big, moved := h.items("big", "b", 1), h.items("small", "s1", 2)
	if len(big) != 1 || big[0].NodeID != "n1" || len(big[0].Devices) != 2 {
		t.Fatalf("big job planned %+v, want both GPUs of n1", big)
	}
	if len(moved) != 1 || moved[0].NodeID != "n2" {
		t.Fatalf("s1's next attempt planned %+v, want n2", moved)
	}
	h.commit(moved[0])
	h.started(moved[0], h.now)
	if ev := h.last("small", "s1"); ev.Type != contracts.EventMigrated || ev.Migration.RestoredFrom != "c1" {
		t.Fatalf("s1: %+v", ev)
	}
	h.noDuplicates()
}

func TestDefragmentationRefusals(t *testing.T) {
	tests := []struct {
		name  string
		setup func(h *harness)
	}{
		// 1 GPU x (30 s + 10 min lost) against 2 GPUs x 60 s waited.
		{"progress lost outweighs the wait", func(h *harness) {
			fragmented(h, false)
			h.now = h.now.Add(10 * time.Minute)
			h.submit("big", job("b", 2, "any"))
			h.cycle()
			h.now = h.now.Add(time.Minute)
		}},
		// The small jobs fill both nodes' other GPUs: a moved job would
		// have nowhere to go.
		{"a moved job would not fit elsewhere", func(h *harness) {
			fragmented(h, true)
			h.submit("big", job("b", 2, "any"))
			req := job("filler", 1, "any")
			req.Run.Duration = contracts.Duration(time.Hour)
			h.submit("big", req) // placed: big waits, the filler fits
			h.cycle()
			h.now = h.now.Add(time.Hour)
		}},
		// Checkpointing jobs (nothing lost but the restart) in the way of
		// a job that waited an hour, but both end in 20 s: waiting for
		// them costs less than the 30 s restart.
		{"the jobs in the way end sooner than a restart", func(h *harness) {
			fragmented(h, true)
			h.submit("big", job("b", 2, "any"))
			h.cycle()
			h.now = h.now.Add(time.Hour - 20*time.Second)
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(c *Config) { c.MinRuntime = 0 })
			tc.setup(h)
			h.st.ApplyDefrag("p", "k", true)
			h.cycle()
			// The big job is blocked by capacity, so the cycle did look for
			// a consolidation and found none worth making.
			if j, _ := h.st.Job("big", "b"); j.Pending.Code != contracts.PendingInsufficientGPUs {
				t.Fatalf("big job pending %+v, want %s", j.Pending, contracts.PendingInsufficientGPUs)
			}
			for _, c := range h.commands {
				if c.Reason == contracts.ReasonDefragment {
					t.Fatalf("moved: %+v", c)
				}
			}
		})
	}
}

// TestMovedJobWaitsForItsReleaseAndKeepsOffTheFreedNode: a moved job's
// next attempt is not planned while the ledger still holds the last one
// (the resource manager would refuse it: one live attempt per job), and a
// refused plan for it keeps it off the node it freed: spread would put it
// on the empty node.
func TestMovedJobWaitsForItsReleaseAndKeepsOffTheFreedNode(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MinRuntime, c.Policy = 0, contracts.PolicySpread })
	s1, _ := fragmented(h, true)
	h.submit("big", job("b", 2, "any"))
	h.cycle()
	h.now = h.now.Add(time.Minute)
	h.st.ApplyDefrag("p", "pool_fragmented/p", true)
	h.cycle()
	if ev := h.last("small", "s1"); ev.Type != contracts.EventMigrating {
		t.Fatalf("s1 not moved: %+v", ev)
	}
	h.checkpointed(s1, "c1", true)
	h.ended(s1, contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonDefragment, StartedAt: h.now, EndedAt: h.now})
	h.cycle()
	if got := h.items("small", "s1", 2); len(got) != 0 {
		t.Fatalf("attempt 2 planned %+v while attempt 1 is still in the ledger", got)
	}
	if j, _ := h.st.Job("small", "s1"); j.State != contracts.StateQueued || j.Pending.Code != contracts.PendingReleasing {
		t.Fatalf("s1 before its release: state %s, pending %+v", j.State, j.Pending)
	}
	// A restarted scheduler, rebuilt from the streams, waits the same way.
	h.restart()
	h.cycle()
	if got := h.items("small", "s1", 2); len(got) != 0 {
		t.Fatalf("after a restart, attempt 2 planned %+v while attempt 1 is still in the ledger", got)
	}
	h.release(s1, contracts.ReasonDefragment, nil)
	h.cycle()
	big, moved := h.items("big", "b", 1), h.items("small", "s1", 2)
	if len(big) != 1 || big[0].NodeID != "n1" || len(moved) != 1 || moved[0].NodeID != "n2" {
		t.Fatalf("after the release: big %+v, s1 %+v; want n1 and n2", big, moved)
	}
	// Both plans refused, the big job gone: n1 is empty, and spread
	// prefers it, but s1 still keeps off the node it was moved from.
	h.refuse(big[0], contracts.RefusedCommitConflict)
	h.refuse(moved[0], contracts.RefusedCommitConflict)
	if err := h.cancel("big", "b"); err != nil {
		t.Fatal(err)
	}
	h.cycle()
	again := h.items("small", "s1", 2)
	if len(again) != 2 || again[1].NodeID != "n2" {
		t.Fatalf("s1's retried attempt 2 planned %+v, want n2 again", again)
	}
	h.commit(again[1])
	h.noDuplicates()
}
