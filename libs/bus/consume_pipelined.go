package bus

import (
	"context"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"
)

// PipelinedHandler starts handling one message and returns as soon as the
// next may be started, with wait, which blocks until the outcome is known
// and returns it as a Handler does. What lies between the two (the acks of
// async publishes) overlaps with starting the next messages.
type PipelinedHandler func(ctx context.Context, m *Msg) (wait func() error)

// ConsumePipelined is Consume for a handler that sends its writes without
// waiting for them (PublishAsync), so that the messages that have arrived
// share one round trip instead of taking one each. It starts, in stream
// order, the messages already on their way (up to spec.Batch, waiting only
// for the first), then waits for each and settles it in that order. A
// message whose Key (spec.Key, default the subject) is already among those
// started and unsettled waits until they settle: one key's messages are
// handled one after the other, as Consume's workers keep them. Each
// message has its own span, redelivery link and fate, as with Consume.
// Workers is not used; a panic in the handler or its wait is a permanent
// failure of that message.
func (b *Bus) ConsumePipelined(ctx context.Context, spec ConsumerSpec, h PipelinedHandler) error {
	return b.consume(ctx, spec, func(cons jetstream.Consumer, spec ConsumerSpec) error {
		return b.consumePipelinedMsgs(ctx, cons, spec, h)
	})
}

// started is one message of ConsumePipelined started and not yet settled.
type started struct {
	raw  jetstream.Msg
	m    *Msg
	ctx  context.Context
	span trace.Span
	wait func() error
}

func (b *Bus) consumePipelinedMsgs(ctx context.Context, cons jetstream.Consumer, spec ConsumerSpec, h PipelinedHandler) error {
	p, err := b.pull(ctx, cons, spec)
	if err != nil {
		return err
	}
	defer p.stop()
	key := spec.Key
	if key == nil {
		key = func(m *Msg) string { return m.Subject }
	}
	group := make([]started, 0, spec.Batch)
	keys := make(map[string]struct{}, spec.Batch)
	settleAll := func() {
		for _, s := range group {
			err := s.wait()
			b.attempted(s.m, s.span, err != nil)
			b.settle(s.ctx, spec, s.raw, s.m, s.span, err)
			s.span.End()
			p.hold.done(s.raw)
		}
		group = group[:0]
		clear(keys)
	}
	start := func(raw jetstream.Msg) {
		m := newMsg(raw)
		k := key(m)
		if _, busy := keys[k]; busy {
			settleAll()
		}
		keys[k] = struct{}{}
		mctx, span := b.startProcess(ctx, spec, m)
		wait := func() error { return nil }
		if err := b.nakOnce(m); err != nil {
			wait = func() error { return err }
		} else {
			wait = safeStart(mctx, h, m)
		}
		group = append(group, started{raw: raw, m: m, ctx: mctx, span: span, wait: wait})
	}
	for {
		raw, err := p.next(ctx)
		if err != nil {
			return err
		}
		start(raw)
		for len(group) < spec.Batch {
			raw, err := p.it.Next(jetstream.NextMaxWait(batchGather))
			if err != nil {
				break // nothing more on its way: settle what we started
			}
			p.hold.add(raw)
			start(raw)
		}
		settleAll()
	}
}

// safeStart runs h and makes a wait that turns a panic, of h or of its
// wait, into a permanent failure.
func safeStart(ctx context.Context, h PipelinedHandler, m *Msg) func() error {
	panicked := func(r any) error { return Permanent(fmt.Errorf("handler panic: %v", r)) }
	var wait func() error
	func() {
		defer func() {
			if r := recover(); r != nil {
				err := panicked(r)
				wait = func() error { return err }
			}
		}()
		wait = h(ctx, m)
	}()
	if wait == nil {
		return func() error { return nil }
	}
	return func() (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = panicked(r)
			}
		}()
		return wait()
	}
}
