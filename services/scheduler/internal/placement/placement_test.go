package placement

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// node builds a node with n GPUs of model (memory from the model name's
// catalogue figure is irrelevant here: tests give it explicitly). busy lists
// indices that are not free.
func node(id, pool, model string, mem int64, n int, busy ...int) Node {
	nd := Node{ID: id, Pool: pool}
	for i := range n {
		nd.GPUs = append(nd.GPUs, GPU{Index: i, UUID: fmt.Sprintf("%s-gpu%d", id, i), Model: model, MemoryMiB: mem,
			Free: !slices.Contains(busy, i)})
	}
	return nd
}

// placed summarises a decision as "node:idx,idx" or "pending:<code>".
func placed(d Decision) string {
	if !d.Placed() {
		return "pending:" + string(d.Pending.Code)
	}
	idx := make([]string, len(d.Devices))
	for i, g := range d.Devices {
		idx[i] = fmt.Sprint(g.Index)
	}
	return d.NodeID + ":" + strings.Join(idx, ",")
}

const (
	h100 = "H100-80GB"
	a100 = "A100-40GB"
	a180 = "A100-80GB"
)

func TestPlaceFirstFit(t *testing.T) {
	tests := map[string]struct {
		nodes []Node
		reqs  []Request
		want  []string
	}{
		"first node by ID with enough free GPUs, lowest indices": {
			nodes: []Node{node("n2", "p", h100, 81920, 8), node("n1", "p", h100, 81920, 8, 0, 2)},
			reqs:  []Request{{Count: 2, Model: h100}},
			want:  []string{"n1:1,3"},
		},
		"count must fit on one machine": {
			nodes: []Node{node("n1", "p", h100, 81920, 4, 0), node("n2", "p", h100, 81920, 4)},
			reqs:  []Request{{Count: 4, Model: h100}},
			want:  []string{"n2:0,1,2,3"},
		},
		"model filter": {
			nodes: []Node{node("n1", "p", a100, 40960, 8), node("n2", "p", h100, 81920, 8)},
			reqs:  []Request{{Count: 1, Model: h100}, {Count: 1, Model: a100}},
			want:  []string{"n2:0", "n1:0"},
		},
		"any model takes the first node whatever its model": {
			nodes: []Node{node("n2", "p", a100, 40960, 8), node("n1", "p", h100, 81920, 8)},
			reqs:  []Request{{Count: 1, Model: contracts.GPUModelAny}, {Count: 1}},
			want:  []string{"n1:0", "n1:1"},
		},
		"memory filter skips smaller cards": {
			nodes: []Node{node("n1", "p", a100, 40960, 8), node("n2", "p", a180, 81920, 8)},
			reqs:  []Request{{Count: 2, MemoryMiB: 80000}},
			want:  []string{"n2:0,1"},
		},
		"pool filter": {
			nodes: []Node{node("n1", "east", h100, 81920, 8), node("n2", "west", h100, 81920, 8)},
			reqs:  []Request{{Count: 1, Model: h100, Pool: "west"}, {Count: 1, Model: h100}},
			want:  []string{"n2:0", "n1:0"},
		},
		"no device is given twice in one cycle": {
			nodes: []Node{node("n1", "p", h100, 81920, 4)},
			reqs:  []Request{{Count: 3, Model: h100}, {Count: 1, Model: h100}, {Count: 1, Model: h100}},
			want:  []string{"n1:0,1,2", "n1:3", "pending:" + string(contracts.PendingQueuedBehind)},
		},
		"assumed or committed devices are not free": {
			nodes: []Node{node("n1", "p", h100, 81920, 4, 0, 1, 2, 3), node("n2", "p", h100, 81920, 4, 1)},
			reqs:  []Request{{Count: 2, Model: h100}, {Count: 2, Model: h100}},
			want:  []string{"n2:0,2", "pending:" + string(contracts.PendingQueuedBehind)},
		},
		"a job that does not fit does not block smaller ones behind it": {
			nodes: []Node{node("n1", "p", h100, 81920, 8, 0, 1)},
			reqs:  []Request{{Count: 8, Model: h100}, {Count: 2, Model: h100}, {Count: 8, Model: h100}, {Count: 4, Model: h100}},
			want: []string{"pending:" + string(contracts.PendingInsufficientGPUs), "n1:2,3",
				"pending:" + string(contracts.PendingInsufficientGPUs), "n1:4,5,6,7"},
		},
		"mixed node: all devices of a job share a model": {
			nodes: []Node{{ID: "n1", Pool: "p", GPUs: []GPU{
				{Index: 0, UUID: "u0", Model: h100, MemoryMiB: 81920, Free: true},
				{Index: 1, UUID: "u1", Model: a100, MemoryMiB: 40960, Free: true},
				{Index: 2, UUID: "u2", Model: h100, MemoryMiB: 81920, Free: true},
			}}},
			reqs: []Request{{Count: 2}, {Count: 2}, {Count: 1}},
			want: []string{"n1:0,2", "pending:" + string(contracts.PendingQueuedBehind), "n1:1"},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var got []string
			for _, d := range Place(Snapshot{Nodes: tc.nodes}, tc.reqs) {
				got = append(got, placed(d))
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("decisions (-want +got):\n%s", diff)
			}
		})
	}
}

