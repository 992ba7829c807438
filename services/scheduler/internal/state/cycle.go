package state

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/backfill"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/demand"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/fairshare"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// CycleResult is what one scheduling cycle decided.
type CycleResult struct {
	// Plans to publish, in order. Usually one; a cycle that places more
	// than MaxPlanBytes of items splits it.
	Plans []contracts.Plan
	// Publish are pending events of jobs whose reason changed.
	Publish []Publish
	// Demand is every pool's demand after the cycle.
	Demand map[string]contracts.PoolDemand
	// Placed and Waiting count the jobs proposed and left waiting.
	Placed, Waiting int
	// Preempted are the preemptions the cycle decided.
	Preempted []Preemption
}

// Cycle offers every queued job to the placer over the current snapshot
// (ledger and plans in flight both hold devices), in fair-share order:
// priority classes first, then the tenant with the lowest weighted
// dominant share, FIFO within a tenant. Per job it checks dependencies,
// the placement timeout, the tenant's quota and the backfill reservations
// of larger jobs ahead. Jobs that fit become plan items (all machines of a
// gang in one plan) held in flight until the ledger or a refusal answers;
// jobs that do not fit get a precise pending reason, may preempt, and the
// first ones blocked by capacity get a reservation. It is level-triggered:
// calling it twice with no new fact in between places nothing new and
// publishes nothing new.
func (s *Store) Cycle() CycleResult {
	now := s.cfg.Now()
	s.cluster.noSnapCache = s.exhaustive // the reference builds every node afresh
	snap := s.cluster.snapshot(now)
	s.drain(now)
	s.checkEvicting()
	if !s.exhaustive { // the reference looks every job up afresh
		s.cycleRefs = s.committed()
		s.cycleRefsOK = true
		defer func() { s.cycleRefs, s.cycleRefsOK = nil, false }()
	}
	p := placement.NewPlacer(snap, placement.Options{Policy: s.policyFor, Workload: s.workload.requests(),
		Exhaustive: s.exhaustive})
	book := s.book(snap)
	type hit struct {
		j *Job
		d placement.Decision
	}
	var (
		hits []hit
		// missed are the jobs left waiting, waiting their requests (for
		// pool demand, and defragment's victim searches).
		bufs       = s.cycleBufs.take(s.queue.Len())
		missed     = bufs.missed
		waiting    = bufs.waiting
		preemptors []miss
		ahead      = s.newAhead()
		resv       = s.carriedReservations()
		reserved   int
		// holds caches, per set of reservations a job must not delay, the
		// set's holds: jobs sharing one share their pending explanations.
		holds = map[string]map[string]placement.Hold{}
		// planner answers the cycle's reservations: the running jobs
		// and the snapshot's nodes are grouped once, at the first.
		planner *backfill.Planner
		// fresh are the jobs that reserved in this cycle: every job after
		// them in this cycle's order respects their reservations. One
		// carried from an earlier cycle binds only jobs of its job's
		// class or lower: fair share reorders a class's jobs from cycle to
		// cycle, and must not hand what a reservation held to a job that
		// merely ranks first this time.
		fresh    = map[string]bool{}
		holdsGen int
	)
	// The watermark: a job that arrived after a request still being
	// accepted waits for it (a cycle or two, milliseconds), or it could
	// take capacity the earlier arrival is owed.
	watermark := ^uint64(0)
	for seq := range s.accepting {
		watermark = min(watermark, seq)
	}
	items := bufs.items
	offered := bufs.offered // by fairshare.Item.Ref
	defer func() {
		s.cycleBufs.put(cycleBufs{missed: missed, waiting: waiting, items: items, offered: offered})
	}()
	// Fair share groups the items by class and tenant (NewRound): the
	// queue hands them over grouped already, each tenant's in its order.
	for it := range s.queue.ByTenant() {
		j := it.Value
		if j.seq > watermark {
			continue
		}
		items = append(items, fairshare.Item{Key: j.key, Tenant: j.Tenant, Priority: j.Request.Priority, Seq: j.seq,
			Ref: len(offered), Usage: j.usage()})
		offered = append(offered, j)
	}
	var reservedForJob func(j *Job, expected time.Duration) (map[string]placement.Hold, string)
	binds := func(j *Job) func(backfill.Reservation) bool {
		return func(res backfill.Reservation) bool {
			if fresh[res.Key] {
				return true
			}
			rj := s.jobs[res.Key]
			return rj != nil && rj.Request != nil && rj.Request.Priority.Rank() >= j.Request.Priority.Rank()
		}
	}
	// reservedFor's answers by (priority rank, expected run time): they
	// depend on nothing else about the job. resvGen names the state they
	// were computed on; it moves whenever a reservation is made or
	// dropped, or a job that may hold one ends (binds reads its request).
	type resvAsk struct {
		gen, rank int
		expected  time.Duration
	}
	type resvAnswer struct {
		holds map[string]placement.Hold
		key   string
	}
	resvGen := 0
	resvMemo := map[resvAsk]resvAnswer{}
	reservedFor := func(j *Job, rank int, expected time.Duration) (map[string]placement.Hold, string) {
		ask := resvAsk{gen: resvGen, rank: rank, expected: expected}
		if a, ok := resvMemo[ask]; ok && !s.exhaustive {
			return a.holds, a.key
		}
		m, k := reservedForJob(j, expected)
		resvMemo[ask] = resvAnswer{m, k}
		return m, k
	}
	reservedForJob = func(j *Job, expected time.Duration) (map[string]placement.Hold, string) {
		applies := binds(j)
		var key strings.Builder
		// The generation: a key names one version of each reservation,
		// for placement's explanations too.
		key.WriteString(strconv.Itoa(holdsGen))
		key.WriteByte(':')
		for _, res := range resv.All() {
			if backfill.Delays(res, now, expected) && applies(res) {
				key.WriteString(res.Key)
				key.WriteByte(',')
			}
		}
		k := key.String()
		if m, ok := holds[k]; ok {
			return m, k
		}
		m := resv.Holds(now, expected, applies)
		holds[k] = m
		return m, k
	}
	// admit is the AllowPool of the job being decided (admitTenant), one
	// closure for the whole cycle rather than one per job: it notes the
	// quota refusals the job's pending reason names. A request kept past
	// its job's turn (a preemptor's) gets its own, admitFor.
	var (
		admitTenant string // the job's tenant
		admitNeed   int64
		quota       []string
	)
	// bookMemo keeps the book's answers (quota verdicts, guarantee
	// notes) until the book next changes: a placement (round.Placed)
	// clears it. Most waiting jobs ask what the job before them asked.
	type bookAsk struct {
		tenant, pool string
		need         int64
	}
	// verdicts are the quota verdicts by tenant and need, each a short
	// list by pool: a job asks about every pool in its scope, and looks
	// its tenant and need up once (admitting), not once per pool.
	type admitAsk struct {
		tenant string
		need   int64
	}
	type poolVerdicts struct {
		pools    []string
		verdicts []fairshare.Verdict
	}
	verdicts := map[admitAsk]*poolVerdicts{}
	// fails are this cycle's failures by what decides them (failcache.go):
	// a job that asks what one before it asked fails alike, unsearched.
	fails := s.cycleFails()
	var admitting *poolVerdicts // the job being decided's; nil until it asks
	notes := map[bookAsk]string{}
	bookChanged := func() {
		clear(verdicts)
		clear(notes)
		admitting = nil
		fails.clear()
	}
	admit := func(pool string) bool {
		var v fairshare.Verdict
		switch {
		case s.exhaustive:
			v = book.Admit(admitTenant, pool, admitNeed)
		default:
			if admitting == nil {
				ask := admitAsk{admitTenant, admitNeed}
				if admitting = verdicts[ask]; admitting == nil {
					admitting = &poolVerdicts{}
					verdicts[ask] = admitting
				}
			}
			if i := slices.Index(admitting.pools, pool); i >= 0 {
				v = admitting.verdicts[i]
			} else {
				v = book.Admit(admitTenant, pool, admitNeed)
				admitting.pools = append(admitting.pools, pool)
				admitting.verdicts = append(admitting.verdicts, v)
			}
		}
		if !v.OK {
			quota = append(quota, v.Message)
		}
		return v.OK
	}
	admitFor := func(j *Job, need int64) func(string) bool {
		return func(pool string) bool { return book.Admit(j.Tenant, pool, need).OK }
	}
	round := book.NewRound(items)
	blocked := func(it fairshare.Item) {
		for _, held := range round.Blocked(it) {
			if hj := s.jobs[held.Key]; hj != nil && hj.State == contracts.StateQueued {
				s.setPending(hj, placement.Pending{Code: contracts.PendingStrictFIFO, Message: fairshare.StrictFIFOMessage(it)})
			}
		}
	}
	for it, ok := round.Next(); ok; it, ok = round.Next() {
		// The queue's job is the jobs map's (a queued job is never
		// replaced there); the reference path looks it up as it did.
		j := offered[it.Ref]
		if s.exhaustive {
			j = s.jobs[it.Key]
		}
		if j == nil || j.State != contracts.StateQueued || j.Request == nil || len(j.parts) > 0 {
			continue
		}
		if t := j.Request.PlacementTimeout.D(); t > 0 && j.queuedAt != 0 && now.Sub(j.queued()) > t {
			s.timeOut(j, t)
			resvGen++
			continue
		}
		switch v, why := s.dependencies(j); v {
		case depFailed:
			s.failDependent(j, why)
			resvGen++
			continue
		case depWaiting:
			s.setPending(j, why)
			blocked(it)
			continue
		}
		if held := s.awaitingRelease(j); len(held) > 0 {
			s.setPending(j, placement.Pending{Code: contracts.PendingReleasing,
				Message: "waiting for the resource manager to release " + strings.Join(held, ", ")})
			blocked(it)
			continue
		}
		if s.preempting(j) {
			j.mv.note = "" // it found its room (preempting: it has victims)
			s.setPending(j, placement.Pending{Code: contracts.PendingPreempting,
				Message: "waiting for " + strings.Join(j.mv.victims, ", ") + " to stop and release their devices"})
			blocked(it)
			continue
		}
		// Its victims are gone: it takes what was claimed for it (held
		// from everyone else meanwhile, and counted in its tenant's
		// quota by book), or, should that be gone, tries afresh next cycle.
		if d, claimed, ok := s.claimed(j, book, now); claimed {
			if ok {
				hits = append(hits, hit{j, d})
				s.servedSeq++
				s.served[j.Tenant] = s.servedSeq
			} else {
				s.setPending(j, placement.Pending{Code: contracts.PendingPreempting,
					Message: "the devices its preemption freed are no longer usable; choosing again"})
				s.cfg.Wake()
			}
			continue
		}
		r := s.request(j, ahead.next(j))
		need := it.Usage.MilliGPU
		admitTenant, admitNeed, quota, admitting = j.Tenant, need, quota[:0], nil
		if !s.exhaustive {
			// The same text, shared by the tenant's jobs (aheadTables):
			// hashed and copied for each, it is then in cache.
			r.Tenant = j.memo.tenantName
			admitTenant = r.Tenant
		}
		r.AllowPool = admit
		if resv.Drop(j.key) { // its own reservation of an earlier cycle: decided again now
			resvGen++
		}
		if resv.Len() > 0 {
			if s.exhaustive {
				r.Reserved, r.ExcludeKey = reservedFor(j, j.Request.Priority.Rank(), expectedRunTime(j.Request))
			} else {
				r.Reserved, r.ExcludeKey = reservedFor(j, int(j.memo.rank), j.memo.expected)
			}
		}
		if avoid := j.moves().avoid; len(avoid) > 0 {
			// A job moved to consolidate capacity stays off the nodes it
			// freed (defrag.go).
			r.Exclude, r.ExcludeKey = maps.Clone(avoid), ""
		}
		var d placement.Decision
		if s.exhaustive { // the reference derives every request afresh
			d = p.Place(r)
		} else {
			d = fails.place(p, &r, &j.memo.place, need, &quota) // ahead.next made j.memo
		}
		if d.Placed() {
			hits = append(hits, hit{j, d})
			if pr := s.promiseOf(j, d, resv.Reservations(), binds(j), now); pr != nil || j.mv != nil {
				j.movesW().promise = pr
			}
			s.servedSeq++
			s.served[j.Tenant] = s.servedSeq
			// Each machine's share counts in its own pool: a gang may span
			// pools when it names none.
			per := it
			k := int64(len(d.Parts))
			per.Usage = fairshare.Usage{MilliGPU: it.Usage.MilliGPU / k, CPUMilli: it.Usage.CPUMilli / k,
				MemoryMiB: it.Usage.MemoryMiB / k}
			for _, part := range d.Parts {
				round.Placed(per, part.Pool)
				bookChanged()
			}
			continue
		}
		blocked(it)
		pend := d.Pending
		if len(quota) > 0 && (pend.Code == contracts.PendingNoNodes || pend.Code == contracts.PendingNoSchedulableNode ||
			pend.Code == contracts.PendingInsufficientGPUs || pend.Code == contracts.PendingQuotaExceeded) {
			slices.Sort(quota)
			quota = slices.Compact(quota)
			pend = placement.Pending{Code: contracts.PendingQuotaExceeded, Message: pend.Message + "; " + strings.Join(quota, "; ")}
		}
		if pend.Code == contracts.PendingInsufficientGPUs || pend.Code == contracts.PendingNoSchedulableNode {
			// preempt tries the first maxPreemptorsPerCycle only.
			if len(preemptors) < maxPreemptorsPerCycle && s.mayPreempt(j, book, r) {
				pr := r
				pr.AllowPool = admitFor(j, need) // asked again after the loop
				preemptors = append(preemptors, miss{j, pr})
			}
			ask := bookAsk{j.Tenant, r.Pool, r.GPU.MilliGPUs()}
			note, ok := notes[ask]
			if !ok || s.exhaustive {
				note = s.guaranteeNote(j, book, r) // it reads no more of j and r than ask holds
				notes[ask] = note
			}
			if note != "" {
				pend.Message += "; " + note
			}
			if reserved < s.cfg.MaxReservations {
				if planner == nil {
					planner = backfill.NewPlanner(snap, s.running(now), now)
				}
				// Earlier reservations' holds are taken for this one, of
				// whatever class: two never count on the same device.
				rr := r
				rr.Reserved = resv.Holds(now, 0, nil)
				if res, ok := planner.Reserve(rr); ok {
					res.Key = j.key
					resv.Add(res)
					fresh[j.key] = true
					clear(holds)
					holdsGen++
					resvGen++
					reserved++
					pend.Message += "; " + res.Message
				}
			}
			pend = withNote(j, pend)
		}
		s.setPending(j, pend)
		r.AllowPool = nil // admit answers for the job being decided only
		missed = append(missed, j)
		waiting = append(waiting, r)
	}

	res := CycleResult{Placed: len(hits), Waiting: len(missed)}
	nowUTC := now.UTC()
	used := map[string]int{}
	size := 0
	for _, h := range hits {
		items := s.items(h.j, h.d)
		n := 0
		for _, item := range items {
			n += itemSize(*item)
		}
		if len(res.Plans) == 0 || size+n > s.cfg.MaxPlanBytes {
			s.planSeq++
			res.Plans = append(res.Plans, contracts.Plan{SchemaVersion: contracts.SchemaVersion,
				ID:        fmt.Sprintf("%s-%s-%d", s.cfg.Scheduler, s.cfg.Boot, s.planSeq),
				Scheduler: s.cfg.Scheduler, Time: nowUTC})
			size = 256
		}
		plan := &res.Plans[len(res.Plans)-1]
		for _, item := range items {
			item.PlanID = plan.ID
			plan.Items = append(plan.Items, *item)
			used[item.Pool] += len(item.Devices)
		}
		size += n
		s.fly(h.j, items)
	}
	s.reservations = resv.Reservations()
	s.enforcePromises(now)
	if len(preemptors) > 0 {
		res.Preempted = s.preempt(now, preemptors, book)
	} else {
		// Kept for the next cycle that preempts, the victim lists would
		// hold released allocations and retired jobs' requests through a
		// quiet spell; a steady cycle preempts every time and keeps them.
		s.preemptBuf = preemptBufs{}
	}
	if len(s.defrag) > 0 {
		misses := make([]miss, len(missed))
		for i, j := range missed {
			r := waiting[i]
			if j.Request != nil {
				r.AllowPool = admitFor(j, usageOf(j.Request).MilliGPU)
			}
			misses[i] = miss{j, r}
		}
		s.defragment(now, misses)
	}
	res.Publish = s.take()
	res.Demand = demand.Compute(snap, used, waiting, s.cluster.pools(), nowUTC)
	return res
}

