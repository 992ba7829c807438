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

	"github.com/nats-io/nats.go/jetstream"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// connect connects to a fresh server as the operator: these tests exercise
// the library on every subject family, which only the operator may use.
func connect(t *testing.T) *bus.Bus {
	t.Helper()
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "test", CredsFile: natstest.Operator(t, srv)})
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	return b
}

func eventually(t *testing.T, d time.Duration, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if cond() {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("timed out waiting for %s", what)
}

func TestPublishSetsEnvelopeAndDeduplicates(t *testing.T) {
	b := connect(t)
	ctx := context.Background()
	req := contracts.JobRequest{ID: "j1", Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}}}
	ack1, err := b.Publish(ctx, contracts.SubjectSubmit("acme"), "id-1", req, bus.CESubject("j1"))
	if err != nil {
		t.Fatal(err)
	}
	ack2, err := b.Publish(ctx, contracts.SubjectSubmit("acme"), "id-1", req)
	if err != nil {
		t.Fatal(err)
	}
	if !ack2.Duplicate || ack2.Sequence != ack1.Sequence {
		t.Fatalf("second publish with the same ID: duplicate=%v seq=%d, want duplicate of seq %d", ack2.Duplicate, ack2.Sequence, ack1.Sequence)
	}
	var got []*bus.Msg
	last, err := b.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamJobs}, func(_ context.Context, m *bus.Msg) error {
		got = append(got, m)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || last != ack1.Sequence {
		t.Fatalf("replay got %d messages up to %d, want 1 up to %d", len(got), last, ack1.Sequence)
	}
	h := got[0].Header
	for k, want := range map[string]string{
		contracts.HeaderCESpecVersion: "1.0",
		contracts.HeaderCEType:        "io.gpuplane.job.request.v1",
		contracts.HeaderCESource:      "/gpuplane/test",
		contracts.HeaderCEID:          "id-1",
		contracts.HeaderCESubject:     "j1",
		contracts.HeaderMsgID:         "id-1",
	} {
		if h.Get(k) != want {
			t.Errorf("header %s = %q, want %q", k, h.Get(k), want)
		}
	}
	if v, ok := h[contracts.HeaderContentType]; ok {
		t.Errorf("header %s = %q, want none (every body is JSON)", contracts.HeaderContentType, v)
	}
}

func TestExpectLastSubjectSeqIsCompareAndSet(t *testing.T) {
	b := connect(t)
	ctx := context.Background()
	subj := contracts.SubjectLedger("n1")
	ack, err := b.Publish(ctx, subj, "e1", contracts.LedgerEntry{Kind: contracts.LedgerCommitted}, bus.ExpectLastSubjectSeq(0))
	if err != nil {
		t.Fatal(err)
	}
	// A writer that still believes the subject is empty loses.
	_, err = b.Publish(ctx, subj, "e2", contracts.LedgerEntry{Kind: contracts.LedgerCommitted}, bus.ExpectLastSubjectSeq(0))
	if !errors.Is(err, bus.ErrWrongLastSequence) {
		t.Fatalf("stale CAS publish: err = %v, want ErrWrongLastSequence", err)
	}
	if _, err := b.Publish(ctx, subj, "e3", contracts.LedgerEntry{Kind: contracts.LedgerReleased}, bus.ExpectLastSubjectSeq(ack.Sequence)); err != nil {
		t.Fatalf("CAS publish with the right sequence: %v", err)
	}
}

func TestConsumeRetriesTransientAndDeadLettersPermanent(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, id := range []string{"ok", "flaky", "poison", "panic"} {
		if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), id, contracts.CancelRequest{JobID: id}); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	done := map[string]int{}
	var flakyTries atomic.Int32
	go func() {
		_ = b.Consume(ctx, bus.ConsumerSpec{
			Stream: contracts.StreamJobs, Durable: "t", FilterSubjects: []string{contracts.SubjectCancelAll},
			Backoff: []time.Duration{20 * time.Millisecond}, MaxDeliver: 5,
		}, func(_ context.Context, m *bus.Msg) error {
			var c contracts.CancelRequest
			if err := m.Decode(&c); err != nil {
				return bus.Permanent(err)
			}
			switch c.JobID {
			case "flaky":
				if flakyTries.Add(1) < 3 {
					return errors.New("transient")
				}
			case "poison":
				return bus.Permanent(errors.New("never valid"))
			case "panic":
				panic("boom")
			}
			mu.Lock()
			done[c.JobID]++
			mu.Unlock()
			return nil
		})
	}()
	var dead []string
	var dmu sync.Mutex
	go func() {
		_ = b.Follow(ctx, bus.FollowSpec{Stream: contracts.StreamDeadLetters}, func(_ context.Context, m *bus.Msg) error {
			dmu.Lock()
			dead = append(dead, m.Header.Get(contracts.HeaderDeadLetterSubject)+":"+m.Header.Get(contracts.HeaderDeadLetterReason))
			dmu.Unlock()
			return nil
		}, nil)
	}()
	eventually(t, 10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		dmu.Lock()
		defer dmu.Unlock()
		return done["ok"] == 1 && done["flaky"] == 1 && len(dead) == 2
	}, "ok and flaky handled once, poison and panic dead-lettered")
	if n := flakyTries.Load(); n != 3 {
		t.Errorf("flaky handled %d times, want 3", n)
	}
}

