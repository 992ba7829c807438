package autoscaler_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/autoscaler"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/autoscaler/simcloud"
)

// testConfig is an autoscaler acting on sim for pools, reconciling every
// 20 ms so that tests wait for the clock they drive, not for ticks.
func testConfig(t *testing.T, srv *natsserver.Server, clk *clock, sim *simcloud.Provider, pools map[string]autoscaler.Pool) autoscaler.Config {
	cfg := autoscaler.DefaultConfig()
	cfg.Bus = busConfig(t, srv)
	cfg.Now = clk.Now
	cfg.Provider = sim
	cfg.Pools = pools
	cfg.ActuateEvery = 20 * time.Millisecond
	return cfg
}

func newSim(t *testing.T, clk *clock, delay time.Duration) *simcloud.Provider {
	t.Helper()
	sim, err := simcloud.New(simcloud.Config{Now: clk.Now, ProvisionDelay: delay})
	if err != nil {
		t.Fatal(err)
	}
	return sim
}

// A spot notice drains the node at once (an administrator's hold is kept
// and given the cause), fires an alert and is a machine event; the pool is
// refilled ahead of the reclaim as far as its maximum allows. The reclaim
// resolves the alert, lifts only the autoscaler's hold and refills the
// pool to its minimum.
func TestSpotNoticeDrainsAndReclaimRefills(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	t0 := time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	clk := &clock{now: t0}
	sim := newSim(t, clk, 30*time.Second)
	start(t, testConfig(t, srv, clk, sim, map[string]autoscaler.Pool{
		"spot": {Min: 2, Max: 3, MachineType: "g2-standard-8", PriceClass: cloud.Spot}}))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	kv, err := b.KeyValue(ctx, contracts.BucketNodeAdmin)
	if err != nil {
		t.Fatal(err)
	}

	eventually(t, "pool filled to its minimum", func() bool { return len(sim.Machines()) == 2 })
	for _, m := range sim.Machines() {
		if !strings.HasPrefix(m.Token, "min/spot/") || m.PriceClass != cloud.Spot {
			t.Errorf("refill machine %+v: want a spot machine with a min/spot/ token", m)
		}
	}
	clk.Advance(30 * time.Second)
	sim.Advance()

	// An administrator holds spot-2 for maintenance before the notices.
	admin := contracts.NodeAdmin{SchemaVersion: 1, NodeID: "spot-2", Cordoned: true, Reason: "maintenance window"}
	data, _ := json.Marshal(admin)
	if _, err := kv.Put(ctx, "spot-2", data); err != nil {
		t.Fatal(err)
	}
	noticeAt := clk.Now()
	deadline := noticeAt.Add(simcloud.NoticeAhead)
	for _, id := range []string{"spot-1", "spot-2"} {
		if err := sim.Interrupt(id); err != nil {
			t.Fatal(err)
		}
	}
	hold := func(node string) (contracts.NodeAdmin, bool) {
		e, err := kv.Get(ctx, node)
		if err != nil {
			return contracts.NodeAdmin{}, false
		}
		var na contracts.NodeAdmin
		return na, json.Unmarshal(e.Value(), &na) == nil
	}
	spotHeld := func(node string) bool {
		na, ok := hold(node)
		return ok && na.Cordoned && na.Drain && na.Cause == contracts.ReasonSpotInterruption && na.Deadline != nil && na.Deadline.Equal(deadline)
	}
	eventually(t, "both nodes drained for the reclaim", func() bool { return spotHeld("spot-1") && spotHeld("spot-2") })
	if na, _ := hold("spot-1"); !strings.HasPrefix(na.Reason, "autoscaler:") {
		t.Errorf("hold written by the autoscaler has reason %q; want the autoscaler: prefix", na.Reason)
	}
	if na, _ := hold("spot-2"); na.Reason != "maintenance window" {
		t.Errorf("administrator's hold reason became %q; want it kept", na.Reason)
	}
	// Both are going: one replacement now, as the maximum of 3 allows.
	eventually(t, "a replacement requested ahead of the reclaim", func() bool { return len(sim.Machines()) == 3 })

	ep := fmt.Sprint(deadline.Unix())
	firing := waitAlerts(t, b, 2)
	for i, node := range []string{"spot-1", "spot-2"} {
		a := firing[i]
		wantID := "alert/spot_interruption/" + node + "/" + ep + "/firing"
		if a.id != wantID || a.State != contracts.AlertFiring || a.Key != node || a.Labels[contracts.AlertLabelPool] != "spot" ||
			a.Labels[contracts.AlertLabelMachine] != node || a.Labels[contracts.AlertLabelDeadline] != deadline.Format(time.RFC3339) {
			t.Errorf("alert %d: %s %+v; want %s firing for %s with pool, machine and deadline labels", i, a.id, a.Alert, wantID, node)
		}
	}

	// The reclaim.
	clk.Advance(simcloud.NoticeAhead)
	sim.Advance()
	eventually(t, "the autoscaler's hold lifted", func() bool { _, ok := hold("spot-1"); return !ok })
	all := waitAlerts(t, b, 4)
	for _, a := range all[2:] {
		if a.State != contracts.AlertResolved || !strings.HasSuffix(a.id, "/"+ep+"/resolved") {
			t.Errorf("after the reclaim: %s %s; want resolved", a.id, a.State)
		}
	}
	eventually(t, "the spot cause taken off the administrator's hold", func() bool { na, _ := hold("spot-2"); return na.Cause == "" })
	if na, ok := hold("spot-2"); !ok || na.Reason != "maintenance window" || !na.Cordoned || na.Deadline != nil {
		t.Errorf("administrator's hold of spot-2 after the reclaim: %+v (present %v); want it kept, without cause and deadline", na, ok)
	}
	eventually(t, "pool refilled to its minimum", func() bool {
		live := 0
		for _, m := range sim.Machines() {
			if m.State != cloud.Deleted {
				live++
			}
		}
		return live == 2
	})

	events := waitMachineEvents(t, b, "spot", func(evs map[string]contracts.MachineEvent) bool {
		return len(evs) >= 4+2+2 // requested ×4, interrupted ×2, reclaimed ×2
	})
	for _, id := range []string{"spot-1", "spot-2"} {
		for _, k := range []contracts.MachineEventKind{contracts.MachineInterrupted, contracts.MachineReclaimed} {
			e, ok := events[contracts.MachineEventID(k, id)]
			if !ok || e.NodeID != id || e.Deadline == nil || !e.Deadline.Equal(deadline) {
				t.Errorf("%s event of %s: %+v (present %v); want it with the deadline", k, id, e, ok)
			}
		}
	}
	for _, m := range sim.Machines() {
		if e, ok := events[contracts.MachineEventID(contracts.MachineRequested, m.ID)]; !ok || e.Token != m.Token {
			t.Errorf("requested event of %s (token %s): %+v (present %v)", m.ID, m.Token, e, ok)
		}
	}
}

