package gateway

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// BenchmarkReadModelRebuild measures the gateway at start on JOB_EVENTS
// holding GPUPLANE_REBUILD_JOBS jobs' events (50,000 by default: queued,
// scheduled, running, succeeded, 1 in 10 also pending; 1 % still
// running; every event a day old, so every ended job is past its
// retention) and USAGE a usage record of each ended job (as billing
// writes them: a minute's segment, priced): the time until it is ready
// and the heap it then holds per 100,000 jobs, in the modes of
// GPUPLANE_REBUILD_MODES (all by default; snapshot also reports the
// snapshot's size):
//
//   - keepall: the read model alone keeping every job whole (the model
//     before retention: the baseline of the same run);
//   - full: the read model alone, retiring ended jobs, folding the stream
//     from its beginning;
//   - snapshot: the same from the snapshot a full start wrote (covering
//     the stream: the tail after a snapshot costs what full costs per
//     event, at most snapshotEvery events or a minute's);
//   - gateway-full, gateway-snapshot: the whole gateway (Run until
//     /healthz answers 200), its heap growth (every model, the SSE ring)
//     per 100,000 jobs.
func BenchmarkReadModelRebuild(b *testing.B) {
	n := 50_000
	if v := os.Getenv("GPUPLANE_REBUILD_JOBS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil {
			b.Fatal(err)
		}
	}
	modes := []string{"keepall", "full", "snapshot", "gateway-full", "gateway-snapshot"}
	if v := os.Getenv("GPUPLANE_REBUILD_MODES"); v != "" {
		modes = strings.Split(v, ",")
	}
	if os.Getenv("GPUPLANE_REBUILD_HEAPPROFILE") != "" {
		// One sample per 4 KiB allocated instead of 512 KiB: a start's
		// few MiB of one kind are then within a few percent.
		defer func(rate int) { runtime.MemProfileRate = rate }(runtime.MemProfileRate)
		runtime.MemProfileRate = 4096
	}
	srv := natstest.Start(b)
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ob, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "bench", CredsFile: natstest.Operator(b, srv), Logger: log})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = ob.Close(context.Background()) }()
	publishRebuildJobs(b, ob, n)
	heapNow := func() float64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return float64(m.HeapAlloc)
	}
	report := func(b *testing.B, took time.Duration, heap float64) {
		b.ReportMetric(took.Seconds()/float64(b.N), "s-to-ready")
		b.ReportMetric(heap/float64(b.N)/float64(n)*100_000/(1<<20), "MiB/100k-jobs")
		b.ReportMetric(heap/float64(b.N)/(1<<20), "MiB")
		b.ReportMetric(float64(n), "jobs")
		b.ReportMetric(0, "ns/op")
	}
	// model starts an ingester on model (JOB_EVENTS and USAGE) and
	// returns once it is ready.
	model := func(model readModel, sn *modelSnapshotter) (*ingester, func()) {
		in := &ingester{bus: ob, model: model, log: log, snaps: sn, loadDone: make(chan struct{})}
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 2)
		go func() { done <- in.followJobEvents(rctx) }()
		go func() { done <- in.followUsage(rctx) }()
		for !in.jobsReady.Load() || !in.usageReady.Load() {
			time.Sleep(time.Millisecond)
		}
		return in, func() { cancel(); <-done; <-done }
	}
	// GPUPLANE_REBUILD_LIST_RETENTION sets the list window (-1ns: none,
	// every retired job kept as before it).
	ret := DefaultRetentionConfig()
	if v := os.Getenv("GPUPLANE_REBUILD_LIST_RETENTION"); v != "" {
		if ret.ListRetention, err = time.ParseDuration(v); err != nil {
			b.Fatalf("GPUPLANE_REBUILD_LIST_RETENTION: %v", err)
		}
	}
	retaining := func() *memoryModel {
		m := newRetainingModel(ret, time.Now, streamFetcher(ob),
			func(ctx context.Context, tenant string, want map[string]*contracts.JobStatus) error {
				return tenantFetch(ctx, ob, tenant, want)
			})
		benchUsageModel(m, ob)
		return m
	}
	var snapshotBytes int
	snapshotted := false
	for _, mode := range modes {
		b.Run(mode, func(b *testing.B) {
			if strings.HasSuffix(mode, "snapshot") && !snapshotted {
				// A full start writes the snapshot the next starts load.
				m := retaining()
				start := time.Now()
				in, stop := model(m, nil)
				b.Logf("the full start that writes the snapshot took %s", time.Since(start))
				kv, err := ob.KeyValue(ctx, contracts.BucketSnapshots)
				if err != nil {
					b.Fatal(err)
				}
				sn := newModelSnapshotter(ob, time.Minute, log)
				sn.written = func(h kvsnap.Head) { snapshotBytes = h.Bytes }
				if err := sn.write(ctx, kv, m.snapshotWithUsage(in.folded.Load(), in.usageFolded.Load())); err != nil {
					b.Fatal(err)
				}
				stop()
				snapshotted = true
			}
			var took time.Duration
			var heap float64
			for range b.N {
				before := heapNow()
				writeHeapProfile(b, mode+"-before")
				start := time.Now()
				var keep any
				var stop func()
				var readyAt time.Time // when /healthz answered 200
				switch mode {
				case "keepall":
					keep, stop = model(newMemoryModel(), nil)
				case "full":
					keep, stop = model(retaining(), nil)
				case "snapshot":
					var in *ingester
					in, stop = model(retaining(), newModelSnapshotter(ob, -1, log))
					if in.startSeq.Load() == 0 {
						b.Fatal("the start did not load the snapshot")
					}
					keep = in
				case "gateway-full", "gateway-snapshot":
					if mode == "gateway-full" {
						// No snapshot to load (the next snapshot mode
						// writes it again).
						kv, err := ob.KeyValue(ctx, contracts.BucketSnapshots)
						if err == nil {
							err = kv.Purge(ctx, contracts.GatewaySnapshotHeadKey())
						}
						if err != nil {
							b.Fatal(err)
						}
						snapshotted = false
						before = heapNow()
						writeHeapProfile(b, mode+"-before")
						start = time.Now()
					}
					gctx, cancel := context.WithCancel(ctx)
					servers := make(chan *server, 1)
					_, _, _ = benchGateway(b, gctx, srv, ob, func(c *Config) {
						c.Retention.SnapshotInterval = -1
						c.onServer = func(s *server) { servers <- s }
					}, nil)
					// The event tail fills its ring beside the models
					// (/healthz does not wait for it): a start from a
					// snapshot is ready long before its ring is full,
					// and its heap was measured with a part of the ring.
					readyAt = time.Now()
					<-(<-servers).tail.ready
					// Run ends in the background: its heap is gone
					// once its goroutines are.
					stop = func() { cancel(); time.Sleep(2 * time.Second) }
				default:
					b.Fatalf("mode %q: want keepall, full, snapshot, gateway-full or gateway-snapshot", mode)
				}
				if readyAt.IsZero() {
					readyAt = time.Now()
				}
				took += readyAt.Sub(start)
				// What the start holds: the heap while it runs less the
				// heap once it stopped (buffers of the publishes and
				// earlier modes freed meanwhile do not count).
				ready := heapNow()
				writeHeapProfile(b, mode)
				runtime.KeepAlive(keep)
				stop()
				keep = nil
				heap += ready - min(before, heapNow())
			}
			report(b, took, heap)
			if mode == "snapshot" {
				b.ReportMetric(float64(snapshotBytes)/(1<<20), "MiB-snapshot")
			}
		})
	}
}

