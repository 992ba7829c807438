package scheduler

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/telemetry"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

// TestJobTracesSurviveReplay: a job's trace is learnt from its submit's
// delivery, or after a restart from the headers of its first replayed
// event; a later event or redelivery does not move it; what is published
// about the job continues it with the job's attributes; a terminal job is
// forgotten.
func TestJobTracesSurviveReplay(t *testing.T) {
	const submit = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	const later = "00-11111111111111111111111111111111-2222222222222222-01"
	event := func(tp string, st contracts.JobState) (*bus.Msg, contracts.JobEvent) {
		h := nats.Header{}
		if tp != "" {
			h.Set("traceparent", tp)
		}
		return &bus.Msg{Subject: contracts.SubjectJobEvents("acme", "j1"), Header: h},
			contracts.JobEvent{Tenant: "acme", JobID: "j1", State: st}
	}
	key := state.Key("acme", "j1")
	for _, tc := range []struct {
		name  string
		steps func(*jobTraces)
		want  string // trace ID, "" for none
	}{
		{"live submit", func(tr *jobTraces) {
			tr.remember(key, submit)
			tr.remember(key, later) // a redelivered submit
		}, "4bf92f3577b34da6a3ce929d0e0e4736"},
		{"replayed after a restart", func(tr *jobTraces) {
			tr.replayed(event(submit, contracts.StateQueued))
			tr.replayed(event(later, contracts.StateRunning))
		}, "4bf92f3577b34da6a3ce929d0e0e4736"},
		{"replayed to its end", func(tr *jobTraces) {
			tr.replayed(event(submit, contracts.StateQueued))
			tr.replayed(event(later, contracts.StateSucceeded))
		}, ""},
		{"published its end", func(tr *jobTraces) {
			tr.remember(key, submit)
			_, ev := event("", contracts.StateFailed)
			tr.published(state.Publish{Key: key, Msg: ev})
		}, ""},
		{"untraced submit", func(tr *jobTraces) {
			tr.replayed(event("", contracts.StateQueued))
		}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := newJobTraces()
			tc.steps(tr)
			ctx := tr.jobContext(context.Background(), key)
			got := ""
			if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
				got = sc.TraceID().String()
			}
			if got != tc.want {
				t.Errorf("job context in trace %q, want %q", got, tc.want)
			}
			attrs := map[string]string{}
			for _, kv := range telemetry.Attrs(ctx) {
				attrs[string(kv.Key)] = kv.Value.AsString()
			}
			if attrs[telemetry.AttrJobID] != "j1" || attrs[telemetry.AttrTenant] != "acme" {
				t.Errorf("job context attributes %v, want the job's", attrs)
			}
		})
	}
	// A key that names no job (a pool's demand) leaves ctx alone.
	if ctx := newJobTraces().jobContext(context.Background(), "pool-a"); len(telemetry.Attrs(ctx)) != 0 {
		t.Errorf("a non-job key got attributes %v", telemetry.Attrs(ctx))
	}
}

// TestPlanSpans: each plan item gets a span in its job's trace, whose
// traceparent the item carries on; a plan of one job is published in that
// job's trace; a plan of several is published under a span that is the
// child of none and links to every item's span.
func TestPlanSpans(t *testing.T) {
	srv := natstest.Start(t)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "plans", TracerProvider: tp, CredsFile: natstest.Operator(t, srv)})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close(context.Background())
	s := &scheduler{bus: b, traces: newJobTraces()}
	jobs := map[string]trace.SpanContext{}
	for _, id := range []string{"a", "b"} {
		_, span := tp.Tracer("test").Start(context.Background(), "submit "+id)
		span.End()
		jobs[id] = span.SpanContext()
		s.traces.remember(state.Key("acme", id), telemetry.TraceParent(trace.ContextWithSpanContext(context.Background(), span.SpanContext())))
	}
	item := func(id string) contracts.Allocation {
		return contracts.Allocation{Tenant: "acme", JobID: id, NodeID: "n1", Attempt: 1}
	}

	one := contracts.Plan{ID: "p1", Items: []contracts.Allocation{item("a")}}
	pctx, end := s.tracePlan(context.Background(), &one)
	end()
	if got := trace.SpanContextFromContext(pctx).TraceID(); got != jobs["a"].TraceID() {
		t.Errorf("one-job plan published in trace %s, want the job's %s", got, jobs["a"].TraceID())
	}

	two := contracts.Plan{ID: "p2", Items: []contracts.Allocation{item("a"), item("b")}}
	pctx, end = s.tracePlan(context.Background(), &two)
	end()
	planSC := trace.SpanContextFromContext(pctx)
	for _, it := range two.Items {
		if sc := telemetry.ParseTraceParent(it.TraceParent); sc.TraceID() != jobs[it.JobID].TraceID() {
			t.Errorf("item %s carries trace %s, want its job's %s", it.JobID, sc.TraceID(), jobs[it.JobID].TraceID())
		}
	}
	for _, sp := range rec.Ended() {
		if sp.SpanContext().SpanID() != planSC.SpanID() {
			continue
		}
		if sp.Parent().IsValid() {
			t.Errorf("a plan of two jobs is the child of %v", sp.Parent())
		}
		linked := map[trace.TraceID]bool{}
		for _, l := range sp.Links() {
			linked[l.SpanContext.TraceID()] = true
		}
		if !linked[jobs["a"].TraceID()] || !linked[jobs["b"].TraceID()] {
			t.Errorf("plan span links %v, want both jobs' traces", sp.Links())
		}
		return
	}
	t.Error("no span for the plan of two jobs")
}
