package state

import (
	"cmp"
	"fmt"
	"reflect"
	"slices"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// cluster is the scheduler's view of nodes and devices. A device (a whole
// GPU, a MIG instance, or a share of a GPU) is held when the ledger has it
// committed or a plan in flight assumed it; it is released only by a ledger
// release, a refusal, or a failed plan publish, never by a timer.
type cluster struct {
	nodes  map[string]*nodeState
	ids    []string                         // sorted node IDs with an inventory
	allocs map[string]*contracts.Allocation // committed, not yet released (a pointer: cycles walk them all)
	plans  map[string]*contracts.Allocation
	// sizes counts the cards out of MIG mode by pool, model and
	// framebuffer, migKinds the MIG instances by pool, model and profile
	// (admission.go).
	sizes    cardSizes
	migKinds map[migKind]int
	// imageNodes counts the nodes whose inventory lists each image
	// (runtime.go): locality is looked for only when some node holds it.
	imageNodes map[string]int
	// claims are devices held for preemptors (by job key) until they
	// commit or give up: what their victims free goes to them alone.
	claims map[string]*claim
	// order keeps allocs in ID order across cycles (committed()).
	order allocOrder
	// noSnapCache has every snapshot built afresh (the exhaustive
	// reference's cycles; nodeSnapshot).
	noSnapCache bool
}

// claim is what a preemptor takes once its victims are gone: the parts
// its victim search verified, with its host CPU and memory on each.
type claim struct {
	tenant              string
	parts               []placement.Part
	cpuMilli, memoryMiB int64 // per machine
	// victims are the allocations whose release frees what it claims:
	// while one still holds a card's share or host capacity, the claim
	// holds only what it needs beyond that (the same capacity is not
	// counted twice).
	victims []string
}

type nodeState struct {
	// ver moves whenever the node may change: every change goes through
	// cluster.node or clear. snap is the node as nodeSnapshot last built
	// it, claims aside, at version snapVer (when snapOK): most nodes do
	// not change between two cycles, and a cycle snapshots twice.
	ver, snapVer uint64
	snapOK       bool
	snap         placement.Node

	inv  *contracts.NodeInventory
	lost bool
	// admin is the administrator's cordon or drain, nil when none.
	admin *contracts.NodeAdmin
	// held are the allocations (committed or assumed) on the node, by ID.
	held map[string]*contracts.Allocation
	// suspect nodes and devices were refused by the resource manager for a
	// reason that a newer fact about the node clears (not ready, unknown
	// device). They sit out cycles until that fact, or until suspectUntil:
	// NODES and ALLOCATIONS are separate streams, so the clearing fact may
	// have been read before the refusal, and then no later fact may ever
	// come. Expiry only makes the node eligible again (a retried plan is
	// verified like any other); no reservation is ever released by time.
	suspect      bool
	suspectGPUs  map[string]bool
	suspectUntil time.Time
	// images are the images its inventory lists, normalized
	// (inventoryImages).
	images map[string]bool
}

// suspectBackoff is how long a refused node or device sits out when no
// newer fact about it clears it first.
const suspectBackoff = time.Second

// unlimited stands for host capacity a node does not report.
const unlimited = int64(1) << 50

func newCluster() *cluster {
	return &cluster{nodes: map[string]*nodeState{}, allocs: map[string]*contracts.Allocation{},
		plans: map[string]*contracts.Allocation{}, claims: map[string]*claim{}, sizes: cardSizes{},
		migKinds: map[migKind]int{}, imageNodes: map[string]int{}}
}

func (c *cluster) node(id string) *nodeState {
	n := c.nodes[id]
	if n == nil {
		n = &nodeState{held: map[string]*contracts.Allocation{}}
		c.nodes[id] = n
	}
	n.ver++ // the caller may change it (the snapshot is built again)
	return n
}

// clear forgets what made a node suspect (a newer fact about it arrived)
// and reports whether there was anything to forget.
func (n *nodeState) clear() bool {
	was := n.suspect || len(n.suspectGPUs) > 0
	n.suspect, n.suspectGPUs = false, nil
	n.ver++
	return was
}

func (c *cluster) assume(a *contracts.Allocation) {
	if _, committed := c.allocs[a.ID]; committed {
		return
	}
	c.plans[a.ID] = a
	c.node(a.NodeID).held[a.ID] = a
}

// forget drops the assumption of allocation id made by plan planID (any
// plan when planID is empty).
func (c *cluster) forget(id, planID string) bool {
	a := c.plans[id]
	if a == nil || (planID != "" && a.PlanID != planID) {
		return false
	}
	delete(c.plans, id)
	n := c.node(a.NodeID)
	if n.held[id] == a {
		delete(n.held, id)
	}
	return true
}

// commit records a committed allocation and reports whether it cleared a
// suspect node (which may let waiting jobs fit again).
//
// The committed allocation is, nearly always, the plan item this store
// assumed, decoded afresh from the ledger: its IDs, run spec and device
// list would be a second copy, for as long as the job runs, of what the
// assumed item shares with the job's request and the node's inventory.
// The assumed item is kept instead when it equals the entry's, but for
// the traceparent: the service puts each published item in its job's
// trace (tracePlan) after the cycle, on the plan's copy; the assumed item
// takes the entry's.
func (c *cluster) commit(a contracts.Allocation) bool {
	held := c.plans[a.ID]
	if held != nil {
		traced := *held
		traced.TraceParent = a.TraceParent
		if reflect.DeepEqual(traced, a) {
			held.TraceParent = a.TraceParent // nothing else holds it: the part is this commit's
		} else {
			held = nil
		}
	}
	if held == nil {
		held = new(contracts.Allocation)
		*held = a
	}
	c.forget(a.ID, "")
	if old, ok := c.allocs[a.ID]; ok {
		c.order.remove(old, len(c.allocs))
	}
	c.allocs[a.ID] = held
	c.order.add(held, len(c.allocs))
	n := c.node(a.NodeID)
	n.held[a.ID] = held
	return n.clear()
}

// committedAlloc is the cluster's committed copy of a, shared by the part
// that has it (nothing changes either in place), or a copy of a of its
// own when the cluster holds another (a fact applied late, Store.ahead:
// released since, or committed again from another plan).
func (c *cluster) committedAlloc(a contracts.Allocation) *contracts.Allocation {
	if held := c.allocs[a.ID]; held != nil && held.PlanID == a.PlanID && held.NodeID == a.NodeID && held.Attempt == a.Attempt {
		return held
	}
	return &a
}

func (c *cluster) release(a contracts.Allocation) {
	c.forget(a.ID, "")
	if held, ok := c.allocs[a.ID]; ok {
		a = *held
		c.order.remove(held, len(c.allocs))
	}
	delete(c.allocs, a.ID)
	n := c.node(a.NodeID)
	delete(n.held, a.ID)
	n.clear()
}

// snapshot is what a cycle may place on: ready, non-suspect nodes with an
// inventory, their healthy GPUs with what is held of each (whole, MIG
// instances, shares; devices claimed for preemptors too), and host
// capacity left.
func (c *cluster) snapshot(now time.Time) placement.Snapshot {
	snap := placement.Snapshot{Nodes: make([]placement.Node, 0, len(c.ids))}
	for _, id := range c.ids {
		if pn, ok := c.nodeSnapshot(id, now, ""); ok {
			snap.Nodes = append(snap.Nodes, pn)
		}
	}
	return snap
}

// nodeSnapshot is node id as snapshot has it, with every claim but the
// one of job skip ("" for none); false when it takes no work.
func (c *cluster) nodeSnapshot(id string, now time.Time, skip string) (placement.Node, bool) {
	n := c.nodes[id]
	if (n.suspect || len(n.suspectGPUs) > 0) && !now.Before(n.suspectUntil) {
		n.clear()
	}
	if n.lost || n.suspect || n.inv == nil {
		return placement.Node{}, false
	}
	// The GPUs (and their MIG instance lists) are shared with the cached
	// snapshot, copy on write: what holds devices on a snapshot node
	// (holdOn: claims, a preemption's decisions) copies what it changes,
	// and the placer, backfill and preempt never change their input.
	// Copying every node's GPUs, twice a cycle, was most of a steady
	// cycle's snapshots at 10,000 machines.
	var pn placement.Node
	if n.snapOK && n.snapVer == n.ver && !c.noSnapCache {
		pn = n.snap
	} else {
		pn = c.nodeBase(id, n)
		n.snap, n.snapVer, n.snapOK = pn, n.ver, true
	}
	// Claims are few (a preemptor's, while its victims stop).
	for key, cl := range c.claims {
		if key == skip {
			continue
		}
		for _, p := range cl.parts {
			if p.NodeID == id {
				c.holdClaim(&pn, cl, p)
			}
		}
	}
	return pn, true
}

// nodeBase is n, ready and not suspect, as a snapshot has it before
// claims: its healthy GPUs and host capacity less what it holds.
func (c *cluster) nodeBase(id string, n *nodeState) placement.Node {
	inv := n.inv
	pn := placement.Node{ID: id, Pool: inv.Pool, Zone: inv.Zone, Labels: inv.Labels, Taints: inv.Taints,
		Cordoned:     n.admin != nil && (n.admin.Cordoned || n.admin.Drain),
		CPUMilliFree: inv.CPUMilli, MemoryMiBFree: inv.MemoryMiB,
		CPUMilliCapacity: max(inv.CPUMilli, 0), MemoryMiBCapacity: max(inv.MemoryMiB, 0),
		GPUs: make([]placement.GPU, 0, len(inv.GPUs))}
	for _, g := range inv.GPUs {
		if !g.Healthy || gpuHeld(n.admin, g.UUID) {
			continue
		}
		pg := placement.GPU{Index: g.Index, UUID: g.UUID, Model: g.Model, MemoryMiB: g.MemoryMiB,
			NVLinkDomain: g.NVLinkDomain, MIG: g.MIGEnabled, Held: n.suspectGPUs[g.UUID]}
		if g.MIGEnabled {
			pg.Instances = make([]placement.MIGSlot, len(g.MIGInstances))
			for i, mi := range g.MIGInstances {
				pg.Instances[i] = placement.MIGSlot{Instance: mi}
			}
		}
		pn.GPUs = append(pn.GPUs, pg)
	}
	// An inventory without host figures does not limit CPU or memory
	// (the resource manager does not check them either).
	if inv.CPUMilli <= 0 {
		pn.CPUMilliFree = unlimited
	}
	if inv.MemoryMiB <= 0 {
		pn.MemoryMiBFree = unlimited
	}
	for _, a := range n.held {
		holdOnOwn(&pn, a.CPUMilli, a.MemoryMiB, a.Devices) // pn's GPUs are its own yet
	}
	return pn
}

// holdClaim marks part p of claim cl held on pn. What its victims still
// hold there is held already: a card's share and the host's CPU and memory
// count the larger of the two, not their sum, or a claim checked while
// another's victims stop would find its card overfull.
func (c *cluster) holdClaim(pn *placement.Node, cl *claim, p placement.Part) {
	cpu, mem := cl.cpuMilli, cl.memoryMiB
	type share struct {
		mem int64
		pct int
	}
	var still map[string]share
	for _, id := range cl.victims {
		a, ok := c.allocs[id]
		if !ok || a.NodeID != p.NodeID {
			continue
		}
		cpu -= a.CPUMilli
		mem -= a.MemoryMiB
		for _, d := range a.Devices {
			if d.Share != nil && d.MIG == nil {
				if still == nil {
					still = map[string]share{}
				}
				sh := still[d.UUID]
				still[d.UUID] = share{sh.mem + d.Share.MemoryMiB, sh.pct + d.Share.ComputePercent}
			}
		}
	}
	devs := p.Devices
	if still != nil {
		devs = slices.Clone(devs)
		for i, d := range devs {
			if sh, ok := still[d.UUID]; ok && d.Share != nil && d.MIG == nil {
				devs[i].Share = &contracts.GPUShare{MemoryMiB: max(0, d.Share.MemoryMiB-sh.mem),
					ComputePercent: max(0, d.Share.ComputePercent-sh.pct)}
			}
		}
	}
	holdOn(pn, max(cpu, 0), max(mem, 0), devs)
}

// holdOn marks devs and host resources held on pn, a snapshot's node,
// whose GPUs and MIG instance lists may be shared (nodeSnapshot): it
// changes copies of them.
func holdOn(pn *placement.Node, cpu, mem int64, devs []contracts.DeviceRef) {
	if len(devs) > 0 {
		pn.GPUs = slices.Clone(pn.GPUs)
	}
	hold(pn, cpu, mem, devs, true)
}

// holdOnOwn is holdOn on a node whose GPUs and MIG instance lists are its
// own (being built): it changes them in place.
func holdOnOwn(pn *placement.Node, cpu, mem int64, devs []contracts.DeviceRef) {
	hold(pn, cpu, mem, devs, false)
}

// hold marks devs and host resources held on pn; shared: a MIG instance
// list is copied before a slot is marked.
func hold(pn *placement.Node, cpu, mem int64, devs []contracts.DeviceRef, shared bool) {
	pn.CPUMilliFree -= cpu
	pn.MemoryMiBFree -= mem
	for _, d := range devs {
		i := slices.IndexFunc(pn.GPUs, func(g placement.GPU) bool { return g.UUID == d.UUID })
		if i < 0 {
			continue
		}
		g := &pn.GPUs[i]
		switch {
		case d.MIG != nil:
			if shared {
				g.Instances = slices.Clone(g.Instances)
			}
			for k := range g.Instances {
				if g.Instances[k].Instance.UUID == d.MIG.UUID {
					g.Instances[k].Held = true
				}
			}
		case d.Share != nil:
			g.ShareMemMiB += d.Share.MemoryMiB
			g.SharePercent += d.Share.ComputePercent
		default:
			g.Held = true
		}
	}
}

// gpuHeld reports whether a hold of its own keeps new work off GPU uuid
// (a node's cordon is the node's: placement explains it per node).
func gpuHeld(a *contracts.NodeAdmin, uuid string) bool {
	if a == nil {
		return false
	}
	h, ok := a.GPUs[uuid]
	return ok && (h.Cordoned || h.Drain)
}

// pools lists every pool a node ever announced, ready or not.
func (c *cluster) pools() []string {
	var out []string
	for _, n := range c.nodes {
		if n.inv != nil && !slices.Contains(out, n.inv.Pool) {
			out = append(out, n.inv.Pool)
		}
	}
	slices.Sort(out)
	return out
}

// ---- facts ----

// ApplyInventory records a node's latest inventory.
func (s *Store) ApplyInventory(inv contracts.NodeInventory) {
	c := s.cluster
	n := c.node(inv.NodeID)
	if n.inv == nil {
		i, _ := slices.BinarySearch(c.ids, inv.NodeID)
		c.ids = slices.Insert(c.ids, i, inv.NodeID)
	}
	c.sizes.add(c.migKinds, n.inv, -1)
	c.sizes.add(c.migKinds, &inv, +1)
	c.indexImages(n, inventoryImages(inv.Images))
	n.inv = &inv
	n.clear()
	s.cfg.Wake()
}

// ApplyNodeEvent records a lifecycle fact: a lost node takes no new work
// (its allocations come back through the ledger as node_lost releases).
func (s *Store) ApplyNodeEvent(ev contracts.NodeEvent) {
	n := s.cluster.node(ev.NodeID)
	switch ev.Kind {
	case contracts.NodeLost:
		n.lost = true
	case contracts.NodeRegistered, contracts.NodeReturned:
		n.lost = false
		n.clear()
	}
	s.cfg.Wake()
}

// ApplyLedger records a ledger entry and advances its job.
func (s *Store) ApplyLedger(e contracts.LedgerEntry) []Publish {
	switch e.Kind {
	case contracts.LedgerCommitted:
		// A commit moves devices from assumed to committed: nothing new is
		// free, so no cycle is needed unless it cleared a suspect node.
		if s.cluster.commit(e.Allocation) {
			s.cfg.Wake()
		}
	case contracts.LedgerReleased:
		s.cluster.release(e.Allocation)
		s.cfg.Wake()
	}
	s.ledgerFact(e)
	return s.take()
}

// ledgerFact applies a ledger entry to its job (the cluster has it).
func (s *Store) ledgerFact(e contracts.LedgerEntry) {
	a := e.Allocation
	j := s.lookup(a.Tenant, a.JobID)
	if s.ahead(j, a.Attempt, func() { s.ledgerFact(e) }) {
		return
	}
	switch e.Kind {
	case contracts.LedgerCommitted:
		if j == nil || a.Attempt != j.Attempt {
			break
		}
		if j.State.Terminal() {
			if s.live {
				// An allocation for a job already ended (it could only come
				// from a plan whose outcome a restart or a failed publish
				// hid, the job being cancelled or timed out since): stop it.
				stray := a
				s.stop(j, &part{alloc: &stray, committed: true}, contracts.ReasonCancelled)
			}
			break
		}
		p := j.part(a.ID)
		if p == nil {
			// Committed from a plan this store does not remember (it was
			// lost with a restart before PLANS had it): adopt it.
			size := 1
			if a.Gang != nil {
				size = max(1, a.Gang.Size)
			}
			if len(j.parts) != size {
				s.landAll(j)
				j.parts = placeholders(a.Tenant, a.JobID, a.Attempt, size)
			}
			rank := 0
			if a.Gang != nil && a.Gang.Rank < size {
				rank = a.Gang.Rank
			}
			p = &part{}
			j.parts[rank] = p
		}
		s.land(p)
		p.alloc, p.committed = s.cluster.committedAlloc(a), true
		// The nodes to avoid bound this attempt's placement, refused plans
		// and retries included; committed, it has served. So has the work
		// a preemption kept from this victim's next attempts.
		if m := j.mv; m != nil {
			m.avoid, m.kept = nil, nil
			j.tidyMoves()
		}
		j.memo = nil // not offered while it runs (fly)
		s.queue.Remove(j.key)
		s.advance(j)
	case contracts.LedgerReleased:
		if j == nil || a.Attempt != j.Attempt || j.State.Terminal() {
			break
		}
		p := j.part(a.ID)
		if p == nil || !p.committed {
			break
		}
		p.released = &e
		// A release for a run that ended carries its result. One for a
		// lost node carries the resource manager's account of the loss
		// (outcome failed, reason node_lost): that is not the job's end,
		// the job is requeued.
		if e.Run != nil && p.ended == nil && awaitsRunFact(e.Reason) {
			r := *e.Run
			p.ended = &r
		}
		s.advance(j)
	}
}

// ahead keeps apply for later when it is a fact about an attempt of j
// after its current one, and reports whether it did. Requeued events go
// out through the outbox while the next cycle's plan is published at once:
// after a crash in between, JOB_EVENTS ends at the old attempt while the
// ledger and the runs already know the new one. The rebuilt store decides
// the same requeue (same event ID) and then applies these facts, rather
// than dropping them and placing that attempt a second time (the resource
// manager would never commit it again: the job would wait forever).
func (s *Store) ahead(j *Job, attempt int, apply func()) bool {
	if j == nil || j.State.Terminal() || attempt <= j.Attempt {
		return false
	}
	j.later = append(j.later, apply)
	return true
}

// ApplyRefusal forgets what a refused plan item assumed; its job goes back
// to the queue (or, when a cancel waited on the plan, is cancelled). A gang
// with parts already committed releases them first (advance).
func (s *Store) ApplyRefusal(r contracts.Refusal) []Publish {
	c := s.cluster
	if c.forget(r.AllocationID, r.PlanID) {
		s.cfg.Wake()
	}
	j := s.flying[r.AllocationID]
	var p *part
	if j != nil {
		p = j.part(r.AllocationID)
	}
	n := c.node(r.NodeID)
	switch r.Reason {
	case contracts.RefusedUnknownNode, contracts.RefusedNodeNotReady:
		n.suspect = true
		n.suspectUntil = s.cfg.Now().Add(suspectBackoff)
	case contracts.RefusedDeviceTaken:
		// Nothing to sit out: the refusal comes on ALLOCATIONS after every
		// ledger entry the resource manager checked against, and this
		// store reads that stream in order, so its view already holds
		// whatever took the device.
	case contracts.RefusedUnknownDevice, contracts.RefusedModelMismatch:
		// The refusal does not say which device; hold the ones the item
		// named until the node's next fact (or the backoff).
		if p != nil && p.alloc.PlanID == r.PlanID {
			n.suspectUntil = s.cfg.Now().Add(suspectBackoff)
			if n.suspectGPUs == nil {
				n.suspectGPUs = map[string]bool{}
			}
			for _, d := range p.alloc.Devices {
				n.suspectGPUs[d.UUID] = true
			}
		}
	}
	if p == nil || !p.inFlight || p.alloc.PlanID != r.PlanID {
		return s.take() // stale: a newer plan or the ledger already answered
	}
	s.land(p)
	if j.State != contracts.StateQueued || j.count(func(p *part) bool { return p.inFlight }) > 0 {
		return s.take() // the other parts' answers decide
	}
	if j.count(func(p *part) bool { return p.committed }) > 0 {
		if j.evict == "" {
			j.evict = contracts.ReasonGangIncomplete
			j.movesW().evictMsg = fmt.Sprintf("part on %s was refused (%s: %s); the committed parts are released and the gang retried",
				r.NodeID, r.Reason, r.Message)
		}
		s.advance(j)
		return s.take()
	}
	j.parts = nil
	switch {
	case j.cancel && s.live: // while rebuilding, GoLive cancels it (advance)
		s.cancelQueued(j)
	default:
		s.enqueue(j)
		s.setPending(j, placement.Pending{Code: contracts.PendingCommitRefused,
			Message: fmt.Sprintf("the resource manager refused the placement on %s (%s: %s); it will be retried",
				r.NodeID, r.Reason, r.Message)})
	}
	return s.take()
}

// ApplyRun records a run fact and advances its job.
func (s *Store) ApplyRun(r contracts.RunEvent) []Publish {
	s.runFact(r)
	return s.take()
}

func (s *Store) runFact(r contracts.RunEvent) {
	j := s.jobs[Key(r.Tenant, r.JobID)]
	if s.ahead(j, r.Attempt, func() { s.runFact(r) }) {
		return
	}
	if j != nil && r.Kind == contracts.RunCheckpointed && r.Checkpoint != nil && r.Attempt <= j.Attempt {
		// Any attempt's checkpoint is what the next one restores (the
		// agent reads LATEST, whichever attempt wrote it); facts come in
		// stream order, so the last one read is the latest.
		j.lastCheckpoint = r.Checkpoint.Name
	}
	if j == nil || r.Attempt != j.Attempt || j.State.Terminal() {
		return
	}
	p := j.part(r.AllocationID)
	if p == nil {
		// The run fact came before the commit it follows (RUNS and
		// ALLOCATIONS are separate streams): keep it for that commit, in
		// a part of its own (a gang's parts by rank).
		if len(j.parts) != 0 || j.Request == nil {
			return
		}
		j.parts = placeholders(r.Tenant, r.JobID, r.Attempt, j.Request.Resources.GPU.Machines())
		if p = j.part(r.AllocationID); p == nil {
			j.parts = nil
			return
		}
		p.alloc.NodeID = r.NodeID
	}
	switch r.Kind {
	case contracts.RunStarted:
		if p.started == nil {
			t := r.Time
			p.started = &t
		}
	case contracts.RunPulling:
		s.pullingEvent(j, p, r)
		return
	case contracts.RunCheckpointed:
		t := r.Time
		p.checkpointed = &t
		// A checkpoint counts as the move's when it was requested and
		// written after the move was decided (a second of clock skew
		// between scheduler and agent allowed).
		if r.Checkpoint != nil && r.Checkpoint.Requested && !j.moves().evictAt.IsZero() && !t.Before(j.moves().evictAt.Add(-time.Second)) {
			p.askedDone = true
		}
	case contracts.RunEnded:
		if r.Result != nil && r.Result.Reason == contracts.ReasonNodeLost {
			// The agent stopped the run because its allocation was
			// released as node_lost: the release requeues the job.
			break
		}
		if p.ended == nil {
			res := contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: -1, EndedAt: r.Time,
				Reason: contracts.ReasonLaunchFailed, Message: "the agent reported an end without a result"}
			if r.Result != nil {
				res = *r.Result
			}
			p.ended = &res
		}
	}
	s.advance(j)
}

