package state

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

func retain(window time.Duration, most int) func(*Config) {
	return func(c *Config) { c.RetainTerminal, c.RetainTerminalMax = window, most }
}

// runToSuccess places every queued job (the cycle's plans), commits,
// starts, ends and releases each one.
func (h *harness) runToSuccess() []contracts.Allocation {
	h.t.Helper()
	var items []contracts.Allocation
	for _, p := range h.cycle().Plans {
		items = append(items, p.Items...)
	}
	for _, a := range items {
		h.commit(a)
		h.started(a, h.now)
		h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now, EndedAt: h.now})
		h.release(a, contracts.ReasonRunEnded, nil)
	}
	return items
}

// TestARetiredJobIsStillKnown: once an ended job is retired (its window
// passed), every decision that asks about it still gets the answer a
// whole job gave: an identical resubmit changes nothing, another body is a
// duplicate, a cancel finds it ended, a job depending on it runs (or is
// rejected when it was rejected), and a late commit of one of its
// allocations is stopped.
func TestARetiredJobIsStillKnown(t *testing.T) {
	h := newHarness(t, retain(time.Minute, 0))
	h.inventory("n1", "p", h100, 81920, 8)
	h.submit("acme", job("done", 1, h100))
	bad := job("bad", 1, h100)
	bad.Priority = "urgent"
	h.submit("acme", bad)
	h.submit("acme", job("gone", 1, h100))
	if err := h.cancel("acme", "gone"); err != nil {
		t.Fatal(err)
	}
	done := h.runToSuccess()
	if len(done) != 1 {
		t.Fatalf("placed %d jobs, want done alone", len(done))
	}
	if n := h.st.RetireTerminal(); n != 0 {
		t.Fatalf("retired %d jobs inside their window", n)
	}
	h.now = h.now.Add(2 * time.Minute)
	if n := h.st.RetireTerminal(); n != 3 {
		t.Fatalf("retired %d jobs, want 3", n)
	}
	if whole, retired := h.st.Retained(); whole != 0 || retired != 3 {
		t.Fatalf("whole %d, retired %d; want 0 and 3", whole, retired)
	}

	if sub := h.submit("acme", job("done", 1, h100)); sub.Outcome != "unchanged" {
		t.Errorf("identical resubmit of a retired job: %s", sub.Outcome)
	}
	if sub := h.submit("acme", job("done", 2, h100)); sub.Outcome != "duplicate" {
		t.Errorf("another body under a retired job's ID: %s", sub.Outcome)
	}
	if sub := h.submit("acme", bad); sub.Outcome != "unchanged" {
		t.Errorf("identical resubmit of a retired rejected job: %s", sub.Outcome)
	}
	if _, err := h.st.Cancel(contracts.SubjectCancel("acme"), mustJSON(t, contracts.CancelRequest{JobID: "gone"})); !errors.Is(err, ErrTerminalJob) {
		t.Errorf("cancel of a retired job: %v, want ErrTerminalJob", err)
	}
	if j, ok := h.st.Job("acme", "done"); !ok || j.State != contracts.StateSucceeded {
		t.Errorf("retired job: %+v %v", j, ok)
	}

	after := job("after", 1, h100)
	after.DependsOn = []string{"done"}
	h.submit("acme", after)
	if got := h.runToSuccess(); len(got) != 1 || got[0].JobID != "after" {
		t.Errorf("a job depending on a retired succeeded one placed %+v", got)
	}
	afterBad := job("after-bad", 1, h100)
	afterBad.DependsOn = []string{"bad"}
	h.submit("acme", afterBad)
	if ev := h.last("acme", "after-bad"); ev.Reason != contracts.ReasonDependencyRejected || !strings.Contains(ev.Message, "(unknown_priority)") {
		t.Errorf("a dependency on a retired rejected job: %+v", ev)
	}
	afterGone := job("after-gone", 1, h100)
	afterGone.DependsOn = []string{"gone"}
	h.submit("acme", afterGone)
	h.cycle()
	if ev := h.last("acme", "after-gone"); ev.Type != contracts.EventCancelled || ev.Reason != contracts.ReasonDependencyFailed {
		t.Errorf("a dependency on a retired cancelled job: %+v", ev)
	}

	// A commit of the retired job's allocation comes late (a plan whose
	// outcome was hidden): it is stopped, as for a whole ended job.
	h.commit(done[0])
	if len(h.commands) != 1 || h.commands[0].AllocationID != done[0].ID || h.commands[0].Kind != contracts.CommandStopRun {
		t.Errorf("commands after a late commit of a retired job: %+v", h.commands)
	}
	h.noDuplicates()
}

// TestEndedJobsDoNotGrowTheStore: however many jobs end, the store holds
// whole only its live jobs and at most RetainTerminalMax ended ones; the
// rest are retired records. A rebuild from the whole history (which
// retires as it goes) holds no more.
func TestEndedJobsDoNotGrowTheStore(t *testing.T) {
	const most, rounds, perRound = 50, 20, 16
	h := newHarness(t, retain(0, most))
	h.inventory("n1", "p", h100, 81920, perRound)
	h.submit("acme", job("waits", 64, h100)) // never fits: stays live
	for r := range rounds {
		for i := range perRound {
			h.submit(fmt.Sprintf("t%d", i%3), job(fmt.Sprintf("r%d-%d", r, i), 1, h100))
		}
		h.runToSuccess()
		h.st.RetireTerminal()
		if whole, _ := h.st.Retained(); whole > most+1 {
			t.Fatalf("round %d: %d jobs whole, want at most %d ended and the live one", r, whole, most)
		}
	}
	if whole, retired := h.st.Retained(); whole != most+1 || retired != rounds*perRound-most {
		t.Fatalf("whole %d, retired %d; want %d and %d", whole, retired, most+1, rounds*perRound-most)
	}
	h.restart()
	h.st.RetireTerminal()
	if whole, retired := h.st.Retained(); whole != most+1 || retired != rounds*perRound-most {
		t.Fatalf("after a rebuild: whole %d, retired %d; want %d and %d", whole, retired, most+1, rounds*perRound-most)
	}
	if sub := h.submit("t0", job("r0-0", 1, h100)); sub.Outcome != "unchanged" {
		t.Errorf("after a rebuild, identical resubmit of a retired job: %s", sub.Outcome)
	}
	if j, ok := h.st.Job("acme", "waits"); !ok || j.State != contracts.StateQueued {
		t.Errorf("the live job after the rebuild: %+v", j)
	}
	h.noDuplicates()
}
