package readmodel

import (
	"cmp"
	"slices"
	"time"
)

// beat is what the model keeps of one node's heartbeats: the stream time of
// the latest, and of the last clean departure.
type beat struct {
	last time.Time
	// left is when the node last left cleanly (its machine deleted or
	// reclaimed); heartbeats stamped at or before it are history, not
	// news, whatever order the streams are read in.
	left time.Time
}

// beat returns the node's record, created on first sight. Called under
// m.mu.
func (m *Model) beat(nodeID string) *beat {
	b := m.beats[nodeID]
	if b == nil {
		b = &beat{}
		m.beats[nodeID] = b
	}
	return b
}

// ApplyHeartbeat records a heartbeat of a node's agent stamped at at by the
// stream. Out-of-order times never move the latest backwards, so a replay
// or a redelivery is harmless.
func (m *Model) ApplyHeartbeat(nodeID string, at time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.beats[nodeID]; m.lateCopy(ok, at) {
		return
	}
	b := m.beat(nodeID)
	if at.After(b.last) {
		b.last = at
	}
}

// ApplyNodeLeft records that a node left cleanly at at (stream time): it is
// no longer expected to send heartbeats, until one stamped later arrives
// (the same node ID back on a new machine).
func (m *Model) ApplyNodeLeft(nodeID string, at time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.beats[nodeID]; m.lateCopy(ok, at) {
		return
	}
	b := m.beat(nodeID)
	if at.After(b.left) {
		b.left = at
	}
}

// NodeHeartbeat is the latest heartbeat of a node expected to be alive.
type NodeHeartbeat struct {
	Node string
	// Pool is the node's pool from its inventory or lifecycle events, ""
	// before either was read.
	Pool string
	Last time.Time
}

// Age is how long before now the heartbeat was sent, never negative (the
// stream's clock and now may differ by a little).
func (h NodeHeartbeat) Age(now time.Time) time.Duration { return max(now.Sub(h.Last), 0) }

// heartbeats lists, by node, every node heard from since it last left
// cleanly. The caller holds m.mu.
func (m *Model) heartbeats() []NodeHeartbeat {
	out := make([]NodeHeartbeat, 0, len(m.beats))
	for id, b := range m.beats {
		if b.last.IsZero() || !b.last.After(b.left) {
			continue
		}
		out = append(out, NodeHeartbeat{Node: id, Pool: m.nodes[id].pool, Last: b.last})
	}
	slices.SortFunc(out, func(a, b NodeHeartbeat) int { return cmp.Compare(a.Node, b.Node) })
	return out
}

// Heartbeats returns the latest heartbeat of every node heard from since it
// last left cleanly, by node: the nodes the node_lost rule watches.
func (m *Model) Heartbeats() []NodeHeartbeat {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.heartbeats()
}

// NodeTelemetry is when a node expected to be alive last sent telemetry.
type NodeTelemetry struct {
	Node, Hostname, Pool string
	Last                 time.Time
}

// Age is how long before now the telemetry was sent, never negative.
func (n NodeTelemetry) Age(now time.Time) time.Duration { return max(now.Sub(n.Last), 0) }

// telemetry lists, by node, every node that sent telemetry and has not
// left cleanly since: a machine deleted or reclaimed is not silent, it is
// gone. The caller holds m.mu.
func (m *Model) telemetry() []NodeTelemetry {
	hosts := make(map[string]GPU, len(m.nodeSeen))
	for _, g := range m.gpus {
		hosts[g.NodeID] = g
	}
	out := make([]NodeTelemetry, 0, len(m.nodeSeen))
	for id, at := range m.nodeSeen {
		if m.departed(id) {
			continue
		}
		g := hosts[id]
		out = append(out, NodeTelemetry{Node: id, Hostname: cmp.Or(g.Hostname, id), Pool: g.Pool, Last: at})
	}
	slices.SortFunc(out, func(a, b NodeTelemetry) int { return cmp.Compare(a.Node, b.Node) })
	return out
}

// departed reports whether the node left and has not been heard from since
// (no heartbeat, telemetry nor inventory stamped after it left). The
// caller holds m.mu.
func (m *Model) departed(nodeID string) bool {
	b := m.beats[nodeID]
	return b != nil && !b.left.IsZero() && !b.last.After(b.left) && !m.nodeSeen[nodeID].After(b.left) &&
		!m.nodes[nodeID].inventoryAt.After(b.left)
}

// lateCopy reports whether a message stamped at about a node the model
// does not know (known false) is a late copy of a forgotten node's:
// stamped at or before the last cutoff Forget was given. The caller holds
// m.mu.
func (m *Model) lateCopy(known bool, at time.Time) bool {
	return !known && !at.After(m.forgotBefore)
}

// Forget drops every node that left at or before before and has not been
// heard from since (see departed): its
// heartbeats, telemetry, GPUs and inventory. The caller passes now less the
// silent period, so that telemetry or heartbeats stamped before the
// departure and still on their way are not taken for a new node. It
// returns how many nodes it dropped.
func (m *Model) Forget(before time.Time) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	if before.After(m.forgotBefore) {
		m.forgotBefore = before
	}
	var gone map[string]bool
	for id, b := range m.beats {
		if !m.departed(id) || b.left.After(before) {
			continue
		}
		if gone == nil {
			gone = map[string]bool{}
		}
		gone[id] = true
		delete(m.beats, id)
		delete(m.nodeSeen, id)
		delete(m.nodes, id)
	}
	if len(gone) > 0 {
		for key, g := range m.gpus {
			if gone[g.NodeID] {
				delete(m.gpus, key)
			}
		}
	}
	return len(gone)
}
