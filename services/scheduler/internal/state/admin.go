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
	for _, a := range s.cluster.allocs {
		hold(&a)
	}
	for _, a := range s.cluster.plans {
		hold(a)
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
	if len(j.victims) == 0 {
		return false
	}
	j.victims = slices.DeleteFunc(j.victims, func(id string) bool {
		_, held := s.cluster.allocs[id]
		return !held
	})
	return len(j.victims) > 0
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
	q, ok := s.quotas[j.Tenant]
	if !ok {
		return nil
	}
	var pools []string
	if r.Pool != "" {
		pools = []string{r.Pool}
	} else if _, all := q.Pools[contracts.QuotaAllPools]; all {
		pools = s.cluster.pools()
	} else {
		for p := range q.Pools {
			pools = append(pools, p)
		}
		slices.Sort(pools)
	}
	need := r.GPU.MilliGPUs()
	return slices.DeleteFunc(pools, func(p string) bool { return !b.UnderGuarantee(j.Tenant, p, need) })
}

// maxPreemptorsPerCycle bounds the victim searches of one cycle; the next
// cycle serves the rest.
const maxPreemptorsPerCycle = 4

// preempt chooses victims for jobs that could not be placed, on the
// cluster as it is after this cycle's placements, and stops them. The
// preemptor keeps its place in the queue and takes the devices when the
// victims' releases come in (it is served before them: a higher class, or
// the tenant under its guarantee ranks first in fair share).
func (s *Store) preempt(now time.Time, preemptors []miss, b *fairshare.Book) {
	snap := s.cluster.snapshot(now)
	running := s.victimsOf(b)
	tried := 0
	for _, m := range preemptors {
		if tried == maxPreemptorsPerCycle {
			break
		}
		tried++
		j := m.j
		// A tenant under its guarantee reclaims in those pools first;
		// then priority alone may evict lower classes anywhere.
		var choice preempt.Choice
		ok := false
		for _, pool := range append(s.reclaimPools(j, b, m.r), "") {
			pr := preempt.Preemptor{Request: m.r, Priority: j.Request.Priority, Reclaim: pool != ""}
			pr.Request.Exclude = nil // reservations yield to preemption by rank
			if pool != "" {
				pr.Request.Pool = pool
			}
			if choice, ok = preempt.Choose(snap, running, pr, preempt.Options{Now: now, MinRuntime: s.cfg.MinRuntime}); ok {
				break
			}
		}
		if !ok || len(choice.Victims) == 0 {
			continue
		}
		keys := s.evictVictims(j, choice.Victims, move{reason: contracts.ReasonPreempted,
			msg: fmt.Sprintf("preempted by %s/%s (priority %s)", j.Tenant, j.ID, j.Request.Priority)}, nil)
		running = slices.DeleteFunc(running, func(r preempt.Running) bool {
			return slices.Contains(keys, Key(r.Tenant, r.JobID))
		})
		s.setPending(j, placement.Pending{Code: contracts.PendingPreempting,
			Message: choice.Reason + "; waiting for " + strings.Join(keys, ", ") + " to stop"})
		s.log.Info("preempting", "tenant", j.Tenant, "job_id", j.ID, "victims", keys, "why", choice.Reason)
	}
}

// evictVictims moves every job of victims for m (a job with several
// victim parts once) and makes j wait for their allocations' releases
// rather than choose again. avoid, when set, is where the moved jobs must
// not go next. It returns the victim jobs' keys.
func (s *Store) evictVictims(j *Job, victims []preempt.Running, m move, avoid map[string]bool) []string {
	var keys []string
	j.victims = j.victims[:0]
	for _, v := range victims {
		j.victims = append(j.victims, v.AllocationID)
		key := Key(v.Tenant, v.JobID)
		if slices.Contains(keys, key) {
			continue
		}
		keys = append(keys, key)
		vj := s.jobs[key]
		if avoid != nil {
			vj.avoid = maps.Clone(avoid)
		}
		s.evictJob(vj, m)
	}
	return keys
}

// miss is a job a cycle could not place, with its request.
type miss struct {
	j *Job
	r placement.Request
}

// victimsOf lists the committed allocations that preemption may consider.
func (s *Store) victimsOf(b *fairshare.Book) []preempt.Running {
	out := make([]preempt.Running, 0, len(s.cluster.allocs))
	for _, a := range s.cluster.allocs {
		j := s.jobs[Key(a.Tenant, a.JobID)]
		if j == nil || j.Request == nil || j.Attempt != a.Attempt || j.State.Terminal() || j.evict != "" || j.cancel {
			continue
		}
		p := j.part(a.ID)
		if p == nil || !p.committed || p.done() {
			continue
		}
		r := preempt.Running{AllocationID: a.ID, Tenant: a.Tenant, JobID: a.JobID, NodeID: a.NodeID,
			Devices: a.Devices, CPUMilli: a.CPUMilli, MemoryMiB: a.MemoryMiB, Priority: j.Request.Priority,
			Borrowing: b != nil && b.Borrowing(a.Tenant, a.Pool), Checkpointable: j.Request.Run.Checkpoint}
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
	// Map order is random; the choice must not be.
	slices.SortFunc(out, func(a, b preempt.Running) int { return strings.Compare(a.AllocationID, b.AllocationID) })
	return out
}

// running lists what holds devices now and when it is expected to let
// go, for backfill reservations.
func (s *Store) running(now time.Time) []backfill.Running {
	out := make([]backfill.Running, 0, len(s.cluster.allocs)+len(s.cluster.plans))
	add := func(a *contracts.Allocation) {
		r := backfill.Running{NodeID: a.NodeID, Devices: a.Devices, CPUMilli: a.CPUMilli, MemoryMiB: a.MemoryMiB}
		j := s.jobs[Key(a.Tenant, a.JobID)]
		if j != nil && j.Request != nil {
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
	for _, a := range s.cluster.allocs {
		add(&a)
	}
	for _, a := range s.cluster.plans {
		add(a)
	}
	slices.SortFunc(out, func(a, b backfill.Running) int { return strings.Compare(a.NodeID, b.NodeID) })
	return out
}
