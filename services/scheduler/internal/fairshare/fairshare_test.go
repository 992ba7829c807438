package fairshare

import (
	"cmp"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"

	gocmp "github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

const gpu = 1000 // milli-GPU

func ptr(f float64) *float64 { return &f }

type hold struct {
	tenant, pool string
	u            Usage
}

// drain runs a round the way the scheduler does when everything fits:
// every item is placed in pool "p".
func drain(r *Round) []string {
	var keys []string
	for it, ok := r.Next(); ok; it, ok = r.Next() {
		keys = append(keys, it.Key)
		r.Placed(it, "p")
	}
	return keys
}

func TestRoundOrder(t *testing.T) {
	const (
		crit = contracts.PriorityCritical
		norm = contracts.PriorityNormal
		be   = contracts.PriorityBestEffort
	)
	oneGPU := Usage{MilliGPU: gpu}
	tests := map[string]struct {
		capacity Usage
		quotas   map[string]contracts.TenantQuota
		holds    []hold
		items    []Item
		want     []string
	}{
		"priority class before share": {
			capacity: Usage{MilliGPU: 10 * gpu},
			holds:    []hold{{"heavy", "p", Usage{MilliGPU: 9 * gpu}}},
			items: []Item{
				{Key: "light-normal", Tenant: "light", Priority: norm, Seq: 1},
				{Key: "heavy-best-effort", Tenant: "heavy", Priority: be, Seq: 2},
				{Key: "heavy-critical", Tenant: "heavy", Priority: crit, Seq: 3},
				{Key: "light-unknown", Tenant: "light", Priority: "urgent", Seq: 0},
			},
			want: []string{"heavy-critical", "light-normal", "heavy-best-effort", "light-unknown"},
		},
		"lowest share first": {
			capacity: Usage{MilliGPU: 10 * gpu},
			holds:    []hold{{"a", "p", Usage{MilliGPU: 3 * gpu}}, {"b", "p", Usage{MilliGPU: 1 * gpu}}},
			items: []Item{
				{Key: "a1", Tenant: "a", Seq: 1, Usage: oneGPU},
				{Key: "b1", Tenant: "b", Seq: 2, Usage: oneGPU},
				{Key: "b2", Tenant: "b", Seq: 3, Usage: oneGPU},
				{Key: "b3", Tenant: "b", Seq: 4, Usage: oneGPU},
			},
			// b climbs 1->2->3; at 3 it ties a and a wins by name.
			want: []string{"b1", "b2", "a1", "b3"},
		},
		"weight 2 is served twice as much": {
			capacity: Usage{MilliGPU: 12 * gpu},
			quotas:   map[string]contracts.TenantQuota{"a": {Weight: 2}},
			items: []Item{
				{Key: "a1", Tenant: "a", Seq: 1, Usage: oneGPU}, {Key: "a2", Tenant: "a", Seq: 2, Usage: oneGPU},
				{Key: "a3", Tenant: "a", Seq: 3, Usage: oneGPU}, {Key: "a4", Tenant: "a", Seq: 4, Usage: oneGPU},
				{Key: "a5", Tenant: "a", Seq: 5, Usage: oneGPU}, {Key: "a6", Tenant: "a", Seq: 6, Usage: oneGPU},
				{Key: "b1", Tenant: "b", Seq: 1, Usage: oneGPU}, {Key: "b2", Tenant: "b", Seq: 2, Usage: oneGPU},
				{Key: "b3", Tenant: "b", Seq: 3, Usage: oneGPU}, {Key: "b4", Tenant: "b", Seq: 4, Usage: oneGPU},
			},
			// (a GPUs, b GPUs) after each: (1,0) (1,1) (2,1) (3,1) (3,2) (4,2) (5,2) (5,3) (6,3), then b alone.
			want: []string{"a1", "b1", "a2", "a3", "b2", "a4", "a5", "b3", "a6", "b4"},
		},
		"dominant resource is CPU for a CPU-heavy tenant": {
			capacity: Usage{MilliGPU: 100 * gpu, CPUMilli: 100_000, MemoryMiB: 1 << 20},
			holds: []hold{
				{"gpu-heavy", "p", Usage{MilliGPU: 10 * gpu, CPUMilli: 1000}}, // dominant GPU: 0.1
				{"cpu-heavy", "p", Usage{CPUMilli: 30_000}},                   // dominant CPU: 0.3
			},
			items: []Item{
				{Key: "cpu-heavy-1", Tenant: "cpu-heavy", Seq: 1},
				{Key: "gpu-heavy-1", Tenant: "gpu-heavy", Seq: 2},
			},
			want: []string{"gpu-heavy-1", "cpu-heavy-1"},
		},
		"memory counts; zero capacity components are ignored": {
			capacity: Usage{MilliGPU: 100 * gpu, MemoryMiB: 1000},
			holds: []hold{
				{"mem-heavy", "p", Usage{MemoryMiB: 500, CPUMilli: 1 << 40}}, // CPU capacity 0: ignored
				{"gpu-light", "p", Usage{MilliGPU: 10 * gpu}},
			},
			items: []Item{
				{Key: "m", Tenant: "mem-heavy", Seq: 1},
				{Key: "g", Tenant: "gpu-light", Seq: 2},
			},
			want: []string{"g", "m"},
		},
		"FIFO by Seq within a tenant, Key breaks ties": {
			capacity: Usage{MilliGPU: 10 * gpu},
			items: []Item{
				{Key: "j4", Tenant: "a", Seq: 4}, {Key: "j2b", Tenant: "a", Seq: 2},
				{Key: "j1", Tenant: "a", Seq: 1}, {Key: "j2a", Tenant: "a", Seq: 2},
			},
			want: []string{"j1", "j2a", "j2b", "j4"},
		},
		"equal shares go to the first tenant by name": {
			capacity: Usage{},
			items: []Item{
				{Key: "z1", Tenant: "z", Seq: 1}, {Key: "m1", Tenant: "m", Seq: 2}, {Key: "a1", Tenant: "a", Seq: 3},
			},
			// Capacity zero: every share is 0, so the name decides every time.
			want: []string{"a1", "m1", "z1"},
		},
		"usage placed in a higher class counts in lower ones": {
			capacity: Usage{MilliGPU: 10 * gpu},
			items: []Item{
				{Key: "a-crit", Tenant: "a", Priority: crit, Seq: 1, Usage: Usage{MilliGPU: 4 * gpu}},
				{Key: "a-norm", Tenant: "a", Priority: norm, Seq: 2},
				{Key: "b-norm", Tenant: "b", Priority: norm, Seq: 3},
			},
			want: []string{"a-crit", "b-norm", "a-norm"},
		},
		"empty": {capacity: Usage{MilliGPU: gpu}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			b := NewBook(tc.capacity, tc.quotas)
			for _, h := range tc.holds {
				b.Hold(h.tenant, h.pool, h.u)
			}
			got := drain(b.NewRound(tc.items))
			if diff := gocmp.Diff(tc.want, got); diff != "" {
				t.Errorf("order (-want +got):\n%s", diff)
			}
		})
	}
}

