package state

import (
	"slices"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/fairshare"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/preempt"
)

// preemptBufs are what preempt keeps from one cycle to the next: the
// victim list of the last cycle and the array the next one is written
// into (~38,000 entries, ~9 MB each at issue 17's scale, which the
// collector would otherwise reclaim every cycle), each entry's stamp, and
// the candidates' scratch. Nothing of a cycle's preemption outlives it
// but these: the fleet is the cycle's, a choice's victims are copies and
// kept lists their own keys.
type preemptBufs struct {
	running [2][]preempt.Running
	stamps  [2][]victimStamp
	last    int // the index of the last cycle's list
	cands   []victimCand
	runs    []preempt.TenantPool // per run of one tenant and pool
	sums    []int64              // per run: the milli-GPUs of its staying work
	stays   []bool               // per run: any of its work stays
}

// victimStamp is everything a victim list entry is made of but its
// Borrowing: the allocation (its ID, tenant, job, node, pool, devices,
// host resources), the job's request (priority, checkpointable), when its
// part started and last checkpointed, and whether the job is a gang (its
// key is the allocation's tenant and job). None of these is changed in
// place: a commit stores a new allocation, a request change a new
// request, a run fact a new time. An entry whose stamp is the last
// cycle's entry's is that entry, with this cycle's Borrowing; the stamps
// hold what they point to, so no address is reused while compared.
type victimStamp struct {
	a             *contracts.Allocation
	req           *contracts.JobRequest
	started, ckpt *time.Time
	gang          bool
}

// victimCand is a running allocation preemption may consider: its job
// and part, what its list entry is made of, and its run of one tenant and
// pool (preemptInputs' runs).
type victimCand struct {
	j   *Job
	p   *part
	st  victimStamp
	run int
}

// preemptInputs is guarantees(b) and victimsOf(g) in one walk over the
// committed allocations: the walk's cost is its cache misses (each
// allocation, its job, its request and its part lie apart in memory), and
// both asked the same of each. The exhaustive reference still calls the
// two on their own (TestSteadyCyclesDecideAsExhaustiveSearch and
// TestPreemptInputsAreGuaranteesAndVictimsOf compare).
func (s *Store) preemptInputs(b *fairshare.Book) (*guarantee, []preempt.Running) {
	if s.exhaustive {
		g := s.guarantees(b)
		return g, s.victimsOf(g)
	}
	g := &guarantee{book: b, staying: map[preempt.TenantPool]int64{}}
	bufs := &s.preemptBuf
	// Allocations come by ID, so one tenant's come together, mostly in
	// one pool: staying is summed per run of one tenant and pool and
	// added once (the entry is made only when something of the run stays,
	// as guarantees makes it: a tenant's entry with a guarantee gets a
	// spare budget, even of zero), and borrowing is asked per run. What
	// the list's entries are made of is read here too, while the
	// allocation, its job and its part are at hand.
	runs, sums, stays := bufs.runs[:0], bufs.sums[:0], bufs.stays[:0]
	cands := bufs.cands[:0]
	for _, ref := range s.committed() {
		a, j := ref.a, ref.j
		// guarantees' add and victimsOf's first test are the same.
		if j == nil || j.Request == nil || j.Attempt != a.Attempt || j.State.Terminal() || j.evict != "" || j.cancel {
			continue
		}
		if n := len(runs); n == 0 || a.Tenant != runs[n-1].Tenant || a.Pool != runs[n-1].Pool {
			runs, sums, stays = append(runs, preempt.TenantPool{Tenant: a.Tenant, Pool: a.Pool}), append(sums, 0), append(stays, false)
		}
		run := len(runs) - 1
		p := j.part(a.ID)
		if p == nil || (!p.done() && p.stopSent == "") {
			sums[run] += milliOf(a) // not leaving
			stays[run] = true
		}
		if p != nil && p.committed && !p.done() {
			cands = append(cands, victimCand{j: j, p: p, run: run,
				st: victimStamp{a: a, req: j.Request, started: p.started, ckpt: p.checkpointed, gang: len(j.parts) > 1}})
		}
	}
	for r, k := range runs {
		if stays[r] {
			g.staying[k] += sums[r]
		}
	}
	// Plans and claims, as guarantees counts them.
	for _, a := range s.cluster.plans {
		if isStaying(a, s.jobs[Key(a.Tenant, a.JobID)]) {
			g.staying[preempt.TenantPool{Tenant: a.Tenant, Pool: a.Pool}] += milliOf(a)
		}
	}
	s.claimedAndSpare(g)
	// victimsOf's list, with borrowing asked once per run of one tenant
	// and pool (staying is complete now). Between steady cycles ~1 % of
	// the running allocations change: an entry the last cycle made of the
	// same stamp is copied (the last list is walked beside this one, both
	// in allocation ID order) instead of read again off the allocation,
	// the request and the part, which lie apart in memory.
	prev, prevSt := bufs.running[bufs.last], bufs.stamps[bufs.last]
	next := 1 - bufs.last
	out, outSt := bufs.running[next][:0], bufs.stamps[next][:0]
	var (
		borrowing bool
		lastRun   = -1
		k         int // prev's entry to compare next
	)
	for _, c := range cands {
		if c.run != lastRun {
			lastRun, borrowing = c.run, g.borrowing(runs[c.run].Tenant, runs[c.run].Pool)
		}
		st := c.st
		a := st.a
		// Skip what the last list had before a (released since); the order
		// only decides how many entries are found again, a stamp decides
		// whether one is.
		for k < len(prevSt) && prevSt[k].a != a && prev[k].AllocationID < a.ID {
			k++
		}
		if k < len(prevSt) && prevSt[k] == st {
			r := prev[k]
			r.Borrowing = borrowing
			out, outSt = append(out, r), append(outSt, st)
			k++
			continue
		}
		if k < len(prevSt) && prevSt[k].a == a {
			k++ // the same allocation, changed
		}
		j, p := c.j, c.p
		r := preempt.Running{AllocationID: a.ID, Tenant: a.Tenant, JobID: a.JobID, NodeID: a.NodeID, Pool: a.Pool,
			Devices: a.Devices, CPUMilli: a.CPUMilli, MemoryMiB: a.MemoryMiB, Priority: j.Request.Priority,
			Borrowing: borrowing, Checkpointable: j.Request.Run.Checkpoint}
		if p.started != nil {
			r.StartedAt = *p.started
		}
		if p.checkpointed != nil {
			r.LastCheckpoint = *p.checkpointed
		}
		if st.gang {
			r.Gang = j.key
		}
		out, outSt = append(out, r), append(outSt, st)
	}
	// The scratch holds no job past the cycle, and the arrays past this
	// cycle's entries nothing of an earlier one (the other list holds the
	// last cycle's until the next cycle writes over it).
	clear(cands)
	clear(runs)
	clear(out[len(out):cap(out)])
	clear(outSt[len(outSt):cap(outSt)])
	bufs.cands, bufs.runs, bufs.sums, bufs.stays = cands[:0], runs[:0], sums[:0], stays[:0]
	bufs.running[next], bufs.stamps[next], bufs.last = out, outSt, next
	return g, out
}

// victimJobs are the jobs of choice's victims (evictVictims' keys), for
// Fleet.RemoveJobs.
func victimJobs(choice preempt.Choice) []preempt.JobRef {
	var out []preempt.JobRef
	for _, v := range choice.Victims {
		if jr := (preempt.JobRef{Tenant: v.Tenant, JobID: v.JobID}); !slices.Contains(out, jr) {
			out = append(out, jr)
		}
	}
	return out
}
