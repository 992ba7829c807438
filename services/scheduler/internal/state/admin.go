package state

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/backfill"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/fairshare"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/preempt"
)

// ---- administrators' settings (KV buckets) ----

// ApplyQuota records tenant's quota; nil removes it. It applies from the
// next cycle.
func (s *Store) ApplyQuota(tenant string, q *contracts.TenantQuota) {
	if q == nil {
		delete(s.quotas, tenant)
	} else {
		s.quotas[tenant] = *q
	}
	s.cfg.Wake()
}

// ApplyPoolConfig records a pool's configuration; nil removes it.
func (s *Store) ApplyPoolConfig(pool string, c *contracts.PoolConfig) {
	if c == nil {
		delete(s.pools, pool)
	} else {
		s.pools[pool] = *c
	}
	s.cfg.Wake()
}

// ApplyNodeAdmin records an administrator's cordon or drain of a node; nil
// lifts it.
func (s *Store) ApplyNodeAdmin(node string, a *contracts.NodeAdmin) {
	s.cluster.node(node).admin = a
	s.cfg.Wake()
}

// policyFor is the placement policy of pool.
func (s *Store) policyFor(pool string) contracts.PlacementPolicy {
	if c, ok := s.pools[pool]; ok && c.Policy.Valid() {
		return c.Policy
	}
	return s.cfg.Policy
}

// workload keeps the most recent requests: the mix the fragmentation-aware
// policy keeps room for.
type workload struct {
	reqs []contracts.GPURequest
	next int
}

const workloadSize = 512

func (w *workload) add(r contracts.GPURequest) {
	if len(w.reqs) < workloadSize {
		w.reqs = append(w.reqs, r)
		return
	}
	w.reqs[w.next] = r
	w.next = (w.next + 1) % workloadSize
}

func (w *workload) requests() []contracts.GPURequest { return w.reqs }

// book is the cycle's quota and fair-share ledger: cluster capacity, and
// what every tenant holds (committed and in flight) per pool.
func (s *Store) book(snap placement.Snapshot) *fairshare.Book {
	var capacity fairshare.Usage
	for _, n := range snap.Nodes {
		capacity.MilliGPU += int64(len(n.GPUs)) * 1000
		if inv := s.cluster.nodes[n.ID].inv; inv != nil {
			capacity.CPUMilli += inv.CPUMilli
			capacity.MemoryMiB += inv.MemoryMiB
		}
	}
	b := fairshare.NewBook(capacity, s.quotas)
	for tenant, stamp := range s.served {
		b.Served(tenant, stamp)
	}
	hold := func(a *contracts.Allocation) {
		b.Hold(a.Tenant, a.Pool, fairshare.Usage{MilliGPU: milliOf(a), CPUMilli: a.CPUMilli, MemoryMiB: a.MemoryMiB})
	}
	for _, ref := range s.committed() {
		hold(ref.a)
	}
	for _, a := range s.cluster.plans {
		hold(a)
	}
	// What is claimed for a preemptor is its tenant's already: no other
	// job of the tenant may take the quota it needs.
	for key, cl := range s.cluster.claims {
		if j := s.jobs[key]; j != nil && j.Request != nil {
			per := j.Request.Resources.GPU.MilliGPUs() / int64(max(len(cl.parts), 1))
			for _, p := range cl.parts {
				b.Hold(cl.tenant, p.Pool, fairshare.Usage{MilliGPU: per, CPUMilli: cl.cpuMilli, MemoryMiB: cl.memoryMiB})
			}
		}
	}
	return b
}