// publishRebuildJobs publishes n jobs' events on JOB_EVENTS (see
// BenchmarkReadModelRebuild). Every event is a day old, unless
// GPUPLANE_REBUILD_EVERY (a duration) spreads the jobs out at a fixed
// rate: job i's events are (n-i) times it old, so that a history longer
// than the list window (-list-retention) shows what the gateway keeps of
// it as the history grows at that rate.
func publishRebuildJobs(b *testing.B, ob *bus.Bus, n int) {
	ctx := context.Background()
	if err := ob.EnsureStreams(ctx); err != nil {
		b.Fatal(err)
	}
	js := ob.JetStream()
	now := time.Now().UTC()
	every, err := time.ParseDuration(cmp.Or(os.Getenv("GPUPLANE_REBUILD_EVERY"), "0s"))
	if err != nil {
		b.Fatalf("GPUPLANE_REBUILD_EVERY: %v", err)
	}
	for i := range n {
		at := now.Add(-24 * time.Hour)
		if every > 0 {
			at = now.Add(-time.Duration(n-i) * every)
		}
		tenant, id := fmt.Sprintf("t%d", i%8), fmt.Sprintf("j%07d", i)
		req := contracts.JobRequest{ID: id, Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB"}},
			Run: contracts.RunSpec{Duration: contracts.Duration(time.Minute)}}.Normalized(tenant)
		ev := func(typ contracts.JobEventType, state contracts.JobState, seq int, fill func(*contracts.JobEvent)) {
			e := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: typ, Tenant: tenant, JobID: id, Attempt: 1, State: state, Time: at}
			if fill != nil {
				fill(&e)
			}
			data, err := json.Marshal(e)
			if err != nil {
				b.Fatal(err)
			}
			m := nats.NewMsg(contracts.SubjectJobEvents(tenant, id))
			m.Data = data
			m.Header.Set(contracts.HeaderMsgID, contracts.JobEventID(tenant, id, typ, 1, seq))
			for {
				if _, err = js.PublishMsgAsync(m); err == nil {
					return
				}
				<-js.PublishAsyncComplete()
			}
		}
		ev(contracts.EventQueued, contracts.StateQueued, 0, func(e *contracts.JobEvent) { e.Request, e.SubmitSeq = &req, uint64(i+1) })
		if i%10 == 0 {
			ev(contracts.EventPending, contracts.StateQueued, 1, func(e *contracts.JobEvent) {
				e.Reason, e.Message = contracts.PendingInsufficientGPUs, "no free H100 in pool east"
			})
		}
		ev(contracts.EventScheduled, contracts.StateScheduled, 0, nil)
		ev(contracts.EventRunning, contracts.StateRunning, 0, nil)
		if i < n-n/100 {
			ev(contracts.EventSucceeded, contracts.StateSucceeded, 0, nil)
			alloc := tenant + "/" + id + "/1"
			rec := contracts.UsageRecord{SchemaVersion: contracts.SchemaVersion, ID: contracts.UsageSegmentID(alloc, 0),
				AllocationID: alloc, Tenant: tenant, JobID: id, Attempt: 1, NodeID: fmt.Sprintf("node-%04d", i%2000), Pool: "east",
				GPUModel: "H100-80GB", GPUs: 1, Start: at, End: at.Add(time.Minute), GPUMillis: 60_000, GPUSeconds: 60, Time: at,
				UsageSegment: contracts.UsageSegment{Final: true, Reason: contracts.ReasonRunEnded, Seconds: 60, GPUShare: "1",
					PriceClass: contracts.PriceOnDemand, PriceVersion: "v1", Currency: "USD", GPURateMicros: 3_900_000,
					OnDemandRateMicros: 3_900_000, GPUCostMicros: 65_000, CostMicros: 65_000, OnDemandCostMicros: 65_000}}
			data, err := json.Marshal(rec)
			if err != nil {
				b.Fatal(err)
			}
			m := nats.NewMsg(contracts.SubjectUsage(tenant))
			m.Data = data
			m.Header.Set(contracts.HeaderMsgID, rec.ID)
			for {
				if _, err = js.PublishMsgAsync(m); err == nil {
					break
				}
				<-js.PublishAsyncComplete()
			}
		}
	}
	<-js.PublishAsyncComplete()
}

