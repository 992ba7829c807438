package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// retireHarness is a NATS server, the operator's bus (playing the
// scheduler) and the gateway's bus (its own credentials, so the direct
// gets and snapshot writes are checked against its permissions).
type retireHarness struct {
	t        *testing.T
	nats     *natsserver.Server
	op, gw   *bus.Bus
	rnd      *rand.Rand
	jobs     map[string][]string // tenant -> job IDs published
	last     uint64
	open     map[jobKey]contracts.JobState
	nextID   int
	clock    time.Time
	tenants  []string
	shutdown []func()
}

func newRetireHarness(t *testing.T, seed uint64) *retireHarness {
	t.Helper()
	h := &retireHarness{t: t, nats: natstest.Start(t), rnd: rand.New(rand.NewPCG(seed, 17)), jobs: map[string][]string{},
		open: map[jobKey]contracts.JobState{}, clock: t0, tenants: []string{"acme", "globex"}}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	var err error
	if h.op, err = bus.Connect(ctx, bus.Config{URL: h.nats.URL(), Name: "test-scheduler", CredsFile: natstest.Operator(t, h.nats)}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.op.Close(context.Background()) })
	if err := h.op.EnsureStreams(ctx); err != nil {
		t.Fatal(err)
	}
	if h.gw, err = bus.Connect(ctx, bus.Config{URL: h.nats.URL(), Name: "gateway",
		CredsFile: natstest.Service(t, h.nats, contracts.BusGateway)}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.gw.Close(context.Background()) })
	t.Cleanup(func() {
		for _, f := range h.shutdown {
			f()
		}
	})
	return h
}

func (h *retireHarness) publish(ev contracts.JobEvent) {
	h.t.Helper()
	ev.SchemaVersion = contracts.SchemaVersion
	if ev.State == "" {
		ev.State, _ = contracts.Transition(h.open[jobKey{ev.Tenant, ev.JobID}], ev.Type)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	ack, err := h.op.Publish(ctx, contracts.SubjectJobEvents(ev.Tenant, ev.JobID),
		fmt.Sprintf("%s-%d", contracts.JobEventID(ev.Tenant, ev.JobID, ev.Type, ev.Attempt, 0), h.last+1), ev)
	if err != nil {
		h.t.Fatalf("publish %s: %v", ev.Type, err)
	}
	h.last = ack.Sequence
}

// workload publishes n new jobs' events and moves the open jobs on: ended
// in every way, some left open, created-at ties, refused and malformed
// events among them.
func (h *retireHarness) workload(n int) {
	h.t.Helper()
	step := func(k jobKey, typ contracts.JobEventType, fill func(*contracts.JobEvent)) {
		h.clock = h.clock.Add(time.Duration(h.rnd.IntN(3)) * time.Second) // ties in created-at
		ev := contracts.JobEvent{Type: typ, Tenant: k.tenant, JobID: k.job, Attempt: 1, Time: h.clock}
		if fill != nil {
			fill(&ev)
		}
		h.publish(ev)
		to, err := contracts.Transition(h.open[k], typ)
		if err == nil {
			h.open[k] = to
		}
		if endedIndex(to) >= 0 {
			delete(h.open, k)
		}
	}
	for range n {
		tenant := h.tenants[h.rnd.IntN(len(h.tenants))]
		h.nextID++
		id := fmt.Sprintf("job-%04d", h.nextID)
		h.jobs[tenant] = append(h.jobs[tenant], id)
		k := jobKey{tenant, id}
		if h.rnd.IntN(10) == 0 {
			step(k, contracts.EventRejected, func(e *contracts.JobEvent) {
				e.Reason, e.Message = contracts.ReasonInvalidValue, "bad request"
				e.Errors = []contracts.FieldError{{Field: "run", Reason: contracts.ReasonInvalidValue, Message: "no"}}
			})
			continue
		}
		q := queued(tenant, id, h.clock)
		step(k, contracts.EventQueued, func(e *contracts.JobEvent) { e.Request = q.Request })
	}
	// Move every open job on by one or two steps.
	for _, k := range sortedKeys(h.open) {
		for range 1 + h.rnd.IntN(2) {
			st, ok := h.open[k]
			if !ok {
				break
			}
			exit := h.rnd.IntN(3)
			p := &contracts.Placement{AllocationID: fmt.Sprintf("a-%d", h.rnd.IntN(1000)), NodeID: fmt.Sprintf("node-%d", h.rnd.IntN(4)), Pool: "east"}
			switch r := h.rnd.IntN(10); {
			case st == contracts.StateQueued && r < 2:
				step(k, contracts.EventPending, func(e *contracts.JobEvent) { e.Reason, e.Message = contracts.PendingInsufficientGPUs, "full" })
			case st == contracts.StateQueued && r < 3:
				step(k, contracts.EventCancelled, func(e *contracts.JobEvent) { e.Reason = contracts.ReasonCancelled })
			case st == contracts.StateQueued:
				step(k, contracts.EventScheduled, func(e *contracts.JobEvent) { e.Placement = p })
			case st == contracts.StateScheduled:
				step(k, contracts.EventRunning, func(e *contracts.JobEvent) { e.Placement = p })
			case st == contracts.StateRunning && r < 5:
				step(k, contracts.EventSucceeded, func(e *contracts.JobEvent) { e.ExitCode = new(int); end := h.clock; e.EndedAt = &end })
			case st == contracts.StateRunning && r < 7:
				step(k, contracts.EventFailed, func(e *contracts.JobEvent) {
					e.ExitCode, e.Reason = &exit, contracts.ReasonExitNonZero
					end := h.clock
					e.EndedAt = &end
				})
			case st == contracts.StateRunning && r < 8:
				step(k, contracts.EventRequeued, func(e *contracts.JobEvent) { e.Attempt, e.Reason = 2, contracts.ReasonPreempted })
			}
		}
	}
	// Refused and malformed events: a duplicate ID's rejection of an
	// ended job, a body naming another job.
	for _, tenant := range h.tenants {
		if ids := h.jobs[tenant]; len(ids) > 0 {
			id := ids[h.rnd.IntN(len(ids))]
			h.publish(contracts.JobEvent{Type: contracts.EventRejected, Tenant: tenant, JobID: id, Time: h.clock,
				State: contracts.StateRejected, Reason: contracts.ReasonDuplicateJobID})
			ev := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: contracts.EventCancelled, Tenant: tenant,
				JobID: "someone-else", Time: h.clock, State: contracts.StateCancelled}
			ctx, cancel := context.WithTimeout(context.Background(), waitFor)
			ack, err := h.op.Publish(ctx, contracts.SubjectJobEvents(tenant, id), fmt.Sprintf("bad-%d", h.last), ev)
			cancel()
			if err != nil {
				h.t.Fatal(err)
			}
			h.last = ack.Sequence
		}
	}
}

