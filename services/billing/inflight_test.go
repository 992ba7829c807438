package billing_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/billing"
	"github.com/gpuplane/gpuplane/services/billing/internal/projector"
)

// inFlightStores are the stores the in-flight tests run against: each
// test gets a fresh, opened one.
func inFlightStores(t *testing.T) map[string]func(*testing.T) billing.Store {
	return map[string]func(*testing.T) billing.Store{
		"memory": func(*testing.T) billing.Store { return billing.NewMemoryStore() },
		"redis": func(t *testing.T) billing.Store {
			return newRedisStore(t, startRedis(t, false), billing.RedisConfig{})
		},
	}
}

// TestInFlightBatchesSharingARecordCountItOnce: the feed starts a batch
// while the one before is still applying; a record redelivered meanwhile
// is in both. Both batches succeed (every message acked) and the record
// counts once, whichever batch's script ran first.
func TestInFlightBatchesSharingARecordCountItOnce(t *testing.T) {
	ctx := context.Background()
	for name, newStore := range inFlightStores(t) {
		t.Run(name, func(t *testing.T) {
			store := newStore(t)
			if _, err := store.Open(ctx); err != nil {
				t.Fatal(err)
			}
			p := projector.New(projector.Config{Store: store, Log: quietLog(), Unavailable: billing.ErrStoreUnavailable,
				Changed: billing.ErrGenerationChanged})
			var recs []contracts.UsageRecord
			for i := range 200 {
				recs = append(recs, rec("acme", fmt.Sprintf("j%03d", i), 1, 0, 1000, 7))
			}
			shared := recs[50]
			first := msgsOf(t, recs[:100]...)
			second := msgsOf(t, append([]contracts.UsageRecord{shared}, append(recs[100:], shared)...)...)
			// Both started before either is waited for: both in flight.
			w1, w2 := p.StartBatch(ctx, first), p.StartBatch(ctx, second)
			for i, errs := range [][]error{w1(), w2()} {
				if errs != nil {
					t.Errorf("batch %d: %v; want every message acked", i+1, errs)
				}
			}
			if p.Applied() != 200 {
				t.Errorf("Applied = %d, want 200 (the shared record once)", p.Applied())
			}
			want := billing.Totals{Records: 200, GPUMillis: 200 * 1000, CostMicros: 200 * 7, OnDemandMicros: 200 * 14}
			if got, err := store.Tenant(ctx, "acme"); err != nil || got != want {
				t.Errorf("acme = %+v, %v; want %+v", got, err, want)
			}
			if got, err := store.Job(ctx, "acme", shared.JobID); err != nil || got.Records != 1 {
				t.Errorf("job of the shared record = %+v, %v; want 1 record", got, err)
			}
		})
	}
}

// TestConcurrentAppliesOfOverlappingRecords: many calls at once, each a
// shuffled window overlapping the others, as redeliveries racing the
// first delivery would make them: every record counts exactly once and
// the calls' answers add up to the records.
func TestConcurrentAppliesOfOverlappingRecords(t *testing.T) {
	ctx := context.Background()
	for name, newStore := range inFlightStores(t) {
		t.Run(name, func(t *testing.T) {
			store := newStore(t)
			if _, err := store.Open(ctx); err != nil {
				t.Fatal(err)
			}
			const calls, window, step = 8, 100, 25
			var recs []contracts.UsageRecord
			for i := range (calls-1)*step + window {
				recs = append(recs, rec(fmt.Sprintf("t%d", i%3), fmt.Sprintf("j%03d", i%40), 1, i, 10, 3))
			}
			var wg sync.WaitGroup
			applied := make([]int, calls)
			errs := make([]error, calls)
			for c := range calls {
				part := append([]contracts.UsageRecord(nil), recs[c*step:c*step+window]...)
				rand.Shuffle(len(part), func(i, j int) { part[i], part[j] = part[j], part[i] })
				wg.Go(func() { applied[c], errs[c] = store.Apply(ctx, part) })
			}
			wg.Wait()
			sum := 0
			for c := range calls {
				if errs[c] != nil {
					t.Fatalf("call %d: %v", c, errs[c])
				}
				sum += applied[c]
			}
			if sum != len(recs) {
				t.Errorf("the calls applied %d records in all, want %d", sum, len(recs))
			}
			var all billing.Totals
			for i := range 3 {
				got, err := store.Tenant(ctx, fmt.Sprintf("t%d", i))
				if err != nil {
					t.Fatal(err)
				}
				all = sumTotals(all, got)
			}
			n := int64(len(recs))
			if want := (billing.Totals{Records: n, GPUMillis: 10 * n, CostMicros: 3 * n, OnDemandMicros: 6 * n}); all != want {
				t.Errorf("tenants' totals = %+v, want %+v", all, want)
			}
		})
	}
}

// msgsOf is recs as the feed receives them from USAGE.
func msgsOf(t *testing.T, recs ...contracts.UsageRecord) []*bus.Msg {
	t.Helper()
	msgs := make([]*bus.Msg, len(recs))
	for i, r := range recs {
		data, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		msgs[i] = &bus.Msg{Subject: contracts.SubjectUsage(r.Tenant), Data: data}
	}
	return msgs
}
