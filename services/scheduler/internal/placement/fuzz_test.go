package placement

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// FuzzPlace feeds arbitrary request fields (valid or not) to a placer over
// a random cluster: Place must never panic, every decision must keep the
// invariants the mirror checks, and a one-machine request must wait exactly
// when FitNode finds no node.
func FuzzPlace(f *testing.F) {
	f.Add(uint64(1), 1, 0, uint8(0), int64(0), uint8(0), int64(0), 0, uint8(0), int64(0), int64(0), uint8(0), uint8(0))
	f.Add(uint64(2), 16, 2, uint8(1), int64(81920), uint8(0), int64(0), 0, uint8(1), int64(8000), int64(65536), uint8(1), uint8(1))
	f.Add(uint64(3), 1, 0, uint8(2), int64(0), uint8(1), int64(0), 0, uint8(0), int64(0), int64(0), uint8(0), uint8(2))
	f.Add(uint64(4), 1, 0, uint8(0), int64(0), uint8(0), int64(10240), 30, uint8(0), int64(0), int64(0), uint8(2), uint8(0))
	f.Add(uint64(5), 0, -1, uint8(3), int64(-5), uint8(9), int64(-1), 101, uint8(7), int64(-1), int64(-1), uint8(9), uint8(9))
	f.Add(uint64(6), 9, 3, uint8(0), int64(0), uint8(0), int64(0), 0, uint8(2), int64(0), int64(0), uint8(0), uint8(0))
	f.Fuzz(func(t *testing.T, seed uint64, count, nodes int, model uint8, mem int64, profile uint8, shareMem int64, sharePct int,
		topo uint8, cpu, hostMem int64, pool, extra uint8) {
		rng := rand.New(rand.NewPCG(seed, 3))
		snap := randomCluster(rng, 1+rng.IntN(16))
		r := Request{Tenant: "fuzz", GPU: contracts.GPURequest{Count: count, Nodes: nodes, MemoryMiB: mem,
			Topology: contracts.Topology([]string{"", "nvlink", "zone", "ring"}[topo%4])}, CPUMilli: cpu, MemoryMiB: hostMem}
		switch model % 4 {
		case 1:
			r.GPU.Model = h100
		case 2:
			r.GPU.Models = []string{a100, "L4", a100}
		case 3:
			r.GPU.Model = "nonsense"
		}
		if profile%3 > 0 {
			r.GPU.MIGProfile = []string{"", "1g.10gb", "unknown.profile"}[profile%3]
		}
		if sharePct != 0 || shareMem != 0 {
			r.GPU.Share = &contracts.GPUShare{MemoryMiB: shareMem, ComputePercent: sharePct}
		}
		r.Pool = []string{"", "a", "b", "zzz"}[pool%4]
		if extra&1 != 0 {
			r.Selector = map[string]string{"rack": "r2"}
		}
		if extra&2 != 0 {
			r.Tolerations = []contracts.Toleration{{Operator: contracts.TolerationExists}}
		}
		if extra&4 != 0 && len(snap.Nodes) > 0 {
			r.Exclude = map[string]bool{snap.Nodes[0].ID: true}
		}
		if extra&8 != 0 {
			r.AllowPool = func(p string) bool { return p != "b" }
		}
		p := NewPlacer(snap, Options{Policy: func(pool string) contracts.PlacementPolicy {
			return contracts.PlacementPolicies[int(extra>>4)%len(contracts.PlacementPolicies)]
		}})
		m := newMirror(snap)
		for i := range 6 {
			req := r
			if i%2 == 1 {
				req = randomRequest(rng, nil) // other work in between
			}
			var fits []string
			single := validate(&req) == nil && req.Machines() == 1
			if single {
				fits = m.fitting(req)
			}
			d := p.Place(req)
			if err := m.apply(req, d); err != nil {
				t.Fatalf("request %d %+v: %v", i, req.GPU, err)
			}
			if single && d.Placed() != (len(fits) > 0) {
				t.Fatalf("request %d %+v: placed %v (%s), FitNode fits %v", i, req.GPU, d.Placed(), d.Pending.Message, fits)
			}
			if d.Placed() && single && !slices.Contains(fits, d.Parts[0].NodeID) {
				t.Fatalf("request %d: placed on %s, FitNode fits %v", i, d.Parts[0].NodeID, fits)
			}
		}
	})
}
