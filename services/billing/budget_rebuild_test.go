package billing_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/billing"
)

// TestBudgetStatusHoldsWhileTheStoreIsRebuilt: two billing replicas share
// one Redis, and a tenant is over its budget. Redis loses its content
// (flushed, as a restart without persistence would). No replica may judge
// the budget on the emptied store, nor on the store while it is refilled
// from USAGE: the spend would read low and the status would let the
// tenant spend again. Every status published from the loss on says
// exceeded, and once the store is rebuilt (the replicas notice the loss
// on their own, with no new usage) the spend is whole again, with the
// usage that came meanwhile.
func TestBudgetStatusHoldsWhileTheStoreIsRebuilt(t *testing.T) {
	srv, b, statuses, budgets := budgetBus(t)
	ctx := context.Background()
	r := startRedis(t, false)
	putBudget(t, budgets, "acme", 1_000_000, contracts.PolicyReject)
	clock := func(c *billing.Config) { c.Now = func() time.Time { return t0.Add(time.Hour) } }
	start(t, srv, newRedisStore(t, r, billing.RedisConfig{}), clock)
	start(t, srv, newRedisStore(t, r, billing.RedisConfig{}), clock)
	spend := func(job string, secs int) {
		a := alloc("acme", job, 1, "n1", 1)
		publishLedger(t, b, "", committed(a), released(a, time.Duration(secs)*time.Second))
	}
	spend("a", 60)
	spend("b", 45) // 1.05 of 1.00
	waitStatus(t, statuses, "acme", func(s contracts.BudgetStatus) bool { return s.SpentMicros == 1_050_000 && s.Exceeded })

	// Every status from here on.
	w, err := statuses.Watch(ctx, "acme", jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = w.Stop() }()
	var mu sync.Mutex
	var seen []contracts.BudgetStatus
	go func() {
		for e := range w.Updates() {
			if e == nil || e.Operation() != jetstream.KeyValuePut {
				continue
			}
			var st contracts.BudgetStatus
			if json.Unmarshal(e.Value(), &st) == nil {
				mu.Lock()
				seen = append(seen, st)
				mu.Unlock()
			}
		}
	}()

	r.lose("flushed")
	// The replicas notice the loss with no usage flowing, and rebuild:
	// the store holds the spend again.
	probe := newRedisStore(t, r, billing.RedisConfig{})
	waitFor(t, "the store to be rebuilt without new usage", func() (bool, string) {
		tot, err := probe.Tenant(ctx, "acme")
		return err == nil && tot.CostMicros == 1_050_000, "not yet"
	})
	// Budgets are evaluated every 100 ms: a few evaluations of the
	// rebuilt store, then usage that comes later counts too.
	time.Sleep(500 * time.Millisecond)
	spend("c", 1)
	waitStatus(t, statuses, "acme", func(s contracts.BudgetStatus) bool { return s.SpentMicros == 1_060_000 && s.Exceeded })
	mu.Lock()
	defer mu.Unlock()
	for _, st := range seen {
		if !st.Exceeded || st.SpentMicros < 1_050_000 {
			t.Errorf("a status judged on a store being rebuilt: spent %d, exceeded %v", st.SpentMicros, st.Exceeded)
		}
	}
}

// TestBudgetsAreJudgedOnAStoreAdoptedWhole: billing restarts on a Redis
// that kept its generation, and no usage comes. Its feed delivers nothing
// (every record was acknowledged before), yet the store holds all of
// USAGE: budgets are judged at once (here, a new limit).
func TestBudgetsAreJudgedOnAStoreAdoptedWhole(t *testing.T) {
	srv, b, statuses, budgets := budgetBus(t)
	r := startRedis(t, false)
	putBudget(t, budgets, "acme", 1_000_000, contracts.PolicyReject)
	clock := func(c *billing.Config) { c.Now = func() time.Time { return t0.Add(time.Hour) } }
	stop := start(t, srv, newRedisStore(t, r, billing.RedisConfig{}), clock)
	a := alloc("acme", "a", 1, "n1", 1)
	publishLedger(t, b, "", committed(a), released(a, 60*time.Second))
	waitStatus(t, statuses, "acme", func(s contracts.BudgetStatus) bool { return s.SpentMicros == 600_000 && !s.Exceeded })
	stop()
	putBudget(t, budgets, "acme", 500_000, contracts.PolicyReject)
	start(t, srv, newRedisStore(t, r, billing.RedisConfig{}), clock)
	waitStatus(t, statuses, "acme", func(s contracts.BudgetStatus) bool {
		return s.SpentMicros == 600_000 && s.LimitMicros == 500_000 && s.Exceeded
	})
}