func TestPlaceDoesNotModifySnapshot(t *testing.T) {
	snap := Snapshot{Nodes: []Node{node("n2", "p", h100, 81920, 2), node("n1", "p", h100, 81920, 2)}}
	before := fmt.Sprint(snap)
	Place(snap, []Request{{Count: 2}, {Count: 2}})
	if after := fmt.Sprint(snap); after != before {
		t.Fatalf("snapshot changed:\nbefore %s\nafter  %s", before, after)
	}
}

func TestPendingReasons(t *testing.T) {
	cluster := []Node{
		node("h100-01", "h100", h100, 81920, 8, 0, 1),
		node("h100-02", "h100", h100, 81920, 8, 0, 1, 2, 3),
		node("a100-01", "a100", a100, 40960, 4),
	}
	tests := map[string]struct {
		nodes []Node
		// before are placed first, to use up capacity in the same cycle.
		before []Request
		req    Request
		want   Pending
	}{
		"no nodes at all": {
			req: Request{Count: 1, Model: h100, Tenant: "acme"},
			want: Pending{contracts.PendingNoNodes,
				"needs 1×H100-80GB on one machine; no nodes are registered"},
		},
		"no nodes in the pool": {
			nodes: cluster,
			req:   Request{Count: 1, Model: h100, Pool: "l4"},
			want: Pending{contracts.PendingNoNodes,
				"needs 1×H100-80GB on one machine in pool l4; no nodes in pool l4"},
		},
		"no node has the model": {
			nodes: cluster,
			req:   Request{Count: 1, Model: "L4"},
			want:  Pending{contracts.PendingNoMatchingModel, "needs 1×L4 on one machine; no node has L4 GPUs"},
		},
		"no node of the pool has the model": {
			nodes: cluster,
			req:   Request{Count: 1, Model: h100, Pool: "a100"},
			want: Pending{contracts.PendingNoMatchingModel,
				"needs 1×H100-80GB on one machine in pool a100; no node in pool a100 has H100-80GB GPUs"},
		},
		"no card has the memory": {
			nodes: cluster,
			req:   Request{Count: 1, Model: a100, MemoryMiB: 50000},
			want: Pending{contracts.PendingNoMatchingModel,
				"needs 1×A100-40GB with ≥50000 MiB each on one machine; no node has A100-40GB GPUs"},
		},
		"larger than any machine": {
			nodes: cluster,
			req:   Request{Count: 16, Model: h100, Tenant: "acme", Ahead: 0},
			want: Pending{contracts.PendingInsufficientGPUs,
				"needs 16×H100-80GB on one machine; the largest machine has 8 (h100-01); 0 jobs ahead in queue acme"},
		},
		"largest free block": {
			nodes: cluster,
			req:   Request{Count: 8, Model: h100, Tenant: "acme", Ahead: 3},
			want: Pending{contracts.PendingInsufficientGPUs,
				"needs 8×H100-80GB on one machine; largest free block is 6 GPUs on h100-01; 3 jobs ahead in queue acme"},
		},
		"largest free block across models for any": {
			nodes: cluster,
			req:   Request{Count: 7, Model: contracts.GPUModelAny, Tenant: "beta", Ahead: 1},
			want: Pending{contracts.PendingInsufficientGPUs,
				"needs 7×any on one machine; largest free block is 6 GPUs on h100-01; 1 job ahead in queue beta"},
		},
		"nothing free": {
			nodes: []Node{node("n1", "p", h100, 81920, 2, 0, 1)},
			req:   Request{Count: 1, Model: h100, Tenant: "acme", Ahead: 1},
			want: Pending{contracts.PendingInsufficientGPUs,
				"needs 1×H100-80GB on one machine; no H100-80GB GPU is free; 1 job ahead in queue acme"},
		},
		"capacity taken by jobs placed ahead this cycle": {
			nodes:  []Node{node("n1", "p", h100, 81920, 4)},
			before: []Request{{Count: 2, Model: h100}, {Count: 1, Model: h100}},
			req:    Request{Count: 2, Model: h100, Tenant: "acme", Ahead: 2},
			want: Pending{contracts.PendingQueuedBehind,
				"needs 2×H100-80GB on one machine; the free GPUs went to 2 jobs placed ahead of it this cycle; 2 jobs ahead in queue acme"},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			p := NewPlacer(Snapshot{Nodes: tc.nodes})
			for _, r := range tc.before {
				if d := p.Place(r); !d.Placed() {
					t.Fatalf("setup request %+v did not fit: %+v", r, d.Pending)
				}
			}
			d := p.Place(tc.req)
			if d.Placed() {
				t.Fatalf("request placed on %s, want pending", d.NodeID)
			}
			if diff := cmp.Diff(tc.want, d.Pending); diff != "" {
				t.Errorf("pending (-want +got):\n%s", diff)
			}
		})
	}
}

