package placement

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// The reference tests check Place against FitNode on an independent copy
// of the cluster that applies every decision: nothing is given twice,
// nothing overcommitted, every rule holds, and a one-machine request waits
// exactly when no node fits it.

var migLayouts = [][]string{
	{"1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb"},
	{"3g.40gb", "3g.40gb"},
	{"3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"},
	{"7g.80gb"},
}

var migStarts = [][]int{{0, 1, 2, 3, 4, 5, 6}, {0, 4}, {0, 4, 6, 7}, {0}}

// randomCluster builds n nodes of random pools, zones, labels, taints,
// models, NVLink layouts, MIG cards, holds and shares.
func randomCluster(rng *rand.Rand, n int) Snapshot {
	var snap Snapshot
	for i := range n {
		id := fmt.Sprintf("n%03d", rng.IntN(1000))
		nd := Node{ID: id, Pool: []string{"a", "b", "c"}[rng.IntN(3)], Zone: []string{"z1", "z2"}[rng.IntN(2)],
			CPUMilliFree: int64(rng.IntN(5)) * 8000, MemoryMiBFree: int64(rng.IntN(5)) * 65536,
			Labels: map[string]string{"rack": []string{"r1", "r2"}[rng.IntN(2)]}}
		if i%7 == 3 {
			nd.ID = fmt.Sprintf("n%03d", i) // a duplicate ID would be a different test
		}
		switch rng.IntN(6) {
		case 0:
			nd.Taints = []contracts.Taint{{Key: "dedicated", Value: "ml", Effect: contracts.TaintNoSchedule}}
		case 1:
			nd.Taints = []contracts.Taint{{Key: "spot", Value: "true", Effect: contracts.TaintPreferNoSchedule}}
		}
		nd.Cordoned = rng.IntN(10) == 0
		model, mem := h100, int64(81920)
		if rng.IntN(2) == 0 {
			model, mem = a100, []int64{40960, 81920}[rng.IntN(2)]
		}
		domains := rng.IntN(3) // 0: PCIe, 1: one domain, 2: two
		count := rng.IntN(9)
		for g := range count {
			gpu := GPU{Index: g, UUID: fmt.Sprintf("%s-%d", nd.ID, g), Model: model, MemoryMiB: mem}
			if rng.IntN(8) == 0 {
				gpu.Model = []string{h100, a100}[rng.IntN(2)] // a mixed node
			}
			switch domains {
			case 1:
				gpu.NVLinkDomain = nd.ID + "/nvl"
			case 2:
				gpu.NVLinkDomain = fmt.Sprintf("%s/nvl%d", nd.ID, g%2)
			}
			switch rng.IntN(8) {
			case 0:
				gpu.Held = true
			case 1:
				gpu.ShareMemMiB, gpu.SharePercent = int64(rng.IntN(4))*10240, rng.IntN(5)*20
			case 2:
				l := rng.IntN(len(migLayouts))
				gpu.MIG = true
				for s, pr := range migLayouts[l] {
					gpu.Instances = append(gpu.Instances, MIGSlot{Held: rng.IntN(3) == 0, Instance: contracts.MIGInstance{
						UUID: fmt.Sprintf("MIG-%s-%d-%d", nd.ID, g, s), Profile: pr, Start: migStarts[l][s], Size: 1,
						MemoryMiB: map[string]int64{"1g.10gb": 9728, "2g.20gb": 19968, "3g.40gb": 40192, "7g.80gb": 80896}[pr]}})
				}
			}
			nd.GPUs = append(nd.GPUs, gpu)
		}
		if rng.IntN(4) == 0 { // the snapshot need not list GPUs by index
			rng.Shuffle(len(nd.GPUs), func(a, b int) { nd.GPUs[a], nd.GPUs[b] = nd.GPUs[b], nd.GPUs[a] })
		}
		snap.Nodes = append(snap.Nodes, nd)
	}
	// Unique IDs: the scheduler's snapshot has one entry per node.
	seen := map[string]bool{}
	snap.Nodes = slices.DeleteFunc(snap.Nodes, func(n Node) bool { d := seen[n.ID]; seen[n.ID] = true; return d })
	return snap
}

