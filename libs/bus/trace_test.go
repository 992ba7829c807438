package bus_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/telemetry"
)

func tracedBus(t *testing.T) (*bus.Bus, *tracetest.SpanRecorder, trace.Tracer) {
	t.Helper()
	srv := natstest.Start(t)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "traced", TracerProvider: tp,
		CredsFile: natstest.Operator(t, srv)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close(context.Background()) })
	return b, rec, tp.Tracer("test")
}

func spansNamed(rec *tracetest.SpanRecorder, name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

// TestRedeliveryLinksNotRoots: a message whose handler failed once is
// handled again in the same trace, as a child of its publish, and the
// second delivery's span links to the first's: a redelivery is never a
// new root. Publishes carry the attributes of their context (a job's).
func TestRedeliveryLinksNotRoots(t *testing.T) {
	b, rec, tr := tracedBus(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	jctx, root := tr.Start(telemetry.WithAttrs(ctx, telemetry.JobAttrs("acme", "j1")...), "submit")
	if _, err := b.Publish(jctx, contracts.SubjectCancel("acme"), "c1", contracts.CancelRequest{JobID: "j1"}); err != nil {
		t.Fatal(err)
	}
	root.End()
	var mu sync.Mutex
	calls := 0
	done := make(chan struct{})
	go func() {
		_ = b.Consume(ctx, bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "redeliver",
			Backoff: []time.Duration{10 * time.Millisecond}}, func(context.Context, *bus.Msg) error {
			mu.Lock()
			defer mu.Unlock()
			calls++
			if calls == 1 {
				return errors.New("transient")
			}
			close(done)
			return nil
		})
	}()
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatal("message not redelivered")
	}
	var procs []sdktrace.ReadOnlySpan
	eventually(t, 5*time.Second, func() bool {
		procs = spansNamed(rec, "process "+contracts.SubjectCancel("acme"))
		return len(procs) == 2
	}, "two process spans")
	pubs := spansNamed(rec, "publish "+contracts.SubjectCancel("acme"))
	if len(pubs) != 1 {
		t.Fatalf("%d publish spans, want 1", len(pubs))
	}
	pub := pubs[0]
	if !hasAttr(pub, telemetry.AttrJobID, "j1") || !hasAttr(pub, telemetry.AttrTenant, "acme") {
		t.Errorf("publish span lacks the job's attributes: %v", pub.Attributes())
	}
	first, second := procs[0], procs[1]
	for _, p := range procs {
		if p.Parent().SpanID() != pub.SpanContext().SpanID() || p.SpanContext().TraceID() != root.SpanContext().TraceID() {
			t.Errorf("process span %v parent %v: want a child of the publish %v", p.SpanContext(), p.Parent(), pub.SpanContext())
		}
	}
	if len(first.Links()) != 0 {
		t.Errorf("first delivery has links %v", first.Links())
	}
	if l := second.Links(); len(l) != 1 || l[0].SpanContext.SpanID() != first.SpanContext().SpanID() {
		t.Errorf("redelivery links %v, want one to the first delivery %v", l, first.SpanContext())
	}
}

// TestBatchSpanLinksEachMessage: a batch has many causes, so its span is
// the child of none and links to every message's publish; a handler puts
// its work on one message in that message's trace with TraceContext.
func TestBatchSpanLinksEachMessage(t *testing.T) {
	b, rec, tr := tracedBus(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	roots := map[trace.TraceID]bool{}
	for _, id := range []string{"a", "b", "c"} {
		jctx, root := tr.Start(ctx, "submit "+id)
		if _, err := b.Publish(jctx, contracts.SubjectCancel("acme"), id, contracts.CancelRequest{JobID: id}); err != nil {
			t.Fatal(err)
		}
		root.End()
		roots[root.SpanContext().TraceID()] = true
	}
	seen := make(chan trace.TraceID, 3)
	go func() {
		_ = b.ConsumeBatch(ctx, bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "batchtrace", Batch: 10},
			func(_ context.Context, msgs []*bus.Msg) []error {
				for _, m := range msgs {
					seen <- trace.SpanContextFromContext(m.TraceContext(ctx)).TraceID()
				}
				return nil
			})
	}()
	for range 3 {
		select {
		case id := <-seen:
			if !roots[id] {
				t.Errorf("TraceContext gave trace %s, not a publisher's", id)
			}
		case <-ctx.Done():
			t.Fatal("batch not handled")
		}
	}
	var batches []sdktrace.ReadOnlySpan
	eventually(t, 5*time.Second, func() bool {
		batches = spansNamed(rec, "process batch "+contracts.StreamJobs)
		return len(batches) > 0
	}, "a batch span")
	linked := map[trace.TraceID]bool{}
	for _, s := range batches {
		for _, l := range s.Links() {
			linked[l.SpanContext.TraceID()] = true
		}
	}
	for id := range roots {
		if !linked[id] {
			t.Errorf("no batch span links to trace %s", id)
		}
	}
}

