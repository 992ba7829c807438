package bus_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// TestConsumeBatchSettlesEachMessage: messages waiting when the consumer
// starts come in batches, in stream order; each message of a batch is
// settled by its own error.
func TestConsumeBatchSettlesEachMessage(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const n = 300
	for i := range n {
		id := fmt.Sprintf("j%03d", i)
		switch i {
		case 10:
			id = "poison"
		case 20:
			id = "flaky"
		}
		if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), id, contracts.CancelRequest{JobID: id}); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	var order []string
	handled := map[string]int{}
	sizes := map[int]int{}
	flaky := 0
	go func() {
		_ = b.ConsumeBatch(ctx, bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "batch",
			FilterSubjects: []string{contracts.SubjectCancelAll}, Batch: 100, Backoff: []time.Duration{20 * time.Millisecond}},
			func(_ context.Context, msgs []*bus.Msg) []error {
				mu.Lock()
				defer mu.Unlock()
				sizes[len(msgs)]++
				errs := make([]error, len(msgs))
				for i, m := range msgs {
					var c contracts.CancelRequest
					if err := m.Decode(&c); err != nil {
						errs[i] = bus.Permanent(err)
						continue
					}
					switch {
					case c.JobID == "poison":
						errs[i] = bus.Permanent(errors.New("never valid"))
						continue
					case c.JobID == "flaky" && flaky == 0:
						flaky++
						errs[i] = errors.New("transient")
						continue
					}
					handled[c.JobID]++
					order = append(order, c.JobID)
				}
				return errs
			})
	}()
	eventually(t, 10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(handled) == n-1
	}, "every message but the poison one handled")
	mu.Lock()
	defer mu.Unlock()
	for id, k := range handled {
		if k != 1 {
			t.Errorf("%s handled %d times", id, k)
		}
	}
	big := 0
	for size, count := range sizes {
		if size > 1 {
			big += count
		}
		if size > 100 {
			t.Errorf("a batch of %d messages, limit 100", size)
		}
	}
	if big == 0 {
		t.Errorf("batch sizes %v: 300 waiting messages never came more than one at a time", sizes)
	}
	// Stream order, except the flaky one which came back later.
	prev := ""
	for _, id := range order {
		if id == "flaky" {
			continue
		}
		if id < prev {
			t.Fatalf("%s handled after %s", id, prev)
		}
		prev = id
	}
	if dl := deadLetterCount(t, b); dl != 1 {
		t.Errorf("%d dead letters, want the poison one", dl)
	}
}

// TestConsumeBatchPipelinedOverlapsAndSettlesEachMessage: batches are
// started while earlier ones are still being waited for, never more than
// inFlight at once; each message is settled by its own error only after
// its batch's wait returned (a failed one comes again, a poison one is
// dead-lettered), and every message is handled once.
func TestConsumeBatchPipelinedOverlapsAndSettlesEachMessage(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const n, inFlight = 300, 2
	for i := range n {
		id := fmt.Sprintf("j%03d", i)
		switch i {
		case 10:
			id = "poison"
		case 120:
			id = "flaky"
		}
		if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), id, contracts.CancelRequest{JobID: id}); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	handled := map[string]int{}
	started, maxStarted, flaky := 0, 0, 0
	go func() {
		_ = b.ConsumeBatchPipelined(ctx, bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "pipelined",
			FilterSubjects: []string{contracts.SubjectCancelAll}, Batch: 20, Backoff: []time.Duration{20 * time.Millisecond}},
			inFlight, func(_ context.Context, msgs []*bus.Msg) func() []error {
				mu.Lock()
				started++
				maxStarted = max(maxStarted, started)
				mu.Unlock()
				return func() []error {
					time.Sleep(5 * time.Millisecond) // the store's round trip
					mu.Lock()
					defer mu.Unlock()
					started--
					errs := make([]error, len(msgs))
					for i, m := range msgs {
						var c contracts.CancelRequest
						if err := m.Decode(&c); err != nil {
							errs[i] = bus.Permanent(err)
							continue
						}
						switch {
						case c.JobID == "poison":
							errs[i] = bus.Permanent(errors.New("never valid"))
							continue
						case c.JobID == "flaky" && flaky == 0:
							flaky++
							errs[i] = errors.New("transient")
							continue
						}
						handled[c.JobID]++
					}
					return errs
				}
			})
	}()
	eventually(t, 30*time.Second, func() bool { // ~0.4 s; room for a loaded CI box
		mu.Lock()
		defer mu.Unlock()
		return len(handled) == n-1
	}, "every message but the poison one handled")
	mu.Lock()
	defer mu.Unlock()
	for id, k := range handled {
		if k != 1 {
			t.Errorf("%s handled %d times", id, k)
		}
	}
	if maxStarted != inFlight {
		t.Errorf("at most %d batches were in flight at once, want %d", maxStarted, inFlight)
	}
	if flaky != 1 {
		t.Errorf("the flaky message failed %d times, want once", flaky)
	}
	if dl := deadLetterCount(t, b); dl != 1 {
		t.Errorf("%d dead letters, want the poison one", dl)
	}
}

// TestRetryAfterDelaysRedelivery: a handler that knows its dependency is
// down asks for a longer delay than the consumer's backoff.
func TestRetryAfterDelaysRedelivery(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), "x", contracts.CancelRequest{JobID: "x"}); err != nil {
		t.Fatal(err)
	}
	const delay = 400 * time.Millisecond
	var mu sync.Mutex
	var seen []time.Time
	go func() {
		_ = b.Consume(ctx, bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "later",
			FilterSubjects: []string{contracts.SubjectCancelAll}, Backoff: []time.Duration{time.Millisecond}},
			func(context.Context, *bus.Msg) error {
				mu.Lock()
				defer mu.Unlock()
				seen = append(seen, time.Now())
				if len(seen) == 1 {
					return bus.RetryAfter(errors.New("store down"), delay)
				}
				return nil
			})
	}()
	eventually(t, 10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen) == 2
	}, "the redelivery")
	mu.Lock()
	defer mu.Unlock()
	if gap := seen[1].Sub(seen[0]); gap < delay {
		t.Errorf("redelivered after %s, want at least the %s asked for (not the 1 ms backoff)", gap, delay)
	}
	if bus.RetryAfter(nil, time.Second) != nil {
		t.Error("RetryAfter(nil) is not nil")
	}
	var ra *bus.RetryAfterError
	if err := fmt.Errorf("wrapped: %w", bus.RetryAfter(errors.New("x"), time.Second)); !errors.As(err, &ra) || ra.Delay != time.Second {
		t.Errorf("errors.As through a wrap: %v", err)
	}
}

func deadLetterCount(t *testing.T, b *bus.Bus) int {
	t.Helper()
	n := 0
	if _, err := b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamDeadLetters}, func(context.Context, *bus.Msg) error {
		n++
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return n
}
