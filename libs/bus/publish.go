package bus

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/gpuplane/gpuplane/libs/telemetry"

	"github.com/gpuplane/gpuplane/contracts"
)

// ErrWrongLastSequence is returned (wrapped) by Publish when an
// expected-last-subject-sequence check failed: someone else wrote to the
// subject first. It is the compare-and-set conflict of the ledger.
var ErrWrongLastSequence = errors.New("bus: wrong last sequence")

// PublishOption adjusts one publish.
type PublishOption func(*publishOpts)

type publishOpts struct {
	expectLastSubjSeq *uint64
	expectLastSeq     *uint64
	ceSubject         string
	ceType            string
	header            nats.Header
	noRetry           bool
}

// ExpectLastSubjectSeq makes the publish fail with ErrWrongLastSequence
// unless the last message on the same subject has sequence seq (0: none).
func ExpectLastSubjectSeq(seq uint64) PublishOption {
	return func(o *publishOpts) { o.expectLastSubjSeq = &seq }
}

// ExpectLastSeq makes the publish fail with ErrWrongLastSequence unless the
// stream's last message has sequence seq (0: the stream is empty): a
// compare-and-set on the whole stream, for a stream that is one chain
// (the audit trail).
func ExpectLastSeq(seq uint64) PublishOption {
	return func(o *publishOpts) { o.expectLastSeq = &seq }
}

// CESubject sets the CloudEvents subject attribute (e.g. the job ID).
func CESubject(s string) PublishOption { return func(o *publishOpts) { o.ceSubject = s } }

// CEType overrides the CloudEvents type derived from the message.
func CEType(s string) PublishOption { return func(o *publishOpts) { o.ceType = s } }

// Header adds a header to the message.
func Header(k, v string) PublishOption {
	return func(o *publishOpts) {
		if o.header == nil {
			o.header = nats.Header{}
		}
		o.header.Set(k, v)
	}
}

// NoRetry makes a failed publish return at once instead of retrying
// transient errors until ctx ends.
func NoRetry() PublishOption { return func(o *publishOpts) { o.noRetry = true } }

// Publish encodes v as JSON and publishes it to subject with Nats-Msg-Id
// and ce-id set to id, CloudEvents headers and the trace context of ctx.
// Transient failures are retried until ctx ends: the message ID makes a
// retried publish safe, JetStream stores it once.
func (b *Bus) Publish(ctx context.Context, subject, id string, v any, opts ...PublishOption) (*jetstream.PubAck, error) {
	data, err := encode(v)
	if err != nil {
		return nil, fmt.Errorf("bus: encode %T for %s: %w", v, subject, err)
	}
	return b.PublishRaw(ctx, subject, id, data, append([]PublishOption{CEType(contracts.CEType(v))}, opts...)...)
}

// encode is JSON without HTML escaping: json.Marshal writes '<', '>' and
// '&' as six bytes each, which can grow a request echoed in an event past
// the stream's message size limit; nothing here is embedded in HTML.
func encode(v any) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}

// publishAttempt bounds one attempt of a publish (JetStream's own default
// ack wait); a transient failure is retried until the caller's ctx ends.
const publishAttempt = 5 * time.Second

// PublishRaw publishes already-encoded data; Publish is the usual entry.
func (b *Bus) PublishRaw(ctx context.Context, subject, id string, data []byte, opts ...PublishOption) (*jetstream.PubAck, error) {
	out, err := b.prepare(ctx, subject, id, data, opts)
	if err != nil {
		return nil, err
	}
	defer out.span.End()
	return out.send(ctx)
}

// outgoing is one message ready to publish, with its span (ended by
// whoever settles it).
type outgoing struct {
	b       *Bus
	subject string
	msg     *nats.Msg
	popts   []jetstream.PublishOpt
	noRetry bool
	span    trace.Span
}

// maxHeaders is the most headers a message of the platform carries: the
// CloudEvents binding's ce-specversion, ce-type, ce-source, ce-id and
// ce-subject, Nats-Msg-Id, a compare-and-set's
// Nats-Expected-Last-Subject-Sequence (the ledger) and a traceparent.
// Every reader (nats.go, for each of a message's ~20 deliveries in a
// burst) decodes a message's headers into a map, and Go's maps hold up to
// 8 entries in one group: a ninth doubles the bytes of the decode (a
// traced ledger entry, 10 headers before: 1,752 vs 912 B, 16 vs 11
// allocations and ~1.7x the time for each delivery, BenchmarkHeaderDecode).
// So two headers that told a reader nothing it lacked are not sent:
// content-type (every body is JSON, which a CloudEvent without
// datacontenttype is in this binding) and ce-time (optional in
// CloudEvents; the stream stores each message with its own timestamp,
// Msg.Timestamp). No reader of the platform read either.
// TestPublishedHeadersFitOneMapGroup holds publishes to it.
const maxHeaders = 8

