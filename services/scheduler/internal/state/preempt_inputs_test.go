package state

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/preempt"
)

// TestPreemptInputsAreGuaranteesAndVictimsOf holds preemptInputs (one walk,
// kept buffers, staying summed per run of one tenant and pool, borrowing
// asked once per run) to guarantees and victimsOf asked on their own,
// through steady cycles of the mixed workload with the tests' extras
// (quota and guarantee changes, cancels, nodes lost, returned and added):
// right after each cycle (plans in flight, preemptions' claims, victims
// being stopped), after its plans commit, after they start, and after each delta (commits, run starts, releases, the
// cordon moved). Each state is asked twice, so a second call over the kept
// buffers and the last call's entries (reused where their stamps are the
// same) answers as the first; the list an earlier call returned is
// compared before the next calls write over it. Runs report checkpoints
// between cycles too.
func TestPreemptInputsAreGuaranteesAndVictimsOf(t *testing.T) {
	cycles := 30
	if testing.Short() || raceEnabled {
		cycles = 10
	}
	for _, size := range []struct{ nodes, queue int }{{40, 160}, {120, 500}} {
		t.Run(fmt.Sprintf("nodes=%d", size.nodes), func(t *testing.T) {
			st := benchMixed(t, size.nodes, size.queue)
			sd := newSteady(size.nodes, st)
			sd.extra = steadyExtras(size.nodes)
			checks, claims, leaving := 0, 0, 0
			rng := rand.New(rand.NewPCG(uint64(size.nodes), 3))
			check := func(when string) {
				t.Helper()
				book := st.book(st.cluster.snapshot(sd.now))
				wantG := st.guarantees(book)
				want := st.victimsOf(wantG)
				for try := range 2 {
					// Each call has a book of its own: preempt holds
					// decisions on it.
					g, got := st.preemptInputs(st.book(st.cluster.snapshot(sd.now)))
					if !reflect.DeepEqual(g.staying, wantG.staying) || !reflect.DeepEqual(g.spare, wantG.spare) {
						t.Fatalf("%s, call %d: guarantees differ:\n staying %v\n want    %v\n spare %v\n want  %v",
							when, try, g.staying, wantG.staying, g.spare, wantG.spare)
					}
					if len(got) != len(want) {
						t.Fatalf("%s, call %d: %d running, want %d", when, try, len(got), len(want))
					}
					for i := range want {
						if !reflect.DeepEqual(got[i], want[i]) {
							t.Fatalf("%s, call %d: running %d:\n %+v\n want %+v", when, try, i, got[i], want[i])
						}
					}
				}
				checks++
				claims += len(st.cluster.claims)
				for _, ref := range st.committed() {
					if j := ref.j; j != nil && (j.evict != "" || j.cancel) {
						leaving++
					}
				}
			}
			check("start")
			for cycle := range cycles {
				res := st.Cycle()
				check(fmt.Sprintf("cycle %d", cycle))
				// Commit what it placed, then start it, with a check
				// between (an entry's start time moves under the same
				// allocation); sd.apply commits again (a new allocation
				// value) and notes it.
				for _, pl := range res.Plans {
					for _, a := range pl.Items {
						st.ApplyLedger(contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a, Time: sd.now})
					}
				}
				check(fmt.Sprintf("cycle %d committed", cycle))
				for _, pl := range res.Plans {
					for _, a := range pl.Items {
						st.ApplyRun(contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunStarted, AllocationID: a.ID,
							Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Devices: a.Devices, Time: sd.now})
					}
				}
				check(fmt.Sprintf("cycle %d started", cycle))
				sd.apply(res)
				sd.delta(size.queue/10, size.nodes/8)
				// A few runs report a checkpoint (a new last-checkpoint
				// time, the one stamp the driver does not move).
				refs := st.committed()
				for range 3 {
					a := refs[rng.IntN(len(refs))].a
					st.ApplyRun(contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunCheckpointed, AllocationID: a.ID,
						Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Time: sd.now})
				}
				check(fmt.Sprintf("after cycle %d's delta", cycle))
			}
			// The comparison must have seen what it is about.
			if claims == 0 || leaving == 0 {
				t.Fatalf("%d checks saw %d claims and %d allocations of leaving jobs: the comparison proves little",
					checks, claims, leaving)
			}
			t.Logf("%d checks, %d claims, %d allocations of leaving jobs", checks, claims, leaving)
		})
	}
}

// TestPreemptInputsSumStayingPerTenantAndPool: one tenant's allocations
// interleave pools, and a tenant with a guarantee holds nothing but
// zero-GPU work in its pool; the per-run sums must still be every
// allocation's, and that pool still has its staying entry, so its spare
// budget is zero (nothing of it may be evicted) rather than none (no
// guarantee to keep). Some parts are being stopped on their own (a gang's
// part retried: stopSent on a job that is not leaving), which no longer
// stay but may still be chosen.
func TestPreemptInputsSumStayingPerTenantAndPool(t *testing.T) {
	st := benchMixed(t, 40, 160)
	zero := preempt.TenantPool{Tenant: benchTenant(4), Pool: "h100-train"}
	n, zeroed, stopping := 0, 0, 0
	for _, ref := range st.committed() {
		if n%5 == 2 && ref.j != nil {
			if p := ref.j.part(ref.a.ID); p != nil && p.live() {
				p.stopSent = contracts.ReasonGangIncomplete
				stopping++
			}
		}
		// The walks read the allocation's pool and devices only; the
		// store is thrown away after.
		switch {
		case ref.a.Tenant == zero.Tenant && ref.a.Pool == zero.Pool:
			ref.a.Devices = nil
			zeroed++
		case n%2 == 1:
			ref.a.Pool = "other-" + ref.a.Pool
		}
		n++
	}
	if zeroed == 0 || stopping == 0 {
		t.Fatalf("tenant %s holds nothing in %s: the test proves little", zero.Tenant, zero.Pool)
	}
	book := st.book(st.cluster.snapshot(benchT0))
	wantG := st.guarantees(book)
	want := st.victimsOf(wantG)
	g, got := st.preemptInputs(book)
	if !reflect.DeepEqual(g.staying, wantG.staying) || !reflect.DeepEqual(g.spare, wantG.spare) {
		t.Fatalf("staying %v\n want %v\nspare %v\n want %v", g.staying, wantG.staying, g.spare, wantG.spare)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("running differs (%d vs %d)", len(got), len(want))
	}
	if sp, ok := g.spare[zero]; !ok || sp != 0 {
		t.Fatalf("spare of %v: %d, %v; want 0, true", zero, sp, ok)
	}
}
