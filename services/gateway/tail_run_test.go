package gateway

import (
	"context"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// run follows JOB_EVENTS from RingEvents before its end (filling the ring)
// until ctx ends: a tail with a read of its own, for the tail's tests and
// the two-reads baseline of BenchmarkJobEventRead. The gateway's tail has
// none: its read model's fold feeds it (ingester.tail), so each job event
// is delivered to the gateway once, not twice (issue 17). A read that
// fails starts again after the last message read.
func (t *eventTail) run(ctx context.Context) error {
	start, err := t.startSeq(ctx)
	if err != nil {
		return nil // ctx ended
	}
	t.startAt(start)
	for {
		t.mu.Lock()
		next := t.last + 1
		t.mu.Unlock()
		err := t.bus.Follow(ctx, bus.FollowSpec{Stream: contracts.StreamJobEvents, StartSeq: next}, t.apply, t.caughtUp)
		if ctx.Err() != nil {
			return nil
		}
		t.log.Warn("job event tail stopped; reading again", "stream", contracts.StreamJobEvents, "stream_seq", next, "err", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
	}
}

// apply adds one message to the ring and hands it to the subscribers it
// matches. It never blocks on a subscriber.
func (t *eventTail) apply(_ context.Context, m *bus.Msg) error {
	if !t.wants(m.StreamSeq) {
		return nil
	}
	e, perr := parseTailEvent(m.Subject, m.StreamSeq, m.Data)
	t.add(m.Subject, m.StreamSeq, e, perr)
	return nil
}
