package autoscaler_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/autoscaler"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
)

// Machines reclaimed or deleted while the autoscaler was down left holds
// behind. At start it releases those of managed pools whose nodes the
// provider no longer lists: its own holds are deleted, an administrator's
// hold given the spot cause keeps what the administrator set, the spot
// alert resolves and the machine event says reclaimed, under the live
// path's IDs. Administrators' holds, and holds of pools it does not manage,
// are left alone.
func TestHoldsOfMachinesGoneWhileDownAreReleasedAtStart(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	kv, err := b.KeyValue(ctx, contracts.BucketNodeAdmin)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	deadline := t0.Add(-time.Minute) // reclaimed a minute before the restart
	ep := fmt.Sprint(deadline.Unix())

	for _, n := range []string{"spot-1", "spot-2", "spot-3", "spot-4"} {
		publish(t, b, contracts.SubjectInventory(n), "inv-"+n, inventory(n, "spot", "g2-standard-8", 1, "L4"))
	}
	publish(t, b, contracts.SubjectInventory("other-1"), "inv-other-1", inventory("other-1", "other", "g2-standard-8", 1, "L4"))
	// The live path saw spot-1's notice (its machine ID differs from the node's).
	publish(t, b, contracts.SubjectMachines("spot"), contracts.MachineEventID(contracts.MachineInterrupted, "m-1"),
		contracts.MachineEvent{SchemaVersion: 1, Kind: contracts.MachineInterrupted, Pool: "spot", MachineID: "m-1", NodeID: "spot-1", Deadline: &deadline})
	publish(t, b, contracts.SubjectAlert(contracts.AlertKindSpotInterruption), "alert/spot_interruption/spot-1/"+ep+"/firing",
		contracts.Alert{SchemaVersion: 1, Kind: contracts.AlertKindSpotInterruption, Key: "spot-1", State: contracts.AlertFiring})

	holds := map[string]contracts.NodeAdmin{
		"spot-1":  {NodeID: "spot-1", Cordoned: true, Drain: true, Reason: "autoscaler: spot interruption notice", Cause: contracts.ReasonSpotInterruption, Deadline: &deadline},
		"spot-2":  {NodeID: "spot-2", Cordoned: true, Drain: true, Reason: "maintenance window", Cause: contracts.ReasonSpotInterruption, Deadline: &deadline},
		"spot-3":  {NodeID: "spot-3", Cordoned: true, Reason: "bad fan"},
		"spot-4":  {NodeID: "spot-4", Cordoned: true, Drain: true, Reason: "autoscaler: idle since 11:00; scaling pool spot down"},
		"other-1": {NodeID: "other-1", Cordoned: true, Drain: true, Reason: "autoscaler: spot interruption notice", Cause: contracts.ReasonSpotInterruption, Deadline: &deadline},
	}
	for n, na := range holds {
		na.SchemaVersion = 1
		data, _ := json.Marshal(na)
		if _, err := kv.Put(ctx, n, data); err != nil {
			t.Fatal(err)
		}
	}

	clk := &clock{now: t0}
	sim := newSim(t, clk, 0)
	start(t, testConfig(t, srv, clk, sim, map[string]autoscaler.Pool{
		"spot": {Min: 0, Max: 2, MachineType: "g2-standard-8", PriceClass: cloud.Spot}}))

	hold := func(node string) (contracts.NodeAdmin, bool) {
		e, err := kv.Get(ctx, node)
		if err != nil {
			return contracts.NodeAdmin{}, false
		}
		var na contracts.NodeAdmin
		return na, json.Unmarshal(e.Value(), &na) == nil
	}
	eventually(t, "the autoscaler's holds of gone machines lifted", func() bool {
		_, h1 := hold("spot-1")
		_, h4 := hold("spot-4")
		na2, _ := hold("spot-2")
		return !h1 && !h4 && na2.Cause == ""
	})
	if na, ok := hold("spot-2"); !ok || !na.Cordoned || !na.Drain || na.Reason != "maintenance window" || na.Deadline != nil {
		t.Errorf("administrator's hold of spot-2: %+v (present %v); want it kept, without the spot cause and deadline", na, ok)
	}
	if na, ok := hold("spot-3"); !ok || na.Reason != "bad fan" {
		t.Errorf("administrator's hold of spot-3: %+v (present %v); want it untouched", na, ok)
	}
	if na, ok := hold("other-1"); !ok || na.Cause != contracts.ReasonSpotInterruption {
		t.Errorf("hold of other-1, of a pool not managed: %+v (present %v); want it untouched", na, ok)
	}

	// spot-1 and spot-2 were under notice: both alerts resolve, once each.
	alerts := waitAlerts(t, b, 3)
	resolved := map[string]int{}
	for _, a := range alerts[1:] {
		resolved[a.id]++
		if a.State != contracts.AlertResolved || a.Labels[contracts.AlertLabelPool] != "spot" {
			t.Errorf("alert %s %+v; want resolved with the pool label", a.id, a.Alert)
		}
	}
	for _, n := range []string{"spot-1", "spot-2"} {
		if id := "alert/spot_interruption/" + n + "/" + ep + "/resolved"; resolved[id] != 1 {
			t.Errorf("resolved alerts %v; want one %s", resolved, id)
		}
	}
	events := waitMachineEvents(t, b, "spot", func(evs map[string]contracts.MachineEvent) bool { return len(evs) >= 3 })
	for id, node := range map[string]string{"m-1": "spot-1", "spot-2": "spot-2"} {
		e, ok := events[contracts.MachineEventID(contracts.MachineReclaimed, id)]
		if !ok || e.NodeID != node || e.Deadline == nil || !e.Deadline.Equal(deadline) {
			t.Errorf("reclaimed event of machine %s: %+v (present %v); want it for node %s with the deadline", id, e, ok, node)
		}
	}
	if len(events) != 3 {
		t.Errorf("machine events %v; want interrupted m-1, reclaimed m-1 and spot-2 only", keys(events))
	}
}

