package preempt

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// refJudge is judge as it was written on the Running values (eligibleRank
// and spend, with their budget map and look-up memo): the reference
// TestJudgeUnitsAsReference holds the fleet's facts to.
type refJudge struct {
	c        *chooser
	eligible []bool
	spends   [][]budgetUse
	budgets  []int64
	budgetOf map[TenantPool]int
	last     struct {
		key     TenantPool
		b       int
		has, ok bool
	}
}

func (r *refJudge) eligibleRank(v *Running, vr int) bool {
	c := r.c
	if !v.StartedAt.IsZero() && c.opt.Now.Sub(v.StartedAt) < c.opt.MinRuntime {
		return false
	}
	if c.opt.Defragment {
		return v.Gang == ""
	}
	pr := c.priRank
	own := v.Tenant == c.req.Tenant
	if vr < pr && (own || v.Borrowing) {
		return true
	}
	return c.reclaim && v.Borrowing && !own && vr <= pr
}

func (r *refJudge) spend(u int, v *Running) {
	c := r.c
	if c.opt.Spare == nil || c.opt.Defragment || v.Tenant == c.req.Tenant {
		return
	}
	key := TenantPool{v.Tenant, v.Pool}
	var b int
	if l := &r.last; l.ok && l.key == key {
		if !l.has {
			return
		}
		b = l.b
	} else {
		var ok bool
		b, ok = r.budgetOf[key]
		if !ok {
			limit, has := c.opt.Spare[key]
			if !has {
				l.key, l.has, l.ok = key, false, true
				return
			}
			if r.budgetOf == nil {
				r.budgetOf = map[TenantPool]int{}
			}
			b = len(r.budgets)
			r.budgetOf[key] = b
			r.budgets = append(r.budgets, max(limit, 0))
		}
		l.key, l.b, l.has, l.ok = key, b, true, true
	}
	var m int64
	for _, d := range v.Devices {
		m += d.MilliGPUs()
	}
	if r.spends == nil {
		r.spends = make([][]budgetUse, len(c.units))
	}
	uses := r.spends[u]
	for i := range uses {
		if uses[i].b == b {
			uses[i].milli += m
			return
		}
	}
	r.spends[u] = append(uses, budgetUse{b, m})
}

// run judges every unit not gone, in running order, as judgeUnits did.
func (r *refJudge) run(f *Fleet, gone []bool) {
	c := r.c
	r.eligible = make([]bool, len(c.units))
	for u := range r.eligible {
		r.eligible[u] = !gone[u]
	}
	for i := range c.running {
		u := c.unitOf[i]
		if gone[u] {
			continue
		}
		v := &c.running[i]
		r.eligible[u] = r.eligible[u] && r.eligibleRank(v, f.rank[i])
		r.spend(u, v)
	}
}

// TestJudgeUnitsAsReference: per unit, eligibility and what evicting it
// spends of which budget (budgets numbered by first use) are the
// reference's, for random fleets (tenants interleaving pools, gangs,
// borrowers, jobs started before and after now, devices whole, shared and
// MIG) and preemptors of every class, tenant (one with nothing running
// included), reclaim, defragment, budgets or none, and two times over one
// fleet (the young list made again for the second).
func TestJudgeUnitsAsReference(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	pris := []contracts.Priority{contracts.PriorityBestEffort, contracts.PriorityNormal, contracts.PriorityHigh,
		contracts.PriorityCritical, ""}
	tenants := []string{"a", "b", "c", "dd"}
	pools := []string{"p1", "p2", ""}
	for seed := range uint64(300) {
		rng := rand.New(rand.NewPCG(seed, 77))
		var running []Running
		n := rng.IntN(60)
		for i := range n {
			v := Running{AllocationID: fmt.Sprintf("x%03d", i), Tenant: tenants[rng.IntN(len(tenants))],
				JobID: fmt.Sprintf("j%03d", i), NodeID: fmt.Sprintf("n%d", rng.IntN(5)), Pool: pools[rng.IntN(len(pools))],
				Priority: pris[rng.IntN(len(pris))], Borrowing: rng.IntN(2) == 0}
			if i > 0 && rng.IntN(3) == 0 { // the previous one's tenant: runs of one tenant
				v.Tenant = running[i-1].Tenant
			}
			if rng.IntN(4) > 0 {
				v.StartedAt = t0.Add(time.Duration(rng.IntN(40)-10) * time.Minute)
			}
			if rng.IntN(5) == 0 {
				v.Gang = "g" + fmt.Sprint(rng.IntN(4))
			}
			for range rng.IntN(3) {
				d := contracts.DeviceRef{UUID: "GPU"}
				switch rng.IntN(3) {
				case 1:
					d.Share = &contracts.GPUShare{MemoryMiB: 1000, ComputePercent: 1 + rng.IntN(100)}
				case 2:
					d.MIG = &contracts.MIGInstance{Profile: "1g.10gb"}
				}
				v.Devices = append(v.Devices, d)
			}
			running = append(running, v)
		}
		nodes := []placement.Node{{ID: "n0"}, {ID: "n1"}, {ID: "n2"}, {ID: "n3"}, {ID: "n4"}}
		f := NewFleet(placement.Snapshot{Nodes: nodes}, running, t0)
		gone := make([]bool, len(f.units))
		for u := range gone {
			gone[u] = rng.IntN(5) == 0
		}
		for search := range 8 {
			opt := Options{Now: t0, MinRuntime: time.Duration(rng.IntN(20)) * time.Minute,
				Defragment: rng.IntN(6) == 0}
			if search >= 4 {
				opt.Now = t0.Add(time.Duration(rng.IntN(20)) * time.Minute)
			}
			if rng.IntN(3) > 0 {
				opt.Spare = map[TenantPool]int64{}
				for _, tn := range tenants {
					for _, p := range pools {
						if rng.IntN(2) == 0 {
							opt.Spare[TenantPool{tn, p}] = int64(rng.IntN(4000) - 500)
						}
					}
				}
			}
			tenant := tenants[rng.IntN(len(tenants))]
			if rng.IntN(8) == 0 {
				tenant = "nobody"
			}
			p := Preemptor{Request: placement.Request{Tenant: tenant, GPU: contracts.GPURequest{Count: 1}},
				Priority: pris[rng.IntN(len(pris))], Reclaim: rng.IntN(2) == 0}
			c, ok := f.newChooser(p, opt, gone)
			if !ok {
				t.Fatalf("seed %d: no chooser", seed)
			}
			ref := &refJudge{c: &chooser{running: c.running, units: c.units, unitOf: c.unitOf, req: c.req, opt: opt,
				priRank: c.priRank, reclaim: c.reclaim}}
			ref.run(f, gone)
			// judgeUnits then drops the units that alone overspend: so
			// does the reference here.
			for u, uses := range ref.spends {
				for _, use := range uses {
					if use.milli > ref.budgets[use.b] {
						ref.eligible[u] = false
					}
				}
			}
			if !reflect.DeepEqual(c.eligible, ref.eligible) {
				t.Fatalf("seed %d search %d: eligible\n %v\nwant %v", seed, search, c.eligible, ref.eligible)
			}
			if !reflect.DeepEqual(c.spends, ref.spends) || !reflect.DeepEqual(c.budgets, ref.budgets) {
				t.Fatalf("seed %d search %d: spends %v budgets %v\nwant %v %v", seed, search, c.spends, c.budgets,
					ref.spends, ref.budgets)
			}
		}
	}
}
