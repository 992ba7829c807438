package gateway

import (
	"context"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

// laggingServer is JetStream as a consumer placed on a cluster member that
// lags sees it: that member counts nothing pending past the messages it
// holds, while the stream (its leader) holds more. No member can be made to
// lag on demand, so, as libs/bus's replay_end_test does, the counts are set
// on what the server sends: the first consumer created counts nothing
// pending from its creation (at 0) or from its at-th message on. With
// withhold it also delivers nothing past them, as a member cut off for good;
// without, the messages come (the member caught up by then). Later
// consumers count right, as a consumer placed on another member.
type laggingServer struct {
	jetstream.JetStream
	at       int
	withhold bool
	used     atomic.Bool
}

func (l *laggingServer) CreateConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	c, err := l.JetStream.CreateConsumer(ctx, stream, cfg)
	if err != nil || l.used.Swap(true) {
		return c, err
	}
	return &laggingConsumer{Consumer: c, l: l}, nil
}

type laggingConsumer struct {
	jetstream.Consumer
	l *laggingServer
	// n counts the messages the consumer got from the server.
	n atomic.Int64
}

func (c *laggingConsumer) counted(info *jetstream.ConsumerInfo) *jetstream.ConsumerInfo {
	if info == nil || c.l.at > 0 {
		return info
	}
	cp := *info
	cp.NumPending = 0
	return &cp
}

func (c *laggingConsumer) CachedInfo() *jetstream.ConsumerInfo {
	return c.counted(c.Consumer.CachedInfo())
}

// msg returns m as the lagging member sends it, or nil when it sends
// nothing.
func (c *laggingConsumer) msg(m jetstream.Msg) jetstream.Msg {
	n := int(c.n.Add(1))
	switch {
	case n > c.l.at && c.l.withhold:
		return nil
	case n >= c.l.at:
		return lastCounted{m}
	}
	return m
}

func (c *laggingConsumer) Fetch(batch int, opts ...jetstream.FetchOpt) (jetstream.MessageBatch, error) {
	b, err := c.Consumer.Fetch(batch, opts...)
	if err != nil {
		return b, err
	}
	out := make(chan jetstream.Msg, batch)
	go func() {
		defer close(out)
		for m := range b.Messages() {
			if m := c.msg(m); m != nil {
				out <- m
			}
		}
	}()
	return laggingBatch{MessageBatch: b, msgs: out}, nil
}

type laggingBatch struct {
	jetstream.MessageBatch
	msgs chan jetstream.Msg
}

func (b laggingBatch) Messages() <-chan jetstream.Msg { return b.msgs }

// lastCounted is a message its consumer counts nothing pending after.
type lastCounted struct{ jetstream.Msg }

func (m lastCounted) Metadata() (*jetstream.MsgMetadata, error) {
	md, err := m.Msg.Metadata()
	if err != nil {
		return nil, err
	}
	cp := *md
	cp.NumPending = 0
	return &cp, nil
}

// TestTailHistoryReadsPastALaggingCount: a subscriber older than the ring
// reads its history from the stream on a consumer of its own; when that
// consumer's server counts nothing more (a member that lags), short of
// where the ring begins, the reader still gets every event, in order: it
// then goes to the ring, and an event skipped here would never reach it.
// A member that never delivers the events the stream's leader holds ends
// the read in an error, never in a skip.
func TestTailHistoryReadsPastALaggingCount(t *testing.T) {
	for _, tc := range []struct {
		name     string
		at       int
		withhold bool
		f        eventFilter
	}{
		{"nothing counted at creation", 0, false, tenantFilter("acme")},
		{"nothing counted from the 4th event", 4, false, tenantFilter("acme")},
		{"nothing counted from the 4th event of a job", 4, false, jobFilter("acme", "j1")},
		{"nothing counted nor delivered", 0, true, tenantFilter("acme")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := startTail(t, SSEConfig{RingEvents: 4, HistoryBatch: 100}, func(h *tailHarness) {
				for i := range 40 {
					h.publish("acme", "j"+strconv.Itoa(i%3))
					h.publish("other", "j"+strconv.Itoa(i%3))
				}
			})
			if st := h.tail.stats(); st.covered < 40 {
				t.Fatalf("the ring covers from %d: the reader would not read the stream", st.covered)
			}
			h.tail.js = &laggingServer{JetStream: h.tail.js, at: tc.at, withhold: tc.withhold}
			want := h.want(tc.f, 0)
			rd := h.tail.reader(tc.f, 0)
			defer rd.close()
			if !tc.withhold {
				if got := readTailUntil(t, rd, want[len(want)-1]); !slices.Equal(got, want) {
					t.Fatalf("read %d events %v\nwant %d: %v", len(got), got, len(want), want)
				}
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), waitFor)
			defer cancel()
			var got []uint64
			for {
				e, err := rd.next(ctx, nil)
				if err != nil {
					if !slices.Equal(got, want[:len(got)]) || ctx.Err() != nil {
						t.Fatalf("read %v, then %v; want a prefix of %v, then an error", got, err, want)
					}
					return
				}
				got = append(got, e.seq)
				if len(got) == len(want) || e.seq != want[len(got)-1] {
					t.Fatalf("read %v from a server that delivers nothing; want an error first", got)
				}
			}
		})
	}
}
