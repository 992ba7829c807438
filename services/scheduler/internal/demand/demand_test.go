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
			Waiting: []contracts.Shape{{Model: "A100-80GB", GPUs: 1, Count: 1, Share: &contracts.GPUShare{MemoryMiB: 1024, ComputePercent: 20}},
				shape("any", 2, 1)}, Nodes: 1, FreeGPUs: 0, TotalGPUs: 4},
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

// migNode is a machine of n GPUs in MIG mode, each cut into the profiles.
func migNode(id, pool, model string, n int, profiles ...string) placement.Node {
	nd := node(id, pool, model, n, 0)
	for i := range nd.GPUs {
		nd.GPUs[i].MIG = true
		for j, p := range profiles {
			nd.GPUs[i].Instances = append(nd.GPUs[i].Instances, placement.MIGSlot{Instance: contracts.MIGInstance{
				UUID: fmt.Sprint("MIG-", id, i, j), Profile: p, Start: j, Size: 1, MemoryMiB: 9856}})
		}
	}
	return nd
}

func mig(profile, model, pool string) placement.Request {
	return placement.Request{GPU: contracts.GPURequest{Count: 1, Model: model, MIGProfile: profile}, Pool: pool}
}

func share(memMiB int64, pct int, model, pool string) placement.Request {
	return placement.Request{GPU: contracts.GPURequest{Count: 1, Model: model,
		Share: &contracts.GPUShare{MemoryMiB: memMiB, ComputePercent: pct}}, Pool: pool}
}

// MIG and share requests are listed with their profile or share, grouped
// by equal shape, and only in pools whose machines could hold them.
func TestComputeMIGAndShares(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	const h100 = "H100-80GB"
	snap := placement.Snapshot{Nodes: []placement.Node{
		migNode("m1", "mig", h100, 8, "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb"),
		node("w1", "whole", h100, 8, 8),
	}}
	s20 := &contracts.GPUShare{MemoryMiB: 20480, ComputePercent: 40}
	tests := map[string]struct {
		waiting []placement.Request
		want    map[string][]contracts.Shape
	}{
		"MIG requests group by profile, only where the profile exists": {
			waiting: []placement.Request{mig("1g.10gb", h100, ""), mig("1g.10gb", h100, ""), mig("1g.10gb", "any", "")},
			want: map[string][]contracts.Shape{
				"mig": {{Model: h100, GPUs: 1, Count: 2, MIGProfile: "1g.10gb"}, {Model: "any", GPUs: 1, Count: 1, MIGProfile: "1g.10gb"}},
			},
		},
		"a profile no machine has is listed nowhere": {
			waiting: []placement.Request{mig("3g.40gb", h100, ""), mig("3g.40gb", h100, "mig")},
		},
		"shares group by equal share, only on GPUs outside MIG mode": {
			waiting: []placement.Request{share(20480, 40, h100, ""), share(20480, 40, h100, ""), share(20480, 40, h100, "mig"),
				share(1024, 10, "any", "")},
			want: map[string][]contracts.Shape{
				"whole": {{Model: h100, GPUs: 1, Count: 2, Share: s20},
					{Model: "any", GPUs: 1, Count: 1, Share: &contracts.GPUShare{MemoryMiB: 1024, ComputePercent: 10}}},
			},
		},
		"a share bigger than any GPU is listed nowhere": {
			waiting: []placement.Request{share(81921, 10, h100, "")},
		},
		"whole GPUs do not fit on cards in MIG mode": {
			waiting: []placement.Request{gpu(1, h100, "mig"), gpu(2, h100, "")},
			want:    map[string][]contracts.Shape{"whole": {{Model: h100, GPUs: 2, Count: 1}}},
		},
		"a pool without machines lists them all": {
			waiting: []placement.Request{mig("1g.10gb", h100, "new"), share(20480, 40, h100, "new")},
			want: map[string][]contracts.Shape{
				"new": {{Model: h100, GPUs: 1, Count: 1, MIGProfile: "1g.10gb"}, {Model: h100, GPUs: 1, Count: 1, Share: s20}},
			},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			got := Compute(snap, nil, tc.waiting, nil, now)
			waiting := map[string][]contracts.Shape{}
			for pool, d := range got {
				if len(d.Waiting) > 0 {
					waiting[pool] = d.Waiting
				}
			}
			if tc.want == nil {
				tc.want = map[string][]contracts.Shape{}
			}
			if diff := cmp.Diff(tc.want, waiting); diff != "" {
				t.Errorf("waiting shapes (-want +got):\n%s", diff)
			}
			// Every request still counts as pending where it names a pool
			// or its model is present, whether or not more machines help.
			if jobs := got["mig"].PendingJobs + got["whole"].PendingJobs + got["new"].PendingJobs; jobs < len(tc.waiting) {
				t.Errorf("pending jobs = %d, want at least %d", jobs, len(tc.waiting))
			}
		})
	}
}

