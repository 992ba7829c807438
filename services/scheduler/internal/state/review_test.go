package state

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// The tests of this file pin down faults found by reviewing the state
// integration of scheduling (gangs, preemption, dependencies, restarts).

// gangOf2 submits a two-machine gang and commits both parts.
func gangOf2(h *harness) []contracts.Allocation {
	h.t.Helper()
	parts := twoMachineGang(h, "A100-80GB", 2)
	if len(parts) != 2 {
		h.t.Fatalf("gang planned as %+v", parts)
	}
	return parts
}

// A part of a gang that ends successfully is not a failure: the other
// machines finish their share. Stopping them (gang_incomplete) would kill
// the job's last ranks and requeue a job that did its work.
func TestReviewGangPartThatSucceedsDoesNotStopTheOthers(t *testing.T) {
	h := newHarness(t)
	parts := gangOf2(h)
	for _, p := range parts {
		h.commit(p)
		h.started(p, h.now)
	}
	h.ended(parts[0], contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now, EndedAt: h.now})
	h.release(parts[0], contracts.ReasonRunEnded, nil)
	if cmds := h.commandsFor(parts[1].ID); len(cmds) != 0 {
		t.Fatalf("rank 1 was stopped because rank 0 succeeded first: %+v", cmds)
	}
	h.ended(parts[1], contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now, EndedAt: h.now.Add(time.Second)})
	h.expectState("a", "g", contracts.StateSucceeded)
	h.noDuplicates()
}

// preemptionSetup runs best-effort jobs of 4 GPUs on nodes of 4 GPUs each,
// then submits a high-priority job of 4 GPUs and runs a cycle that
// preempts.
func preemptionSetup(t *testing.T, nodes ...string) (*harness, map[string]contracts.Allocation) {
	h := newHarness(t, func(c *Config) { c.MinRuntime = 0 })
	lows := map[string]contracts.Allocation{}
	for i, n := range nodes {
		h.inventory(n, "p", h100, 81920, 4)
		low := job("low"+string(rune('1'+i)), 4, "any")
		low.Priority = contracts.PriorityBestEffort
		h.submit("a", low)
		h.cycle()
		a := h.item("a", low.ID)
		h.commit(a)
		h.started(a, h.now)
		lows[low.ID] = a
	}
	high := job("high", 4, "any")
	high.Priority = contracts.PriorityHigh
	h.submit("b", high)
	h.cycle()
	return h, lows
}

func (h *harness) victims(lows map[string]contracts.Allocation) []string {
	var out []string
	for id, a := range lows {
		for _, c := range h.commandsFor(a.ID) {
			if c.Kind == contracts.CommandStopRun && c.Reason == contracts.ReasonPreempted {
				out = append(out, id)
			}
		}
	}
	return out
}

// A victim whose run succeeded before the stop took effect did its work:
// it succeeded, it is not requeued to run again.
func TestReviewVictimWhoseRunSucceededIsNotRequeued(t *testing.T) {
	h, lows := preemptionSetup(t, "n1")
	if v := h.victims(lows); len(v) != 1 {
		t.Fatalf("victims %v", v)
	}
	la := lows["low1"]
	h.ended(la, contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now, EndedAt: h.now})
	h.release(la, contracts.ReasonRunEnded, nil)
	h.expectState("a", "low1", contracts.StateSucceeded)
	h.noDuplicates()
}

// A victim's run may end (and the victim be requeued) before the resource
// manager releases its devices: the preemptor waits for that release
// rather than evicting more jobs.
func TestReviewPreemptorWaitsForTheReleaseOfItsVictims(t *testing.T) {
	h, lows := preemptionSetup(t, "n1", "n2")
	v := h.victims(lows)
	if len(v) != 1 {
		t.Fatalf("victims %v", v)
	}
	va := lows[v[0]]
	h.ended(va, contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonPreempted, StartedAt: h.now, EndedAt: h.now})
	if ev := h.last("a", v[0]); ev.Type != contracts.EventRequeued {
		t.Fatalf("victim after its end: %+v", ev)
	}
	h.cycle()
	if got := h.victims(lows); len(got) != 1 {
		t.Fatalf("a second job was preempted while the first victim's release was on its way: %v", got)
	}
	h.release(va, contracts.ReasonPreempted, nil)
	h.cycle()
	if len(h.items("b", "high", 1)) != 1 {
		t.Fatal("the preemptor did not get the freed devices")
	}
	h.noDuplicates()
}