func sortedKeys(m map[jobKey]contracts.JobState) []jobKey {
	keys := make([]jobKey, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	for i := 1; i < len(keys); i++ {
		for j := i; j > 0 && (keys[j].tenant+"/"+keys[j].job) < (keys[j-1].tenant+"/"+keys[j-1].job); j-- {
			keys[j], keys[j-1] = keys[j-1], keys[j]
		}
	}
	return keys
}

// ingest starts an ingester on the gateway's bus folding JOB_EVENTS into
// model (with snapshots when sn is set) and waits until it folded every
// event published so far.
func (h *retireHarness) ingest(model readModel, sn *modelSnapshotter) *ingester {
	h.t.Helper()
	in := &ingester{bus: h.gw, model: model, log: slog.New(slog.NewTextHandler(io.Discard, nil)), snaps: sn}
	var seen atomic.Uint64
	in.observe = func(_ contracts.JobStatus, _ contracts.JobEvent, seq uint64) { seen.Store(seq) }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 2)
	go func() { done <- in.followJobEvents(ctx) }()
	if sn != nil {
		go func() { done <- sn.run(ctx) }()
	}
	h.shutdown = append(h.shutdown, func() {
		cancel()
		<-done
		if sn != nil {
			<-done
		}
	})
	h.caughtUp(in)
	return in
}

