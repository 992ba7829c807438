package state

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestAllocOrderIsTheSortedMap: the order kept across asks is always the
// committed allocations sorted by ID, pointer for pointer, through random
// commits (new IDs, and IDs committed again, which store a new pointer),
// releases, asks between them or not, and bursts past the bound that make
// it sort afresh.
func TestAllocOrderIsTheSortedMap(t *testing.T) {
	seeds := uint64(20)
	if testing.Short() || raceEnabled {
		seeds = 5
	}
	for seed := range seeds {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 7))
			c := newCluster()
			ids := 50 + rng.IntN(3000)
			for step := range 200 {
				burst := 1 + rng.IntN(40)
				if rng.IntN(20) == 0 {
					burst = 3000 // past the bound
				}
				for range burst {
					id := fmt.Sprintf("a-%05d", rng.IntN(ids))
					if _, ok := c.allocs[id]; ok && rng.IntN(3) > 0 {
						c.release(contracts.Allocation{ID: id})
					} else {
						c.commit(contracts.Allocation{ID: id, NodeID: fmt.Sprintf("n%d", rng.IntN(8))})
					}
				}
				if rng.IntN(3) == 0 {
					continue // no ask: the changes pile up
				}
				want := make([]*contracts.Allocation, 0, len(c.allocs))
				for _, a := range c.allocs {
					want = append(want, a)
				}
				slices.SortFunc(want, func(x, y *contracts.Allocation) int { return strings.Compare(x.ID, y.ID) })
				if got := c.order.sorted(c.allocs); !slices.Equal(got, want) {
					t.Fatalf("step %d: order of %d allocations differs from the sorted map's %d", step, len(got), len(want))
				}
			}
		})
	}
}
