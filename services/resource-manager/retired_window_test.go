package resourcemanager_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	resourcemanager "github.com/gpuplane/gpuplane/services/resource-manager"
	"github.com/gpuplane/gpuplane/services/resource-manager/internal/ledger"
)

// TestEndedJobsAreForgottenAndTheirPlansExpire: the resource manager
// remembers an ended allocation only for ledger.Keep of log time
// (issue 17: nothing grows with history), and what makes that safe is
// that an item of a plan older than the plans' age is refused
// (plan_expired), never committed. Jobs are committed, run and released;
// a day and more of log time later (a marker's entries move the
// ledger's clock) their records are gone, before and after a restart
// from a snapshot; and their plan, delivered again, commits nothing: every
// item is refused plan_expired, and their run ends release nothing.
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
	// written, as another replica's) move the ledger's clock.
	h.clock.Advance(ledger.Keep(contracts.PlansMaxAge)*5/4 + time.Minute)
	m := item("marker", 1, nodes[0], h100, 0)
	for _, kind := range []contracts.LedgerKind{contracts.LedgerCommitted, contracts.LedgerReleased} {
		h.publish(contracts.SubjectLedger(m.NodeID), contracts.LedgerEntryID(kind, m.ID),
			contracts.LedgerEntry{SchemaVersion: 1, Kind: kind, Allocation: m, Time: h.clock.Now()})
	}
	h.eventually("the ended jobs forgotten: only the marker retired", func() bool { return retired() == 1 })

	again := func(round string) {
		t.Helper()
		// Their plan again (PLANS stamps it now: a day older than the
		// ledger's clock, as the first delivery would be), and their run
		// ends again under new IDs.
		h.plan(round, items...)
		h.plansSettled()
		for _, a := range items {
			h.runEvent(a.NodeID, contracts.RunEnded, a, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded},
				round+"/"+contracts.RunEventID(contracts.RunEnded, a.ID))
		}
		// A run that ends after theirs, committed by hand: once its
		// release is written, theirs were read.
		mk := item("marker-"+round, 1, nodes[1], h100, 0)
		h.publish(contracts.SubjectLedger(mk.NodeID), contracts.LedgerEntryID(contracts.LedgerCommitted, mk.ID),
			contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: mk, Time: h.clock.Now()})
		h.eventually("the marker committed", func() bool { return h.has(mk.ID, contracts.LedgerCommitted) })
		h.runEvent(mk.NodeID, contracts.RunEnded, mk, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded}, "")
		h.eventually("the marker released", func() bool { return h.has(mk.ID, contracts.LedgerReleased) })
		h.locked(func() {
			for _, a := range items {
				r, ok := h.refusal(round, a.ID)
				if !ok || r.Reason != contracts.RefusedPlanExpired {
					t.Errorf("%s: %s answered %v %q, want refused %s", round, a.ID, ok, r.Reason, contracts.RefusedPlanExpired)
				}
				for _, kind := range []contracts.LedgerKind{contracts.LedgerCommitted, contracts.LedgerReleased} {
					if n := len(h.entriesFor(a.ID, kind)); n != 1 {
						t.Errorf("%s: %s %s %d times, want once", round, a.ID, kind, n)
					}
				}
			}
		})
	}
	again("again")
	first.stop()
	h.start(cfg)
	h.eventually("the restart loaded a snapshot", func() bool { return h.logs.count("snapshot loaded") == 1 })
	// The markers' records (one or two, as the last snapshot was
	// written before or after the second's release), none of the jobs'.
	if n, _ := h.logs.lastInt("snapshot loaded", "retired_allocations"); n < 1 || n > 2 {
		t.Fatalf("the restart's snapshot holds %d retired allocations, want the markers' alone", n)
	}
	again("restart")
}

// TestAClockADayAheadExpiresNoPlan: a replica whose clock ran two days
// ahead wrote ledger entries dated then (here by hand). The log's clock
// takes a date at most ledger.ClockSkew past the reader's own clock, so
// plans stored now still commit, before and after a restart from a
// snapshot written with that clock; unclamped, every plan would be
// refused plan_expired for two days.
func TestAClockADayAheadExpiresNoPlan(t *testing.T) {
	h, cfg, first := startLogClock(t)
	h.ready(h100, 4, "n1", "n2")
	ahead := item("ahead", 1, "n1", h100, 0)
	for _, kind := range []contracts.LedgerKind{contracts.LedgerCommitted, contracts.LedgerReleased} {
		h.publish(contracts.SubjectLedger(ahead.NodeID), contracts.LedgerEntryID(kind, ahead.ID),
			contracts.LedgerEntry{SchemaVersion: 1, Kind: kind, Allocation: ahead, Time: h.clock.Now().Add(48 * time.Hour)})
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

// startLogClock starts a manager whose clock starts at the NATS server's
// (which stamps plans) and writes a snapshot every 20 ms, with a
// heartbeat timeout no clock jump of these tests reaches.
func startLogClock(t *testing.T) (*harness, resourcemanager.Config, *rm) {
	h := newHarness(t)
	h.clock.ns.Store(time.Now().UnixNano())
	cfg := h.config("rm-a")
	cfg.HeartbeatTimeout = 1000 * time.Hour
	cfg.SnapshotInterval = 20 * time.Millisecond
	return h, cfg, h.start(cfg)
}
