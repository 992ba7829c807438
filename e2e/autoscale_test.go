package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/autoscaler"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// The autoscaling end-to-end tests: the whole platform on the simulated
// cloud of the all-in-one (package simcloud behind Endpoints.Cloud), whose
// machines boot real node agents and die with their runs. Each test drives
// one scenario of issue 4 (a burst, a spot interruption storm, a provider
// outage) and checks it from the outside: job events, the autoscaler's
// decisions and machine events on OPS, the provider's own list, and the
// oracle.

// autoscaledFleet declares the machine type hgx-h100-4 (4×H100, NVLink)
// and an empty static pool named pool: it lends the autoscaled pool of the
// same name its zone and price class; the autoscaler brings every machine.
func autoscaledFleet(pool, priceClass string) *fleet.Fleet {
	return &fleet.Fleet{
		MachineTypes: map[string]fleet.MachineType{
			"hgx-h100-4": {GPUModel: "H100-80GB", GPUCount: 4, NVLink: true},
		},
		Pools: []fleet.Pool{{Name: pool, MachineType: "hgx-h100-4", Count: 0, Zone: "zone-a", PriceClass: priceClass}},
	}
}

// withAutoscale runs the stack with the autoscaled pools, a spot notice
// of notice, and the autoscaler reconciling four times a second with a
// short circuit-breaker open time, so scenarios play out in seconds.
func withAutoscale(notice time.Duration, pools ...gpuplane.AutoscalePool) func(*gpuplane.Config) {
	return func(c *gpuplane.Config) {
		c.Autoscale = pools
		c.SpotNotice = notice
		c.Autoscaler = func(ac *autoscaler.Config) {
			ac.ActuateEvery = 250 * time.Millisecond
			ac.BreakerOpenFor = 2 * time.Second
		}
	}
}

// fourH100 is a simulated job of one whole 4×H100 machine of pool.
func fourH100(id, pool string, d time.Duration, checkpoint bool) contracts.JobRequest {
	return contracts.JobRequest{ID: id, Pool: pool,
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 4, Model: "H100-80GB"}},
		Run:       contracts.RunSpec{Duration: contracts.Duration(d), Checkpoint: checkpoint}}
}

// opsLog follows one pool's scale decisions and machine events on OPS.
type opsLog struct {
	mu        sync.Mutex
	decisions []contracts.ScaleDecision
	machines  []contracts.MachineEvent
}

func (s *stack) watchOps(t testing.TB, pool string) *opsLog {
	t.Helper()
	o := &opsLog{}
	s.tail(t, contracts.StreamOps, []string{contracts.SubjectScale(pool), contracts.SubjectMachines(pool)}, func(m jetstream.Msg) {
		o.mu.Lock()
		defer o.mu.Unlock()
		switch m.Subject() {
		case contracts.SubjectScale(pool):
			var d contracts.ScaleDecision
			if json.Unmarshal(m.Data(), &d) == nil {
				o.decisions = append(o.decisions, d)
			}
		case contracts.SubjectMachines(pool):
			var e contracts.MachineEvent
			if json.Unmarshal(m.Data(), &e) == nil {
				o.machines = append(o.machines, e)
			}
		}
	})
	return o
}

// ups is every scale-up decision so far.
func (o *opsLog) ups() []contracts.ScaleDecision {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []contracts.ScaleDecision
	for _, d := range o.decisions {
		if d.Direction == contracts.ScaleUp {
			out = append(out, d)
		}
	}
	return out
}

// events is the machine events of kind so far, in stream order.
func (o *opsLog) events(kind contracts.MachineEventKind) []contracts.MachineEvent {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []contracts.MachineEvent
	for _, e := range o.machines {
		if e.Kind == kind {
			out = append(out, e)
		}
	}
	return out
}

// machineIDs is the machine IDs of events, sorted.
func machineIDs(evs []contracts.MachineEvent) []string {
	var out []string
	for _, e := range evs {
		out = append(out, e.MachineID)
	}
	slices.Sort(out)
	return out
}

// summary lists the machine events, for failure messages.
func (o *opsLog) summary() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []string
	for _, e := range o.machines {
		out = append(out, fmt.Sprintf("%s %s", e.Kind, cmpOr(e.MachineID, e.Token)))
	}
	for _, d := range o.decisions {
		out = append(out, fmt.Sprintf("decision %s %d→%d", d.Direction, d.CurrentNodes, d.DesiredNodes))
	}
	return strings.Join(out, ", ")
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// poolSampler samples the provider's live (not deleted) machines of one
// pool every 20 ms, for bounds that must hold at every moment: never more
// than the pool's maximum, never fewer than its minimum once filled.
type poolSampler struct {
	mu       sync.Mutex
	min, max int
	armed    bool // min is tracked only once the pool was filled
}

