package gateway

import (
	"cmp"
	"context"
	"maps"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// nodeModel is the gateway's view of the fleet: the latest inventory and
// lifecycle fact of each node, folded from the NODES stream, less the
// machines the autoscaler deleted or the provider took back (their
// machine events, on OPS). It is rebuilt from the streams at every start.
// Applies are idempotent by stream sequence or time, so a replay or a
// redelivery changes nothing.
type nodeModel struct {
	mu    sync.RWMutex
	nodes map[string]*nodeEntry
	// holds are the node holds (BucketNodeAdmin: cordons and drains of
	// nodes and of single GPUs, by administrators or the platform), by
	// node ID, folded from a KV watch; a node may be held before its
	// agent ever published an inventory.
	holds map[string]nodeHold
	// changed, when set, is told of every node that changed (the fleet
	// hub's versions, fleet_events.go); it is called under mu, so it must
	// take no lock of the model.
	changed func(node string)
}

// nodeHold is a node's hold at a KV revision; admin nil: released.
type nodeHold struct {
	admin *contracts.NodeAdmin
	rev   uint64
}

type nodeEntry struct {
	status          contracts.NodeStatus
	invSeq, lifeSeq uint64
	// gone is the last machine event that took the node's machine away
	// (deleted, reclaimed); nil while none did.
	gone *contracts.MachineEvent
}

// removed reports whether the node's machine was taken away after its
// last inventory: the agent of a machine that went on purpose stops
// heartbeating, and the resource manager's verdict on that silence,
// lost, is not what happened to it. A later inventory (the same node ID
// on a new machine) brings the node back. The two facts come from two
// streams, so they are ordered by their times.
func (e *nodeEntry) removed() bool {
	return e.gone != nil && !e.status.Time.After(e.gone.Time)
}

func newNodeModel() *nodeModel {
	return &nodeModel{nodes: map[string]*nodeEntry{}, holds: map[string]nodeHold{}}
}

// applyHold records the node's hold (nil: released) as of KV revision rev,
// unless a later revision was applied: the gateway's own writes and the
// watch both apply, in either order.
func (m *nodeModel) applyHold(node string, admin *contracts.NodeAdmin, rev uint64) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if h, ok := m.holds[node]; ok && rev <= h.rev {
		return false
	}
	m.holds[node] = nodeHold{admin: admin, rev: rev}
	m.notify(node)
	return true
}

// notify tells changed of a node's change; m.mu is held.
func (m *nodeModel) notify(node string) {
	if m.changed != nil {
		m.changed(node)
	}
}

// withHold returns st with its node's hold; m.mu is held.
func (m *nodeModel) withHold(st contracts.NodeStatus) contracts.NodeStatus {
	if a := m.holds[st.NodeID].admin; a != nil {
		c := *a
		c.GPUs = maps.Clone(a.GPUs)
		st.Admin = &c
	}
	return st
}

// applyInventory replaces the node's inventory with inv, read at stream
// sequence seq, unless a later one was applied; it reports whether it did.
// The slices of inv are shared with readers from then on: never mutated.
func (m *nodeModel) applyInventory(inv contracts.NodeInventory, seq uint64) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.entry(inv.NodeID)
	if seq <= e.invSeq {
		return false
	}
	e.status.NodeInventory, e.invSeq = inv, seq
	m.notify(inv.NodeID)
	return true
}

// applyLifecycle records ev, read at seq, as the node's lifecycle state
// unless a later one was applied.
func (m *nodeModel) applyLifecycle(ev contracts.NodeEvent, seq uint64) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.entry(ev.NodeID)
	if seq <= e.lifeSeq {
		return false
	}
	e.status.Lifecycle, e.status.LifecycleAt, e.lifeSeq = ev.Kind, ev.Time, seq
	m.notify(ev.NodeID)
	return true
}

