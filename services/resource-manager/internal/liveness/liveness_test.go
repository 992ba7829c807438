package liveness

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// publisher stands in for the lifecycle subject: it stores decisions and
// feeds them back, as the resource manager does.
type publisher struct {
	seq  uint64 // stream sequence counter
	last map[string]uint64
	ids  []string
}

func (p *publisher) publish(t *testing.T, tr *Tracker, d Decision, now time.Time) {
	t.Helper()
	if p.last == nil {
		p.last = map[string]uint64{}
	}
	if want := contracts.NodeEventID(d.Event.Kind, d.Event.NodeID, p.last[d.Event.NodeID]); d.ID != want {
		t.Fatalf("decision ID %s, want %s (seeded by the previous event)", d.ID, want)
	}
	p.seq++
	p.last[d.Event.NodeID] = p.seq
	p.ids = append(p.ids, d.ID)
	tr.Apply(d.Event, p.seq, now)
}

func inv(node, incarnation string) contracts.NodeInventory {
	return contracts.NodeInventory{NodeID: node, Pool: "p", Incarnation: incarnation}
}

func kinds(ds []Decision) []string {
	var out []string
	for _, d := range ds {
		out = append(out, string(d.Event.Kind)+" "+d.Event.NodeID+" "+d.Event.Incarnation)
	}
	return out
}

func TestLifecycle(t *testing.T) {
	tr := New(6 * time.Second)
	var p publisher
	now := t0

	d, ok := tr.Inventory(inv("n1", "i1"), now)
	if !ok || d.Event.Kind != contracts.NodeRegistered || d.Event.Incarnation != "i1" || d.ID != "node/registered/n1/0" {
		t.Fatalf("first inventory: %+v %v, want registered i1 with ID node/registered/n1/0", d, ok)
	}
	// Until published, the registration stays owed.
	if got := kinds(tr.Due(now)); !cmp.Equal(got, []string{"registered n1 i1"}) {
		t.Fatalf("Due before publish = %v", got)
	}
	p.publish(t, tr, d, now)
	if tr.Status("n1") != Ready {
		t.Fatalf("status %v after registered", tr.Status("n1"))
	}
	// Same inventory again (republished on change): nothing.
	if _, ok := tr.Inventory(inv("n1", "i1"), now); ok {
		t.Fatal("a re-sent inventory of the same incarnation decided something")
	}

	// Heartbeats keep it alive through 3 s steps.
	for range 5 {
		now = now.Add(3 * time.Second)
		if _, ok := tr.Heartbeat("n1", "i1", now); ok {
			t.Fatal("heartbeat of a ready node decided something")
		}
		if due := tr.Due(now); len(due) != 0 {
			t.Fatalf("Due with fresh heartbeats = %v", kinds(due))
		}
	}
	// Exactly the timeout is not yet lost; past it is.
	if due := tr.Due(now.Add(6 * time.Second)); len(due) != 0 {
		t.Fatalf("lost at exactly the timeout: %v", kinds(due))
	}
	now = now.Add(6*time.Second + time.Millisecond)
	due := tr.Due(now)
	if got := kinds(due); !cmp.Equal(got, []string{"lost n1 i1"}) {
		t.Fatalf("Due after silence = %v", got)
	}
	p.publish(t, tr, due[0], now)
	if tr.Status("n1") != Lost || !cmp.Equal(tr.Lost(), []string{"n1"}) {
		t.Fatalf("status %v, lost %v", tr.Status("n1"), tr.Lost())
	}
	if due := tr.Due(now.Add(time.Hour)); len(due) != 0 {
		t.Fatalf("a lost node is declared again: %v", kinds(due))
	}

	// Same incarnation comes back: returned.
	now = now.Add(time.Minute)
	d, ok = tr.Heartbeat("n1", "i1", now)
	if !ok || d.Event.Kind != contracts.NodeReturned {
		t.Fatalf("heartbeat after lost: %+v %v, want returned", d, ok)
	}
	p.publish(t, tr, d, now)
	if tr.Status("n1") != Ready {
		t.Fatalf("status %v after returned", tr.Status("n1"))
	}

	// Lost again, then a new agent process: registered with the new one.
	now = now.Add(7 * time.Second)
	due = tr.Due(now)
	p.publish(t, tr, due[0], now)
	d, ok = tr.Heartbeat("n1", "i2", now)
	if !ok || d.Event.Kind != contracts.NodeRegistered || d.Event.Incarnation != "i2" {
		t.Fatalf("new-incarnation heartbeat after lost: %+v %v, want registered i2", d, ok)
	}
	p.publish(t, tr, d, now)
	// The old inventory (i1) is no reason to register i1 again.
	if due := tr.Due(now); len(due) != 0 {
		t.Fatalf("Due after a heartbeat registration = %v", kinds(due))
	}
	// Its inventory follows: already registered, nothing.
	if d, ok := tr.Inventory(inv("n1", "i2"), now); ok {
		t.Fatalf("inventory of the registered incarnation decided %+v", d)
	}
	// An agent restart quick enough not to be lost: registered again.
	d, ok = tr.Inventory(inv("n1", "i3"), now)
	if !ok || d.Event.Kind != contracts.NodeRegistered || d.Event.Incarnation != "i3" {
		t.Fatalf("inventory of a new incarnation: %+v %v", d, ok)
	}
	p.publish(t, tr, d, now)

	// Every event had a distinct ID: none would be dropped as a duplicate.
	seen := map[string]bool{}
	for _, id := range p.ids {
		if seen[id] {
			t.Fatalf("ID %s used twice in %v", id, p.ids)
		}
		seen[id] = true
	}
}