func randomRequest(rng *rand.Rand, nodeIDs []string) Request {
	r := Request{Tenant: "t", Ahead: rng.IntN(3)}
	switch rng.IntN(6) {
	case 0:
		r.GPU = contracts.GPURequest{Count: 1, MIGProfile: []string{"1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb", "4g.40gb"}[rng.IntN(5)]}
	case 1:
		r.GPU = contracts.GPURequest{Count: 1, Share: &contracts.GPUShare{MemoryMiB: int64(1+rng.IntN(8)) * 5120, ComputePercent: 5 * (1 + rng.IntN(19))}}
	case 2:
		m := 2 + rng.IntN(2)
		r.GPU = contracts.GPURequest{Count: m * (1 + rng.IntN(4)), Nodes: m}
	default:
		r.GPU = contracts.GPURequest{Count: []int{1, 1, 2, 3, 4, 8}[rng.IntN(6)]}
	}
	switch rng.IntN(5) {
	case 0:
		r.GPU.Model = h100
	case 1:
		r.GPU.Models = []string{a100, h100}
	case 2:
		r.GPU.Model = a100
	}
	if rng.IntN(4) == 0 {
		r.GPU.MemoryMiB = []int64{40960, 81920, 9728}[rng.IntN(3)]
	}
	if r.GPU.Kind() == contracts.GPUKindWhole {
		r.GPU.Topology = []contracts.Topology{"", "", contracts.TopologyNVLink, contracts.TopologyZone}[rng.IntN(4)]
	}
	r.CPUMilli, r.MemoryMiB = int64(rng.IntN(4))*4000, int64(rng.IntN(4))*16384
	if rng.IntN(3) == 0 {
		r.Pool = []string{"a", "b", "x"}[rng.IntN(3)]
	}
	if rng.IntN(5) == 0 {
		r.Selector = map[string]string{"rack": "r1"}
	}
	if rng.IntN(3) == 0 {
		r.Tolerations = []contracts.Toleration{{Key: []string{"dedicated", "spot"}[rng.IntN(2)], Operator: contracts.TolerationExists}}
	}
	if rng.IntN(5) == 0 {
		denied := []string{"a", "b", "c"}[rng.IntN(3)]
		r.AllowPool = func(pool string) bool { return pool != denied }
	}
	if rng.IntN(5) == 0 && len(nodeIDs) > 0 {
		r.Exclude = map[string]bool{nodeIDs[rng.IntN(len(nodeIDs))]: true}
	}
	if rng.IntN(4) == 0 && len(nodeIDs) > 0 {
		// A reservation's hold: some cards (by index) and the host
		// capacity to spare.
		h := Hold{SpareCPUMilli: int64(rng.IntN(64)) * 1000, SpareMemoryMiB: int64(rng.IntN(512)) << 10}
		for i := range 8 {
			if rng.IntN(2) == 0 {
				h.Devices = append(h.Devices, contracts.DeviceRef{Index: i})
			}
		}
		r.Reserved = map[string]Hold{nodeIDs[rng.IntN(len(nodeIDs))]: h}
	}
	return r
}

// mirror is the test's own account of the cluster: the snapshot with every
// decision applied.
type mirror struct {
	nodes map[string]*Node
	order []string
}

func newMirror(snap Snapshot) *mirror {
	m := &mirror{nodes: map[string]*Node{}}
	for _, n := range snap.Nodes {
		c := n
		c.GPUs = slices.Clone(n.GPUs)
		for i := range c.GPUs {
			c.GPUs[i].Instances = slices.Clone(c.GPUs[i].Instances)
		}
		m.nodes[n.ID] = &c
		m.order = append(m.order, n.ID)
	}
	slices.Sort(m.order)
	return m
}