// Requests are answered in parallel: a job naming a dependency whose queued
// event is still being stored depends on a job submitted before it, and is
// accepted. Should that event not be stored (the request is redelivered),
// the dependent waits rather than being cancelled.
func TestReviewDependencyOnAJobStillBeingAccepted(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 2)
	h.jobsSeq++
	first := h.st.Submit(contracts.SubjectSubmit("a"), mustJSON(t, job("first", 1, "any")), h.jobsSeq)
	second := job("second", 1, "any")
	second.DependsOn = []string{"first"}
	if sub := h.submit("a", second); sub.Outcome != "queued" {
		t.Fatalf("a dependency submitted first but not yet stored: %s %+v", sub.Outcome, h.last("a", "second"))
	}
	// The first request's publish fails; a cycle runs before it comes again.
	first.Abandoned()
	h.cycle()
	if ev := h.last("a", "second"); ev.Type == contracts.EventCancelled {
		t.Fatalf("cancelled while its dependency's request was being redelivered: %+v", ev)
	}
	h.submit("a", job("first", 1, "any"))
	h.cycle()
	succeed(h, h.item("a", "first"))
	h.cycle()
	if len(h.items("a", "second", 1)) != 1 {
		j, _ := h.st.Job("a", "second")
		t.Fatalf("dependent not placed after its dependency succeeded: %+v", j.Pending)
	}
	h.noDuplicates()
}

// placementTimeout bounds the wait for a placement: a job that was placed,
// ran and was then requeued (node lost, preempted, drained) starts a new
// wait, before and after a restart.
func TestReviewRequeuedJobGetsAFreshPlacementTimeout(t *testing.T) {
	for _, restart := range []bool{false, true} {
		h := newHarness(t)
		h.inventory("n1", "p", h100, 81920, 2)
		r := job("j", 1, h100)
		r.PlacementTimeout = contracts.Duration(time.Minute)
		h.submit("a", r)
		h.cycle()
		a := h.item("a", "j")
		h.commit(a)
		h.started(a, h.now)
		h.now = h.now.Add(time.Hour)
		h.release(a, contracts.ReasonNodeLost, &contracts.RunResult{Outcome: contracts.OutcomeFailed,
			Reason: contracts.ReasonNodeLost, StartedAt: h.now.Add(-time.Hour), EndedAt: h.now})
		if ev := h.last("a", "j"); ev.Type != contracts.EventRequeued {
			t.Fatalf("after the loss: %+v", ev)
		}
		if restart {
			h.restart()
		}
		h.cycle()
		if ev := h.last("a", "j"); ev.Type == contracts.EventFailed {
			t.Fatalf("restart %v: a requeued job failed at once: %+v", restart, ev)
		}
		if len(h.items("a", "j", 2)) != 1 {
			t.Fatalf("restart %v: attempt 2 not placed", restart)
		}
	}
}

// A gang committed in part stops each committed part once, however many
// facts about it arrive meanwhile; its requeue says why.
func TestReviewPartialGangStopsEachCommittedPartOnce(t *testing.T) {
	h := newHarness(t)
	parts := gangOf2(h)
	h.commit(parts[0])
	h.refuse(parts[1], contracts.RefusedDeviceTaken)
	h.started(parts[0], h.now) // the agent started it before the stop arrived
	h.ended(parts[0], contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonGangIncomplete, StartedAt: h.now, EndedAt: h.now})
	h.release(parts[0], contracts.ReasonGangIncomplete, nil)
	if n := len(h.commandsFor(parts[0].ID)); n != 1 {
		t.Fatalf("%d commands for the committed part, want one stop", n)
	}
	h.noDuplicates()

	// The same when the refusal comes first, while the other part is in
	// flight: the requeue still names the cause.
	h.cycle()
	parts = h.items("a", "g", 2)
	h.refuse(parts[1], contracts.RefusedDeviceTaken)
	h.commit(parts[0])
	h.ended(parts[0], contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonGangIncomplete, EndedAt: h.now})
	h.release(parts[0], contracts.ReasonGangIncomplete, nil)
	ev := h.last("a", "g")
	if ev.Type != contracts.EventRequeued || ev.Attempt != 3 || strings.HasPrefix(ev.Message, ";") {
		t.Fatalf("requeue of a gang committed in part: %+v", ev)
	}
	h.noDuplicates()
}

