package gateway

import (
	"context"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
)

// readConsumers returns the JOB_EVENTS consumers that read (not paused),
// leaving out the event streams' short-lived history consumers.
func (h *harness) readConsumers() []*jetstream.ConsumerInfo {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	s, err := h.bus.JetStream().Stream(ctx, contracts.StreamJobEvents)
	if err != nil {
		h.t.Fatalf("stream: %v", err)
	}
	lister := s.ListConsumers(ctx)
	var out []*jetstream.ConsumerInfo
	for info := range lister.Info() {
		if !info.Paused && !strings.HasPrefix(info.Name, "gw-sse-") {
			out = append(out, info)
		}
	}
	if err := lister.Err(); err != nil {
		h.t.Fatalf("consumers: %v", err)
	}
	return out
}

// TestOneJobEventReadFeedsModelAndStreams: the gateway reads JOB_EVENTS
// once, for its read model and its event streams alike (one delivery per
// event, not one per reader; issue 17). With history before it starts, a
// stream opened after, and its one consumer stalled (paused on the
// server, as one on a dead NATS node) or deleted, the read model and a
// tenant's stream still see every event once and in order, and the
// gateway holds one reading consumer again.
func TestOneJobEventReadFeedsModelAndStreams(t *testing.T) {
	for _, tc := range []struct {
		name string
		// replace makes the gateway's consumer go away or stall.
		replace func(ctx context.Context, js jetstream.JetStream, name string) error
	}{
		{"paused", func(ctx context.Context, js jetstream.JetStream, name string) error {
			_, err := js.PauseConsumer(ctx, contracts.StreamJobEvents, name, time.Now().Add(time.Hour))
			return err
		}},
		{"deleted", func(ctx context.Context, js jetstream.JetStream, name string) error {
			return js.DeleteConsumer(ctx, contracts.StreamJobEvents, name)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var want []string
			h := startGateway(t, func(c *Config) { c.Limits.StreamsPerTenant, c.Limits.RequestsPerSecond = 0, 0 }, func(h *harness) {
				for i := range 5 {
					want = append(want, itoa(h.publishEvent(queued("acme", "j"+strconv.Itoa(i), t0))))
				}
			})
			for i := 5; i < 10; i++ {
				want = append(want, itoa(h.publishEvent(queued("acme", "j"+strconv.Itoa(i), t0))))
				h.publishEvent(queued("other", "j"+strconv.Itoa(i), t0))
			}
			h.waitState("j9", contracts.StateQueued, 1)
			cons := h.readConsumers()
			if len(cons) != 1 {
				t.Fatalf("%d consumers read %s for the gateway, want 1 (read model and event streams): %v",
					len(cons), contracts.StreamJobEvents, consumerNames(cons))
			}
			frames, _ := h.openStream("/v1/tenants/acme/events")
			if n := len(h.readConsumers()); n != 1 {
				t.Fatalf("%d consumers with a stream open, want 1", n)
			}
			var got []string
			next := func() {
				t.Helper()
				f, ok := nextEvent(t, frames)
				if !ok {
					t.Fatalf("stream ended after %v; want %v", got, want)
				}
				got = append(got, f.ID)
			}
			for len(got) < len(want) {
				next()
			}

			ctx, cancel := context.WithTimeout(context.Background(), waitFor)
			defer cancel()
			if err := tc.replace(ctx, h.bus.JetStream(), cons[0].Name); err != nil {
				t.Fatalf("replace consumer %s: %v", cons[0].Name, err)
			}
			for i := range 10 {
				at := t0.Add(time.Duration(i+1) * time.Second)
				want = append(want, itoa(h.publishEvent(contracts.JobEvent{Type: contracts.EventScheduled, Tenant: "acme",
					JobID: "j" + strconv.Itoa(i), Attempt: 1, Time: at})))
				want = append(want, itoa(h.publishEvent(queued("acme", "k"+strconv.Itoa(i), at))))
			}
			for len(got) < len(want) {
				next()
			}
			if strings.Join(got, ",") != strings.Join(want, ",") {
				t.Fatalf("stream sent %v, want %v", got, want)
			}
			for i := range 10 {
				h.waitState("j"+strconv.Itoa(i), contracts.StateScheduled, 1)
				h.waitState("k"+strconv.Itoa(i), contracts.StateQueued, 1)
			}
			h.eventually("one reading consumer", func() bool { return len(h.readConsumers()) == 1 })
			if n := len(h.readConsumers()); n != 1 {
				t.Fatalf("%d consumers read %s after the replacement, want 1", n, contracts.StreamJobEvents)
			}
		})
	}
}