// referencePlace is the obviously-correct first-fit: scan nodes in ID order,
// and on each node the GPU kinds in (model, memory) order, for enough free
// matching devices. The indexed placer must decide exactly the same.
func referencePlace(snap Snapshot, reqs []Request) []string {
	nodes := slices.Clone(snap.Nodes)
	slices.SortFunc(nodes, func(a, b Node) int { return strings.Compare(a.ID, b.ID) })
	used := map[string]bool{}
	out := make([]string, len(reqs))
	for i, r := range reqs {
		out[i] = "pending"
	search:
		for _, n := range nodes {
			if r.Pool != "" && n.Pool != r.Pool {
				continue
			}
			byKind := map[[2]string][]GPU{}
			var kinds [][2]string
			gpus := slices.Clone(n.GPUs)
			slices.SortFunc(gpus, func(a, b GPU) int { return a.Index - b.Index })
			for _, g := range gpus {
				if !g.Free || used[g.UUID] || g.MemoryMiB < r.MemoryMiB ||
					(r.Model != "" && r.Model != contracts.GPUModelAny && g.Model != r.Model) {
					continue
				}
				k := [2]string{g.Model, fmt.Sprintf("%012d", g.MemoryMiB)}
				if _, ok := byKind[k]; !ok {
					kinds = append(kinds, k)
				}
				byKind[k] = append(byKind[k], g)
			}
			slices.SortFunc(kinds, func(a, b [2]string) int { return strings.Compare(a[0]+a[1], b[0]+b[1]) })
			for _, k := range kinds {
				if free := byKind[k]; len(free) >= r.Count {
					d := Decision{NodeID: n.ID, Devices: free[:r.Count]}
					for _, g := range d.Devices {
						used[g.UUID] = true
					}
					out[i] = placed(d)
					break search
				}
			}
		}
	}
	return out
}

// randomCluster builds n nodes with varied pools, models, sizes and
// occupancy from a seeded generator.
func randomCluster(rng *rand.Rand, n int) Snapshot {
	models := []struct {
		name string
		mem  int64
	}{{h100, 81920}, {a100, 40960}, {a180, 81920}, {"L4", 23034}}
	pools := []string{"east", "west", "lab"}
	var snap Snapshot
	// IDs are a permutation, so the snapshot is not already in node order.
	for i, id := range rng.Perm(n) {
		m := models[rng.IntN(len(models))]
		nd := Node{ID: fmt.Sprintf("n%04d", id), Pool: pools[rng.IntN(len(pools))]}
		size := []int{1, 2, 4, 8}[rng.IntN(4)]
		for g := range size {
			model := m
			if rng.IntN(20) == 0 { // a few mixed machines
				model = models[rng.IntN(len(models))]
			}
			nd.GPUs = append(nd.GPUs, GPU{Index: g, UUID: fmt.Sprintf("%s-%d-%d", nd.ID, i, g), Model: model.name,
				MemoryMiB: model.mem, Free: rng.IntN(3) != 0})
		}
		snap.Nodes = append(snap.Nodes, nd)
	}
	return snap
}

