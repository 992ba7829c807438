package bus_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// TestConsumePipelinedOverlapsKeysAndKeepsEachKeysOrder: several messages
// are started before the first settles, yet a key's next message starts
// only after its previous one's wait returned, in stream order, each once.
func TestConsumePipelinedOverlapsKeysAndKeepsEachKeysOrder(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const keys, perKey = 10, 20
	for i := range keys * perKey {
		c := contracts.CancelRequest{JobID: fmt.Sprintf("k%d", i%keys), Reason: fmt.Sprint(i / keys)}
		if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), fmt.Sprint("m", i), c); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	started := map[string][]string{}
	settled := map[string]int{} // per key, how many waits returned
	violations := 0
	var open, maxOpen atomic.Int32
	go func() {
		_ = b.ConsumePipelined(ctx, bus.ConsumerSpec{
			Stream: contracts.StreamJobs, Durable: "pipelined", Batch: 64,
			Key: cancelJobID,
		}, func(_ context.Context, m *bus.Msg) func() error {
			var c contracts.CancelRequest
			if err := m.Decode(&c); err != nil {
				return func() error { return bus.Permanent(err) }
			}
			mu.Lock()
			if len(started[c.JobID]) != settled[c.JobID] {
				violations++ // started before the key's previous message settled
			}
			started[c.JobID] = append(started[c.JobID], c.Reason)
			mu.Unlock()
			n := open.Add(1)
			for {
				old := maxOpen.Load()
				if n <= old || maxOpen.CompareAndSwap(old, n) {
					break
				}
			}
			return func() error {
				open.Add(-1)
				mu.Lock()
				settled[c.JobID]++
				mu.Unlock()
				return nil
			}
		})
	}()
	eventually(t, 10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, v := range settled {
			n += v
		}
		return n == keys*perKey
	}, "every message settled")
	mu.Lock()
	defer mu.Unlock()
	if violations > 0 {
		t.Fatalf("%d messages started before their key's previous one settled", violations)
	}
	for k, got := range started {
		for i, r := range got {
			if r != fmt.Sprint(i) {
				t.Fatalf("key %s started out of order or twice: %v", k, got)
			}
		}
	}
	if maxOpen.Load() < 2 {
		t.Errorf("at most %d message started and unsettled at once; want several", maxOpen.Load())
	}
}

// TestConsumePipelinedFates: each message's wait decides its own fate, as
// a Handler's error does: a transient failure is redelivered, a permanent
// one and a panic (in the start or in the wait) are dead-lettered, the
// others are acknowledged once.
func TestConsumePipelinedFates(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, id := range []string{"ok", "flaky", "poison", "panic-start", "panic-wait", "ok2"} {
		if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), id, contracts.CancelRequest{JobID: id}); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	done := map[string]int{}
	var flakyTries atomic.Int32
	go func() {
		_ = b.ConsumePipelined(ctx, bus.ConsumerSpec{
			Stream: contracts.StreamJobs, Durable: "fates", FilterSubjects: []string{contracts.SubjectCancelAll},
			Backoff: []time.Duration{20 * time.Millisecond}, MaxDeliver: 5,
		}, func(_ context.Context, m *bus.Msg) func() error {
			var c contracts.CancelRequest
			if err := m.Decode(&c); err != nil {
				return func() error { return bus.Permanent(err) }
			}
			if c.JobID == "panic-start" {
				panic("boom")
			}
			return func() error {
				switch c.JobID {
				case "flaky":
					if flakyTries.Add(1) < 3 {
						return errors.New("transient")
					}
				case "poison":
					return bus.Permanent(errors.New("never valid"))
				case "panic-wait":
					panic("boom")
				}
				mu.Lock()
				done[c.JobID]++
				mu.Unlock()
				return nil
			}
		})
	}()
	dead := deadLetters(ctx, b)
	eventually(t, 10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return done["ok"] == 1 && done["ok2"] == 1 && done["flaky"] == 1 && len(dead()) == 3
	}, "ok, ok2 and flaky handled once; poison and both panics dead-lettered")
	if n := flakyTries.Load(); n != 3 {
		t.Errorf("flaky handled %d times, want 3", n)
	}
}