func TestApplyIgnoresStaleAndCountsForeignEvents(t *testing.T) {
	tr := New(time.Second)
	tr.Inventory(inv("n1", "i1"), t0)
	// Another replica's registered and lost, delivered in order.
	if !tr.Apply(contracts.NodeEvent{Kind: contracts.NodeRegistered, NodeID: "n1", Incarnation: "i1"}, 5, t0) {
		t.Fatal("registered did not change the status")
	}
	tr.Apply(contracts.NodeEvent{Kind: contracts.NodeLost, NodeID: "n1"}, 9, t0)
	// Our own earlier publish, seen late through the follow: ignored.
	if tr.Apply(contracts.NodeEvent{Kind: contracts.NodeReturned, NodeID: "n1", Incarnation: "i1"}, 7, t0) {
		t.Fatal("a stale event changed the status")
	}
	n, _ := tr.Node("n1")
	if n.Status != Lost || n.LifecycleSeq != 9 {
		t.Fatalf("node = %+v, want lost at seq 9", n)
	}
	d, ok := tr.Heartbeat("n1", "i1", t0)
	if !ok || d.ID != contracts.NodeEventID(contracts.NodeReturned, "n1", 9) {
		t.Fatalf("decision %+v, want returned seeded by seq 9", d)
	}
}

func TestGraceAfterRestart(t *testing.T) {
	tr := New(6 * time.Second)
	// Rebuilt from the stream: registered long ago, no heartbeat since.
	tr.Inventory(inv("n1", "i1"), t0)
	tr.Apply(contracts.NodeEvent{Kind: contracts.NodeRegistered, NodeID: "n1", Incarnation: "i1"}, 1, t0)
	restart := t0.Add(time.Hour)
	tr.Grace(restart)
	if due := tr.Due(restart.Add(5 * time.Second)); len(due) != 0 {
		t.Fatalf("nodes declared lost within the grace period: %v", kinds(due))
	}
	if got := kinds(tr.Due(restart.Add(7 * time.Second))); !cmp.Equal(got, []string{"lost n1 i1"}) {
		t.Fatalf("Due after the grace period = %v", got)
	}
}

func TestHeartbeatWithoutInventoryRegistersNothing(t *testing.T) {
	tr := New(time.Second)
	if _, ok := tr.Heartbeat("n9", "i1", t0); ok {
		t.Fatal("heartbeat of an unknown node decided something")
	}
	if due := tr.Due(t0.Add(time.Hour)); len(due) != 0 {
		t.Fatalf("Due = %v for a node that never sent an inventory", kinds(due))
	}
}