// A provider down for hours of simulated time trips the breaker: calls
// stop reaching it (no retry storm). When it recovers, and even though the
// first create's reply is lost, each token the decision asked for names
// one machine.
func TestProviderOutageOpensTheBreakerAndMakesNoDuplicates(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	publish(t, b, contracts.SubjectInventory("p0"), "inv-p0", inventory("p0", "h100", "a3-highgpu-8g", 8, "H100-80GB"))
	clk := &clock{now: time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)}
	sim := newSim(t, clk, 0)
	sim.SetFailing(true, nil)
	cfg := testConfig(t, srv, clk, sim, map[string]autoscaler.Pool{
		"h100": {Min: 0, Max: 4, MachineType: "a3-highgpu-8g", PriceClass: cloud.OnDemand}})
	const openFor = time.Second
	cfg.BreakerOpenFor = openFor
	start(t, cfg)

	seq := publish(t, b, contracts.SubjectDemand("h100"), "d1", contracts.PoolDemand{SchemaVersion: 1, Pool: "h100",
		Nodes: 1, Waiting: []contracts.Shape{{Model: "H100-80GB", GPUs: 8, Count: 2}}})
	id := "scale/h100/" + itoa(seq) + "/up-3"
	calls := func() int { c := sim.Calls(); return c["list"] + c["create"] + c["delete"] }
	// Each poll moves the clock past the longest backoff: only the
	// breaker can keep calls from the provider now.
	eventually(t, "five failed calls trip the breaker", func() bool { clk.Advance(3 * time.Minute); return calls() >= 5 })
	tripped := time.Now()
	for range 50 {
		clk.Advance(3 * time.Minute)
		time.Sleep(20 * time.Millisecond) // one actuator step per advance
	}
	// While open, at most one probe per openFor gets through.
	if got, most := calls(), 5+int(time.Since(tripped)/openFor)+1; got > most {
		t.Errorf("%d provider calls during 150 simulated minutes of outage; want at most %d (breaker open)", got, most)
	}

	sim.SetFailing(false, nil)
	sim.LoseReplies(1)
	eventually(t, "the decision's machines created after the outage", func() bool {
		clk.Advance(3 * time.Minute)
		return len(sim.Machines()) >= 2 && len(tokens(sim.Machines())) >= 2
	})
	perToken := map[string]int{}
	for _, m := range sim.Machines() {
		perToken[m.Token]++
	}
	if len(perToken) != 2 || perToken[id+"#0"] != 1 || perToken[id+"#1"] != 1 {
		t.Errorf("machines per token %v; want one each for %s#0 and %s#1", perToken, id, id)
	}
}

