package state

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestSteadyCyclesDecideAsExhaustiveSearch drives two stores built alike
// through a long run of cycles with deltas between them (BenchmarkSteadyCycle's
// driver: commits and run starts of what each cycle placed, victims that
// stop, running jobs that end, arrivals of every kind the mixed workload has,
// a cordon that moves) plus quota changes, cancels of queued jobs, a node
// lost and returned, and a node added. One store's cycles use everything
// the cycle keeps from one cycle to the next and the placer's failure memos;
// the other's search every job afresh and explain every failure in full.
// Every cycle's plans, pending events, preemptions and demand must be the
// same, and so must every queued job's pending reason.
func TestSteadyCyclesDecideAsExhaustiveSearch(t *testing.T) {
	cycles := 40
	if testing.Short() || raceEnabled {
		cycles = 12
	}
	for _, size := range []struct{ nodes, queue int }{{40, 160}, {120, 500}} {
		t.Run(fmt.Sprintf("nodes=%d", size.nodes), func(t *testing.T) {
			fast, full := benchMixed(t, size.nodes, size.queue), benchMixed(t, size.nodes, size.queue)
			full.exhaustive = true
			sd := newSteady(size.nodes, fast, full)
			sd.extra = steadyExtras(size.nodes)
			placed, preempted := 0, 0
			for cycle := range cycles {
				got, want := fast.Cycle(), full.Cycle()
				if !reflect.DeepEqual(got, want) {
					t.Fatalf("cycle %d differs:\n fast       placed %d waiting %d, %d plans, %d events\n exhaustive placed %d waiting %d, %d plans, %d events\n%s",
						cycle, got.Placed, got.Waiting, len(got.Plans), len(got.Publish), want.Placed, want.Waiting,
						len(want.Plans), len(want.Publish), firstDiff(got, want))
				}
				for k, j := range fast.jobs {
					if o := full.jobs[k]; o == nil || o.Pending != j.Pending || o.State != j.State {
						t.Fatalf("cycle %d: job %s: fast %s %+v, exhaustive %+v", cycle, k, j.State, j.Pending, o)
					}
				}
				placed += got.Placed
				preempted += len(got.Preempted)
				sd.apply(got)
				sd.delta(size.queue/10, size.nodes/8)
			}
			if placed == 0 {
				t.Fatal("nothing placed: the comparison proves little")
			}
			t.Logf("%d cycles: %d placed, %d preemptions", cycles, placed, preempted)
		})
	}
}

// steadyExtras are the test's deltas beyond the benchmark's: a tenant's
// quota changes, a queued job is cancelled, a node is lost and returns, a
// node joins.
func steadyExtras(nodes int) func(rng *rand.Rand, st *Store) {
	return func(rng *rand.Rand, st *Store) {
		switch rng.IntN(6) {
		case 0: // a capped tenant's cap moves
			limit := float64(nodes) * 8 * float64(1+rng.IntN(8)) / 100
			q := contracts.TenantQuota{Tenant: benchTenant(rng.IntN(4)),
				Pools: map[string]contracts.PoolQuota{"h100-train": {Max: &limit}}}
			st.ApplyQuota(q.Tenant, &q)
		case 1: // a guarantee moves
			q := contracts.TenantQuota{Tenant: benchTenant(4 + rng.IntN(4)), Weight: float64(1 + rng.IntN(3)),
				Pools: map[string]contracts.PoolQuota{"h100-train": {Guarantee: float64(nodes) * 8 * float64(rng.IntN(5)) / 100}}}
			st.ApplyQuota(q.Tenant, &q)
		case 2: // a node is lost, or returns
			id := benchInventory(rng.IntN(nodes)).NodeID
			kind := contracts.NodeLost
			if rng.IntN(2) == 0 {
				kind = contracts.NodeReturned
			}
			st.ApplyNodeEvent(contracts.NodeEvent{SchemaVersion: 1, Kind: kind, NodeID: id})
		case 3: // a node joins
			st.ApplyInventory(benchInventory(nodes + rng.IntN(nodes/4+1)))
		}
		// A queued job or two is cancelled.
		for range rng.IntN(3) {
			keys := st.queue.Len()
			if keys == 0 {
				break
			}
			n, i := rng.IntN(keys), 0
			var victim *Job
			for it := range st.queue.Order() {
				if i == n {
					victim = it.Value
					break
				}
				i++
			}
			// Outside the walk: a cancel takes the job out of the queue.
			st.Cancel(contracts.SubjectCancel(victim.Tenant), cancelBody(victim.ID))
		}
	}
}

func cancelBody(id string) []byte {
	b, err := json.Marshal(contracts.CancelRequest{JobID: id})
	if err != nil {
		panic(err)
	}
	return b
}
