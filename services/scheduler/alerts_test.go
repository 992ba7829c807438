package scheduler

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/lease"
)

// hold reads a node's hold document, nil when it has none.
func (e *env) hold(node string) *contracts.NodeAdmin {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	kv, err := e.bus.KeyValue(ctx, contracts.BucketNodeAdmin)
	if err != nil {
		e.t.Fatal(err)
	}
	en, err := kv.Get(ctx, node)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil
	}
	if err != nil {
		e.t.Fatal(err)
	}
	var h contracts.NodeAdmin
	if err := json.Unmarshal(en.Value(), &h); err != nil {
		e.t.Fatal(err)
	}
	return &h
}

func (e *env) waitHold(node string, ok func(*contracts.NodeAdmin) bool) *contracts.NodeAdmin {
	e.t.Helper()
	deadline := time.Now().Add(waitFor)
	for {
		h := e.hold(node)
		if ok(h) {
			return h
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("hold of %s: %+v", node, h)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func gpuAlert(kind, action, node, uuid string, state contracts.AlertState) contracts.Alert {
	return contracts.Alert{SchemaVersion: 1, Kind: kind, Key: node + "/" + uuid, State: state, Severity: "critical",
		Labels: map[string]string{contracts.AlertLabelAction: action, contracts.AlertLabelNode: node,
			contracts.AlertLabelGPU: uuid, contracts.AlertLabelScope: "gpu"},
		Message: kind + " on " + uuid, Since: time.Now().UTC(), Time: time.Now().UTC()}
}

// TestAlertsHoldGPUsAndMoveTheirJobs: the monitor's drain_gpu alert (a hot
// GPU) holds the GPU in gp-node-admin, which migrates the job on it, and
// its resolution lifts that hold; a gpu_unhealthy alert holds its GPU
// until an administrator lifts it, and an administrator's own hold is
// never touched by a resolving alert.
func TestAlertsHoldGPUsAndMoveTheirJobs(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.inventory("n1", "east", h100, 2)
	e.start()
	req := request("hot", 1, h100)
	e.submit("acme", req)
	a := e.waitItem("acme", "hot", 1, "")
	e.commit(a)
	e.runStarted(a, time.Now())
	e.waitEvent("acme", "hot", contracts.EventRunning)
	uuid := a.Devices[0].UUID

	fire := gpuAlert("gpu_hot", contracts.AlertActionDrainGPU, "n1", uuid, contracts.AlertFiring)
	e.publish(contracts.SubjectAlert(fire.Kind), "alert/hot/1/firing", fire)
	h := e.waitHold("n1", func(h *contracts.NodeAdmin) bool { return h != nil && len(h.GPUs) == 1 })
	if g := h.GPUs[uuid]; !g.Cordoned || !g.Drain || g.Cause != contracts.ReasonOverheating || h.Cordoned {
		t.Fatalf("hold %+v", h)
	}
	mig := e.waitEvent("acme", "hot", contracts.EventMigrating)
	if mig.Reason != contracts.ReasonOverheating || mig.Migration == nil || mig.Migration.From[0].NodeID != "n1" {
		t.Fatalf("migrating %+v", mig)
	}
	// A redelivered firing alert changes nothing.
	e.publish(contracts.SubjectAlert(fire.Kind), "alert/hot/1/firing-again", fire)

	resolved := fire
	resolved.State = contracts.AlertResolved
	e.publish(contracts.SubjectAlert(fire.Kind), "alert/hot/1/resolved", resolved)
	e.waitHold("n1", func(h *contracts.NodeAdmin) bool { return h == nil })

	// An unhealthy GPU stays held after its alert resolves.
	other := "GPU-n1-1"
	if other == uuid {
		other = "GPU-n1-0"
	}
	sick := gpuAlert("gpu_xid", contracts.AlertActionGPUUnhealthy, "n1", other, contracts.AlertFiring)
	e.publish(contracts.SubjectAlert(sick.Kind), "alert/xid/1/firing", sick)
	e.waitHold("n1", func(h *contracts.NodeAdmin) bool {
		return h != nil && h.GPUs[other].Cause == contracts.ReasonGPUUnhealthy
	})
	sick.State = contracts.AlertResolved
	e.publish(contracts.SubjectAlert(sick.Kind), "alert/xid/1/resolved", sick)
	// A bad alert is dead-lettered, not retried forever, and does not
	// stop the consumer: the next alert is still applied.
	bad := gpuAlert("gpu_hot", contracts.AlertActionDrainGPU, "", "", contracts.AlertFiring)
	e.publish(contracts.SubjectAlert(bad.Kind), "alert/bad", bad)
	hot2 := gpuAlert("gpu_hot", contracts.AlertActionDrainGPU, "n2", "GPU-n2-0", contracts.AlertFiring)
	e.publish(contracts.SubjectAlert(hot2.Kind), "alert/hot/2/firing", hot2)
	e.waitHold("n2", func(h *contracts.NodeAdmin) bool { return h != nil && len(h.GPUs) == 1 })
	if h := e.hold("n1"); h == nil || h.GPUs[other].Cause != contracts.ReasonGPUUnhealthy {
		t.Fatalf("the unhealthy GPU's hold was lifted by its alert's resolution: %+v", h)
	}
}

// poolAlert is the monitor's pool_fragmented alert about pool, under key
// (the monitor keys a pool-scoped alert by the pool).
func poolAlert(pool, key string, state contracts.AlertState) contracts.Alert {
	labels := map[string]string{contracts.AlertLabelAction: contracts.AlertActionDefragment, contracts.AlertLabelScope: "pool"}
	if pool != "" {
		labels[contracts.AlertLabelPool] = pool
	}
	return contracts.Alert{SchemaVersion: 1, Kind: "pool_fragmented", Key: key, State: state, Severity: "warning",
		Labels: labels, Message: "free capacity of " + key + " fragmented", Since: time.Now().UTC(), Time: time.Now().UTC()}
}

// defragStep is one message on the OPS alert subjects: an alert, or raw
// bytes when raw is set.
type defragStep struct {
	name  string
	alert contracts.Alert
	raw   []byte
}

func (e *env) publishAlertSteps(prefix string, steps []defragStep) {
	e.t.Helper()
	for i, st := range steps {
		id := fmt.Sprintf("%s/%d/%s", prefix, i, st.name)
		if st.raw != nil {
			e.publishRaw(contracts.SubjectAlert("pool_fragmented"), id, st.raw)
			continue
		}
		e.publish(contracts.SubjectAlert(st.alert.Kind), id, st.alert)
	}
}

// followDefragOf runs a fresh scheduler's defragment follow (what run
// starts once live) until the test ends, and returns a reader of the
// pools it turned consolidation on for.
func (e *env) followDefragOf() func() map[string]string {
	e.t.Helper()
	s := newScheduler(e.cfg, e.bus, testLogger(e.t), lease.Term{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.followDefrag(ctx) }()
	e.t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil && ctx.Err() == nil {
			e.t.Errorf("followDefrag: %v", err)
		}
	})
	return func() map[string]string {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.st.Defragmenting()
	}
}

// waitDefrag polls until the follow's pools are want.
func (e *env) waitDefrag(what string, got func() map[string]string, want map[string]string) {
	e.t.Helper()
	deadline := time.Now().Add(waitFor)
	for {
		g := got()
		if maps.Equal(g, want) {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("%s: defragmenting %v, want %v", what, g, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestFollowDefragFoldsAndFollowsDefragmentAlerts: which pools may be
// consolidated is state folded from every defragment alert the OPS stream
// holds, those stored before the scheduler started included, then kept up
// to date from new ones; other alerts and unreadable messages change
// nothing and do not stop the follow; and a restarted scheduler folds the
// same state again.
func TestFollowDefragFoldsAndFollowsDefragmentAlerts(t *testing.T) {
	t.Parallel()
	const east, west = "pool_fragmented/east", "pool_fragmented/west"
	e := newEnv(t)

	// Stored before the scheduler starts: east fires; west fired and
	// resolved; an unreadable message, an alert that asks for another
	// action and one of another rule about a third pool's GPU sit between.
	stored := []defragStep{
		{name: "east-firing", alert: poolAlert("east", east, contracts.AlertFiring)},
		{name: "west-firing", alert: poolAlert("west", west, contracts.AlertFiring)},
		{name: "garbage", raw: []byte("{not an alert")},
		{name: "scale-up", alert: func() contracts.Alert {
			a := poolAlert("south", "pool_pending/south", contracts.AlertFiring)
			a.Labels[contracts.AlertLabelAction] = contracts.AlertActionScaleUp
			return a
		}()},
		{name: "hot-gpu", alert: gpuAlert("gpu_hot", contracts.AlertActionDrainGPU, "n9", "GPU-n9-0", contracts.AlertFiring)},
		{name: "west-resolved", alert: poolAlert("west", west, contracts.AlertResolved)},
	}
	e.publishAlertSteps("stored", stored)
	defrag := e.followDefragOf()
	e.waitDefrag("replay of the stored alerts", defrag, map[string]string{"east": east})

	// Then live, each step checked in turn. A step that must change
	// nothing is followed by one that must change something, so the
	// follow is seen to go on past it.
	live := []struct {
		defragStep
		want map[string]string
	}{
		{defragStep{name: "west-firing", alert: poolAlert("west", west, contracts.AlertFiring)},
			map[string]string{"east": east, "west": west}},
		{defragStep{name: "garbage", raw: []byte(`{"state": 7}`)},
			map[string]string{"east": east, "west": west}},
		{defragStep{name: "no-json", raw: []byte("\x00\x01")},
			map[string]string{"east": east, "west": west}},
		// Another rule's alert about east resolving does not end the
		// episode east's own alert started.
		{defragStep{name: "east-other-key-resolved", alert: poolAlert("east", "pool_stranded/east", contracts.AlertResolved)},
			map[string]string{"east": east, "west": west}},
		{defragStep{name: "east-resolved", alert: poolAlert("east", east, contracts.AlertResolved)},
			map[string]string{"west": west}},
		// Without a pool label the key names the pool.
		{defragStep{name: "north-by-key", alert: poolAlert("", "north", contracts.AlertFiring)},
			map[string]string{"west": west, "north": "north"}},
		{defragStep{name: "west-resolved", alert: poolAlert("west", west, contracts.AlertResolved)},
			map[string]string{"north": "north"}},
		{defragStep{name: "east-firing-again", alert: poolAlert("east", east, contracts.AlertFiring)},
			map[string]string{"north": "north", "east": east}},
	}
	for i, st := range live {
		e.publishAlertSteps(fmt.Sprintf("live/%d", i), []defragStep{st.defragStep})
		e.waitDefrag(st.name, defrag, st.want)
	}

	// A restarted scheduler folds the whole stream to the same state.
	e.waitDefrag("replay after a restart", e.followDefragOf(), live[len(live)-1].want)
}