// After a restart the RUNS stream may be read ahead of ALLOCATIONS: a
// gang part's run fact that comes before its commit is kept for it, as a
// single machine's is.
func TestReviewGangRunFactsBeforeTheirCommitsAfterARestart(t *testing.T) {
	h := newHarness(t)
	parts := gangOf2(h)
	h.commit(parts[0])
	h.commit(parts[1])
	if ev := h.last("a", "g"); ev.Type != contracts.EventScheduled {
		t.Fatalf("gang: %+v", ev)
	}
	// Down: both ranks start. The rebuild reads the starts first.
	st := h.newStore()
	for _, p := range h.events {
		st.ReplayJobEvent(p.ev, p.seq, p.id)
	}
	for _, p := range h.plans {
		st.ReplayPlan(p)
	}
	for _, a := range parts {
		st.ApplyRun(contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunStarted, AllocationID: a.ID, Tenant: a.Tenant,
			JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Devices: a.Devices, Time: h.now})
	}
	// Only rank 0's commit is read before going live.
	for _, f := range h.facts[:3] {
		f(st)
	}
	h.st = st
	h.collect(st.GoLive())
	if ev := h.last("a", "g"); ev.Type != contracts.EventScheduled {
		t.Fatalf("running published before every part's commit was read again: %+v", ev)
	}
	h.collect(st.ApplyLedger(contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: parts[1], Time: h.now}))
	ev := h.last("a", "g")
	if ev.Type != contracts.EventRunning || len(ev.Placements) != 2 || ev.Placements[1].NodeID != parts[1].NodeID {
		t.Fatalf("the ranks' start facts were lost: %+v", ev)
	}
	h.noDuplicates()
}

// lostRequeue plays the crash these tests rebuild from: the requeued event
// goes out through the outbox while the next cycle's plan is published at
// once, and the scheduler dies in between, leaving JOB_EVENTS at the old
// attempt while attempt 2's plan is in PLANS. It returns that plan item.
func lostRequeue(t *testing.T) (*harness, contracts.Allocation) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 2)
	h.submit("a", job("j", 1, h100))
	h.cycle()
	a1 := h.item("a", "j")
	h.commit(a1)
	h.started(a1, h.now)
	h.release(a1, contracts.ReasonNodeLost, &contracts.RunResult{Outcome: contracts.OutcomeFailed, Reason: contracts.ReasonNodeLost, StartedAt: h.now, EndedAt: h.now})
	h.cycle()
	a2 := h.items("a", "j", 2)
	if len(a2) != 1 {
		t.Fatal("attempt 2 not planned")
	}
	// The crash: attempt 2's events never reached the stream.
	kept := h.events[:0]
	for _, p := range h.events {
		if p.ev.JobID == "j" && p.ev.Attempt == 2 {
			h.ids[p.id]--
			continue
		}
		kept = append(kept, p)
	}
	h.events = kept
	h.status = map[string]*contracts.JobStatus{}
	for _, p := range h.events {
		st := h.status[Key(p.ev.Tenant, p.ev.JobID)]
		if st == nil {
			st = &contracts.JobStatus{}
			h.status[Key(p.ev.Tenant, p.ev.JobID)] = st
		}
		_ = st.Apply(p.ev, p.seq)
	}
	return h, a2[0]
}

// The rebuilt store requeues again (same event ID) and adopts attempt 2's
// commit instead of placing the attempt a second time (the resource
// manager would never commit that ID again: the job would wait forever).
func TestReviewRestartAdoptsTheNextAttemptsCommitWhoseRequeueWasNotStored(t *testing.T) {
	h, a2 := lostRequeue(t)
	// While it is down, the resource manager commits attempt 2.
	e := contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a2, Time: h.now}
	h.facts = append(h.facts, func(s *Store) []Publish { return s.ApplyLedger(e) })
	h.restart()
	if res := h.cycle(); res.Placed != 0 {
		t.Fatalf("attempt 2 placed again while committed: %+v", res.Plans)
	}
	if ev := h.last("a", "j"); ev.Type != contracts.EventScheduled || ev.Attempt != 2 || ev.Placement.AllocationID != a2.ID {
		t.Fatalf("after the restart: %v", h.types("a", "j"))
	}
	h.noDuplicates()
}

