package state

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestRestartLosesNothingAndRepeatsNothing stops a scheduler with jobs in
// every state, lets facts happen while it is down, and rebuilds a new one:
// it must publish exactly what it owes, once.
func TestRestartLosesNothingAndRepeatsNothing(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 8)
	for _, r := range []contracts.JobRequest{
		job("done", 1, h100),    // runs to completion while the scheduler is down
		job("run", 1, h100),     // starts while it is down
		job("flight", 1, h100),  // plan in flight, cancelled, committed while down
		job("refused", 1, h100), // plan in flight, refused while down
		job("big", 16, h100),    // never fits: one pending event, not one per run
	} {
		h.submit("acme", r)
	}
	h.cycle()
	done, run, flight, refused := h.item("acme", "done"), h.item("acme", "run"), h.item("acme", "flight"), h.item("acme", "refused")
	h.commit(done)
	h.started(done, h.now)
	h.commit(run)
	if err := h.cancel("acme", "flight"); err != nil {
		t.Fatal(err)
	}
	before := len(h.events)

	// The scheduler is down; the rest of the platform goes on.
	h.facts = append(h.facts,
		func(s *Store) []Publish {
			return s.ApplyRun(contracts.RunEvent{Kind: contracts.RunEnded, AllocationID: done.ID, Tenant: "acme", JobID: "done",
				Attempt: 1, NodeID: "n1", Result: &contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now, EndedAt: h.now.Add(time.Minute)}})
		},
		func(s *Store) []Publish {
			return s.ApplyRun(contracts.RunEvent{Kind: contracts.RunStarted, AllocationID: run.ID, Tenant: "acme", JobID: "run",
				Attempt: 1, NodeID: "n1", Time: h.now})
		},
		func(s *Store) []Publish {
			return s.ApplyLedger(contracts.LedgerEntry{Kind: contracts.LedgerCommitted, Allocation: flight})
		},
		func(s *Store) []Publish {
			return s.ApplyRefusal(contracts.Refusal{PlanID: refused.PlanID, AllocationID: refused.ID, Tenant: "acme",
				JobID: "refused", Attempt: 1, NodeID: "n1", Reason: contracts.RefusedCommitConflict})
		},
	)
	h.restart()

	var after []string
	for _, p := range h.events[before:] {
		after = append(after, p.ev.JobID+":"+string(p.ev.Type))
	}
	// The refusal seen during the rebuild puts the job back in the queue
	// without a commit_refused event: the next cycle places it anyway.
	want := []string{"done:succeeded", "flight:scheduled", "run:running"}
	if diff := cmp.Diff(want, after); diff != "" {
		t.Fatalf("events owed after the restart (-want +got):\n%s", diff)
	}
	if len(h.commands) != 1 || h.commands[0].AllocationID != flight.ID {
		t.Fatalf("stop commands %+v, want one for the cancelled job's allocation", h.commands)
	}
	// The refused job is placed again; the big one stays pending without a
	// new event; nothing is proposed twice.
	res := h.cycle()
	if res.Placed != 1 || res.Plans[0].Items[0].JobID != "refused" {
		t.Fatalf("cycle after restart: %+v", res.Plans)
	}
	if got := h.types("acme", "big"); len(got) != 2 {
		t.Fatalf("big: %v, want queued and one pending", got)
	}
	h.noDuplicates()
	if h.st.Queued() != 1 {
		t.Fatalf("%d queued, want only big", h.st.Queued())
	}
}

// TestRestartKeepsPlansInFlight checks that devices a plan assumed before a
// restart stay held after it until the ledger answers.
func TestRestartKeepsPlansInFlight(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 1)
	h.submit("acme", job("first", 1, h100))
	a := h.cycle().Plans[0].Items[0]
	h.restart()
	h.submit("acme", job("second", 1, h100))
	if res := h.cycle(); res.Placed != 0 {
		t.Fatalf("after a restart the device of a plan in flight was given again: %+v", res.Plans)
	}
	if j, _ := h.st.Job("acme", "first"); j.Pending.Code != contracts.PendingPlanInFlight {
		t.Fatalf("first: pending %q, want plan_in_flight", j.Pending.Code)
	}
	h.commit(a)
	if e := h.last("acme", "first"); e.Type != contracts.EventScheduled {
		t.Fatalf("first after commit: %+v", e)
	}
	// Requests are still recognised after the restart.
	if sub := h.submit("acme", job("first", 1, h100)); sub.Outcome != "unchanged" {
		t.Fatalf("identical resubmit after a restart: %s", sub.Outcome)
	}
	if sub := h.submit("acme", job("first", 2, h100)); sub.Outcome != "duplicate" {
		t.Fatalf("another body after a restart: %s", sub.Outcome)
	}
	h.noDuplicates()
}