// Same compares shares by value: a republished demand with equal shares is
// the same demand.
func TestSameComparesSharesByValue(t *testing.T) {
	mk := func(pct int) contracts.PoolDemand {
		return contracts.PoolDemand{Pool: "p", Waiting: []contracts.Shape{{Model: "any", GPUs: 1, Count: 1,
			Share: &contracts.GPUShare{MemoryMiB: 1024, ComputePercent: pct}}}}
	}
	if !Same(mk(40), mk(40)) {
		t.Error("equal shares behind different pointers should be the same")
	}
	if Same(mk(40), mk(50)) {
		t.Error("different shares should differ")
	}
}

// TestComputeSkipsPoolsThatDoNotRunIt: a job that waits for a pool whose
// runtime policy runs it (a host command) is demand there only, never in
// a pool that would not take it with any number of machines.
func TestComputeSkipsPoolsThatDoNotRunIt(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	snap := placement.Snapshot{Nodes: []placement.Node{
		node("i1", "images", "H100-80GB", 8, 8),
		node("t1", "trusted", "H100-80GB", 8, 8),
	}}
	host := gpu(1, "H100-80GB", "")
	host.PoolRuns = func(pool string) bool { return pool == "trusted" }
	got := Compute(snap, nil, []placement.Request{host, gpu(2, "H100-80GB", "")}, []string{"images", "trusted"}, now)
	if d := got["images"]; d.PendingJobs != 1 || d.PendingGPUs != 2 {
		t.Errorf("images: %d jobs, %d GPUs pending; want only the image's 1 and 2", d.PendingJobs, d.PendingGPUs)
	}
	if d := got["trusted"]; d.PendingJobs != 2 || d.PendingGPUs != 3 {
		t.Errorf("trusted: %d jobs, %d GPUs pending; want both, 3 GPUs", d.PendingJobs, d.PendingGPUs)
	}
}

// TestMixedNodeNamesOneModel: a pool whose machines hold two models, and a
// request either fits, names the same model every time, the one the
// machines list first (a pool's kinds came out of a map per node, in
// random order, and the shape flipped between cycles).
func TestMixedNodeNamesOneModel(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	mixed := node("m1", "mixed", "L40S-48GB", 4, 0)
	for i := range 4 {
		mixed.GPUs = append(mixed.GPUs, placement.GPU{Index: 4 + i, UUID: fmt.Sprint("m1-a", i), Model: "A100-80GB", MemoryMiB: 81920})
	}
	req := placement.Request{GPU: contracts.GPURequest{Count: 2, Models: []string{"A100-80GB", "L40S-48GB"}}}
	for range 50 {
		got := Compute(placement.Snapshot{Nodes: []placement.Node{mixed}}, nil, []placement.Request{req}, []string{"mixed"}, now)
		if w := got["mixed"].Waiting; len(w) != 1 || w[0].Model != "L40S-48GB" {
			t.Fatalf("waiting shapes %+v; want one of 2 L40S-48GB, the model the machine lists first", w)
		}
	}
}