// drain moves every job off the nodes held with a drain (an
// administrator's, or the autoscaler's on a spot interruption notice, with
// its cause and reclaim deadline), off single GPUs held with a drain (the
// monitor's overheating and unhealthy-GPU alerts, through the scheduler's
// alert consumer), and off GPUs their node's latest inventory reports
// unhealthy (an XID, a double-bit ECC error, a card that fell off the bus).
// Each such job migrates: checkpointed when it can, stopped, and requeued
// as its next attempt elsewhere.
func (s *Store) drain(now time.Time) {
	for _, id := range s.cluster.ids {
		n := s.cluster.nodes[id]
		admin := n.admin
		drained := admin != nil && admin.Drain
		var sick map[string]bool
		if n.inv != nil {
			for _, g := range n.inv.GPUs {
				if !g.Healthy {
					if sick == nil {
						sick = map[string]bool{}
					}
					sick[g.UUID] = true
				}
			}
		}
		if !drained && sick == nil && (admin == nil || len(admin.GPUs) == 0) {
			continue
		}
		for _, a := range n.held {
			j := s.jobs[Key(a.Tenant, a.JobID)]
			if j == nil || j.Attempt != a.Attempt || j.State.Terminal() || j.evict != "" || j.cancel {
				continue
			}
			if p := j.part(a.ID); p == nil || !p.committed || p.done() {
				continue
			}
			if m, ok := s.moveFor(id, n, a, sick); ok {
				s.evictJob(j, m)
			}
		}
	}
}

// moveFor says whether allocation a on node id must move, and why: the
// node's drain first (it takes every device), then an unhealthy GPU, then
// a GPU's own hold.
func (s *Store) moveFor(id string, n *nodeState, a *contracts.Allocation, sick map[string]bool) (move, bool) {
	admin := n.admin
	if admin != nil && admin.Drain {
		m := move{reason: contracts.ReasonDrained, msg: fmt.Sprintf("node %s is drained by an administrator", id),
			triggered: admin.Time}
		if admin.Cause != "" {
			m.reason = admin.Cause
			m.msg = fmt.Sprintf("node %s is drained (%s)", id, admin.Cause)
		}
		if admin.Reason != "" {
			m.msg += ": " + admin.Reason
		}
		if admin.Deadline != nil {
			m.deadline = *admin.Deadline
		}
		return m, true
	}
	for _, d := range a.Devices {
		if sick[d.UUID] {
			m := move{reason: contracts.ReasonGPUUnhealthy,
				msg: fmt.Sprintf("GPU %s of node %s is unhealthy; moved to healthy devices", d.UUID, id)}
			if n.inv != nil {
				m.triggered = n.inv.Time
			}
			return m, true
		}
	}
	if admin == nil {
		return move{}, false
	}
	for _, d := range a.Devices {
		h, ok := admin.GPUs[d.UUID]
		if !ok || !h.Drain {
			continue
		}
		m := move{reason: cmpReason(h.Cause, contracts.ReasonDrained), triggered: h.Since,
			msg: fmt.Sprintf("GPU %s of node %s is drained (%s)", d.UUID, id, cmpReason(h.Cause, contracts.ReasonDrained))}
		if h.Reason != "" {
			m.msg += ": " + h.Reason
		}
		return m, true
	}
	return move{}, false
}

// preempting reports whether j waits for victims it chose to stop: until
// the ledger releases each victim allocation. A victim's job is requeued
// on its run's end, before the release frees its devices, so the victim
// job's own state cannot tell (its next attempt has no parts yet).
func (s *Store) preempting(j *Job) bool {
	if len(j.moves().victims) == 0 {
		return false
	}
	j.mv.victims = slices.DeleteFunc(j.mv.victims, func(id string) bool {
		_, held := s.cluster.allocs[id]
		return !held
	})
	if len(j.mv.victims) > 0 {
		return true
	}
	j.tidyMoves()
	return false
}

// awaitingRelease returns the allocations of j's previous attempt the
// ledger still holds. A job is requeued when its run ends, before the
// resource manager has released the attempt; planning the next one then
// would only be refused (job_already_allocated: one live attempt per
// job). It is read off the ledger as this store has it, so a rebuilt store
// waits the same way. An attempt before the previous one cannot be live:
// each waited for the release of the one before it.
func (s *Store) awaitingRelease(j *Job) []string {
	if j.Attempt <= 1 || j.Request == nil {
		return nil
	}
	var held []string
	machines := max(j.Request.Resources.GPU.Machines(), 1)
	for rank := range machines {
		id := partID(j.Tenant, j.ID, j.Attempt-1, rank, machines)
		if _, ok := s.cluster.allocs[id]; ok {
			held = append(held, id)
		}
	}
	return held
}