func TestBlocked(t *testing.T) {
	const (
		high = contracts.PriorityHigh
		norm = contracts.PriorityNormal
	)
	one := Usage{MilliGPU: gpu}
	items := []Item{
		{Key: "s1", Tenant: "s", Priority: norm, Seq: 1, Usage: one},
		{Key: "s2", Tenant: "s", Priority: norm, Seq: 2, Usage: one},
		{Key: "s3", Tenant: "s", Priority: norm, Seq: 3, Usage: one},
		{Key: "s-high", Tenant: "s", Priority: high, Seq: 4, Usage: one},
		{Key: "t1", Tenant: "t", Priority: norm, Seq: 1, Usage: one},
		{Key: "t2", Tenant: "t", Priority: norm, Seq: 2, Usage: one},
	}
	tests := map[string]struct {
		strict      bool
		blocked     string // the item refused placement; every other is placed
		wantOrder   []string
		wantDropped []string
	}{
		"strict tenant: later jobs of the class leave the round": {
			strict:      true,
			blocked:     "s1",
			wantOrder:   []string{"s-high", "t1", "s1", "t2"},
			wantDropped: []string{"s2", "s3"},
		},
		"strict tenant blocked in the middle": {
			strict:      true,
			blocked:     "s2",
			wantOrder:   []string{"s-high", "t1", "s1", "t2", "s2"},
			wantDropped: []string{"s3"},
		},
		"strict tenant blocked at its last job drops nothing": {
			strict:    true,
			blocked:   "s3",
			wantOrder: []string{"s-high", "t1", "s1", "t2", "s2", "s3"},
		},
		"other classes of the strict tenant are not held": {
			strict:    true,
			blocked:   "s-high",
			wantOrder: []string{"s-high", "s1", "t1", "s2", "t2", "s3"},
		},
		"non-strict tenant keeps going": {
			blocked: "s1",
			// s1 refused leaves s's share as it was: s is served again.
			wantOrder: []string{"s-high", "t1", "s1", "s2", "t2", "s3"},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			quotas := map[string]contracts.TenantQuota{"s": {StrictFIFO: tc.strict}}
			b := NewBook(Usage{MilliGPU: 10 * gpu}, quotas)
			r := b.NewRound(slices.Clone(items))
			var order, dropped []string
			for it, ok := r.Next(); ok; it, ok = r.Next() {
				order = append(order, it.Key)
				if it.Key != tc.blocked {
					r.Placed(it, "p")
					continue
				}
				for _, d := range r.Blocked(it) {
					dropped = append(dropped, d.Key)
				}
			}
			if diff := gocmp.Diff(tc.wantOrder, order); diff != "" {
				t.Errorf("order (-want +got):\n%s", diff)
			}
			if diff := gocmp.Diff(tc.wantDropped, dropped); diff != "" {
				t.Errorf("dropped (-want +got):\n%s", diff)
			}
		})
	}
	if got, want := StrictFIFOMessage(Item{Key: "s1", Tenant: "s"}), "tenant s's queue is strict FIFO; waiting behind job s1"; got != want {
		t.Errorf("StrictFIFOMessage = %q, want %q", got, want)
	}
}

