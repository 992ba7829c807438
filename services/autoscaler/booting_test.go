package autoscaler_test

import (
	"context"
	"fmt"
	"github.com/gpuplane/gpuplane/libs/bus"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/autoscaler"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
)

// Machines still provisioning absorb the demand they were created for: with
// an up-cooldown far shorter than the boot time and the same demand
// published again after every cooldown, the pool gets exactly the machines
// the waiting jobs need, and one more only when one more job waits.
func TestBootingMachinesAreNotAskedForAgain(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	// h0 is a static node of the pool (not the provider's): 4 GPUs, busy.
	publish(t, b, contracts.SubjectInventory("h0"), "inv-h0", inventory("h0", "h100", "hgx-h100-4", 4, "H100-80GB"))
	clk := &clock{now: time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)}
	sim := newSim(t, clk, 10*time.Minute)
	start(t, testConfig(t, srv, clk, sim, map[string]autoscaler.Pool{
		"h100": {Min: 0, Max: 10, MachineType: "hgx-h100-4", PriceClass: cloud.OnDemand, UpCooldown: time.Second,
			DownCooldown: time.Hour, IdleFor: time.Hour}}))

	msg := 0
	demand := func(waiting int) uint64 {
		msg++
		return publish(t, b, contracts.SubjectDemand("h100"), fmt.Sprintf("d%d", msg), contracts.PoolDemand{SchemaVersion: 1,
			Pool: "h100", Nodes: 1, Waiting: []contracts.Shape{{Model: "H100-80GB", GPUs: 4, Count: waiting}}})
	}
	live := func() int { return len(liveOf(sim.Machines())) }
	// steps publishes the same demand again after each cooldown, while
	// nothing boots, and lets the actuator reconcile in between.
	steps := func(waiting int) {
		for range 4 {
			clk.Advance(5 * time.Second)
			sim.Advance()
			lists := sim.Calls()["list"]
			eventually(t, "the actuator reconciled", func() bool { return sim.Calls()["list"] >= lists+2 })
			demand(waiting)
		}
	}

	first := demand(2)
	eventually(t, "two machines for two waiting 4-GPU jobs", func() bool { return live() == 2 })
	steps(2)
	// A third job: one more machine; the decision counts the two booting.
	grown := demand(3)
	eventually(t, "a third machine for a third job", func() bool { return live() == 3 })
	steps(3)
	// A sentinel change after the steps: once its machine exists, every
	// demand before it was decided on.
	last := demand(4)
	eventually(t, "a fourth machine for a fourth job", func() bool { return live() == 4 })

	ds := decisionsOf(t, b, "h100")
	want := []string{
		fmt.Sprintf("scale/h100/%d/up-3", first),
		fmt.Sprintf("scale/h100/%d/up-4", grown),
		fmt.Sprintf("scale/h100/%d/up-5", last),
	}
	var got []string
	for _, d := range ds {
		got = append(got, d.ID)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("decisions %v; want %v (booting machines counted, none asked for twice)", got, want)
	}
	if n := len(sim.Machines()); n != 4 {
		t.Errorf("%d machines created; want 4: %+v", n, sim.Machines())
	}
	for _, m := range sim.Machines() {
		if m.State != cloud.Provisioning {
			t.Errorf("machine %s is %s; want still provisioning (the test is about booting machines)", m.ID, m.State)
		}
	}
}

func liveOf(ms []cloud.Machine) []cloud.Machine {
	var out []cloud.Machine
	for _, m := range ms {
		if m.State != cloud.Deleted {
			out = append(out, m)
		}
	}
	return out
}

// decisionsOf returns the scale decisions of pool on the bus, in order.
func decisionsOf(t *testing.T, b *bus.Bus, pool string) []contracts.ScaleDecision {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var out []contracts.ScaleDecision
	_, err := b.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamOps,
		FilterSubjects: []string{contracts.SubjectScale(pool)}}, func(_ context.Context, m *bus.Msg) error {
		var d contracts.ScaleDecision
		if err := m.Decode(&d); err != nil {
			return err
		}
		out = append(out, d)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}
