package bus

import (
	"context"
	"errors"
	"fmt"
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
		return m.StreamSeq >= target || m.NumPending == 0, nil
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

// read runs an ordered consumer and calls fn for each message until fn
// says stop, fn fails, or ctx ends.
func (b *Bus) read(ctx context.Context, spec FollowSpec, fn func(context.Context, *Msg) (stop bool, err error)) error {
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
	nexts, quit := make(chan next), make(chan struct{})
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
	stream, err := b.js.Stream(ctx, spec.Stream)
	if err != nil {
		return 0, fmt.Errorf("bus: stream %s: %w", spec.Stream, err)
	}
	filters := spec.FilterSubjects
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
