package bus

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/telemetry"
)

// headerCarrier carries the W3C trace context in NATS headers. NATS header
// keys are case-sensitive, unlike HTTP's, so propagation.HeaderCarrier
// (which canonicalizes to "Traceparent") would not interoperate with other
// NATS clients that write and read "traceparent".
type headerCarrier nats.Header

var _ propagation.TextMapCarrier = headerCarrier{}

func (c headerCarrier) Get(key string) string { return nats.Header(c).Get(key) }

func (c headerCarrier) Set(key, value string) { nats.Header(c).Set(key, value) }

func (c headerCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// Tracer is the bus's tracer, for the spans a service starts around its
// own work (a job's plan, run or usage), so they share the bus's provider.
// A nil Bus (a test's server without one) has a no-op tracer.
func (b *Bus) Tracer() trace.Tracer {
	if b == nil || b.tracer == nil {
		return noop.NewTracerProvider().Tracer("")
	}
	return b.tracer
}

// TraceContext is ctx continuing the trace m's headers carry (its
// publisher's span): what a batch handler uses to put its work on one
// message into that message's trace, since the batch's own span has
// several parents and can be the child of none.
func (m *Msg) TraceContext(ctx context.Context) context.Context {
	return propagation.TraceContext{}.Extract(ctx, headerCarrier(m.Header))
}

// attempts remembers the span of each delivery that failed and was
// redelivered, so that the next delivery's span links to it (a span with
// two causes: the publish, its parent, and the attempt before). Bounded:
// a message redelivered after a restart, or past the bound, links to its
// publish instead.
type attempts struct {
	mu    sync.Mutex
	spans map[string]trace.SpanContext // stream/seq -> the last failed attempt's span
}

const maxAttempts = 10000

func attemptKey(m *Msg) string { return m.Stream + "/" + strconv.FormatUint(m.StreamSeq, 10) }

// redeliveryLinks are the links of the span of m's delivery: none on the
// first delivery; on a redelivery, the span of the attempt before when
// this process saw it fail, else m's publish (its parent too: the link
// says that this span is a retry, and a redelivery never starts a new
// root).
func (b *Bus) redeliveryLinks(ctx context.Context, m *Msg) trace.SpanStartOption {
	if m.NumDelivered <= 1 {
		return trace.WithLinks()
	}
	attrs := []attribute.KeyValue{attribute.String("gpuplane.link", "redelivery"),
		attribute.Int64("messaging.nats.delivered", int64(m.NumDelivered))}
	b.attempts.mu.Lock()
	prev, ok := b.attempts.spans[attemptKey(m)]
	b.attempts.mu.Unlock()
	if !ok {
		prev = trace.SpanContextFromContext(ctx)
	}
	if !prev.IsValid() {
		return trace.WithLinks()
	}
	return trace.WithLinks(trace.Link{SpanContext: prev, Attributes: attrs})
}

// attempted records how m's delivery ended: a failure the next delivery
// will link to, or success, which forgets it.
func (b *Bus) attempted(m *Msg, span trace.Span, failed bool) {
	if !failed && m.NumDelivered <= 1 {
		return // the common case: nothing was remembered, no lock taken
	}
	b.attempts.mu.Lock()
	defer b.attempts.mu.Unlock()
	k := attemptKey(m)
	if !failed {
		delete(b.attempts.spans, k)
		return
	}
	if b.attempts.spans == nil {
		b.attempts.spans = map[string]trace.SpanContext{}
	}
	if len(b.attempts.spans) >= maxAttempts {
		for old := range b.attempts.spans {
			delete(b.attempts.spans, old)
			break
		}
	}
	b.attempts.spans[k] = span.SpanContext()
}

// EnvNakOnce names a subject prefix whose messages every consumer of this
// process fails once (before its handler) and so gets again: a test hook
// that forces a real redelivery (e2e's trace test). Never set it in
// production.
const EnvNakOnce = "GPUPLANE_TEST_NAK_ONCE"

// errNakOnce is the failure EnvNakOnce injects.
var errNakOnce = errors.New("first delivery refused by " + EnvNakOnce + " (test hook)")

// nakOnce is the error of m's delivery under EnvNakOnce: errNakOnce on its
// first delivery when its subject has the prefix, else nil.
func (b *Bus) nakOnce(m *Msg) error {
	if b.nakOncePrefix == "" || m.NumDelivered > 1 || !strings.HasPrefix(m.Subject, b.nakOncePrefix) {
		return nil
	}
	return errNakOnce
}

// batchLinks links a batch's span to the publish of each of its messages
// (up to 128): a batch has many causes and is the child of none of them.
func batchLinks(msgs []*Msg) trace.SpanStartOption {
	var links []trace.Link
	for _, m := range msgs[:min(len(msgs), 128)] {
		if sc := trace.SpanContextFromContext(m.TraceContext(context.Background())); sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc})
		}
	}
	return trace.WithLinks(links...)
}

// jobAttrs are the job attributes (telemetry.JobAttrs, and the node) of a
// message about one job, read from its subject and CloudEvents subject
// (an allocation ID is tenant/job/attempt): the span of its delivery, and
// the publishes its handler makes, are then found by Jaeger's tag search
// without every handler naming the job. None for other messages.
func jobAttrs(m *Msg) []attribute.KeyValue {
	tok := strings.Split(m.Subject, ".")
	if len(tok) < 3 || tok[0] != "gp" {
		return nil
	}
	ce := m.Header.Get(contracts.HeaderCESubject)
	var tenant, job, node string
	switch {
	case tok[1] == "jobs" && len(tok) == 4 && (tok[2] == "submit" || tok[2] == "cancel"):
		tenant, job = tok[3], ce
	case tok[1] == "jobs" && len(tok) == 5 && tok[2] == "events":
		tenant, job = tok[3], tok[4]
	case tok[1] == "logs" && len(tok) == 5:
		tenant, job, node = tok[2], tok[3], tok[4]
	case (tok[1] == "alloc" && tok[2] == "ledger" && len(tok) == 4) || (tok[1] == "runs" && len(tok) == 3):
		node = tok[len(tok)-1]
		parts := strings.SplitN(ce, "/", 3)
		if len(parts) < 2 {
			return nil
		}
		tenant, job = parts[0], parts[1]
	case tok[1] == "usage" && len(tok) == 3:
		parts := strings.SplitN(ce, "/", 3)
		if len(parts) < 2 || parts[0] != tok[2] {
			return nil
		}
		tenant, job = parts[0], parts[1]
	default:
		return nil
	}
	if tenant == "" || job == "" {
		return nil
	}
	attrs := telemetry.JobAttrs(tenant, job)
	if node != "" {
		attrs = append(attrs, attribute.String(telemetry.AttrNode, node))
	}
	return attrs
}

// ProcessSpan starts the span of a batch handler's work on one message of
// its batch: the span Consume starts for each message (a child of the
// message's publisher's span, with the job's attributes, in the returned
// context too), linked to the batch's span (ctx's), which has many
// parents and can be the child of none. Without it a batch consumer's
// work, and what it publishes, would leave the jobs' traces. The caller
// ends the span once the message is handled.
func (b *Bus) ProcessSpan(ctx context.Context, durable string, m *Msg) (context.Context, trace.Span) {
	batch := trace.LinkFromContext(ctx)
	ctx, span := b.startProcess(ctx, ConsumerSpec{Durable: durable}, m)
	if batch.SpanContext.IsValid() {
		span.AddLink(batch)
	}
	return ctx, span
}
