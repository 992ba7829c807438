package state

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// TestDefragmentDecidesAsExhaustiveSearch runs the mixed workload of
// TestCycleDecidesAsExhaustiveSearch with every pool's defragment alert
// firing, through a store whose defragment shares one search among the
// blocked jobs that ask the same (defragAsk) and one that searches for
// every job afresh. Every cycle's plans, events, moves and demand must be
// the same, while the clock runs on and jobs commit, start, end and
// arrive. (Its moves are few or none: the moves themselves are
// TestDefragmentSharesSearchesOfTheSameAsk's.)
func TestDefragmentDecidesAsExhaustiveSearch(t *testing.T) {
	for _, size := range []struct{ nodes, queue int }{{40, 120}, {150, 400}} {
		t.Run(fmt.Sprintf("nodes=%d", size.nodes), func(t *testing.T) {
			memo, full := benchMixed(t, size.nodes, size.queue), benchMixed(t, size.nodes, size.queue)
			full.exhaustive = true
			now := benchT0
			for _, st := range []*Store{memo, full} {
				st.cfg.Now = func() time.Time { return now }
				st.cfg.MinRuntime = 0
				for _, p := range benchPools {
					st.ApplyDefrag(p.name, "pool_fragmented/"+p.name, true)
				}
			}
			rng := rand.New(rand.NewPCG(uint64(size.nodes), 11))
			seq := uint64(1_000_000)
			placed, moved := 0, 0
			for cycle := range 6 {
				now = now.Add(2 * time.Minute)
				got, want := memo.Cycle(), full.Cycle()
				sameCycle(t, cycle, got, want)
				placed += got.Placed
				for _, p := range got.Publish {
					if ev, ok := p.Msg.(contracts.JobEvent); ok && strings.HasPrefix(ev.Message, "defragmenting pool") {
						moved++
					}
				}
				runPlaced(rng, now, got, memo, full)
				submitMixed(t, rng, &seq, size.queue/4, memo, full)
			}
			if placed == 0 || full.defragSearches == 0 || memo.defragSearches >= full.defragSearches {
				t.Fatalf("placed %d, searches %d shared vs %d exhaustive: the comparison proves little", placed, memo.defragSearches, full.defragSearches)
			}
			t.Logf("placed %d, %d moves decided, searches %d shared vs %d exhaustive", placed, moved, memo.defragSearches, full.defragSearches)
		})
	}
}

// TestDefragmentSharesSearchesOfTheSameAsk: on a fragmented pool, blocked
// jobs that ask the same of a search (several tenants' 2-GPU jobs, 3-GPU
// jobs no node holds, one of them needing a runtime check) are decided by
// a store that shares searches as by one that searches for each job, over
// cycles with the clock running on, until a small job is moved; and the
// sharing store searched fewer times.
func TestDefragmentSharesSearchesOfTheSameAsk(t *testing.T) {
	build := func(exhaustive bool) *harness {
		h := newHarness(t, func(c *Config) { c.MinRuntime = 0 })
		h.st.exhaustive = exhaustive
		fragmented(h, true)
		for i := range 3 {
			h.submit("wide", job(fmt.Sprintf("w%d", i), 3, "any"))
		}
		for _, tenant := range []string{"big", "other"} {
			for i := range 3 {
				h.submit(tenant, job(fmt.Sprintf("b%d", i), 2, "any"))
			}
		}
		host := job("h0", 2, "any")
		host.Run.Command = []string{"true"}
		h.submit("other", host)
		h.st.ApplyDefrag("p", "pool_fragmented/p", true)
		return h
	}
	memo, full := build(false), build(true)
	moved := false
	for cycle := range 8 {
		got, want := memo.cycle(), full.cycle()
		sameCycle(t, cycle, got, want)
		for _, p := range got.Publish {
			if ev, ok := p.Msg.(contracts.JobEvent); ok && strings.HasPrefix(ev.Message, "defragmenting pool") {
				moved = true
			}
		}
		if moved {
			break
		}
		// Not worth it yet: the waits grow.
		memo.now, full.now = memo.now.Add(10*time.Second), full.now.Add(10*time.Second)
	}
	if !moved {
		t.Fatal("nothing moved: the comparison proves little")
	}
	if memo.st.defragSearches >= full.st.defragSearches {
		t.Fatalf("the sharing store searched %d times, the exhaustive one %d: nothing shared", memo.st.defragSearches, full.st.defragSearches)
	}
	t.Logf("searches: %d shared vs %d exhaustive", memo.st.defragSearches, full.st.defragSearches)
}

