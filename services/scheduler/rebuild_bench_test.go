package scheduler

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

// rebuildJobs is the number of jobs whose histories BenchmarkRebuild
// writes: 50,000 by default (seconds), GPUPLANE_REBUILD_JOBS for the
// issue's million.
func rebuildJobs(tb testing.TB) int {
	n := 50_000
	if v := os.Getenv("GPUPLANE_REBUILD_JOBS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 100 {
			tb.Fatalf("GPUPLANE_REBUILD_JOBS=%q: want a number ≥ 100", v)
		}
	}
	return n
}

// history writes n jobs' histories into the streams as their writers
// would (async publishes with their message IDs): 1 % of the jobs are live
// (half queued, half running on the inventory written first), the rest
// succeeded: queued (1 in 10 also pending), scheduled, running, succeeded
// in JOB_EVENTS; a plan item per job in PLANS (100 per plan); committed and
// released in ALLOCATIONS; started and ended in RUNS. It returns the
// number of messages written.
func history(tb testing.TB, b *bus.Bus, scheduler string, n int) int {
	tb.Helper()
	return writeHistory(tb, b, scheduler, n, max(n/100, 1), 1)
}

// writeHistory is history with live of the n jobs live (the last ones)
// and, when waits > 1, every live queued job waited long: waits pending
// events each (one a minute, its reason published again), not 1 in 10
// jobs one.
func writeHistory(tb testing.TB, b *bus.Bus, scheduler string, n, live, waits int) int {
	tb.Helper()
	js := b.JetStream()
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	written := 0
	pub := func(subject, id string, v any) {
		data, err := json.Marshal(v)
		if err != nil {
			tb.Fatal(err)
		}
		m := nats.NewMsg(subject)
		m.Data = data
		m.Header.Set(contracts.HeaderMsgID, id)
		m.Header.Set(contracts.HeaderContentType, contracts.ContentTypeJSON)
		for {
			_, err = js.PublishMsgAsync(m)
			if err == nil {
				break
			}
			select { // too many in flight: let the acks catch up
			case <-js.PublishAsyncComplete():
			case <-ctx.Done():
				tb.Fatal(ctx.Err())
			}
		}
		written++
	}
	running := live / 2
	nodes := max(running/8+1, 10)
	for i := range nodes {
		id := fmt.Sprintf("n%05d", i)
		inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: id, Hostname: id, Pool: "east", MachineType: "test",
			Backend: "sim", Incarnation: "inc-1", Time: time.Now().UTC()}
		for g := range 8 {
			inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: g, UUID: fmt.Sprintf("GPU-%s-%d", id, g), Model: h100,
				MemoryMiB: 81920, Healthy: true})
		}
		pub(contracts.SubjectInventory(id), contracts.InventoryID(id, inv.Incarnation, 1), inv)
	}
	t0 := time.Now().UTC().Add(-24 * time.Hour)
	var plan contracts.Plan
	flush := func() {
		if len(plan.Items) > 0 {
			pub(contracts.SubjectPlan(scheduler), plan.ID, plan)
		}
		plan = contracts.Plan{}
	}
	for i := range n {
		tenant, id := fmt.Sprintf("t%d", i%8), fmt.Sprintf("j%07d", i)
		at := t0.Add(time.Duration(i) * time.Millisecond)
		req := request(id, 1, h100).Normalized(tenant)
		subj := contracts.SubjectJobEvents(tenant, id)
		ev := func(typ contracts.JobEventType, state contracts.JobState, seq int, fill func(*contracts.JobEvent)) {
			e := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: typ, Tenant: tenant, JobID: id,
				Attempt: 1, State: state, Time: at}
			if fill != nil {
				fill(&e)
			}
			pub(subj, contracts.JobEventID(tenant, id, typ, 1, seq), e)
		}
		ev(contracts.EventQueued, contracts.StateQueued, 0, func(e *contracts.JobEvent) {
			e.Request, e.SubmitSeq = &req, uint64(i+1)
		})
		isLive := i >= n-live
		pendings := 0
		switch {
		case waits > 1 && isLive && i >= n-live+running:
			pendings = waits
		case i%10 == 0:
			pendings = 1
		}
		for k := 1; k <= pendings; k++ {
			ev(contracts.EventPending, contracts.StateQueued, k, func(e *contracts.JobEvent) {
				e.Reason, e.Message = contracts.PendingInsufficientGPUs, "no free H100 in pool east"
				e.Time = at.Add(time.Duration(k) * time.Minute)
			})
		}
		if isLive && i >= n-live+running {
			continue // queued
		}
		slot := i % (nodes * 8)
		if isLive {
			slot = i - (n - live)
		}
		node := fmt.Sprintf("n%05d", slot/8)
		a := contracts.Allocation{ID: contracts.AllocationID(tenant, id, 1), Tenant: tenant, JobID: id, Attempt: 1,
			NodeID: node, Pool: "east", Devices: []contracts.DeviceRef{{Index: slot % 8, UUID: fmt.Sprintf("GPU-%s-%d", node, slot%8), Model: h100}},
			Run: req.Run, Scheduler: scheduler}
		if plan.ID == "" {
			plan = contracts.Plan{SchemaVersion: 1, ID: fmt.Sprintf("%s-hist-%d", scheduler, i), Scheduler: scheduler, Epoch: 1, Time: at}
		}
		a.PlanID = plan.ID
		plan.Items = append(plan.Items, a)
		if len(plan.Items) == 100 {
			flush()
		}
		pub(contracts.SubjectLedger(node), contracts.LedgerEntryID(contracts.LedgerCommitted, a.ID),
			contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a, Time: at})
		ev(contracts.EventScheduled, contracts.StateScheduled, 0, func(e *contracts.JobEvent) {
			e.Placement = &contracts.Placement{NodeID: node, Pool: "east", AllocationID: a.ID, Devices: a.Devices}
		})
		pub(contracts.SubjectRuns(node), contracts.RunEventID(contracts.RunStarted, a.ID),
			contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunStarted, AllocationID: a.ID, Tenant: tenant,
				JobID: id, Attempt: 1, NodeID: node, Devices: a.Devices, Time: at})
		ev(contracts.EventRunning, contracts.StateRunning, 0, nil)
		if isLive {
			continue
		}
		res := contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: at, EndedAt: at.Add(time.Minute)}
		pub(contracts.SubjectRuns(node), contracts.RunEventID(contracts.RunEnded, a.ID),
			contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunEnded, AllocationID: a.ID, Tenant: tenant,
				JobID: id, Attempt: 1, NodeID: node, Devices: a.Devices, Time: res.EndedAt, Result: &res})
		ev(contracts.EventSucceeded, contracts.StateSucceeded, 0, func(e *contracts.JobEvent) {
			code := 0
			e.ExitCode, e.StartedAt, e.EndedAt = &code, &res.StartedAt, &res.EndedAt
		})
		pub(contracts.SubjectLedger(node), contracts.LedgerEntryID(contracts.LedgerReleased, a.ID),
			contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerReleased, Allocation: a, Time: res.EndedAt,
				Reason: contracts.ReasonRunEnded, Run: &res})
	}
	flush()
	select {
	case <-js.PublishAsyncComplete():
	case <-ctx.Done():
		tb.Fatal(ctx.Err())
	}
	return written
}

