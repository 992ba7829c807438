package lease_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/lease"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

func bucket(t *testing.T) jetstream.KeyValue {
	t.Helper()
	srv := natstest.Start(t)
	return leasesAt(t, srv, srv.URL())
}

// clock is a fake clock shared by contenders: expiry without sleeping.
type clock struct{ ns atomic.Int64 }

func (c *clock) now() time.Time          { return time.Unix(0, c.ns.Load()) }
func (c *clock) advance(d time.Duration) { c.ns.Add(int64(d)) }

// race runs TryAcquire on every elector at once and returns the winners.
func race(t *testing.T, es []*lease.Elector) map[int]lease.Term {
	t.Helper()
	var mu sync.Mutex
	won := map[int]lease.Term{}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i, e := range es {
		wg.Go(func() {
			<-start
			term, ok, err := e.TryAcquire(context.Background())
			if err != nil {
				t.Errorf("contender %d: %v", i, err)
			}
			if ok {
				mu.Lock()
				won[i] = term
				mu.Unlock()
			}
		})
	}
	close(start)
	wg.Wait()
	return won
}

func stored(t *testing.T, kv jetstream.KeyValue, key string) contracts.Lease {
	t.Helper()
	e, err := kv.Get(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	var l contracts.Lease
	if err := json.Unmarshal(e.Value(), &l); err != nil {
		t.Fatal(err)
	}
	return l
}

func TestAcquireRenewTakeoverOneWinner(t *testing.T) {
	kv := bucket(t)
	clk := &clock{}
	clk.ns.Store(time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	const ttl = time.Second
	var es []*lease.Elector
	for i := range 10 {
		e, err := lease.New(lease.Config{KV: kv, Key: "scheduler.s", Holder: fmt.Sprintf("r%d", i), TTL: ttl, Now: clk.now})
		if err != nil {
			t.Fatal(err)
		}
		es = append(es, e)
	}
	ctx := context.Background()

	// A free key: exactly one Create wins, at epoch 1.
	won := race(t, es)
	if len(won) != 1 {
		t.Fatalf("%d contenders won a free lease; want exactly 1: %v", len(won), won)
	}
	var first int
	var term1 lease.Term
	for i, tm := range won {
		first, term1 = i, tm
	}
	if term1.Epoch != 1 || !term1.Valid() {
		t.Fatalf("first term = epoch %d valid %v; want epoch 1, valid", term1.Epoch, term1.Valid())
	}

	// Renewed before expiry: nobody takes it, even past the first TTL.
	clk.advance(ttl / 2)
	if err := es[first].Renew(ctx, term1); err != nil {
		t.Fatalf("renew: %v", err)
	}
	clk.advance(ttl / 2)
	if won := race(t, es); len(won) != 0 {
		t.Fatalf("a renewed lease was taken over by %v", won)
	}
	if l := stored(t, kv, "scheduler.s"); l.Holder != fmt.Sprintf("r%d", first) || l.Epoch != 1 {
		t.Fatalf("stored lease = %+v; want holder r%d epoch 1", l, first)
	}

	// Not renewed: past its expiry, exactly one standby takes over with
	// the next epoch, and the old holder can neither act nor renew.
	clk.advance(ttl)
	if term1.Valid() {
		t.Fatal("an expired term still reports valid")
	}
	won = race(t, es)
	if len(won) != 1 {
		t.Fatalf("%d contenders took over an expired lease; want exactly 1: %v", len(won), won)
	}
	for i, tm := range won {
		if tm.Epoch != 2 {
			t.Errorf("takeover epoch = %d; want 2", tm.Epoch)
		}
		if l := stored(t, kv, "scheduler.s"); l.Holder != fmt.Sprintf("r%d", i) || l.Epoch != 2 {
			t.Errorf("stored lease = %+v; want holder r%d epoch 2", l, i)
		}
	}
	if err := es[first].Renew(ctx, term1); !errors.Is(err, lease.ErrLost) {
		t.Errorf("deposed holder's renew = %v; want ErrLost", err)
	}
}

func TestRenewAfterTakeoverIsLost(t *testing.T) {
	// The old holder still believes it holds the lease (its own clock
	// says so) but the key moved on: the revision check refuses it.
	kv := bucket(t)
	clk := &clock{}
	fast := &clock{} // the new contender's clock runs ahead
	fast.advance(time.Hour)
	a, _ := lease.New(lease.Config{KV: kv, Key: "k", Holder: "a", TTL: time.Second, Now: clk.now})
	b, _ := lease.New(lease.Config{KV: kv, Key: "k", Holder: "b", TTL: time.Second, Now: fast.now})
	ctx := context.Background()
	ta, ok, err := a.TryAcquire(ctx)
	if !ok || err != nil {
		t.Fatalf("a: ok=%v err=%v", ok, err)
	}
	tb, ok, err := b.TryAcquire(ctx)
	if !ok || err != nil || tb.Epoch != 2 {
		t.Fatalf("b: ok=%v err=%v epoch=%d", ok, err, tb.Epoch)
	}
	if err := a.Renew(ctx, ta); !errors.Is(err, lease.ErrLost) {
		t.Fatalf("renew after takeover = %v; want ErrLost", err)
	}
	if ta.Valid() {
		t.Error("a term whose renewal was refused still reports valid")
	}
}

func TestRunHandsOverOnStop(t *testing.T) {
	kv := bucket(t)
	type lead struct {
		who   string
		epoch uint64
	}
	leads := make(chan lead, 8)
	var leading atomic.Int32
	run := func(ctx context.Context, who string) error {
		e, err := lease.New(lease.Config{KV: kv, Key: "k", Holder: who, TTL: 300 * time.Millisecond})
		if err != nil {
			return err
		}
		return e.Run(ctx, func(ctx context.Context, tm lease.Term) error {
			if n := leading.Add(1); n != 1 {
				t.Errorf("%d leaders at once", n)
			}
			defer leading.Add(-1)
			leads <- lead{who, tm.Epoch}
			<-ctx.Done()
			return nil
		})
	}
	ctxA, stopA := context.WithCancel(context.Background())
	ctxB, stopB := context.WithCancel(context.Background())
	defer stopB()
	var wg sync.WaitGroup
	wg.Go(func() { _ = run(ctxA, "a") })
	first := <-leads
	wg.Go(func() { _ = run(ctxB, "b") })
	if first.who == "a" {
		stopA()
	} else {
		stopB()
	}
	select {
	case second := <-leads:
		if second.who == first.who || second.epoch != first.epoch+1 {
			t.Errorf("after %+v stopped, %+v leads; want the other one at epoch %d", first, second, first.epoch+1)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no takeover after the leader stopped")
	}
	stopA()
	stopB()
	wg.Wait()
}

// TestRunStepDownReleasesAndContendsAgain: a leader whose lead returns
// ErrStepDown (it could not do its work) gives the lease up at once, so
// another contender takes it at the next epoch, and keeps contending:
// Run does not return, and it leads again once the lease is free.
func TestRunStepDownReleasesAndContendsAgain(t *testing.T) {
	kv := bucket(t)
	const ttl = 300 * time.Millisecond
	a, err := lease.New(lease.Config{KV: kv, Key: "k", Holder: "a", TTL: ttl, SitOut: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	b, err := lease.New(lease.Config{KV: kv, Key: "k", Holder: "b", TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	terms := make(chan uint64, 4)
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	go func() {
		runErr <- a.Run(ctx, func(ctx context.Context, tm lease.Term) error {
			terms <- tm.Epoch
			if tm.Epoch == 1 {
				return fmt.Errorf("rebuild not done: %w", lease.ErrStepDown)
			}
			<-ctx.Done()
			return nil
		})
	}()
	defer func() {
		cancel()
		if err := <-runErr; err != nil {
			t.Errorf("Run returned %v after its context ended, want nil", err)
		}
	}()
	if ep := <-terms; ep != 1 {
		t.Fatalf("first term at epoch %d, want 1", ep)
	}
	// b takes the released lease while a sits out; b's own TTL is a
	// minute, so only a release lets it in this early.
	var tb lease.Term
	deadline := time.Now().Add(10 * time.Second)
	for {
		term, ok, err := b.TryAcquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			tb = term
			break
		}
		select {
		case err := <-runErr:
			t.Fatalf("Run returned %v after a step-down, want it to contend again", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the lease was not released after the step-down")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if tb.Epoch != 2 {
		t.Errorf("b leads at epoch %d, want 2", tb.Epoch)
	}
	if err := b.Release(context.Background(), tb); err != nil {
		t.Fatal(err)
	}
	select {
	case ep := <-terms:
		if ep != 3 {
			t.Errorf("a leads again at epoch %d, want 3", ep)
		}
	case err := <-runErr:
		t.Fatalf("Run returned %v, want it to lead again", err)
	case <-time.After(15 * time.Second):
		t.Fatal("a did not lead again once the lease was free")
	}
}
