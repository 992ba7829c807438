package billing_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/billing"
)

func TestMemoryStore(t *testing.T) {
	testStore(t, func(*testing.T) billing.Store { return billing.NewMemoryStore() })
}

var day1 = time.Date(2026, 11, 3, 0, 0, 0, 0, time.UTC)

// rec is a segment of tenant's job, attempt, segment seg, starting on
// day1 + hour hours, on pool "p-<tenant>".
func rec(tenant, job string, attempt, seg int, gpuMillis, cost int64) contracts.UsageRecord {
	return recAt(tenant, job, attempt, seg, day1, gpuMillis, cost)
}

func recAt(tenant, job string, attempt, seg int, start time.Time, gpuMillis, cost int64) contracts.UsageRecord {
	id := contracts.AllocationID(tenant, job, attempt)
	return contracts.UsageRecord{ID: contracts.UsageSegmentID(id, seg), AllocationID: id, Tenant: tenant, JobID: job,
		Attempt: attempt, Pool: "p-" + tenant, Start: start, GPUMillis: gpuMillis,
		UsageSegment: contracts.UsageSegment{Segment: seg, CostMicros: cost, OnDemandCostMicros: 2 * cost}}
}

// testStore is the conformance test every Store implementation passes.
func testStore(t *testing.T, newStore func(*testing.T) billing.Store) {
	ctx := context.Background()
	open := func(t *testing.T) billing.Store {
		t.Helper()
		s := newStore(t)
		if _, err := s.Open(ctx); err != nil {
			t.Fatal(err)
		}
		return s
	}
	apply := func(t *testing.T, s billing.Store, recs ...contracts.UsageRecord) int {
		t.Helper()
		n, err := s.Apply(ctx, recs)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	check := func(t *testing.T, what string, got billing.Totals, err error, want billing.Totals) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if got != want {
			t.Errorf("%s = %+v, want %+v", what, got, want)
		}
	}
	tot := func(n, gms, cost int64) billing.Totals {
		return billing.Totals{Records: n, GPUMillis: gms, CostMicros: cost, OnDemandMicros: 2 * cost}
	}

	t.Run("sums by every dimension", func(t *testing.T) {
		s := open(t)
		nextDay, nextMonth := day1.AddDate(0, 0, 1).Add(5*time.Hour), day1.AddDate(0, 1, 0)
		n := apply(t, s, rec("acme", "j1", 1, 0, 1000, 10), rec("acme", "j1", 1, 1, 2000, 20),
			rec("acme", "j1", 2, 0, 250, 3), recAt("acme", "j2", 1, 0, nextDay, 7, 1),
			recAt("acme", "j2", 2, 0, nextMonth, 5, 100), rec("beta", "j1", 1, 0, 5, 2))
		if n != 6 {
			t.Errorf("Apply counted %d new records, want 6", n)
		}
		got, err := s.Tenant(ctx, "acme")
		check(t, "acme", got, err, tot(5, 3262, 134))
		got, err = s.TenantDay(ctx, "acme", day1.Add(23*time.Hour))
		check(t, "acme on day 1", got, err, tot(3, 3250, 33))
		got, err = s.TenantDay(ctx, "acme", nextDay)
		check(t, "acme on day 2", got, err, tot(1, 7, 1))
		got, err = s.TenantMonth(ctx, "acme", day1.AddDate(0, 0, 20))
		check(t, "acme in November", got, err, tot(4, 3257, 34))
		got, err = s.TenantMonth(ctx, "acme", nextMonth)
		check(t, "acme in December", got, err, tot(1, 5, 100))
		got, err = s.PoolDay(ctx, "p-acme", day1)
		check(t, "pool p-acme on day 1", got, err, tot(3, 3250, 33))
		got, err = s.Job(ctx, "acme", "j1")
		check(t, "acme/j1", got, err, tot(3, 3250, 33))
		got, err = s.Job(ctx, "beta", "j1")
		check(t, "beta/j1 (jobs of different tenants are different jobs)", got, err, tot(1, 5, 2))
	})
	t.Run("idempotent on the record ID", func(t *testing.T) {
		s := open(t)
		r := rec("acme", "j1", 1, 0, 1000, 10)
		if n := apply(t, s, r, r, r); n != 1 {
			t.Errorf("a batch holding one record three times counted %d", n)
		}
		if n := apply(t, s, r); n != 0 {
			t.Errorf("the record again counted %d", n)
		}
		got, err := s.Job(ctx, "acme", "j1")
		check(t, "acme/j1", got, err, tot(1, 1000, 10))
	})
	t.Run("unknown is zero", func(t *testing.T) {
		s := open(t)
		got, err := s.Tenant(ctx, "nobody")
		check(t, "unknown tenant", got, err, billing.Totals{})
		got, err = s.PoolDay(ctx, "none", day1)
		check(t, "unknown pool", got, err, billing.Totals{})
	})
	t.Run("a generation is stable", func(t *testing.T) {
		s := open(t)
		g1, err1 := s.Open(ctx)
		g2, err2 := s.Open(ctx)
		if err1 != nil || err2 != nil || g1 == "" || g1 != g2 {
			t.Errorf("Open twice: %q %v, %q %v", g1, err1, g2, err2)
		}
	})
	t.Run("totals for decisions only once complete", func(t *testing.T) {
		s := open(t)
		gen, err := s.Open(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if g, err := s.Generation(ctx); err != nil || g != gen {
			t.Errorf("Generation = %q, %v; want Open's %q", g, err, gen)
		}
		apply(t, s, rec("acme", "j1", 1, 0, 1000, 10))
		incomplete := func(when string) {
			t.Helper()
			if got, err := s.CompleteTenantDay(ctx, "acme", day1); !errors.Is(err, billing.ErrIncomplete) {
				t.Errorf("CompleteTenantDay %s = %+v, %v; want ErrIncomplete", when, got, err)
			}
			if got, err := s.CompleteTenantMonth(ctx, "acme", day1); !errors.Is(err, billing.ErrIncomplete) {
				t.Errorf("CompleteTenantMonth %s = %+v, %v; want ErrIncomplete", when, got, err)
			}
		}
		incomplete("before any mark")
		if err := s.MarkComplete(ctx, "another-generation"); !errors.Is(err, billing.ErrGenerationChanged) {
			t.Errorf("MarkComplete of another generation: %v, want ErrGenerationChanged", err)
		}
		incomplete("after another generation's mark")
		if err := s.MarkComplete(ctx, gen); err != nil {
			t.Fatal(err)
		}
		got, err := s.CompleteTenantDay(ctx, "acme", day1)
		check(t, "CompleteTenantDay once marked", got, err, tot(1, 1000, 10))
		got, err = s.CompleteTenantMonth(ctx, "acme", day1.AddDate(0, 0, 5))
		check(t, "CompleteTenantMonth once marked", got, err, tot(1, 1000, 10))
		got, err = s.CompleteTenantMonth(ctx, "nobody", day1)
		check(t, "CompleteTenantMonth of an unknown tenant", got, err, billing.Totals{})
	})
	t.Run("billed allocations, in the generation", func(t *testing.T) {
		s := open(t)
		gen, err := s.Open(ctx)
		if err != nil {
			t.Fatal(err)
		}
		key := func(tenant, job string, attempt int) billing.AllocationKey {
			return billing.KeyOfAllocation(contracts.AllocationID(tenant, job, attempt))
		}
		keys := []billing.AllocationKey{key("acme", "j1", 1), key("acme", "j1", 2), key("beta", "j1", 1), key("acme", "j2", 1)}
		ask := func(want ...bool) {
			t.Helper()
			g, got, err := s.Billed(ctx, keys)
			if err != nil || g != gen || fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("Billed = %q %v, %v; want %q %v", g, got, err, gen, want)
			}
		}
		ask(false, false, false, false)
		if g, got, err := s.Billed(ctx, nil); err != nil || g != gen || len(got) != 0 {
			t.Errorf("Billed of nothing (a probe) = %q %v, %v; want %q", g, got, err, gen)
		}
		// A segment other than the first, a second attempt, another
		// tenant's job of the same name: each marks its own allocation.
		apply(t, s, rec("acme", "j1", 1, 3, 1000, 10), rec("acme", "j1", 2, 0, 5, 1))
		ask(true, true, false, false)
		apply(t, s, rec("beta", "j1", 1, 0, 5, 1), rec("acme", "j1", 1, 3, 1000, 10)) // the second again
		ask(true, true, true, false)
		if r := rec("acme", "j2", 1, 0, 5, 1); true {
			r.AllocationID = "" // not an allocation's record: marks nothing
			apply(t, s, r)
		}
		ask(true, true, true, false)
	})
	t.Run("large and concurrent batches are exact", func(t *testing.T) {
		s := open(t)
		var all []contracts.UsageRecord
		for i := range 2500 { // more than one script call's worth
			all = append(all, rec("acme", fmt.Sprintf("j%d", i%40), 1, i, int64(i), int64(i%7)))
		}
		var wg sync.WaitGroup
		for w := range 4 { // overlapping batches from four writers
			wg.Go(func() {
				lo := w * 500
				if _, err := s.Apply(ctx, all[lo:lo+1000]); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
		apply(t, s, all...)
		var gms, cost int64
		for _, r := range all {
			gms += r.GPUMillis
			cost += r.CostMicros
		}
		got, err := s.Tenant(ctx, "acme")
		check(t, "acme", got, err, tot(2500, gms, cost))
	})
}