// TestCompleteReadsWaitForAnotherReplicasRefill: two replicas' stores on
// one Redis. Once the content is lost (flushed, or the server restarted,
// here with all of it on disk), the replica that reads for budgets must
// not take the store as complete, neither emptied nor while the other
// refills a new generation, until the other marks it complete.
func TestCompleteReadsWaitForAnotherReplicasRefill(t *testing.T) {
	ctx := context.Background()
	for _, how := range []string{"flushed", "restarted"} {
		t.Run(how, func(t *testing.T) {
			r := startRedis(t, true)
			x, y := newRedisStore(t, r, billing.RedisConfig{}), newRedisStore(t, r, billing.RedisConfig{})
			recs := []contracts.UsageRecord{rec("acme", "j1", 1, 0, 1000, 5), rec("acme", "j2", 1, 0, 1000, 7)}
			gen := openWith(t, x, recs...)
			if err := x.MarkComplete(ctx, gen); err != nil {
				t.Fatal(err)
			}
			if g, err := y.Open(ctx); err != nil || g != gen {
				t.Fatalf("the second replica opens %q, %v; want %q", g, err, gen)
			}
			spent := func(s *billing.RedisStore) (int64, error) {
				tot, err := s.CompleteTenantDay(ctx, "acme", day1)
				return tot.CostMicros, err
			}
			if got, err := spent(y); err != nil || got != 12 {
				t.Fatalf("the complete store reads %d, %v; want 12", got, err)
			}
			incomplete := func(when string) {
				t.Helper()
				if got, err := spent(y); !errors.Is(err, billing.ErrIncomplete) {
					t.Errorf("%s: the other replica reads %d, %v; want ErrIncomplete", when, got, err)
				}
			}
			r.lose(how)
			for range 3 { // the first call after a restart may meet the dead connection
				_, _ = spent(y)
			}
			incomplete("once the content is lost")
			// x notices, opens a new generation and refills it, a record at a time.
			err := afterRestart(func() error { _, err := x.Apply(ctx, recs[:1]); return err })
			if !errors.Is(err, billing.ErrGenerationChanged) {
				t.Fatalf("Apply after the loss: %v", err)
			}
			gen2, err := x.Open(ctx)
			if err != nil || gen2 == gen {
				t.Fatalf("Open after the loss: %q, %v", gen2, err)
			}
			if _, err := x.Apply(ctx, recs[:1]); err != nil {
				t.Fatal(err)
			}
			incomplete("while another replica refills the store")
			if _, err := x.Apply(ctx, recs[1:]); err != nil {
				t.Fatal(err)
			}
			incomplete("once refilled, before the mark")
			if err := x.MarkComplete(ctx, gen); !errors.Is(err, billing.ErrGenerationChanged) {
				t.Errorf("MarkComplete of the lost generation: %v, want ErrGenerationChanged", err)
			}
			incomplete("after a mark of the lost generation")
			if err := x.MarkComplete(ctx, gen2); err != nil {
				t.Fatal(err)
			}
			if how == "restarted" {
				// y saw the restart: its own content is suspect until it
				// opens the store again (its projector does).
				incomplete("before it opened the store again")
				if g, err := y.Open(ctx); err != nil || g != gen2 {
					t.Fatalf("y opens %q, %v; want %q", g, err, gen2)
				}
			}
			if got, err := spent(y); err != nil || got != 12 {
				t.Errorf("the refilled, complete store reads %d, %v; want 12", got, err)
			}
		})
	}
}

