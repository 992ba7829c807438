package silence

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

func size(d *Detector) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.nodes)
}

// TestChurnKeepsNodesBounded churns spot machines through the detector:
// every 10 s a machine joins, sends telemetry every second for 10 s and is
// deleted; every third one goes quiet 4 s before its deletion, long enough
// to open a node_silent episode. The detector must hold no more than the
// machines within a silent period, and each episode must fire once and
// resolve once, with no number used twice.
func TestChurnKeepsNodesBounded(t *testing.T) {
	const (
		machines = 300
		lifetime = 10 * time.Second
		after    = 3 * time.Second
	)
	d := New(after)
	bound := int(after/lifetime) + 2
	end := time.Duration(machines)*lifetime + 2*after
	var changes []Change
	for s := time.Duration(0); s <= end; s += time.Second {
		if i := int(s / lifetime); i < machines {
			quiet := i%3 == 0 && s%lifetime >= 5*time.Second
			if !quiet {
				d.Seen(fmt.Sprintf("spot-%d", i), "spot", "", at(s))
			}
			if s%lifetime == 0 && i > 0 {
				d.Left(fmt.Sprintf("spot-%d", i-1), at(s))
			}
		} else if s == time.Duration(machines)*lifetime {
			d.Left(fmt.Sprintf("spot-%d", machines-1), at(s))
		}
		changes = append(changes, d.Check(at(s))...)
		if n := size(d); n > bound {
			t.Fatalf("at %s: %d nodes held; want at most %d", s, n, bound)
		}
	}
	if n := size(d); n != 0 {
		t.Errorf("after every machine left: %d nodes held; want none", n)
	}
	fired, resolved, ids := map[string]int{}, map[string]int{}, map[string]bool{}
	for _, c := range changes {
		if ids[c.ID()] {
			t.Errorf("alert ID %s used twice", c.ID())
		}
		ids[c.ID()] = true
		if c.State == contracts.AlertFiring {
			fired[c.Node]++
			continue
		}
		resolved[c.Node]++
		if !c.Left {
			t.Errorf("%s resolved, not by leaving: %+v", c.Node, c)
		}
	}
	for i := range machines {
		id, want := fmt.Sprintf("spot-%d", i), 0
		if i%3 == 0 {
			want = 1
		}
		if fired[id] != want || resolved[id] != want {
			t.Errorf("%s: fired %d, resolved %d; want %d each", id, fired[id], resolved[id], want)
		}
	}
}

// TestDepartedNode: an episode open when the node leaves resolves once
// (saying so), the node is forgotten a silent period later, a late sample
// stamped before then does not bring it back, and the same ID on a new
// machine is a new node whose episodes number above the old one's.
func TestDepartedNode(t *testing.T) {
	const after = 3 * time.Second
	sec := func(s int) time.Time { return at(time.Duration(s) * time.Second) }
	d := New(after)
	d.Seen("n1", "spot", "host-1", sec(0))
	d.Seen("n2", "spot", "host-2", sec(0)) // leaves at 1 s, never silent
	d.Seen("n3", "spot", "host-3", sec(0)) // goes quiet, never leaves
	d.Left("n2", sec(1))
	got := d.Check(sec(3))
	want := []Change{
		{Node: "n1", Pool: "spot", Hostname: "host-1", Episode: 1, State: contracts.AlertFiring, Since: sec(0), Silence: after, At: sec(3)},
		{Node: "n3", Pool: "spot", Hostname: "host-3", Episode: 1, State: contracts.AlertFiring, Since: sec(0), Silence: after, At: sec(3)},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("first silence (-want +got):\n%s", diff)
	}
	if size(d) != 3 {
		t.Fatalf("%d nodes held; want 3 (n2 left at 1 s, not yet a silent period ago)", size(d))
	}
	if got := d.Check(sec(4)); len(got) != 0 || size(d) != 2 {
		t.Fatalf("at 4 s: %+v and %d nodes held; want nothing published and n2 forgotten", got, size(d))
	}

	d.Left("n1", sec(5))
	got = d.Check(sec(5))
	want = []Change{{Left: true, Node: "n1", Pool: "spot", Hostname: "host-1", Episode: 1, State: contracts.AlertResolved,
		Since: sec(0), Silence: 5 * time.Second, At: sec(5)}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("n1 left while silent (-want +got):\n%s", diff)
	}
	if msg := got[0].Alert().Message; !strings.Contains(msg, "left") {
		t.Errorf("resolution message %q does not say the node left", msg)
	}
	for s := 6; s <= 60; s++ {
		if got := d.Check(sec(s)); len(got) != 0 {
			t.Fatalf("at %ds: %+v; want nothing more for n1 (nor n3, still silent)", s, got)
		}
	}
	d.mu.Lock()
	_, n1 := d.nodes["n1"]
	_, n3 := d.nodes["n3"]
	d.mu.Unlock()
	if n1 || !n3 {
		t.Fatalf("n1 held %v, n3 held %v; want n1 forgotten and n3 (silent, never left) kept", n1, n3)
	}

	// A late copy of n1's telemetry from before it left is history.
	d.Seen("n1", "spot", "host-1", sec(4))
	if got := d.Check(sec(61)); len(got) != 0 || size(d) != 1 {
		t.Fatalf("after a late sample of n1: %+v, %d nodes held; want nothing and only n3", got, size(d))
	}

	// n1's ID on a new machine: a new node, its episodes above the old.
	d.Seen("n1", "spot", "host-9", sec(70))
	got = d.Check(sec(73))
	if len(got) != 1 || got[0].Node != "n1" || got[0].State != contracts.AlertFiring || got[0].Episode != 2 ||
		got[0].Hostname != "host-9" || got[0].Since != sec(70) {
		t.Fatalf("n1 back and silent: %+v; want episode 2 firing since 70 s on host-9", got)
	}
	d.Seen("n1", "spot", "host-9", sec(74))
	if got := d.Check(sec(74)); len(got) != 1 || got[0].State != contracts.AlertResolved || got[0].Left || got[0].Episode != 2 {
		t.Fatalf("n1 speaks again: %+v; want episode 2 resolved", got)
	}
}

// TestRestoredDepartedEpisodeResolves: a restarted monitor restores an
// episode left open by a node that since left; it resolves once, and the
// node's number is not reused.
func TestRestoredDepartedEpisodeResolves(t *testing.T) {
	const after = 3 * time.Second
	d := New(after)
	if err := d.Restore(contracts.Alert{Kind: Kind, Key: "n1", State: contracts.AlertFiring, Since: at(0),
		Labels: map[string]string{LabelEpisode: "4", LabelPool: "spot"}}); err != nil {
		t.Fatal(err)
	}
	d.Seen("n1", "spot", "", at(0))
	d.Left("n1", at(time.Second))
	got := d.Check(at(10 * time.Second))
	if len(got) != 1 || got[0].State != contracts.AlertResolved || !got[0].Left || got[0].Episode != 4 {
		t.Fatalf("%+v; want episode 4 resolved as departed", got)
	}
	if got := d.Check(at(11 * time.Second)); len(got) != 0 || size(d) != 0 {
		t.Fatalf("%+v, %d nodes held; want nothing more and n1 forgotten", got, size(d))
	}
	d.Seen("n1", "spot", "", at(20*time.Second))
	if got := d.Check(at(30 * time.Second)); len(got) != 1 || got[0].Episode != 5 {
		t.Fatalf("%+v; want n1 back firing episode 5", got)
	}
}
