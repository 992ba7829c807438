// Package silence detects nodes that stopped sending telemetry and turns
// each silence into one node_silent episode: one firing alert when the node
// has been quiet for the configured time, one resolved alert when it speaks
// again, never more for the same episode.
//
// The Detector is pure: times are passed in (Seen takes a sample's stream
// time, Check the current time), so tests drive it without a clock. Episodes
// are numbered per node; Restore rebuilds the numbering and any open episode
// from the alerts already published, so a restarted monitor neither repeats
// an alert nor reuses an episode number.
//
// A node that left on purpose (Left: its machine deleted or reclaimed) is
// not silent, it is gone: it starts no episode, an episode it left open
// resolves once, and once it has been quiet for the silent period with no
// episode open its state is dropped. Spot machines come and go for months,
// and a detector that kept every node it ever saw would grow without bound.
// The detector's episode floor keeps the highest episode a dropped node
// used, and a node met again (the same ID on a new machine) numbers its
// episodes above it: an episode number, and with it an alert's message ID,
// is never reused. A node's numbers still increase, but need not be
// consecutive. A node that went quiet without leaving is kept: its silence
// is news, and whether it is lost is the node_lost rule's business.
package silence

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// Kind is the alert kind this package raises.
const Kind = "node_silent"

// Label keys of a node_silent alert.
const (
	LabelNode     = "node"
	LabelPool     = "pool"
	LabelHostname = "hostname"
	LabelEpisode  = "episode"
)

// Detector tracks when every node last sent telemetry. It is safe for
// concurrent use.
type Detector struct {
	after time.Duration
	mu    sync.Mutex
	nodes map[string]*node
	// floor is the highest episode of a node whose state was dropped: a
	// new node starts there, so no episode number is used twice.
	floor int
	// horizon is now less the silent period at the latest check: a node
	// dropped then had been quiet since before it, so telemetry of an
	// unknown node stamped at or before it is a late copy of a departed
	// node's, not a new node.
	horizon time.Time
}

type node struct {
	pool, hostname string
	lastSeen       time.Time
	episode        int
	firing         bool
	// silentSince is the last telemetry before the open episode.
	silentSince time.Time
	// left is when the node last left on purpose; telemetry stamped at or
	// before it is history, whatever order the streams are read in.
	left time.Time
}

// gone reports whether the node left and has not spoken since.
func (n *node) gone() bool { return !n.left.IsZero() && !n.lastSeen.After(n.left) }

// New returns a detector that declares a node silent after a quiet period of
// after.
func New(after time.Duration) *Detector {
	return &Detector{after: after, nodes: map[string]*node{}}
}

// Seen records telemetry from a node taken at at. Out-of-order times never
// move a node's last-seen time backwards.
func (d *Detector) Seen(nodeID, pool, hostname string, at time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := d.nodes[nodeID]
	if n == nil {
		if !at.After(d.horizon) {
			return
		}
		n = d.node(nodeID)
	}
	if pool != "" {
		n.pool = pool
	}
	if hostname != "" {
		n.hostname = hostname
	}
	if at.After(n.lastSeen) {
		n.lastSeen = at
	}
}

// Left records that a node left on purpose at at (stream time): its machine
// was deleted or reclaimed. Telemetry stamped later is the same node ID
// back on a new machine.
func (d *Detector) Left(nodeID string, at time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := d.node(nodeID)
	if at.After(n.left) {
		n.left = at
	}
}