func randomRequests(rng *rand.Rand, n int) []Request {
	models := []string{"", contracts.GPUModelAny, h100, a100, a180, "L4", "T4"}
	pools := []string{"", "", "east", "west", "lab", "none"}
	reqs := make([]Request, n)
	for i := range reqs {
		reqs[i] = Request{
			Count:     []int{1, 1, 1, 2, 2, 4, 8, 16}[rng.IntN(8)],
			Model:     models[rng.IntN(len(models))],
			MemoryMiB: []int64{0, 0, 0, 40000, 80000}[rng.IntN(5)],
			Pool:      pools[rng.IntN(len(pools))],
		}
	}
	return reqs
}

func TestPlaceMatchesReferenceFirstFit(t *testing.T) {
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 7))
		snap := randomCluster(rng, 1+rng.IntN(40))
		reqs := randomRequests(rng, 1+rng.IntN(60))
		want := referencePlace(snap, reqs)
		var got []string
		used := map[string]bool{}
		for _, d := range Place(snap, reqs) {
			if d.Placed() {
				for _, g := range d.Devices {
					if used[g.UUID] {
						t.Fatalf("seed %d: device %s given twice", seed, g.UUID)
					}
					used[g.UUID] = true
				}
				got = append(got, placed(d))
			} else {
				got = append(got, "pending")
				if d.Pending.Code == "" || d.Pending.Message == "" {
					t.Fatalf("seed %d: pending decision without a reason: %+v", seed, d.Pending)
				}
			}
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Fatalf("seed %d: indexed placer differs from reference first-fit (-want +got):\n%s", seed, diff)
		}
	}
}

// benchCluster is 1,000 nodes × 8 H100 in two pools, all free.
func benchCluster() Snapshot {
	var snap Snapshot
	for i := range 1000 {
		pool := "east"
		if i%2 == 1 {
			pool = "west"
		}
		snap.Nodes = append(snap.Nodes, node(fmt.Sprintf("h100-%04d", i), pool, h100, 81920, 8))
	}
	return snap
}

// benchQueue is a few thousand queued jobs of mixed shapes: more than the
// cluster holds, so the later ones exercise the pending path.
func benchQueue() []Request {
	rng := rand.New(rand.NewPCG(1, 2))
	reqs := make([]Request, 3000)
	for i := range reqs {
		reqs[i] = Request{Count: []int{1, 1, 2, 4, 8}[rng.IntN(5)], Model: h100, Tenant: "acme", Ahead: i}
		if i%10 == 0 {
			reqs[i].Pool = "west"
		}
	}
	return reqs
}

// BenchmarkPlaceCycle measures one scheduling cycle of the indexed placer:
// 1,000 nodes × 8 GPUs, 3,000 queued jobs.
func BenchmarkPlaceCycle(b *testing.B) {
	snap, reqs := benchCluster(), benchQueue()
	benchCycle(b, func() []Decision { return Place(snap, reqs) })
}

// BenchmarkPlaceCycleReference is the baseline: the same cycle with the
// linear-scan reference first-fit.
func BenchmarkPlaceCycleReference(b *testing.B) {
	snap, reqs := benchCluster(), benchQueue()
	benchCycle(b, func() []Decision {
		out := referencePlace(snap, reqs)
		ds := make([]Decision, len(out))
		for i, s := range out {
			if s != "pending" {
				ds[i].NodeID = s
			}
		}
		return ds
	})
}

func benchCycle(b *testing.B, cycle func() []Decision) {
	placedJobs := 0
	for b.Loop() {
		placedJobs = 0
		for _, d := range cycle() {
			if d.Placed() {
				placedJobs++
			}
		}
	}
	if placedJobs == 0 {
		b.Fatal("no job was placed")
	}
	perCycle := b.Elapsed().Seconds() / float64(b.N)
	b.ReportMetric(float64(placedJobs)/perCycle, "placements/s")
	b.ReportMetric(3000/perCycle, "jobs/s")
	b.ReportMetric(float64(placedJobs), "placed/cycle")
}