// mayPreempt reports whether j may evict others: a class above
// best-effort (lower classes are its victims), or a tenant under its
// guarantee reclaiming what others borrowed.
func (s *Store) mayPreempt(j *Job, b *fairshare.Book, r placement.Request) bool {
	if j.Request.Priority.Rank() > contracts.PriorityBestEffort.Rank() {
		return true
	}
	return len(s.reclaimPools(j, b, r)) > 0
}

// reclaimPools are the pools where j's tenant, placing j, would still be
// within its guarantee: there it may evict other tenants' borrowed work.
func (s *Store) reclaimPools(j *Job, b *fairshare.Book, r placement.Request) []string {
	pools := s.quotaPools(j, r)
	need := r.GPU.MilliGPUs()
	return slices.DeleteFunc(pools, func(p string) bool { return !b.UnderGuarantee(j.Tenant, p, need) })
}

// quotaPools are the pools, sorted, where j's tenant has a quota that
// could serve r: r's pool when it names one, else every pool of the
// tenant's quota ("*" standing for every pool of the fleet). Nil when the
// tenant has no quota.
func (s *Store) quotaPools(j *Job, r placement.Request) []string {
	q, ok := s.quotas[j.Tenant]
	if !ok {
		return nil
	}
	if r.Pool != "" {
		return []string{r.Pool}
	}
	if _, all := q.Pools[contracts.QuotaAllPools]; all {
		return s.cluster.pools()
	}
	pools := make([]string, 0, len(q.Pools))
	for p := range q.Pools {
		pools = append(pools, p)
	}
	slices.Sort(pools)
	return pools
}

// maxPreemptorsPerCycle bounds the victim searches of one cycle; the next
// cycle serves the rest.
const maxPreemptorsPerCycle = 4

// Preemption is one preemption decided by a cycle: the preemptor, the
// allocations it evicts and where it goes once they are gone (held for it
// meanwhile).
type Preemption struct {
	Tenant, JobID string
	Victims       []string // allocation IDs
	Parts         []placement.Part
}

