package billing_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/billing"
)

// TestRedisOutageDelaysMeteringNeverLosesIt: Redis dies mid-stream; usage
// records keep being written to USAGE, the store's breaker opens and the
// records are handed back with a delay; Redis comes back and the totals
// are exact. Whether Redis kept its data (fsync always) or lost it all,
// billing rebuilds the store from USAGE after a restart of Redis.
func TestRedisOutageDelaysMeteringNeverLosesIt(t *testing.T) {
	for _, persist := range []bool{true, false} {
		t.Run(fmt.Sprintf("persist=%v", persist), func(t *testing.T) {
			srv := natstest.Start(t)
			b := connect(t, srv)
			r := startRedis(t, persist)
			inventory(t, b, "n1", "h100", "on-demand")
			ctx := context.Background()
			kv, err := b.KeyValue(ctx, contracts.BucketPriceBook)
			if err != nil {
				t.Fatal(err)
			}
			setBook(t, kv, contracts.PriceBook{Versions: []contracts.PriceVersion{{ID: "v1", EffectiveFrom: t0.Add(-time.Hour),
				Currency: "USD", GPU: map[string]contracts.GPUPrices{"*": {OnDemand: 2_345_678}}}}})
			store := newRedisStore(t, r, billing.RedisConfig{BreakerOpen: 300 * time.Millisecond, Timeout: 300 * time.Millisecond})
			start(t, srv, store)

			var want billing.Totals
			run := func(i int) {
				a := alloc("acme", fmt.Sprintf("j%03d", i), 1, "n1", 1+i%8)
				publishLedger(t, b, "", committed(a), released(a, time.Duration(1+i)*time.Second+300*time.Millisecond))
			}
			for i := range 20 {
				run(i)
			}
			recs := usage(t, b, 20)
			for _, rec := range recs {
				want = sumTotals(want, totalsOf(rec))
			}
			reader := newRedisStore(t, r, billing.RedisConfig{})
			waitTotals(t, reader, map[string]billing.Totals{"acme": want})

			r.kill()
			for i := 20; i < 50; i++ {
				run(i)
			}
			// Metering goes on without Redis.
			recs = usage(t, b, 50)
			if len(recs) != 50 {
				t.Fatalf("%d usage records with Redis down, want 50: metering must not wait for the read side", len(recs))
			}
			want = billing.Totals{}
			for _, rec := range recs {
				want = sumTotals(want, totalsOf(rec))
			}
			waitFor(t, "the breaker to open", func() (bool, string) {
				return store.BreakerState() == "open", store.BreakerState()
			})
			r.start()
			waitTotals(t, reader, map[string]billing.Totals{"acme": want, "acme/j007": totalsOf(recs[7])})
			if want.CostMicros == 0 {
				t.Fatal("nothing was priced")
			}
			if dl := deadLettersOf(t, b, contracts.StreamUsage); len(dl) != 0 {
				t.Errorf("usage records dead-lettered: %q", dl)
			}
		})
	}
}
