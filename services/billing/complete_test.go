package billing_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/billing"
	"github.com/gpuplane/gpuplane/services/billing/internal/projector"
)

// gatedStore is a real store whose Apply waits until gate is closed: the
// feed has records delivered and not yet acknowledged meanwhile.
type gatedStore struct {
	billing.Store
	gate chan struct{}
}

func (g gatedStore) Apply(ctx context.Context, recs []contracts.UsageRecord) (int, error) {
	select {
	case <-g.gate:
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	return g.Store.Apply(ctx, recs)
}

// usageFeed publishes n usage records of acme to USAGE (10 GPU-seconds
// and 7 micro-units each) on a connection with billing's identity, and
// returns it.
func usageFeed(t *testing.T, n int) *bus.Bus {
	t.Helper()
	srv := natstest.Start(t)
	b := connect(t, srv)
	for i := range n {
		r := rec("acme", fmt.Sprintf("feed-%02d", i), 1, 0, 10_000, 7)
		if _, err := b.Publish(context.Background(), contracts.SubjectUsage(r.Tenant), r.ID, r); err != nil {
			t.Fatal(err)
		}
	}
	return b
}

// runFeed runs a projector of store on b, probing every 20 ms, until
// stop or the test's end.
func runFeed(t *testing.T, b *bus.Bus, store projector.Store) (p *projector.Projector, stop func()) {
	t.Helper()
	p = projector.New(projector.Config{Bus: b, Store: store, Log: quietLog(), Unavailable: billing.ErrStoreUnavailable,
		Changed: billing.ErrGenerationChanged, ProbeInterval: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Error(err)
			}
		})
	}
	t.Cleanup(stop)
	return p, stop
}

// TestAFeedMarksItsStoreCompleteOnlyOnceItsReplayIsAcknowledged: records
// are delivered to the feed but their Apply has not returned (nothing is
// acknowledged): the store is not complete, whatever was delivered, until
// the acknowledgements reach USAGE's last record.
func TestAFeedMarksItsStoreCompleteOnlyOnceItsReplayIsAcknowledged(t *testing.T) {
	ctx := context.Background()
	b := usageFeed(t, 10)
	mem := billing.NewMemoryStore()
	gate := make(chan struct{})
	p, _ := runFeed(t, b, gatedStore{Store: mem, gate: gate})
	gen, _ := mem.Generation(ctx)
	waitFor(t, "the records to be delivered", func() (bool, string) {
		c, err := b.JetStream().Consumer(ctx, contracts.StreamUsage, projector.ConsumerPrefix+gen)
		if err != nil {
			return false, err.Error()
		}
		info := c.CachedInfo()
		return info.NumAckPending > 0 && info.NumPending == 0, fmt.Sprintf("%d pending, %d unacknowledged", info.NumPending, info.NumAckPending)
	})
	time.Sleep(200 * time.Millisecond) // ten probes
	if tot, err := mem.CompleteTenantDay(ctx, "acme", day1); !errors.Is(err, billing.ErrIncomplete) || p.CaughtUp() {
		t.Errorf("with every record delivered and none acknowledged: %+v, %v, caught up %v; want ErrIncomplete", tot, err, p.CaughtUp())
	}
	close(gate)
	waitFor(t, "the store to be complete", func() (bool, string) {
		tot, err := mem.CompleteTenantDay(ctx, "acme", day1)
		return err == nil && tot.Records == 10, fmt.Sprintf("%+v, %v", tot, err)
	})
}

// TestAFeedMarksAGenerationAdoptedWholeComplete: a Redis generation was
// filled (and its consumer acknowledged all of USAGE) by a billing that
// left no mark (a version before marks). A feed that opens it adopts it
// and is delivered nothing: it marks it complete all the same.
func TestAFeedMarksAGenerationAdoptedWholeComplete(t *testing.T) {
	ctx := context.Background()
	b := usageFeed(t, 10)
	r := startRedis(t, false)
	first := newRedisStore(t, r, billing.RedisConfig{})
	gen, err := first.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, stop := runFeed(t, b, first)
	complete := func(s *billing.RedisStore) (bool, string) {
		tot, err := s.CompleteTenantDay(ctx, "acme", day1)
		return err == nil && tot.Records == 10, fmt.Sprintf("%+v, %v", tot, err)
	}
	waitFor(t, "the first feed to fill the store", func() (bool, string) { return complete(first) })
	stop()
	// As a billing before marks left it: filled, acknowledged, unmarked.
	if err := r.client().Del(ctx, "{gp-billing}:complete").Err(); err != nil {
		t.Fatal(err)
	}
	second := newRedisStore(t, r, billing.RedisConfig{})
	if _, err := second.Open(ctx); err != nil {
		t.Fatal(err)
	}
	if ok, got := complete(second); ok {
		t.Fatalf("the store reads complete with its mark deleted: %s", got)
	}
	p, _ := runFeed(t, b, second)
	waitFor(t, "the adopted generation to be marked complete", func() (bool, string) { return complete(second) })
	if g, err := second.Generation(ctx); err != nil || g != gen {
		t.Errorf("the feed's generation is %q, %v; want the adopted %q", g, err, gen)
	}
	if p.Applied() != 0 {
		t.Errorf("the feed of the adopted generation applied %d records, want none (all were acknowledged)", p.Applied())
	}
}

// TestNoCompleteReadOrMarkOnARestartedServer: the server restarts from
// its files (which may lack the last writes) while a generation is being
// filled. The store that filled it must not mark it complete, nor leave
// a mark behind when it fails to; and a store not yet opened (a billing
// just started, whose budget watcher runs beside its first Open) must not
// take the old content as complete, though gen and complete came back
// (from a review: it did, while Open would start over).
func TestNoCompleteReadOrMarkOnARestartedServer(t *testing.T) {
	ctx := context.Background()
	for _, marked := range []bool{false, true} {
		t.Run(fmt.Sprintf("marked before the restart %v", marked), func(t *testing.T) {
			r := startRedis(t, true)
			x := newRedisStore(t, r, billing.RedisConfig{})
			gen := openWith(t, x, rec("acme", "j1", 1, 0, 1000, 5))
			if marked {
				if err := x.MarkComplete(ctx, gen); err != nil {
					t.Fatal(err)
				}
			}
			r.lose("restarted")
			err2 := afterRestart(func() error { return x.MarkComplete(ctx, gen) })
			if !errors.Is(err2, billing.ErrGenerationChanged) {
				t.Errorf("MarkComplete after the restart: %v, want ErrGenerationChanged", err2)
			}
			if v, err := r.client().Get(ctx, "{gp-billing}:complete").Result(); !marked && err == nil {
				t.Errorf("a refused MarkComplete left the mark %q", v)
			}
			z := newRedisStore(t, r, billing.RedisConfig{})
			for name, s := range map[string]*billing.RedisStore{"the store that filled it": x, "a store not yet opened": z} {
				if tot, err := s.CompleteTenantDay(ctx, "acme", day1); !errors.Is(err, billing.ErrIncomplete) {
					t.Errorf("%s reads the restarted server's content as complete: %+v, %v", name, tot, err)
				}
			}
		})
	}
}
