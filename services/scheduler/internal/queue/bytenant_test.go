package queue

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestByTenantIsOrderGroupedByTenant: on random queues (pushes out of
// Seq order, removals, compactions, unknown classes), ByTenant yields
// every item Order yields, grouped by class (highest first) and tenant (by
// name), each group in the order Order gives it.
func TestByTenantIsOrderGroupedByTenant(t *testing.T) {
	prios := []contracts.Priority{contracts.PriorityCritical, contracts.PriorityHigh, contracts.PriorityNormal, "",
		contracts.PriorityBestEffort, "bogus"}
	for seed := range 30 {
		rng := rand.New(rand.NewPCG(uint64(seed), 9))
		q := New[int]()
		var keys []string
		for i := range 50 + rng.IntN(400) {
			if len(keys) > 0 && rng.IntN(3) == 0 {
				k := keys[rng.IntN(len(keys))]
				q.Remove(k)
				continue
			}
			k := fmt.Sprint("k", i)
			keys = append(keys, k)
			q.Push(Item[int]{Key: k, Tenant: fmt.Sprint("t", rng.IntN(7)), Priority: prios[rng.IntN(len(prios))],
				Seq: uint64(rng.IntN(1000)), Value: i})
		}
		type group struct {
			class  int
			tenant string
		}
		want := map[group][]string{}
		for it := range q.Order() {
			g := group{classIndex(it.Priority), it.Tenant}
			want[g] = append(want[g], it.Key)
		}
		got := map[group][]string{}
		var seen []group
		for it := range q.ByTenant() {
			g := group{classIndex(it.Priority), it.Tenant}
			if n := len(seen); n == 0 || seen[n-1] != g {
				if slices.Contains(seen, g) {
					t.Fatalf("seed %d: group %v comes twice", seed, g)
				}
				if n > 0 && (seen[n-1].class > g.class || seen[n-1].class == g.class && seen[n-1].tenant > g.tenant) {
					t.Fatalf("seed %d: group %v after %v", seed, g, seen[n-1])
				}
				seen = append(seen, g)
			}
			got[g] = append(got[g], it.Key)
		}
		if len(got) != len(want) {
			t.Fatalf("seed %d: %d groups, want %d", seed, len(got), len(want))
		}
		for g, w := range want {
			if !slices.Equal(got[g], w) {
				t.Fatalf("seed %d: group %v: %v, want %v", seed, g, got[g], w)
			}
		}
	}
}