// benchStreams starts an embedded server with the platform's streams and
// returns an operator's bus on it (closed when b ends) and the config of
// a scheduler named name on it. Its rebuild has no bound: a bound it ran
// past would make it start over, and a benchmark measures the rebuild,
// not step-downs.
func benchStreams(b *testing.B, name string) (*bus.Bus, Config) {
	srv := natstest.Start(b)
	ctx := context.Background()
	ob, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "bench", Logger: testLogger(b),
		CredsFile: natstest.Operator(b, srv)})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = ob.Close(context.Background()) })
	if err := ob.EnsureStreams(ctx); err != nil {
		b.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Bus = service.BusConfig{NATSURL: srv.URL(), Replicas: 1, Creds: natstest.Service(b, srv, contracts.BusScheduler)}
	cfg.Name = name
	cfg.RebuildTimeout = time.Hour
	return ob, cfg
}

// liveSignal is a slog handler that closes ch when the scheduler says it
// is live (rebuilt and deciding) and keeps how long its rebuild took,
// dropping everything below Warn else.
type liveSignal struct {
	slog.Handler
	ch      chan struct{}
	rebuilt *atomic.Int64
}

func (h liveSignal) Enabled(_ context.Context, l slog.Level) bool { return true }

func (h liveSignal) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == "state rebuilt" {
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "took" {
				h.rebuilt.Store(int64(a.Value.Duration()))
			}
			return true
		})
	}
	if r.Message == "scheduler live" {
		select {
		case <-h.ch:
		default:
			close(h.ch)
		}
	}
	if r.Level < slog.LevelWarn {
		return nil
	}
	return h.Handler.Handle(ctx, r)
}

func (h liveSignal) WithAttrs(as []slog.Attr) slog.Handler {
	return liveSignal{Handler: h.Handler.WithAttrs(as), ch: h.ch, rebuilt: h.rebuilt}
}

func (h liveSignal) WithGroup(g string) slog.Handler {
	return liveSignal{Handler: h.Handler.WithGroup(g), ch: h.ch, rebuilt: h.rebuilt}
}