func TestAdmit(t *testing.T) {
	quotas := map[string]contracts.TenantQuota{
		"research": {Pools: map[string]contracts.PoolQuota{
			"h100":                  {Guarantee: 8, Max: ptr(16)},
			contracts.QuotaAllPools: {Guarantee: 1, Max: ptr(2.5)},
		}},
		"guaranteed": {Pools: map[string]contracts.PoolQuota{"h100": {Guarantee: 4}}}, // no max
	}
	tests := map[string]struct {
		holds  []hold
		tenant string
		pool   string
		milli  int64
		want   Verdict
	}{
		"within guarantee": {
			holds:  []hold{{"research", "h100", Usage{MilliGPU: 4 * gpu}}},
			tenant: "research", pool: "h100", milli: 4 * gpu,
			want: Verdict{OK: true},
		},
		"beyond guarantee is borrowing": {
			holds:  []hold{{"research", "h100", Usage{MilliGPU: 8 * gpu}}},
			tenant: "research", pool: "h100", milli: 1,
			want: Verdict{OK: true, Borrowing: true},
		},
		"exactly at max": {
			holds:  []hold{{"research", "h100", Usage{MilliGPU: 12 * gpu}}},
			tenant: "research", pool: "h100", milli: 4 * gpu,
			want: Verdict{OK: true, Borrowing: true},
		},
		"past max": {
			holds:  []hold{{"research", "h100", Usage{MilliGPU: 16 * gpu}}},
			tenant: "research", pool: "h100", milli: gpu,
			want: Verdict{Code: contracts.PendingQuotaExceeded, Message: "quota research/h100 at 16 of 16 GPUs (job needs 1)"},
		},
		"other pools' usage does not count": {
			holds:  []hold{{"research", "a100", Usage{MilliGPU: 2 * gpu}}},
			tenant: "research", pool: "h100", milli: 16 * gpu,
			want: Verdict{OK: true, Borrowing: true},
		},
		"'*' applies to a pool without its own entry": {
			holds:  []hold{{"research", "a100", Usage{MilliGPU: 2 * gpu}}},
			tenant: "research", pool: "a100", milli: 600,
			want: Verdict{Code: contracts.PendingQuotaExceeded, Message: "quota research/a100 at 2 of 2.5 GPUs (job needs 0.6)"},
		},
		"'*' applies to each pool separately": {
			holds:  []hold{{"research", "a100", Usage{MilliGPU: 2 * gpu}}},
			tenant: "research", pool: "l4", milli: 2500,
			want: Verdict{OK: true, Borrowing: true},
		},
		"a share within the '*' guarantee": {
			tenant: "research", pool: "l4", milli: 500,
			want: Verdict{OK: true},
		},
		"no max: only borrowing": {
			holds:  []hold{{"guaranteed", "h100", Usage{MilliGPU: 100 * gpu}}},
			tenant: "guaranteed", pool: "h100", milli: gpu,
			want: Verdict{OK: true, Borrowing: true},
		},
		"no quota in the pool: no max, all borrowed": {
			tenant: "guaranteed", pool: "a100", milli: gpu,
			want: Verdict{OK: true, Borrowing: true},
		},
		"no quota at all: no max, all borrowed": {
			holds:  []hold{{"nobody", "h100", Usage{MilliGPU: 1000 * gpu}}},
			tenant: "nobody", pool: "h100", milli: gpu,
			want: Verdict{OK: true, Borrowing: true},
		},
		"nothing asked, nothing held: not borrowing": {
			tenant: "nobody", pool: "h100",
			want: Verdict{OK: true},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			b := NewBook(Usage{MilliGPU: 1000 * gpu}, quotas)
			for _, h := range tc.holds {
				b.Hold(h.tenant, h.pool, h.u)
			}
			if diff := gocmp.Diff(tc.want, b.Admit(tc.tenant, tc.pool, tc.milli)); diff != "" {
				t.Errorf("Admit (-want +got):\n%s", diff)
			}
		})
	}
}