// prepare builds the message of a publish: CloudEvents headers, the trace
// context of ctx (the publish's own span, started here) and the
// JetStream options.
func (b *Bus) prepare(ctx context.Context, subject, id string, data []byte, opts []PublishOption) (*outgoing, error) {
	var o publishOpts
	for _, opt := range opts {
		opt(&o)
	}
	if o.ceType == "" {
		o.ceType = "io.gpuplane.raw.v1"
	}
	if id == "" {
		return nil, fmt.Errorf("bus: publish to %s: empty message ID", subject)
	}
	var span trace.Span
	if !b.traced {
		// A no-op span: it carries ctx's trace context into the headers
		// and drops a name and attributes (startProcess).
		ctx, span = b.tracer.Start(ctx, "")
	} else {
		ctx, span = b.startPublish(ctx, subject, id, o.ceType)
	}

	// Room for every header a publish sets, so the map is made once.
	msg := &nats.Msg{Subject: subject, Data: data, Header: make(nats.Header, maxHeaders)}
	for k, vs := range o.header {
		for _, v := range vs {
			msg.Header.Add(k, v)
		}
	}
	msg.Header.Set(contracts.HeaderCESpecVersion, contracts.CESpecVersion)
	msg.Header.Set(contracts.HeaderCEType, o.ceType)
	msg.Header.Set(contracts.HeaderCESource, "/gpuplane/"+b.name)
	msg.Header.Set(contracts.HeaderCEID, id)
	if o.ceSubject != "" {
		msg.Header.Set(contracts.HeaderCESubject, o.ceSubject)
	}
	b.prop.Inject(ctx, headerCarrier(msg.Header))

	popts := []jetstream.PublishOpt{jetstream.WithMsgID(id)}
	if o.expectLastSubjSeq != nil {
		popts = append(popts, jetstream.WithExpectLastSequencePerSubject(*o.expectLastSubjSeq))
	}
	if o.expectLastSeq != nil {
		popts = append(popts, jetstream.WithExpectLastSequence(*o.expectLastSeq))
	}
	return &outgoing{b: b, subject: subject, msg: msg, popts: popts, noRetry: o.noRetry, span: span}, nil
}

// startPublish starts the span of a publish, with the job attributes of
// ctx (telemetry.WithAttrs) so that Jaeger's tag search finds it.
func (b *Bus) startPublish(ctx context.Context, subject, id, ceType string) (context.Context, trace.Span) {
	return b.tracer.Start(ctx, "publish "+subject,
		trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(
			attribute.String("messaging.system", "nats"),
			attribute.String("messaging.destination.name", subject),
			attribute.String("messaging.message.id", id),
			attribute.String("cloudevents.event_type", ceType),
		), trace.WithAttributes(telemetry.Attrs(ctx)...))
}

// send publishes the message and waits for its ack, retrying transient
// failures until ctx ends unless NoRetry was given.
func (out *outgoing) send(ctx context.Context) (*jetstream.PubAck, error) {
	var ack *jetstream.PubAck
	publish := func() error {
		// Each attempt waits for its ack at most publishAttempt: a
		// publish the server refused is never acked, and the refusal
		// (seen by the error handler) ends the retries after one.
		actx, cancel := context.WithTimeout(ctx, publishAttempt)
		defer cancel()
		var err error
		ack, err = out.b.js.PublishMsg(actx, out.msg, out.popts...)
		if err != nil && out.b.refused(out.subject) {
			// The server said no (the error handler saw it); the ack
			// timeout is only how the client noticed.
			return fmt.Errorf("%w to publish %s: %w", ErrPermissionDenied, out.subject, err)
		}
		return err
	}
	var err error
	if out.noRetry {
		err = publish()
	} else {
		err = retry(ctx, publish)
	}
	if err != nil {
		return nil, out.failed(err)
	}
	out.acked(ack)
	return ack, nil
}

// failed wraps a publish's error (a lost compare-and-set as
// ErrWrongLastSequence) and records it on the span.
func (out *outgoing) failed(err error) error {
	if wrongLastSequence(err) {
		err = fmt.Errorf("%w: %s: %w", ErrWrongLastSequence, out.subject, err)
	} else {
		err = fmt.Errorf("bus: publish %s: %w", out.subject, err)
	}
	out.span.RecordError(err)
	out.span.SetStatus(codes.Error, err.Error())
	return err
}

func (out *outgoing) acked(ack *jetstream.PubAck) {
	if !out.span.IsRecording() {
		return
	}
	out.span.SetAttributes(attribute.String("messaging.nats.stream", ack.Stream),
		attribute.String("messaging.nats.sequence", strconv.FormatUint(ack.Sequence, 10)),
		attribute.Bool("messaging.nats.duplicate", ack.Duplicate))
}

// wrongLastSequence reports whether err is JetStream's refusal of an
// expected-last-sequence check.
func wrongLastSequence(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
		apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
}

// PublishCore publishes v on core NATS (no stream, no ack): for
// fire-and-forget signals that are not records. Most messages should use
// Publish.
func (b *Bus) PublishCore(ctx context.Context, subject string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("bus: encode %T: %w", v, err)
	}
	msg := nats.NewMsg(subject)
	msg.Data = data
	b.prop.Inject(ctx, headerCarrier(msg.Header))
	return b.nc.PublishMsg(msg)
}
