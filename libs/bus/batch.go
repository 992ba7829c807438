package bus

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// BatchHandler handles messages taken together, in stream order. It
// returns one error per message, each with the meaning Handler gives it
// (nil: ack; Permanent: dead-letter; RetryAfter or any other: redeliver),
// or a nil slice when every message succeeded.
type BatchHandler func(ctx context.Context, msgs []*Msg) []error

// batchGather is how long a batch waits for messages already on their way
// once it has its first: long enough to take what the server is sending,
// far too short to delay a lone message noticeably.
const batchGather = time.Millisecond

// ConsumeBatch is Consume for a handler that amortizes a round trip over
// many messages (a store written with one pipelined call per batch). It
// takes the messages that have arrived, up to spec.Batch, waiting only for
// the first: a batch is never held back to fill up. Workers and Key are
// not used. A panic in h is a permanent failure of the whole batch.
// Messages are acknowledged without waiting for the server's confirmation
// (one round trip per message would cost more than the batch saved): an
// ack lost on the way is a redelivery, which h must take in its stride,
// as every handler must.
func (b *Bus) ConsumeBatch(ctx context.Context, spec ConsumerSpec, h BatchHandler) error {
	return b.consume(ctx, spec, func(cons jetstream.Consumer, spec ConsumerSpec) error {
		return b.consumeBatchLoop(ctx, cons, spec, h)
	})
}

func (b *Bus) consumeBatchLoop(ctx context.Context, cons jetstream.Consumer, spec ConsumerSpec, h BatchHandler) error {
	p, err := b.pull(ctx, cons, spec)
	if err != nil {
		return err
	}
	defer p.stop()
	raws := make([]jetstream.Msg, 0, spec.Batch)
	for {
		raw, err := p.next(ctx)
		if err != nil {
			return err
		}
		raws = append(raws[:0], raw)
		for len(raws) < spec.Batch {
			raw, err := p.it.Next(jetstream.NextMaxWait(batchGather))
			if err != nil {
				break // nothing more on its way: handle what we have
			}
			p.hold.add(raw)
			raws = append(raws, raw)
		}
		b.handleBatch(ctx, spec, raws, h)
		for _, raw := range raws {
			p.hold.done(raw)
		}
	}
}

// handleBatch runs h on one batch and settles each message.
func (b *Bus) handleBatch(ctx context.Context, spec ConsumerSpec, raws []jetstream.Msg, h BatchHandler) {
	msgs := make([]*Msg, len(raws))
	for i, raw := range raws {
		msgs[i] = newMsg(raw)
	}
	ctx, span := b.tracer.Start(ctx, "process batch "+spec.Stream,
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			attribute.String("messaging.system", "nats"),
			attribute.String("messaging.consumer.group.name", spec.Durable),
			attribute.Int("messaging.batch.message_count", len(msgs)),
		))
	defer span.End()
	errs := safeBatchCall(ctx, h, msgs)
	if errs != nil && len(errs) != len(msgs) {
		errs = repeat(Permanent(fmt.Errorf("batch handler returned %d results for %d messages", len(errs), len(msgs))), len(msgs))
	}
	for i, raw := range raws {
		var err error
		if errs != nil {
			err = errs[i]
		}
		b.settle(ctx, spec, raw, msgs[i], span, err, false)
	}
}

func safeBatchCall(ctx context.Context, h BatchHandler, msgs []*Msg) (errs []error) {
	defer func() {
		if r := recover(); r != nil {
			errs = repeat(Permanent(fmt.Errorf("batch handler panic: %v", r)), len(msgs))
		}
	}()
	return h(ctx, msgs)
}

func repeat(err error, n int) []error {
	out := make([]error, n)
	for i := range out {
		out[i] = err
	}
	return out
}