func TestGuaranteeAndBorrowing(t *testing.T) {
	quotas := map[string]contracts.TenantQuota{
		"g": {Pools: map[string]contracts.PoolQuota{"h100": {Guarantee: 4, Max: ptr(8)}, contracts.QuotaAllPools: {Guarantee: 0.5}}},
	}
	type query struct {
		tenant, pool string
		milli        int64
	}
	tests := map[string]struct {
		held           int64 // by the tenant in the pool
		q              query
		wantUnder      bool
		wantBorrowing  bool // Borrowing(tenant, pool) before the request
		wantAdmitBorrw bool // Admit(...).Borrowing
	}{
		"empty, asking the guarantee":      {0, query{"g", "h100", 4 * gpu}, true, false, false},
		"empty, asking past the guarantee": {0, query{"g", "h100", 5 * gpu}, false, false, true},
		"at the guarantee":                 {4 * gpu, query{"g", "h100", 1}, false, false, true},
		"borrowing":                        {5 * gpu, query{"g", "h100", gpu}, false, true, true},
		"'*' guarantee of half a GPU":      {0, query{"g", "l4", 500}, true, false, false},
		"'*' guarantee exceeded":           {300, query{"g", "l4", 300}, false, false, true},
		"no quota: never under guarantee":  {0, query{"x", "h100", 1}, false, false, true},
		"no quota, holding: borrowing":     {1, query{"x", "h100", 1}, false, true, true},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			b := NewBook(Usage{MilliGPU: 100 * gpu}, quotas)
			b.Hold(tc.q.tenant, tc.q.pool, Usage{MilliGPU: tc.held})
			if got := b.UnderGuarantee(tc.q.tenant, tc.q.pool, tc.q.milli); got != tc.wantUnder {
				t.Errorf("UnderGuarantee = %v, want %v", got, tc.wantUnder)
			}
			if got := b.Borrowing(tc.q.tenant, tc.q.pool); got != tc.wantBorrowing {
				t.Errorf("Borrowing = %v, want %v", got, tc.wantBorrowing)
			}
			if got := b.Admit(tc.q.tenant, tc.q.pool, tc.q.milli).Borrowing; got != tc.wantAdmitBorrw {
				t.Errorf("Admit.Borrowing = %v, want %v", got, tc.wantAdmitBorrw)
			}
		})
	}
	// Guarantee is what preemption keeps of a tenant: the pool's own
	// entry, else '*', else none.
	b := NewBook(Usage{MilliGPU: 100 * gpu}, quotas)
	for _, tc := range []struct {
		tenant, pool string
		want         int64
	}{{"g", "h100", 4 * gpu}, {"g", "l4", 500}, {"x", "h100", 0}} {
		if got := b.Guarantee(tc.tenant, tc.pool); got != tc.want {
			t.Errorf("Guarantee(%s, %s) = %d, want %d", tc.tenant, tc.pool, got, tc.want)
		}
	}
}

