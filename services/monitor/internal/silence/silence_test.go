package silence

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

var t0 = time.Date(2025, 1, 1, 12, 0, 0, 0, time.UTC)

func at(d time.Duration) time.Time { return t0.Add(d) }

func TestEpisodeFiresOnceAndResolvesOnce(t *testing.T) {
	d := New(3 * time.Second)
	d.Seen("n1", "h100", "host-1", at(0))
	d.Seen("n2", "h100", "host-2", at(0))

	if got := d.Check(at(2 * time.Second)); len(got) != 0 {
		t.Fatalf("before the silent period: %+v, want nothing", got)
	}
	d.Seen("n2", "h100", "host-2", at(2*time.Second))

	want := []Change{{Node: "n1", Pool: "h100", Hostname: "host-1", Episode: 1, State: contracts.AlertFiring,
		Since: at(0), Silence: 3 * time.Second, At: at(3 * time.Second)}}
	if diff := cmp.Diff(want, d.Check(at(3*time.Second))); diff != "" {
		t.Fatalf("first check after the silent period (-want +got):\n%s", diff)
	}
	// Still silent: the open episode is not announced again.
	for _, s := range []time.Duration{4, 10, 60} {
		d.Seen("n2", "h100", "host-2", at(s*time.Second))
		if got := d.Check(at(s * time.Second)); len(got) != 0 {
			t.Fatalf("check at %ds: %+v, want nothing", s, got)
		}
	}
	d.Seen("n1", "h100", "host-1", at(61*time.Second))
	d.Seen("n2", "h100", "host-2", at(61*time.Second))
	got := d.Check(at(61 * time.Second))
	want = []Change{{Node: "n1", Pool: "h100", Hostname: "host-1", Episode: 1, State: contracts.AlertResolved,
		Since: at(0), Silence: 61 * time.Second, At: at(61 * time.Second)}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("after n1 spoke again (-want +got):\n%s", diff)
	}
	if got := d.Check(at(62 * time.Second)); len(got) != 0 {
		t.Fatalf("after resolution: %+v, want nothing", got)
	}
	// A second silence is a second episode.
	d.Seen("n2", "h100", "host-2", at(64*time.Second))
	got = d.Check(at(64 * time.Second))
	if len(got) != 1 || got[0].Episode != 2 || got[0].State != contracts.AlertFiring {
		t.Fatalf("second silence: %+v, want n1 firing episode 2", got)
	}
	if id := got[0].ID(); id != "alert/node_silent/n1/2/firing" {
		t.Errorf("ID = %q", id)
	}
}

func TestNodeNeverSeenNeverFires(t *testing.T) {
	d := New(time.Second)
	if got := d.Check(at(time.Hour)); len(got) != 0 {
		t.Fatalf("no telemetry at all: %+v, want nothing", got)
	}
}

func TestOutOfOrderSampleDoesNotRewindLastSeen(t *testing.T) {
	d := New(3 * time.Second)
	d.Seen("n1", "p", "h", at(10*time.Second))
	d.Seen("n1", "p", "h", at(0))
	if got := d.Check(at(12 * time.Second)); len(got) != 0 {
		t.Fatalf("got %+v; an older sample must not make the node look silent", got)
	}
}

func TestRestoreContinuesEpisodes(t *testing.T) {
	fired := Change{Node: "n1", Pool: "h100", Hostname: "host-1", Episode: 4, State: contracts.AlertFiring,
		Since: at(0), Silence: 3 * time.Second, At: at(3 * time.Second)}
	resolvedEarlier := Change{Node: "n2", Pool: "h100", Episode: 7, State: contracts.AlertResolved, Since: at(0), At: at(time.Second)}
	older := Change{Node: "n2", Episode: 6, State: contracts.AlertFiring, Since: at(0), At: at(0)}

	d := New(3 * time.Second)
	for _, c := range []Change{fired, resolvedEarlier, older} {
		if err := d.Restore(c.Alert()); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Restore(contracts.Alert{Kind: Kind, Key: "n3"}); err == nil {
		t.Error("Restore of an alert without an episode label succeeded")
	}

	// The restarted monitor sees n1's last sample again, as old as before:
	// the open episode stays open and is not fired a second time.
	d.Seen("n1", "h100", "host-1", at(0))
	if got := d.Check(at(time.Minute)); len(got) != 0 {
		t.Fatalf("after restore: %+v, want nothing", got)
	}
	d.Seen("n1", "h100", "host-1", at(time.Minute))
	d.Seen("n2", "h100", "host-2", at(time.Minute))
	got := d.Check(at(time.Minute))
	if len(got) != 1 || got[0].Node != "n1" || got[0].State != contracts.AlertResolved || got[0].Episode != 4 {
		t.Fatalf("n1 back: %+v, want n1 resolved episode 4", got)
	}
	got = d.Check(at(2 * time.Minute))
	if len(got) != 2 || got[1].Node != "n2" || got[1].Episode != 8 {
		t.Fatalf("both silent again: %+v, want n2 to continue at episode 8 (not 7 or 1)", got)
	}
}

func TestAlertCarriesEpisodeAndLabels(t *testing.T) {
	c := Change{Node: "n1", Pool: "h100", Hostname: "host-1", Episode: 2, State: contracts.AlertResolved,
		Since: at(0), Silence: 1500 * time.Millisecond, At: at(2 * time.Second)}
	want := contracts.Alert{
		SchemaVersion: contracts.SchemaVersion, Kind: "node_silent", Key: "n1", State: contracts.AlertResolved,
		Severity: "warning", Labels: map[string]string{"node": "n1", "pool": "h100", "hostname": "host-1", "episode": "2"},
		Value: 1.5, Message: "node n1 sends telemetry again after 1.5s of silence", Since: at(0), Time: at(2 * time.Second),
	}
	if diff := cmp.Diff(want, c.Alert()); diff != "" {
		t.Errorf("Alert (-want +got):\n%s", diff)
	}
	if id := c.ID(); id != "alert/node_silent/n1/2/resolved" {
		t.Errorf("ID = %q", id)
	}
}