func TestFollowSignalsCaughtUpThenStreamsNew(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, id := range []string{"a", "b"} {
		if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), id, contracts.CancelRequest{JobID: id}); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	var seen []string
	caught := make(chan int, 1)
	go func() {
		_ = b.Follow(ctx, bus.FollowSpec{Stream: contracts.StreamJobs}, func(_ context.Context, m *bus.Msg) error {
			mu.Lock()
			seen = append(seen, m.ID())
			mu.Unlock()
			return nil
		}, func() {
			mu.Lock()
			caught <- len(seen)
			mu.Unlock()
		})
	}()
	select {
	case n := <-caught:
		if n != 2 {
			t.Fatalf("caught up after %d messages, want 2", n)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("never caught up")
	}
	if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), "c", contracts.CancelRequest{JobID: "c"}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return len(seen) == 3 }, "the new message")
}

func TestReplayOfEmptyFilterReturnsAtOnce(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	last, err := b.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamAllocations, FilterSubjects: []string{contracts.SubjectLedgerAll}},
		func(context.Context, *bus.Msg) error { t.Error("no message expected"); return nil })
	if err != nil || last != 0 {
		t.Fatalf("Replay of an empty stream = %d, %v; want 0, nil", last, err)
	}
}

func TestStreamsAreProvisionedIdempotently(t *testing.T) {
	b := connect(t)
	ctx := context.Background()
	if err := b.EnsureStreams(ctx); err != nil {
		t.Fatalf("second provisioning: %v", err)
	}
	s, err := b.JetStream().Stream(ctx, contracts.StreamJobs)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Config.Discard != jetstream.DiscardNew {
		t.Errorf("JOBS discard policy = %v, want DiscardNew (an overflowing submit must fail, not drop an old job)", info.Config.Discard)
	}
}

// TestServicesProvisionWithTheirOwnIdentity: every unscoped identity that
// connects with provisioning on (each service, a simulated fleet) creates
// the platform's streams on a fresh server and finds them in place on one the
// operator provisioned, with nothing but its own permissions (natstest fails
// the test on any access the server refuses), and opens each KV bucket it
// may read.
func TestServicesProvisionWithTheirOwnIdentity(t *testing.T) {
	unscoped := []contracts.BusRole{contracts.BusScheduler, contracts.BusResourceManager, contracts.BusMonitor,
		contracts.BusAutoscaler, contracts.BusBilling, contracts.BusGateway, contracts.BusFleet, contracts.BusAdmin}
	for _, role := range unscoped {
		for _, fresh := range []bool{true, false} {
			name := string(role) + "/operator-first"
			if fresh {
				name = string(role) + "/fresh"
			}
			t.Run(name, func(t *testing.T) {
				srv := natstest.Start(t)
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				op, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "operator", CredsFile: natstest.Operator(t, srv),
					SkipProvision: fresh})
				if err != nil {
					t.Fatalf("operator: %v", err)
				}
				defer op.Close(context.Background())
				b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: string(role), CredsFile: natstest.Service(t, srv, role)})
				if err != nil {
					t.Fatalf("%s connect: %v", role, err)
				}
				defer b.Close(context.Background())
				for _, name := range contracts.StreamNames() {
					if _, err := op.JetStream().Stream(ctx, name); err != nil {
						t.Errorf("stream %s after %s connected: %v", name, role, err)
					}
				}
				for _, ba := range contracts.Buckets {
					if !slices.Contains(ba.Readers, role) && !slices.Contains(ba.Writers, role) {
						continue
					}
					if _, err := b.KeyValue(ctx, ba.Bucket); err != nil {
						t.Errorf("%s opens bucket %s: %v", role, ba.Bucket, err)
					}
				}
			})
		}
	}
}

// TestStreamsHoldMoreConsumersThanTheServerDefault: every standalone node
// agent holds a durable consumer on ALLOCATIONS; a fleet of more than 1,000
// machines must not hit the server's default of 1,000 per stream.
func TestStreamsHoldMoreConsumersThanTheServerDefault(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := b.JetStream().Stream(ctx, contracts.StreamAllocations)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 1001 {
		node := fmt.Sprintf("n%04d", i)
		if _, err := s.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "node-agent-" + node,
			FilterSubject: contracts.SubjectLedger(node), AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
			t.Fatalf("consumer %d: %v", i+1, err)
		}
	}
}