func TestHoldReleasesNeverBelowZero(t *testing.T) {
	b := NewBook(Usage{MilliGPU: 10 * gpu, CPUMilli: 1000}, nil)
	b.Hold("a", "p", Usage{MilliGPU: 2 * gpu, CPUMilli: 100})
	b.Hold("a", "p", Usage{MilliGPU: -5 * gpu, CPUMilli: -50})
	if got := b.Held("a", "p"); got != 0 {
		t.Errorf("Held = %d, want 0", got)
	}
	if diff := gocmp.Diff(Usage{CPUMilli: 50}, b.Usage("a")); diff != "" {
		t.Errorf("Usage (-want +got):\n%s", diff)
	}
	if got := b.Share("a"); got != 0.05 {
		t.Errorf("Share = %v, want 0.05", got)
	}
}

func TestGPUs(t *testing.T) {
	for milli, want := range map[int64]string{0: "0", 16000: "16", 2500: "2.5", 142: "0.142", 1: "0.001"} {
		if got := GPUs(milli); got != want {
			t.Errorf("GPUs(%d) = %q, want %q", milli, got, want)
		}
	}
}

// TestRandomRounds simulates cycles the way the scheduler runs them (quota,
// then capacity, then place or block) with random quotas, jobs and job ends.
// It checks against a brute-force reference that every item comes out in
// order (class, then least weighted dominant share, then FIFO), that each
// item is handed out or dropped exactly once, and that no tenant ever holds
// more than its Max in a pool.
func TestRandomRounds(t *testing.T) {
	var total stats
	for seed := range uint64(40) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			s := randomRounds(t, seed)
			total.placed += s.placed
			total.quota += s.quota
			total.dropped += s.dropped
		})
	}
	// The simulation must exercise what it checks.
	if total.placed < 1000 || total.quota < 100 || total.dropped < 10 {
		t.Errorf("simulation too tame: %+v", total)
	}
}

type stats struct{ placed, quota, dropped int }

type running struct {
	tenant, pool string
	u            Usage
	ends         int // round
}

