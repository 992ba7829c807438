package gateway

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// tailHarness is a shared tail on a real JetStream, reading as the
// gateway (its NATS permissions), and a bus of the test's own that plays
// the scheduler.
type tailHarness struct {
	t    *testing.T
	tail *eventTail
	pub  *bus.Bus
	mu   sync.Mutex
	// seqs are the stream sequences published, per subject.
	seqs map[string][]uint64
	n    int
}

func startTail(t *testing.T, cfg SSEConfig, before func(h *tailHarness)) *tailHarness {
	t.Helper()
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	pub, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "test-scheduler", CredsFile: natstest.Operator(t, srv)})
	if err != nil {
		t.Fatalf("connect test bus: %v", err)
	}
	t.Cleanup(func() { _ = pub.Close(context.Background()) })
	gw, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: Name, CredsFile: natstest.Service(t, srv, contracts.BusGateway)})
	if err != nil {
		t.Fatalf("connect gateway bus: %v", err)
	}
	t.Cleanup(func() { _ = gw.Close(context.Background()) })
	h := &tailHarness{t: t, pub: pub, seqs: map[string][]uint64{}}
	if before != nil {
		before(h)
	}
	h.tail = newEventTail(gw, cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	runCtx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = h.tail.run(runCtx)
	}()
	t.Cleanup(func() { stop(); <-done })
	select {
	case <-h.tail.ready:
	case <-time.After(waitFor):
		t.Fatal("the tail did not catch up in time")
	}
	return h
}

// publish publishes job id's queued event and records its sequence.
func (h *tailHarness) publish(tenant, id string) uint64 {
	ev := queued(tenant, id, t0)
	ev.SchemaVersion = contracts.SchemaVersion
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	subject := contracts.SubjectJobEvents(tenant, id)
	h.mu.Lock()
	h.n++
	msgID := subject + "-" + strconv.Itoa(h.n) // a job's events repeat: one ID each
	h.mu.Unlock()
	ack, err := h.pub.Publish(ctx, subject, msgID, ev)
	if err != nil {
		h.t.Errorf("publish %s: %v", subject, err)
		return 0
	}
	h.mu.Lock()
	h.seqs[subject] = append(h.seqs[subject], ack.Sequence)
	h.mu.Unlock()
	return ack.Sequence
}

// want is every sequence published on f after from, in order.
func (h *tailHarness) want(f eventFilter, from uint64) []uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []uint64
	for subject, seqs := range h.seqs {
		if subject == f.subject || f.job == "" && contracts.Token(subject, 3) == f.tenant {
			for _, s := range seqs {
				if s > from {
					out = append(out, s)
				}
			}
		}
	}
	slices.Sort(out)
	return out
}

// readTailUntil returns the sequences rd returns until it returned last, or fails
// the test after waitFor.
func readTailUntil(t *testing.T, rd *tailReader, last uint64) []uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	var got []uint64
	for len(got) == 0 || got[len(got)-1] < last {
		e, err := rd.next(ctx, nil)
		if err != nil {
			t.Errorf("reader of %s after %d stopped at %v: %v", rd.f.subject, rd.from, got, err)
			return got
		}
		got = append(got, e.seq)
	}
	return got
}

// readWhilePublishing reads from rd while events are published, until
// publishing is done and rd returned the last sequence of its filter.
func readWhilePublishing(t *testing.T, rd *tailReader, published <-chan struct{}, last func() uint64) []uint64 {
	t.Helper()
	// Readers behind a small ring read the stream in many small batches
	// (on a loaded 2-core machine): a longer bound than waitFor.
	ctx, cancel := context.WithTimeout(context.Background(), 4*waitFor)
	defer cancel()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	var got []uint64
	for {
		select {
		case <-published:
			if len(got) > 0 && got[len(got)-1] >= last() {
				return got
			}
		default:
		}
		e, err := rd.next(ctx, tick.C)
		if err != nil {
			t.Errorf("reader of %s stopped at %v: %v", rd.f.subject, got, err)
			return got
		}
		if e != nil {
			got = append(got, e.seq)
		}
	}
}