// cycleBufs are the lists a cycle fills per offered job.
type cycleBufs struct {
	missed  []*Job
	waiting []placement.Request
	items   []fairshare.Item
	offered []*Job
	// ahead are the ahead tables, kept across cycles (newAhead).
	ahead *aheadTables
	// failHits counts the failures the cycles' failCache answered.
	failHits int
}

// take hands the kept lists over, empty, each with room for n.
func (b *cycleBufs) take(n int) cycleBufs {
	if cap(b.waiting) > 4*n+1024 {
		*b = cycleBufs{} // the queue shrank: let the collector have them
	}
	out := cycleBufs{missed: slices.Grow(b.missed[:0], n), waiting: slices.Grow(b.waiting[:0], n),
		items: slices.Grow(b.items[:0], n), offered: slices.Grow(b.offered[:0], n)}
	*b = cycleBufs{ahead: b.ahead, failHits: b.failHits}
	return out
}

// put keeps a cycle's lists for the next one, cleared: a list must not
// keep a job (or a request's closures) alive past its cycle.
func (b *cycleBufs) put(used cycleBufs) {
	clear(used.missed)
	clear(used.waiting)
	clear(used.items)
	clear(used.offered)
	*b = cycleBufs{missed: used.missed[:0], waiting: used.waiting[:0], items: used.items[:0], offered: used.offered[:0],
		ahead: b.ahead, failHits: b.failHits}
}