// preempt chooses victims for jobs that could not be placed, on the
// cluster as it is after this cycle's placements, and stops them (issue
// 18; FLOWS.md, "Preemption"):
//   - priority acts inside the tenant, or on borrowed work: another
//     tenant's work is evicted only beyond its guarantee, however high the
//     preemptor's class (a reclaim likewise never takes a tenant below
//     its own);
//   - the victims are of the lowest classes that make room, then the
//     fewest GPUs and jobs (preempt.Choose);
//   - the devices the preemptor takes are claimed for it at once: until
//     it commits (or gives up) no other job, the victims' next attempts
//     included, is placed on them, and it is placed on them;
//   - a victim's next attempt does not evict, by priority, work that was
//     running when the decision chose it (the decision kept that work),
//     while the preemptor holds what it took.
func (s *Store) preempt(now time.Time, preemptors []miss, b *fairshare.Book) []Preemption {
	snap := s.cluster.snapshot(now)
	g, running := s.preemptInputs(b) // guarantees and victimsOf in one walk
	// Every search of the cycle shares one grouping and pricing of the
	// running allocations; a decision's victims are removed from it.
	fleet := preempt.NewFleet(snap, running, now)
	var out []Preemption
	var (
		base    []keptRef // see kept
		evicted []string
	)
	tried := 0
	for _, m := range preemptors {
		if tried == maxPreemptorsPerCycle {
			break
		}
		tried++
		j := m.j
		// A tenant under its guarantee reclaims in those pools first;
		// then priority alone may evict lower classes.
		var choice preempt.Choice
		ok := false
		opt := preempt.Options{Now: now, MinRuntime: s.cfg.MinRuntime, Spare: g.spare}
		for _, pool := range append(s.reclaimPools(j, b, m.r), "") {
			pr := preempt.Preemptor{Request: m.r, Priority: j.Request.Priority, Reclaim: pool != ""}
			pr.Request.Exclude, pr.Request.Reserved = nil, nil // reservations yield to preemption by rank
			var skip func(*preempt.Running) bool
			if pool != "" {
				pr.Request.Pool = pool
			} else if kept := s.keptFor(j); kept != nil {
				skip = func(r *preempt.Running) bool { return kept[Key(r.Tenant, r.JobID)] }
			}
			if choice, ok = fleet.Choose(pr, opt, skip); ok {
				break
			}
		}
		if !ok || len(choice.Victims) == 0 {
			s.notePreemptionLater(j, m.r, fleet, opt) // when it would find room (waitnote.go)
			continue
		}
		keys := s.evictVictims(j, choice, move{reason: contracts.ReasonPreempted,
			msg: fmt.Sprintf("preempted by %s/%s (priority %s)", j.Tenant, j.ID, j.Request.Priority)}, nil)
		// The work this decision keeps: its victims' next attempts leave
		// it alone while j holds what it took.
		// (Listed lazily, by keptFor: only a victim's next attempt that may
		// preempt asks, and a cycle would otherwise build a map of every
		// running job per decision.)
		if base == nil {
			// running as the cycle's first decision found it: a later
			// decision's is this without the earlier decisions' victims.
			base = make([]keptRef, len(running))
			for i, r := range running {
				base[i] = keptRef{r.Tenant, r.JobID}
			}
		}
		evicted = append(evicted, keys...)
		k := &kept{by: j.key, attempt: j.Attempt, running: base, victims: slices.Clone(evicted)}
		for _, key := range keys {
			s.jobs[key].movesW().kept = k
		}
		g.spend(j, choice)
		// Its claim is its tenant's from now on: a later decision of the
		// cycle must not be admitted into the same quota (book).
		per := j.Request.Resources.GPU.MilliGPUs() / int64(max(len(choice.Parts), 1))
		for _, part := range choice.Parts {
			b.Hold(j.Tenant, part.Pool, fairshare.Usage{MilliGPU: per, CPUMilli: j.Request.Resources.CPUMilli,
				MemoryMiB: j.Request.Resources.MemoryMiB})
		}
		// What it claimed is held for the decisions after it in this cycle
		// too: two must not count on the same free device.
		for _, part := range choice.Parts {
			if i := slices.IndexFunc(snap.Nodes, func(n placement.Node) bool { return n.ID == part.NodeID }); i >= 0 {
				holdOn(&snap.Nodes[i], j.Request.Resources.CPUMilli, j.Request.Resources.MemoryMiB, part.Devices)
			}
		}
		fleet.RemoveJobs(victimJobs(choice)) // every allocation of keys' jobs
		p := Preemption{Tenant: j.Tenant, JobID: j.ID, Parts: choice.Parts}
		for _, v := range choice.Victims {
			p.Victims = append(p.Victims, v.AllocationID)
		}
		out = append(out, p)
		s.setPending(j, placement.Pending{Code: contracts.PendingPreempting,
			Message: choice.Reason + "; waiting for " + strings.Join(keys, ", ") + " to stop"})
		s.log.Info("preempting", "tenant", j.Tenant, "job_id", j.ID, "victims", keys, "why", choice.Reason)
	}
	return out
}

// kept is the work a preemption decision chose to keep, by job key: its
// victims' next attempts may not evict it by priority while the
// preemptor's attempt (by, attempt) is live. Shared by the victims of one
// decision.
type kept struct {
	by      string
	attempt int
	// running are the jobs of the allocations the cycle's first decision
	// considered (shared by the cycle's decisions), victims the jobs it
	// and the decisions before it in the cycle evicted: jobs is every job
	// of running but those, made on first use.
	running []keptRef
	victims []string
	jobs    map[string]bool
}

type keptRef struct{ tenant, id string }

// keptFor is the work j, a victim's next attempt, must leave alone; nil
// when none (or the preemptor that kept it is done with what it took).
func (s *Store) keptFor(j *Job) map[string]bool {
	k := j.moves().kept
	if k == nil {
		return nil
	}
	if by := s.jobs[k.by]; by == nil || by.State.Terminal() || by.Attempt != k.attempt {
		j.mv.kept = nil
		j.tidyMoves()
		return nil
	}
	if k.jobs == nil {
		k.jobs = make(map[string]bool, len(k.running))
		for _, r := range k.running {
			if key := Key(r.tenant, r.id); !slices.Contains(k.victims, key) {
				k.jobs[key] = true
			}
		}
		k.running = nil
	}
	return k.jobs
}

