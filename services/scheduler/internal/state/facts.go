package state

import (
	"fmt"
	"slices"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// cluster is the scheduler's view of nodes and devices. A device is held
// when the ledger has it committed or a plan in flight assumed it; it is
// released only by a ledger release, a refusal, or a failed plan publish,
// never by a timer.
type cluster struct {
	nodes map[string]*nodeState
	ids   []string // sorted node IDs with an inventory
	// committed and assumed map a GPU UUID to the allocation holding it.
	committed map[string]string
	assumed   map[string]string
	allocs    map[string]contracts.Allocation // committed, not yet released
	plans     map[string]*contracts.Allocation
}

type nodeState struct {
	inv  *contracts.NodeInventory
	lost bool
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
}

// suspectBackoff is how long a refused node or device sits out when no
// newer fact about it clears it first.
const suspectBackoff = time.Second

func newCluster() *cluster {
	return &cluster{nodes: map[string]*nodeState{}, committed: map[string]string{}, assumed: map[string]string{},
		allocs: map[string]contracts.Allocation{}, plans: map[string]*contracts.Allocation{}}
}

func (c *cluster) node(id string) *nodeState {
	n := c.nodes[id]
	if n == nil {
		n = &nodeState{}
		c.nodes[id] = n
	}
	return n
}

// clear forgets what made a node suspect (a newer fact about it arrived)
// and reports whether there was anything to forget.
func (n *nodeState) clear() bool {
	was := n.suspect || len(n.suspectGPUs) > 0
	n.suspect, n.suspectGPUs = false, nil
	return was
}

func (c *cluster) assume(a *contracts.Allocation) {
	c.plans[a.ID] = a
	for _, d := range a.Devices {
		if c.assumed[d.UUID] == "" {
			c.assumed[d.UUID] = a.ID
		}
	}
}

// forget drops the assumption of allocation id made by plan planID (any
// plan when planID is empty).
func (c *cluster) forget(id, planID string) bool {
	a := c.plans[id]
	if a == nil || (planID != "" && a.PlanID != planID) {
		return false
	}
	delete(c.plans, id)
	for _, d := range a.Devices {
		if c.assumed[d.UUID] == id {
			delete(c.assumed, d.UUID)
		}
	}
	return true
}

// commit records a committed allocation and reports whether it cleared a
// suspect node (which may let waiting jobs fit again).
func (c *cluster) commit(a contracts.Allocation) bool {
	c.forget(a.ID, "")
	c.allocs[a.ID] = a
	for _, d := range a.Devices {
		c.committed[d.UUID] = a.ID
	}
	return c.node(a.NodeID).clear()
}

func (c *cluster) release(a contracts.Allocation) {
	c.forget(a.ID, "")
	if held, ok := c.allocs[a.ID]; ok {
		a = held
	}
	delete(c.allocs, a.ID)
	for _, d := range a.Devices {
		if c.committed[d.UUID] == a.ID {
			delete(c.committed, d.UUID)
		}
	}
	c.node(a.NodeID).clear()
}

// snapshot is what a cycle may place on: ready, non-suspect nodes with an
// inventory, their healthy GPUs, free unless held.
func (c *cluster) snapshot(now time.Time) placement.Snapshot {
	snap := placement.Snapshot{Nodes: make([]placement.Node, 0, len(c.ids))}
	for _, id := range c.ids {
		n := c.nodes[id]
		if (n.suspect || len(n.suspectGPUs) > 0) && !now.Before(n.suspectUntil) {
			n.clear()
		}
		if n.lost || n.suspect {
			continue
		}
		pn := placement.Node{ID: id, Pool: n.inv.Pool, GPUs: make([]placement.GPU, 0, len(n.inv.GPUs))}
		for _, g := range n.inv.GPUs {
			// A GPU in MIG mode is only its MIG instances: the ledger
			// refuses it whole (mig_enabled), and MIG requests come later.
			if !g.Healthy || g.MIGEnabled {
				continue
			}
			free := c.committed[g.UUID] == "" && c.assumed[g.UUID] == "" && !n.suspectGPUs[g.UUID]
			pn.GPUs = append(pn.GPUs, placement.GPU{Index: g.Index, UUID: g.UUID, Model: g.Model,
				MemoryMiB: g.MemoryMiB, Free: free})
		}
		snap.Nodes = append(snap.Nodes, pn)
	}
	return snap
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
	a := e.Allocation
	j := s.jobs[Key(a.Tenant, a.JobID)]
	switch e.Kind {
	case contracts.LedgerCommitted:
		// A commit moves devices from assumed to committed: nothing new is
		// free, so no cycle is needed unless it cleared a suspect node.
		if s.cluster.commit(a) {
			s.cfg.Wake()
		}
		if j == nil || a.Attempt != j.Attempt {
			break
		}
		if j.State == contracts.StateCancelled && s.live {
			// An allocation for a job already cancelled (it could only
			// come from a plan whose outcome a restart hid): stop it.
			s.stop(j, a)
			break
		}
		if j.State.Terminal() {
			break
		}
		if j.inFlight != nil && j.inFlight.ID == a.ID {
			s.land(j)
		}
		if j.committed == nil {
			j.committed = &a
		}
		s.queue.Remove(j.key)
		s.advance(j)
	case contracts.LedgerReleased:
		s.cluster.release(a)
		s.cfg.Wake()
		if j == nil || a.Attempt != j.Attempt || j.State.Terminal() || j.committed == nil {
			break
		}
		j.released = &e
		// A release for a run that ended carries its result. One for a
		// lost node carries the resource manager's account of the loss
		// (outcome failed, reason node_lost): that is not the job's end,
		// the job is requeued (advance -> lost).
		if e.Run != nil && j.ended == nil && awaitsRunFact(e.Reason) {
			r := *e.Run
			j.ended = &r
		}
		s.advance(j)
	}
	return s.take()
}

// ApplyRefusal forgets what a refused plan item assumed; its job goes back
// to the queue (or, when a cancel waited on the plan, is cancelled).
func (s *Store) ApplyRefusal(r contracts.Refusal) []Publish {
	c := s.cluster
	if c.forget(r.AllocationID, r.PlanID) {
		s.cfg.Wake()
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
		if j := s.flying[r.AllocationID]; j != nil && j.inFlight.PlanID == r.PlanID {
			n.suspectUntil = s.cfg.Now().Add(suspectBackoff)
			if n.suspectGPUs == nil {
				n.suspectGPUs = map[string]bool{}
			}
			for _, d := range j.inFlight.Devices {
				n.suspectGPUs[d.UUID] = true
			}
		}
	}
	j := s.flying[r.AllocationID]
	if j == nil || j.inFlight.PlanID != r.PlanID {
		return s.take() // stale: a newer plan or the ledger already answered
	}
	s.land(j)
	switch {
	case j.State != contracts.StateQueued:
	case j.cancel:
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
	j := s.jobs[Key(r.Tenant, r.JobID)]
	if j == nil || r.Attempt != j.Attempt || j.State.Terminal() {
		return nil
	}
	switch r.Kind {
	case contracts.RunStarted:
		if j.started == nil {
			t := r.Time
			j.started = &t
		}
	case contracts.RunEnded:
		if r.Result != nil && r.Result.Reason == contracts.ReasonNodeLost {
			// The agent stopped the run because its allocation was
			// released as node_lost: the release requeues the job.
			break
		}
		if j.ended == nil {
			res := contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: -1, EndedAt: r.Time,
				Reason: contracts.ReasonLaunchFailed, Message: "the agent reported an end without a result"}
			if r.Result != nil {
				res = *r.Result
			}
			j.ended = &res
		}
	}
	s.advance(j)
	return s.take()
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
			switch {
			case j.committed != nil:
				a := j.committed
				s.queue.Remove(j.key)
				s.land(j)
				j.Pending = placement.Pending{}
				p := &contracts.Placement{AllocationID: a.ID, NodeID: a.NodeID, Pool: a.Pool, Devices: a.Devices}
				if !s.emit(j, contracts.EventScheduled, 0, func(ev *contracts.JobEvent) { ev.Placement = p }) {
					return
				}
				continue
			case j.cancel && j.inFlight == nil:
				s.cancelQueued(j)
			}
			return
		case contracts.StateScheduled, contracts.StateRunning:
			if j.cancel && !j.stopSent && j.ended == nil && j.released == nil && j.committed != nil {
				s.stop(j, *j.committed)
			}
			if j.State == contracts.StateScheduled && (j.started != nil || (j.ended != nil && ranFor(j.ended))) {
				start := startOf(j)
				if !s.emit(j, contracts.EventRunning, 0, func(ev *contracts.JobEvent) {
					ev.Placement, ev.StartedAt = placementOf(j), &start
				}) {
					return
				}
				continue
			}
			switch {
			case j.ended != nil:
				s.end(j)
			case j.released != nil && !awaitsRunFact(j.released.Reason):
				s.lost(j)
			}
			return
		default:
			return
		}
	}
}