// movedBy are the stop reasons that move a job rather than end it: a run
// that ended for one of them is requeued as the next attempt.
func movedBy(r contracts.Reason) bool {
	return r == contracts.ReasonPreempted || r == contracts.ReasonGangIncomplete || r == contracts.ReasonRunTimeExceeded ||
		migrates(r)
}

// advance moves j as far as its recorded facts allow, publishing one event
// per step. It is idempotent: with no new fact it publishes nothing.
func (s *Store) advance(j *Job) {
	if !s.live {
		return
	}
	for range 4 { // at most scheduled, running, then an end: the loop is bounded
		switch j.State {
		case contracts.StateQueued:
			if !s.advanceQueued(j) {
				return
			}
		case contracts.StateScheduled, contracts.StateRunning:
			if !s.advanceHeld(j) {
				return
			}
		default:
			return
		}
	}
}

// advanceQueued handles a queued job's plan outcome; it reports whether
// the job moved on (and advance should look again).
func (s *Store) advanceQueued(j *Job) bool {
	n := len(j.parts)
	committed := j.count(func(p *part) bool { return p.committed })
	switch {
	case n > 0 && committed == n && j.evict == "":
		s.queue.Remove(j.key)
		s.landAll(j)
		j.Pending = placement.Pending{}
		pl := placementsOf(j)
		return s.emit(j, contracts.EventScheduled, 0, func(ev *contracts.JobEvent) {
			ev.Placement = &pl[0]
			if len(pl) > 1 {
				ev.Placements = pl
			}
		})
	case j.count(func(p *part) bool { return p.inFlight }) > 0:
		return false
	case committed > 0:
		// A gang committed in part: release what was committed (stop its
		// runs; the releases follow), then retry the whole gang as the
		// next attempt, so no part keeps machines the others never got.
		reason := cmpReason(j.evict, contracts.ReasonGangIncomplete)
		if j.cancel {
			reason = contracts.ReasonCancelled
		}
		for _, p := range j.parts {
			if p.live() && p.stopSent == "" { // once: every fact until the releases comes here
				s.stop(j, p, reason)
			}
		}
		if j.count(func(p *part) bool { return p.committed && p.released == nil }) > 0 {
			return false // wait for every release
		}
		if j.cancel {
			s.cancelQueued(j)
			return false
		}
		s.requeue(j, reason, cmp.Or(j.moves().evictMsg, "a part of the gang was refused; the committed parts were released"))
		return false
	case j.cancel && n == 0:
		s.cancelQueued(j)
	}
	return false
}