func watchPool(t testing.TB, c interface{ Machines() []cloud.Machine }, pool string) *poolSampler {
	t.Helper()
	p := &poolSampler{min: -1}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			live := len(liveMachines(c.Machines(), pool))
			p.mu.Lock()
			p.max = max(p.max, live)
			if p.armed && (p.min < 0 || live < p.min) {
				p.min = live
			}
			p.mu.Unlock()
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
	return p
}

// arm starts tracking the least live count.
func (p *poolSampler) arm() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.armed = true
}

func (p *poolSampler) bounds() (least, most int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.min, p.max
}

// liveMachines keeps pool's machines that are not deleted.
func liveMachines(ms []cloud.Machine, pool string) []cloud.Machine {
	var out []cloud.Machine
	for _, m := range ms {
		if m.Pool == pool && m.State != cloud.Deleted {
			out = append(out, m)
		}
	}
	return out
}

// noNodeLost fails the test if any of jobs was requeued because its
// machine disappeared under it.
func noNodeLost(t testing.TB, h *history, keys []string) {
	t.Helper()
	for _, k := range keys {
		for _, ev := range h.of(k) {
			if ev.Type == contracts.EventRequeued && ev.Reason == contracts.ReasonNodeLost {
				t.Errorf("%s requeued with node_lost: a machine went away with its work: %s", k, h.types(k))
			}
		}
	}
}

// TestBurstScalesAPoolUpAndBackDown submits more whole-machine jobs than
// the pool's one machine holds: the autoscaler decides a scale-up, creates
// machines whose agents register, every job runs and succeeds, then the
// idle machines are drained and deleted one by one back to the minimum,
// never below it, never above the maximum, and never while they hold work.
func TestBurstScalesAPoolUpAndBackDown(t *testing.T) {
	const pool, minN, maxN = "burst", 1, 4
	s := startStack(t, autoscaledFleet(pool, cloud.OnDemand), withScheduler(time.Second, time.Second),
		withAutoscale(5*time.Second, gpuplane.AutoscalePool{Name: pool, MachineType: "hgx-h100-4", PriceClass: cloud.OnDemand,
			Min: minN, Max: maxN, ProvisionDelay: 500 * time.Millisecond,
			UpCooldown: 2 * time.Second, DownCooldown: time.Second, IdleFor: 2 * time.Second}))
	h := s.watchHistory(t)
	ops := s.watchOps(t, pool)
	samples := watchPool(t, s.ep.Cloud, pool)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	waitFor(t, 30*time.Second, "the pool filled to its minimum", func() (bool, string) {
		return len(ops.events(contracts.MachineReady)) >= minN, ops.summary()
	})
	first := machineIDs(ops.events(contracts.MachineReady))
	samples.arm()

	var keys []string
	for i := range maxN {
		id := fmt.Sprintf("burst-%d", i)
		s.submitJob(t, ctx, "acme", fourH100(id, pool, 6*time.Second, false))
		keys = append(keys, "acme/"+id)
	}
	waitFor(t, 30*time.Second, "a scale-up decision", func() (bool, string) {
		return len(ops.ups()) > 0, ops.summary()
	})
	for _, d := range ops.ups() {
		if d.Pool != pool || d.DesiredNodes <= d.CurrentNodes || d.DesiredNodes > maxN || d.Reason == "" {
			t.Errorf("decision %+v: want pool %s growing within its maximum %d, with a reason", d, pool, maxN)
		}
	}
	for _, k := range keys {
		h.awaitState(t, 90*time.Second, k, contracts.StateSucceeded)
	}

	// The burst ran on machines the scale-up brought.
	nodes := map[string]bool{}
	for _, k := range keys {
		for _, ev := range h.of(k) {
			if ev.Type == contracts.EventRunning && ev.Placement != nil {
				nodes[ev.Placement.NodeID] = true
			}
		}
	}
	requested := ops.events(contracts.MachineRequested)
	if len(requested) <= minN {
		t.Errorf("%d machines requested, want more than the %d of the minimum: %s", len(requested), minN, ops.summary())
	}
	newRan := false
	for n := range nodes {
		newRan = newRan || !slices.Contains(first, n)
	}
	if !newRan {
		t.Errorf("the burst ran only on %v, the machines there before it", nodes)
	}
	waitFor(t, 30*time.Second, "every requested machine ready", func() (bool, string) {
		return len(ops.events(contracts.MachineReady)) >= len(requested), ops.summary()
	})

	// Back down to the minimum, one drained machine at a time.
	waitFor(t, 60*time.Second, "the pool back at its minimum", func() (bool, string) {
		live := liveMachines(s.ep.Cloud.Machines(), pool)
		created := len(s.ep.Cloud.Machines())
		return len(live) == minN && len(ops.events(contracts.MachineDeleted)) == created-minN,
			fmt.Sprintf("%d live of %d created; %s", len(live), created, ops.summary())
	})
	deleted := ops.events(contracts.MachineDeleted)
	draining := machineIDs(ops.events(contracts.MachineDraining))
	for _, d := range deleted {
		if !slices.Contains(draining, d.MachineID) {
			t.Errorf("machine %s deleted without a draining event first: %s", d.MachineID, ops.summary())
		}
		// Nothing that ran there was still running when it was deleted.
		for _, k := range keys {
			for _, ev := range h.of(k) {
				if ev.Type == contracts.EventRunning && ev.Placement != nil && ev.Placement.NodeID == d.NodeID {
					end, _ := h.last(k)
					if end.EndedAt == nil || end.EndedAt.After(d.Time) {
						t.Errorf("%s ran on %s until %v, deleted at %v", k, d.NodeID, end.EndedAt, d.Time)
					}
				}
			}
		}
	}
	// The pool stays at its minimum: no further drain comes.
	time.Sleep(3 * time.Second)
	if live := liveMachines(s.ep.Cloud.Machines(), pool); len(live) != minN {
		t.Errorf("%d machines live after the scale-down settled, want %d", len(live), minN)
	}
	least, most := samples.bounds()
	if least < minN || most > maxN {
		t.Errorf("live machines ranged %d to %d, want within [%d, %d]", least, most, minN, maxN)
	}
	noNodeLost(t, h, keys)
	for _, k := range keys {
		if n := h.count(k, contracts.EventRequeued); n != 0 {
			t.Errorf("%s requeued: %s", k, h.types(k))
		}
	}
	t.Logf("machines: %s; live between %d and %d", ops.summary(), least, most)
	s.checkOracle(t)
}

