package demand

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// TestGroupedCountEqualsOneByOne holds Compute, which counts equal
// requests once per group, to counting each request on its own, on random
// queues drawn from a few shapes (so groups are large) over random fleets:
// whole GPUs of one or several models, gangs, MIG instances, shares, named
// pools with and without machines, and runtime verdicts (never grouped).
func TestGroupedCountEqualsOneByOne(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	models := []string{"H100-80GB", "A100-80GB", "L4", contracts.GPUModelAny}
	pools := []string{"east", "west", "mig", "l4", "nowhere"}
	for seed := range 40 {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(seed), 5))
			var snap placement.Snapshot
			for i := range 1 + rng.IntN(12) {
				pool := pools[rng.IntN(4)]
				var n placement.Node
				if pool == "mig" {
					n = migNode(fmt.Sprint("m", i), pool, "A100-80GB", 1+rng.IntN(4), "3g.40gb", "1g.10gb")
				} else {
					n = node(fmt.Sprint("n", i), pool, models[rng.IntN(3)], 1+rng.IntN(8), rng.IntN(4))
				}
				snap.Nodes = append(snap.Nodes, n)
			}
			shapes := make([]placement.Request, 6+rng.IntN(6))
			for i := range shapes {
				r := placement.Request{GPU: contracts.GPURequest{Count: 1 + rng.IntN(8), Model: models[rng.IntN(len(models))]}}
				switch rng.IntN(6) {
				case 0:
					r.GPU.Nodes = 2
					r.GPU.Count = 2 * (1 + rng.IntN(4))
				case 1:
					r.GPU.Count, r.GPU.MIGProfile = 1, []string{"3g.40gb", "1g.10gb", "7g.80gb"}[rng.IntN(3)]
				case 2:
					r.GPU.Count = 1
					r.GPU.Share = &contracts.GPUShare{MemoryMiB: 1024 * int64(1+rng.IntN(3)), ComputePercent: 10 * (1 + rng.IntN(5))}
				case 3:
					r.GPU.Model, r.GPU.Models = "", []string{"L4", "A100-80GB"}[:1+rng.IntN(2)]
				}
				if rng.IntN(4) == 0 {
					r.Pool = pools[rng.IntN(len(pools))]
				}
				if rng.IntN(5) == 0 {
					refuse := pools[rng.IntN(len(pools))]
					r.PoolRuns = func(pool string) bool { return pool != refuse }
				}
				r.GPU.MemoryMiB = int64(rng.IntN(2)) * 40960
				shapes[i] = r
			}
			waiting := make([]placement.Request, rng.IntN(300))
			for i := range waiting {
				waiting[i] = shapes[rng.IntN(len(shapes))]
			}
			used := map[string]int{"east": rng.IntN(3)}
			got := Compute(snap, used, waiting, pools[:2], now)
			ungrouped = true
			want := Compute(snap, used, waiting, pools[:2], now)
			ungrouped = false
			if diff := cmp.Diff(want, got); diff != "" {
				t.Fatalf("grouped demand differs (-one by one +grouped):\n%s", diff)
			}
		})
	}
}
