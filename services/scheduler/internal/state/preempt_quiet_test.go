package state

import (
	"runtime"
	"testing"
	"time"
	"weak"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestQuietCyclesKeepNoVictimList: preemption's kept victim lists (their
// stamps point at allocations, requests and run times) are dropped by a
// cycle that does not preempt, so allocations released and jobs retired
// after the last preemption are not kept reachable through a quiet spell
// (review of 235c1e4: they were, 4 of 4).
func TestQuietCyclesKeepNoVictimList(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MinRuntime = 0 }, retain(time.Minute, 0))
	h.inventory("l4-1", "l4", "L4", 23034, 4)
	ids := []string{"w0", "w1", "w2", "w3"}
	for _, id := range ids {
		r := job(id, 1, "any")
		r.Pool = "l4"
		h.submit("acme", r)
	}
	h.cycle()
	allocs := map[string]contracts.Allocation{}
	for _, id := range ids {
		allocs[id] = h.item("acme", id)
		h.running(allocs[id])
	}
	var weaks []weak.Pointer[contracts.Allocation]
	for _, a := range h.st.cluster.allocs {
		weaks = append(weaks, weak.Make(a))
	}
	hi := job("hi", 1, "any")
	hi.Pool, hi.Priority = "l4", contracts.PriorityHigh
	h.now = h.now.Add(time.Minute)
	h.submit("acme", hi)
	h.cycle()
	if got := h.preempted(); len(got) == 0 {
		t.Fatalf("no preemption")
	}
	// Everything stops and ends; every job is retired.
	for _, id := range ids {
		a := allocs[id]
		h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now, EndedAt: h.now})
		h.release(a, contracts.ReasonRunEnded, nil)
	}
	for range 5 {
		for _, p := range h.cycle().Plans {
			for _, a := range p.Items {
				h.running(a)
				h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now, EndedAt: h.now})
				h.release(a, contracts.ReasonRunEnded, nil)
			}
		}
	}
	for _, id := range append(ids, "hi") {
		if j := h.st.jobs[Key("acme", id)]; j == nil || !j.State.Terminal() {
			t.Fatalf("%s not ended: %+v", id, j)
		}
	}
	h.now = h.now.Add(5 * time.Minute)
	h.st.RetireTerminal()
	for range 3 {
		h.cycle() // no preemptors
	}
	runtime.GC()
	runtime.GC()
	if b := &h.st.preemptBuf; len(b.running[0])+len(b.running[1])+len(b.stamps[0])+len(b.stamps[1]) > 0 {
		t.Errorf("after cycles without preemptors the kept victim lists hold %d+%d entries", len(b.running[0]), len(b.running[1]))
	}
	alive := 0
	for _, w := range weaks {
		if w.Value() != nil {
			alive++
		}
	}
	if alive > 0 {
		t.Errorf("%d of %d released allocations of retired jobs still reachable", alive, len(weaks))
	}
}
