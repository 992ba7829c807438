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
		if _, ok := tr.Heartbeat("n1", "i1", 0, now); ok {
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
	d, ok = tr.Heartbeat("n1", "i1", 0, now)
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
	d, ok = tr.Heartbeat("n1", "i2", 0, now)
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
	d, ok := tr.Heartbeat("n1", "i1", 0, t0)
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
	if _, ok := tr.Heartbeat("n9", "i1", 0, t0); ok {
		t.Fatal("heartbeat of an unknown node decided something")
	}
	if due := tr.Due(t0.Add(time.Hour)); len(due) != 0 {
		t.Fatalf("Due = %v for a node that never sent an inventory", kinds(due))
	}
}

// TestFeedOutageIsNotNodeSilence drives three ready nodes through outages
// of the heartbeat feed itself (issue 13, finding 2): a node may be lost
// only for its own silence while the feed is known to work.
func TestFeedOutageIsNotNodeSilence(t *testing.T) {
	type step struct {
		at   time.Duration // since t0
		op   string        // "hb", "hold", "resume", "refresh" or "due"
		node string
		seq  uint64
		want []string // "due": the nodes Due declares lost
	}
	tests := map[string][]step{
		"one node silent while the others flow is lost": {
			{at: 2 * time.Second, op: "hb", node: "n1", seq: 10},
			{at: 2 * time.Second, op: "hb", node: "n2", seq: 11},
			{at: 4 * time.Second, op: "hb", node: "n1", seq: 12},
			{at: 4 * time.Second, op: "hb", node: "n2", seq: 13},
			{at: 6 * time.Second, op: "hb", node: "n1", seq: 14},
			{at: 6 * time.Second, op: "hb", node: "n2", seq: 15},
			{at: 6500 * time.Millisecond, op: "due", want: []string{"n3"}},
		},
		"a stalled feed blames no one; the clocks restart when it delivers": {
			{at: time.Second, op: "hb", node: "n1", seq: 10},
			{at: time.Second, op: "hb", node: "n2", seq: 11},
			{at: time.Second, op: "hb", node: "n3", seq: 12},
			// The stream's leader dies: nothing arrives for 9 s. The
			// caller cannot reach the stream and holds.
			{at: 5 * time.Second, op: "hold"},
			{at: 8 * time.Second, op: "due"},
			{at: 10 * time.Second, op: "due"},
			// The feed resumes with n1 and n2; n3's agent is still
			// reconnecting: it gets a full timeout from the resumption.
			{at: 10 * time.Second, op: "hb", node: "n1", seq: 20},
			{at: 10 * time.Second, op: "hb", node: "n2", seq: 21},
			{at: 12 * time.Second, op: "hb", node: "n1", seq: 22},
			{at: 12 * time.Second, op: "hb", node: "n2", seq: 23},
			{at: 14 * time.Second, op: "hb", node: "n1", seq: 24},
			{at: 14 * time.Second, op: "hb", node: "n2", seq: 25},
			{at: 15900 * time.Millisecond, op: "due"},
			{at: 16100 * time.Millisecond, op: "due", want: []string{"n3"}},
		},
		"a gap of the whole feed restarts the clocks even without a hold": {
			{at: time.Second, op: "hb", node: "n1", seq: 10},
			{at: time.Second, op: "hb", node: "n2", seq: 11},
			{at: time.Second, op: "hb", node: "n3", seq: 12},
			// Nothing for 4.5 s (more than half the timeout), then n1.
			{at: 5500 * time.Millisecond, op: "hb", node: "n1", seq: 20},
			{at: 7500 * time.Millisecond, op: "hb", node: "n1", seq: 21},
			{at: 11 * time.Second, op: "due"},
			{at: 11600 * time.Millisecond, op: "due", want: []string{"n2", "n3"}},
		},
		"a resumed feed that is whole but silent restarts the clocks once": {
			{at: time.Second, op: "hb", node: "n1", seq: 10},
			{at: 4 * time.Second, op: "hold"},
			{at: 20 * time.Second, op: "due"},
			{at: 20 * time.Second, op: "resume"},
			{at: 25 * time.Second, op: "due"},
			{at: 26100 * time.Millisecond, op: "due", want: []string{"n1", "n2", "n3"}},
		},
		"a heartbeat the stream holds but the feed has not delivered is a heartbeat": {
			{at: time.Second, op: "hb", node: "n1", seq: 10},
			{at: time.Second, op: "hb", node: "n2", seq: 11},
			{at: time.Second, op: "hb", node: "n3", seq: 12},
			{at: 3 * time.Second, op: "hb", node: "n1", seq: 13},
			{at: 3 * time.Second, op: "hb", node: "n2", seq: 14},
			{at: 5 * time.Second, op: "hb", node: "n1", seq: 15},
			{at: 5 * time.Second, op: "hb", node: "n2", seq: 16},
			{at: 7 * time.Second, op: "hb", node: "n1", seq: 17},
			{at: 7 * time.Second, op: "hb", node: "n2", seq: 18},
			// n3's newest stored heartbeat is the one already seen: no refresh.
			{at: 7100 * time.Millisecond, op: "refresh", node: "n3", seq: 12},
			{at: 7100 * time.Millisecond, op: "due", want: []string{"n3"}},
			// A newer one is stored: alive.
			{at: 7200 * time.Millisecond, op: "refresh", node: "n3", seq: 19},
			{at: 7200 * time.Millisecond, op: "due"},
		},
		"a quiet feed the stream confirms whole is no gap": {
			{at: time.Second, op: "hb", node: "n1", seq: 10},
			{at: time.Second, op: "hb", node: "n2", seq: 11},
			// n1 and n3 die; n2's agent is stopped for 4 s, and the
			// caller checks the stream every 500 ms meanwhile.
			{at: 4500 * time.Millisecond, op: "resume"},
			{at: 5 * time.Second, op: "resume"},
			{at: 5 * time.Second, op: "hb", node: "n2", seq: 12},
			{at: 7 * time.Second, op: "hb", node: "n2", seq: 13},
			{at: 7100 * time.Millisecond, op: "due", want: []string{"n1", "n3"}},
		},
		"every node silent on a working feed: all lost on time": {
			{at: time.Second, op: "hb", node: "n1", seq: 10},
			{at: time.Second, op: "hb", node: "n2", seq: 11},
			{at: time.Second, op: "hb", node: "n3", seq: 12},
			{at: 6900 * time.Millisecond, op: "due"},
			{at: 7100 * time.Millisecond, op: "due", want: []string{"n1", "n2", "n3"}},
		},
	}
	for name, steps := range tests {
		t.Run(name, func(t *testing.T) {
			tr := New(6 * time.Second)
			for i, n := range []string{"n1", "n2", "n3"} {
				tr.Inventory(inv(n, "i1"), t0)
				tr.Apply(contracts.NodeEvent{Kind: contracts.NodeRegistered, NodeID: n, Incarnation: "i1"}, uint64(i+1), t0)
			}
			for _, s := range steps {
				now := t0.Add(s.at)
				switch s.op {
				case "hb":
					tr.Heartbeat(s.node, "i1", s.seq, now)
				case "hold":
					tr.Hold()
				case "resume":
					tr.Resume(now)
				case "refresh":
					tr.Refresh(s.node, s.seq, now)
				case "due":
					var got []string
					for _, d := range tr.Due(now) {
						if d.Event.Kind == contracts.NodeLost {
							got = append(got, d.Event.NodeID)
						}
					}
					if diff := cmp.Diff(s.want, got); diff != "" {
						t.Fatalf("at %s: lost (-want +got):\n%s", s.at, diff)
					}
				}
			}
		})
	}
}
