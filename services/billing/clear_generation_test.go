package billing_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/billing"
)

// TestBilledNeverUnbilledWithinAGeneration (third review, HIGH): two
// billing replicas share one Redis. It restarts; replica A notices first,
// Opens G2 and rebuilds; A's biller forgets in G2. Replica B notices the
// restart only at its next Apply, and its Open clears the keys with SCAN
// and UNLINK in batches. The gen key went in any batch, so between the
// batch that unlinked "billed" and the one that unlinked "gen", A's
// Billed answered (G2, not billed) for an allocation it had answered (G2,
// billed): biller.find then billed a forgotten allocation as new. The
// clear now unlinks the generation first.
func TestBilledNeverUnbilledWithinAGeneration(t *testing.T) {
	ctx := context.Background()
	r := startRedis(t, false)
	a := newRedisStore(t, r, billing.RedisConfig{})
	b := newRedisStore(t, r, billing.RedisConfig{})
	if _, err := a.Open(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Open(ctx); err != nil {
		t.Fatal(err)
	}
	x := rec("acme", "forgotten", 1, 0, 1000, 5)
	key := billing.KeyOfAllocation(x.AllocationID)
	for trial := range 4 {
		r.kill()
		r.start()
		var err error
		for range 3 {
			if _, err = a.Apply(ctx, []contracts.UsageRecord{x}); errors.Is(err, billing.ErrGenerationChanged) {
				break
			}
		}
		if !errors.Is(err, billing.ErrGenerationChanged) {
			t.Fatalf("A's Apply after the restart: %v", err)
		}
		gen2, err := a.Open(ctx)
		if err != nil {
			t.Fatal(err)
		}
		recs := []contracts.UsageRecord{x}
		for j := range 20000 {
			recs = append(recs, rec("acme", fmt.Sprintf("j%d", j), 1, 0, 1000, 5))
		}
		for i := 0; i < len(recs); i += 1000 {
			if _, err := a.Apply(ctx, recs[i:min(i+1000, len(recs))]); err != nil {
				t.Fatal(err)
			}
		}
		if g, billed, err := a.Billed(ctx, []billing.AllocationKey{key}); err != nil || g != gen2 || !billed[0] {
			t.Fatalf("A's Billed(X) in G2: %q %v %v", g, billed, err)
		}
		for range 3 {
			if _, err = b.Apply(ctx, []contracts.UsageRecord{rec("acme", "late", 1, 0, 1000, 5)}); errors.Is(err, billing.ErrGenerationChanged) {
				break
			}
		}
		if !errors.Is(err, billing.ErrGenerationChanged) {
			t.Fatalf("B's Apply after the restart: %v", err)
		}
		var stop atomic.Bool
		var wrong atomic.Int64
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { // A's biller asks about X (a redelivered release)
			defer wg.Done()
			for !stop.Load() {
				g, billed, err := a.Billed(ctx, []billing.AllocationKey{key})
				if err == nil && g == gen2 && !billed[0] {
					wrong.Add(1)
				}
			}
		}()
		gen3, err := b.Open(ctx)
		stop.Store(true)
		wg.Wait()
		if err != nil {
			t.Fatal(err)
		}
		if n := wrong.Load(); n > 0 {
			t.Fatalf("trial %d: while B's Open cleared the keys (then opened %q), A's Billed answered %d times that X is "+
				"not billed in generation %q, where it had answered billed: the biller bills a forgotten allocation again",
				trial, gen3, n, gen2)
		}
	}
}