// BenchmarkReadModelRebuildSnapshotCodec measures what a start from a
// snapshot costs beside reading its chunks: decoding it and installing it
// in the model, for GPUPLANE_REBUILD_JOBS jobs (50,000 by default) of
// which 1 % are open and the rest retired, with a usage record each, and
// the snapshot's size; no NATS (the chunks' transfer is what
// BenchmarkReadModelRebuild's snapshot mode adds).
func BenchmarkReadModelRebuildSnapshotCodec(b *testing.B) {
	n := 50_000
	if v := os.Getenv("GPUPLANE_REBUILD_JOBS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil {
			b.Fatal(err)
		}
	}
	at := time.Now().UTC().Add(-24 * time.Hour)
	s := &modelSnap{seq: uint64(4 * n), retired: map[string][]retiredJob{}}
	agg := newUsageAgg(DefaultUsageConfig())
	for i := range n {
		tenant, id := fmt.Sprintf("t%d", i%8), fmt.Sprintf("j%07d", i)
		created := at.Add(time.Duration(i) * time.Millisecond)
		if i%100 == 0 {
			req := contracts.JobRequest{ID: id, Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB"}},
				Run: contracts.RunSpec{Duration: contracts.Duration(time.Minute)}}.Normalized(tenant)
			s.live = append(s.live, &contracts.JobStatus{Tenant: tenant, JobID: id, State: contracts.StateRunning, Attempt: 1,
				Request: &req, CreatedAt: created, UpdatedAt: created, LastSeq: uint64(4*i + 3)})
		} else {
			s.retired[tenant] = append(s.retired[tenant], retiredJob{sec: created.Unix(), nsec: int32(created.Nanosecond()), id: id})
		}
		agg.add(tenant, contracts.UsageRecord{SchemaVersion: 1, ID: contracts.UsageID("a-" + id),
			AllocationID: "a-" + id, Tenant: tenant, JobID: id, Attempt: 1, NodeID: "node-1", Pool: "east", GPUModel: "H100-80GB",
			GPUs: 1, Start: created, End: created.Add(time.Minute), GPUMillis: 60_000, GPUSeconds: 60, Time: created}, created)
	}
	s.usageSeq, s.usage, s.usageIDs, s.usageCut = uint64(n), agg.tenants, agg.ids, agg.cut
	data, err := s.encode()
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	var decode, install time.Duration
	for range b.N {
		start := time.Now()
		got, err := decodeModelSnap(data)
		if err != nil {
			b.Fatal(err)
		}
		decode += time.Since(start)
		start = time.Now()
		m := newRetainingModel(DefaultRetentionConfig(), time.Now, nil, nil)
		m.aggregateUsage(DefaultUsageConfig(), nil)
		m.install(got)
		install += time.Since(start)
	}
	b.ReportMetric(decode.Seconds()/float64(b.N), "s-decode")
	b.ReportMetric(install.Seconds()/float64(b.N), "s-install")
	b.ReportMetric(float64(len(data))/(1<<20), "MiB-snapshot")
	b.ReportMetric(float64(n), "jobs")
	b.ReportMetric(0, "ns/op")
}

// writeHeapProfile writes the heap as it is now (after a collection) to
// GPUPLANE_REBUILD_HEAPPROFILE/<mode>.pprof when that directory is set
// (then sampled every 4 KiB):
// what a start holds, by allocation site (go tool pprof -sample_index
// inuse_space).
func writeHeapProfile(b *testing.B, mode string) {
	dir := os.Getenv("GPUPLANE_REBUILD_HEAPPROFILE")
	if dir == "" {
		return
	}
	f, err := os.Create(filepath.Join(dir, mode+".pprof"))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
		b.Fatal(err)
	}
}