// TestSpotInterruptionStormLosesNoJob gives half of a spot pool its
// interruption notice at once while a checkpointing job runs on every
// machine: each job on a noticed machine is announced migrating
// (spot_interruption, the reclaim as deadline) before the reclaim,
// checkpoints, moves, restores its checkpoint elsewhere (migrated) and
// succeeds; the others are untouched; the pool is refilled to its minimum
// and no job is lost to the reclaim.
func TestSpotInterruptionStormLosesNoJob(t *testing.T) {
	const pool, minN, maxN = "spot", 4, 6
	const notice = 5 * time.Second
	s := startStack(t, autoscaledFleet(pool, cloud.Spot), withScheduler(time.Second, time.Second),
		withAutoscale(notice, gpuplane.AutoscalePool{Name: pool, MachineType: "hgx-h100-4", PriceClass: cloud.Spot,
			Min: minN, Max: maxN, ProvisionDelay: 500 * time.Millisecond,
			UpCooldown: 2 * time.Second, DownCooldown: time.Second, IdleFor: 2 * time.Second}))
	h := s.watchHistory(t)
	ops := s.watchOps(t, pool)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	waitFor(t, 30*time.Second, "the pool filled to its minimum", func() (bool, string) {
		return len(ops.events(contracts.MachineReady)) >= minN, ops.summary()
	})
	var keys []string
	for i := range minN {
		id := fmt.Sprintf("spot-job-%d", i)
		s.submitJob(t, ctx, "acme", fourH100(id, pool, 12*time.Second, true))
		keys = append(keys, "acme/"+id)
	}
	onNode := map[string]string{} // job → node
	for _, k := range keys {
		ev := h.awaitState(t, 30*time.Second, k, contracts.StateRunning)
		onNode[k] = ev.Placement.NodeID
	}
	time.Sleep(1500 * time.Millisecond) // progress worth keeping

	// Half the pool noticed at once: the machines of the first half of
	// the jobs.
	victims, bystanders := keys[:minN/2], keys[minN/2:]
	reclaimAt := map[string]time.Time{} // node → reclaim
	for _, k := range victims {
		if err := s.ep.Cloud.Interrupt(onNode[k]); err != nil {
			t.Fatalf("interrupt %s: %v", onNode[k], err)
		}
	}
	for _, m := range s.ep.Cloud.Machines() {
		if !m.Interruption.IsZero() {
			reclaimAt[m.NodeID] = m.Interruption
		}
	}
	if len(reclaimAt) != len(victims) {
		t.Fatalf("%d machines under notice, want %d", len(reclaimAt), len(victims))
	}

	for _, k := range victims {
		node := onNode[k]
		mig := h.await(t, 30*time.Second, k, "migrating", isType(contracts.EventMigrating, 1))
		m := mig.Migration
		switch {
		case mig.Reason != contracts.ReasonSpotInterruption || m == nil || m.Reason != contracts.ReasonSpotInterruption:
			t.Errorf("%s migrating %+v (%+v), want reason spot_interruption", k, mig, m)
		case m.Deadline == nil || m.Deadline.Sub(reclaimAt[node]).Abs() > time.Second:
			t.Errorf("%s migrating with deadline %v, want the reclaim of %s at %v", k, m.Deadline, node, reclaimAt[node])
		case !m.Checkpoint:
			t.Errorf("%s migrating without a checkpoint first: %+v", k, m)
		case !mig.Time.Before(reclaimAt[node]):
			t.Errorf("%s announced migrating at %v, after its machine's reclaim at %v", k, mig.Time, reclaimAt[node])
		}
		req := h.await(t, 30*time.Second, k, "requeued", isType(contracts.EventRequeued, 2))
		if req.Reason != contracts.ReasonSpotInterruption {
			t.Errorf("%s requeued with %s, want spot_interruption (moved before the reclaim): %s", k, req.Reason, h.types(k))
		}
		again := h.await(t, 30*time.Second, k, "scheduled again", isType(contracts.EventScheduled, 2))
		if again.Placement == nil || reclaimAt[again.Placement.NodeID] != (time.Time{}) {
			t.Errorf("%s attempt 2 placed on %+v, want a machine not under notice", k, again.Placement)
		}
		moved := h.await(t, 30*time.Second, k, "migrated", isType(contracts.EventMigrated, 2))
		if mm := moved.Migration; mm == nil || mm.RestoredFrom == "" || !mm.Checkpointed || mm.FromAttempt != 1 {
			t.Errorf("%s migrated %+v (%+v), want attempt 1's requested checkpoint restored", k, moved, mm)
		}
	}
	for _, k := range keys {
		h.awaitState(t, 60*time.Second, k, contracts.StateSucceeded)
	}
	for _, k := range bystanders {
		if n := h.count(k, contracts.EventRequeued) + h.count(k, contracts.EventMigrating); n != 0 {
			t.Errorf("%s, on a machine without notice, was moved: %s", k, h.types(k))
		}
	}

	// Both machines reclaimed, each announced interrupted first, and the
	// pool back at its minimum with replacements.
	waitFor(t, 30*time.Second, "the noticed machines reclaimed and the pool refilled", func() (bool, string) {
		live := liveMachines(s.ep.Cloud.Machines(), pool)
		return len(ops.events(contracts.MachineReclaimed)) == len(victims) && len(live) >= minN,
			fmt.Sprintf("%d live; %s", len(live), ops.summary())
	})
	noticed := make([]string, 0, len(reclaimAt))
	for n := range reclaimAt {
		noticed = append(noticed, n)
	}
	slices.Sort(noticed)
	if got := machineIDs(ops.events(contracts.MachineInterrupted)); !slices.Equal(got, noticed) {
		t.Errorf("interrupted events for %v, want %v", got, noticed)
	}
	if got := machineIDs(ops.events(contracts.MachineReclaimed)); !slices.Equal(got, noticed) {
		t.Errorf("reclaimed events for %v, want %v", got, noticed)
	}
	for _, m := range liveMachines(s.ep.Cloud.Machines(), pool) {
		if reclaimAt[m.NodeID] != (time.Time{}) {
			t.Errorf("noticed machine %s still live after its reclaim", m.ID)
		}
	}
	refills := 0
	for _, e := range ops.events(contracts.MachineRequested) {
		if strings.HasPrefix(e.DecisionID, "min/") {
			refills++
		}
	}
	if refills < minN+len(victims) {
		t.Errorf("%d machines requested to keep the minimum, want %d (the first fill and a replacement per reclaim): %s",
			refills, minN+len(victims), ops.summary())
	}
	noNodeLost(t, h, keys)
	t.Logf("machines: %s", ops.summary())
	s.checkOracle(t)
}