func hasAttr(s sdktrace.ReadOnlySpan, key, want string) bool {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key && kv.Value.AsString() == want {
			return true
		}
	}
	return false
}

// TestNakOnceHook: under EnvNakOnce a matching message's first delivery
// fails before its handler, so the handler sees only the redelivery; other
// subjects are untouched.
func TestNakOnceHook(t *testing.T) {
	t.Setenv(bus.EnvNakOnce, "gp.jobs.cancel.")
	b, _, _ := tracedBus(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), "c1", contracts.CancelRequest{JobID: "j1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Publish(ctx, contracts.SubjectSubmit("acme"), "s1", contracts.JobRequest{ID: "j2"}); err != nil {
		t.Fatal(err)
	}
	got := make(chan [2]any, 2)
	go func() {
		_ = b.Consume(ctx, bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "nakonce",
			Backoff: []time.Duration{10 * time.Millisecond}}, func(_ context.Context, m *bus.Msg) error {
			got <- [2]any{m.Subject, m.NumDelivered}
			return nil
		})
	}()
	want := map[string]uint64{contracts.SubjectCancel("acme"): 2, contracts.SubjectSubmit("acme"): 1}
	for range 2 {
		select {
		case g := <-got:
			if d := g[1].(uint64); d != want[g[0].(string)] {
				t.Errorf("%s handled at delivery %d, want %d", g[0], d, want[g[0].(string)])
			}
		case <-ctx.Done():
			t.Fatal("messages not handled")
		}
	}
}

// TestProcessSpanPutsABatchsMessageInItsTrace: a batch handler's span for
// one message (ProcessSpan) is a child of that message's publish, in its
// trace, with the job's attributes, and links to the batch's span.
func TestProcessSpanPutsABatchsMessageInItsTrace(t *testing.T) {
	b, rec, tr := tracedBus(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	jctx, root := tr.Start(ctx, "submit j1")
	if _, err := b.Publish(jctx, contracts.SubjectCancel("acme"), "j1", contracts.CancelRequest{JobID: "j1"},
		bus.CESubject("j1")); err != nil {
		t.Fatal(err)
	}
	root.End()
	done := make(chan trace.SpanContext, 1)
	go func() {
		_ = b.ConsumeBatch(ctx, bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "processspan", Batch: 10},
			func(bctx context.Context, msgs []*bus.Msg) []error {
				for _, m := range msgs {
					_, span := b.ProcessSpan(bctx, "processspan", m)
					span.End()
				}
				done <- trace.SpanContextFromContext(bctx)
				return nil
			})
	}()
	var batch trace.SpanContext
	select {
	case batch = <-done:
	case <-ctx.Done():
		t.Fatal("batch not handled")
	}
	name := "process " + contracts.SubjectCancel("acme")
	var spans []sdktrace.ReadOnlySpan
	eventually(t, 5*time.Second, func() bool { spans = spansNamed(rec, name); return len(spans) == 1 }, "the message's span")
	s := spans[0]
	if s.SpanContext().TraceID() != root.SpanContext().TraceID() {
		t.Errorf("span in trace %s, not the publisher's %s", s.SpanContext().TraceID(), root.SpanContext().TraceID())
	}
	if !hasAttr(s, "gpuplane.job_id", "j1") || !hasAttr(s, "gpuplane.tenant", "acme") {
		t.Errorf("span attributes %v: no job attributes", s.Attributes())
	}
	linked := false
	for _, l := range s.Links() {
		linked = linked || l.SpanContext.SpanID() == batch.SpanID()
	}
	if !linked {
		t.Errorf("span links %v: none to the batch's span %s", s.Links(), batch.SpanID())
	}
}
