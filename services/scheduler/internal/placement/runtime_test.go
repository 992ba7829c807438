package placement

import (
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