// advanceHeld handles a scheduled or running job's run facts.
func (s *Store) advanceHeld(j *Job) bool {
	if len(j.parts) == 0 || j.count(func(p *part) bool { return p.committed }) < len(j.parts) {
		// Every part of a scheduled job was committed, but after a restart
		// the run facts may be read before the commits they follow (or a
		// commit not at all, from a trimmed stream): wait until every
		// part's allocation is known again.
		return false
	}
	stopFor := contracts.Reason("")
	switch {
	case j.cancel:
		stopFor = contracts.ReasonCancelled
	case j.evict != "":
		stopFor = j.evict
	case len(j.parts) > 1 && j.count(func(p *part) bool { return p.done() && !succeeded(p) }) > 0:
		// One machine of a gang failed or is gone: the others cannot go
		// on alone. A part that succeeded is not a reason: the others
		// finish their own work (parts rarely end at the same instant).
		stopFor = contracts.ReasonGangIncomplete
	}
	if stopFor != "" {
		s.stopParts(j, stopFor)
	}
	if j.State == contracts.StateScheduled && j.count(func(p *part) bool {
		return p.started != nil || (p.ended != nil && ranFor(p.ended))
	}) > 0 {
		start := startOf(j)
		pl := placementsOf(j)
		return s.emit(j, contracts.EventRunning, 0, func(ev *contracts.JobEvent) {
			ev.Placement, ev.StartedAt = &pl[0], &start
			if len(pl) > 1 {
				ev.Placements = pl
			}
		})
	}
	if j.State == contracts.StateRunning && j.moves().moved != nil && j.evict == "" && !j.cancel {
		s.migrated(j)
	}
	if j.count(func(p *part) bool { return p.done() }) < len(j.parts) {
		return false
	}
	s.conclude(j)
	return false
}

