package placement

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// The benchmarks run on a fleet of 8-GPU machines in four pools (H100 SXM
// with one NVSwitch domain in two pools, A100 with two NVLink domains of
// four, and A100 machines with two MIG cards each), three zones, some spot
// machines tainted PreferNoSchedule, filled to about half by placing a
// mixed workload and releasing a random fifth of it (so free GPUs are
// scattered as departures leave them). The requests mix single-machine
// jobs of 1, 2, 4 and 8 GPUs, gangs of 2 to 4 machines, MIG instances and
// shares, of any model or one, in any pool or one.

var benchPools = []struct {
	name, model string
	share       int // per 10 machines
	domains     int
	migCards    int
}{
	{"h100-train", h100, 4, 1, 0},
	{"h100-infer", h100, 2, 1, 0},
	{"a100", a100, 3, 2, 0},
	{"a100-mig", a100, 1, 2, 2},
}

func benchEmpty(nodes int) Snapshot {
	var snap Snapshot
	for i := range nodes {
		bp := benchPools[0]
		for j, cum := 0, 0; j < len(benchPools); j++ {
			cum += benchPools[j].share
			if i%10 < cum {
				bp = benchPools[j]
				break
			}
		}
		id := fmt.Sprintf("%s-%05d", bp.name, i)
		n := Node{ID: id, Pool: bp.name, Zone: fmt.Sprintf("zone-%d", i%3), CPUMilliFree: 128000, MemoryMiBFree: 1 << 20,
			Labels: map[string]string{"rack": fmt.Sprintf("r%d", i%40)}}
		if i%20 == 7 {
			n.Taints = []contracts.Taint{{Key: "spot", Value: "true", Effect: contracts.TaintPreferNoSchedule}}
		}
		for g := range 8 {
			gpu := GPU{Index: g, UUID: fmt.Sprintf("%s-%d", id, g), Model: bp.model, MemoryMiB: 81920,
				NVLinkDomain: fmt.Sprintf("%s/nvl%d", id, g*bp.domains/8)}
			if g >= 8-bp.migCards {
				l := g % 2 * 2 // 7×1g, or 3g+2g+1g+1g
				gpu.MIG = true
				for s, pr := range migLayouts[l] {
					gpu.Instances = append(gpu.Instances, MIGSlot{Instance: contracts.MIGInstance{
						UUID: fmt.Sprintf("MIG-%s-%d-%d", id, g, s), Profile: pr, Start: migStarts[l][s], Size: 1,
						MemoryMiB: map[string]int64{"1g.10gb": 9728, "2g.20gb": 19968, "3g.40gb": 40192}[pr]}})
				}
			}
			n.GPUs = append(n.GPUs, gpu)
		}
		snap.Nodes = append(snap.Nodes, n)
	}
	return snap
}

// benchRequests is a mixed queue.
func benchRequests(rng *rand.Rand, n int) []Request {
	out := make([]Request, n)
	for i := range out {
		var r Request
		x := rng.IntN(100)
		switch {
		case x < 30:
			r.GPU = contracts.GPURequest{Count: 1}
		case x < 40:
			r.GPU = contracts.GPURequest{Count: 2}
		case x < 48:
			r.GPU = contracts.GPURequest{Count: 4}
		case x < 55:
			r.GPU = contracts.GPURequest{Count: 8}
			if rng.IntN(2) == 0 {
				r.GPU.Topology = contracts.TopologyNVLink
			}
		case x < 60:
			m := 2 + rng.IntN(3)
			r.GPU = contracts.GPURequest{Count: 8 * m, Nodes: m}
			if rng.IntN(2) == 0 {
				r.GPU.Topology = contracts.TopologyZone
			}
		case x < 70:
			r.GPU = contracts.GPURequest{Count: 1, MIGProfile: []string{"1g.10gb", "1g.10gb", "3g.40gb"}[rng.IntN(3)]}
		default:
			pct := []int{10, 25, 25, 50}[rng.IntN(4)]
			r.GPU = contracts.GPURequest{Count: 1, Share: &contracts.GPUShare{MemoryMiB: int64(pct) * 800, ComputePercent: pct}}
		}
		switch rng.IntN(4) {
		case 0:
			r.GPU.Model = h100
		case 1:
			r.GPU.Model = a100
		}
		if r.GPU.MIGProfile != "" {
			r.GPU.Model = a100
		}
		if rng.IntN(10) < 3 {
			r.Pool = benchPools[rng.IntN(len(benchPools))].name
		}
		gpusPer := max(1, r.GPU.Count/r.Machines())
		r.CPUMilli, r.MemoryMiB = int64(gpusPer)*12000, int64(gpusPer)*98304
		if r.GPU.Kind() != contracts.GPUKindWhole {
			r.CPUMilli, r.MemoryMiB = 4000, 32768
		}
		r.Tenant, r.Ahead = fmt.Sprintf("t%d", rng.IntN(20)), rng.IntN(5)
		out[i] = r
	}
	return out
}

var benchSnaps sync.Map // nodes -> Snapshot