// Restore applies a node_silent alert published earlier (in stream order):
// the episode counter never goes back, and a firing alert reopens its
// episode until the node is seen after the alert's Since.
func (d *Detector) Restore(a contracts.Alert) error {
	if a.Kind != Kind {
		return fmt.Errorf("alert kind %q is not %s", a.Kind, Kind)
	}
	ep, err := strconv.Atoi(a.Labels[LabelEpisode])
	if err != nil || ep < 1 {
		return fmt.Errorf("alert %s has no valid %s label: %q", a.Key, LabelEpisode, a.Labels[LabelEpisode])
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	n := d.node(a.Key)
	if ep < n.episode {
		return nil
	}
	n.episode = ep
	n.firing = a.State == contracts.AlertFiring
	n.silentSince = a.Since
	if p := a.Labels[LabelPool]; p != "" {
		n.pool = p
	}
	if h := a.Labels[LabelHostname]; h != "" {
		n.hostname = h
	}
	return nil
}

// Change is a node entering or leaving a silent episode.
type Change struct {
	// Left is set on the resolution of an episode whose node left on
	// purpose rather than spoke again.
	Left     bool
	Node     string
	Pool     string
	Hostname string
	Episode  int
	State    contracts.AlertState
	// Since is the time of the last telemetry before the silence.
	Since time.Time
	// Silence is how long the node has been quiet (firing) or was quiet
	// (resolved).
	Silence time.Duration
	At      time.Time
}

// Check returns the changes due at now, sorted by node: a firing change for
// every node quiet for the detector's period with no episode open, a
// resolved change for every open episode whose node was seen since or left.
// It drops the state of every node that left, has been quiet for the
// period since (telemetry stamped before the departure may still be on its
// way until then) and has no episode open; and of every node restored from
// an alert with no episode open and not heard from (it holds nothing but
// its episode number, which the floor keeps).
func (d *Detector) Check(now time.Time) []Change {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []Change
	if h := now.Add(-d.after); h.After(d.horizon) {
		d.horizon = h
	}
	for id, n := range d.nodes {
		switch {
		case n.firing && n.lastSeen.After(n.silentSince):
			n.firing = false
			out = append(out, n.change(id, contracts.AlertResolved, n.lastSeen.Sub(n.silentSince), now))
		case n.firing && n.gone():
			// Resolved once; the state goes at a later check.
			n.firing = false
			c := n.change(id, contracts.AlertResolved, max(n.left.Sub(n.silentSince), 0), now)
			c.Left = true
			out = append(out, c)
		case n.firing:
			// Silent, not gone: open until the node speaks or leaves.
		case n.gone() || n.lastSeen.IsZero():
			// Gone, or restored and never heard from (no departure to
			// wait for: now.Sub of the zero time saturates).
			if now.Sub(n.left) >= d.after {
				d.floor = max(d.floor, n.episode)
				delete(d.nodes, id)
			}
		case now.Sub(n.lastSeen) >= d.after:
			n.firing = true
			n.episode++
			n.silentSince = n.lastSeen
			out = append(out, n.change(id, contracts.AlertFiring, now.Sub(n.lastSeen), now))
		}
	}
	slices.SortFunc(out, func(a, b Change) int { return cmp.Compare(a.Node, b.Node) })
	return out
}

func (d *Detector) node(id string) *node {
	n := d.nodes[id]
	if n == nil {
		n = &node{episode: d.floor}
		d.nodes[id] = n
	}
	return n
}

func (n *node) change(id string, state contracts.AlertState, silence time.Duration, now time.Time) Change {
	return Change{Node: id, Pool: n.pool, Hostname: n.hostname, Episode: n.episode, State: state,
		Since: n.silentSince, Silence: silence, At: now}
}

// ID is the deterministic message ID of the change's alert: one per node,
// episode and state, so a republished alert is dropped by JetStream.
func (c Change) ID() string {
	return "alert/" + Kind + "/" + c.Node + "/" + strconv.Itoa(c.Episode) + "/" + string(c.State)
}

// Alert is the contracts message for the change.
func (c Change) Alert() contracts.Alert {
	labels := map[string]string{LabelNode: c.Node, LabelEpisode: strconv.Itoa(c.Episode)}
	if c.Pool != "" {
		labels[LabelPool] = c.Pool
	}
	if c.Hostname != "" {
		labels[LabelHostname] = c.Hostname
	}
	msg := fmt.Sprintf("node %s has sent no telemetry for %s", c.Node, c.Silence.Round(time.Millisecond))
	switch {
	case c.State == contracts.AlertResolved && c.Left:
		msg = fmt.Sprintf("node %s left (machine deleted or reclaimed) after %s of silence", c.Node, c.Silence.Round(time.Millisecond))
	case c.State == contracts.AlertResolved:
		msg = fmt.Sprintf("node %s sends telemetry again after %s of silence", c.Node, c.Silence.Round(time.Millisecond))
	}
	return contracts.Alert{
		SchemaVersion: contracts.SchemaVersion,
		Kind:          Kind,
		Key:           c.Node,
		State:         c.State,
		Severity:      "warning",
		Labels:        labels,
		Value:         c.Silence.Seconds(),
		Message:       msg,
		Since:         c.Since,
		Time:          c.At,
	}
}