// A machine listed as running whose node agent is lost for longer than the
// grace is deleted as dead and replaced; one whose agent came back is kept,
// and nothing is deleted before the grace has passed.
func TestDeadMachineIsDeletedAndReplaced(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	t0 := time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	clk := &clock{now: t0}
	sim := newSim(t, clk, 0)
	cfg := testConfig(t, srv, clk, sim, map[string]autoscaler.Pool{
		"l4": {Min: 2, Max: 3, MachineType: "g2-standard-8", PriceClass: cloud.OnDemand}})
	cfg.NodeLostGrace = 2 * time.Minute
	start(t, cfg)

	eventually(t, "pool filled to its minimum", func() bool { return len(sim.Machines()) == 2 })
	sim.Advance()
	nodeEvent := func(node string, kind contracts.NodeLifecycleKind, at time.Time, seq uint64) {
		publish(t, b, contracts.SubjectNodeLifecycle(node), contracts.NodeEventID(kind, node, seq),
			contracts.NodeEvent{SchemaVersion: 1, Kind: kind, NodeID: node, Pool: "l4", Time: at})
	}
	for _, n := range []string{"l4-1", "l4-2"} {
		publish(t, b, contracts.SubjectInventory(n), "inv-"+n, inventory(n, "l4", "g2-standard-8", 1, "L4"))
		nodeEvent(n, contracts.NodeRegistered, t0, 1)
		nodeEvent(n, contracts.NodeLost, t0, 2)
	}
	nodeEvent("l4-2", contracts.NodeReturned, t0.Add(30*time.Second), 3)

	// Within the grace: steps run, nothing is deleted.
	clk.Advance(time.Minute)
	lists := sim.Calls()["list"]
	eventually(t, "several steps within the grace", func() bool { return sim.Calls()["list"] >= lists+10 })
	if c := sim.Calls()["delete"]; c != 0 {
		t.Fatalf("%d deletes within the grace; want none", c)
	}

	clk.Advance(2 * time.Minute)
	eventually(t, "dead l4-1 deleted and replaced", func() bool {
		live := 0
		for _, m := range sim.Machines() {
			if m.State != cloud.Deleted {
				live++
			}
		}
		ms := sim.Machines()
		return len(ms) == 3 && ms[0].State == cloud.Deleted && live == 2
	})
	if m := sim.Machines()[1]; m.ID != "l4-2" || m.State != cloud.Running {
		t.Errorf("machine %+v whose agent came back: want l4-2 running", m)
	}
	if c := sim.Calls()["delete"]; c != 1 {
		t.Errorf("%d deletes; want 1", c)
	}
	events := waitMachineEvents(t, b, "l4", func(evs map[string]contracts.MachineEvent) bool {
		_, ok := evs[contracts.MachineEventID(contracts.MachineDeleted, "l4-1")]
		return ok
	})
	if e := events[contracts.MachineEventID(contracts.MachineDeleted, "l4-1")]; !strings.Contains(e.Message, "node agent has been lost") {
		t.Errorf("deleted event message %q; want it to say the node agent was lost", e.Message)
	}
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}