// TestConsumePipelinedStartsTheNextGroupWhileOneSettles: the first
// message's wait returns only once a message of a later group (Batch 1:
// any other message) has started. Settling a group while the next one
// starts lets it return; settling before starting more would wait it out.
// Every message is still settled once. (With groups of 4, a loaded machine
// could gather groups of one and fill the four unsettled groups before
// the fifth message: a failure of the test, not of the bus.)
func TestConsumePipelinedStartsTheNextGroupWhileOneSettles(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const n = 12
	for i := range n {
		c := contracts.CancelRequest{JobID: fmt.Sprintf("k%d", i)}
		if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), fmt.Sprint("m", i), c); err != nil {
			t.Fatal(err)
		}
	}
	laterStarted := make(chan struct{})
	var once sync.Once
	var mu sync.Mutex
	settled := map[string]int{}
	var failures []string
	go func() {
		_ = b.ConsumePipelined(ctx, bus.ConsumerSpec{
			Stream: contracts.StreamJobs, Durable: "overlap", Batch: 1, MaxDeliver: 1,
			Key: cancelJobID,
		}, func(_ context.Context, m *bus.Msg) func() error {
			var c contracts.CancelRequest
			if err := m.Decode(&c); err != nil {
				return func() error { return bus.Permanent(err) }
			}
			var i int
			fmt.Sscanf(c.JobID, "k%d", &i)
			if i >= 1 {
				once.Do(func() { close(laterStarted) })
			}
			return func() error {
				if i == 0 {
					select {
					case <-laterStarted:
					case <-time.After(5 * time.Second):
						mu.Lock()
						failures = append(failures, "k0's wait saw no later group start")
						mu.Unlock()
					}
				}
				mu.Lock()
				settled[c.JobID]++
				mu.Unlock()
				return nil
			}
		})
	}()
	eventually(t, 15*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(settled) == n
	}, "every message settled")
	mu.Lock()
	defer mu.Unlock()
	if len(failures) > 0 {
		t.Fatal(failures)
	}
	for k, c := range settled {
		if c != 1 {
			t.Errorf("%s settled %d times", k, c)
		}
	}
}

// TestConsumePipelinedPrepares: Prepare runs before each message starts
// and the handler finds its result in m.Prepared, in stream order; a
// Prepare that panics fails its message for good (dead-lettered) without
// the handler seeing it, and the others go on.
func TestConsumePipelinedPrepares(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const n = 200
	for i := range n {
		id := fmt.Sprintf("j%03d", i)
		if i == 57 {
			id = "panic"
		}
		if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), "m"+id, contracts.CancelRequest{JobID: id}); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	var seen []string
	var wrong []string
	go func() {
		_ = b.ConsumePipelined(ctx, bus.ConsumerSpec{
			Stream: contracts.StreamJobs, Durable: "prepared", Batch: 16, MaxDeliver: 1,
			Prepare: func(m *bus.Msg) any {
				var c contracts.CancelRequest
				_ = m.Decode(&c)
				if c.JobID == "panic" {
					panic("boom")
				}
				return c
			},
		}, func(_ context.Context, m *bus.Msg) func() error {
			c, ok := m.Prepared.(contracts.CancelRequest)
			var direct contracts.CancelRequest
			_ = m.Decode(&direct)
			mu.Lock()
			if !ok || c.JobID != direct.JobID {
				wrong = append(wrong, fmt.Sprintf("%s prepared as %#v", direct.JobID, m.Prepared))
			}
			seen = append(seen, direct.JobID)
			mu.Unlock()
			return nil
		})
	}()
	dead := deadLetters(ctx, b)
	eventually(t, 10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen) == n-1 && len(dead()) == 1
	}, "every message but the one whose Prepare panicked handled, that one dead-lettered")
	mu.Lock()
	defer mu.Unlock()
	if len(wrong) > 0 {
		t.Fatalf("handler did not find what Prepare returned: %v", wrong[:min(3, len(wrong))])
	}
	for i, id := range seen {
		if i > 0 && id < seen[i-1] {
			t.Fatalf("started out of stream order: %s after %s", id, seen[i-1])
		}
		if id == "panic" {
			t.Fatal("the handler saw the message whose Prepare panicked")
		}
	}
}

