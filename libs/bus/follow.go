package bus

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// FollowSpec selects what an ordered (ephemeral, ack-less) read of a stream
// delivers. Ordered reads rebuild state and feed read models; they never
// move a durable consumer.
type FollowSpec struct {
	Stream         string
	FilterSubjects []string
	// StartSeq starts at this stream sequence; 0 starts at the first
	// message, unless New is set.
	StartSeq uint64
	// New delivers only messages published after the read starts.
	New bool
	// LastPerSubject starts with the last message of each subject.
	LastPerSubject bool
	// NamePrefix names the ordered consumer <NamePrefix>_<n> instead of a
	// random name: a node agent's permissions name its consumers
	// (contracts.NodeReplayPrefix). Two reads with one prefix must not
	// run at once on the same stream.
	NamePrefix string
	// StallAfter bounds how long the read may deliver nothing while the
	// stream holds a matching message past its position before its
	// consumer is replaced; 0 means DefaultStallAfter.
	StallAfter time.Duration
}

// Replay calls fn for every message the stream holds now that matches the
// spec, in stream order, and returns the sequence of the last one (0 when
// there was none). Messages published during the replay may or may not be
// included; Follow from the returned sequence+1 to continue without a gap.
func (b *Bus) Replay(ctx context.Context, spec FollowSpec, fn func(context.Context, *Msg) error) (uint64, error) {
	target, err := b.lastSeq(ctx, spec)
	if err != nil || target == 0 || target < spec.StartSeq {
		return 0, err
	}
	var last uint64
	err = b.read(ctx, spec, func(ctx context.Context, m *Msg) (bool, error) {
		if err := fn(ctx, m); err != nil {
			return true, err
		}
		last = m.StreamSeq
		if m.StreamSeq >= target || m.NumPending > 0 {
			return m.StreamSeq >= target, nil
		}
		// The consumer's server counts nothing more, short of the
		// target. It may hold a stale copy of the stream (a member
		// that was cut off while others stored the last messages: the
		// chaos suite saw a new scheduler leader's rebuild end there and
		// forget the jobs queued last), or the messages up to the target
		// were deleted since. Ask the stream again, as the target was
		// asked: stop only once it holds nothing past here; else read
		// on, and the stall watch replaces a consumer stuck behind it.
		now, err := b.lastSeq(ctx, spec)
		if err != nil {
			return true, err
		}
		target = min(target, now)
		return m.StreamSeq >= target, nil
	})
	return last, err
}

// Follow calls fn for every matching message, then for each new one, until
// ctx ends (it then returns nil) or fn fails. caughtUp, if not nil, is
// called once when the messages present at the start have been delivered
// (at once when there were none): a read model is ready from then on.
func (b *Bus) Follow(ctx context.Context, spec FollowSpec, fn func(context.Context, *Msg) error, caughtUp func()) error {
	var target uint64
	if !spec.New {
		var err error
		if target, err = b.lastSeq(ctx, spec); err != nil {
			return err
		}
	}
	signalled := false
	signal := func() {
		if !signalled && caughtUp != nil {
			signalled = true
			caughtUp()
		}
	}
	if target == 0 || target < spec.StartSeq {
		signal()
	}
	err := b.read(ctx, spec, func(ctx context.Context, m *Msg) (bool, error) {
		if err := fn(ctx, m); err != nil {
			return true, err
		}
		if m.StreamSeq >= target {
			signal()
		}
		return false, nil
	})
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// DefaultStallAfter is how long an ordered read may deliver nothing while
// its stream holds a matching message past its position before the bus
// replaces its consumer (FollowSpec.StallAfter). It is above the time
// nats.go's own rebuild takes after a NATS server's death when it works
// (an election, one to three seconds), so the two do not race in the
// common case, and far below the 40 s and more it takes when it does not.
const DefaultStallAfter = 5 * time.Second

// readPos is where a read stands: the last sequence handed to its
// handler, and when it last moved or was found caught up with its stream.
type readPos struct {
	mu sync.Mutex
	// next is the first sequence the read still needs: after the last
	// one handed to fn once started, and 0 while unknown (a read of new
	// messages whose consumer does not exist yet).
	next     uint64
	started  bool
	progress time.Time
	// busy is set while fn runs: a slow handler is not a stall, and its
	// context must not end under it. replacing is set once the consumer
	// is given up: fn is not called again until the next one starts.
	busy, replacing bool
}

func (p *readPos) isBusy() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.busy
}