// budgetBus starts a NATS server with billing's inventory (node n1 in
// pool h100) and a price book of 36.00 USD a GPU-hour (0.01 a
// GPU-second), and returns the budget buckets.
func budgetBus(t *testing.T) (*natsserver.Server, *bus.Bus, jetstream.KeyValue, jetstream.KeyValue) {
	t.Helper()
	srv := natstest.Start(t)
	b := connect(t, srv)
	ctx := context.Background()
	inventory(t, b, "n1", "h100", "on-demand")
	bookKV, err := b.KeyValue(ctx, contracts.BucketPriceBook)
	if err != nil {
		t.Fatal(err)
	}
	setBook(t, bookKV, contracts.PriceBook{Versions: []contracts.PriceVersion{{ID: "v1", EffectiveFrom: t0.Add(-time.Hour),
		Currency: "USD", GPU: map[string]contracts.GPUPrices{"*": {OnDemand: 36_000_000}}}}})
	statuses, err := b.KeyValue(ctx, contracts.BucketBudgetStatus)
	if err != nil {
		t.Fatal(err)
	}
	budgets, err := b.KeyValue(ctx, contracts.BucketBudgets)
	if err != nil {
		t.Fatal(err)
	}
	return srv, b, statuses, budgets
}

// putBudget sets tenant's monthly budget.
func putBudget(t *testing.T, budgets jetstream.KeyValue, tenant string, limit contracts.Money, policy contracts.BudgetPolicy) {
	t.Helper()
	data, err := json.Marshal(contracts.Budget{Period: contracts.BudgetMonthly, Limit: limit, Policy: policy})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := budgets.Put(context.Background(), tenant, data); err != nil {
		t.Fatal(err)
	}
}

// waitStatus waits until tenant's budget status satisfies want.
func waitStatus(t *testing.T, statuses jetstream.KeyValue, tenant string, want func(contracts.BudgetStatus) bool) contracts.BudgetStatus {
	t.Helper()
	var st contracts.BudgetStatus
	waitFor(t, "the budget status of "+tenant, func() (bool, string) {
		e, err := statuses.Get(context.Background(), tenant)
		if err != nil {
			return false, err.Error()
		}
		st = contracts.BudgetStatus{}
		if err := json.Unmarshal(e.Value(), &st); err != nil {
			return false, err.Error()
		}
		return want(st), string(e.Value())
	})
	return st
}

// TestAStatusWithoutABudgetGoesWhileTheStoreIsRebuilt: billing starts on a
// store that is not complete (its replay of USAGE is held), with the
// statuses of two tenants, one of whose budgets was removed while billing
// was down. The removed budget's status goes at once, though the spend
// of the tenant before it in the round cannot be read (the round stopped
// there, and the status held the tenant for as long as a rebuild took);
// the other status stands, judged on nothing.
func TestAStatusWithoutABudgetGoesWhileTheStoreIsRebuilt(t *testing.T) {
	srv, b, statuses, budgets := budgetBus(t)
	ctx := context.Background()
	putBudget(t, budgets, "acme", 1_000_000, contracts.PolicyReject)
	r := rec("acme", "held", 1, 0, 10_000, 7)
	if _, err := b.Publish(ctx, contracts.SubjectUsage(r.Tenant), r.ID, r); err != nil {
		t.Fatal(err)
	}
	status := func(tenant string) []byte {
		data, err := json.Marshal(contracts.BudgetStatus{SchemaVersion: contracts.SchemaVersion, Tenant: tenant,
			Period: contracts.BudgetMonthly, LimitMicros: 1_000_000, SpentMicros: 1_200_000, Exceeded: true,
			Crossed: []int{50, 80, 100}, Alerted: []int{50, 80, 100}, Policy: contracts.PolicyReject})
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
	for _, tenant := range []string{"acme", "globex"} { // globex's budget is gone
		if _, err := statuses.Put(ctx, tenant, status(tenant)); err != nil {
			t.Fatal(err)
		}
	}
	gate := make(chan struct{}) // the store's replay is held: it is never complete
	defer close(gate)
	clock := func(c *billing.Config) { c.Now = func() time.Time { return t0.Add(time.Hour) } }
	start(t, srv, gatedStore{Store: billing.NewMemoryStore(), gate: gate}, clock)
	waitFor(t, "globex's status to go", func() (bool, string) {
		_, err := statuses.Get(ctx, "globex")
		return errors.Is(err, jetstream.ErrKeyNotFound), fmt.Sprint(err)
	})
	e, err := statuses.Get(ctx, "acme")
	if err != nil || string(e.Value()) != string(status("acme")) {
		t.Errorf("acme's status changed on an incomplete store: %v, %s", err, e.Value())
	}
}