// applyMachineEvent records a machine event that took a node's machine
// away (deleted, reclaimed); any other kind, or one that names no node,
// changes nothing. It reports whether it changed the model.
func (m *nodeModel) applyMachineEvent(ev contracts.MachineEvent) bool {
	if (ev.Kind != contracts.MachineDeleted && ev.Kind != contracts.MachineReclaimed) || ev.NodeID == "" {
		return false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.entry(ev.NodeID)
	if e.gone != nil && !ev.Time.After(e.gone.Time) {
		return false
	}
	e.gone = &ev
	m.notify(ev.NodeID)
	return true
}

// gone returns the machine event that took a node away, when the node is
// not listed for that reason.
func (m *nodeModel) gone(id string) (contracts.MachineEvent, bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	e, ok := m.nodes[id]
	if !ok || !e.removed() {
		return contracts.MachineEvent{}, false
	}
	return *e.gone, true
}

// entry returns the node's entry, creating it; m.mu is held for writing.
func (m *nodeModel) entry(id string) *nodeEntry {
	e := m.nodes[id]
	if e == nil {
		e = &nodeEntry{}
		m.nodes[id] = e
	}
	return e
}

// node returns a node that has published an inventory and whose machine
// was not taken away since.
func (m *nodeModel) node(id string) (contracts.NodeStatus, bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	e, ok := m.nodes[id]
	if !ok || e.invSeq == 0 || e.removed() {
		return contracts.NodeStatus{}, false
	}
	return m.withHold(e.status), true
}

// list returns the nodes with an inventory whose machine was not taken
// away, of one pool ("" for all), ordered by ID.
func (m *nodeModel) list(pool string) []contracts.NodeStatus {
	m.mu.RLock()
	out := make([]contracts.NodeStatus, 0, len(m.nodes))
	for _, e := range m.nodes {
		if e.invSeq > 0 && !e.removed() && (pool == "" || e.status.Pool == pool) {
			out = append(out, m.withHold(e.status))
		}
	}
	m.mu.RUnlock()
	slices.SortFunc(out, func(a, b contracts.NodeStatus) int { return cmp.Compare(a.NodeID, b.NodeID) })
	return out
}

// followNodes folds the last inventory and lifecycle fact of every node,
// then each new one, and the autoscaler's machine events, until ctx ends.
// Only the latest of each node subject is the truth, so that replay
// starts with the last message per subject rather than every inventory a
// node ever published; machine events are per pool, so they are all
// read. The nodes are ready once both reads have caught up: a machine
// scaled down before a restart must not show meanwhile.
func (in *ingester) followNodes(ctx context.Context) error {
	var caught atomic.Int32
	ready := func(stream string) func() {
		return func() {
			in.log.Info("nodes caught up", "stream", stream)
			if caught.Add(1) == 2 {
				in.nodesReady.Store(true)
			}
		}
	}
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		spec := bus.FollowSpec{
			Stream:         contracts.StreamNodes,
			FilterSubjects: []string{contracts.SubjectInventoryAll, contracts.SubjectNodeLifecycleAll},
			LastPerSubject: true,
		}
		return in.bus.Follow(gctx, spec, in.applyNode, ready(contracts.StreamNodes))
	})
	g.Go(func() error {
		spec := bus.FollowSpec{Stream: contracts.StreamOps, FilterSubjects: []string{contracts.SubjectMachinesAll}}
		return in.bus.Follow(gctx, spec, in.applyMachine, ready(contracts.StreamOps))
	})
	return g.Wait()
}

// applyMachine never fails: a machine event it cannot use is logged and
// skipped.
func (in *ingester) applyMachine(_ context.Context, m *bus.Msg) error {
	var ev contracts.MachineEvent
	if err := m.Decode(&ev); err != nil || (ev.NodeID != "" && contracts.ValidateID(ev.NodeID) != nil) {
		in.log.Warn("skipping a machine event that does not decode or names no valid node", "subject", m.Subject,
			"stream_seq", m.StreamSeq, "node_id", ev.NodeID, "err", err)
		return nil
	}
	if in.nodes.applyMachineEvent(ev) {
		in.log.Debug("node's machine gone", "node_id", ev.NodeID, "kind", string(ev.Kind), "stream_seq", m.StreamSeq)
	}
	return nil
}

// followNodeAdmin folds the node holds of BucketNodeAdmin into the node
// model until ctx ends. A watch that cannot start is logged and leaves
// the node endpoints answering 503: the jobs API does not depend on it.
func (in *ingester) followNodeAdmin(ctx context.Context) error {
	err := in.bus.WatchKV(ctx, contracts.BucketNodeAdmin, in.applyNodeAdmin, func() {
		in.adminReady.Store(true)
		in.log.Info("node holds caught up", "bucket", contracts.BucketNodeAdmin)
	})
	if err != nil && ctx.Err() == nil {
		in.log.Error("node holds unavailable: node endpoints answer 503", "bucket", contracts.BucketNodeAdmin, "err", err)
	}
	return nil
}

// applyNodeAdmin applies one KV entry.
func (in *ingester) applyNodeAdmin(e jetstream.KeyValueEntry) {
	node := e.Key()
	if e.Operation() != jetstream.KeyValuePut {
		in.nodes.applyHold(node, nil, e.Revision())
		return
	}
	// Read as the resource manager reads it: an unreadable hold shows as
	// the cordon it is in effect.
	a, err := contracts.DecodeNodeAdmin(node, e.Value())
	if err != nil {
		in.log.Warn("unreadable node hold: shown as cordoned, as the resource manager treats it", "node_id", node,
			"revision", e.Revision(), "err", err)
		// A stable code beside the message: uncordon (or a new cordon
		// or drain) replaces the value (readHold).
		a.Cause = contracts.ReasonUnreadableDocument
	}
	in.nodes.applyHold(node, &a, e.Revision())
}

// applyNode never fails: a message it cannot use is logged and skipped.
func (in *ingester) applyNode(_ context.Context, m *bus.Msg) error {
	log := m.Log(in.log)
	node := contracts.Token(m.Subject, 3)
	if contracts.ValidateID(node) != nil {
		log.Warn("skipping node message on a malformed subject")
		return nil
	}
	switch contracts.Token(m.Subject, 2) {
	case "inventory":
		var inv contracts.NodeInventory
		if err := m.Decode(&inv); err != nil || inv.NodeID != node {
			log.Warn("skipping an inventory that does not decode or names another node", "node_id", inv.NodeID, "err", err)
			return nil
		}
		in.nodes.applyInventory(inv, m.StreamSeq)
	case "lifecycle":
		var ev contracts.NodeEvent
		if err := m.Decode(&ev); err != nil || ev.NodeID != node {
			log.Warn("skipping a node event that does not decode or names another node", "node_id", ev.NodeID, "err", err)
			return nil
		}
		in.nodes.applyLifecycle(ev, m.StreamSeq)
	}
	return nil
}
