package state

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestAheadCountsByTenantAndPool holds ahead.next, which counts by tenant
// and pool id, to counting by tenant and pool name (the count it replaced):
// for each offered job, the most jobs of its tenant offered before it in
// any one of the pools its cards could use. Random fleets (pools of H100,
// A100 and MIG A100 machines) and requests (any model, one or two models,
// MIG profiles, a named pool, one no pool has).
func TestAheadCountsByTenantAndPool(t *testing.T) {
	for seed := range 20 {
		rng := rand.New(rand.NewPCG(uint64(seed), 3))
		h := newHarness(t)
		for i := range 1 + rng.IntN(6) {
			pool := fmt.Sprint("p", rng.IntN(4))
			model := []string{h100, a100, "L4"}[rng.IntN(3)]
			h.inventory(fmt.Sprint("n", i), pool, model, 81920, 1+rng.IntN(4))
		}
		a := h.st.newAhead()
		ref := map[[2]string]int{}
		for i := range 400 {
			g := contracts.GPURequest{Count: 1}
			switch rng.IntN(5) {
			case 0:
				g.Model = []string{h100, a100, "T4"}[rng.IntN(3)]
			case 1:
				g.Models = []string{"L4", a100}[:1+rng.IntN(2)]
			case 2:
				g.MIGProfile, g.Model = "1g.10gb", a100
			}
			r := &contracts.JobRequest{ID: fmt.Sprint("j", i), Resources: contracts.Resources{GPU: g}}
			if rng.IntN(6) == 0 {
				r.Pool = fmt.Sprint("p", rng.IntN(5))
			}
			j := &Job{Tenant: fmt.Sprint("t", rng.IntN(4)), Request: r}
			got := a.next(j)
			names := map[int32]string{}
			for name, id := range a.ids {
				names[id] = name
			}
			want := 0
			for _, id := range a.pools[poolsKeyOf(r)] {
				want = max(want, ref[[2]string{j.Tenant, names[id]}])
			}
			if r.Pool != "" {
				want = ref[[2]string{j.Tenant, r.Pool}]
				ref[[2]string{j.Tenant, r.Pool}]++
			} else {
				for _, id := range a.pools[poolsKeyOf(r)] {
					ref[[2]string{j.Tenant, names[id]}]++
				}
			}
			if got != want {
				t.Fatalf("seed %d job %d (%+v): %d ahead, want %d", seed, i, g, got, want)
			}
		}
	}
}

// poolsKeyOf is poolsOf's key of a request naming no pool.
func poolsKeyOf(r *contracts.JobRequest) poolsKey {
	g := &r.Resources.GPU
	k := poolsKey{kind: g.Kind(), mig: g.MIGProfile, model: g.Model}
	if len(g.Models) > 0 {
		k.models = strings.Join(g.Models, ",")
	}
	return k
}
