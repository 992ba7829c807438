package scheduler

import (
	"context"
	"strings"
	"sync"

	"go.opentelemetry.io/otel/trace"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/telemetry"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

// jobTraces remembers each live job's trace context (a W3C traceparent),
// so that what the scheduler publishes about a job long after its submit
// (scheduled, running, succeeded, requeued, its plan items and commands)
// continues the job's one trace instead of starting a new root. It is
// learnt from the submit's delivery and, after a restart, from the
// headers of the job's events as JOB_EVENTS is replayed; a terminal job
// is forgotten.
type jobTraces struct {
	mu sync.Mutex
	tp map[string]string // state.Key(tenant, job) -> traceparent
}

func newJobTraces() *jobTraces { return &jobTraces{tp: map[string]string{}} }

// remember keeps tp for key unless one is already known: the first is the
// job's (a redelivered submit or a later event must not move it).
func (t *jobTraces) remember(key, tp string) {
	if tp == "" {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.tp[key]; !ok {
		t.tp[key] = tp
	}
}

func (t *jobTraces) get(key string) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.tp[key]
}

func (t *jobTraces) forget(key string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.tp, key)
}

// replayed learns a job's trace from one of its replayed events.
func (t *jobTraces) replayed(m *bus.Msg, ev contracts.JobEvent) {
	key := state.Key(ev.Tenant, ev.JobID)
	if ev.State.Terminal() {
		t.forget(key)
		return
	}
	t.remember(key, telemetry.TraceParent(m.TraceContext(context.Background())))
}

// jobContext is ctx continuing the trace of the job key names, with its
// attributes, for a publish about it; ctx as it is for keys that name no
// known job (a node's or pool's).
func (t *jobTraces) jobContext(ctx context.Context, key string) context.Context {
	tenant, job, ok := strings.Cut(key, "/")
	if !ok {
		return ctx
	}
	return telemetry.JobContext(ctx, t.get(key), telemetry.JobAttrs(tenant, job)...)
}

// published forgets a job once its terminal event is out.
func (t *jobTraces) published(p state.Publish) {
	if ev, ok := p.Msg.(contracts.JobEvent); ok && ev.State.Terminal() {
		t.forget(p.Key)
	}
}

// tracePlan puts each item of p in its job's trace: a span "plan <job>"
// per item, a child of the job's trace, whose traceparent the item
// carries on (resource manager, ledger, node agent, billing). It returns
// the context to publish p under: a plan of one job is published in that
// job's trace; a plan of several has several causes, so its publish is
// the child of none and links to every item's span.
func (s *scheduler) tracePlan(ctx context.Context, p *contracts.Plan) (context.Context, func()) {
	tracer := s.bus.Tracer()
	links := make([]trace.Link, 0, len(p.Items))
	var single context.Context
	for i := range p.Items {
		it := &p.Items[i]
		attrs := telemetry.AllocAttrs(it.Tenant, it.JobID, it.NodeID, it.Attempt)
		jctx := telemetry.JobContext(ctx, s.traces.get(state.Key(it.Tenant, it.JobID)), attrs...)
		jctx, span := tracer.Start(jctx, "plan "+it.JobID, trace.WithAttributes(attrs...),
			trace.WithAttributes(telemetry.PlanAttr(p.ID)))
		it.TraceParent = telemetry.TraceParent(jctx)
		links = append(links, trace.Link{SpanContext: span.SpanContext()})
		span.End()
		if len(p.Items) == 1 {
			single = jctx
		}
	}
	if single != nil {
		return single, func() {}
	}
	ctx, span := tracer.Start(ctx, "plan "+p.ID, trace.WithLinks(links...),
		trace.WithAttributes(telemetry.PlanAttr(p.ID)))
	return ctx, func() { span.End() }
}