func (p *readPos) get() (next uint64, started bool, progress time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.next, p.started, p.progress
}

// read runs an ordered consumer and calls fn for each message until fn
// says stop, fn fails, or ctx ends.
//
// nats.go rebuilds an ordered consumer by itself after a gap or a NATS
// server's death, but not always in time: on a 3-server cluster about one
// server death in five kept its rebuild failing for more than 40 s (each
// create waits up to 10 s, its back-off grows to 10 s), and a consumer
// on a member that died, or created on a fresh cluster whose first pulls
// go unanswered, delivers nothing until nats.go misses its heartbeats
// (about 10 s in libs/bus's cluster tests). So read watches its
// own consumer (watchStall): once it has delivered nothing for
// spec.StallAfter while the stream holds a matching message past the last
// one delivered, the consumer is abandoned and a new one starts right
// after that message. fn sees every sequence once and in order: a
// replaced consumer is stopped before the next starts, and a sequence at
// or before the last delivered one is skipped.
func (b *Bus) read(ctx context.Context, spec FollowSpec, fn func(context.Context, *Msg) (stop bool, err error)) error {
	stallAfter := cmp.Or(spec.StallAfter, DefaultStallAfter)
	pos := &readPos{progress: time.Now()}
	switch {
	case spec.New:
	case spec.StartSeq > 0 && !spec.LastPerSubject:
		pos.next = spec.StartSeq
	default:
		pos.next = 1
	}
	deliver := func(ctx context.Context, m *Msg) (bool, error) {
		pos.mu.Lock()
		skip := pos.replacing || pos.started && m.StreamSeq < pos.next
		pos.busy = !skip
		pos.mu.Unlock()
		if skip {
			// Delivered before, or by a consumer given up: the next
			// one starts at pos.next.
			return false, nil
		}
		stop, err := fn(ctx, m)
		pos.mu.Lock()
		pos.next, pos.started, pos.progress, pos.busy = m.StreamSeq+1, true, time.Now(), false
		pos.mu.Unlock()
		return stop, err
	}
	cur := spec
	for replaced := 0; ; replaced++ {
		rctx, cancel := context.WithCancel(ctx)
		stalled := make(chan struct{})
		watching := make(chan struct{})
		go func() {
			defer close(watching)
			if b.watchStall(rctx, spec, stallAfter, pos) {
				close(stalled)
				cancel()
			}
		}()
		err := b.readOnce(rctx, cur, deliver, pos)
		cancel()
		<-watching
		if ctx.Err() != nil {
			return ctx.Err()
		}
		select {
		case <-stalled:
		default:
			return err
		}
		next, started, _ := pos.get()
		b.log.Warn("bus: ordered read stalled behind its stream; replacing its consumer",
			"stream", spec.Stream, "next_seq", next, "stall", stallAfter, "replaced", replaced+1)
		if started || spec.New && next > 0 {
			// Resume at the first sequence not yet handed to fn. A read
			// of the last message per subject that delivered none yet
			// starts over as asked: it has lost nothing.
			cur.New, cur.LastPerSubject, cur.StartSeq = false, false, next
		}
		pos.mu.Lock()
		pos.progress, pos.replacing = time.Now(), false
		pos.mu.Unlock()
	}
}