// TestProviderOutageMakesNoDuplicateMachines takes the provider down while
// a gang waits for two more machines, and loses the replies of the first
// creates after it comes back: every create token yields one machine, the
// pool reaches exactly the size the decision asked for, never more than
// its maximum, and the gang runs.
func TestProviderOutageMakesNoDuplicateMachines(t *testing.T) {
	const pool, minN, maxN = "ondemand", 1, 4
	// A long up-cooldown: the one decision of the test is the gang's, so
	// the size to reach is known.
	s := startStack(t, autoscaledFleet(pool, cloud.OnDemand), withScheduler(time.Second, time.Second),
		withAutoscale(5*time.Second, gpuplane.AutoscalePool{Name: pool, MachineType: "hgx-h100-4", PriceClass: cloud.OnDemand,
			Min: minN, Max: maxN, ProvisionDelay: 500 * time.Millisecond,
			UpCooldown: 5 * time.Minute, DownCooldown: time.Minute, IdleFor: time.Minute}))
	h := s.watchHistory(t)
	ops := s.watchOps(t, pool)
	samples := watchPool(t, s.ep.Cloud, pool)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cl := s.ep.Cloud

	waitFor(t, 30*time.Second, "the pool filled to its minimum", func() (bool, string) {
		return len(ops.events(contracts.MachineReady)) >= minN, ops.summary()
	})
	samples.arm()

	cl.SetFailing(true, nil)
	failingSince := cl.Calls()["list"]
	// One gang of two whole machines: the demand asks for two more at
	// once, whatever the scheduler's timing.
	s.submitJob(t, ctx, "acme", contracts.JobRequest{ID: "gang", Pool: pool,
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 8, Model: "H100-80GB", Nodes: 2}},
		Run:       contracts.RunSpec{Duration: contracts.Duration(3 * time.Second)}})
	waitFor(t, 30*time.Second, "a scale-up decision", func() (bool, string) {
		return len(ops.ups()) > 0, ops.summary()
	})
	dec := ops.ups()[0]
	if dec.CurrentNodes != minN || dec.DesiredNodes != minN+2 {
		t.Fatalf("decision %d→%d, want %d→%d for a gang of two machines", dec.CurrentNodes, dec.DesiredNodes, minN, minN+2)
	}
	// Several reconciliations fail while the decision waits.
	waitFor(t, 30*time.Second, "failed provider calls during the outage", func() (bool, string) {
		n := cl.Calls()["list"] - failingSince
		return n >= 2, fmt.Sprintf("%d lists since the outage began", n)
	})
	if n := len(liveMachines(cl.Machines(), pool)); n != minN {
		t.Fatalf("%d machines live during the outage, want %d", n, minN)
	}
	// It comes back, but the first two creates act without answering.
	cl.LoseReplies(2)
	cl.SetFailing(false, nil)

	waitFor(t, 60*time.Second, "the pool at the decided size", func() (bool, string) {
		live := liveMachines(cl.Machines(), pool)
		return len(live) == dec.DesiredNodes, fmt.Sprintf("%d live; calls %v; %s", len(live), cl.Calls(), ops.summary())
	})
	h.awaitState(t, 60*time.Second, "acme/gang", contracts.StateSucceeded)
	// A ready event comes from a reconciliation that listed the machine:
	// once every machine has one, the actuator has seen what its lost
	// replies created, and would have created again by now if it were
	// going to.
	waitFor(t, 60*time.Second, "every machine ready", func() (bool, string) {
		return len(ops.events(contracts.MachineReady)) == dec.DesiredNodes, ops.summary()
	})
	time.Sleep(time.Second)

	all := cl.Machines()
	tokens := map[string][]string{}
	fromDecision := 0
	for _, m := range all {
		tokens[m.Token] = append(tokens[m.Token], m.ID)
		if strings.HasPrefix(m.Token, dec.ID+"#") {
			fromDecision++
		}
	}
	for tok, ids := range tokens {
		if len(ids) != 1 {
			t.Errorf("token %s created %d machines: %v", tok, len(ids), ids)
		}
	}
	if len(all) != dec.DesiredNodes || fromDecision != dec.DesiredNodes-dec.CurrentNodes {
		t.Errorf("%d machines created (%d for decision %s), want %d (%d for the decision): %s",
			len(all), fromDecision, dec.ID, dec.DesiredNodes, dec.DesiredNodes-dec.CurrentNodes, ops.summary())
	}
	failed := ops.events(contracts.MachineFailed)
	if len(failed) < 2 {
		t.Errorf("%d failed machine events, want one per lost reply (2): %s", len(failed), ops.summary())
	}
	_, most := samples.bounds()
	if most > maxN {
		t.Errorf("%d machines live at once, over the maximum %d", most, maxN)
	}
	if n := h.count("acme/gang", contracts.EventRequeued); n != 0 {
		t.Errorf("gang requeued: %s", h.types("acme/gang"))
	}
	t.Logf("calls %v; machines: %s", cl.Calls(), ops.summary())
	s.checkOracle(t)
}