// caughtUp waits until in is ready and its model holds the status of the
// last job event the workload sent that applies.
func (h *retireHarness) caughtUp(in *ingester) {
	h.t.Helper()
	deadline := time.Now().Add(waitFor)
	for !in.jobsReady.Load() || in.folded.Load() < h.last {
		if time.Now().After(deadline) {
			h.t.Fatalf("ingester did not fold up to seq %d (at %d)", h.last, in.folded.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// answerJSON is a read model's answer v (or err) as text to compare:
// "unknown" for an unknown job, the JSON of v otherwise; any other error
// fails t.
func answerJSON(t testing.TB, v any, err error) string {
	t.Helper()
	if errors.Is(err, errUnknownJob) {
		return "unknown"
	}
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// sameAnswers holds got to want's answers: every job (and an unknown
// one), every list filter, page size and page.
func (h *retireHarness) sameAnswers(want, got readModel) {
	h.t.Helper()
	ctx := context.Background()
	asJSON := func(v any, err error) string { return answerJSON(h.t, v, err) }
	for _, tenant := range append(h.tenants, "initech") {
		ids := append(h.jobs[tenant], "nope")
		if other := h.jobs[h.tenants[0]]; len(other) > 0 {
			ids = append(ids, other[0]) // another tenant's job
		}
		for _, id := range ids {
			w, g := asJSON(want.Job(ctx, tenant, id)), asJSON(got.Job(ctx, tenant, id))
			if w != g {
				h.t.Fatalf("job %s/%s:\nwant %s\ngot  %s", tenant, id, w, g)
			}
		}
		for _, state := range append([]contracts.JobState{contracts.StateNew}, jobStates...) {
			for _, limit := range []int{0, 1, 7, 300} {
				q := jobQuery{State: state, Limit: limit}
				for page := 0; ; page++ {
					wl, werr := want.Jobs(ctx, tenant, q)
					gl, gerr := got.Jobs(ctx, tenant, q)
					w, g := asJSON(wl, werr), asJSON(gl, gerr)
					if w != g {
						h.t.Fatalf("jobs %s %+v page %d:\nwant %s\ngot  %s", tenant, q, page, w, g)
					}
					if limit == 0 || len(wl) < limit || (limit == 1 && page == 12) {
						break
					}
					q.After = wl[len(wl)-1].JobID
				}
			}
		}
		w, g := asJSON(want.Jobs(ctx, tenant, jobQuery{After: "nope"})), asJSON(got.Jobs(ctx, tenant, jobQuery{After: "nope"}))
		if w != "unknown" || g != "unknown" {
			h.t.Fatalf("unknown cursor: want %s, got %s", w, g)
		}
	}
}

// retiringModel retires the ended jobs but the last keep, and those that
// ended 2 minutes before the clock reads t0+since, and caches few
// statuses, so that reads go to the stream.
func (h *retireHarness) retiringModel(keep int, since time.Duration) *memoryModel {
	now := func() time.Time { return t0.Add(since) }
	return newRetainingModel(RetentionConfig{RetainEnded: 2 * time.Minute, RetainEndedMax: keep, CachedJobs: 4}, now, streamFetcher(h.gw),
		func(ctx context.Context, tenant string, want map[string]*contracts.JobStatus) error {
			return tenantFetch(ctx, h.gw, tenant, want)
		})
}

// TestRetiredJobsAnswerAsBefore: a read model that retires ended jobs
// answers every job and every list (filters, page sizes, cursors on
// retired jobs) as one that keeps them all, the retired statuses being
// folded again from JOB_EVENTS (one by one, and a tenant at once for a
// page of more than fetchOne).
func TestRetiredJobsAnswerAsBefore(t *testing.T) {
	h := newRetireHarness(t, 1)
	h.workload(150)
	all := newMemoryModel()
	allIn := h.ingest(all, nil)
	for _, keep := range []int{1, 25} {
		t.Run(fmt.Sprintf("keep=%d", keep), func(t *testing.T) {
			h.t = t
			// keep=1: every ended job but one retires at once; keep=25:
			// those that ended in the last minutes of the workload's
			// clock stay whole (by time, and by count).
			since := map[int]time.Duration{1: 365 * 24 * time.Hour, 25: 12 * time.Minute}[keep]
			m := h.retiringModel(keep, since)
			if keep == 1 {
				m.fetchOne = 16 // a page of more reads the tenant's events
			}
			in := h.ingest(m, nil)
			h.sameAnswers(all, m)
			h.workload(350) // more than maxFetchOne ended in a tenant
			h.caughtUp(in)
			h.caughtUp(allIn)
			live, retired := m.counts()
			if retired == 0 || live > len(h.open)+keep {
				t.Fatalf("%d jobs whole (%d open, keep %d), %d retired: want the ended ones retired", live, len(h.open), keep, retired)
			}
			h.sameAnswers(all, m)
		})
	}
}

// TestRetiredJobsMemoryIsBounded: whatever the ended history, the read
// model keeps at most RetainEndedMax ended jobs whole and CachedJobs
// statuses; what grows is one record per retired job.
func TestRetiredJobsMemoryIsBounded(t *testing.T) {
	ctx := context.Background()
	fetched := 0
	m := newRetainingModel(RetentionConfig{RetainEnded: time.Hour, RetainEndedMax: 50, CachedJobs: 20}, func() time.Time { return t0 },
		func(context.Context, string, string) (contracts.JobStatus, error) {
			fetched++
			return contracts.JobStatus{}, errors.New("not read in this test")
		}, nil)
	seq := uint64(0)
	apply := func(ev contracts.JobEvent) {
		seq++
		if err := m.ApplyJobEvent(ctx, ev.Tenant, ev.JobID, ev, seq); err != nil {
			t.Fatal(err)
		}
	}
	for round := 1; round <= 4; round++ {
		for i := range 1000 {
			id := fmt.Sprintf("r%d-%d", round, i)
			apply(queued("acme", id, t0))
			apply(contracts.JobEvent{Type: contracts.EventCancelled, Tenant: "acme", JobID: id, Attempt: 1, Time: t0})
		}
		// One open job, to show open jobs are never retired.
		apply(queued("acme", fmt.Sprintf("open-%d", round), t0))
		live, retired := m.counts()
		m.mu.RLock()
		endedWhole := len(m.ended) - m.endedHead
		m.mu.RUnlock()
		if live != 50+round || endedWhole != 50 || retired != round*1000-50 || m.cache.len() > 20 {
			t.Fatalf("round %d: %d whole (%d ended), %d retired, %d cached; want %d whole, 50 ended, %d retired, <= 20 cached",
				round, live, endedWhole, retired, m.cache.len(), 50+round, round*1000-50)
		}
	}
	// An event for a retired job is refused as for an ended one.
	err := m.ApplyJobEvent(ctx, "acme", "r1-0", contracts.JobEvent{Type: contracts.EventRunning, Tenant: "acme", JobID: "r1-0", Time: t0}, seq+1)
	if !errors.Is(err, contracts.ErrTransition) {
		t.Fatalf("event on a retired job: %v, want ErrTransition", err)
	}
	if fetched != 0 {
		t.Fatalf("folding read %d jobs from the stream", fetched)
	}
}

// TestReadModelSnapshotRestartAnswersAsTheLog: a gateway that starts from
// a snapshot written while events kept coming, and folds what came after
// it, answers as a full replay of JOB_EVENTS.
func TestReadModelSnapshotRestartAnswersAsTheLog(t *testing.T) {
	h := newRetireHarness(t, 2)
	h.workload(120)
	first := h.retiringModel(10, 8*time.Minute)
	sn := newModelSnapshotter(h.gw, time.Nanosecond, slog.New(slog.NewTextHandler(io.Discard, nil)))
	var written atomic.Uint64
	sn.written = func(v kvsnap.Head) { written.Store(v.Seq) }
	in := h.ingest(first, sn)
	mid := h.last
	h.workload(60) // the snapshots are taken while the events come
	h.caughtUp(in)
	deadline := time.Now().Add(waitFor)
	for written.Load() < mid {
		if time.Now().After(deadline) {
			t.Fatalf("no snapshot past seq %d written (last %d)", mid, written.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
	h.workload(80) // and after the last one
	h.caughtUp(in)
	restarted := h.retiringModel(10, 8*time.Minute)
	rin := h.ingest(restarted, newModelSnapshotter(h.gw, -1, slog.New(slog.NewTextHandler(io.Discard, nil))))
	if rin.startSeq.Load() < mid {
		t.Fatalf("the restart read JOB_EVENTS from %d, want from a snapshot past %d", rin.startSeq.Load(), mid)
	}
	all := newMemoryModel()
	h.ingest(all, nil)
	h.sameAnswers(all, restarted)
	h.sameAnswers(all, first)
	// The ops view's job events (preemptions) came with the snapshot.
	want, _ := json.Marshal(in.opsEvents)
	got, _ := json.Marshal(rin.opsEvents)
	if len(in.opsEvents) == 0 || string(got) != string(want) {
		t.Fatalf("ops view's job events after the restart:\n%s\nwant (from the log)\n%s", got, want)
	}
}

// TestUnusableReadModelSnapshotFallsBackToTheLog: a snapshot that is
// corrupt, truncated, incomplete, ahead of the stream or of a stream
// since recreated is ignored: the gateway reads JOB_EVENTS whole and
// answers as before.
func TestUnusableReadModelSnapshotFallsBackToTheLog(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, tc := range []struct {
		name  string
		spoil func(t *testing.T, h *retireHarness, kv jetstream.KeyValue, head kvsnap.Head)
	}{
		{"corrupt chunk", func(t *testing.T, h *retireHarness, kv jetstream.KeyValue, head kvsnap.Head) {
			putKV(t, kv, contracts.GatewaySnapshotChunkKey(head.Slot, 0), []byte("not a snapshot"))
		}},
		{"missing chunk", func(t *testing.T, h *retireHarness, kv jetstream.KeyValue, head kvsnap.Head) {
			head.Chunks++
			b, _ := json.Marshal(head)
			putKV(t, kv, contracts.GatewaySnapshotHeadKey(), b)
		}},
		{"garbled head", func(t *testing.T, h *retireHarness, kv jetstream.KeyValue, head kvsnap.Head) {
			putKV(t, kv, contracts.GatewaySnapshotHeadKey(), []byte("{"))
		}},
		{"ahead of the stream", func(t *testing.T, h *retireHarness, kv jetstream.KeyValue, head kvsnap.Head) {
			s := h.retiringModel(10, time.Hour).snapshot(h.last + 100)
			if err := newModelSnapshotter(h.gw, time.Minute, quiet).write(context.Background(), kv, s); err != nil {
				t.Fatal(err)
			}
		}},
		{"stream recreated", func(t *testing.T, h *retireHarness, kv jetstream.KeyValue, head kvsnap.Head) {
			ctx, cancel := context.WithTimeout(context.Background(), waitFor)
			defer cancel()
			if err := h.op.JetStream().DeleteStream(ctx, contracts.StreamJobEvents); err != nil {
				t.Fatal(err)
			}
			if err := h.op.EnsureStreams(ctx); err != nil {
				t.Fatal(err)
			}
			h.jobs, h.open, h.last = map[string][]string{}, map[jobKey]contracts.JobState{}, 0
			h.workload(30)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newRetireHarness(t, 3)
			h.workload(80)
			m := h.retiringModel(5, 4*time.Minute)
			h.ingest(m, nil)
			ctx, cancel := context.WithTimeout(context.Background(), waitFor)
			defer cancel()
			kv, err := h.gw.KeyValue(ctx, contracts.BucketSnapshots)
			if err != nil {
				t.Fatal(err)
			}
			var head kvsnap.Head
			sn := newModelSnapshotter(h.gw, time.Minute, quiet)
			sn.written = func(v kvsnap.Head) { head = v }
			if err := sn.write(ctx, kv, m.snapshot(h.last)); err != nil {
				t.Fatal(err)
			}
			// The snapshot as written is usable.
			if _, err := loadModelSnapshot(ctx, h.gw); err != nil {
				t.Fatalf("the snapshot as written: %v", err)
			}
			tc.spoil(t, h, kv, head)
			if _, err := loadModelSnapshot(ctx, h.gw); err == nil {
				t.Fatal("the spoiled snapshot loads")
			}
			restarted := h.retiringModel(5, 4*time.Minute)
			rin := h.ingest(restarted, newModelSnapshotter(h.gw, -1, quiet))
			if got := rin.startSeq.Load(); got != 0 {
				t.Fatalf("the restart read JOB_EVENTS from %d, want from its beginning", got)
			}
			all := newMemoryModel()
			h.ingest(all, nil)
			h.sameAnswers(all, restarted)
		})
	}
}

func putKV(t *testing.T, kv jetstream.KeyValue, key string, value []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := kv.Put(ctx, key, value); err != nil {
		t.Fatal(err)
	}
}
