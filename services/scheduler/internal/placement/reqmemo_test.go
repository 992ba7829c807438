package placement

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestPlaceMemoDecidesAsPlace offers one random queue of repeated request
// shapes, cycle after cycle, to two placers over the same random cluster:
// one given each queued request's RequestMemo, kept from cycle to cycle
// (as the scheduler keeps one per queued job), and one without. Every
// decision, devices and pending code and message alike, must be the same,
// in a cycle's first offers (the memo names an earlier Placer's shape)
// and its later ones; and the memo must have been used.
func TestPlaceMemoDecidesAsPlace(t *testing.T) {
	reused := 0
	for seed := range uint64(120) {
		rng := rand.New(rand.NewPCG(seed, 29))
		snap := randomCluster(rng, 4+rng.IntN(30))
		ids := make([]string, len(snap.Nodes))
		for i, n := range snap.Nodes {
			ids[i] = n.ID
		}
		templates := make([]Request, 2+rng.IntN(6))
		for i := range templates {
			r := randomRequest(rng, ids)
			if i > 0 && rng.IntN(2) == 0 {
				// The shape of the one before with other host resources
				// (its memo key differs only in them).
				r = templates[i-1]
				r.CPUMilli, r.MemoryMiB = int64(rng.IntN(3))*16000, int64(rng.IntN(3))*64000
			}
			r.Tenant = fmt.Sprintf("t%d", rng.IntN(3))
			if len(r.Exclude) > 0 || len(r.Reserved) > 0 {
				r.ExcludeKey = fmt.Sprintf("x%d", i)
			}
			if rng.IntN(3) == 0 {
				r.Extra = "quota t0/a at 8 of 8"
			}
			templates[i] = r
		}
		// The queue: each job a template and its own memo, kept across
		// cycles while the request stays the same.
		type job struct {
			tmpl int
			memo *RequestMemo
		}
		queue := make([]job, 20+rng.IntN(60))
		for i := range queue {
			queue[i] = job{tmpl: rng.IntN(len(templates)), memo: &RequestMemo{}}
		}
		verdicts := []func(string) bool{nil, func(p string) bool { return p != "a" }}
		pol := contracts.PlacementPolicies[rng.IntN(len(contracts.PlacementPolicies))]
		opt := Options{Policy: func(string) contracts.PlacementPolicy { return pol }}
		for cycle := range 3 {
			memo, plain := NewPlacer(snap, opt), NewPlacer(snap, opt)
			for i, jb := range queue {
				r := templates[jb.tmpl]
				r.Ahead = i
				if rng.IntN(3) == 0 {
					r.AllowPool = verdicts[rng.IntN(len(verdicts))]
				}
				if jb.memo.prefix != "" {
					reused++
				}
				rr := r
				got, want := memo.PlaceMemo(&rr, jb.memo), plain.Place(r)
				if !reflect.DeepEqual(got, want) {
					t.Fatalf("seed %d cycle %d request %d %+v:\n with the memo %s %+v\n without      %s %+v", seed, cycle, i,
						r.GPU, placed(got), got.Pending, placed(want), want.Pending)
				}
				if memo.reqMemo != nil {
					t.Fatalf("seed %d: the memo outlived its request's placement", seed)
				}
			}
			// A job whose request changes gets a new memo (the caller's
			// rule); some jobs leave and others come.
			for i := range queue {
				if rng.IntN(5) == 0 {
					queue[i] = job{tmpl: rng.IntN(len(templates)), memo: &RequestMemo{}}
				}
			}
		}
	}
	if reused == 0 {
		t.Fatal("no memo was reused: the test proves nothing")
	}
	t.Logf("%d placements with a kept memo", reused)
}

// TestWithQueueIsTheConcatenation holds withQueue's one-buffer text to
// the concatenation it replaced: the explanation, aheadText, and Extra.
func TestWithQueueIsTheConcatenation(t *testing.T) {
	p := NewPlacer(Snapshot{}, Options{})
	for _, tc := range []struct {
		tenant, extra string
		ahead         int
	}{
		{"", "", 0}, {"research", "", 0}, {"research", "", 1}, {"t01", "", 2}, {"t01", "", 123456},
		{"", "quota research/h100 at 16 of 16", 0}, {"ml", "quota ml/a at 1 of 1", 1},
	} {
		for _, base := range []string{"", "needs 1×GPU on one machine; no matching GPU is free on a usable machine"} {
			r := Request{Tenant: tc.tenant, Ahead: tc.ahead, Extra: tc.extra}
			want := base + aheadText(&r)
			if r.Extra != "" {
				want += "; " + r.Extra
			}
			got := p.withQueue(Pending{Code: contracts.PendingInsufficientGPUs, Message: base}, &r)
			if got.Message != want || got.Code != contracts.PendingInsufficientGPUs {
				t.Errorf("%+v on %q: got %q, want %q", tc, base, got.Message, want)
			}
		}
	}
	// Each result is its own string: the buffer is reused.
	a := p.withQueue(Pending{Message: "x"}, &Request{Tenant: "a", Ahead: 1})
	b := p.withQueue(Pending{Message: "y"}, &Request{Tenant: "b", Ahead: 2})
	if a.Message != "x; 1 job ahead in queue a" || b.Message != "y; 2 jobs ahead in queue b" {
		t.Fatalf("got %q and %q", a.Message, b.Message)
	}
}