// conclude decides the outcome of an attempt whose parts are all done.
func (s *Store) conclude(j *Job) {
	var failed, lost, moved *part
	for _, p := range j.parts {
		switch {
		case p.ended == nil, lostWith(p.ended.Reason) && p.ended.Outcome != contracts.OutcomeSucceeded:
			lost = cmpPart(lost, p)
		case movedBy(p.ended.Reason) && p.ended.Outcome != contracts.OutcomeSucceeded:
			moved = cmpPart(moved, p)
		case p.ended.Outcome != contracts.OutcomeSucceeded:
			failed = cmpPart(failed, p)
		}
	}
	switch {
	case j.cancel:
		var r *contracts.RunResult
		for _, p := range j.parts {
			if p.ended != nil && (r == nil || p.ended.Outcome == contracts.OutcomeFailed) {
				r = p.ended
			}
		}
		if r != nil {
			res := *r
			if movedBy(res.Reason) || lostWith(res.Reason) {
				res.Outcome, res.Reason = contracts.OutcomeCancelled, contracts.ReasonCancelled
			}
			s.end(j, res)
			return
		}
		rel := lost.released
		if s.emit(j, contracts.EventCancelled, 0, func(ev *contracts.JobEvent) {
			ev.Reason = contracts.ReasonCancelled
			ev.Message = fmt.Sprintf("cancelled; its allocation on %s was released (%s)", rel.Allocation.NodeID, rel.Reason)
		}) {
			s.finish(j)
		}
	case failed != nil && failed.started == nil && retriesLaunch(failed.ended.Reason) && j.launchRetries < MaxLaunchRetries:
		// The run never started for a reason of the machine or the
		// moment (runtime.go): a new attempt, a few times, before the job
		// fails with it.
		j.launchRetries++
		r := failed.ended
		s.requeue(j, r.Reason, fmt.Sprintf("the run could not start on %s (%s: %s); retry %d of %d",
			failed.alloc.NodeID, r.Reason, r.Message, j.launchRetries, MaxLaunchRetries))
	case failed != nil && failed.ended.Reason != contracts.ReasonGangIncomplete:
		s.end(j, *failed.ended)
	case lost != nil && lost.ended != nil:
		// The run died with its node agent (a restart quicker than the
		// heartbeat timeout): lost through no fault of its own, exactly
		// as when the machine was declared lost, so requeued the same way.
		reason := lost.ended.Reason
		s.requeue(j, reason, fmt.Sprintf("the run of allocation %s on %s was lost (%s)", lost.alloc.ID, lost.alloc.NodeID, reason))
	case lost != nil:
		rel := lost.released
		reason := cmpReason(rel.Reason, contracts.ReasonNodeLost)
		s.requeue(j, reason, fmt.Sprintf("allocation %s on %s was released (%s) before the run ended",
			rel.Allocation.ID, rel.Allocation.NodeID, reason))
	case moved != nil:
		// Only a part that was actually stopped moves the job: a victim
		// (or drained job) whose run succeeded before its stop took effect
		// did its work, and ends below like any other.
		reason := cmpReason(j.evict, moved.ended.Reason)
		msg := cmp.Or(j.moves().evictMsg, moved.ended.Message, "stopped on "+moved.alloc.NodeID+" ("+string(reason)+")")
		s.requeue(j, reason, msg)
	case failed != nil:
		s.end(j, *failed.ended)
	default:
		// Every part succeeded: the job's result is the last to end.
		last := j.parts[0].ended
		for _, p := range j.parts[1:] {
			if p.ended.EndedAt.After(last.EndedAt) {
				last = p.ended
			}
		}
		s.end(j, *last)
	}
}

