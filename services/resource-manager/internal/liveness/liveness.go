// Package liveness decides node lifecycle events from inventories,
// heartbeats and the passage of time. It is pure: time comes in as an
// argument, and what it decides comes out as Decisions the caller publishes
// (with a compare-and-set on the node's lifecycle subject) and then feeds
// back through Apply. A Tracker is not safe for concurrent use.
//
// The rules (contracts/FLOWS.md, "Nodes"):
//   - the first inventory of a node, or one with a new incarnation, is a
//     registered event;
//   - a ready node not heard from (heartbeat or inventory) for the timeout
//     is lost;
//   - a heartbeat of a lost node is returned when its incarnation is the
//     registered one, registered (with the new incarnation) otherwise.
//
// Every decided event's ID is contracts.NodeEventID(kind, node, seq) where
// seq is the stream sequence of the node's previous lifecycle event (0 for
// none): two replicas deciding the same transition from the same state
// publish the same ID and JetStream keeps one. Lifecycle events are facts
// ordered by the stream, and every replica folds them in that order (the
// last one wins), so replicas converge. They are not a compare-and-set
// chain: exclusivity of GPUs rests on the ledger's compare-and-set alone,
// and lifecycle subjects age out of NODES (a stale expected sequence could
// never be met again).
package liveness

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// Status is a node's lifecycle state.
type Status int

const (
	// Unregistered: an inventory or heartbeat was seen, no registered
	// event yet.
	Unregistered Status = iota
	// Ready: registered or returned, heard from within the timeout.
	Ready
	// Lost: declared lost; waits for a heartbeat.
	Lost
)

func (s Status) String() string {
	switch s {
	case Ready:
		return "ready"
	case Lost:
		return "lost"
	}
	return "unregistered"
}

// Node is what the tracker knows of one node.
type Node struct {
	ID     string
	Pool   string
	Status Status
	// Incarnation of the last registered or returned event.
	Incarnation string
	// HasInventory: an inventory was seen; InventoryIncarnation is the
	// latest one's incarnation.
	HasInventory         bool
	InventoryIncarnation string
	// RegistrationOwed: an inventory arrived that no registered or
	// returned event has answered yet, and it names a new incarnation (or
	// the node was never registered). A later registered event clears it,
	// so an inventory older than a heartbeat's registration is not
	// registered again.
	RegistrationOwed bool
	// LifecycleSeq is the stream sequence of the last lifecycle event
	// applied: the ID seed of the next.
	LifecycleSeq uint64
	// LastSeen is when the node was last heard from, on the caller's clock.
	LastSeen time.Time
}

// Decision is a lifecycle event the tracker wants published; once stored,
// the caller feeds it back with Apply.
type Decision struct {
	Event contracts.NodeEvent
	// ID is the event's Nats-Msg-Id.
	ID string
}

// Tracker tracks every node's lifecycle.
type Tracker struct {
	timeout time.Duration
	nodes   map[string]*Node
}

// New returns a tracker declaring nodes lost after timeout without news.
func New(timeout time.Duration) *Tracker {
	return &Tracker{timeout: timeout, nodes: map[string]*Node{}}
}

func (t *Tracker) node(id string) *Node {
	n, ok := t.nodes[id]
	if !ok {
		n = &Node{ID: id}
		t.nodes[id] = n
	}
	return n
}

// Node returns a copy of what the tracker knows of a node.
func (t *Tracker) Node(id string) (Node, bool) {
	n, ok := t.nodes[id]
	if !ok {
		return Node{}, false
	}
	return *n, true
}

// Status is a node's status (Unregistered for an unknown node).
func (t *Tracker) Status(id string) Status {
	if n, ok := t.nodes[id]; ok {
		return n.Status
	}
	return Unregistered
}

// Nodes returns every node's ID, sorted.
func (t *Tracker) Nodes() []string {
	out := make([]string, 0, len(t.nodes))
	for id := range t.nodes {
		out = append(out, id)
	}
	slices.Sort(out)
	return out
}

func (t *Tracker) decide(n *Node, kind contracts.NodeLifecycleKind, incarnation, reason string, now time.Time) Decision {
	return Decision{
		Event: contracts.NodeEvent{SchemaVersion: contracts.SchemaVersion, Kind: kind, NodeID: n.ID, Pool: n.Pool,
			Incarnation: incarnation, Reason: reason, Time: now},
		ID: contracts.NodeEventID(kind, n.ID, n.LifecycleSeq),
	}
}