// TestConsumePipelinedHandsBackWhatItDidNotStart: messages taken but not
// started when the consumer stops, including while a started one still
// settles, go to the next consumer at once, not after AckWait (30 s
// here). (From a review: one was dropped at every stop, and the others
// were handed back into the stopping consumer's own buffer.)
func TestConsumePipelinedHandsBackWhatItDidNotStart(t *testing.T) {
	for _, tc := range []struct {
		name      string
		slowWait  bool // a started message's wait outlasts the stop by 500 ms
		stopAfter int  // the message whose start cancels
	}{
		{"stopped between starts", false, 10},
		{"stopped while one settles", true, 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := connect(t)
			bg := context.Background()
			const n = 50
			publishCancels(t, b, 0, n)
			spec := bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "handback", Batch: 64, AckWait: 30 * time.Second,
				Key: cancelJobID}
			ctx1, cancel1 := context.WithCancel(bg)
			done := make(chan struct{})
			go func() {
				defer close(done)
				_ = b.ConsumePipelined(ctx1, spec, func(ctx context.Context, m *bus.Msg) func() error {
					var c contracts.CancelRequest
					_ = m.Decode(&c)
					switch c.JobID {
					case "k00":
						if tc.slowWait {
							return func() error { <-ctx.Done(); time.Sleep(500 * time.Millisecond); return nil }
						}
					case fmt.Sprintf("k%02d", tc.stopAfter):
						time.Sleep(200 * time.Millisecond) // the fetcher takes the rest meanwhile
						cancel1()
					}
					return nil
				})
			}()
			<-done
			var mu sync.Mutex
			seen := map[string]bool{}
			ctx2, cancel2 := context.WithCancel(bg)
			defer cancel2()
			go func() {
				_ = b.ConsumePipelined(ctx2, spec, func(_ context.Context, m *bus.Msg) func() error {
					var c contracts.CancelRequest
					_ = m.Decode(&c)
					mu.Lock()
					seen[c.JobID] = true
					mu.Unlock()
					return nil
				})
			}()
			if ks := awaitHandled(&mu, tc.stopAfter+1, n, func(k string) bool { return seen[k] }); len(ks) > 0 {
				t.Fatalf("taken and not started, yet not handed back at the stop (8 s; AckWait 30 s): %v", ks)
			}
		})
	}
}