// benchCluster is the fleet about half full, built once per size.
func benchCluster(tb testing.TB, nodes int) Snapshot {
	if s, ok := benchSnaps.Load(nodes); ok {
		return s.(Snapshot)
	}
	snap := benchEmpty(nodes)
	m := newMirror(snap)
	rng := rand.New(rand.NewPCG(uint64(nodes), 1))
	total := nodes * 8
	type job struct {
		r Request
		d Decision
	}
	var jobs []job
	used := 0
	for used < total*6/10 {
		p := NewPlacer(snap, Options{})
		misses := 0
		for _, r := range benchRequests(rng, 2000) {
			d := p.Place(r)
			if err := m.apply(r, d); err != nil {
				tb.Fatalf("filling the bench cluster: %v", err)
			}
			if !d.Placed() {
				misses++
				continue
			}
			jobs = append(jobs, job{r, d})
			for _, pt := range d.Parts {
				used += len(pt.Devices)
			}
		}
		snap = m.snapshot()
		if misses == 2000 {
			break
		}
	}
	// Departures: a random fifth of the jobs ends.
	for _, j := range jobs {
		if rng.IntN(5) == 0 {
			m.release(j.r, j.d)
		}
	}
	snap = m.snapshot()
	benchSnaps.Store(nodes, snap)
	return snap
}

func (m *mirror) snapshot() Snapshot {
	var s Snapshot
	for _, id := range m.order {
		n := *m.nodes[id]
		n.GPUs = slices.Clone(n.GPUs)
		for i := range n.GPUs {
			n.GPUs[i].Instances = slices.Clone(n.GPUs[i].Instances)
		}
		s.Nodes = append(s.Nodes, n)
	}
	return s
}

func (m *mirror) release(r Request, d Decision) {
	for _, pt := range d.Parts {
		n := m.nodes[pt.NodeID]
		n.CPUMilliFree += r.CPUMilli
		n.MemoryMiBFree += r.MemoryMiB
		for _, dv := range pt.Devices {
			gi := slices.IndexFunc(n.GPUs, func(g GPU) bool { return g.Index == dv.Index })
			g := &n.GPUs[gi]
			switch {
			case dv.MIG != nil:
				si := slices.IndexFunc(g.Instances, func(s MIGSlot) bool { return s.Instance.UUID == dv.MIG.UUID })
				g.Instances[si].Held = false
			case dv.Share != nil:
				g.ShareMemMiB -= dv.Share.MemoryMiB
				g.SharePercent -= dv.Share.ComputePercent
			default:
				g.Held = false
			}
		}
	}
}

func freeShare(snap Snapshot) float64 {
	free, total := 0, 0
	for _, n := range snap.Nodes {
		for _, g := range n.GPUs {
			total++
			if wholeFree(&g) {
				free++
			}
		}
	}
	return float64(free) / float64(total)
}

const benchCycle = 1000 // decisions per placer (one scheduling cycle)

var benchSizes = []int{1000, 10000}

// BenchmarkPlace times single decisions (b.N of them) on placers of one
// cycle each (built outside the timer), reporting placements/s and the
// 99th percentile of one decision.
func BenchmarkPlace(b *testing.B) {
	for _, nodes := range benchSizes {
		snap := benchCluster(b, nodes)
		reqs := benchRequests(rand.New(rand.NewPCG(99, 2)), 8192)
		for _, pol := range []contracts.PlacementPolicy{contracts.PolicyFragAware, contracts.PolicyBinpack, contracts.PolicySpread, contracts.PolicyTopology} {
			b.Run(fmt.Sprintf("nodes=%d/%s", nodes, pol), func(b *testing.B) {
				opt := Options{Policy: func(string) contracts.PlacementPolicy { return pol }}
				lat := make([]time.Duration, 0, b.N)
				var p *Placer
				placedN := 0
				b.ReportAllocs()
				b.ResetTimer()
				for i := range b.N {
					if i%benchCycle == 0 {
						b.StopTimer()
						p = NewPlacer(snap, opt)
						b.StartTimer()
					}
					r := reqs[i%len(reqs)]
					t0 := time.Now()
					d := p.Place(r)
					lat = append(lat, time.Since(t0))
					if d.Placed() {
						placedN++
					}
				}
				b.StopTimer()
				if placedN == 0 {
					b.Fatal("nothing placed")
				}
				var sum time.Duration
				for _, l := range lat {
					sum += l
				}
				slices.Sort(lat)
				b.ReportMetric(float64(len(lat))/sum.Seconds(), "placements/s")
				b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
				b.ReportMetric(100*float64(placedN)/float64(b.N), "placed%")
			})
		}
	}
}

// BenchmarkNewPlacer times indexing the snapshot, which every cycle does.
func BenchmarkNewPlacer(b *testing.B) {
	for _, nodes := range benchSizes {
		snap := benchCluster(b, nodes)
		b.Run(fmt.Sprintf("nodes=%d", nodes), func(b *testing.B) {
			b.ReportAllocs()
			var p *Placer
			for b.Loop() {
				p = NewPlacer(snap, Options{})
			}
			b.ReportMetric(float64(len(p.classes)), "classes")
			b.ReportMetric(100*freeShare(snap), "free%")
		})
	}
}

// BenchmarkPlaceCycle is whole scheduling cycles with fragaware: one op
// is one decision, and every 1,000 decisions NewPlacer indexes the
// snapshot again inside the timer, so placements/s includes the indexing.
func BenchmarkPlaceCycle(b *testing.B) {
	for _, nodes := range benchSizes {
		snap := benchCluster(b, nodes)
		reqs := benchRequests(rand.New(rand.NewPCG(99, 2)), benchCycle)
		b.Run(fmt.Sprintf("nodes=%d", nodes), func(b *testing.B) {
			b.ReportAllocs()
			var p *Placer
			for i := range b.N {
				if i%benchCycle == 0 {
					p = NewPlacer(snap, Options{})
				}
				p.Place(reqs[i%benchCycle])
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "placements/s")
		})
	}
}