// The same crash with attempt 2's plan not answered yet: its device stays
// held (nothing else is proposed on it) and the job waits for the answer
// instead of being placed a second time.
func TestReviewRestartKeepsTheNextAttemptsPlanWhoseRequeueWasNotStored(t *testing.T) {
	h, a2 := lostRequeue(t)
	h.restart()
	h.submit("b", job("other", 1, h100))
	res := h.cycle()
	for _, p := range res.Plans {
		for _, it := range p.Items {
			if it.JobID == "j" || it.Devices[0].UUID == a2.Devices[0].UUID {
				t.Fatalf("proposed again on a device of a plan in flight: %+v", it)
			}
		}
	}
	if j, _ := h.st.Job("a", "j"); j.Pending.Code != contracts.PendingPlanInFlight {
		t.Fatalf("attempt 2 after the restart: %+v", j.Pending)
	}
	h.commit(a2)
	if ev := h.last("a", "j"); ev.Type != contracts.EventScheduled || ev.Attempt != 2 {
		t.Fatalf("after the commit: %v", h.types("a", "j"))
	}
	h.noDuplicates()
}

// A scheduled job whose commit the rebuild did not find (a trimmed
// ALLOCATIONS stream) waits for it; it must not crash the scheduler.
func TestReviewScheduledJobWithoutItsCommitDoesNotPanic(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 2)
	h.submit("a", job("j", 1, h100))
	h.cycle()
	h.commit(h.item("a", "j"))
	h.facts = h.facts[:1] // the commit is gone
	h.restart()
	if err := h.cancel("a", "j"); err != nil {
		t.Fatal(err)
	}
	h.expectState("a", "j", contracts.StateScheduled)
}

// A cancel waiting on a plan in flight, whose refusal comes while the
// scheduler is down: the rebuild publishes nothing before going live (the
// harness fails a store that does), then the job is cancelled once.
func TestReviewCancelWaitingOnAPlanRefusedWhileDown(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 1)
	h.submit("a", job("j", 1, h100))
	h.cycle()
	a := h.item("a", "j")
	if err := h.cancel("a", "j"); err != nil {
		t.Fatal(err)
	}
	r := contracts.Refusal{SchemaVersion: 1, PlanID: a.PlanID, AllocationID: a.ID, Tenant: "a", JobID: "j", Attempt: 1,
		NodeID: "n1", Reason: contracts.RefusedDeviceTaken, Time: h.now}
	h.facts = append(h.facts, func(s *Store) []Publish { return s.ApplyRefusal(r) })
	h.restart()
	if ev := h.last("a", "j"); ev.Type != contracts.EventCancelled {
		t.Fatalf("after the restart: %v", h.types("a", "j"))
	}
	h.noDuplicates()
}

// The same as TestReviewGangRunFactsBeforeTheirCommitsAfterARestart when
// rank 0's commit is read first: the part it adopts for rank 1 must still
// take rank 1's run facts.
func TestReviewGangRunFactAfterAnAdoptedPartBeforeItsOwnCommit(t *testing.T) {
	h := newHarness(t)
	parts := gangOf2(h)
	h.commit(parts[0])
	h.commit(parts[1])
	h.started(parts[0], h.now)
	h.started(parts[1], h.now)
	st := h.newStore()
	for _, p := range h.events {
		st.ReplayJobEvent(p.ev, p.seq, p.id)
	}
	for _, p := range h.plans {
		st.ReplayPlan(p)
	}
	facts := h.facts
	for _, f := range facts[:3] { // inventories, rank 0's commit
		f(st)
	}
	// Rank 1 ends (it failed) while its commit is not read yet.
	st.ApplyRun(contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunEnded, AllocationID: parts[1].ID, Tenant: "a",
		JobID: "g", Attempt: 1, NodeID: parts[1].NodeID, Time: h.now,
		Result: &contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: 7, StartedAt: h.now, EndedAt: h.now}})
	facts[3](st) // rank 1's commit
	h.st = st
	h.collect(st.GoLive())
	if stops := h.commandsFor(parts[0].ID); len(stops) != 1 || stops[0].Reason != contracts.ReasonGangIncomplete {
		t.Fatalf("rank 1's failure was lost: stops for rank 0 %+v", stops)
	}
}

