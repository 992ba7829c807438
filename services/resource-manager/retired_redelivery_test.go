package resourcemanager_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	resourcemanager "github.com/gpuplane/gpuplane/services/resource-manager"
)

// TestEndedJobsStayEndedOnRedelivery: once many jobs have been committed,
// run and released (their records retired, past several growths of the
// retired records' index), everything about them delivered again, under
// new message IDs (past JetStream's duplicate window), changes nothing:
// their plans are answered Duplicate (no second commit, no refusal),
// their run ends release nothing more, and their ledger entries read
// again are no-ops. Before and after a restart from a snapshot that
// holds the retired records.
func TestEndedJobsStayEndedOnRedelivery(t *testing.T) {
	const jobs, perPlan = 300, 50
	h := newHarness(t)
	cfg := h.config("rm-a")
	cfg.SnapshotInterval = 20 * time.Millisecond
	first := h.start(cfg)
	nodes := make([]string, jobs/4)
	for i := range nodes {
		nodes[i] = fmt.Sprintf("n%03d", i)
	}
	h.ready(h100, 4, nodes...)
	items := make([]contracts.Allocation, jobs)
	for j := range jobs {
		items[j] = item(fmt.Sprintf("j%04d", j), 1, nodes[j/4], h100, j%4)
	}
	plans := func(prefix string) {
		for p := 0; p < jobs; p += perPlan {
			id := fmt.Sprintf("p%03d", p/perPlan)
			h.publish(contracts.SubjectPlan("sched-test"), prefix+"plan/"+id,
				contracts.Plan{SchemaVersion: 1, ID: id, Scheduler: "sched-test", Time: h.clock.Now(), Items: items[p : p+perPlan]})
		}
	}
	ends := func(prefix string) {
		for _, a := range items {
			h.runEvent(a.NodeID, contracts.RunEnded, a, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded},
				prefix+contracts.RunEventID(contracts.RunEnded, a.ID))
		}
	}
	plans("")
	h.eventually("all committed", func() bool {
		for _, a := range items {
			if !h.has(a.ID, contracts.LedgerCommitted) {
				return false
			}
		}
		return true
	})
	ends("")
	h.eventually("all released", func() bool {
		for _, a := range items {
			if !h.has(a.ID, contracts.LedgerReleased) {
				return false
			}
		}
		return true
	})
	entries := func() int {
		n := 0
		h.locked(func() { n = len(h.entries) })
		return n
	}
	written := entries()
	// Each round: the plans and run ends again, then the ledger's own
	// entries again (a replica's copy), and a marker whose commit and
	// release are written after them all.
	round := func(prefix string) {
		t.Helper()
		plans(prefix)
		h.plansSettled()
		ends(prefix)
		for _, a := range items {
			for _, kind := range []contracts.LedgerKind{contracts.LedgerCommitted, contracts.LedgerReleased} {
				h.publish(contracts.SubjectLedger(a.NodeID), prefix+contracts.LedgerEntryID(kind, a.ID),
					contracts.LedgerEntry{SchemaVersion: 1, Kind: kind, Allocation: a, Time: h.clock.Now()})
			}
		}
		m := item("marker-"+prefix, 1, nodes[0], h100, 0)
		h.plan("marker-"+prefix, m)
		h.eventually("marker committed", func() bool { return h.has(m.ID, contracts.LedgerCommitted) })
		h.runEvent(m.NodeID, contracts.RunEnded, m, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded}, "")
		h.eventually("marker released", func() bool { return h.has(m.ID, contracts.LedgerReleased) })
		h.plansSettled()
		// Ours (jobs*2 hand-published copies) and the marker's two.
		written += 2*jobs + 2
		h.locked(func() {
			for _, a := range items {
				for _, kind := range []contracts.LedgerKind{contracts.LedgerCommitted, contracts.LedgerReleased} {
					if n := len(h.entriesFor(a.ID, kind)); n != 2 && prefix == "again-" || n != 3 && prefix == "restart-" {
						t.Errorf("%s: %s %s %d times (ours included)", prefix, a.ID, kind, n)
					}
				}
				for p := range jobs / perPlan {
					if r, ok := h.refusal(fmt.Sprintf("p%03d", p), a.ID); ok {
						t.Errorf("%s: %s refused on redelivery: %s %s", prefix, a.ID, r.Reason, r.Message)
					}
				}
			}
			if len(h.entries) != written {
				t.Errorf("%s: %d ledger entries, want %d: the manager wrote more than the marker's", prefix, len(h.entries), written)
			}
		})
	}
	round("again-")
	first.stop()
	h.start(cfg)
	// The restart started from a snapshot that holds the retired records
	// (one is written every 20 ms while anything changes), not from the
	// streams alone.
	h.eventually("the restart loaded a snapshot", func() bool { return h.logs.count("snapshot loaded") == 1 })
	if n, _ := h.logs.lastInt("snapshot loaded", "retired_allocations"); n < jobs {
		t.Fatalf("the restart's snapshot holds %d retired allocations, want at least %d", n, jobs)
	}
	round("restart-")
}

// plansSettled waits, bounded, until the manager's plan consumer has
// handled and acknowledged every plan published so far.
func (h *harness) plansSettled() {
	h.t.Helper()
	h.eventually("plans settled", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		c, err := h.bus.JetStream().Consumer(ctx, contracts.StreamPlans, resourcemanager.PlansDurable)
		if err != nil {
			return false
		}
		info, err := c.Info(ctx)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0
	})
}
