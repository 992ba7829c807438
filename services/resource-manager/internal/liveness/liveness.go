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
// Silence is judged on the caller's heartbeat feed, which has outages of
// its own: a NATS server dies, the HEARTBEATS stream elects a new leader,
// the caller's consumer or connection is rebuilt, the caller is paused.
// None of that is a node's silence, so a node is never blamed for a gap of
// the feed itself (finding 2 of issue 13: one NATS node's death made every
// node "lost" at once):
//   - a gap of the whole feed (no heartbeat from any node for longer than
//     half the timeout, well above the agents' interval) restarts every
//     ready node's clock when the feed resumes;
//   - the caller Holds judgment while it cannot trust its feed (its
//     connection is down, the stream does not answer, or the stream holds
//     a heartbeat the feed has not delivered) and Resumes when it can,
//     which restarts the clocks too: nodes whose agents were held up by the
//     same outage get a full timeout to get through;
//   - a heartbeat the stream holds but the feed has not delivered yet is
//     a heartbeat (Refresh).
//
// So a node is lost only when the feed is known to flow (or the stream is
// known to hold nothing newer) and this node's heartbeats are missing.
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
	// HeartbeatSeq is the stream sequence of the node's last heartbeat
	// received (0: none since the caller started).
	HeartbeatSeq uint64
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
	// feedAt is when the last heartbeat of any node arrived (zero: none
	// yet); held is true while the caller cannot trust its feed.
	feedAt time.Time
	held   bool
	// wholeAt is when the caller last confirmed that the stream held no
	// heartbeat the feed had missed (Resume): a quiet feed confirmed whole
	// is no gap.
	wholeAt time.Time
}

// New returns a tracker declaring nodes lost after timeout without news.
func New(timeout time.Duration) *Tracker {
	return &Tracker{timeout: timeout, nodes: map[string]*Node{}}
}

// FeedGap is how long the whole heartbeat feed may be silent before the
// tracker treats it as an outage of the feed: half the timeout (3 s of 6 s,
// above the agents' 2 s interval, so a fleet of one node is not a gap).
func (t *Tracker) FeedGap() time.Duration { return t.timeout / 2 }

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

// Heartbeat records a heartbeat of a node's agent, stored at stream
// sequence seq and received at now. A heartbeat of a node without
// inventory is only remembered. The first heartbeat after a gap of the
// whole feed, or after a Hold, restarts every node's clock. It returns the
// returned or registered event owed by a lost node.
func (t *Tracker) Heartbeat(nodeID, incarnation string, seq uint64, now time.Time) (Decision, bool) {
	if since := later(t.feedAt, t.wholeAt); t.held || (!since.IsZero() && now.Sub(since) > t.FeedGap()) {
		t.held = false
		t.Grace(now)
	}
	t.feedAt = now
	n := t.node(nodeID)
	n.LastSeen = now
	n.HeartbeatSeq = max(n.HeartbeatSeq, seq)
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
		if n.LastSeen.Before(now) {
			n.LastSeen = now
		}
	}
}

// FeedQuiet reports whether no heartbeat of any node has arrived for longer
// than FeedGap: the caller then checks its feed (Hold or Resume) before
// any node may be judged.
func (t *Tracker) FeedQuiet(now time.Time) bool {
	return now.Sub(t.feedAt) > t.FeedGap()
}

// Hold stops every loss while the caller cannot trust its feed; the
// first heartbeat or Resume after it restarts every clock.
func (t *Tracker) Hold() { t.held = true }

// Held reports whether judgment is held.
func (t *Tracker) Held() bool { return t.held }

// Resume records that the feed is known whole at now (the stream answers
// and holds nothing the feed missed). It ends a Hold, restarting every
// node's clock at now.
func (t *Tracker) Resume(now time.Time) {
	t.wholeAt = later(t.wholeAt, now)
	if t.held {
		t.held = false
		t.Grace(now)
	}
}

// Refresh records that the stream holds a heartbeat of the node, at seq,
// that the feed has not delivered: the node is alive, the feed is late.
// It reports whether seq was newer than the node's last heartbeat.
func (t *Tracker) Refresh(nodeID string, seq uint64, now time.Time) bool {
	n, ok := t.nodes[nodeID]
	if !ok || seq <= n.HeartbeatSeq {
		return false
	}
	n.HeartbeatSeq = seq
	n.LastSeen = now
	return true
}

// Due returns, in node order, every event owed at now: registrations not
// yet published, and (unless judgment is held) lost for ready nodes
// silent for longer than the timeout. Calling it again before the
// decisions are applied returns them again: it is level-triggered.
//
// It is called every check (twice a second) on the whole fleet: it walks
// the map and sorts only what it returns, since sorting 10,000 node IDs
// each time cost more than the decisions (issue 17).
func (t *Tracker) Due(now time.Time) []Decision {
	var out []Decision
	for _, n := range t.nodes {
		if d, ok := t.registration(n, now); ok {
			out = append(out, d)
			continue
		}
		if !t.held && n.Status == Ready && now.Sub(n.LastSeen) > t.timeout {
			out = append(out, t.decide(n, contracts.NodeLost, n.Incarnation,
				fmt.Sprintf("no heartbeat for %s", now.Sub(n.LastSeen).Round(time.Millisecond)), now))
		}
	}
	slices.SortFunc(out, func(a, b Decision) int { return strings.Compare(a.Event.NodeID, b.Event.NodeID) })
	return out
}

// Suspect is a ready node silent for longer than the timeout: lost unless
// the caller finds its feed at fault.
type Suspect struct {
	ID           string
	HeartbeatSeq uint64
}

// Suspects returns, in node order, the ready nodes silent for longer than
// the timeout at now, held or not.
func (t *Tracker) Suspects(now time.Time) []Suspect {
	var out []Suspect
	for id, n := range t.nodes {
		if n.Status == Ready && now.Sub(n.LastSeen) > t.timeout {
			out = append(out, Suspect{ID: id, HeartbeatSeq: n.HeartbeatSeq})
		}
	}
	slices.SortFunc(out, func(a, b Suspect) int { return strings.Compare(a.ID, b.ID) })
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

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