// items turns a decision into plan items: one allocation, or one per
// machine of a gang (AllocationPartID, with its rank and the gang's nodes).
func (s *Store) items(j *Job, d placement.Decision) []*contracts.Allocation {
	out := make([]*contracts.Allocation, len(d.Parts))
	var gang []string
	if len(d.Parts) > 1 {
		gang = make([]string, len(d.Parts))
		for i, p := range d.Parts {
			gang[i] = p.NodeID
		}
	}
	for i, p := range d.Parts {
		a := &contracts.Allocation{ID: partID(j.Tenant, j.ID, j.Attempt, i, len(d.Parts)), Tenant: j.Tenant,
			JobID: j.ID, Attempt: j.Attempt, NodeID: p.NodeID, Pool: p.Pool, Devices: p.Devices,
			Priority: j.Request.Priority, Run: j.Request.Run, Scheduler: s.cfg.Scheduler,
			CPUMilli: j.Request.Resources.CPUMilli, MemoryMiB: j.Request.Resources.MemoryMiB}
		if run := j.Request.Run; run.IsContainer() || run.IsHostCommand() {
			// The agent runs it under the pool's policy as placed here.
			rt := *s.runtimeOf(p.Pool)
			rt.MountRoots = slices.Clone(rt.MountRoots)
			a.Runtime = &rt
		}
		if gang != nil {
			a.Gang = &contracts.GangPart{Rank: i, Size: len(gang), Nodes: gang}
		}
		out[i] = a
	}
	return out
}

