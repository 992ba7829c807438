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
// order, the messages already on their way (a group of up to spec.Batch,
// waiting only for the first), then hands the group to a settler, which
// waits for each and settles it in that order while the next group is
// started: waiting for one group's acks overlaps starting the next (on a
// 16-core host the intake spent a quarter of a burst waiting for acks,
// issue 17). At most two groups are unsettled at once: one settling, one
// starting. A message whose Key (spec.Key, default the subject) is
// already among those started and unsettled waits until they all settle:
// one key's messages are handled one after the other, as Consume's workers
// keep them. A wait may therefore run while later messages (of other
// keys) start. Each message has its own span, redelivery link and fate,
// as with Consume. Workers is not used; a panic in the handler or its wait
// is a permanent failure of that message.
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

// startedGroup is the messages ConsumePipelined started together, settled
// together; done is closed once every one is.
type startedGroup struct {
	msgs []started
	keys map[string]struct{}
	done chan struct{}
}

func newStartedGroup(n int) *startedGroup {
	return &startedGroup{msgs: make([]started, 0, n), keys: make(map[string]struct{}, n), done: make(chan struct{})}
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
	// The settler settles the groups in the order handed. Handing blocks
	// while it still settles the one before: back-pressure, and at most
	// two groups unsettled. Every started message is settled before the
	// puller stops (defers run last in, first out).
	groups := make(chan *startedGroup)
	settlerDone := make(chan struct{})
	go func() {
		defer close(settlerDone)
		for g := range groups {
			for _, s := range g.msgs {
				err := s.wait()
				b.attempted(s.m, s.span, err != nil)
				b.settle(s.ctx, spec, s.raw, s.m, s.span, err)
				s.span.End()
				p.hold.done(s.raw)
			}
			close(g.done)
		}
	}()
	defer func() {
		close(groups)
		<-settlerDone
	}()
	var handed []*startedGroup // handed to the settler, oldest first; maybe settled
	hand := func(g *startedGroup) {
		if len(g.msgs) > 0 {
			groups <- g
			handed = append(handed, g)
		}
	}
	waitSettled := func() {
		if len(handed) > 0 {
			<-handed[len(handed)-1].done // the settler goes in order
		}
		handed = handed[:0]
	}
	busyHanded := func(k string) bool {
		for len(handed) > 0 {
			select {
			case <-handed[0].done:
				handed = handed[1:]
				continue
			default:
			}
			break
		}
		for _, g := range handed {
			if _, busy := g.keys[k]; busy {
				return true
			}
		}
		return false
	}
	g := newStartedGroup(spec.Batch)
	start := func(raw jetstream.Msg) {
		m := newMsg(raw)
		k := key(m)
		if _, busy := g.keys[k]; busy {
			hand(g)
			waitSettled()
			g = newStartedGroup(spec.Batch)
		} else if busyHanded(k) {
			waitSettled()
		}
		g.keys[k] = struct{}{}
		mctx, span := b.startProcess(ctx, spec, m)
		wait := func() error { return nil }
		if err := b.nakOnce(m); err != nil {
			wait = func() error { return err }
		} else {
			wait = safeStart(mctx, h, m)
		}
		g.msgs = append(g.msgs, started{raw: raw, m: m, ctx: mctx, span: span, wait: wait})
	}
	for {
		raw, err := p.next(ctx)
		if err != nil {
			return err
		}
		start(raw)
		for len(g.msgs) < spec.Batch {
			raw, err := p.it.Next(jetstream.NextMaxWait(batchGather))
			if err != nil {
				break // nothing more on its way: settle what we started
			}
			p.hold.add(raw)
			start(raw)
		}
		hand(g)
		g = newStartedGroup(spec.Batch)
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
