package scheduler

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

// publisher is what the scheduler needs of the bus to publish.
type publisher interface {
	Publish(ctx context.Context, subject, id string, v any, opts ...bus.PublishOption) (*jetstream.PubAck, error)
}

var _ publisher = (*bus.Bus)(nil)

// asyncPublisher publishes without waiting for each ack (bus.PublishAsync);
// the outbox uses it when its publisher has it.
type asyncPublisher interface {
	PublishAsync(ctx context.Context, subject, id string, v any, opts ...bus.PublishOption) (*bus.Pending, error)
}

var _ asyncPublisher = (*bus.Bus)(nil)

// outbox publishes the store's decisions. Messages with the same key (one
// job) go to the same shard and out in the order they were enqueued, so a
// reader never sees a job's running event before its scheduled one;
// different jobs publish in parallel. Enqueue never blocks, so it is called
// under the scheduler's lock: that is what keeps the order of decisions.
type outbox struct {
	pub    publisher
	log    *slog.Logger
	shards []*shard
	// traces, when set, puts each publish in its job's trace.
	traces *jobTraces
}

type shard struct {
	mu     sync.Mutex
	items  []outItem
	signal chan struct{}
}

type outItem struct {
	state.Publish
	done chan error // nil when nobody waits
}

func newOutbox(pub publisher, n int, log *slog.Logger) *outbox {
	o := &outbox{pub: pub, log: log}
	for range n {
		o.shards = append(o.shards, &shard{signal: make(chan struct{}, 1)})
	}
	return o
}

// enqueue queues pubs. With wait, it returns one channel per message that
// receives the publish's outcome.
func (o *outbox) enqueue(pubs []state.Publish, wait bool) []chan error {
	var dones []chan error
	for _, p := range pubs {
		it := outItem{Publish: p}
		if wait {
			it.done = make(chan error, 1)
			dones = append(dones, it.done)
		}
		h := fnv.New32a()
		_, _ = h.Write([]byte(p.Key))
		sh := o.shards[h.Sum32()%uint32(len(o.shards))]
		sh.mu.Lock()
		sh.items = append(sh.items, it)
		sh.mu.Unlock()
		select {
		case sh.signal <- struct{}{}:
		default:
		}
	}
	return dones
}

// run publishes until ctx ends; what is left then is reported to its
// waiters as ctx's error (and rebuilt from the streams after a restart).
func (o *outbox) run(ctx context.Context) error {
	ctx, fail := context.WithCancelCause(ctx)
	defer fail(nil)
	var wg sync.WaitGroup
	for _, sh := range o.shards {
		wg.Go(func() { o.drain(ctx, sh, fail) })
	}
	wg.Wait()
	if err := context.Cause(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// drain publishes one shard's messages in order. A publish that fails for
// good stops the outbox with an error, and with it the scheduler: the store
// has already moved past a fact readers never got, and a restart rebuilds it
// from the streams, which is the recovery this design relies on. Dropping
// the message instead would leave readers behind for good.
func (o *outbox) drain(ctx context.Context, sh *shard, fail context.CancelCauseFunc) {
	for {
		select {
		case <-ctx.Done():
			sh.mu.Lock()
			left := sh.items
			sh.items = nil
			sh.mu.Unlock()
			for _, it := range left {
				if it.done != nil {
					it.done <- ctx.Err()
				}
			}
			return
		case <-sh.signal:
		}
		for {
			sh.mu.Lock()
			batch := sh.items
			sh.items = nil
			sh.mu.Unlock()
			if len(batch) == 0 {
				break
			}
			for len(batch) > 0 && ctx.Err() == nil {
				n := distinctKeys(batch, maxInFlight)
				o.publishAll(ctx, batch[:n], fail)
				batch = batch[n:]
			}
			for _, rest := range batch {
				if rest.done != nil {
					rest.done <- ctx.Err()
				}
			}
		}
	}
}

// maxInFlight bounds the messages of one shard sent and not yet acked.
const maxInFlight = 256

// distinctKeys is the length of the longest prefix of items, at most max,
// in which no key comes twice: the messages publishAll may send together.
// A job's second message waits for its first to be stored, so a failed
// first one, sent again, still comes before it.
func distinctKeys(items []outItem, max int) int {
	if len(items) == 1 {
		return 1
	}
	seen := make(map[string]struct{}, min(len(items), max))
	for i, it := range items {
		if _, dup := seen[it.Key]; dup || i == max {
			return i
		}
		seen[it.Key] = struct{}{}
	}
	return len(items)
}

// publishAll publishes items of distinct keys, in order, and reports each
// outcome to its waiter. With a bus it sends them all before waiting for
// any ack: one round trip for the lot instead of one each. A message
// whose async send fails goes again through publish's retries.
func (o *outbox) publishAll(ctx context.Context, items []outItem, fail context.CancelCauseFunc) {
	pending := make([]*bus.Pending, len(items))
	if ap, ok := o.pub.(asyncPublisher); ok && len(items) > 1 {
		for i, it := range items {
			pctx := ctx
			if o.traces != nil {
				pctx = o.traces.jobContext(ctx, it.Key)
			}
			// An error (the message does not encode) is publish's to
			// report below.
			pending[i], _ = ap.PublishAsync(pctx, it.Subject, it.ID, it.Msg, bus.CESubject(it.Key))
		}
	}
	for i, it := range items {
		var err error
		if p := pending[i]; p != nil {
			if _, err = p.Wait(ctx); err == nil && o.traces != nil {
				o.traces.published(it.Publish)
			}
		}
		if pending[i] == nil || err != nil {
			if ctx.Err() != nil {
				err = ctx.Err()
			} else {
				err = o.publish(ctx, it.Publish)
			}
		}
		if it.done != nil {
			it.done <- err
		}
		if err != nil && ctx.Err() == nil {
			fail(fmt.Errorf("outbox: %s not published, restart to rebuild: %w", it.ID, err))
		}
	}
}

// publish sends one message. The bus already retries transient failures
// until ctx ends; what fails anyway is retried a few times, then returned
// (and drain stops the scheduler).
func (o *outbox) publish(ctx context.Context, p state.Publish) error {
	delay := 100 * time.Millisecond
	pctx := ctx
	if o.traces != nil {
		pctx = o.traces.jobContext(ctx, p.Key)
	}
	for attempt := 1; ; attempt++ {
		_, err := o.pub.Publish(pctx, p.Subject, p.ID, p.Msg, bus.CESubject(p.Key))
		if err == nil && o.traces != nil {
			o.traces.published(p)
		}
		if err == nil || ctx.Err() != nil {
			return err
		}
		if attempt == 5 {
			o.log.Error("giving up on a publish", "subject", p.Subject, "id", p.ID, "err", err)
			return err
		}
		o.log.Warn("publish failed; retrying", "subject", p.Subject, "id", p.ID, "err", err)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
		delay *= 2
	}
}
