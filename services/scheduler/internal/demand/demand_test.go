package demand

import (
	"fmt"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

func node(id, pool, model string, n, busy int) placement.Node {
	nd := placement.Node{ID: id, Pool: pool}
	for i := range n {
		nd.GPUs = append(nd.GPUs, placement.GPU{Index: i, UUID: fmt.Sprint(id, i), Model: model, MemoryMiB: 81920, Held: i < busy})
	}
	return nd
}

func gpu(count int, model, pool string) placement.Request {
	return placement.Request{GPU: contracts.GPURequest{Count: count, Model: model}, Pool: pool}
}

func TestCompute(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	snap := placement.Snapshot{Nodes: []placement.Node{
		node("h1", "h100", "H100-80GB", 8, 6),
		node("h2", "h100", "H100-80GB", 8, 8),
		node("a1", "a100", "A100-80GB", 4, 0),
	}}
	// A card in MIG mode and a card with a share are not free whole GPUs.
	snap.Nodes[0].GPUs[6].MIG = true
	snap.Nodes[0].GPUs[6].Instances = []placement.MIGSlot{{Instance: contracts.MIGInstance{UUID: "MIG-1", Profile: "7g.80gb", Size: 8}}}
	waiting := []placement.Request{
		gpu(8, "H100-80GB", ""),           // h100 only; fits a machine there
		gpu(8, "H100-80GB", ""),           // same shape
		gpu(16, "H100-80GB", ""),          // no machine holds it: counted, not waiting
		gpu(2, contracts.GPUModelAny, ""), // both pools
		gpu(1, "A100-80GB", "h100"),       // named pool without the model
		gpu(4, "L4", "l4"),                // a pool without machines yet
		gpu(1, "T4", ""),                  // no pool has T4: counted nowhere
		{GPU: contracts.GPURequest{Count: 16, Nodes: 2, Model: "H100-80GB"}}, // a gang: two machines of 8
		{GPU: contracts.GPURequest{Count: 1, Models: []string{"T4", "A100-80GB"}, // the pool's allowed model
			Share: &contracts.GPUShare{MemoryMiB: 1024, ComputePercent: 20}}},
	}
	got := Compute(snap, map[string]int{"a100": 4}, waiting, []string{"h100", "a100", "spare"}, now)
	shape := func(m string, g, c int) contracts.Shape { return contracts.Shape{Model: m, GPUs: g, Count: c} }
	want := map[string]contracts.PoolDemand{
		"h100": {SchemaVersion: 1, Pool: "h100", Time: now, PendingJobs: 6, PendingGPUs: 51,
			Waiting: []contracts.Shape{shape("H100-80GB", 8, 4), shape("any", 2, 1)},
			Nodes:   2, FreeGPUs: 1, TotalGPUs: 16},
		"a100": {SchemaVersion: 1, Pool: "a100", Time: now, PendingJobs: 2, PendingGPUs: 3,
			Waiting: []contracts.Shape{shape("A100-80GB", 1, 1), shape("any", 2, 1)}, Nodes: 1, FreeGPUs: 0, TotalGPUs: 4},
		"l4": {SchemaVersion: 1, Pool: "l4", Time: now, PendingJobs: 1, PendingGPUs: 4,
			Waiting: []contracts.Shape{shape("L4", 4, 1)}},
		"spare": {SchemaVersion: 1, Pool: "spare", Time: now, Waiting: []contracts.Shape{}},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("demand (-want +got):\n%s", diff)
	}
	if !Same(got["h100"], func() contracts.PoolDemand { d := got["h100"]; d.Time = now.Add(time.Hour); return d }()) {
		t.Error("Same should ignore Time")
	}
	changed := got["h100"]
	changed.Waiting = []contracts.Shape{shape("H100-80GB", 8, 3)}
	if Same(got["h100"], changed) {
		t.Error("Same missed a change in the waiting shapes")
	}
}
