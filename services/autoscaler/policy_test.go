package autoscaler_test

import (
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/autoscaler"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
)

// TestOnlyPoolsWithAPolicyAreDecided: with a provider, demand for a pool
// with no scaling policy becomes no decision. No one would act on it, and
// the monitor counted each as a scale-up (gpuplane_scale_decisions_total)
// of a pool that never grows. The pool with a policy is decided as before.
func TestOnlyPoolsWithAPolicyAreDecided(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	publish(t, b, contracts.SubjectInventory("h0"), "inv-h0", inventory("h0", "h100", "a3-highgpu-8g", 8, "H100-80GB"))
	publish(t, b, contracts.SubjectInventory("a0"), "inv-a0", inventory("a0", "a100", "a2-ultragpu-8g", 8, "A100-80GB"))

	clk := &clock{now: time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)}
	cfg := testConfig(t, srv, clk, newSim(t, clk, 0), map[string]autoscaler.Pool{
		"h100": {Min: 0, Max: 4, MachineType: "a3-highgpu-8g", PriceClass: cloud.OnDemand}})
	start(t, cfg)

	// a100's demand first: demand is read in stream order, so once h100's
	// decision is out, a100's demand has been weighed.
	publish(t, b, contracts.SubjectDemand("a100"), "d-a100", contracts.PoolDemand{SchemaVersion: 1, Pool: "a100",
		Nodes: 1, Waiting: []contracts.Shape{{Model: "A100-80GB", GPUs: 8, Count: 2}}})
	publish(t, b, contracts.SubjectDemand("h100"), "d-h100", contracts.PoolDemand{SchemaVersion: 1, Pool: "h100",
		Nodes: 1, Waiting: []contracts.Shape{{Model: "H100-80GB", GPUs: 8, Count: 2}}})
	if d := waitDecision(t, b, "h100"); d.Direction != contracts.ScaleUp || d.DesiredNodes != 3 {
		t.Fatalf("h100 decision = %+v; want up to 3", d)
	}
	if ds := decisionsOf(t, b, "a100"); len(ds) != 0 {
		t.Errorf("decisions for a100, a pool with no scaling policy: %+v", ds)
	}
}
