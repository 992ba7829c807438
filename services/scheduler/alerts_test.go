package scheduler

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
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