// apply checks a decision against the mirror and applies it; it reports
// the first broken rule.
func (m *mirror) apply(r Request, d Decision) error {
	if !d.Placed() {
		if d.Pending.Code == "" || d.Pending.Message == "" {
			return fmt.Errorf("pending without code or message: %+v", d.Pending)
		}
		return nil
	}
	if len(d.Parts) != r.Machines() {
		return fmt.Errorf("%d parts for %d machines", len(d.Parts), r.Machines())
	}
	seen := map[string]bool{}
	var gangModel, gangZone string
	for pi, pt := range d.Parts {
		n := m.nodes[pt.NodeID]
		switch {
		case n == nil:
			return fmt.Errorf("unknown node %s", pt.NodeID)
		case seen[pt.NodeID]:
			return fmt.Errorf("node %s twice in one gang", pt.NodeID)
		case pt.Pool != n.Pool || pt.Zone != n.Zone:
			return fmt.Errorf("part pool/zone %s/%s, node has %s/%s", pt.Pool, pt.Zone, n.Pool, n.Zone)
		case !admits(n, r):
			return fmt.Errorf("node %s breaks a node rule (cordon, pool, quota, selector, taint, exclude, cpu/mem)", n.ID)
		}
		seen[pt.NodeID] = true
		if pi == 0 {
			gangZone = n.Zone
		} else if r.GPU.Topology == contracts.TopologyZone && n.Zone != gangZone {
			return fmt.Errorf("gang spans zones %s and %s", gangZone, n.Zone)
		}
		want := 1
		if r.GPU.Kind() == contracts.GPUKindWhole {
			want = r.GPU.Count / r.Machines()
		}
		if len(pt.Devices) != want {
			return fmt.Errorf("%d devices on %s, want %d", len(pt.Devices), n.ID, want)
		}
		domain := ""
		for di, dv := range pt.Devices {
			gi := slices.IndexFunc(n.GPUs, func(g GPU) bool { return g.Index == dv.Index })
			if gi < 0 {
				return fmt.Errorf("no GPU %d on %s", dv.Index, n.ID)
			}
			g := &n.GPUs[gi]
			if dv.UUID != g.UUID || dv.Model != g.Model {
				return fmt.Errorf("device %+v names GPU %s/%s", dv, g.UUID, g.Model)
			}
			if !modelAllowed(r.GPU.AllowedModels(), g.Model) {
				return fmt.Errorf("model %s not allowed", g.Model)
			}
			if r.Machines() > 1 {
				if gangModel == "" {
					gangModel = g.Model
				} else if g.Model != gangModel {
					return fmt.Errorf("gang mixes %s and %s", gangModel, g.Model)
				}
			}
			switch r.GPU.Kind() {
			case contracts.GPUKindMIG:
				si := slices.IndexFunc(g.Instances, func(s MIGSlot) bool { return dv.MIG != nil && s.Instance.UUID == dv.MIG.UUID })
				if si < 0 || !g.MIG || g.Held || g.Instances[si].Held || g.Instances[si].Instance.Profile != r.GPU.MIGProfile ||
					g.Instances[si].Instance.MemoryMiB < r.GPU.MemoryMiB {
					return fmt.Errorf("MIG device %+v not a free %s instance", dv, r.GPU.MIGProfile)
				}
				g.Instances[si].Held = true
			case contracts.GPUKindShare:
				s := r.GPU.Share
				if dv.Share == nil || *dv.Share != *s || !shareFits(g, s.MemoryMiB, s.ComputePercent) || g.MemoryMiB < r.GPU.MemoryMiB {
					return fmt.Errorf("share %+v does not fit GPU %+v", dv.Share, *g)
				}
				g.ShareMemMiB += s.MemoryMiB
				g.SharePercent += s.ComputePercent
			default:
				if !wholeFree(g) || g.MemoryMiB < r.GPU.MemoryMiB || dv.MIG != nil || dv.Share != nil {
					return fmt.Errorf("whole GPU %d of %s given twice or not whole: %+v", dv.Index, n.ID, *g)
				}
				if r.GPU.Topology == contracts.TopologyNVLink {
					if g.NVLinkDomain == "" || di > 0 && g.NVLinkDomain != domain {
						return fmt.Errorf("NVLink part spans domains on %s", n.ID)
					}
					domain = g.NVLinkDomain
				}
				g.Held = true
			}
		}
		n.CPUMilliFree -= r.CPUMilli
		n.MemoryMiBFree -= r.MemoryMiB
		if n.CPUMilliFree < 0 || n.MemoryMiBFree < 0 {
			return fmt.Errorf("host capacity of %s overcommitted", n.ID)
		}
	}
	return nil
}