// lostWith reports whether a run that ended with reason r was lost through
// no fault of its own: its machine was declared lost (node_lost), or its
// node agent restarted and found it gone (agent_restarted, when the agent
// came back before the heartbeat timeout). Which of the two is reported
// depends only on how long the agent was away, so both requeue the job
// (the next attempt restores the job's latest checkpoint, as any does).
func lostWith(r contracts.Reason) bool {
	return r == contracts.ReasonNodeLost || r == contracts.ReasonAgentRestart
}

func cmpPart(cur, p *part) *part {
	if cur == nil {
		return p
	}
	return cur
}

// awaitsRunFact reports whether a release without a run result is only the
// echo of a run end the RUNS stream has not shown yet: the end decides the
// job's outcome, so nothing is done until it arrives. Other releases (node
// lost, agent restarted) took the allocation away from a live run.
func awaitsRunFact(r contracts.Reason) bool {
	return r == contracts.ReasonRunEnded || r == contracts.ReasonCancelled || movedBy(r)
}

// succeeded reports whether the part's run ended by itself with success.
func succeeded(p *part) bool {
	return p.ended != nil && p.ended.Outcome == contracts.OutcomeSucceeded
}

// ranFor reports whether an end fact implies the run started.
func ranFor(r *contracts.RunResult) bool {
	return !r.StartedAt.IsZero() || r.Outcome == contracts.OutcomeSucceeded
}

