package bus

import (
	"cmp"
	"context"
	"fmt"
	"runtime"
	"sync"

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
// issue 17). At most four groups are unsettled at once: one settling, two
// waiting for the settler, one starting. Messages are taken and prepared
// (spec.Prepare) ahead of their start, up to Batch of them, on other
// goroutines. MaxAckPending bounds all of these together (the scheduler's
// is 4 × Batch): a group ends when nothing more arrives within a
// millisecond, so a smaller bound only overlaps less. A message whose Key (spec.Key, default the subject) is
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

// fetched is a message ConsumePipelined took, on its way to be started:
// ready is closed once m and key are set (prepared), and prepErr if
// preparing it panicked. A group marker (group) ends the messages that
// were on their way together; err ends them all.
type fetched struct {
	raw     jetstream.Msg
	m       *Msg
	key     string
	prepErr error
	ready   chan struct{}
	group   bool
	err     error
}

// prepareWorkers bounds the goroutines that prepare messages.
const prepareWorkers = 8

func (b *Bus) consumePipelinedMsgs(ctx context.Context, cons jetstream.Consumer, spec ConsumerSpec, h PipelinedHandler) error {
	p, err := b.pull(ctx, cons, spec)
	if err != nil {
		return err
	}
	key := spec.Key
	if key == nil {
		key = func(m *Msg) string { return m.Subject }
	}
	// The settler settles the groups in the order handed. Handing blocks
	// while two wait for it: back-pressure, and at most four groups
	// unsettled. More than one waiting lets acks that the stream is slow
	// to give overlap more starts (a 16-core burst's trace had the starter
	// blocked handing a group for 190 ms of 1.1 s). Every started message
	// is settled before the puller stops (below).
	groups := make(chan *startedGroup, 2)
	settlerDone := make(chan struct{})
	go func() {
		defer close(settlerDone)
		for g := range groups {
			for _, s := range g.msgs {
				err := s.wait()
				b.attempted(s.m, s.span, err != nil)
				b.settle(s.ctx, spec, p, s.raw, s.m, s.span, err)
				s.span.End()
			}
			close(g.done)
		}
	}()
	// The fetcher takes the messages and has them prepared (newMsg, key,
	// spec.Prepare) on several goroutines; they reach the starter below
	// in stream order.
	fctx, stopFetch := context.WithCancel(ctx)
	out := b.fetchPrepared(fctx, p, spec, key)
	var unstarted []*fetched // taken, never to be started
	defer func() {
		// Stop taking and pulling (the drain also takes what the
		// iterator received and the fetcher did not), settle what was
		// started (everything held is kept alive meanwhile), and only
		// then hand back what was taken and not started. Handed back
		// before the settling, a message could reach another consumer (a
		// new leader) while an earlier message of its key is unsettled
		// here; handed back, or Nak'ed by its settling, while this
		// iterator still pulls, it would come back into its buffer and
		// wait out AckWait (both from a review).
		stopFetch()
		for f := range out {
			if f.raw != nil {
				unstarted = append(unstarted, f)
			}
		}
		p.drain()
		close(groups)
		<-settlerDone
		for _, f := range unstarted {
			<-f.ready // its preparing is done with it
			p.handBack(f.raw)
		}
		p.stop() // hands them back with what the iterator held
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
	for f := range out {
		switch {
		case ctx.Err() != nil:
			if f.raw != nil {
				unstarted = append(unstarted, f)
			}
			hand(g)
			return ctx.Err()
		case f.err != nil:
			hand(g)
			return f.err
		case f.group:
			hand(g)
			g = newStartedGroup(spec.Batch)
			continue
		}
		<-f.ready
		m, k := f.m, f.key
		if _, busy := g.keys[k]; busy {
			hand(g)
			waitSettled()
			g = newStartedGroup(spec.Batch)
		} else if busyHanded(k) {
			waitSettled()
		}
		g.keys[k] = struct{}{}
		mctx, span := b.startProcess(ctx, spec, m)
		var wait func() error
		switch err := cmp.Or(b.nakOnce(m), f.prepErr); {
		case err != nil:
			wait = func() error { return err }
		default:
			wait = safeStart(mctx, h, m)
		}
		g.msgs = append(g.msgs, started{raw: f.raw, m: m, ctx: mctx, span: span, wait: wait})
	}
	hand(g)
	return ctx.Err()
}

// fetchPrepared takes the consumer's messages until ctx ends or the
// puller fails (a last item with err), in stream order, each prepared by
// one of a few workers, with a group marker after the messages that were
// on their way together (up to spec.Batch, waiting only for the first).
// The channel is closed once nothing more comes.
func (b *Bus) fetchPrepared(ctx context.Context, p *puller, spec ConsumerSpec, key func(*Msg) string) <-chan *fetched {
	out := make(chan *fetched, spec.Batch)
	work := make(chan *fetched, spec.Batch)
	var wg sync.WaitGroup
	for range min(prepareWorkers, runtime.GOMAXPROCS(0)) {
		wg.Go(func() {
			for f := range work {
				prepare(f, spec, key)
			}
		})
	}
	send := func(f *fetched) bool {
		select {
		case out <- f:
			return true
		case <-ctx.Done():
			return false
		}
	}
	take := func(raw jetstream.Msg) {
		// Always sent, even once ctx ended: the starter reads until the
		// channel closes, and hands back what it does not start.
		f := &fetched{raw: raw, ready: make(chan struct{})}
		out <- f
		work <- f
	}
	go func() {
		defer close(out)
		defer wg.Wait()
		defer close(work)
		for {
			raw, err := p.next(ctx)
			if err != nil {
				send(&fetched{err: err})
				return
			}
			take(raw)
			for n := 1; n < spec.Batch; n++ {
				raw, err := p.it.Next(jetstream.NextMaxWait(batchGather))
				if err != nil {
					break // nothing more on its way: the group ends here
				}
				p.hold.add(raw)
				take(raw)
			}
			if !send(&fetched{group: true}) {
				return
			}
		}
	}()
	return out
}

// prepare fills f's message and key, and its Prepared; a panic of key or
// spec.Prepare fails the message for good.
func prepare(f *fetched, spec ConsumerSpec, key func(*Msg) string) {
	defer close(f.ready)
	f.m = newMsg(f.raw)
	defer func() {
		if r := recover(); r != nil {
			f.prepErr = Permanent(fmt.Errorf("prepare panic: %v", r))
			f.key = f.m.Subject
		}
	}()
	f.key = key(f.m)
	if spec.Prepare != nil {
		f.m.Prepared = spec.Prepare(f.m)
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