// TestAStoppedConsumerHandsBackWhatItsIteratorHeld: the messages a pull
// iterator has received and nobody took yet go to the next consumer as
// soon as a consumer stops, for every way of consuming, not after AckWait
// (30 s here). The first consumer stops at its first message while its
// handler is slow, so its iterator holds the batch it pulled. (CI once
// lost three cancels this way for 30 s: nats.go's Stop drops its buffer.)
func TestAStoppedConsumerHandsBackWhatItsIteratorHeld(t *testing.T) {
	type run func(ctx context.Context, b *bus.Bus, spec bus.ConsumerSpec, saw func(*bus.Msg)) error
	for _, tc := range []struct {
		name  string
		batch int
		run   run
	}{
		{"Consume", 16, func(ctx context.Context, b *bus.Bus, spec bus.ConsumerSpec, saw func(*bus.Msg)) error {
			return b.Consume(ctx, spec, func(_ context.Context, m *bus.Msg) error { saw(m); return nil })
		}},
		{"ConsumeBatch", 4, func(ctx context.Context, b *bus.Bus, spec bus.ConsumerSpec, saw func(*bus.Msg)) error {
			return b.ConsumeBatch(ctx, spec, func(_ context.Context, ms []*bus.Msg) []error {
				for _, m := range ms {
					saw(m)
				}
				return make([]error, len(ms))
			})
		}},
		{"ConsumeBatchPipelined", 4, func(ctx context.Context, b *bus.Bus, spec bus.ConsumerSpec, saw func(*bus.Msg)) error {
			return b.ConsumeBatchPipelined(ctx, spec, 2, func(_ context.Context, ms []*bus.Msg) func() []error {
				for _, m := range ms {
					saw(m)
				}
				return func() []error { return make([]error, len(ms)) }
			})
		}},
		{"ConsumePipelined", 4, func(ctx context.Context, b *bus.Bus, spec bus.ConsumerSpec, saw func(*bus.Msg)) error {
			return b.ConsumePipelined(ctx, spec, func(_ context.Context, m *bus.Msg) func() error { saw(m); return nil })
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := connect(t)
			bg := context.Background()
			const n = 40
			publishCancels(t, b, 0, n)
			spec := bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "held", Batch: tc.batch,
				AckWait: 30 * time.Second, Key: cancelJobID}
			var mu sync.Mutex
			first := map[string]bool{}
			ctx1, cancel1 := context.WithCancel(bg)
			done := make(chan struct{})
			go func() {
				defer close(done)
				_ = tc.run(ctx1, b, spec, func(m *bus.Msg) {
					mu.Lock()
					first[cancelJobID(m)] = true
					mu.Unlock()
					// The iterator fills up meanwhile.
					time.Sleep(300 * time.Millisecond)
					cancel1()
				})
			}()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("the first consumer did not stop")
			}
			seen := map[string]bool{}
			ctx2, cancel2 := context.WithCancel(bg)
			defer cancel2()
			go func() {
				_ = tc.run(ctx2, b, spec, func(m *bus.Msg) {
					mu.Lock()
					seen[cancelJobID(m)] = true
					mu.Unlock()
				})
			}()
			if ks := awaitHandled(&mu, 0, n, func(k string) bool { return seen[k] || first[k] }); len(ks) > 0 {
				t.Fatalf("never handled, and not handed back at the stop (8 s; AckWait 30 s): %v", ks)
			}
		})
	}
}

// publishCancels publishes the cancel requests of jobs k<from>..k<to-1>
// of tenant acme, message IDs m<from>...
func publishCancels(t *testing.T, b *bus.Bus, from, to int) {
	t.Helper()
	for i := from; i < to; i++ {
		c := contracts.CancelRequest{JobID: fmt.Sprintf("k%02d", i)}
		if _, err := b.Publish(context.Background(), contracts.SubjectCancel("acme"), fmt.Sprint("m", i), c); err != nil {
			t.Fatal(err)
		}
	}
}

// awaitHandled waits up to 8 s (well under the tests' AckWait of 30 s)
// until handled, read under mu, holds the keys k<from>..k<to-1>, and
// returns those it does not.
func awaitHandled(mu *sync.Mutex, from, to int, handled func(key string) bool) []string {
	missing := func() []string {
		mu.Lock()
		defer mu.Unlock()
		var ks []string
		for i := from; i < to; i++ {
			if k := fmt.Sprintf("k%02d", i); !handled(k) {
				ks = append(ks, k)
			}
		}
		return ks
	}
	deadline := time.Now().Add(8 * time.Second)
	for len(missing()) > 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	return missing()
}

// deadLetters follows the dead letters until ctx ends; the IDs of those
// seen so far.
func deadLetters(ctx context.Context, b *bus.Bus) func() []string {
	var mu sync.Mutex
	var ids []string
	go func() {
		_ = b.Follow(ctx, bus.FollowSpec{Stream: contracts.StreamDeadLetters}, func(_ context.Context, m *bus.Msg) error {
			mu.Lock()
			ids = append(ids, m.ID())
			mu.Unlock()
			return nil
		}, nil)
	}()
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(ids)
	}
}

// cancelJobID keys the tests' messages, cancel requests, by their job.
func cancelJobID(m *bus.Msg) string {
	var c contracts.CancelRequest
	_ = m.Decode(&c)
	return c.JobID
}
