package bus_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// TestHeldMessagesStayAliveUntilHandedBack: a consumer stopped by its
// context holds what its iterator received (drain) and what it took and
// did not start, kept alive until the stop hands them back, while a
// started message's wait still runs (12 s here, AckWait 10 s). Another
// replica must not get any of them before the stopping one hands them
// back, and none may be handled twice because of a late Nak. (From a
// review: the keep-alive ended with the context.) AckWait is long because
// a message in nats.go's buffer is kept alive only once taken: under
// -race and CI's load, messages sat there past an AckWait of 2 s.
func TestHeldMessagesStayAliveUntilHandedBack(t *testing.T) {
	b := connect(t)
	bg := context.Background()
	const n = 40
	publishCancels(t, b, 0, n)
	spec := bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "alive", Batch: 4, AckWait: 10 * time.Second,
		Key: cancelJobID}
	ctx1, cancel1 := context.WithCancel(bg)
	var firstDone atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer firstDone.Store(true)
		_ = b.ConsumePipelined(ctx1, spec, func(ctx context.Context, m *bus.Msg) func() error {
			if cancelJobID(m) != "k00" {
				return nil
			}
			time.Sleep(300 * time.Millisecond) // the fetcher and the iterator fill up
			cancel1()
			return func() error { <-ctx.Done(); time.Sleep(12 * time.Second); return nil }
		})
	}()
	<-ctx1.Done()
	var mu sync.Mutex
	var early []string          // redelivered to the other replica while the first still held them
	handled := map[string]int{} // by the other replica
	ctx2, cancel2 := context.WithCancel(bg)
	defer cancel2()
	spec2 := spec
	spec2.Workers = 16
	go func() {
		_ = b.Consume(ctx2, spec2, func(_ context.Context, m *bus.Msg) error {
			k := cancelJobID(m)
			if m.NumDelivered >= 2 && !firstDone.Load() {
				mu.Lock()
				early = append(early, fmt.Sprintf("%s(delivery %d)", k, m.NumDelivered))
				mu.Unlock()
				// Handled a while, past the first replica's hand-back.
				for !firstDone.Load() {
					time.Sleep(10 * time.Millisecond)
				}
				time.Sleep(300 * time.Millisecond)
			}
			mu.Lock()
			handled[k]++
			mu.Unlock()
			return nil
		})
	}()
	<-done
	time.Sleep(3 * time.Second)
	mu.Lock()
	defer mu.Unlock()
	var twice []string
	for k, c := range handled {
		if c > 1 {
			twice = append(twice, k)
		}
	}
	slices.Sort(twice)
	if len(early) > 0 || len(twice) > 0 {
		t.Fatalf("redelivered to another replica while the stopping one held them: %v; handled twice (its late Nak): %v",
			early, twice)
	}
}

// TestAStoppedConsumerHandsBackWhatItsHandlerGaveUp: a handler that
// gives up at the stop (its context's error) has its message handed back
// with what the iterator held, each once, to the next consumer at once
// (AckWait 30 s here). Their order is not asserted: the stop Naks them
// in stream order, but nats-server first offers the first one to the
// stopped consumer's pull request, which lingers until it expires, and
// finding no one there puts it at the back of its redelivery queue
// (consumer.go, "add it back"): a hand-over keeps the order only
// mostly. (From a review, which asked for the order.)
func TestAStoppedConsumerHandsBackWhatItsHandlerGaveUp(t *testing.T) {
	b := connect(t)
	bg := context.Background()
	pub := func(i int) { publishCancels(t, b, i, i+1) }
	pub(0)
	spec := bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "order", Batch: 16, AckWait: 30 * time.Second}
	ctx1, cancel1 := context.WithCancel(bg)
	started := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = b.Consume(ctx1, spec, func(ctx context.Context, m *bus.Msg) error {
			if cancelJobID(m) == "k00" {
				close(started)
			}
			<-ctx.Done()
			return ctx.Err()
		})
	}()
	<-started
	for i := 1; i < 6; i++ {
		pub(i) // into the iterator's buffer
	}
	time.Sleep(300 * time.Millisecond)
	cancel1()
	<-done
	var mu sync.Mutex
	var order, wrong []string
	ctx2, cancel2 := context.WithCancel(bg)
	defer cancel2()
	go func() {
		_ = b.Consume(ctx2, spec, func(_ context.Context, m *bus.Msg) error {
			mu.Lock()
			order = append(order, cancelJobID(m))
			if m.NumDelivered != 2 {
				wrong = append(wrong, fmt.Sprintf("%s delivery %d", cancelJobID(m), m.NumDelivered))
			}
			mu.Unlock()
			return nil
		})
	}()
	eventually(t, 8*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return len(order) >= 6 }, "six messages")
	mu.Lock()
	defer mu.Unlock()
	slices.Sort(order)
	if want := []string{"k00", "k01", "k02", "k03", "k04", "k05"}; !slices.Equal(order, want) || len(wrong) > 0 {
		t.Fatalf("the next consumer got %v (%v), want each of %v once, on its second delivery", order, wrong, want)
	}
}

// TestAStopReturnsWhenTheConnectionIsClosed: a consumer whose
// connection closed under it (while a handler runs, and while the
// context ends) stops within drainWait, for each way of consuming.
func TestAStopReturnsWhenTheConnectionIsClosed(t *testing.T) {
	for _, pipelined := range []bool{false, true} {
		for _, cancelFirst := range []bool{false, true} {
			t.Run(fmt.Sprint(pipelined, cancelFirst), func(t *testing.T) {
				b := connect(t)
				bg := context.Background()
				publishCancels(t, b, 0, 20)
				spec := bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "closed", Batch: 4, AckWait: 30 * time.Second, Key: cancelJobID}
				ctx, cancel := context.WithCancel(bg)
				defer cancel()
				started, release := make(chan struct{}), make(chan struct{})
				var once sync.Once
				slow := func() { once.Do(func() { close(started) }); <-release }
				done := make(chan struct{})
				go func() {
					defer close(done)
					if pipelined {
						_ = b.ConsumePipelined(ctx, spec, func(context.Context, *bus.Msg) func() error { slow(); return nil })
					} else {
						_ = b.Consume(ctx, spec, func(context.Context, *bus.Msg) error { slow(); return nil })
					}
				}()
				<-started
				time.Sleep(200 * time.Millisecond)
				if cancelFirst {
					cancel()
				}
				b.Conn().Close()
				close(release)
				cancel()
				select {
				case <-done:
				case <-time.After(5 * time.Second):
					t.Fatal("the consumer did not stop within 5 s of its connection closing")
				}
			})
		}
	}
}
