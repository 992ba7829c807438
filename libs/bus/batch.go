package bus

import (
	"context"
	"fmt"
	"sync"
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
		b.handleBatch(ctx, spec, p, raws, h)
	}
}

// handleBatch runs h on one batch and settles each message.
func (b *Bus) handleBatch(ctx context.Context, spec ConsumerSpec, p *puller, raws []jetstream.Msg, h BatchHandler) {
	ctx, span, msgs := b.startBatch(ctx, spec, raws)
	defer span.End()
	b.settleBatch(ctx, spec, p, raws, msgs, span, safeBatchCall(ctx, h, msgs))
}

// startBatch wraps raws and starts the batch's span.
func (b *Bus) startBatch(ctx context.Context, spec ConsumerSpec, raws []jetstream.Msg) (context.Context, trace.Span, []*Msg) {
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
		), batchLinks(msgs))
	return ctx, span, msgs
}

// settleBatch settles each message of a batch by its error (errs nil: all
// succeeded).
func (b *Bus) settleBatch(ctx context.Context, spec ConsumerSpec, p *puller, raws []jetstream.Msg, msgs []*Msg, span trace.Span, errs []error) {
	if errs != nil && len(errs) != len(msgs) {
		errs = repeat(Permanent(fmt.Errorf("batch handler returned %d results for %d messages", len(errs), len(msgs))), len(msgs))
	}
	for i, raw := range raws {
		var err error
		if errs != nil {
			err = errs[i]
		}
		b.settle(ctx, spec, p, raw, msgs[i], span, err)
	}
}

// PipelinedBatchHandler starts handling a batch and returns as soon as
// the next batch may be started, with wait, which blocks until the batch's
// outcome is known and returns it as a BatchHandler does. The work between
// the two (a store's round trip) overlaps with taking and starting the
// next batches.
type PipelinedBatchHandler func(ctx context.Context, msgs []*Msg) (wait func() []error)

// ConsumeBatchPipelined is ConsumeBatch with up to inFlight batches
// started and not yet settled (at least 1): batch n+1 is taken and started
// while batch n is still being waited for. Every message is settled only
// after its batch's wait returned, by its own error, and batches are
// settled in the order they were taken. A panic in h or in wait is a
// permanent failure of the whole batch. Messages started and not settled
// stay held (kept alive) like any other.
func (b *Bus) ConsumeBatchPipelined(ctx context.Context, spec ConsumerSpec, inFlight int, h PipelinedBatchHandler) error {
	return b.consume(ctx, spec, func(cons jetstream.Consumer, spec ConsumerSpec) error {
		return b.consumePipelinedLoop(ctx, cons, spec, max(1, inFlight), h)
	})
}

func (b *Bus) consumePipelinedLoop(ctx context.Context, cons jetstream.Consumer, spec ConsumerSpec, inFlight int, h PipelinedBatchHandler) error {
	p, err := b.pull(ctx, cons, spec)
	if err != nil {
		return err
	}
	defer p.stop()
	slots := make(chan struct{}, inFlight)
	var wg sync.WaitGroup
	// Every started batch is settled before the puller stops.
	defer wg.Wait()
	prev := make(chan struct{})
	close(prev)
	for {
		raw, err := p.next(ctx)
		if err != nil {
			return err
		}
		raws := make([]jetstream.Msg, 0, spec.Batch)
		raws = append(raws, raw)
		for len(raws) < spec.Batch {
			raw, err := p.it.Next(jetstream.NextMaxWait(batchGather))
			if err != nil {
				break // nothing more on its way: handle what we have
			}
			p.hold.add(raw)
			raws = append(raws, raw)
		}
		slots <- struct{}{} // a batch started earlier always settles: no deadlock
		bctx, span, msgs := b.startBatch(ctx, spec, raws)
		wait := safePipelinedStart(bctx, h, msgs)
		done := make(chan struct{})
		wg.Add(1)
		go func(prev chan struct{}) {
			defer wg.Done()
			defer func() { <-slots }()
			defer close(done)
			defer span.End()
			errs := wait()
			<-prev // settle in the order taken
			b.settleBatch(bctx, spec, p, raws, msgs, span, errs)
		}(prev)
		prev = done
	}
}

// safePipelinedStart runs h, and makes a wait that turns a panic, of h or
// of its wait, into a permanent failure of the batch.
func safePipelinedStart(ctx context.Context, h PipelinedBatchHandler, msgs []*Msg) func() []error {
	panicked := func(r any) []error {
		return repeat(Permanent(fmt.Errorf("batch handler panic: %v", r)), len(msgs))
	}
	var wait func() []error
	func() {
		defer func() {
			if r := recover(); r != nil {
				errs := panicked(r)
				wait = func() []error { return errs }
			}
		}()
		wait = h(ctx, msgs)
	}()
	return func() (errs []error) {
		defer func() {
			if r := recover(); r != nil {
				errs = panicked(r)
			}
		}()
		return wait()
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
