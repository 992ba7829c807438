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
		nd.GPUs = append(nd.GPUs, placement.GPU{Index: i, UUID: fmt.Sprint(id, i), Model: model, MemoryMiB: 81920, Free: i >= busy})
	}
	return nd
}

func TestCompute(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	snap := placement.Snapshot{Nodes: []placement.Node{
		node("h1", "h100", "H100-80GB", 8, 6),
		node("h2", "h100", "H100-80GB", 8, 8),
		node("a1", "a100", "A100-80GB", 4, 0),
	}}
	waiting := []placement.Request{
		{Count: 8, Model: "H100-80GB"},               // h100 only; fits a machine there
		{Count: 8, Model: "H100-80GB"},               // same shape
		{Count: 16, Model: "H100-80GB"},              // no machine holds it: counted, not waiting
		{Count: 2, Model: contracts.GPUModelAny},     // both pools
		{Count: 1, Model: "A100-80GB", Pool: "h100"}, // named pool without the model
		{Count: 4, Model: "L4", Pool: "l4"},          // a pool without machines yet
		{Count: 1, Model: "T4"},                      // no pool has T4: counted nowhere
	}
	got := Compute(snap, map[string]int{"a100": 4}, waiting, []string{"h100", "a100", "spare"}, now)
	shape := func(m string, g, c int) contracts.Shape { return contracts.Shape{Model: m, GPUs: g, Count: c} }
	want := map[string]contracts.PoolDemand{
		"h100": {SchemaVersion: 1, Pool: "h100", Time: now, PendingJobs: 5, PendingGPUs: 35,
			Waiting: []contracts.Shape{shape("H100-80GB", 8, 2), shape("any", 2, 1)},
			Nodes:   2, FreeGPUs: 2, TotalGPUs: 16},
		"a100": {SchemaVersion: 1, Pool: "a100", Time: now, PendingJobs: 1, PendingGPUs: 2,
			Waiting: []contracts.Shape{shape("any", 2, 1)}, Nodes: 1, FreeGPUs: 0, TotalGPUs: 4},
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
