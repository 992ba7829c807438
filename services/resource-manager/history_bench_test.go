package resourcemanager_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/service"
	resourcemanager "github.com/gpuplane/gpuplane/services/resource-manager"
)

// BenchmarkHistoryMemory measures what a running resource manager's heap
// keeps per job of history (issue 17: "memory per 100k jobs in each
// service; nothing grows with history"). For each size in
// GPUPLANE_RMHIST_JOBS (default "5000,20000"; the figure wants
// e.g. "10000,40000") a fresh embedded NATS and manager take that many
// jobs through their whole life, as the scheduler and node agents would
// send them: a plan commits them, a run starts and ends on each, and the
// manager releases it. At most GPUPLANE_RMHIST_LIVE (512) are live at
// once, one wave filling every GPU of 64 nodes of 8, so what is live is
// the same at every size. The manager's share of the heap is the heap
// while it runs less the heap once it stopped (both after two GCs: the
// embedded server, in the same process, keeps the streams either way).
//
// It reports, per size, the manager's heap (rm-KiB-<n>), and the
// difference between the largest and smallest size per job of history
// (B/job-history: a fixed cost cancels), and the heap a live job costs
// (B/live-job: the last full wave of the smallest size measured committed
// and started, then released, plus what its retirement keeps). GPUPLANE_RMHIST_PROFILE=dir
// writes a heap profile of each size while the manager runs
// (heap-<n>.pprof; compare with go tool pprof -base), sampled every 4 KiB.
// GPUPLANE_RMHIST_SETTLE (11s) is the wait before the end measurements
// (natstest.BlockCacheSettle).
func BenchmarkHistoryMemory(b *testing.B) {
	sizes := []int{5000, 20000}
	if v := os.Getenv("GPUPLANE_RMHIST_JOBS"); v != "" {
		sizes = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n <= 0 {
				b.Fatalf("GPUPLANE_RMHIST_JOBS: %q is not a job count", f)
			}
			sizes = append(sizes, n)
		}
	}
	live := 512
	if v := os.Getenv("GPUPLANE_RMHIST_LIVE"); v != "" {
		var err error
		if live, err = strconv.Atoi(v); err != nil || live < 8 {
			b.Fatalf("GPUPLANE_RMHIST_LIVE: %q (at least 8)", v)
		}
	}
	settle := natstest.BlockCacheSettle(b, "GPUPLANE_RMHIST_SETTLE")
	profDir := os.Getenv("GPUPLANE_RMHIST_PROFILE")
	if profDir != "" {
		old := runtime.MemProfileRate
		runtime.MemProfileRate = 4096
		b.Cleanup(func() { runtime.MemProfileRate = old })
	}
	for range b.N {
		var held []float64
		var liveLess float64
		for i, n := range sizes {
			// The live cost once, at the smallest size.
			r := driveHistory(b, n, live, profDir, settle, i == 0)
			held = append(held, r.held)
			if i == 0 {
				liveLess = r.liveLess
			}
			b.ReportMetric(r.held/1024, fmt.Sprintf("rm-KiB-%d", n))
			b.Logf("%d jobs (%d live at once): manager holds %.0f KiB (the process %.0f KiB more at the last release than once caught up and settled: the follows' backlog and the embedded server's caches), a live job %.0f B more than a released one, %d released, %s",
				n, live, r.held/1024, r.lag/1024, r.liveLess, r.retired, r.took.Round(time.Millisecond))
		}
		perHistory := 0.0
		if len(sizes) > 1 {
			lo, hi := 0, len(sizes)-1
			perHistory = (held[hi] - held[lo]) / float64(sizes[hi]-sizes[lo])
			b.ReportMetric(perHistory, "B/job-history")
		}
		// A live job costs what it holds more than once released, plus
		// what its retirement keeps (the history cost).
		b.ReportMetric(liveLess+perHistory, "B/live-job")
	}
	b.ReportMetric(0, "ns/op")
}