// TestDefragAskNamesWhatASearchReads: requests that differ in anything a
// defragment search reads are asked apart; the same request built twice
// (other maps, another share pointer) is one ask; a request with a
// runtime check is never shared.
func TestDefragAskNamesWhatASearchReads(t *testing.T) {
	base := func() placement.Request {
		return placement.Request{Tenant: "a", GPU: contracts.GPURequest{Count: 1, Share: &contracts.GPUShare{MemoryMiB: 8000, ComputePercent: 10}},
			CPUMilli: 1000, MemoryMiB: 2048, Selector: map[string]string{"k": "v"},
			Tolerations: []contracts.Toleration{{Key: "t", Operator: contracts.TolerationExists}},
			AllowPool:   func(string) bool { return true }, Ahead: 3, Extra: "x"}
	}
	key := func(r placement.Request, prio contracts.Priority, need int64) string {
		k, ok := defragAsk(r, prio, need)
		if !ok {
			t.Fatalf("request %+v not named", r)
		}
		return k
	}
	want := key(base(), contracts.PriorityNormal, 1000)
	same := base()
	same.Ahead, same.Extra, same.Prefer = 9, "y", func(string) bool { return true }
	if got := key(same, contracts.PriorityNormal, 1000); got != want {
		t.Fatalf("the same search asked apart:\n%s\n%s", got, want)
	}
	differ := []struct {
		name string
		edit func(*placement.Request)
		prio contracts.Priority
		need int64
	}{
		{"tenant", func(r *placement.Request) { r.Tenant = "b" }, "", 0},
		{"priority", func(*placement.Request) {}, contracts.PriorityHigh, 0},
		{"need", func(*placement.Request) {}, "", 500},
		{"count", func(r *placement.Request) { r.GPU.Count = 2 }, "", 0},
		{"share", func(r *placement.Request) { r.GPU.Share = &contracts.GPUShare{MemoryMiB: 8000, ComputePercent: 20} }, "", 0},
		{"model", func(r *placement.Request) { r.GPU.Model = "H100-80GB" }, "", 0},
		{"models", func(r *placement.Request) { r.GPU.Models = []string{"A100-80GB"} }, "", 0},
		{"mig", func(r *placement.Request) { r.GPU.MIGProfile = "1g.10gb" }, "", 0},
		{"nodes", func(r *placement.Request) { r.GPU.Nodes = 2 }, "", 0},
		{"topology", func(r *placement.Request) { r.GPU.Topology = contracts.TopologyZone }, "", 0},
		{"framebuffer", func(r *placement.Request) { r.GPU.MemoryMiB = 40000 }, "", 0},
		{"cpu", func(r *placement.Request) { r.CPUMilli = 2000 }, "", 0},
		{"memory", func(r *placement.Request) { r.MemoryMiB = 4096 }, "", 0},
		{"selector", func(r *placement.Request) { r.Selector = map[string]string{"k": "w"} }, "", 0},
		{"tolerations", func(r *placement.Request) { r.Tolerations = nil }, "", 0},
		{"no quota", func(r *placement.Request) { r.AllowPool = nil }, "", 0},
	}
	for _, tc := range differ {
		t.Run(tc.name, func(t *testing.T) {
			r := base()
			tc.edit(&r)
			prio, need := cmp.Or(tc.prio, contracts.PriorityNormal), cmp.Or(tc.need, 1000)
			if got := key(r, prio, need); got == want {
				t.Fatalf("a request with another %s is asked as the base one: %s", tc.name, got)
			}
		})
	}
	r := base()
	r.PoolRuns = func(string) bool { return true }
	if _, ok := defragAsk(r, contracts.PriorityNormal, 1000); ok {
		t.Fatal("a request with a runtime check was named: its search reads the job's run")
	}
}