// evictVictims moves every job of the choice's victims for m (a job with
// several victim parts once), makes j wait for their allocations'
// releases rather than choose again, and claims for j the devices the
// choice gives it. avoid, when set, is where the moved jobs must not go
// next. It returns the victim jobs' keys.
func (s *Store) evictVictims(j *Job, choice preempt.Choice, m move, avoid map[string]bool) []string {
	var keys []string
	mv := j.movesW()
	mv.victims = mv.victims[:0]
	for _, v := range choice.Victims {
		mv.victims = append(mv.victims, v.AllocationID)
		key := Key(v.Tenant, v.JobID)
		if slices.Contains(keys, key) {
			continue
		}
		keys = append(keys, key)
		vj := s.jobs[key]
		if avoid != nil {
			vj.movesW().avoid = maps.Clone(avoid)
		}
		s.evictJob(vj, m)
	}
	s.cluster.claims[j.key] = &claim{tenant: j.Tenant, parts: choice.Parts, victims: slices.Clone(mv.victims),
		cpuMilli: j.Request.Resources.CPUMilli, memoryMiB: j.Request.Resources.MemoryMiB}
	return keys
}

// claimed is the decision for j on the devices claimed for it, once its
// victims are gone: exactly those devices, checked again with FitNode on
// each node as it is now without j's claim. ok is false when j has no
// claim; placed is false when the claim no longer fits (a node lost or
// cordoned, a device unhealthy, the quota lowered past it), and the claim
// is then dropped. The claim is in b already (book): the quota is checked
// with nothing more.
func (s *Store) claimed(j *Job, b *fairshare.Book, now time.Time) (d placement.Decision, ok, placed bool) {
	cl := s.cluster.claims[j.key]
	if cl == nil {
		return placement.Decision{}, false, false
	}
	r := s.request(j, 0)
	machines := max(r.Machines(), 1)
	per := r
	per.GPU.Count /= machines
	per.GPU.Nodes = 1
	if per.GPU.Topology == contracts.TopologyZone {
		per.GPU.Topology = contracts.TopologyAny
	}
	per.Exclude, per.ExcludeKey, per.AllowPool = nil, "", nil
	fits := len(cl.parts) == machines
	for _, p := range cl.parts {
		if !fits {
			break
		}
		n, live := s.cluster.nodeSnapshot(p.NodeID, now, j.key)
		if !live || n.Cordoned || !b.Admit(j.Tenant, p.Pool, 0).OK {
			fits = false
			break
		}
		// Only the claimed devices are offered: the cycle's placer counts
		// them held, so nothing else on the node may be taken here.
		var gpus []placement.GPU
		for _, g := range n.GPUs {
			var slots []placement.MIGSlot
			mine := false
			for _, dev := range p.Devices {
				if dev.UUID != g.UUID {
					continue
				}
				mine = true
				if dev.MIG != nil {
					for _, sl := range g.Instances {
						if sl.Instance.UUID == dev.MIG.UUID {
							slots = append(slots, sl)
						}
					}
				}
			}
			if mine {
				if g.MIG {
					g.Instances = slots
				}
				gpus = append(gpus, g)
			}
		}
		n.GPUs = gpus
		devs, ok := placement.FitNode(&n, per)
		if !ok {
			fits = false
			break
		}
		d.Parts = append(d.Parts, placement.Part{NodeID: p.NodeID, Pool: p.Pool, Zone: p.Zone, Devices: devs})
	}
	if !fits {
		delete(s.cluster.claims, j.key)
		return placement.Decision{}, true, false
	}
	return d, true, true
}

// miss is a job a cycle could not place, with its request.
type miss struct {
	j *Job
	r placement.Request
}

// guarantee is what preemption keeps of tenants' guarantees in one cycle.
type guarantee struct {
	book *fairshare.Book
	// staying is, per tenant and pool, the milli-GPU of work that is not
	// leaving (committed or in flight, not being stopped) plus what is
	// claimed for its preemptors.
	staying map[preempt.TenantPool]int64
	// spare is, for tenants with a guarantee in a pool, what of staying
	// lies beyond it: all another tenant's preemptor may evict.
	spare map[preempt.TenantPool]int64
}