// awaitsRunFact reports whether a release without a run result is only the
// echo of a run end the RUNS stream has not shown yet: the end decides the
// job's outcome, so nothing is done until it arrives. Other releases (node
// lost, agent restarted) took the allocation away from a live run.
func awaitsRunFact(r contracts.Reason) bool {
	return r == contracts.ReasonRunEnded || r == contracts.ReasonCancelled
}

// ranFor reports whether an end fact implies the run started.
func ranFor(r *contracts.RunResult) bool {
	return !r.StartedAt.IsZero() || r.Outcome == contracts.OutcomeSucceeded
}

func startOf(j *Job) time.Time {
	switch {
	case j.started != nil:
		return *j.started
	case j.ended != nil && !j.ended.StartedAt.IsZero():
		return j.ended.StartedAt
	case j.ended != nil:
		return j.ended.EndedAt
	}
	return time.Time{}
}

func placementOf(j *Job) *contracts.Placement {
	if a := j.committed; a != nil {
		return &contracts.Placement{AllocationID: a.ID, NodeID: a.NodeID, Pool: a.Pool, Devices: a.Devices}
	}
	return nil
}

// end publishes the terminal event the run's result calls for.
func (s *Store) end(j *Job) {
	r := *j.ended
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

// lost handles an allocation released before its run ended (node lost):
// the job goes back to the queue as a new attempt, unless the user already
// asked to cancel it.
func (s *Store) lost(j *Job) {
	rel := j.released
	if j.cancel {
		if s.emit(j, contracts.EventCancelled, 0, func(ev *contracts.JobEvent) {
			ev.Reason = contracts.ReasonCancelled
			ev.Message = fmt.Sprintf("cancelled; its allocation on %s was released (%s)", rel.Allocation.NodeID, rel.Reason)
		}) {
			s.finish(j)
		}
		return
	}
	next := j.Attempt + 1
	if _, err := contracts.Transition(j.State, contracts.EventRequeued); err != nil {
		s.log.Error("refusing to requeue", "tenant", j.Tenant, "job_id", j.ID, "err", err)
		return
	}
	to := contracts.StateQueued
	ev := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: contracts.EventRequeued, Tenant: j.Tenant,
		JobID: j.ID, Attempt: next, State: to, Time: s.cfg.Now().UTC(), Reason: cmpReason(rel.Reason, contracts.ReasonNodeLost),
		Message: fmt.Sprintf("allocation %s on %s was released (%s) before the run ended; requeued as attempt %d",
			rel.Allocation.ID, rel.Allocation.NodeID, cmpReason(rel.Reason, contracts.ReasonNodeLost), next)}
	s.out = append(s.out, Publish{Subject: contracts.SubjectJobEvents(j.Tenant, j.ID), Key: j.key, Msg: ev,
		ID: contracts.JobEventID(j.Tenant, j.ID, contracts.EventRequeued, next, 0)})
	j.State = to
	s.resetAttempt(j, next)
	s.enqueue(j)
	s.cfg.Wake()
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

// stop asks the agent of a's node to stop (or never start) a's run.
func (s *Store) stop(j *Job, a contracts.Allocation) {
	j.stopSent = true
	cmd := contracts.NodeCommand{SchemaVersion: contracts.SchemaVersion, Kind: contracts.CommandStopRun,
		AllocationID: a.ID, Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, Reason: contracts.ReasonCancelled,
		Time: s.cfg.Now().UTC()}
	s.out = append(s.out, Publish{Subject: contracts.SubjectNodeCommands(a.NodeID), Key: j.key, Msg: cmd,
		ID: contracts.NodeCommandID(contracts.CommandStopRun, a.ID)})
}