// request is the placement request of a queued job.
func (s *Store) request(j *Job, ahead int) placement.Request {
	req := j.Request
	return placement.Request{Tenant: j.Tenant, Ahead: ahead, GPU: req.Resources.GPU,
		CPUMilli: req.Resources.CPUMilli, MemoryMiB: req.Resources.MemoryMiB, Pool: req.Pool,
		Selector: req.NodeSelector, Tolerations: req.Tolerations,
		PoolRuns: s.poolRuns(req.Run), Prefer: s.prefer(req.Run)}
}

// timeOut fails a job not placed within its placement timeout.
func (s *Store) timeOut(j *Job, t time.Duration) {
	msg := fmt.Sprintf("not placed within its placement timeout of %s", t)
	if j.Pending.Message != "" {
		msg += "; last reason: " + j.Pending.Message
	}
	if s.emit(j, contracts.EventFailed, 0, func(ev *contracts.JobEvent) {
		ev.Reason, ev.Message = contracts.ReasonPlacementTimeout, msg
	}) {
		s.finish(j)
	}
}

// expectedRunTime is how long a job says it runs: expectedRunTime, else
// its run's duration (a simulated run's length or a command's limit); 0
// when unknown.
func expectedRunTime(r *contracts.JobRequest) time.Duration {
	if r.ExpectedRunTime > 0 {
		return r.ExpectedRunTime.D()
	}
	return r.Run.Duration.D()
}

