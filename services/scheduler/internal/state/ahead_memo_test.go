package state

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestAheadTablesKeptAcrossCycles offers the same queue cycle after cycle
// to ahead counts over the tables a store keeps (each job keeping its pool
// and tenant ids) and to counts over tables built afresh, while the fleet
// changes between some cycles (a pool gains a model, a MIG profile or a
// new pool appears, a pool loses its last card of a model): every count
// must be the same, the kept ids must have been reused, and new tables
// must come exactly when the fleet's card kinds changed.
func TestAheadTablesKeptAcrossCycles(t *testing.T) {
	reused := 0
	for seed := range 12 {
		rng := rand.New(rand.NewPCG(uint64(seed), 41))
		h := newHarness(t)
		nodes := 0
		addNode := func() {
			pool := fmt.Sprint("p", rng.IntN(4))
			model := []string{h100, a100, "L4"}[rng.IntN(3)]
			h.inventory(fmt.Sprint("n", nodes), pool, model, 81920, 1+rng.IntN(4))
			nodes++
		}
		for range 1 + rng.IntN(4) {
			addNode()
		}
		var queue []*Job
		for i := range 300 {
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
			queue = append(queue, &Job{Tenant: fmt.Sprint("t", rng.IntN(4)), Request: r})
		}
		var lastGen uint64
		lastSig := ""
		for cycle := range 6 {
			kept := h.st.newAhead()
			fresh := &ahead{s: h.st, aheadTables: newAheadTables(h.st.cardKindsSig())}
			if sig := h.st.cardKindsSig(); cycle > 0 && (kept.gen != lastGen) != (sig != lastSig) {
				t.Fatalf("seed %d cycle %d: tables of generation %d after %d, card kinds %q after %q", seed, cycle,
					kept.gen, lastGen, sig, lastSig)
			}
			lastGen, lastSig = kept.gen, h.st.cardKindsSig()
			for i, j := range queue {
				if j.memo != nil && j.memo.aheadGen == kept.gen {
					reused++
				}
				ref := *j
				ref.memo = nil // its own ids, in the fresh tables
				if got, want := kept.next(j), fresh.next(&ref); got != want {
					t.Fatalf("seed %d cycle %d job %d (%+v in pool %q): %d ahead over kept tables, %d over fresh ones",
						seed, cycle, i, j.Request.Resources.GPU, j.Request.Pool, got, want)
				}
				if j.memo.tenantName != j.Tenant {
					t.Fatalf("seed %d: tenant %q kept as %q", seed, j.Tenant, j.memo.tenantName)
				}
			}
			switch rng.IntN(3) {
			case 0:
				addNode()
			case 1: // a node's cards change model, or it turns to MIG
				id := fmt.Sprint("n", rng.IntN(nodes))
				if rng.IntN(2) == 0 {
					h.inventory(id, fmt.Sprint("p", rng.IntN(5)), []string{h100, a100, "L4"}[rng.IntN(3)], 81920, 1)
				} else {
					h.st.ApplyInventory(contracts.NodeInventory{NodeID: id, Pool: "p1", GPUs: []contracts.GPUInfo{{
						UUID: id + "-mig", Model: a100, MemoryMiB: 81920, Healthy: true, MIGEnabled: true,
						MIGInstances: []contracts.MIGInstance{{Profile: "1g.10gb"}}}}})
				}
			}
		}
	}
	if reused == 0 {
		t.Fatal("no kept ids were reused: the test proves nothing")
	}
	t.Logf("%d counts over kept ids", reused)
}

// TestAheadTablesAreBounded: kept tables that grew past maxAheadNames
// (pool names, tenants and model lists come from users) are built afresh
// by the next cycle, not kept growing.
func TestAheadTablesAreBounded(t *testing.T) {
	h := newHarness(t)
	h.inventory("n0", "p0", h100, 81920, 1)
	a := h.st.newAhead()
	if b := h.st.newAhead(); b.aheadTables != a.aheadTables {
		t.Fatal("tables not kept between cycles with the same fleet")
	}
	for i := range maxAheadNames + 1 {
		a.pools[poolsKey{models: fmt.Sprint("m", i)}] = nil
	}
	if b := h.st.newAhead(); b.aheadTables == a.aheadTables || b.gen == a.gen || len(b.pools) != 0 {
		t.Fatalf("tables of %d shapes kept (generation %d, then %d)", len(a.pools), a.gen, b.gen)
	}
}
