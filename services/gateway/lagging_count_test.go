package gateway

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
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

func (l *laggingServer) OrderedConsumer(ctx context.Context, stream string, cfg jetstream.OrderedConsumerConfig) (jetstream.Consumer, error) {
	c, err := l.JetStream.OrderedConsumer(ctx, stream, cfg)
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

func (c *laggingConsumer) Info(ctx context.Context) (*jetstream.ConsumerInfo, error) {
	info, err := c.Consumer.Info(ctx)
	return c.counted(info), err
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

func (c *laggingConsumer) Messages(opts ...jetstream.PullMessagesOpt) (jetstream.MessagesContext, error) {
	it, err := c.Consumer.Messages(opts...)
	if err != nil {
		return it, err
	}
	return laggingMessages{MessagesContext: it, c: c}, nil
}

type laggingBatch struct {
	jetstream.MessageBatch
	msgs chan jetstream.Msg
}

func (b laggingBatch) Messages() <-chan jetstream.Msg { return b.msgs }

type laggingMessages struct {
	jetstream.MessagesContext
	c *laggingConsumer
}

func (it laggingMessages) Next(opts ...jetstream.NextOpt) (jetstream.Msg, error) {
	for {
		m, err := it.MessagesContext.Next(opts...)
		if err != nil {
			return nil, err
		}
		if m := it.c.msg(m); m != nil {
			return m, nil
		}
	}
}

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

// TestAuditReadsPastALaggingCount: an audit read whose consumer's server
// counts nothing more (a member that lags), short of the last record when
// the read began, reads on to it; one whose server never delivers the
// records the stream's leader holds ends in an error at its deadline,
// never in a short answer that looks whole.
func TestAuditReadsPastALaggingCount(t *testing.T) {
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	op, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "test-audit", CredsFile: natstest.Operator(t, srv)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = op.Close(context.Background()) })
	gw, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: Name, CredsFile: natstest.Service(t, srv, contracts.BusGateway)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = gw.Close(context.Background()) })
	all := map[string][]uint64{}
	for i := range 30 {
		tenant := []string{"acme", "other"}[i%2]
		id := fmt.Sprintf("r%d", i)
		ack, err := op.PublishRaw(ctx, contracts.SubjectAudit(tenant, id), id, []byte(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		all[tenant] = append(all[tenant], ack.Sequence)
		all[""] = append(all[""], ack.Sequence)
	}
	acme := []string{contracts.SubjectAuditTenant("acme")}
	for _, tc := range []struct {
		name     string
		at       int
		withhold bool
		filters  []string
		want     []uint64
	}{
		{"nothing counted at the start", 0, false, acme, all["acme"]},
		{"nothing counted from the 4th record", 4, false, nil, all[""]},
		{"nothing counted from the 4th record of a tenant", 4, false, acme, all["acme"]},
		{"nothing counted nor delivered from the 4th record", 4, true, acme, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wait := waitFor
			if tc.withhold {
				wait = time.Second // the deadline is the only end of this read
			}
			ctx, cancel := context.WithTimeout(context.Background(), wait)
			defer cancel()
			js := &laggingServer{JetStream: gw.JetStream(), at: tc.at, withhold: tc.withhold}
			var got []uint64
			err := readAuditTrail(ctx, js, gw.Conn(), auditRange{filters: tc.filters}, func(seq uint64, _ []byte) bool {
				got = append(got, seq)
				return true
			})
			if tc.withhold {
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Fatalf("read %v, then %v; want an error at the deadline", got, err)
				}
				return
			}
			if err != nil || !slices.Equal(got, tc.want) {
				t.Fatalf("read %d records %v, then %v\nwant %d: %v", len(got), got, err, len(tc.want), tc.want)
			}
		})
	}
}

// TestLeaderReadsOnACluster: on a 3-member cluster with R3 streams, as in
// production, a gateway connected to any member (the streams' leader or a
// follower) gets the leader's answer to where a stream ends, and reads the
// whole audit trail: the leader alone answers, the others stay silent.
func TestLeaderReadsOnACluster(t *testing.T) {
	c := natstest.StartCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	r3 := contracts.StreamOptions{Replicas: 3}
	op, err := bus.Connect(ctx, bus.Config{URL: c.URLs(), Name: "test-audit", CredsFile: natstest.Operator(t, c), Streams: r3})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = op.Close(context.Background()) })
	var want []uint64
	for i := range 6 {
		id := fmt.Sprintf("r%d", i)
		ack, err := op.PublishRaw(ctx, contracts.SubjectAudit("acme", id), id, []byte(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, ack.Sequence)
	}
	for i := range c.Servers {
		gw, err := bus.Connect(ctx, bus.Config{URL: c.URL(i), Name: Name, CredsFile: natstest.Service(t, c, contracts.BusGateway),
			Streams: r3, SkipProvision: true})
		if err != nil {
			t.Fatal(err)
		}
		last, err := bus.LeaderLast(ctx, gw.Conn(), contracts.StreamAudit, nil)
		if err != nil || last != want[len(want)-1] {
			t.Errorf("member %d: leaderLast = %d, %v; want %d", i, last, err, want[len(want)-1])
		}
		var got []uint64
		err = readAuditTrail(ctx, gw.JetStream(), gw.Conn(), auditRange{filters: []string{contracts.SubjectAuditTenant("acme")}},
			func(seq uint64, _ []byte) bool {
				got = append(got, seq)
				return true
			})
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("member %d: read %v, then %v; want %v", i, got, err, want)
		}
		_ = gw.Close(context.Background())
	}
}