// guarantees counts what each tenant keeps. Work being stopped already
// (preempted, moved, cancelled) is leaving: counting it would let two
// decisions take the same borrowed GPUs twice.
func (s *Store) guarantees(b *fairshare.Book) *guarantee {
	g := &guarantee{book: b, staying: map[preempt.TenantPool]int64{}}
	add := func(a *contracts.Allocation, j *Job) {
		if isStaying(a, j) {
			g.staying[preempt.TenantPool{Tenant: a.Tenant, Pool: a.Pool}] += milliOf(a)
		}
	}
	for _, ref := range s.committed() {
		add(ref.a, ref.j)
	}
	for _, a := range s.cluster.plans {
		add(a, s.jobs[Key(a.Tenant, a.JobID)])
	}
	s.claimedAndSpare(g)
	return g
}

// isStaying reports whether allocation a of job j is work that stays: its
// job's current attempt, not ended, evicted or cancelled, and its part
// neither ended nor being stopped (a gang's part retried).
func isStaying(a *contracts.Allocation, j *Job) bool {
	if j == nil || j.Request == nil || j.Attempt != a.Attempt || j.State.Terminal() || j.evict != "" || j.cancel {
		return false
	}
	p := j.part(a.ID)
	return p == nil || (!p.done() && p.stopSent == "")
}

// claimedAndSpare ends guarantees (and preemptInputs' walk): what is
// claimed for preemptors stays too, and each guaranteed tenant's spare is
// what of its staying work lies beyond its guarantee.
func (s *Store) claimedAndSpare(g *guarantee) {
	for key, cl := range s.cluster.claims {
		if j := s.jobs[key]; j != nil && j.Request != nil {
			per := j.Request.Resources.GPU.MilliGPUs() / int64(max(len(cl.parts), 1))
			for _, p := range cl.parts {
				g.staying[preempt.TenantPool{Tenant: cl.tenant, Pool: p.Pool}] += per
			}
		}
	}
	g.spare = map[preempt.TenantPool]int64{}
	for k, n := range g.staying {
		if q := g.book.Guarantee(k.Tenant, k.Pool); q > 0 {
			g.spare[k] = max(0, n-q)
		}
	}
}

// borrowing reports whether tenant holds more than its guarantee in pool
// (anything at all when it has none there).
func (g *guarantee) borrowing(tenant, pool string) bool {
	k := preempt.TenantPool{Tenant: tenant, Pool: pool}
	return g.staying[k] > g.book.Guarantee(tenant, pool)
}

// spend counts a decision: its victims leave, what it claims stays.
func (g *guarantee) spend(j *Job, choice preempt.Choice) {
	for _, v := range choice.Victims {
		k := preempt.TenantPool{Tenant: v.Tenant, Pool: v.Pool}
		var m int64
		for _, d := range v.Devices {
			m += d.MilliGPUs()
		}
		g.staying[k] -= m
		if sp, ok := g.spare[k]; ok {
			g.spare[k] = max(0, sp-m)
		}
	}
	per := j.Request.Resources.GPU.MilliGPUs() / int64(max(len(choice.Parts), 1))
	for _, p := range choice.Parts {
		k := preempt.TenantPool{Tenant: j.Tenant, Pool: p.Pool}
		g.staying[k] += per
		if q := g.book.Guarantee(j.Tenant, p.Pool); q > 0 {
			g.spare[k] = max(0, g.staying[k]-q)
		}
	}
}