// fitting lists the nodes FitNode says take r now.
func (m *mirror) fitting(r Request) []string {
	var out []string
	for _, id := range m.order {
		if _, ok := FitNode(m.nodes[id], r); ok {
			out = append(out, id)
		}
	}
	return out
}

func tier0(n *Node, r Request) bool {
	return contracts.Tolerated(r.Tolerations, n.Taints, contracts.TaintPreferNoSchedule)
}

func TestPlaceMatchesFitNode(t *testing.T) {
	seeds := 3000
	if testing.Short() {
		seeds = 300
	}
	policies := []contracts.PlacementPolicy{contracts.PolicyFragAware, contracts.PolicyBinpack, contracts.PolicySpread, contracts.PolicyTopology}
	placedN, waited, heldN := 0, 0, 0
	for seed := range seeds {
		rng := rand.New(rand.NewPCG(uint64(seed), 7))
		snap := randomCluster(rng, 1+rng.IntN(24))
		var ids []string
		for _, n := range snap.Nodes {
			ids = append(ids, n.ID)
		}
		pols := map[string]contracts.PlacementPolicy{}
		for _, pool := range []string{"a", "b", "c"} {
			pols[pool] = policies[rng.IntN(len(policies))]
		}
		p := NewPlacer(snap, Options{Policy: func(pool string) contracts.PlacementPolicy { return pols[pool] }})
		m := newMirror(snap)
		for i := range 40 {
			r := randomRequest(rng, ids)
			var fits []string
			if r.Machines() == 1 {
				fits = m.fitting(r)
			}
			calls := map[string]int{}
			counted := r
			if allow := r.AllowPool; allow != nil {
				counted.AllowPool = func(pool string) bool { calls[pool]++; return allow(pool) }
			}
			d := p.Place(counted)
			for pool, c := range calls {
				if c > 1 {
					t.Fatalf("seed %d req %d: AllowPool(%s) called %d times", seed, i, pool, c)
				}
			}
			if err := m.apply(r, d); err != nil {
				t.Fatalf("seed %d req %d %+v: %v\ndecision %s", seed, i, r.GPU, err, placed(d))
			}
			if r.Machines() > 1 {
				continue
			}
			switch {
			case d.Placed() && !slices.Contains(fits, d.Parts[0].NodeID):
				t.Fatalf("seed %d req %d %+v: placed on %s, FitNode says only %v fit", seed, i, r.GPU, d.Parts[0].NodeID, fits)
			case !d.Placed() && len(fits) > 0:
				t.Fatalf("seed %d req %d %+v: waits (%s: %s), FitNode says %v fit", seed, i, r.GPU, d.Pending.Code, d.Pending.Message, fits)
			case d.Placed():
				placedN++
				if h, ok := r.Reserved[d.Parts[0].NodeID]; ok {
					heldN++
					for _, dv := range d.Parts[0].Devices {
						if slices.ContainsFunc(h.Devices, func(x contracts.DeviceRef) bool { return x.Index == dv.Index }) {
							t.Fatalf("seed %d req %d: placed on held card %d of %s", seed, i, dv.Index, d.Parts[0].NodeID)
						}
					}
				}
				// PreferNoSchedule: a last resort only.
				if !tier0(m.nodes[d.Parts[0].NodeID], r) {
					for _, id := range fits {
						if tier0(m.nodes[id], r) {
							t.Fatalf("seed %d req %d: placed on PreferNoSchedule node %s while %s fits", seed, i, d.Parts[0].NodeID, id)
						}
					}
				}
			default:
				waited++
			}
		}
	}
	t.Logf("%d one-machine requests placed (%d on a held node), %d waited", placedN, heldN, waited)
	if placedN == 0 || waited == 0 || heldN == 0 {
		t.Fatal("the random cases exercise only one outcome")
	}
}