// Inventory records a node's inventory, received at now. It returns the
// registered event owed when this incarnation was never registered.
func (t *Tracker) Inventory(inv contracts.NodeInventory, now time.Time) (Decision, bool) {
	n := t.node(inv.NodeID)
	n.Pool = inv.Pool
	n.HasInventory = true
	n.InventoryIncarnation = inv.Incarnation
	n.LastSeen = now
	// A known agent re-sending its inventory owes nothing; a lost one
	// returns by heartbeat.
	n.RegistrationOwed = n.Status == Unregistered || inv.Incarnation != n.Incarnation
	return t.registration(n, now)
}

func (t *Tracker) registration(n *Node, now time.Time) (Decision, bool) {
	switch {
	case !n.HasInventory || !n.RegistrationOwed:
		return Decision{}, false
	case n.Status == Unregistered:
		return t.decide(n, contracts.NodeRegistered, n.InventoryIncarnation, "first inventory", now), true
	}
	return t.decide(n, contracts.NodeRegistered, n.InventoryIncarnation, "inventory of a new incarnation", now), true
}

// Heartbeat records a heartbeat of a node's agent, received at now. A
// heartbeat of a node without inventory is only remembered. It returns the
// returned or registered event owed by a lost node.
func (t *Tracker) Heartbeat(nodeID, incarnation string, now time.Time) (Decision, bool) {
	n := t.node(nodeID)
	n.LastSeen = now
	if n.Status != Lost {
		return Decision{}, false
	}
	if incarnation == n.Incarnation || incarnation == "" {
		return t.decide(n, contracts.NodeReturned, n.Incarnation, "heartbeat", now), true
	}
	return t.decide(n, contracts.NodeRegistered, incarnation, "heartbeat from a new incarnation", now), true
}

// Apply folds a published lifecycle event, stored at stream sequence seq,
// into the tracker; now is when it was applied (a node that becomes ready
// starts a fresh timeout). Events at or below the node's LifecycleSeq
// change nothing. It reports whether the status changed.
func (t *Tracker) Apply(ev contracts.NodeEvent, seq uint64, now time.Time) bool {
	n := t.node(ev.NodeID)
	if seq <= n.LifecycleSeq {
		return false
	}
	n.LifecycleSeq = seq
	if ev.Pool != "" && n.Pool == "" {
		n.Pool = ev.Pool
	}
	before := n.Status
	switch ev.Kind {
	case contracts.NodeRegistered, contracts.NodeReturned:
		n.Status = Ready
		if ev.Incarnation != "" {
			n.Incarnation = ev.Incarnation
		}
		n.RegistrationOwed = false
		n.LastSeen = now
	case contracts.NodeLost:
		n.Status = Lost
	}
	return n.Status != before
}

// Grace gives every node a fresh timeout from now: a restarted resource
// manager has not been listening, which says nothing about the nodes.
func (t *Tracker) Grace(now time.Time) {
	for _, n := range t.nodes {
		n.LastSeen = now
	}
}

// Due returns, in node order, every event owed at now: registrations not
// yet published, and lost for ready nodes silent for longer than the
// timeout. Calling it again before the decisions are applied returns them
// again: it is level-triggered.
func (t *Tracker) Due(now time.Time) []Decision {
	var out []Decision
	for _, id := range t.Nodes() {
		n := t.nodes[id]
		if d, ok := t.registration(n, now); ok {
			out = append(out, d)
			continue
		}
		if n.Status == Ready && now.Sub(n.LastSeen) > t.timeout {
			out = append(out, t.decide(n, contracts.NodeLost, n.Incarnation,
				fmt.Sprintf("no heartbeat for %s", now.Sub(n.LastSeen).Round(time.Millisecond)), now))
		}
	}
	return out
}

// Lost returns the IDs of lost nodes, sorted.
func (t *Tracker) Lost() []string {
	var out []string
	for id, n := range t.nodes {
		if n.Status == Lost {
			out = append(out, id)
		}
	}
	slices.SortFunc(out, strings.Compare)
	return out
}