func consumerNames(infos []*jetstream.ConsumerInfo) []string {
	var names []string
	for _, c := range infos {
		names = append(names, c.Name)
	}
	return names
}

// ingestWithTail is retireHarness.ingest with the tail fed by the fold.
func (h *retireHarness) ingestWithTail(model readModel, sn *modelSnapshotter, tail *eventTail) *ingester {
	h.t.Helper()
	in := &ingester{bus: h.gw, model: model, log: slog.New(slog.NewTextHandler(io.Discard, nil)), snaps: sn, tail: tail}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- in.followJobEvents(ctx) }()
	h.shutdown = append(h.shutdown, func() {
		cancel()
		<-done
	})
	h.caughtUp(in)
	return in
}

// TestSnapshotStartFillsTheTail: a gateway that starts from a read model
// snapshot reads JOB_EVENTS once, from the earlier of the snapshot's next
// sequence and the tail's start. With a ring reaching back before the
// snapshot (the tail takes events the fold skips) and one starting after
// it (the fold takes events the tail skips), the ring holds the stream's
// last RingEvents events, a reader of each tenant from the beginning gets
// every event of its tenant once and in order (the ring, or the stream
// then the ring), and the model answers as a fold of the whole log.
func TestSnapshotStartFillsTheTail(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, tc := range []struct {
		name string
		ring int
	}{{"ring before the snapshot", 10_000}, {"ring after the snapshot", 7}} {
		t.Run(tc.name, func(t *testing.T) {
			h := newRetireHarness(t, 4)
			h.workload(60)
			first := h.retiringModel(10, 8*time.Minute)
			sn := newModelSnapshotter(h.gw, time.Nanosecond, quiet)
			var written atomic.Uint64
			sn.written = func(v kvsnap.Head) { written.Store(v.Seq) }
			in := h.ingest(first, sn)
			mid := h.last
			h.workload(30) // the snapshots are taken while the events come
			h.caughtUp(in)
			deadline := time.Now().Add(waitFor)
			for written.Load() < mid {
				if time.Now().After(deadline) {
					t.Fatalf("no snapshot past seq %d written (last %d)", mid, written.Load())
				}
				time.Sleep(5 * time.Millisecond)
			}
			// The first gateway stops: no snapshot covers what follows,
			// which a snapshot written at the last event (its interval is
			// a nanosecond) did now and then, leaving no events after it
			// for the ring of 7 to start after.
			stop := h.shutdown[len(h.shutdown)-1]
			h.shutdown = h.shutdown[:len(h.shutdown)-1]
			stop()
			h.workload(40) // after the last snapshot

			tail := newEventTail(h.gw, SSEConfig{RingEvents: tc.ring, HistoryBatch: 5}, quiet)
			restarted := h.retiringModel(10, 8*time.Minute)
			rin := h.ingestWithTail(restarted, newModelSnapshotter(h.gw, -1, quiet), tail)
			if rin.startSeq.Load() < mid {
				t.Fatalf("the restart read JOB_EVENTS from %d, want from a snapshot past %d", rin.startSeq.Load(), mid)
			}
			select {
			case <-tail.ready:
			case <-time.After(waitFor):
				t.Fatal("the tail did not catch up in time")
			}
			st := tail.stats()
			if wantRing := min(tc.ring, int(h.last)); st.last != h.last || st.ringEvents != wantRing || st.covered+uint64(st.ringEvents) != st.last {
				t.Fatalf("tail %+v; want the last %d events of %d", st, wantRing, h.last)
			}
			if tc.ring < int(h.last) && st.covered+1 <= rin.startSeq.Load() {
				t.Fatalf("ring starts at %d, not after the snapshot's %d: the case is not tested", st.covered+1, rin.startSeq.Load())
			}

			want := map[string][]uint64{}
			ctx, cancel := context.WithTimeout(context.Background(), waitFor)
			defer cancel()
			if _, err := h.op.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamJobEvents}, func(_ context.Context, m *bus.Msg) error {
				tenant := contracts.Token(m.Subject, 3)
				want[tenant] = append(want[tenant], m.StreamSeq)
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			for _, tenant := range h.tenants {
				rd := tail.reader(tenantFilter(tenant), 0)
				got := readTailUntil(t, rd, want[tenant][len(want[tenant])-1])
				rd.close()
				if !slices.Equal(got, want[tenant]) {
					t.Errorf("tenant %s: reader got %v, want %v", tenant, got, want[tenant])
				}
			}
			all := newMemoryModel()
			h.ingest(all, nil)
			h.sameAnswers(all, restarted)
		})
	}
}