func randomRounds(t *testing.T, seed uint64) (st stats) {
	rng := rand.New(rand.NewPCG(seed, 7))
	pools := []string{"h100", "a100", "l4"}
	poolGPUs := map[string]int64{"h100": 32 * gpu, "a100": 16 * gpu, "l4": 8 * gpu}
	capacity := Usage{MilliGPU: 56 * gpu, CPUMilli: 400_000, MemoryMiB: 4 << 20}
	tenants := []string{"t0", "t1", "t2", "t3", "t4", "t5", "t6"}
	quotas := map[string]contracts.TenantQuota{}
	for _, tn := range tenants[:6] { // t6 has no quota at all
		q := contracts.TenantQuota{Weight: float64(rng.IntN(4)), StrictFIFO: rng.IntN(3) == 0, Pools: map[string]contracts.PoolQuota{}}
		for _, p := range append(slices.Clone(pools), contracts.QuotaAllPools) {
			if rng.IntN(2) == 0 {
				continue
			}
			g := float64(rng.IntN(8)) / 2
			pq := contracts.PoolQuota{Guarantee: g}
			if rng.IntN(3) > 0 {
				pq.Max = ptr(g + float64(rng.IntN(12))/2)
			}
			q.Pools[p] = pq
		}
		quotas[tn] = q
	}
	var run []running
	var queued []Item
	seq := uint64(0)
	for round := range 60 {
		// Jobs end; new ones arrive.
		run = slices.DeleteFunc(run, func(r running) bool { return r.ends <= round })
		for range rng.IntN(30) {
			seq++
			tn := tenants[rng.IntN(len(tenants))]
			u := Usage{MilliGPU: int64(rng.IntN(4)+1) * gpu, CPUMilli: int64(rng.IntN(64)) * 1000, MemoryMiB: int64(rng.IntN(1 << 18))}
			if rng.IntN(4) == 0 {
				u.MilliGPU = int64(rng.IntN(99)+1) * 10 // a share
			}
			queued = append(queued, Item{
				Key: fmt.Sprintf("j%d", seq), Tenant: tn, Seq: seq, Usage: u,
				Priority: contracts.Priorities[rng.IntN(len(contracts.Priorities))],
			})
		}
		b := NewBook(capacity, quotas)
		free := maps.Clone(poolGPUs)
		for _, r := range run {
			b.Hold(r.tenant, r.pool, r.u)
			free[r.pool] -= r.u.MilliGPU
		}
		rng.Shuffle(len(queued), func(i, j int) { queued[i], queued[j] = queued[j], queued[i] })
		remaining := map[string]Item{}
		for _, it := range queued {
			remaining[it.Key] = it
		}
		r := b.NewRound(queued)
		var still []Item
		for it, ok := r.Next(); ok; it, ok = r.Next() {
			checkNext(t, b, remaining, it)
			delete(remaining, it.Key)
			placed := false
			for _, p := range pools {
				v := b.Admit(it.Tenant, p, it.Usage.MilliGPU)
				if !v.OK {
					st.quota++
				}
				if !v.OK || free[p] < it.Usage.MilliGPU {
					continue
				}
				st.placed++
				r.Placed(it, p)
				free[p] -= it.Usage.MilliGPU
				run = append(run, running{it.Tenant, p, it.Usage, round + 1 + rng.IntN(5)})
				placed = true
				break
			}
			if placed {
				continue
			}
			still = append(still, it)
			dropped := r.Blocked(it)
			if len(dropped) > 0 && !quotas[it.Tenant].StrictFIFO {
				t.Fatalf("round %d: Blocked(%s) of a non-strict tenant dropped %d", round, it.Key, len(dropped))
			}
			for _, d := range dropped {
				if d.Tenant != it.Tenant || d.Priority.Rank() != it.Priority.Rank() || d.Seq < it.Seq {
					t.Fatalf("round %d: Blocked(%+v) dropped %+v", round, it, d)
				}
				if _, ok := remaining[d.Key]; !ok {
					t.Fatalf("round %d: dropped %s was already handed out", round, d.Key)
				}
				delete(remaining, d.Key)
				still = append(still, d)
				st.dropped++
			}
		}
		if len(remaining) > 0 {
			t.Fatalf("round %d: %d items never handed out nor dropped", round, len(remaining))
		}
		queued = still
		// The quota invariant, recomputed from the running jobs alone.
		type poolKey struct{ tenant, pool string }
		held := map[poolKey]int64{}
		for _, r := range run {
			held[poolKey{r.tenant, r.pool}] += r.u.MilliGPU
		}
		for k, h := range held {
			if pq, ok := quotas[k.tenant].For(k.pool); ok && pq.Max != nil && float64(h) > *pq.Max*1000+1e-9 {
				t.Fatalf("round %d: %s holds %s GPUs in %s, max %g", round, k.tenant, GPUs(h), k.pool, *pq.Max)
			}
		}
		for p, f := range free {
			if f < 0 {
				t.Fatalf("round %d: pool %s overcommitted by %d", round, p, -f)
			}
		}
	}
	return st
}

// checkNext is the reference order: got must be the first remaining item of
// the highest class, of the tenant of least (share, name) in that class.
func checkNext(t *testing.T, b *Book, remaining map[string]Item, got Item) {
	t.Helper()
	var want Item
	found := false
	for _, it := range remaining {
		if !found || refBefore(b, it, want) {
			want, found = it, true
		}
	}
	if !found || want.Key != got.Key {
		t.Fatalf("Next = %s (tenant %s share %v), reference order wants %s (tenant %s share %v)",
			got.Key, got.Tenant, b.Share(got.Tenant), want.Key, want.Tenant, b.Share(want.Tenant))
	}
}

func refBefore(b *Book, x, y Item) bool {
	if c := cmp.Compare(y.Priority.Rank(), x.Priority.Rank()); c != 0 {
		return c < 0
	}
	if x.Tenant != y.Tenant {
		if c := cmp.Compare(b.Share(x.Tenant), b.Share(y.Tenant)); c != 0 {
			return c < 0
		}
		return x.Tenant < y.Tenant
	}
	if x.Seq != y.Seq {
		return x.Seq < y.Seq
	}
	return x.Key < y.Key
}