// usageOf is what a request takes once placed, all machines together.
func usageOf(r *contracts.JobRequest) fairshare.Usage {
	m := int64(r.Resources.GPU.Machines())
	return fairshare.Usage{MilliGPU: r.Resources.GPU.MilliGPUs(), CPUMilli: r.Resources.CPUMilli * m,
		MemoryMiB: r.Resources.MemoryMiB * m}
}

// usage is usageOf(j.Request), kept in the request's memo: every cycle
// asks it of every queued job (and only of queued jobs, whose memo the
// cycle makes anyway).
func (j *Job) usage() fairshare.Usage { return j.memoFor().usage }

// milliOf is what an allocation holds, in thousandths of a GPU.
func milliOf(a *contracts.Allocation) int64 {
	var n int64
	for _, d := range a.Devices {
		n += d.MilliGPUs()
	}
	return n
}

// itemSize estimates an item's encoded size. A plain simulated run is
// estimated from its strings (cheap, and cycles run under the scheduler's
// lock); one with a command or environment, whose escaping can grow it, is
// encoded to be sure.
func itemSize(a contracts.Allocation) int {
	if len(a.Run.Command) > 0 || len(a.Run.Env) > 0 {
		b, err := json.Marshal(a)
		if err != nil {
			return contracts.MaxMessageBytes
		}
		return len(b) + 128 // planId, set afterwards
	}
	n := 512 + 2*len(a.ID) + len(a.Tenant) + len(a.JobID) + len(a.NodeID) + len(a.Pool) + len(a.Scheduler)
	for _, d := range a.Devices {
		n += 48 + len(d.UUID) + len(d.Model)
	}
	return n
}

// PlanFailed puts back the items of a plan that could not be published:
// their devices are free again and their jobs wait in the queue (or are
// cancelled, when a cancel waited on the plan).
func (s *Store) PlanFailed(planID string) []Publish {
	for id, j := range s.flying {
		p := j.part(id)
		if p == nil || p.alloc.PlanID != planID {
			continue
		}
		s.cluster.forget(id, planID)
		s.land(p)
		if j.count(func(p *part) bool { return p.inFlight || p.committed }) > 0 {
			continue // a gang's other parts decide (advance)
		}
		j.parts = nil
		if j.cancel {
			s.cancelQueued(j)
		} else {
			s.enqueue(j)
		}
	}
	s.cfg.Wake()
	return s.take()
}