// TestTailHandoverHasNoGapNorDuplicate starts readers at different points
// of the history while events are published, with rings and queues small
// enough that readers go through every path: history from the stream in
// batches, the ring, the live queue, and being cut for a full queue. Each
// reader gets exactly the events of its filter after its start, in order.
func TestTailHandoverHasNoGapNorDuplicate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  SSEConfig
	}{
		{"the ring holds everything", SSEConfig{}},
		{"a ring of 16 events read in batches of 7", SSEConfig{RingEvents: 16, HistoryBatch: 7, HistoryReaders: 3}},
		{"a ring of 4 KiB", SSEConfig{RingBytes: 4 << 10, HistoryBatch: 64}},
		{"queues of one event", SSEConfig{RingEvents: 64, QueueEvents: 1, HistoryBatch: 16}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const history, live = 150, 150
			h := startTail(t, tc.cfg, func(h *tailHarness) {
				for i := range history {
					h.publish([]string{"acme", "other"}[i%2], "h"+strconv.Itoa(i%40))
				}
			})
			mid := h.want(tenantFilter("acme"), 0)[history/4]
			filters := []struct {
				f    eventFilter
				from uint64
			}{
				{tenantFilter("acme"), 0}, {tenantFilter("acme"), mid}, {tenantFilter("other"), 0},
				{jobFilter("acme", "h0"), 0}, {jobFilter("acme", "h2"), mid}, {jobFilter("acme", "l4"), 0}, {jobFilter("other", "l3"), mid},
			}
			var wg sync.WaitGroup
			// Publish live events while the readers start; the last one,
			// on every reader's filter, tells them where to stop.
			pubDone := make(chan struct{})
			go func() {
				defer close(pubDone)
				for i := range live {
					h.publish([]string{"acme", "other"}[i%2], "l"+strconv.Itoa(i%10))
				}
			}()
			type result struct {
				name      string
				got, want []uint64
			}
			results := make(chan result, len(filters)*2)
			for round := range 2 {
				for _, fl := range filters {
					wg.Go(func() {
						rd := h.tail.reader(fl.f, fl.from)
						defer rd.close()
						got := readWhilePublishing(t, rd, pubDone, func() uint64 {
							all := h.want(fl.f, 0)
							return all[len(all)-1]
						})
						results <- result{fmt.Sprintf("%s after %d (round %d)", fl.f.subject, fl.from, round), got, h.want(fl.f, fl.from)}
					})
				}
				if round == 0 {
					<-pubDone // later rounds start with the tail idle
				}
			}
			wg.Wait()
			close(results)
			for r := range results {
				if !slices.Equal(r.got, r.want) {
					t.Errorf("%s: got %d events %v\nwant %d: %v", r.name, len(r.got), r.got, len(r.want), r.want)
				}
			}
			st := h.tail.stats()
			cfg := tc.cfg.withDefaults()
			if st.ringEvents > cfg.RingEvents || st.ringEvents > 1 && st.ringBytes > cfg.RingBytes {
				t.Errorf("ring holds %d events, %d bytes; bounds %d and %d", st.ringEvents, st.ringBytes, cfg.RingEvents, cfg.RingBytes)
			}
			if st.subscribers != 0 {
				t.Errorf("%d subscribers left registered after every reader closed", st.subscribers)
			}
		})
	}
}

// TestTailSlowReaderDoesNotDelayOthers: a reader that stops reading
// (a slow client) is cut from the live tail when its queue fills, while a
// fast reader gets every event; the slow one then gets all of them too,
// in order, caught up from the ring and the stream.
func TestTailSlowReaderDoesNotDelayOthers(t *testing.T) {
	h := startTail(t, SSEConfig{QueueEvents: 4, RingEvents: 20, HistoryBatch: 8}, nil)
	f := tenantFilter("acme")
	slow, fast := h.tail.reader(f, 0), h.tail.reader(f, 0)
	defer slow.close()
	defer fast.close()
	first := h.publish("acme", "j0")
	if got := readTailUntil(t, slow, first); !slices.Equal(got, []uint64{first}) {
		t.Fatalf("slow reader's first event: %v, want [%d]", got, first)
	}
	var last uint64
	for i := 1; i < 100; i++ {
		last = h.publish("acme", "j"+strconv.Itoa(i))
	}
	// The fast reader gets every event while the slow one reads nothing:
	// if the tail waited for the slow one, this would time out.
	if got, want := readTailUntil(t, fast, last), h.want(f, 0); !slices.Equal(got, want) {
		t.Fatalf("fast reader: %v, want %v", got, want)
	}
	if st := h.tail.stats(); st.cut == 0 {
		t.Fatalf("the slow reader was not cut from the live tail: %+v", st)
	}
	if got, want := readTailUntil(t, slow, last), h.want(f, first); !slices.Equal(got, want) {
		t.Fatalf("slow reader after catching up: %v, want %v", got, want)
	}
}

