package state

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestRandomOperationsKeepG1AndQ1 drives the store with random operation
// sequences (submits of every request kind, quotas, cycles, commits and
// refusals in any order, runs that start and end, preemptions, releases)
// and checks after every step, over everything committed or in flight:
// G1, no GPU, MIG instance or part of a card is given twice (shares never
// sum past one card); and Q1, no tenant holds more than its quota's max in
// a pool. The resource manager is played by a reference ledger that
// commits an item only when it fits, so any overlap is the scheduler's.
func TestRandomOperationsKeepG1AndQ1(t *testing.T) {
	seeds := 2000
	if testing.Short() || raceEnabled {
		seeds = 200
	}
	for seed := range seeds {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			t.Parallel()
			runInvariantSeed(t, uint64(seed))
		})
	}
}

type refLedger struct {
	byID map[string]contracts.Allocation // committed
}

func runInvariantSeed(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 42))
	h := newHarness(t, func(c *Config) {
		c.MinRuntime = time.Duration(rng.IntN(2)) * time.Minute
		c.Policy = contracts.PlacementPolicies[rng.IntN(len(contracts.PlacementPolicies))]
	})
	// Nodes: whole-GPU machines and one with MIG instances.
	nodes := 2 + rng.IntN(3)
	for i := range nodes {
		id := fmt.Sprintf("n%d", i)
		inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: id, Pool: []string{"p", "q"}[i%2], Incarnation: "i1",
			Time: h.now, CPUMilli: 64000, MemoryMiB: 512 * 1024}
		for g := range 2 + rng.IntN(3) {
			gi := contracts.GPUInfo{Index: g, UUID: fmt.Sprintf("%s-gpu%d", id, g), Model: "A100-80GB",
				MemoryMiB: 81920, Healthy: true, NVLinkDomain: id + "-nvl"}
			if i == 0 && g == 0 {
				gi.MIGEnabled = true
				for k, start := range []int{0, 1, 2, 3} {
					gi.MIGInstances = append(gi.MIGInstances, contracts.MIGInstance{UUID: fmt.Sprintf("MIG-%s-%d", id, k),
						Profile: "1g.10gb", GIID: k + 1, Start: start, Size: 1, MemoryMiB: 9856})
				}
			}
			inv.GPUs = append(inv.GPUs, gi)
		}
		h.fact(func(s *Store) []Publish { s.ApplyInventory(inv); return nil })
	}
	tenants := []string{"a", "b", "c"}
	maxes := map[string]float64{}
	for _, tn := range tenants[:2] {
		m := float64(1 + rng.IntN(4))
		maxes[tn] = m
		h.st.ApplyQuota(tn, &contracts.TenantQuota{Pools: map[string]contracts.PoolQuota{
			contracts.QuotaAllPools: {Guarantee: float64(rng.IntN(2)), Max: &m}}})
	}
	ref := refLedger{byID: map[string]contracts.Allocation{}}
	var pending []contracts.Allocation // plan items not answered yet
	var live []contracts.Allocation    // committed, not released
	seen := 0
	jobN := 0
	held := map[string]bool{} // GPUs under a hold: no new proposal may name one
	for step := range 150 {
		switch op := rng.IntN(10); {
		case op < 3:
			jobN++
			r := job(fmt.Sprintf("j%d", jobN), 1+rng.IntN(3), "any")
			switch rng.IntN(5) {
			case 0:
				r.Resources.GPU = contracts.GPURequest{Count: 1, MIGProfile: "1g.10gb"}
			case 1:
				r.Resources.GPU = contracts.GPURequest{Count: 1, Share: &contracts.GPUShare{MemoryMiB: int64(1 + rng.IntN(40000)), ComputePercent: 1 + rng.IntN(60)}}
			case 2:
				r.Resources.GPU.Count, r.Resources.GPU.Nodes = 2, 2
			}
			r.Priority = contracts.Priorities[rng.IntN(len(contracts.Priorities))]
			r.Run.Checkpoint = rng.IntN(2) == 0
			r.Resources.CPUMilli = int64(rng.IntN(8000))
			h.submit(tenants[rng.IntN(len(tenants))], r)
		case op < 5:
			h.cycle()
			for _, p := range h.plans[seen:] {
				pending = append(pending, p.Items...)
				for _, a := range p.Items {
					for _, d := range a.Devices {
						if held[d.UUID] {
							t.Fatalf("step %d: %s proposed on held GPU %s", step, a.ID, d.UUID)
						}
					}
				}
			}
			seen = len(h.plans)
			checkProposals(t, step, pending, live)
		case op < 7 && len(pending) > 0:
			i := rng.IntN(len(pending))
			a := pending[i]
			pending = append(pending[:i], pending[i+1:]...)
			if reason, ok := ref.fits(a); ok && rng.IntN(6) > 0 {
				ref.byID[a.ID] = a
				live = append(live, a)
				h.commit(a)
			} else {
				if reason == "" {
					reason = contracts.RefusedCommitConflict
				}
				h.refuse(a, reason)
			}
		case op < 9 && len(live) > 0:
			i := rng.IntN(len(live))
			a := live[i]
			if rng.IntN(2) == 0 {
				h.started(a, h.now)
				break
			}
			if rng.IntN(3) == 0 {
				h.checkpointed(a, fmt.Sprintf("c%d", step), rng.IntN(2) == 0)
				break
			}
			live = append(live[:i], live[i+1:]...)
			delete(ref.byID, a.ID)
			outcome := contracts.OutcomeSucceeded
			reason := contracts.ReasonRunEnded
			for _, c := range h.commandsFor(a.ID) {
				if c.Kind == contracts.CommandStopRun {
					outcome, reason = contracts.OutcomeCancelled, c.Reason
				}
			}
			h.ended(a, contracts.RunResult{Outcome: outcome, Reason: reason, StartedAt: h.now, EndedAt: h.now})
			h.release(a, contracts.ReasonRunEnded, nil)
		case rng.IntN(3) == 0:
			// The platform's holds and alerts: a spot notice drains a
			// node, an alert holds one GPU, or a pool is fragmented.
			node := fmt.Sprintf("n%d", rng.IntN(nodes))
			switch rng.IntN(4) {
			case 0:
				deadline := h.now.Add(2 * time.Minute)
				h.st.ApplyNodeAdmin(node, &contracts.NodeAdmin{NodeID: node, Cordoned: true, Drain: true,
					Cause: contracts.ReasonSpotInterruption, Deadline: &deadline})
				for g := range 5 {
					held[fmt.Sprintf("%s-gpu%d", node, g)] = true
				}
			case 1:
				uuid := fmt.Sprintf("%s-gpu%d", node, rng.IntN(2))
				h.st.ApplyNodeAdmin(node, &contracts.NodeAdmin{NodeID: node, GPUs: map[string]contracts.GPUHold{
					uuid: {Cordoned: true, Drain: true, Cause: contracts.ReasonOverheating}}})
				for g := range 5 {
					delete(held, fmt.Sprintf("%s-gpu%d", node, g))
				}
				held[uuid] = true
			case 2:
				h.st.ApplyNodeAdmin(node, nil)
				for g := range 5 {
					delete(held, fmt.Sprintf("%s-gpu%d", node, g))
				}
			default:
				h.st.ApplyDefrag([]string{"p", "q"}[rng.IntN(2)], "frag", rng.IntN(2) == 0)
			}
		default:
			h.now = h.now.Add(time.Duration(rng.IntN(90)) * time.Second)
		}
		checkQuotas(t, step, maxes, pending, live)
	}
}

