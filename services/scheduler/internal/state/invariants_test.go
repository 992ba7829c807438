package state

import (
	"fmt"
	"math/rand/v2"
	"slices"
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
// After every cycle it checks that evictions pay off (issue 18): no
// allocation is preempted but those a decision of the cycle chose, no
// decision takes another tenant below its guarantee, and a preemptor is
// placed on the devices its decision freed (unless a drain or hold took
// them meanwhile).
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
	guarantees := map[string]int64{} // milli-GPU, in each pool
	for _, tn := range tenants[:2] {
		m := float64(1 + rng.IntN(4))
		maxes[tn] = m
		g := rng.IntN(2)
		guarantees[tn] = int64(g) * 1000
		h.st.ApplyQuota(tn, &contracts.TenantQuota{Pools: map[string]contracts.PoolQuota{
			contracts.QuotaAllPools: {Guarantee: float64(g), Max: &m}}})
	}
	ref := refLedger{byID: map[string]contracts.Allocation{}}
	var pending []contracts.Allocation // plan items not answered yet
	var live []contracts.Allocation    // committed, not released
	seen := 0
	jobN := 0
	held := map[string]bool{} // GPUs under a hold: no new proposal may name one
	pay := payoff{guarantees: guarantees, claims: map[string]claimed{}, preempted: map[string]bool{}, since: map[string]int{}}
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
			cmds := len(h.commands)
			res := h.cycle()
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
			pay.check(t, step, h, res, h.plans[seen:], h.commands[cmds:], pending, live)
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
			pay.disturbed()
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

// payoff checks, cycle after cycle, that evictions pay off.
type payoff struct {
	guarantees map[string]int64
	// claims are the open decisions by preemptor key: the devices it is
	// to take, until its next plan item.
	claims map[string]claimed
	// preempted are the allocations ever chosen as victims.
	preempted map[string]bool
	// since is, per allocation ID, how many commands had been sent when
	// its latest plan item was proposed: an ID comes again in a retried
	// gang's plan, and the commands to its earlier incarnation do not
	// stop this one.
	since map[string]int
}

type claimed struct {
	attempt   int
	devices   []string
	disturbed bool // a drain or hold since: the devices may be gone
}

func (p *payoff) disturbed() {
	for k, c := range p.claims {
		c.disturbed = true
		p.claims[k] = c
	}
}

func deviceKeys(devs []contracts.DeviceRef) []string {
	var out []string
	for _, d := range devs {
		k := d.UUID
		if d.MIG != nil {
			k += "/" + d.MIG.UUID
		}
		if d.Share != nil {
			k += fmt.Sprintf("/share:%d:%d", d.Share.MemoryMiB, d.Share.ComputePercent)
		}
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func (p *payoff) check(t *testing.T, step int, h *harness, res CycleResult, plans []contracts.Plan, cmds []contracts.NodeCommand,
	pending, live []contracts.Allocation) {
	t.Helper()
	// A preemptor placed goes where its decision said.
	for _, pl := range plans {
		byJob := map[string][]contracts.DeviceRef{}
		attempt := map[string]int{}
		for _, a := range pl.Items {
			byJob[Key(a.Tenant, a.JobID)] = append(byJob[Key(a.Tenant, a.JobID)], a.Devices...)
			attempt[Key(a.Tenant, a.JobID)] = a.Attempt
		}
		for key, devs := range byJob {
			c, ok := p.claims[key]
			if !ok || c.attempt != attempt[key] {
				continue
			}
			delete(p.claims, key)
			if got := deviceKeys(devs); !c.disturbed && !slices.Equal(got, c.devices) {
				t.Fatalf("step %d: preemptor %s placed on %v, its victims freed %v", step, key, got, c.devices)
			}
		}
	}
	chosen := map[string]bool{}
	for _, d := range res.Preempted {
		key := Key(d.Tenant, d.JobID)
		var devs []contracts.DeviceRef
		for _, part := range d.Parts {
			devs = append(devs, part.Devices...)
		}
		p.claims[key] = claimed{attempt: h.st.jobs[key].Attempt, devices: deviceKeys(devs)}
		for _, v := range d.Victims {
			chosen[v] = true
			p.preempted[v] = true
		}
	}
	// Nothing is evicted for a preemptor but the set chosen.
	for _, c := range cmds {
		if c.Reason == contracts.ReasonPreempted && !p.preempted[c.AllocationID] {
			t.Fatalf("step %d: %s preempted, chosen by no decision (%+v)", step, c.AllocationID, res.Preempted)
		}
	}
	// No tenant is taken below its guarantee by another's preemptor: what
	// it keeps (committed or in flight, not being stopped, plus what is
	// claimed for its own preemptors) is at least its guarantee.
	for _, pl := range plans {
		for _, a := range pl.Items {
			p.since[a.ID] = len(h.commands)
		}
	}
	leaving := map[string]bool{}
	for i, c := range h.commands {
		if i >= p.since[c.AllocationID] {
			leaving[c.AllocationID] = true
		}
	}
	staying := map[[2]string]int64{}
	for _, a := range append(slices.Clone(live), pending...) {
		if !leaving[a.ID] {
			staying[[2]string{a.Tenant, a.Pool}] += milliOf(&a)
		}
	}
	for key, cl := range h.st.cluster.claims {
		if j := h.st.jobs[key]; j != nil && j.Request != nil {
			for _, part := range cl.parts {
				staying[[2]string{cl.tenant, part.Pool}] += j.Request.Resources.GPU.MilliGPUs() / int64(len(cl.parts))
			}
		}
	}
	byID := map[string]contracts.Allocation{}
	for _, a := range live {
		byID[a.ID] = a
	}
	// Decision by decision: a tenant's own preemptor may take it below
	// its guarantee, another's never. staying is after all of them: go
	// back to before the first (its victims stayed, its claim was not).
	claimOf := func(d Preemption) map[[2]string]int64 {
		out := map[[2]string]int64{}
		j := h.st.jobs[Key(d.Tenant, d.JobID)]
		for _, part := range d.Parts {
			out[[2]string{d.Tenant, part.Pool}] += j.Request.Resources.GPU.MilliGPUs() / int64(len(d.Parts))
		}
		return out
	}
	for _, d := range res.Preempted {
		for _, id := range d.Victims {
			v, ok := byID[id]
			if !ok {
				t.Fatalf("step %d: victim %s is not a committed allocation", step, id)
			}
			staying[[2]string{v.Tenant, v.Pool}] += milliOf(&v)
		}
		for k, n := range claimOf(d) {
			staying[k] -= n
		}
	}
	for _, d := range res.Preempted {
		for _, id := range d.Victims {
			v := byID[id]
			staying[[2]string{v.Tenant, v.Pool}] -= milliOf(&v)
		}
		for k, n := range claimOf(d) {
			staying[k] += n
		}
		for _, id := range d.Victims {
			v := byID[id]
			g := p.guarantees[v.Tenant]
			if v.Tenant == d.Tenant || g == 0 {
				continue
			}
			if n := staying[[2]string{v.Tenant, v.Pool}]; n < g {
				t.Fatalf("step %d: %s/%s evicted %s of tenant %s, which keeps %d milli-GPU in pool %s, guarantee %d",
					step, d.Tenant, d.JobID, id, v.Tenant, n, v.Pool, g)
			}
		}
	}
}