// TestTailRingIsBounded: however many events pass, the ring and its
// indexes hold no more than their bounds.
func TestTailRingIsBounded(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  SSEConfig
	}{
		{"by count", SSEConfig{RingEvents: 30}},
		{"by bytes", SSEConfig{RingBytes: 8 << 10}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := startTail(t, tc.cfg, nil)
			var last uint64
			for i := range 200 {
				last = h.publish("t"+strconv.Itoa(i%7), "j"+strconv.Itoa(i))
			}
			cfg := tc.cfg.withDefaults()
			deadline := time.Now().Add(waitFor)
			for h.tail.stats().last < last {
				if time.Now().After(deadline) {
					t.Fatalf("the tail did not read up to %d: %+v", last, h.tail.stats())
				}
				time.Sleep(10 * time.Millisecond)
			}
			st := h.tail.stats()
			if st.ringEvents == 0 || st.ringEvents > cfg.RingEvents || st.ringBytes > cfg.RingBytes {
				t.Errorf("ring of %d events, %d bytes; bounds %d and %d", st.ringEvents, st.ringBytes, cfg.RingEvents, cfg.RingBytes)
			}
			h.tail.mu.Lock()
			indexed := 0
			for _, l := range h.tail.bySubject {
				indexed += l.len()
			}
			subjects, ring := len(h.tail.bySubject), h.tail.ring.len()
			h.tail.mu.Unlock()
			if indexed != ring || subjects > ring {
				t.Errorf("the job index holds %d events on %d subjects, the ring %d", indexed, subjects, ring)
			}
			if st.covered+uint64(st.ringEvents) != st.last {
				t.Errorf("ring covers (%d, %d] with %d events: it should hold every one", st.covered, st.last, st.ringEvents)
			}
		})
	}
}

// TestEventStreamsShareOneConsumer: many streams of a tenant and of its
// jobs, each with history, add no consumer to JOB_EVENTS, and each gets
// a live event.
func TestEventStreamsShareOneConsumer(t *testing.T) {
	h := startGateway(t, func(c *Config) { c.Limits.StreamsPerTenant, c.Limits.RequestsPerSecond = 0, 0 }, nil)
	var history []uint64
	for i := range 30 {
		history = append(history, h.publishEvent(queued("acme", "j"+strconv.Itoa(i), t0)))
	}
	first, _ := h.openStream("/v1/tenants/acme/events")
	if f, ok := nextEvent(t, first); !ok || f.ID != itoa(history[0]) {
		t.Fatalf("first stream: %+v", f)
	}
	baseline := h.streamInfo(contracts.StreamJobEvents).State.Consumers
	var streams []<-chan sseFrame
	for i := range 40 {
		path := "/v1/tenants/acme/events"
		if i%4 == 0 {
			path = "/v1/tenants/acme/jobs/j" + strconv.Itoa(i%30) + "/events"
		}
		frames, _ := h.openStream(path)
		if f, ok := nextEvent(t, frames); !ok || f.Event != "queued" {
			t.Fatalf("stream %s: %+v", path, f)
		}
		streams = append(streams, frames)
	}
	if n := h.streamInfo(contracts.StreamJobEvents).State.Consumers; n != baseline {
		t.Fatalf("%d consumers on %s with 41 streams open, want %d", n, contracts.StreamJobEvents, baseline)
	}
	live := h.publishEvent(contracts.JobEvent{Type: contracts.EventScheduled, Tenant: "acme", JobID: "j0", Attempt: 1, Time: t0})
	for i, frames := range streams {
		if i%4 == 0 && i%30 != 0 {
			continue // a stream of another job
		}
		for {
			f, ok := nextEvent(t, frames)
			if !ok {
				t.Fatalf("stream %d ended before the live event", i)
			}
			if f.ID == itoa(live) {
				break
			}
		}
	}
}

// TestEventStreamHistoryOlderThanTheRing: with a ring of a few events, a
// stream's history comes from the stream, then the ring and the live
// tail, each event once.
func TestEventStreamHistoryOlderThanTheRing(t *testing.T) {
	h := startGateway(t, func(c *Config) { c.SSE = SSEConfig{RingEvents: 4, HistoryBatch: 3} }, nil)
	var want []string
	for i := range 20 {
		want = append(want, itoa(h.publishEvent(queued("acme", "j"+strconv.Itoa(i), t0))))
		h.publishEvent(queued("other", "j"+strconv.Itoa(i), t0))
	}
	frames, _ := h.openStream("/v1/tenants/acme/events")
	want = append(want, "live")
	for i, id := range want {
		if id == "live" {
			id = itoa(h.publishEvent(queued("acme", "live", t0)))
			want[i] = id
		}
		if f, ok := nextEvent(t, frames); !ok || f.ID != id {
			t.Fatalf("event %d: got %+v (open %v), want id %s; want all of %v", i, f, ok, id, want)
		}
	}
	// Each history batch deleted its consumer before it was sent.
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	stream, err := h.bus.JetStream().Stream(ctx, contracts.StreamJobEvents)
	if err != nil {
		t.Fatal(err)
	}
	names := stream.ConsumerNames(ctx)
	for name := range names.Name() {
		if strings.HasPrefix(name, "gw-sse-") {
			t.Errorf("history consumer %s left behind", name)
		}
	}
	if err := names.Err(); err != nil {
		t.Fatal(err)
	}
}
