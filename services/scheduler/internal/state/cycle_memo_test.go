package state

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestCycleDecidesAsExhaustiveSearch runs one random mixed workload (pools,
// MIG, shares, gangs, quotas, guarantees, reservations, three priority
// classes) through two stores built alike: one whose cycles place with the
// placer's failure memos, one whose cycles search every job afresh and
// explain every failure in full. Every cycle's plans, pending events,
// preemptions and demand must be the same, over cycles with commits, run
// starts, departures and new arrivals in between.
func TestCycleDecidesAsExhaustiveSearch(t *testing.T) {
	for _, size := range []struct{ nodes, queue int }{{40, 120}, {150, 400}} {
		t.Run(fmt.Sprintf("nodes=%d", size.nodes), func(t *testing.T) {
			memo, full := benchMixed(t, size.nodes, size.queue), benchMixed(t, size.nodes, size.queue)
			full.exhaustive = true
			rng := rand.New(rand.NewPCG(uint64(size.nodes), 5))
			seq := uint64(1_000_000)
			placed := 0
			for cycle := range 4 {
				got, want := memo.Cycle(), full.Cycle()
				sameCycle(t, cycle, got, want)
				placed += got.Placed
				// Commit and start what was placed, end a third of it, and
				// queue more, alike in both stores.
				runPlaced(rng, benchT0, got, memo, full)
				submitMixed(t, rng, &seq, size.queue/4, memo, full)
			}
			if placed == 0 {
				t.Fatal("nothing placed: the comparison proves little")
			}
		})
	}
}

// sameCycle fails the test unless the fast store's cycle got is the
// exhaustive store's want.
func sameCycle(t *testing.T, cycle int, got, want CycleResult) {
	t.Helper()
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("cycle %d differs:\n memos      placed %d waiting %d, %d plans, %d events\n exhaustive placed %d waiting %d, %d plans, %d events\n%s",
			cycle, got.Placed, got.Waiting, len(got.Plans), len(got.Publish), want.Placed, want.Waiting,
			len(want.Plans), len(want.Publish), firstDiff(got, want))
	}
}

// runPlaced commits and starts, in every store, what res placed, and
// ends a third of it (released at now).
func runPlaced(rng *rand.Rand, now time.Time, res CycleResult, stores ...*Store) {
	for _, p := range res.Plans {
		for _, a := range p.Items {
			end := rng.IntN(3) == 0
			for _, st := range stores {
				st.ApplyLedger(contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a, Time: now})
				st.ApplyRun(contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunStarted, AllocationID: a.ID,
					Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Devices: a.Devices, Time: now})
				if end {
					run := contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: now, EndedAt: now.Add(time.Minute)}
					st.ApplyLedger(contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerReleased, Allocation: a,
						Time: now, Reason: contracts.ReasonRunEnded, Run: &run})
				}
			}
		}
	}
}

// submitMixed queues n more of the mixed workload's jobs, alike in every
// store.
func submitMixed(t *testing.T, rng *rand.Rand, seq *uint64, n int, stores ...*Store) {
	t.Helper()
	for range n {
		*seq++
		tenant, r := benchTenant(rng.IntN(benchTenants)), benchRequest(rng, fmt.Sprintf("k%06d", *seq))
		for _, st := range stores {
			benchSubmit(t, st, tenant, r, *seq)
		}
	}
}

// firstDiff names the first plan item or event that differs.
func firstDiff(a, b CycleResult) string {
	for i := range min(len(a.Plans), len(b.Plans)) {
		for j := range min(len(a.Plans[i].Items), len(b.Plans[i].Items)) {
			if x, y := a.Plans[i].Items[j], b.Plans[i].Items[j]; !reflect.DeepEqual(x, y) {
				return fmt.Sprintf("plan %d item %d: %s/%s on %s vs %s/%s on %s", i, j, x.Tenant, x.JobID, x.NodeID, y.Tenant, y.JobID, y.NodeID)
			}
		}
	}
	for i := range min(len(a.Publish), len(b.Publish)) {
		if !reflect.DeepEqual(a.Publish[i], b.Publish[i]) {
			return fmt.Sprintf("event %d: %+v\n vs %+v", i, a.Publish[i], b.Publish[i])
		}
	}
	return "(counts, preemptions or demand)"
}