// A firing scale_up alert for a managed pool is one more machine, once
// per episode; the next episode waits for the cooldown; alerts for other
// pools and other actions are ignored.
func TestScaleUpAlertAddsOneMachine(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	clk := &clock{now: time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)}
	sim := newSim(t, clk, 0)
	cfg := testConfig(t, srv, clk, sim, map[string]autoscaler.Pool{
		"l4": {Min: 0, Max: 3, MachineType: "g2-standard-8", PriceClass: cloud.OnDemand, UpCooldown: time.Minute}})
	start(t, cfg)

	alert := func(pool, action, episode string, st contracts.AlertState) {
		a := contracts.Alert{SchemaVersion: 1, Kind: "pool_util_high", Key: pool, State: st, Severity: "warning",
			Labels: map[string]string{contracts.AlertLabelAction: action, contracts.AlertLabelPool: pool,
				contracts.AlertLabelScope: "pool", contracts.AlertLabelEpisode: episode},
			Message: "pool GPU utilisation above 90% for 5 minutes", Time: clk.Now()}
		// Each publish gets its own message ID: a redelivery the bus
		// cannot de-duplicate.
		publish(t, b, contracts.SubjectAlert(a.Kind), fmt.Sprintf("a-%s-%s-%s-%d", pool, episode, st, time.Now().UnixNano()), a)
	}
	ep1 := "scale/l4/alert/pool_util_high/l4/1#0"
	ep2 := "scale/l4/alert/pool_util_high/l4/2#0"
	alert("l4", contracts.AlertActionScaleUp, "1", contracts.AlertFiring)
	eventually(t, "one machine for episode 1", func() bool { return len(sim.Machines()) == 1 })
	alert("l4", contracts.AlertActionScaleUp, "1", contracts.AlertFiring) // seen again
	alert("a100", contracts.AlertActionScaleUp, "1", contracts.AlertFiring)
	alert("l4", "", "7", contracts.AlertFiring)
	alert("l4", contracts.AlertActionScaleUp, "1", contracts.AlertResolved)
	alert("l4", contracts.AlertActionScaleUp, "2", contracts.AlertFiring)
	// Episode 2 waits for the cooldown; everything before it was read
	// once its decision lands, so a duplicate would show now.
	clk.Advance(61 * time.Second)
	eventually(t, "episode 2 after the cooldown", func() bool { return len(sim.Machines()) >= 2 })
	if diff := strings.Join(tokens(sim.Machines()), " "); diff != ep1+" "+ep2 {
		t.Errorf("tokens %q; want %q", diff, ep1+" "+ep2)
	}
}

type seenAlert struct {
	contracts.Alert
	id string
}

// waitAlerts waits for n spot alerts and returns them in stream order.
func waitAlerts(t *testing.T, b *bus.Bus, n int) []seenAlert {
	t.Helper()
	var got []seenAlert
	eventually(t, fmt.Sprintf("%d spot alerts", n), func() bool {
		got = got[:0]
		_, err := b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamOps,
			FilterSubjects: []string{contracts.SubjectAlert(contracts.AlertKindSpotInterruption)}}, func(_ context.Context, m *bus.Msg) error {
			var a contracts.Alert
			if err := m.Decode(&a); err != nil {
				return err
			}
			got = append(got, seenAlert{Alert: a, id: m.ID()})
			return nil
		})
		return err == nil && len(got) >= n
	})
	return got
}

// waitMachineEvents waits until done holds for pool's machine events, by
// Nats-Msg-Id, each checked to be under its MachineEventID.
func waitMachineEvents(t *testing.T, b *bus.Bus, pool string, done func(map[string]contracts.MachineEvent) bool) map[string]contracts.MachineEvent {
	t.Helper()
	var evs map[string]contracts.MachineEvent
	var bad error
	eventually(t, "machine events of "+pool, func() bool {
		evs = map[string]contracts.MachineEvent{}
		_, err := b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamOps,
			FilterSubjects: []string{contracts.SubjectMachines(pool)}}, func(_ context.Context, m *bus.Msg) error {
			var e contracts.MachineEvent
			if err := m.Decode(&e); err != nil {
				return err
			}
			key := e.MachineID
			if key == "" {
				key = e.Token
			}
			if want := contracts.MachineEventID(e.Kind, key); m.ID() != want || e.Pool != pool {
				bad = fmt.Errorf("machine event %+v came as %s; want %s", e, m.ID(), want)
			}
			evs[m.ID()] = e
			return nil
		})
		return err == nil && done(evs)
	})
	if bad != nil {
		t.Error(bad)
	}
	return evs
}
