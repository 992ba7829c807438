package placement

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestFailedBeforeDecidesAsTheSearch runs one random queue of repeated
// request shapes through two placers over the same random cluster, one
// that skips the search of a request whose memo key failed earlier in the
// cycle (failedBefore) and one that searches every time: every decision,
// devices and pending code and message alike, must be the same, and the
// skip must have happened.
func TestFailedBeforeDecidesAsTheSearch(t *testing.T) {
	skipped := 0
	for seed := range uint64(300) {
		rng := rand.New(rand.NewPCG(seed, 17))
		snap := randomCluster(rng, 4+rng.IntN(40))
		ids := make([]string, len(snap.Nodes))
		for i, n := range snap.Nodes {
			ids[i] = n.ID
		}
		// A few templates, so that shapes repeat; exclusions travel under
		// a key naming them, as the scheduler's reservations do.
		templates := make([]Request, 3+rng.IntN(8))
		for i := range templates {
			r := randomRequest(rng, ids)
			r.Tenant = fmt.Sprintf("t%d", rng.IntN(3))
			if len(r.Exclude) > 0 || len(r.Reserved) > 0 {
				r.ExcludeKey = fmt.Sprintf("x%d", i)
			}
			if rng.IntN(4) == 0 {
				r.Prefer = func(node string) bool { return node > "n5" }
			}
			templates[i] = r
		}
		// The same shapes under other pool verdicts (a tenant at its
		// quota in one pool), which the key must tell apart.
		verdicts := []func(string) bool{nil, func(p string) bool { return p != "a" }, func(p string) bool { return p == "c" }}
		pol := contracts.PlacementPolicies[rng.IntN(len(contracts.PlacementPolicies))]
		opt := Options{Policy: func(string) contracts.PlacementPolicy { return pol }}
		memo, plain := NewPlacer(snap, opt), NewPlacer(snap, opt)
		plain.noFailMemo = true
		m := newMirror(snap)
		for i := range 120 {
			r := templates[rng.IntN(len(templates))]
			r.Ahead = i
			if rng.IntN(2) == 0 {
				r.AllowPool = verdicts[rng.IntN(len(verdicts))]
			}
			got, want := memo.Place(r), plain.Place(r)
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("seed %d request %d %+v:\n with the skip %s %+v\n searching     %s %+v", seed, i, r.GPU,
					placed(got), got.Pending, placed(want), want.Pending)
			}
			if err := m.apply(r, got); err != nil {
				t.Fatalf("seed %d request %d: %v", seed, i, err)
			}
		}
		skipped += memo.skipped
		if plain.skipped != 0 {
			t.Fatalf("seed %d: the searching placer skipped %d", seed, plain.skipped)
		}
	}
	if skipped == 0 {
		t.Fatal("no search was skipped: the test proves nothing")
	}
	t.Logf("%d searches skipped", skipped)
}

// TestOccupiedClassesAreTheNonEmptyOnes checks the occupied list explain
// walks against the classes themselves after every placement.
func TestOccupiedClassesAreTheNonEmptyOnes(t *testing.T) {
	for seed := range uint64(50) {
		rng := rand.New(rand.NewPCG(seed, 23))
		snap := randomCluster(rng, 4+rng.IntN(40))
		p := NewPlacer(snap, Options{})
		for i := range 60 {
			p.Place(randomRequest(rng, nil))
			want := map[int32]bool{}
			for cid := range p.classes {
				if len(p.classes[cid].members) > 0 {
					want[int32(cid)] = true
				}
			}
			got := map[int32]bool{}
			for pos, cid := range p.occupied {
				if got[cid] || p.occupiedAt[cid] != int32(pos) {
					t.Fatalf("seed %d step %d: class %d listed twice or at the wrong position", seed, i, cid)
				}
				got[cid] = true
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("seed %d step %d: occupied %v, non-empty %v", seed, i, got, want)
			}
		}
	}
}
