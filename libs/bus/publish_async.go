package bus

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// Pending is a publish sent without waiting for its ack (PublishAsync).
// Wait settles it; every Pending must be waited for, or its span is never
// ended.
type Pending struct {
	out *outgoing
	// f is the ack's future; nil when the async send itself failed, and
	// Wait goes straight to the synchronous retries.
	f    jetstream.PubAckFuture
	sent time.Time
}

// PublishAsync is Publish without the wait: it sends the message at once
// and returns before the server's ack, so that many publishes share one
// round trip (send them all, then Wait for each). Messages sent on one
// connection are stored in the order sent, but a message that fails may
// be sent again by Wait after later ones were stored: a caller that needs
// an order between two messages (one job's events) must Wait for the first
// before sending the second.
func (b *Bus) PublishAsync(ctx context.Context, subject, id string, v any, opts ...PublishOption) (*Pending, error) {
	data, err := encode(v)
	if err != nil {
		return nil, fmt.Errorf("bus: encode %T for %s: %w", v, subject, err)
	}
	out, err := b.prepare(ctx, subject, id, data, append([]PublishOption{CEType(contracts.CEType(v))}, opts...))
	if err != nil {
		return nil, err
	}
	p := &Pending{out: out, sent: time.Now()}
	if f, err := b.js.PublishMsgAsync(out.msg, out.popts...); err == nil {
		p.f = f
	}
	return p, nil
}

// Wait waits for the ack of an async publish. One that failed, or whose
// ack did not come within publishAttempt of its send, is published again
// synchronously with Publish's retries (its message ID makes that safe:
// JetStream stores it once), unless NoRetry was given. A lost
// compare-and-set is returned at once, wrapped as ErrWrongLastSequence.
func (p *Pending) Wait(ctx context.Context) (*jetstream.PubAck, error) {
	defer p.out.span.End()
	if p.f != nil {
		timer := time.NewTimer(max(publishAttempt-time.Since(p.sent), 0))
		defer timer.Stop()
		select {
		case ack := <-p.f.Ok():
			p.out.acked(ack)
			return ack, nil
		case err := <-p.f.Err():
			if wrongLastSequence(err) || p.out.noRetry {
				return nil, p.out.failed(err)
			}
		case <-timer.C:
			if p.out.noRetry {
				return nil, p.out.failed(errors.New("no ack in time"))
			}
		case <-ctx.Done():
			return nil, p.out.failed(ctx.Err())
		}
	}
	return p.out.send(ctx)
}