// victimsOf lists the committed allocations that preemption may consider;
// g, when set, says which tenants borrow.
func (s *Store) victimsOf(g *guarantee) []preempt.Running {
	// In allocation ID order (committed's): map order is random, and the
	// choice must not be.
	type cand struct {
		a *contracts.Allocation
		j *Job
		p *part
	}
	refs := s.committed()
	cands := make([]cand, 0, len(refs))
	for _, ref := range refs {
		a, j := ref.a, ref.j
		if j == nil || j.Request == nil || j.Attempt != a.Attempt || j.State.Terminal() || j.evict != "" || j.cancel {
			continue
		}
		p := j.part(a.ID)
		if p == nil || !p.committed || p.done() {
			continue
		}
		cands = append(cands, cand{a, j, p})
	}
	out := make([]preempt.Running, 0, len(cands))
	for _, c := range cands {
		a, j, p := c.a, c.j, c.p
		r := preempt.Running{AllocationID: a.ID, Tenant: a.Tenant, JobID: a.JobID, NodeID: a.NodeID, Pool: a.Pool,
			Devices: a.Devices, CPUMilli: a.CPUMilli, MemoryMiB: a.MemoryMiB, Priority: j.Request.Priority,
			Borrowing: g != nil && g.borrowing(a.Tenant, a.Pool), Checkpointable: j.Request.Run.Checkpoint}
		if p.started != nil {
			r.StartedAt = *p.started
		}
		if p.checkpointed != nil {
			r.LastCheckpoint = *p.checkpointed
		}
		if len(j.parts) > 1 {
			r.Gang = j.key
		}
		out = append(out, r)
	}
	return out
}

// running lists what holds devices now and when it is expected to let
// go, for backfill reservations.
func (s *Store) running(now time.Time) []backfill.Running {
	out := make([]backfill.Running, 0, len(s.cluster.allocs)+len(s.cluster.plans))
	add := func(a *contracts.Allocation, j *Job) {
		r := backfill.Running{NodeID: a.NodeID, Devices: a.Devices, CPUMilli: a.CPUMilli, MemoryMiB: a.MemoryMiB}
		if ended(j, a) {
			// Its run is over (or its job is, or it is not this attempt's):
			// only the release is to come. Counted as never ending, it
			// would make every reservation that needs it impossible for
			// as long as the release takes, and the capacity it waits
			// for would go to whoever comes next.
			r.End = now
		} else if j != nil && j.Request != nil {
			if d := expectedRunTime(j.Request); d > 0 {
				start := now
				if p := j.part(a.ID); p != nil && p.started != nil {
					start = *p.started
				}
				r.End = start.Add(d)
			}
		}
		out = append(out, r)
	}
	for _, ref := range s.committed() {
		add(ref.a, ref.j)
	}
	for _, a := range s.cluster.plans {
		add(a, s.jobs[Key(a.Tenant, a.JobID)])
	}
	// In map order: backfill.Reserve groups the jobs by node itself and
	// orders each node's by release time; what is released by a time
	// does not depend on the order (it was sorted by node, 25k values a
	// cycle at issue 17's scale, for nothing).
	return out
}

// ended reports whether allocation a no longer runs anything its job will
// wait for: the job is gone or terminal, a is an earlier attempt's, or its
// part is done.
func ended(j *Job, a *contracts.Allocation) bool {
	if j == nil || j.State.Terminal() || a.Attempt < j.Attempt {
		return true
	}
	p := j.part(a.ID)
	return p != nil && p.done()
}

// allocRef is a committed allocation and its job (nil when the store has
// none by that key).
type allocRef struct {
	a *contracts.Allocation
	j *Job
}

// committed returns the committed allocations with their jobs, in
// allocation ID order. A cycle computes it once (cycleRefs) for its four
// walks over them (book, running, guarantees, victimsOf): while a cycle
// runs neither changes, since ledger facts come between cycles and jobs
// enter and leave the jobs map only with requests and RetireTerminal.
func (s *Store) committed() []allocRef {
	if s.cycleRefsOK {
		return s.cycleRefs
	}
	refs := make([]allocRef, 0, len(s.cluster.allocs))
	var key []byte    // Key's bytes: a look-up by string(key) allocates nothing
	if s.exhaustive { // the reference sorts afresh
		for _, a := range s.cluster.allocs {
			key = append(append(append(key[:0], a.Tenant...), '/'), a.JobID...)
			refs = append(refs, allocRef{a, s.jobs[string(key)]})
		}
		slices.SortFunc(refs, func(x, y allocRef) int { return strings.Compare(x.a.ID, y.a.ID) })
		return refs
	}
	for _, a := range s.cluster.order.sorted(s.cluster.allocs) {
		key = append(append(append(key[:0], a.Tenant...), '/'), a.JobID...)
		refs = append(refs, allocRef{a, s.jobs[string(key)]})
	}
	return refs
}