// TestConsumeWorkersKeepPerKeyOrder: with several workers, messages of one
// key are still handled in stream order, each exactly once, while different
// keys overlap in time.
func TestConsumeWorkersKeepPerKeyOrder(t *testing.T) {
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
	seen := map[string][]string{}
	var inFlight, maxInFlight atomic.Int32
	go func() {
		_ = b.Consume(ctx, bus.ConsumerSpec{
			Stream: contracts.StreamJobs, Durable: "workers", Workers: 8,
			Key: func(m *bus.Msg) string {
				var c contracts.CancelRequest
				_ = m.Decode(&c)
				return c.JobID
			},
		}, func(_ context.Context, m *bus.Msg) error {
			n := inFlight.Add(1)
			for {
				old := maxInFlight.Load()
				if n <= old || maxInFlight.CompareAndSwap(old, n) {
					break
				}
			}
			time.Sleep(2 * time.Millisecond) // let other keys overlap
			inFlight.Add(-1)
			var c contracts.CancelRequest
			if err := m.Decode(&c); err != nil {
				return bus.Permanent(err)
			}
			mu.Lock()
			seen[c.JobID] = append(seen[c.JobID], c.Reason)
			mu.Unlock()
			return nil
		})
	}()
	eventually(t, 10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, v := range seen {
			n += len(v)
		}
		return n == keys*perKey
	}, "every message handled")
	mu.Lock()
	defer mu.Unlock()
	for k, got := range seen {
		for i, r := range got {
			if r != fmt.Sprint(i) {
				t.Fatalf("key %s handled out of order or twice: %v", k, got)
			}
		}
	}
	if maxInFlight.Load() < 2 {
		t.Errorf("at most %d handler ran at once; want parallel keys", maxInFlight.Load())
	}
}

// TestTraceContextCrossesTheBus: a span started before Publish is the
// parent of the consumer's span, through the traceparent header, read with
// the real OpenTelemetry SDK.
func TestTraceContextCrossesTheBus(t *testing.T) {
	srv := natstest.Start(t)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "traced", TracerProvider: tp,
		CredsFile: natstest.Operator(t, srv)})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close(context.Background())

	ctx, root := tp.Tracer("test").Start(ctx, "submit")
	if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), "t1", contracts.CancelRequest{JobID: "j"}); err != nil {
		t.Fatal(err)
	}
	root.End()
	got := make(chan trace.SpanContext, 1)
	go func() {
		_ = b.Consume(ctx, bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "traced"}, func(hctx context.Context, m *bus.Msg) error {
			if m.Header.Get("traceparent") == "" {
				t.Error("no traceparent header on the message")
			}
			got <- trace.SpanContextFromContext(hctx)
			return nil
		})
	}()
	select {
	case sc := <-got:
		if sc.TraceID() != root.SpanContext().TraceID() {
			t.Fatalf("handler trace %s, want the publisher's %s", sc.TraceID(), root.SpanContext().TraceID())
		}
	case <-ctx.Done():
		t.Fatal("message not consumed")
	}
	// publish (producer) and process (consumer) spans share the trace.
	eventually(t, 5*time.Second, func() bool {
		kinds := map[trace.SpanKind]bool{}
		for _, s := range rec.Ended() {
			if s.SpanContext().TraceID() == root.SpanContext().TraceID() {
				kinds[s.SpanKind()] = true
			}
		}
		return kinds[trace.SpanKindProducer] && kinds[trace.SpanKindConsumer]
	}, "producer and consumer spans in one trace")
}

// TestSlowHandlerIsKeptAlive: a handler slower than AckWait is not
// redelivered while it works, because the bus sends InProgress for it.
func TestSlowHandlerIsKeptAlive(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), "slow", contracts.CancelRequest{JobID: "slow"}); err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	done := make(chan struct{})
	go func() {
		_ = b.Consume(ctx, bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "slow", AckWait: 300 * time.Millisecond},
			func(context.Context, *bus.Msg) error {
				if calls.Add(1) == 1 {
					time.Sleep(1500 * time.Millisecond) // five AckWaits
					close(done)
				}
				return nil
			})
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("handler never finished")
	}
	time.Sleep(600 * time.Millisecond) // a redelivery would come within one AckWait
	if n := calls.Load(); n != 1 {
		t.Fatalf("handled %d times; a live slow handler must not be redelivered", n)
	}
}

// TestQueuedMessagesAreKeptAlive: messages waiting behind a slow handler
// for the same worker wait longer than AckWait, and are still handled once.
func TestQueuedMessagesAreKeptAlive(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const n = 6
	for i := range n {
		if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), fmt.Sprint("q", i), contracts.CancelRequest{JobID: fmt.Sprint("q", i)}); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	count := map[string]int{}
	go func() {
		_ = b.Consume(ctx, bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "queued", AckWait: 300 * time.Millisecond,
			Workers: 2, Key: func(*bus.Msg) string { return "one key: one worker, in order" }},
			func(_ context.Context, m *bus.Msg) error {
				time.Sleep(200 * time.Millisecond) // the last waits ~1 s, three AckWaits
				mu.Lock()
				count[m.ID()]++
				mu.Unlock()
				return nil
			})
	}()
	eventually(t, 15*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return len(count) == n }, "every message")
	time.Sleep(600 * time.Millisecond) // a redelivery would come within one AckWait
	mu.Lock()
	defer mu.Unlock()
	for id, c := range count {
		if c != 1 {
			t.Errorf("%s handled %d times; a waiting message must be kept alive", id, c)
		}
	}
}
