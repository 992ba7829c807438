package preempt

import (
	"slices"
	"time"
)

// facts are what judging a running allocation for a preemptor reads of it,
// kept by the fleet in arrays of their own: a steady cycle judges ~38,000
// allocations for each of its preemptors, and reading them off the Running
// values (~200 bytes apart, the tenant a string compared per allocation,
// the devices summed again per preemptor) was most of each judgement. The
// answers are refJudge's (the test's reference: eligibleRank and spend on
// the Running values); TestJudgeUnitsAsReference compares.
type facts struct {
	tenant  []int32 // per running: index into tenants
	tp      []int32 // per running: index into tps (its tenant and pool)
	milli   []int64 // per running: its devices' milli-GPUs
	borrow  []bool  // per running: Borrowing
	gang    []bool  // per running: Gang != ""
	tenants []string
	tps     []TenantPool
	// young is, per running, a started job younger than minRuntime at
	// now (not evictable); made for the last (now, minRuntime) asked.
	young              []bool
	youngNow           time.Time
	youngMin           time.Duration
	youngOK            bool
	tenantIdx          map[string]int32
	lastTenant, lastTP int32
}

// gatherFacts fills f.facts from f.running. Allocations come by ID, so one
// tenant's come together, mostly in one pool: the previous one's tenant and
// pool are compared before any map is asked.
func (f *Fleet) gatherFacts() {
	n := len(f.running)
	fc := &f.facts
	fc.tenant, fc.tp = make([]int32, n), make([]int32, n)
	fc.milli, fc.borrow, fc.gang = make([]int64, n), make([]bool, n), make([]bool, n)
	fc.tenantIdx = map[string]int32{}
	tpIdx := map[TenantPool]int32{}
	fc.lastTenant, fc.lastTP = -1, -1
	for i := range f.running {
		v := &f.running[i]
		t := fc.lastTenant
		if t < 0 || fc.tenants[t] != v.Tenant {
			var ok bool
			if t, ok = fc.tenantIdx[v.Tenant]; !ok {
				t = int32(len(fc.tenants))
				fc.tenants = append(fc.tenants, v.Tenant)
				fc.tenantIdx[v.Tenant] = t
			}
			fc.lastTenant = t
		}
		fc.tenant[i] = t
		k := fc.lastTP
		if k < 0 || fc.tps[k].Tenant != v.Tenant || fc.tps[k].Pool != v.Pool {
			key := TenantPool{v.Tenant, v.Pool}
			var ok bool
			if k, ok = tpIdx[key]; !ok {
				k = int32(len(fc.tps))
				fc.tps = append(fc.tps, key)
				tpIdx[key] = k
			}
			fc.lastTP = k
		}
		fc.tp[i] = k
		var m int64
		for _, d := range v.Devices {
			m += d.MilliGPUs()
		}
		fc.milli[i] = m
		fc.borrow[i] = v.Borrowing
		fc.gang[i] = v.Gang != ""
	}
}

// youngAt is, per running, whether it is a started job younger than
// minRuntime at now: eligibleRank's first test, the same for every
// preemptor of a cycle.
func (f *Fleet) youngAt(now time.Time, minRuntime time.Duration) []bool {
	fc := &f.facts
	if fc.youngOK && fc.youngNow == now && fc.youngMin == minRuntime {
		return fc.young
	}
	if fc.young == nil {
		fc.young = make([]bool, len(f.running))
	}
	for i := range f.running {
		v := &f.running[i]
		fc.young[i] = !v.StartedAt.IsZero() && now.Sub(v.StartedAt) < minRuntime
	}
	fc.youngNow, fc.youngMin, fc.youngOK = now, minRuntime, true
	return fc.young
}

// judge is eligibleRank and spend for every running allocation not gone,
// in running order (budgets are numbered by first use), off the fleet's
// facts.
func (c *chooser) judge(f *Fleet, gone []bool) {
	fc := &f.facts
	young := f.youngAt(c.opt.Now, c.opt.MinRuntime)
	own, ok := fc.tenantIdx[c.req.Tenant]
	if !ok {
		own = -1 // no running allocation is the preemptor's tenant's
	}
	spends := c.opt.Spare != nil && !c.opt.Defragment
	// budget is, per tenant-and-pool index, its budget's index, -1 for
	// none (no guarantee there), -2 not asked yet.
	var budget []int32
	if spends {
		budget = make([]int32, len(fc.tps))
		for k := range budget {
			budget[k] = -2
		}
	}
	pr := c.priRank
	for i := range c.running {
		u := c.unitOf[i]
		if gone[u] {
			continue
		}
		mine := fc.tenant[i] == own
		if c.eligible[u] {
			var ok bool
			switch vr := f.rank[i]; {
			case young[i]:
			case c.opt.Defragment:
				ok = !fc.gang[i]
			case vr < pr && (mine || fc.borrow[i]):
				ok = true
			default:
				ok = c.reclaim && fc.borrow[i] && !mine && vr <= pr
			}
			c.eligible[u] = ok
		}
		if !spends || mine {
			continue
		}
		k := fc.tp[i]
		b := budget[k]
		if b == -2 {
			b = -1
			if limit, has := c.opt.Spare[fc.tps[k]]; has {
				b = int32(len(c.budgets))
				c.budgets = append(c.budgets, max(limit, 0))
			}
			budget[k] = b
		}
		if b < 0 {
			continue
		}
		if c.spends == nil {
			c.spends = make([][]budgetUse, len(c.units))
		}
		c.addSpend(u, int(b), fc.milli[i])
	}
}

// addSpend adds m milli-GPUs of budget b to what evicting unit u spends.
func (c *chooser) addSpend(u, b int, m int64) {
	uses := c.spends[u]
	for i := range uses {
		if uses[i].b == b {
			uses[i].milli += m
			return
		}
	}
	c.spends[u] = append(uses, budgetUse{b, m})
}

// JobRef names a job by tenant and ID.
type JobRef struct{ Tenant, JobID string }

// RemoveJobs is Remove of every running allocation of the jobs named: a
// decision's victims' jobs. An allocation's tenant is compared as the
// fleet's index first, so only the named tenants' allocations are read
// (a cycle removes a few jobs from ~38,000 allocations per decision).
func (f *Fleet) RemoveJobs(jobs []JobRef) {
	fc := &f.facts
	tenants := make([]int32, 0, len(jobs))
	for _, jr := range jobs {
		if t, ok := fc.tenantIdx[jr.Tenant]; ok && !slices.Contains(tenants, t) {
			tenants = append(tenants, t)
		}
	}
	if len(tenants) == 0 {
		return // nothing running is theirs
	}
	f.removeIdx(func(i int) bool {
		if !slices.Contains(tenants, fc.tenant[i]) {
			return false
		}
		v := &f.running[i]
		return slices.ContainsFunc(jobs, func(jr JobRef) bool { return jr.Tenant == v.Tenant && jr.JobID == v.JobID })
	})
}