// A plan whose publish reported an error may still have been stored: its
// items can commit after the job ended another way (here: its placement
// timeout). Such an allocation runs nothing anyone waits for; it is
// stopped, as one of a cancelled job is.
func TestReviewCommitOfAJobThatEndedMeanwhileIsStopped(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 1)
	r := job("j", 1, h100)
	r.PlacementTimeout = contracts.Duration(time.Minute)
	h.submit("a", r)
	res := h.cycle()
	a := res.Plans[0].Items[0]
	h.collect(h.st.PlanFailed(res.Plans[0].ID))
	hog := job("hog", 1, h100)
	hog.Priority = contracts.PriorityHigh
	h.submit("a", hog)
	h.cycle()
	h.now = h.now.Add(2 * time.Minute)
	h.cycle()
	h.expectState("a", "j", contracts.StateFailed)
	h.commit(a) // the plan was stored after all
	if cmds := h.commandsFor(a.ID); len(cmds) != 1 || cmds[0].Kind != contracts.CommandStopRun {
		t.Fatalf("an allocation of a failed job was left running: %+v", cmds)
	}
}

// TestReviewRandomRestarts drives random submits (gangs, priorities,
// dependencies), cycles, commits and refusals, run starts and ends,
// node-lost releases and cancels, with restarts at random points. A
// restart reads the NODES, ALLOCATIONS and RUNS facts interleaved at
// random (each stream in order), goes live before the last few, and in
// half of the seeds first loses the job events of the last steps that
// went out through the outbox (a crash). After every step: job event IDs
// are unique, proposals never share a device (G1) and tenant a never
// holds more than its max (Q1), counting an allocation ID once (the
// resource manager commits an ID once). At the end every plan is
// answered and every run ended: each job left is queued with nothing held,
// in the state readers folded.
func TestReviewRandomRestarts(t *testing.T) {
	seeds := 600
	if testing.Short() || raceEnabled {
		seeds = 100
	}
	for seed := range seeds {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			t.Parallel()
			runRestartSeed(t, uint64(seed), seed%2 == 1)
		})
	}
}