// BenchmarkRound orders a queue of items over tenants and places every item,
// so every Next re-ranks a tenant: the worst case of a cycle.
func BenchmarkRound(b *testing.B) {
	for _, size := range []struct{ items, tenants int }{{10_000, 100}, {100_000, 1_000}} {
		b.Run(fmt.Sprintf("items=%d/tenants=%d", size.items, size.tenants), func(b *testing.B) {
			rng := rand.New(rand.NewPCG(1, 2))
			items := make([]Item, size.items)
			quotas := map[string]contracts.TenantQuota{}
			for i := range size.tenants {
				quotas[fmt.Sprintf("tenant-%04d", i)] = contracts.TenantQuota{Weight: float64(1 + i%3)}
			}
			for i := range items {
				items[i] = Item{
					Key:      fmt.Sprintf("job-%06d", i),
					Tenant:   fmt.Sprintf("tenant-%04d", rng.IntN(size.tenants)),
					Priority: contracts.Priorities[rng.IntN(len(contracts.Priorities))],
					Seq:      uint64(rng.IntN(size.items)),
					Usage:    Usage{MilliGPU: int64(rng.IntN(8)+1) * gpu, CPUMilli: int64(rng.IntN(64)) * 1000},
				}
			}
			capacity := Usage{MilliGPU: int64(size.items) * 8 * gpu, CPUMilli: int64(size.items) * 64_000}
			b.ReportAllocs()
			b.ResetTimer()
			handed, rounds := 0, 0
			for b.Loop() {
				rounds++
				book := NewBook(capacity, quotas)
				r := book.NewRound(items)
				for it, ok := r.Next(); ok; it, ok = r.Next() {
					if book.Admit(it.Tenant, "p", it.Usage.MilliGPU).OK {
						r.Placed(it, "p")
					}
					handed++
				}
			}
			if handed != rounds*size.items {
				b.Fatalf("handed out %d items over %d rounds, want %d each", handed, rounds, size.items)
			}
			b.ReportMetric(float64(handed)/b.Elapsed().Seconds(), "items/s")
		})
	}
}

// TestGroupedItemsRoundAsAnyOrder: items grouped by class and tenant (the
// scheduler's queue hands them over so; NewRound then uses each run in
// place) go round in the order the same items shuffled do, whatever the
// order inside a run.
func TestGroupedItemsRoundAsAnyOrder(t *testing.T) {
	for seed := range uint64(30) {
		rng := rand.New(rand.NewPCG(seed, 11))
		quotas := map[string]contracts.TenantQuota{}
		tenants := []string{"a", "b", "c", "d"}
		for _, tn := range tenants {
			quotas[tn] = contracts.TenantQuota{Weight: float64(rng.IntN(3) + 1)}
		}
		var items []Item
		for i := range 40 + rng.IntN(40) {
			items = append(items, Item{Key: fmt.Sprintf("j%02d", i), Tenant: tenants[rng.IntN(len(tenants))],
				Seq: uint64(rng.IntN(30)), Usage: Usage{MilliGPU: int64(rng.IntN(3)+1) * gpu},
				Priority: contracts.Priorities[rng.IntN(len(contracts.Priorities))]})
		}
		shuffled := slices.Clone(items)
		rng.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
		grouped := slices.Clone(shuffled)
		// Grouped by class and tenant, each run in the shuffled order.
		slices.SortStableFunc(grouped, func(x, y Item) int {
			if c := x.Priority.Rank() - y.Priority.Rank(); c != 0 {
				return c
			}
			return cmp.Compare(x.Tenant, y.Tenant)
		})
		walk := func(in []Item) []string {
			b := NewBook(Usage{MilliGPU: 64 * gpu, CPUMilli: 1 << 20, MemoryMiB: 1 << 30}, quotas)
			r := b.NewRound(in)
			var keys []string
			for it, ok := r.Next(); ok; it, ok = r.Next() {
				keys = append(keys, it.Key)
				if len(keys)%3 == 0 {
					r.Placed(it, "p")
				}
			}
			return keys
		}
		want, got := walk(shuffled), walk(grouped)
		if len(want) != len(items) || !slices.Equal(got, want) {
			t.Fatalf("seed %d: grouped items went round as %v, shuffled as %v", seed, got, want)
		}
	}
}