// startOf is when the job's first part started.
func startOf(j *Job) time.Time {
	var first time.Time
	for _, p := range j.parts {
		var t time.Time
		switch {
		case p.started != nil:
			t = *p.started
		case p.ended != nil && !p.ended.StartedAt.IsZero():
			t = p.ended.StartedAt
		case p.ended != nil:
			t = p.ended.EndedAt
		default:
			continue
		}
		if first.IsZero() || t.Before(first) {
			first = t
		}
	}
	return first
}

// placementsOf lists where the current attempt's parts are, by rank.
func placementsOf(j *Job) []contracts.Placement {
	out := make([]contracts.Placement, 0, len(j.parts))
	for _, p := range j.parts {
		a := p.alloc
		out = append(out, contracts.Placement{AllocationID: a.ID, NodeID: a.NodeID, Pool: a.Pool, Devices: a.Devices})
	}
	return out
}

// end publishes the terminal event a run result calls for.
func (s *Store) end(j *Job, r contracts.RunResult) {
	typ, reason := contracts.EventFailed, r.Reason
	switch r.Outcome {
	case contracts.OutcomeSucceeded:
		typ = contracts.EventSucceeded
	case contracts.OutcomeCancelled:
		typ, reason = contracts.EventCancelled, cmpReason(reason, contracts.ReasonCancelled)
	default:
		if reason == "" && r.ExitCode != 0 {
			reason = contracts.ReasonExitNonZero
		}
	}
	code := r.ExitCode
	ended := r.EndedAt
	var started *time.Time
	if j.State == contracts.StateRunning || ranFor(&r) {
		t := startOf(j)
		started = &t
	}
	if s.emit(j, typ, 0, func(ev *contracts.JobEvent) {
		ev.ExitCode, ev.StartedAt, ev.EndedAt = &code, started, &ended
		ev.Reason, ev.Message = reason, r.Message
	}) {
		s.finish(j)
	}
}