func runRestartSeed(t *testing.T, seed uint64, lossy bool) {
	rng := rand.New(rand.NewPCG(seed, 7))
	noMin := func(c *Config) { c.MinRuntime = 0 }
	h := newHarness(t, noMin)
	for i := range 2 + rng.IntN(2) {
		id := fmt.Sprintf("n%d", i)
		inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: id, Pool: "p", Incarnation: "i1", Time: h.now}
		for g := range 2 + rng.IntN(3) {
			inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: g, UUID: fmt.Sprintf("%s-gpu%d", id, g), Model: "A100-80GB",
				MemoryMiB: 81920, Healthy: true})
		}
		h.fact(func(s *Store) []Publish { s.ApplyInventory(inv); return nil })
	}
	maxA := 3.0
	quota := &contracts.TenantQuota{Pools: map[string]contracts.PoolQuota{contracts.QuotaAllPools: {Max: &maxA}}}
	h.st.ApplyQuota("a", quota)
	var (
		ref       = refLedger{byID: map[string]contracts.Allocation{}}
		committed = map[string]contracts.Allocation{} // every ID ever committed
		ended     = map[string]bool{}                 // run end published before the release
		pending   []contracts.Allocation              // plan items not answered
		live      []contracts.Allocation              // committed, not released
		seen      int                                 // plans moved to pending
		jobN      int
		streams   []byte // per fact: n(odes), a(llocations), r(uns)
		evAt      []int  // len(h.events) after each step
	)
	tag := func(c byte) {
		for len(streams) < len(h.facts) {
			streams = append(streams, c)
		}
	}
	tag('n')
	answer := func(a contracts.Allocation, commit bool) {
		defer tag('a')
		if prev, ok := committed[a.ID]; ok {
			// The resource manager commits an allocation ID once: the
			// same placement again is a no-op (no answer at all).
			if prev.NodeID != a.NodeID || fmt.Sprint(prev.Devices) != fmt.Sprint(a.Devices) {
				h.refuse(a, contracts.RefusedAlreadyPlaced)
			}
			return
		}
		if _, fits := ref.fits(a); fits && commit {
			committed[a.ID] = a
			ref.byID[a.ID] = a
			live = append(live, a)
			h.commit(a)
			return
		}
		h.refuse(a, contracts.RefusedDeviceTaken)
	}
	result := func(a contracts.Allocation, succeed bool) contracts.RunResult {
		r := contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now, EndedAt: h.now}
		if !succeed {
			r.Outcome, r.Reason, r.ExitCode = contracts.OutcomeFailed, contracts.ReasonExitNonZero, 1
		}
		for _, c := range h.commandsFor(a.ID) {
			if c.Kind == contracts.CommandStopRun {
				r.Outcome, r.Reason = contracts.OutcomeCancelled, c.Reason
			}
		}
		return r
	}
	endRun := func(i int, succeed bool) {
		a := live[i]
		live = append(live[:i], live[i+1:]...)
		delete(ref.byID, a.ID)
		if !ended[a.ID] {
			h.ended(a, result(a, succeed))
			tag('r')
		}
		h.release(a, contracts.ReasonRunEnded, nil)
		tag('a')
	}
	once := func(all []contracts.Allocation) []contracts.Allocation {
		byID := map[string]contracts.Allocation{}
		for _, a := range all {
			byID[a.ID] = a
		}
		out := make([]contracts.Allocation, 0, len(byID))
		for _, a := range byID {
			out = append(out, a)
		}
		return out
	}
	restart := func() {
		if lossy && len(evAt) > 3 {
			// Crash: per job, events of the last steps after a random
			// one are lost (the outbox keeps a job's order, so the rest
			// of that job's are too); queued and rejected answers were
			// published before their requests were acknowledged.
			from := evAt[len(evAt)-1-rng.IntN(3)]
			drop := map[string]bool{}
			kept := h.events[:0:0]
			for i, p := range h.events {
				k := Key(p.ev.Tenant, p.ev.JobID)
				if drop[k] || (i >= from && p.ev.Type != contracts.EventQueued && p.ev.Type != contracts.EventRejected && rng.IntN(2) == 0) {
					drop[k] = true
					h.ids[p.id]--
					continue
				}
				kept = append(kept, p)
			}
			h.events = kept
			h.status = map[string]*contracts.JobStatus{}
			for _, p := range h.events {
				st := h.status[Key(p.ev.Tenant, p.ev.JobID)]
				if st == nil {
					st = &contracts.JobStatus{}
					h.status[Key(p.ev.Tenant, p.ev.JobID)] = st
				}
				_ = st.Apply(p.ev, p.seq)
			}
		}
		st := h.newStore(noMin)
		for _, p := range h.events {
			st.ReplayJobEvent(p.ev, p.seq, p.id)
		}
		for i, c := range h.cancels {
			st.ReplayCancel(c[0], []byte(c[1]), h.cancelSeqs[i])
		}
		for _, p := range h.plans {
			st.ReplayPlan(p)
		}
		var idx [3][]int
		for i, c := range streams {
			k := strings.IndexByte("nar", c)
			idx[k] = append(idx[k], i)
		}
		var order []int
		for len(idx[0])+len(idx[1])+len(idx[2]) > 0 {
			if k := rng.IntN(3); len(idx[k]) > 0 {
				order = append(order, idx[k][0])
				idx[k] = idx[k][1:]
			}
		}
		cut := len(order) - rng.IntN(min(len(order), 4)+1)
		for _, i := range order[:cut] {
			if pubs := h.facts[i](st); len(pubs) > 0 {
				t.Fatalf("a store that is not live published %+v", pubs[0])
			}
		}
		h.st = st
		st.ApplyQuota("a", quota)
		h.collect(st.GoLive())
		for _, i := range order[cut:] {
			h.collect(h.facts[i](st))
		}
	}
	cycle := func(step int) {
		h.cycle()
		for _, p := range h.plans[seen:] {
			pending = append(pending, p.Items...)
		}
		seen = len(h.plans)
		held := once(append(append([]contracts.Allocation{}, live...), pending...))
		if err := exclusive(held); err != nil {
			t.Fatalf("step %d: G1 broken by the scheduler's proposals: %v", step, err)
		}
	}
	for step := range 200 {
		switch op := rng.IntN(12); {
		case op < 2:
			jobN++
			r := job(fmt.Sprintf("j%d", jobN), 1+rng.IntN(2), "any")
			if rng.IntN(3) == 0 {
				r.Resources.GPU.Count, r.Resources.GPU.Nodes = 2, 2
			}
			r.Priority = contracts.Priorities[rng.IntN(len(contracts.Priorities))]
			if jobN > 1 && rng.IntN(4) == 0 {
				r.DependsOn = []string{fmt.Sprintf("j%d", 1+rng.IntN(jobN-1))}
			}
			h.submit([]string{"a", "b"}[rng.IntN(2)], r)
		case op < 4:
			cycle(step)
		case op < 6 && len(pending) > 0:
			i := rng.IntN(len(pending))
			a := pending[i]
			pending = append(pending[:i], pending[i+1:]...)
			answer(a, rng.IntN(4) > 0)
		case op < 8 && len(live) > 0:
			i := rng.IntN(len(live))
			a := live[i]
			switch rng.IntN(3) {
			case 0:
				h.started(a, h.now)
				tag('r')
			case 1:
				if !ended[a.ID] { // the end read before its release
					ended[a.ID] = true
					h.ended(a, result(a, true))
					tag('r')
				}
			default:
				endRun(i, rng.IntN(5) > 0)
			}
		case op == 8 && rng.IntN(2) == 0:
			restart()
		case op == 8 && len(h.events) > 0:
			ev := h.events[rng.IntN(len(h.events))].ev
			_ = h.cancel(ev.Tenant, ev.JobID)
		case op == 9 && len(live) > 0:
			i := rng.IntN(len(live))
			a := live[i]
			live = append(live[:i], live[i+1:]...)
			delete(ref.byID, a.ID)
			h.release(a, contracts.ReasonNodeLost, &contracts.RunResult{Outcome: contracts.OutcomeFailed,
				Reason: contracts.ReasonNodeLost, EndedAt: h.now})
			tag('a')
		default:
			h.now = h.now.Add(time.Duration(rng.IntN(30)) * time.Second)
		}
		evAt = append(evAt, len(h.events))
		h.uniqueJobEvents()
		checkQuotas(t, step, map[string]float64{"a": maxA}, once(append(append([]contracts.Allocation{}, live...), pending...)), nil)
	}
	// Settle: answer every plan, end every run, until nothing moves.
	for range 6 {
		cycle(200)
		for len(pending) > 0 {
			a := pending[0]
			pending = pending[1:]
			answer(a, true)
		}
		for len(live) > 0 {
			endRun(0, true)
		}
		h.now = h.now.Add(time.Minute)
	}
	h.uniqueJobEvents()
	for k, j := range h.st.jobs {
		if j.State.Terminal() {
			continue
		}
		if j.State != contracts.StateQueued || len(j.parts) > 0 || len(j.later) > 0 {
			t.Errorf("job %s stuck: state %s, %d parts, pending %+v; events %v", k, j.State, len(j.parts), j.Pending, h.types(j.Tenant, j.ID))
		}
		if st := h.status[k]; st == nil || st.State != j.State || st.Attempt != j.Attempt {
			t.Errorf("job %s: store %s attempt %d, readers %+v", k, j.State, j.Attempt, st)
		}
	}
}

// uniqueJobEvents fails when a job event ID was published twice.
func (h *harness) uniqueJobEvents() {
	h.t.Helper()
	seen := map[string]bool{}
	for _, p := range h.events {
		if seen[p.id] && p.ev.Reason != contracts.ReasonDuplicateJobID {
			h.t.Fatalf("job event %s published twice", p.id)
		}
		seen[p.id] = true
	}
}