// watchStall reports true once the read at pos has delivered nothing for
// stallAfter while the stream holds a matching message past pos, and
// false when ctx ends first. It asks the stream only when the read has
// been quiet for stallAfter/2: a read that delivers costs nothing.
func (b *Bus) watchStall(ctx context.Context, spec FollowSpec, stallAfter time.Duration, pos *readPos) bool {
	tick := time.NewTicker(stallAfter / 4)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-tick.C:
		}
		if _, _, progress := pos.get(); time.Since(progress) < stallAfter/2 || pos.isBusy() {
			continue
		}
		lctx, cancel := context.WithTimeout(ctx, stallAfter)
		last, err := b.lastSeqOnce(lctx, spec)
		cancel()
		if err != nil {
			// The stream cannot be asked (no leader, a lost
			// connection): a new consumer could not be created either.
			continue
		}
		pos.mu.Lock()
		behind := pos.next > 0 && last >= pos.next
		if !behind {
			pos.progress = time.Now()
		}
		stalled := behind && !pos.busy && time.Since(pos.progress) >= stallAfter
		pos.replacing = stalled
		pos.mu.Unlock()
		if stalled {
			return true
		}
	}
}

// pumpAhead is how many messages readOnce's pump may hold for its reader.
const pumpAhead = 256

// readOnce reads through one ordered consumer (that nats.go may rebuild)
// until fn says stop, fn fails, or ctx ends. A read of new messages sets
// pos.next to where its consumer starts, so watchStall can tell whether
// it is behind before it delivers.
func (b *Bus) readOnce(ctx context.Context, spec FollowSpec, fn func(context.Context, *Msg) (stop bool, err error), pos *readPos) error {
	// A short inactive threshold lets the server drop the ephemeral
	// consumer soon after the reader stops (the default is 5 minutes); an
	// ordered consumer recreates itself if a slow reader trips it.
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: spec.FilterSubjects, InactiveThreshold: 30 * time.Second,
		NamePrefix: spec.NamePrefix}
	switch {
	case spec.New:
		cfg.DeliverPolicy = jetstream.DeliverNewPolicy
	case spec.LastPerSubject:
		cfg.DeliverPolicy = jetstream.DeliverLastPerSubjectPolicy
	case spec.StartSeq > 0:
		cfg.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
		cfg.OptStartSeq = spec.StartSeq
	default:
		cfg.DeliverPolicy = jetstream.DeliverAllPolicy
	}
	if spec.NamePrefix != "" {
		// nats.go names the consumer <prefix>_<n>, n counting resets from
		// 1, and creates it with create-or-update: a leftover of an earlier
		// read (a reader that crashed within the inactive threshold, maybe
		// after resets) would be taken over, already delivered, and the
		// read would wait forever. Remove every one the name can take.
		for n := 1; n <= contracts.NodeReplayResets; n++ {
			name := fmt.Sprintf("%s_%d", spec.NamePrefix, n)
			err := b.js.DeleteConsumer(ctx, spec.Stream, name)
			if err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
				return fmt.Errorf("bus: remove leftover consumer %s on %s: %w", name, spec.Stream, err)
			}
		}
	}
	var cons jetstream.Consumer
	// Each try has its own bound (retryEach): on a cluster still electing,
	// or busy creating what every service asks for at once, a create can
	// go unanswered, and nats.go's default wait is 5 s per request.
	if err := retryEach(ctx, func(ctx context.Context) error {
		var err error
		cons, err = b.js.OrderedConsumer(ctx, spec.Stream, cfg)
		return err
	}); err != nil {
		return fmt.Errorf("bus: ordered consumer on %s: %w", spec.Stream, err)
	}
	if info := cons.CachedInfo(); info != nil && spec.New {
		// A read of new messages starts after the stream's last message
		// at its creation: the server reports it as delivered.
		pos.mu.Lock()
		if !pos.started && pos.next == 0 {
			pos.next = info.Delivered.Stream + 1
		}
		pos.mu.Unlock()
	}
	if spec.NamePrefix != "" {
		// The next read with this prefix starts from _1 again: remove
		// this one rather than leave it to the inactive threshold.
		defer func() {
			if info := cons.CachedInfo(); info != nil {
				dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
				defer cancel()
				_ = b.js.DeleteConsumer(dctx, spec.Stream, info.Name)
			}
		}()
	}
	it, err := cons.Messages()
	if err != nil {
		return fmt.Errorf("bus: read %s: %w", spec.Stream, err)
	}
	// nats.go rebuilds an ordered consumer inside Next (after a gap, or a
	// NATS server's death), retrying without looking at ctx and under a
	// lock that Stop takes too: on a 3-server cluster about one server
	// death in five kept a rebuild failing for more than 40 s, and the
	// read (with the service's shutdown) could not end. Next runs in a
	// pump, so that a read whose ctx ends returns at once; a rebuild in
	// progress is then stopped in the background.
	type next struct {
		raw jetstream.Msg
		err error
	}
	// The pump reads ahead (messages nats.go has already pulled): an
	// unbuffered hand-off switched goroutines for every message, the
	// larger part of a replay's own cost. What is read ahead and not
	// handed to fn when the read ends is dropped, as nats.go's buffer is;
	// a replaced consumer starts after the last message fn saw.
	nexts, quit := make(chan next, pumpAhead), make(chan struct{})
	stopInBackground := false
	defer func() {
		close(quit)
		if stopInBackground {
			go it.Stop()
		} else {
			it.Stop()
		}
	}()
	go func() {
		for {
			raw, err := it.Next(jetstream.NextContext(ctx))
			select {
			case nexts <- next{raw, err}:
			case <-quit:
				return
			}
			if errors.Is(err, jetstream.ErrMsgIteratorClosed) {
				return
			}
		}
	}()
	for {
		var n next
		select {
		case n = <-nexts:
		case <-ctx.Done():
			stopInBackground = true
			return ctx.Err()
		}
		raw, err := n.raw, n.err
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if errors.Is(err, jetstream.ErrMsgIteratorClosed) {
				return fmt.Errorf("bus: read %s: %w", spec.Stream, err)
			}
			continue // the ordered consumer resets itself on gaps
		}
		m := newMsg(raw)
		mctx := b.prop.Extract(ctx, headerCarrier(m.Header))
		stop, err := fn(mctx, m)
		if err != nil {
			return err
		}
		if stop {
			return nil
		}
	}
}