func cmpReason(r, def contracts.Reason) contracts.Reason {
	if r == "" {
		return def
	}
	return r
}

// requeue puts j back in the queue as its next attempt: its allocation was
// released before its run ended (node lost), or the scheduler moved it
// (preempted, drained, a gang committed in part).
func (s *Store) requeue(j *Job, reason contracts.Reason, msg string) {
	next := j.Attempt + 1
	from := j.State
	to, err := contracts.Transition(j.State, contracts.EventRequeued)
	if err != nil {
		s.log.Error("refusing to requeue", "tenant", j.Tenant, "job_id", j.ID, "err", err)
		return
	}
	ev := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: contracts.EventRequeued, Tenant: j.Tenant,
		JobID: j.ID, Attempt: next, State: to, Time: s.cfg.Now().UTC(), Reason: reason,
		Message: fmt.Sprintf("%s; requeued as attempt %d", msg, next)}
	s.out = append(s.out, Publish{Subject: contracts.SubjectJobEvents(j.Tenant, j.ID), Key: j.key, Msg: ev,
		ID: contracts.JobEventID(j.Tenant, j.ID, contracts.EventRequeued, next, 0)})
	j.State = to
	s.keepMove(j)
	s.resetAttempt(j, next)
	if from != contracts.StateQueued {
		// It was placed: its placement timeout counts from now. A gang
		// never committed in full still waits for its first placement.
		j.queuedAt = stampOf(ev.Time)
	}
	s.enqueue(j)
	s.cfg.Wake()
	// Plan items and facts of the new attempt that came before this
	// decision (ahead).
	s.adoptInFlight(j)
	later := j.later
	j.later = nil
	for _, apply := range later {
		apply()
	}
}

