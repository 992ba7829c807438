package resourcemanager_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	resourcemanager "github.com/gpuplane/gpuplane/services/resource-manager"
)

// logAge and logSkew are the plan age and clock skew margin of these
// tests' managers: an ended allocation is kept two seconds of stream time
// (every date is NATS time), in buckets of 500 ms.
const logAge, logSkew = time.Second, time.Second

// TestEndedJobsAreForgottenAndTheirPlansExpire: the resource manager
// remembers an ended allocation only for a plan age (and margin) of
// stream time (issue 17: nothing grows with history), and what makes that
// safe is that an item of a plan older than the plan age is refused
// (plan_expired), never committed. Jobs are committed, run and released;
// a window later (a marker's entries move the ledger's clock) their
// records are gone. Then their very plan message is delivered again (the
// plans' durable consumer deleted, as an operator might, and the manager
// restarted from its snapshot): every item is refused plan_expired and
// none is committed again; their run ends again release nothing; and a
// plan stored now still commits.
func TestEndedJobsAreForgottenAndTheirPlansExpire(t *testing.T) {
	const jobs = 40
	h, cfg, first := startLogClock(t)
	nodes := make([]string, jobs/4)
	for i := range nodes {
		nodes[i] = fmt.Sprintf("n%03d", i)
	}
	h.ready(h100, 4, nodes...)
	items := make([]contracts.Allocation, jobs)
	for j := range jobs {
		items[j] = item(fmt.Sprintf("j%04d", j), 1, nodes[j/4], h100, j%4)
	}
	h.plan("old", items...)
	h.eventually("all committed", func() bool { return h.has(items[jobs-1].ID, contracts.LedgerCommitted) })
	for _, a := range items {
		h.runEvent(a.NodeID, contracts.RunEnded, a, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded}, "")
	}
	h.eventually("all released", func() bool {
		for _, a := range items {
			if !h.has(a.ID, contracts.LedgerReleased) {
				return false
			}
		}
		return true
	})
	retired := func() int64 {
		n, _ := h.logs.lastInt("snapshot written", "retired_allocations")
		return n
	}
	h.eventually("a snapshot with every ended job", func() bool { return retired() == jobs })

	// A window and a bucket later, a marker's commit and release (hand
	// written, as another replica's, dated NATS time as it would) move the
	// ledger's clock.
	time.Sleep((logAge+logSkew)*5/4 + 200*time.Millisecond)
	m := item("marker", 1, nodes[0], h100, 0)
	for _, kind := range []contracts.LedgerKind{contracts.LedgerCommitted, contracts.LedgerReleased} {
		h.publish(contracts.SubjectLedger(m.NodeID), contracts.LedgerEntryID(kind, m.ID),
			contracts.LedgerEntry{SchemaVersion: 1, Kind: kind, Allocation: m, Time: time.Now()})
	}
	h.eventually("the ended jobs forgotten: only the marker retired", func() bool { return retired() == 1 })

	// The old plan message again, with its old stamp.
	first.stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := h.bus.JetStream().DeleteConsumer(ctx, contracts.StreamPlans, resourcemanager.PlansDurable); err != nil {
		t.Fatalf("delete the plans' consumer: %v", err)
	}
	h.start(cfg)
	h.eventually("the restart loaded a snapshot", func() bool { return h.logs.count("snapshot loaded") == 1 })
	h.plansSettled()
	for _, a := range items {
		h.runEvent(a.NodeID, contracts.RunEnded, a, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded},
			"again/"+contracts.RunEventID(contracts.RunEnded, a.ID))
	}
	// A plan stored now commits; its job ends after theirs: once its
	// release is written, their run ends were read.
	fresh := item("fresh", 1, nodes[1], h100, 0)
	h.plan("fresh", fresh)
	h.eventually("a plan stored now committed", func() bool { return h.has(fresh.ID, contracts.LedgerCommitted) })
	h.runEvent(fresh.NodeID, contracts.RunEnded, fresh, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded}, "")
	h.eventually("the fresh job released", func() bool { return h.has(fresh.ID, contracts.LedgerReleased) })
	h.locked(func() {
		for _, a := range items {
			r, ok := h.refusal("old", a.ID)
			if !ok || r.Reason != contracts.RefusedPlanExpired {
				t.Errorf("%s redelivered: answered %v %q, want refused %s", a.ID, ok, r.Reason, contracts.RefusedPlanExpired)
			}
			for _, kind := range []contracts.LedgerKind{contracts.LedgerCommitted, contracts.LedgerReleased} {
				if n := len(h.entriesFor(a.ID, kind)); n != 1 {
					t.Errorf("%s %s %d times, want once", a.ID, kind, n)
				}
			}
		}
	})
}

// TestClocksOfReplicasDateNothing: a manager whose own clock is two days
// ahead, and ledger entries whose time fields say two days ahead (a
// replica with a bad clock, or hand-written), change nothing: every date
// is a stream's stamp, so plans stored now commit, before and after a
// restart from a snapshot. Dated by the entries' times, every plan would
// be refused plan_expired for two days (found in review).
func TestClocksOfReplicasDateNothing(t *testing.T) {
	h, cfg, first := startLogClock(t)
	h.clock.Advance(48 * time.Hour)
	h.ready(h100, 4, "n1", "n2")
	ahead := item("ahead", 1, "n1", h100, 0)
	for _, kind := range []contracts.LedgerKind{contracts.LedgerCommitted, contracts.LedgerReleased} {
		h.publish(contracts.SubjectLedger(ahead.NodeID), contracts.LedgerEntryID(kind, ahead.ID),
			contracts.LedgerEntry{SchemaVersion: 1, Kind: kind, Allocation: ahead, Time: h.clock.Now()})
	}
	h.eventually("the entries dated ahead applied", func() bool {
		n, _ := h.logs.lastInt("snapshot written", "retired_allocations")
		return n == 1
	})
	commits := func(round string, gpu int) {
		t.Helper()
		a := item("now-"+round, 1, "n2", h100, gpu)
		h.plan(round, a)
		h.plansSettled()
		h.locked(func() {
			if r, ok := h.refusal(round, a.ID); ok {
				t.Errorf("%s: a plan stored now refused: %s %s", round, r.Reason, r.Message)
			}
		})
		h.eventually(round+" committed", func() bool { return h.has(a.ID, contracts.LedgerCommitted) })
	}
	commits("first", 1)
	first.stop()
	h.start(cfg)
	h.eventually("the restart loaded a snapshot", func() bool { return h.logs.count("snapshot loaded") == 1 })
	commits("restart", 2)
}

// startLogClock starts a manager of plan age logAge, clock skew margin
// logSkew and a snapshot every 20 ms, with a heartbeat timeout no clock
// jump of these tests reaches.
func startLogClock(t *testing.T) (*harness, resourcemanager.Config, *rm) {
	h := newHarness(t)
	cfg := h.config("rm-a")
	cfg.HeartbeatTimeout = 1000 * time.Hour
	cfg.SnapshotInterval = 20 * time.Millisecond
	cfg.PlanMaxAge, cfg.ClockSkew = logAge, logSkew
	return h, cfg, h.start(cfg)
}
