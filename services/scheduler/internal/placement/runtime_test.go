package placement

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// withImage prefers the nodes listed, as the scheduler prefers the nodes
// whose inventory lists the job's image.
func withImage(r Request, holders ...string) Request {
	r.Prefer = func(node string) bool {
		for _, h := range holders {
			if h == node {
				return true
			}
		}
		return false
	}
	return r
}

// TestPlacePrefersNodesWithTheImage: between machines of equal rank the one
// holding the image wins; a better-ranked machine without it still wins
// (locality never costs fragmentation); a holder that cannot take the job
// is passed over.
func TestPlacePrefersNodesWithTheImage(t *testing.T) {
	full := mk("c", "p", 8, 8)
	tests := map[string]struct {
		policy contracts.PlacementPolicy
		nodes  []Node
		req    Request
		want   string
	}{
		"no image: first in node order": {contracts.PolicyBinpack, []Node{mk("a", "p", 8, 0), mk("b", "p", 8, 0)},
			whole(1), "a[0]"},
		"equal machines: the holder": {contracts.PolicyBinpack, []Node{mk("a", "p", 8, 0), mk("b", "p", 8, 0)},
			withImage(whole(1), "b"), "b[0]"},
		"equal machines, fragaware: the holder": {contracts.PolicyFragAware, []Node{mk("a", "p", 8, 0), mk("b", "p", 8, 0)},
			withImage(whole(1), "b"), "b[0]"},
		"equal machines, spread: the holder": {contracts.PolicySpread, []Node{mk("a", "p", 8, 0), mk("b", "p", 8, 0), mk("d", "p", 8, 0)},
			withImage(whole(1), "d"), "d[0]"},
		"binpack: the fuller machine beats the holder": {contracts.PolicyBinpack, []Node{mk("a", "p", 8, 4), mk("b", "p", 8, 0)},
			withImage(whole(1), "b"), "a[4]"},
		"spread: the emptier machine beats the holder": {contracts.PolicySpread, []Node{mk("a", "p", 8, 4), mk("b", "p", 8, 0)},
			withImage(whole(1), "a"), "b[0]"},
		"a holder without room is passed over": {contracts.PolicyBinpack, []Node{mk("a", "p", 8, 0), mk("b", "p", 8, 0), full},
			withImage(whole(1), "c"), "a[0]"},
		"a holder in another class of equal rank": {contracts.PolicyBinpack,
			[]Node{mk("a", "p", 8, 0), {ID: "b", Pool: "p", Zone: "z2", CPUMilliFree: 64000, MemoryMiBFree: 512 << 10, GPUs: gpus("b", h100, 81920, 8, "b-nvl", 0)}},
			withImage(whole(1), "b"), "b[0]"},
		"a holder in another pool of equal rank": {contracts.PolicyBinpack, []Node{mk("a", "p", 8, 0), mk("b", "q", 8, 0)},
			withImage(whole(1), "b"), "b[0]"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			got := run(Snapshot{Nodes: tt.nodes}, usePolicy(tt.policy), tt.req)
			if got[0] != tt.want {
				t.Fatalf("placed %s, want %s", got[0], tt.want)
			}
		})
	}
}

// TestPlaceKeepsOffPoolsThatDoNotRunIt: PoolRuns keeps a job off the pools
// whose runtime policy refuses it, in Place, FitNode and the pending reason.
func TestPlaceKeepsOffPoolsThatDoNotRunIt(t *testing.T) {
	onlyTrusted := func(r Request) Request {
		r.PoolRuns = func(pool string) bool { return pool == "trusted" }
		return r
	}
	snap := Snapshot{Nodes: []Node{mk("a", "images", 8, 0), mk("b", "trusted", 8, 6)}}
	got := run(snap, usePolicy(contracts.PolicyBinpack), onlyTrusted(whole(2)), onlyTrusted(whole(1)))
	if got[0] != "b[6 7]" {
		t.Fatalf("placed %s, want b[6 7]: pool images does not run it", got[0])
	}
	p := NewPlacer(Snapshot{Nodes: snap.Nodes[:1]}, usePolicy(contracts.PolicyBinpack))
	d := p.Place(onlyTrusted(whole(1)))
	if d.Placed() || d.Pending.Code != contracts.PendingNoSchedulableNode || !strings.Contains(d.Pending.Message, "runtime policy does not run it") {
		t.Fatalf("decision %+v: want a wait that names the runtime policy", d)
	}
	if _, ok := FitNode(&snap.Nodes[0], onlyTrusted(whole(1))); ok {
		t.Fatal("FitNode fits a node of a pool that does not run the job")
	}
	if _, ok := FitNode(&snap.Nodes[1], onlyTrusted(whole(1))); !ok {
		t.Fatal("FitNode refuses a node of a pool that runs the job")
	}
}

// BenchmarkPlaceLocality is BenchmarkPlace's fragaware decisions with every
// request preferring the machines holding its image (one in twenty, a
// different twentieth per image of 16), for the cost of Prefer beside
// BenchmarkPlace/nodes=N/fragaware; on-holder% is the share of placements
// that landed on a holder.
func BenchmarkPlaceLocality(b *testing.B) {
	for _, nodes := range benchSizes {
		snap := benchCluster(b, nodes)
		reqs := benchRequests(rand.New(rand.NewPCG(99, 2)), 8192)
		holders := make([]map[string]bool, 16)
		for im := range holders {
			holders[im] = map[string]bool{}
			for i, n := range snap.Nodes {
				if (i+im)%20 == 0 {
					holders[im][n.ID] = true
				}
			}
		}
		for i := range reqs {
			h := holders[i%len(holders)]
			reqs[i].Prefer = func(node string) bool { return h[node] }
		}
		b.Run(fmt.Sprintf("nodes=%d/fragaware", nodes), func(b *testing.B) {
			var p *Placer
			placedN, onHolder := 0, 0
			b.ReportAllocs()
			for i := range b.N {
				if i%benchCycle == 0 {
					b.StopTimer()
					p = NewPlacer(snap, Options{})
					b.StartTimer()
				}
				r := reqs[i%len(reqs)]
				d := p.Place(r)
				if d.Placed() {
					placedN++
					if r.Prefer(d.Parts[0].NodeID) {
						onHolder++
					}
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "placements/s")
			b.ReportMetric(100*float64(onHolder)/float64(max(placedN, 1)), "on-holder%")
			b.ReportMetric(100*float64(placedN)/float64(b.N), "placed%")
		})
	}
}