// adoptInFlight takes over the plan items of j's (new) attempt that a
// rebuild found unanswered (ReplayPlan): the job waits for their answers
// rather than being placed again. Parts answered already are left to the
// facts kept for them (a commit adopts its part; a refused one stays
// refused).
func (s *Store) adoptInFlight(j *Job) {
	if j.Request == nil {
		return
	}
	parts := placeholders(j.Tenant, j.ID, j.Attempt, j.Request.Resources.GPU.Machines())
	found := false
	for i, p := range parts {
		id := p.alloc.ID
		if a := s.cluster.plans[id]; a != nil && a.Attempt == j.Attempt {
			cp := *a
			parts[i] = &part{alloc: &cp, inFlight: true}
			s.flying[id] = j
			found = true
		}
	}
	if !found {
		return
	}
	j.parts = parts
	s.queue.Remove(j.key)
	j.Pending = placement.Pending{Code: contracts.PendingPlanInFlight,
		Message: "proposed in a plan before a restart; waiting for the resource manager to commit"}
}

// cancelQueued cancels a job that holds nothing.
func (s *Store) cancelQueued(j *Job) {
	msg := "cancelled by the user before placement"
	if j.cancelReason != "" {
		msg += ": " + j.cancelReason
	}
	if s.emit(j, contracts.EventCancelled, 0, func(ev *contracts.JobEvent) {
		ev.Reason, ev.Message = contracts.ReasonCancelled, msg
	}) {
		s.finish(j)
		s.cfg.Wake()
	}
}

// stop asks the agent of p's node to stop (or never start) p's run, for
// reason. A job being moved gets the preemption grace period (shortened to
// fit before a deadline) to exit cleanly; its checkpoint was asked for
// and waited for before (stopParts).
func (s *Store) stop(j *Job, p *part, reason contracts.Reason) {
	p.stopSent = reason
	a := p.alloc
	now := s.cfg.Now().UTC()
	var grace contracts.Duration
	if movedBy(reason) {
		g := s.cfg.PreemptGrace
		if !j.moves().evictBy.IsZero() {
			g = min(g, max(time.Second, j.moves().evictBy.Sub(now)-deadlineMargin))
		}
		grace = contracts.Duration(g)
	}
	cmd := contracts.NodeCommand{SchemaVersion: contracts.SchemaVersion, Kind: contracts.CommandStopRun,
		AllocationID: a.ID, Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, Reason: reason,
		GracePeriod: grace, Time: now}
	s.out = append(s.out, Publish{Subject: contracts.SubjectNodeCommands(a.NodeID), Key: j.key, Msg: cmd,
		ID: contracts.NodeCommandID(contracts.CommandStopRun, a.ID)})
}

// placeholders returns the parts of an attempt spread over machines
// machines (at least one), none of them known yet. They exist because
// facts arrive out of order (a run fact before its commit, RUNS and
// ALLOCATIONS being separate streams; a commit whose plan a restart lost;
// a plan item found in flight on rebuild): a fact finds its part by the
// allocation ID alone, so each placeholder carries the ID its plan item
// has, by rank, and nothing else. Neither in flight nor committed, it
// holds no device and counts as not placed until a fact fills it in.
func placeholders(tenant, jobID string, attempt, machines int) []*part {
	parts := make([]*part, max(machines, 1))
	for rank := range parts {
		parts[rank] = &part{alloc: &contracts.Allocation{ID: partID(tenant, jobID, attempt, rank, len(parts))}}
	}
	return parts
}

// partID is the allocation ID of part rank of an attempt on machines
// machines: AllocationID for one machine, AllocationPartID for a gang.
func partID(tenant, jobID string, attempt, rank, machines int) string {
	if machines > 1 {
		return contracts.AllocationPartID(tenant, jobID, attempt, rank)
	}
	return contracts.AllocationID(tenant, jobID, attempt)
}