// fits is the resource manager's check, on the reference ledger.
func (l refLedger) fits(a contracts.Allocation) (contracts.Reason, bool) {
	items := make([]contracts.Allocation, 0, len(l.byID)+1)
	for _, b := range l.byID {
		items = append(items, b)
	}
	if err := exclusive(append(items, a)); err != nil {
		return contracts.RefusedDeviceTaken, false
	}
	return "", true
}

// exclusive checks G1 over a set of allocations.
func exclusive(allocs []contracts.Allocation) error {
	whole := map[string]string{}
	mig := map[string]string{}
	sharePct := map[string]int{}
	shareMem := map[string]int64{}
	parted := map[string]string{}
	for _, a := range allocs {
		for _, d := range a.Devices {
			switch {
			case d.MIG != nil:
				if other, ok := mig[d.MIG.UUID]; ok {
					return fmt.Errorf("MIG instance %s given to %s and %s", d.MIG.UUID, other, a.ID)
				}
				mig[d.MIG.UUID] = a.ID
				parted[d.UUID] = a.ID
			case d.Share != nil:
				sharePct[d.UUID] += d.Share.ComputePercent
				shareMem[d.UUID] += d.Share.MemoryMiB
				if sharePct[d.UUID] > 100 || shareMem[d.UUID] > 81920 {
					return fmt.Errorf("shares of %s sum to %d%% and %d MiB (last %s)", d.UUID, sharePct[d.UUID], shareMem[d.UUID], a.ID)
				}
				parted[d.UUID] = a.ID
			default:
				if other, ok := whole[d.UUID]; ok {
					return fmt.Errorf("GPU %s given to %s and %s", d.UUID, other, a.ID)
				}
				whole[d.UUID] = a.ID
			}
		}
	}
	for uuid, id := range whole {
		if other, ok := parted[uuid]; ok {
			return fmt.Errorf("GPU %s given whole to %s and in part to %s", uuid, id, other)
		}
	}
	return nil
}

func checkProposals(t *testing.T, step int, pending, live []contracts.Allocation) {
	t.Helper()
	if err := exclusive(append(append([]contracts.Allocation{}, live...), pending...)); err != nil {
		t.Fatalf("step %d: G1 broken by the scheduler's proposals: %v", step, err)
	}
}

func checkQuotas(t *testing.T, step int, maxes map[string]float64, pending, live []contracts.Allocation) {
	t.Helper()
	// The quotas are set for QuotaAllPools: the max applies in each pool.
	held := map[[2]string]int64{}
	for _, a := range append(append([]contracts.Allocation{}, live...), pending...) {
		held[[2]string{a.Tenant, a.Pool}] += milliOf(&a)
	}
	for k, n := range held {
		if m, ok := maxes[k[0]]; ok && n > int64(m*1000) {
			for _, a := range append(append([]contracts.Allocation{}, live...), pending...) {
				t.Logf("held: %s in %s on %s: %v", a.ID, a.Pool, a.NodeID, a.Devices)
			}
			t.Fatalf("step %d: Q1 broken: tenant %s holds %d milli-GPU in pool %s, max %g GPUs", step, k[0], n, k[1], m)
		}
	}
}