// lastSeq is the sequence of the last message matching spec's filters now,
// or 0 when there is none. Its reads are retried, each with its own bound
// (retryEach), like every JetStream request a service starts with.
func (b *Bus) lastSeq(ctx context.Context, spec FollowSpec) (uint64, error) {
	var last uint64
	err := retryEach(ctx, func(ctx context.Context) error {
		var err error
		last, err = b.lastSeqOnce(ctx, spec)
		return err
	})
	return last, err
}

func (b *Bus) lastSeqOnce(ctx context.Context, spec FollowSpec) (uint64, error) {
	filters := spec.FilterSubjects
	if len(filters) > 0 && !b.directReads {
		// The leader: a direct get may be answered by a replica that
		// lags, and a target short of the stream ends a Replay short of
		// it (LeaderLast). No stream info: one request to the leader
		// per filter is the whole cost.
		last, err := LeaderLast(ctx, b.nc, spec.Stream, filters)
		if err != nil {
			return 0, fmt.Errorf("bus: last message of %v on %s: %w", filters, spec.Stream, err)
		}
		return last, nil
	}
	stream, err := b.js.Stream(ctx, spec.Stream)
	if err != nil {
		return 0, fmt.Errorf("bus: stream %s: %w", spec.Stream, err)
	}
	if len(filters) == 0 {
		info := stream.CachedInfo()
		if info.State.Msgs == 0 {
			return 0, nil
		}
		return info.State.LastSeq, nil
	}
	var last uint64
	for _, f := range filters {
		msg, err := stream.GetLastMsgForSubject(ctx, f)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("bus: last message of %s on %s: %w", f, spec.Stream, err)
		}
		last = max(last, msg.Sequence)
	}
	return last, nil
}
