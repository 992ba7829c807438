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
// context holds what it took and did not start, kept alive until the
// stop hands them back, while a started message's wait still runs (12 s
// here, AckWait 10 s). Another replica must not get any of them before
// the stopping one hands them back, and each must be handled once. (From
// a review: the keep-alive ended with the context.) What the stop's drain
// takes (what arrives after the fetcher stopped) is not held here: only a
// pull still on its way brings any, which a test cannot time, and which
// races the drain's unsubscription (below).
//
// The first replica is stopped only once it has taken every message
// (each prepared, a condition waited on), so that it holds them all and
// any delivery to the other replica before the hand-back is the defect.
// The test had 40 messages, more than the first replica takes: its
// fetcher's last pull could still be on its way when the stop's drain
// unsubscribed, and nats-server, finding no one to deliver to, counts
// the delivery all the same and gives the message at once to the other
// replica as its second (consumer.go, didNotDeliver). The first replica
// never had those, nor handed them back, and none was handled twice, but
// their NumDelivered of 2 read as "redelivered while held": the test
// failed in CI (k07, k08, k09 on delivery 2) and under -race and load
// here (3 runs in 40; 30 ms after the stop began, not AckWait after).
// Waiting only for the server to have sent them all (NumPending 0) was
// not enough (1 run in 40, the two messages of the last pull): a
// delivery counted is not yet one received.
func TestHeldMessagesStayAliveUntilHandedBack(t *testing.T) {
	b := connect(t)
	bg := context.Background()
	const n = 6 // fewer than a Batch: the fetcher takes them all at once
	publishCancels(t, b, 0, n)
	var prepared atomic.Int32
	spec := bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "alive", Batch: 16, AckWait: 10 * time.Second,
		Key: cancelJobID, Prepare: func(*bus.Msg) any { prepared.Add(1); return nil }}
	var mu sync.Mutex
	handled := map[string]int{} // by either replica
	var early []string          // delivered to the other replica before the hand-back
	count := func(k string) { mu.Lock(); handled[k]++; mu.Unlock() }
	ctx1, cancel1 := context.WithCancel(bg)
	defer cancel1()
	// handingBack is set when the started message's wait returns: the
	// stop hands nothing back before (it settles what it started first),
	// so until then every message is held by the first replica.
	var handingBack atomic.Bool
	started := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = b.ConsumePipelined(ctx1, spec, func(ctx context.Context, m *bus.Msg) func() error {
			if cancelJobID(m) != "k00" {
				return nil
			}
			count("k00")
			close(started)
			<-ctx.Done() // nothing else starts meanwhile
			return func() error {
				time.Sleep(12 * time.Second)
				handingBack.Store(true)
				return nil
			}
		})
	}()
	<-started
	eventually(t, 10*time.Second, func() bool { return prepared.Load() == n }, "the first replica taking every message")
	cancel1()
	ctx2, cancel2 := context.WithCancel(bg)
	defer cancel2()
	spec2 := spec
	spec2.Workers = 16
	go func() {
		_ = b.Consume(ctx2, spec2, func(_ context.Context, m *bus.Msg) error {
			k := cancelJobID(m)
			if !handingBack.Load() {
				mu.Lock()
				early = append(early, fmt.Sprintf("%s(delivery %d)", k, m.NumDelivered))
				mu.Unlock()
			}
			count(k)
			return nil
		})
	}()
	<-done
	// Every message handed back reaches the other replica; once none is
	// left unacknowledged nothing more can come, so a message handled
	// twice (a late Nak) has been by then.
	eventually(t, 10*time.Second, func() bool {
		mu.Lock()
		got := len(handled)
		mu.Unlock()
		c, err := b.JetStream().Consumer(bg, contracts.StreamJobs, spec.Durable)
		if err != nil {
			return false
		}
		info, err := c.Info(bg)
		return got == n && err == nil && info.NumPending == 0 && info.NumAckPending == 0
	}, "every message handled and acknowledged")
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
		t.Fatalf("delivered to another replica while the stopping one held them: %v; handled twice (a late Nak): %v",
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
