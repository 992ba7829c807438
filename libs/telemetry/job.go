package telemetry

import (
	"context"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// The attributes every span about a job carries, so that Jaeger's tag
// search (tags={"gpuplane.job_id":"..."}) finds a job's trace, and a
// tenant's.
const (
	AttrJobID   = "gpuplane.job_id"
	AttrTenant  = "gpuplane.tenant"
	AttrNode    = "gpuplane.node"
	AttrAttempt = "gpuplane.attempt"
	AttrPool    = "gpuplane.pool"
)

// JobAttrs are the attributes of a span about one job of one tenant.
func JobAttrs(tenant, jobID string) []attribute.KeyValue {
	return []attribute.KeyValue{attribute.String(AttrTenant, tenant), attribute.String(AttrJobID, jobID)}
}

// AllocAttrs are JobAttrs plus the node and attempt of one allocation.
func AllocAttrs(tenant, jobID, node string, attempt int) []attribute.KeyValue {
	return append(JobAttrs(tenant, jobID), attribute.String(AttrNode, node), attribute.Int(AttrAttempt, attempt))
}

var w3c = propagation.TraceContext{}

// TraceParent is the W3C traceparent of ctx's span, or "" when ctx holds
// none: what a message or record remembers to continue a trace later.
func TraceParent(ctx context.Context) string {
	c := propagation.MapCarrier{}
	w3c.Inject(ctx, c)
	return c.Get("traceparent")
}

// ParseTraceParent is the span context a traceparent names (invalid when
// tp is empty or malformed).
func ParseTraceParent(tp string) trace.SpanContext {
	if tp == "" {
		return trace.SpanContext{}
	}
	return trace.SpanContextFromContext(w3c.Extract(context.Background(), propagation.MapCarrier{"traceparent": tp}))
}

// WithTraceParent returns ctx continuing the trace tp names, so that spans
// started from it are children of that trace (a job's, remembered with
// the job) rather than new roots or children of whatever ctx held. An
// empty or malformed tp leaves ctx as it is.
func WithTraceParent(ctx context.Context, tp string) context.Context {
	if sc := ParseTraceParent(tp); sc.IsValid() {
		return trace.ContextWithRemoteSpanContext(ctx, sc)
	}
	return ctx
}

// LinkTo is a link to the span tp names (none when tp is invalid), with
// why as the link's gpuplane.link attribute.
func LinkTo(tp, why string) []trace.Link {
	sc := ParseTraceParent(tp)
	if !sc.IsValid() {
		return nil
	}
	return []trace.Link{{SpanContext: sc, Attributes: []attribute.KeyValue{attribute.String("gpuplane.link", why)}}}
}

// noisySubjects are the subjects published every second or so by every
// machine: a span for each would be almost every trace stored (658 of 679
// under `make run`) and tell nothing about any job.
var noisySubjects = []string{"gp.telemetry.", "gp.heartbeat."}

// noisyStreams are the streams of noisySubjects, for batch spans.
var noisyStreams = []string{"TELEMETRY", "HEARTBEATS"}

// IsNoisy reports whether a span of this name is one quietSampler drops.
func IsNoisy(name string) bool {
	_, rest, ok := strings.Cut(name, " ")
	if !ok {
		return false
	}
	rest = strings.TrimPrefix(rest, "batch ")
	for _, p := range noisySubjects {
		if strings.HasPrefix(rest, p) {
			return true
		}
	}
	for _, s := range noisyStreams {
		if rest == s {
			return true
		}
	}
	return false
}

// quietSampler drops the spans of telemetry and heartbeat traffic (named
// "publish gp.telemetry.<node>", "process gp.heartbeat.<node>", "process
// batch TELEMETRY" by libs/bus) and leaves every other decision to next.
type quietSampler struct{ next sdktrace.Sampler }

func (s quietSampler) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	if IsNoisy(p.Name) {
		return sdktrace.SamplingResult{Decision: sdktrace.Drop,
			Tracestate: trace.SpanContextFromContext(p.ParentContext).TraceState()}
	}
	return s.next.ShouldSample(p)
}

func (s quietSampler) Description() string { return "Quiet{" + s.next.Description() + "}" }

// Sampler is the sampler NewTracing installs: telemetry and heartbeat
// spans dropped whatever their parent, the rest parent-based with ratio
// of new traces kept.
func Sampler(ratio float64) sdktrace.Sampler {
	return quietSampler{next: sdktrace.ParentBased(sdktrace.TraceIDRatioBased(ratio))}
}

type attrsKey struct{}

// WithAttrs returns ctx carrying attrs (added to what it carries), which
// libs/bus puts on the span of every publish made with it: a service says
// once which job (tenant, node) its work is about, and the messages it
// publishes for it are found by Jaeger's tag search.
func WithAttrs(ctx context.Context, attrs ...attribute.KeyValue) context.Context {
	prev := Attrs(ctx)
	all := make([]attribute.KeyValue, 0, len(prev)+len(attrs))
	return context.WithValue(ctx, attrsKey{}, append(append(all, prev...), attrs...))
}

// Attrs are the attributes ctx carries (WithAttrs).
func Attrs(ctx context.Context) []attribute.KeyValue {
	a, _ := ctx.Value(attrsKey{}).([]attribute.KeyValue)
	return a
}

// JobContext is ctx continuing the job's trace (tp, remembered with the
// job) and carrying its attributes, for work done on the job long after
// its submit.
func JobContext(ctx context.Context, tp string, attrs ...attribute.KeyValue) context.Context {
	return WithAttrs(WithTraceParent(ctx, tp), attrs...)
}

// PlanAttr names a scheduler's plan.
func PlanAttr(planID string) attribute.KeyValue { return attribute.String("gpuplane.plan_id", planID) }

// Annotate adds attrs to the span in ctx (a no-op without one): a handler
// names the job a message was about once it has decoded it.
func Annotate(ctx context.Context, attrs ...attribute.KeyValue) {
	trace.SpanFromContext(ctx).SetAttributes(attrs...)
}

// StartJobSpan starts a span about one job in the job's trace (tp, the
// traceparent remembered with the job, e.g. contracts.Allocation's), with
// attrs on the span and on the returned context (for the publishes made
// under it). What ctx's span was doing (a plan's delivery, a run's end, a
// lost node) caused this work but is not the job's trace: it becomes a
// link ("cause"), not the parent. Without a valid tp the span is simply a
// child of ctx.
func StartJobSpan(ctx context.Context, tracer trace.Tracer, name, tp string, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	opts := []trace.SpanStartOption{trace.WithAttributes(attrs...)}
	cause := trace.SpanContextFromContext(ctx)
	if sc := ParseTraceParent(tp); sc.IsValid() {
		if cause.IsValid() && cause.SpanID() != sc.SpanID() {
			opts = append(opts, trace.WithLinks(trace.Link{SpanContext: cause,
				Attributes: []attribute.KeyValue{attribute.String("gpuplane.link", "cause")}}))
		}
		ctx = trace.ContextWithRemoteSpanContext(ctx, sc)
	}
	ctx, span := tracer.Start(WithAttrs(ctx, attrs...), name, opts...)
	return ctx, span
}