// historyRun is what driveHistory measured.
type historyRun struct {
	held float64 // the manager's heap at the end (running less stopped)
	// lag is what the process's heap held more at the last release than
	// once the manager caught up with the streams and the server's block
	// caches expired (both: they share the heap).
	lag float64
	// liveLess is the heap per job of the last full wave while live less
	// once released (its retired record's cost not added back).
	liveLess float64
	retired  int
	took     time.Duration
}

// driveHistory takes n jobs through one fresh manager, live at a time.
func driveHistory(b *testing.B, n, live int, profDir string, settle time.Duration, measureLive bool) historyRun {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := natstest.Start(b)
	ob, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "bench", CredsFile: natstest.Operator(b, srv),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = ob.Close(context.Background()) }()
	if err := ob.EnsureStreams(ctx); err != nil {
		b.Fatal(err)
	}
	js := ob.JetStream()
	pubs := natstest.NewPublisher(b, js)
	pub, flush := pubs.Publish, pubs.Flush
	// What the manager wrote, counted only (the driver keeps nothing per
	// job, so the heap it leaves is the manager's and the server's).
	var committed, released, refused atomic.Int64
	fctx, stopFollow := context.WithCancel(ctx)
	followDone := make(chan struct{})
	go func() {
		defer close(followDone)
		_ = ob.Follow(fctx, bus.FollowSpec{Stream: contracts.StreamAllocations}, func(_ context.Context, m *bus.Msg) error {
			switch id := m.ID(); {
			case strings.HasPrefix(m.Subject, "gp.alloc.refused."):
				refused.Add(1)
			case strings.HasPrefix(id, "ledger/"+string(contracts.LedgerCommitted)+"/"):
				committed.Add(1)
			case strings.HasPrefix(id, "ledger/"+string(contracts.LedgerReleased)+"/"):
				released.Add(1)
			}
			return nil
		}, nil)
	}()
	defer func() { stopFollow(); <-followDone }()

	nodes := (live + 7) / 8
	nodeID := func(i int) string { return fmt.Sprintf("n%05d", i) }
	for i := range nodes {
		id := nodeID(i)
		inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: id, Hostname: id, Pool: "east", MachineType: "test",
			Backend: "sim", Incarnation: "inc-1", Time: time.Now().UTC()}
		for g := range 8 {
			inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: g, UUID: fmt.Sprintf("GPU-%s-%d", id, g), Model: "H100-80GB",
				MemoryMiB: 81920, Healthy: true})
		}
		pub(contracts.SubjectInventory(id), contracts.InventoryID(id, inv.Incarnation, 1), inv)
	}
	flush()

	cfg := resourcemanager.DefaultConfig()
	cfg.Bus = service.BusConfig{NATSURL: srv.URL(), Replicas: 1, Creds: natstest.Service(b, srv, contracts.BusResourceManager)}
	cfg.Name = "rm-history"
	cfg.HeartbeatTimeout = time.Hour // no heartbeats here: no node is lost while measuring
	cfg.LeaseTTL = 0
	sig := readySignal{ch: make(chan struct{})}
	rctx, stopRM := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- resourcemanager.Run(rctx, cfg, slog.New(sig)) }()
	select {
	case <-sig.ch:
	case err := <-done:
		b.Fatalf("resource manager ended before it was ready: %v", err)
	case <-time.After(time.Minute):
		b.Fatal("resource manager not ready in a minute")
	}
	waitFor := func(what string, c *atomic.Int64, want int) {
		deadline := time.Now().Add(2 * time.Minute)
		for c.Load() < int64(want) {
			if r := refused.Load(); r > 0 {
				b.Fatalf("%d plan items refused (every one fits)", r)
			}
			if time.Now().After(deadline) {
				b.Fatalf("%s: %d of %d after 2 minutes", what, c.Load(), want)
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	heapNow := func() float64 {
		runtime.GC()
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return float64(m.HeapAlloc)
	}
	start := time.Now()
	at := time.Now().UTC()
	const perPlan = 64
	// The live cost is measured on the last full wave (when measureLive),
	// committed and started, then released, each once the manager and the
	// server have settled.
	var liveLess float64
	waves := (n + live - 1) / live
	full := n / live
	measured := 0
	for w := range waves {
		first, last := w*live, min((w+1)*live, n)
		allocs := make([]contracts.Allocation, 0, last-first)
		for i := first; i < last; i++ {
			slot := i - first
			tenant, job, node := fmt.Sprintf("t%d", i%8), fmt.Sprintf("j%07d", i), nodeID(slot/8)
			allocs = append(allocs, contracts.Allocation{ID: contracts.AllocationID(tenant, job, 1), Tenant: tenant,
				JobID: job, Attempt: 1, NodeID: node, Pool: "east", PlanID: fmt.Sprintf("p%d", i/perPlan), Scheduler: "scheduler",
				Devices: []contracts.DeviceRef{{Index: slot % 8, UUID: fmt.Sprintf("GPU-%s-%d", node, slot%8), Model: "H100-80GB"}},
				Run:     contracts.RunSpec{Duration: contracts.Duration(time.Minute)}})
		}
		for p := 0; p < len(allocs); p += perPlan {
			items := allocs[p:min(p+perPlan, len(allocs))]
			id := items[0].PlanID
			pub(contracts.SubjectPlan("scheduler"), "plan/"+id,
				contracts.Plan{SchemaVersion: 1, ID: id, Scheduler: "scheduler", Time: at, Items: items})
		}
		flush()
		waitFor("committed", &committed, last)
		for _, a := range allocs {
			pub(contracts.SubjectRuns(a.NodeID), contracts.RunEventID(contracts.RunStarted, a.ID),
				contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunStarted, AllocationID: a.ID, Tenant: a.Tenant,
					JobID: a.JobID, Attempt: 1, NodeID: a.NodeID, Devices: a.Devices, Time: at})
		}
		flush()
		measure := measureLive && w == full-1
		var liveHeap float64
		if measure {
			// Committed and started, once the manager has read what
			// was published (what lags is not what is kept).
			natstest.CaughtUp(b, js, contracts.StreamAllocations, contracts.StreamRuns)
			time.Sleep(settle)
			liveHeap = heapNow()
		}
		for _, a := range allocs {
			res := contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: at, EndedAt: at.Add(time.Minute)}
			pub(contracts.SubjectRuns(a.NodeID), contracts.RunEventID(contracts.RunEnded, a.ID),
				contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunEnded, AllocationID: a.ID, Tenant: a.Tenant,
					JobID: a.JobID, Attempt: 1, NodeID: a.NodeID, Devices: a.Devices, Time: res.EndedAt, Result: &res})
		}
		flush()
		waitFor("released", &released, last)
		if measure {
			natstest.CaughtUp(b, js, contracts.StreamAllocations, contracts.StreamRuns)
			time.Sleep(settle)
			liveLess += liveHeap - heapNow()
			measured += last - first
		}
	}
	took := time.Since(start)
	// The manager's follows read its own ledger entries again: on a busy
	// machine they lag, and what the client buffers for them is lag, not
	// history. Measured once every consumer has been handed everything;
	// what the lag held at the last release is reported beside.
	lagHeap := heapNow()
	natstest.CaughtUp(b, js, contracts.StreamAllocations, contracts.StreamRuns)
	time.Sleep(settle)
	releasedHeap := heapNow()
	if profDir != "" {
		f, err := os.Create(filepath.Join(profDir, fmt.Sprintf("heap-%d.pprof", n)))
		if err != nil {
			b.Fatal(err)
		}
		if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
			b.Fatal(err)
		}
		_ = f.Close()
	}
	stopRM()
	if err := <-done; err != nil {
		b.Fatalf("resource manager: %v", err)
	}
	time.Sleep(settle)
	stopped := heapNow()
	held := releasedHeap - stopped
	return historyRun{held: held, lag: lagHeap - releasedHeap, liveLess: liveLess / float64(max(measured, 1)),
		retired: int(released.Load()), took: took}
}