// BenchmarkRebuild measures a scheduler's start on streams that hold the
// histories of GPUPLANE_REBUILD_JOBS jobs (50,000 by default; see history):
// the time from Run to "scheduler live" (state rebuilt), and the heap it
// then holds per 100,000 jobs (live heap after a GC, less the heap before
// it started: the embedded NATS server is in the same process). Three
// ways, on the same streams: every ended job kept whole and no snapshot
// (as before issue 17), ended jobs retired, and retired with a snapshot.
// For each a first scheduler runs until live (and, with snapshots, its
// first snapshot is written) and stops, as a restart finds things; the
// starts after it are measured.
func BenchmarkRebuild(b *testing.B) {
	n := rebuildJobs(b)
	ctx := context.Background()
	ob, base := benchStreams(b, "sched-bench")
	fill := time.Now()
	msgs := history(b, ob, base.Name, n)
	b.Logf("%d jobs: %d messages written in %s", n, msgs, time.Since(fill).Round(time.Millisecond))

	for _, mode := range []struct {
		name              string
		retain, snapshots bool
	}{
		{"all-kept", false, false},
		{"retired", true, false},
		{"snapshot", true, true},
	} {
		if only := os.Getenv("GPUPLANE_REBUILD_MODES"); only != "" && !strings.Contains(","+only+",", ","+mode.name+",") {
			continue
		}
		b.Run(mode.name, func(b *testing.B) {
			cfg := base
			if !mode.retain {
				cfg.RetainEnded, cfg.RetainEndedMax = 0, 0
			}
			if !mode.snapshots {
				cfg.SnapshotInterval = 0
			}
			written := make(chan state.SnapshotMeta, 16)
			cfg.snapshotWritten = func(m state.SnapshotMeta) {
				select {
				case written <- m:
				default:
				}
			}
			// start runs a scheduler until it is live and returns how long
			// that took, how long its rebuild took (its log's "state
			// rebuilt"), the heap it holds, and how to stop it.
			start := func() (live, rebuilt time.Duration, stop func() float64) {
				sig := liveSignal{ch: make(chan struct{}), rebuilt: new(atomic.Int64)}
				sig.Handler = slog.NewTextHandler(b.Output(), nil)
				rctx, cancel := context.WithCancel(ctx)
				done := make(chan error, 1)
				t := time.Now()
				go func() { done <- Run(rctx, cfg, slog.New(sig)) }()
				select {
				case <-sig.ch:
				case err := <-done:
					b.Fatalf("scheduler ended before it was live: %v", err)
				}
				live = time.Since(t)
				heapNow := func() float64 {
					runtime.GC()
					var m runtime.MemStats
					runtime.ReadMemStats(&m)
					return float64(m.HeapAlloc)
				}
				// What the scheduler holds: the heap while it runs less
				// the heap once it stopped (the server's is in both).
				running := heapNow()
				return live, time.Duration(sig.rebuilt.Load()), func() float64 {
					cancel()
					if err := <-done; err != nil {
						b.Errorf("scheduler: %v", err)
					}
					return running - heapNow()
				}
			}
			var liveT, rebuiltT time.Duration
			var heap float64
			for i := range b.N {
				l, r, stop := start()
				if mode.snapshots && i == 0 {
					// The first start reads the streams whole and writes
					// snapshots (some while it reads); the second, once one
					// covers the streams, is the one measured.
					want := map[string]uint64{}
					for _, name := range snapshotStreams {
						st, err := ob.JetStream().Stream(ctx, name)
						if err != nil {
							b.Fatal(err)
						}
						want[name] = st.CachedInfo().State.LastSeq
					}
				wait:
					for {
						select {
						case m := <-written:
							for name, seq := range want {
								if m.Seqs[name] < seq {
									continue wait
								}
							}
							b.Logf("snapshot: %d open jobs, %d retired, %d messages", m.Jobs, m.Retired, m.Msgs)
							break wait
						case <-time.After(20 * time.Minute):
							b.Fatal("no snapshot written")
						}
					}
					b.Logf("first start (no snapshot yet): live after %s, rebuilt in %s", l.Round(time.Millisecond), r.Round(time.Millisecond))
					stop()
					l, r, stop = start()
				}
				heap += stop()
				liveT += l
				rebuiltT += r
			}
			b.ReportMetric(liveT.Seconds()/float64(b.N), "s-to-live")
			b.ReportMetric(rebuiltT.Seconds()/float64(b.N), "s-rebuild")
			b.ReportMetric(heap/float64(b.N)/float64(n)*100_000/(1<<20), "MiB/100k-jobs")
			b.ReportMetric(float64(n), "jobs")
			b.ReportMetric(0, "ns/op")
		})
	}
}
