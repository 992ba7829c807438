package resourcemanager_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/service"
	resourcemanager "github.com/gpuplane/gpuplane/services/resource-manager"
)

// readySignal closes ch when the resource manager logs that it is ready.
type readySignal struct {
	slog.Handler
	ch chan struct{}
	// on is the message that closes ch; "" is the ready line.
	on string
}

func (h readySignal) Enabled(context.Context, slog.Level) bool { return true }
func (h readySignal) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == h.msg() {
		select {
		case <-h.ch:
		default:
			close(h.ch)
		}
	}
	return nil
}

func (h readySignal) msg() string {
	if h.on != "" {
		return h.on
	}
	return "ready: consuming plans"
}
func (h readySignal) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h readySignal) WithGroup(string) slog.Handler      { return h }

// BenchmarkRebuild measures a resource manager's start (Run to "ready:
// consuming plans") on streams holding GPUPLANE_REBUILD_JOBS jobs'
// histories (50,000 by default), as the scheduler's BenchmarkRebuild
// writes them: per job a ledger commit and release in ALLOCATIONS and a
// run start and end in RUNS (1 % still running), on 8-GPU nodes. It
// reports the time to ready and the heap the manager then holds per
// 100,000 jobs (heap while it runs less the heap once it stopped; the
// embedded server is in the same process). The resource manager reads
// ALLOCATIONS and RUNS from their beginning (issue 17's figure to beat).
//
// GPUPLANE_REBUILD_MODES picks what is measured (both by default):
// "full", a start that reads both streams whole (snapshots off), and
// "snapshot", a start from the snapshot a first start wrote once ready
// (that first start is not measured), reading only the tail after it.
func BenchmarkRebuild(b *testing.B) {
	n := 50_000
	if v := os.Getenv("GPUPLANE_REBUILD_JOBS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil {
			b.Fatal(err)
		}
	}
	srv := natstest.Start(b)
	ctx := context.Background()
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
	pub := func(subject, id string, v any) {
		data, err := json.Marshal(v)
		if err != nil {
			b.Fatal(err)
		}
		m := nats.NewMsg(subject)
		m.Data = data
		m.Header.Set(contracts.HeaderMsgID, id)
		for {
			if _, err = js.PublishMsgAsync(m); err == nil {
				return
			}
			<-js.PublishAsyncComplete()
		}
	}
	live := max(n/100, 1)
	nodes := max(live/8+1, 10)
	for i := range nodes {
		id := fmt.Sprintf("n%05d", i)
		inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: id, Hostname: id, Pool: "east", MachineType: "test",
			Backend: "sim", Incarnation: "inc-1", Time: time.Now().UTC()}
		for g := range 8 {
			inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: g, UUID: fmt.Sprintf("GPU-%s-%d", id, g), Model: "H100-80GB",
				MemoryMiB: 81920, Healthy: true})
		}
		pub(contracts.SubjectInventory(id), contracts.InventoryID(id, inv.Incarnation, 1), inv)
	}
	fill := time.Now()
	at := time.Now().UTC().Add(-24 * time.Hour)
	for i := range n {
		tenant, job := fmt.Sprintf("t%d", i%8), fmt.Sprintf("j%07d", i)
		isLive := i >= n-live
		slot := i % (nodes * 8)
		if isLive {
			slot = i - (n - live)
		}
		node := fmt.Sprintf("n%05d", slot/8)
		a := contracts.Allocation{ID: contracts.AllocationID(tenant, job, 1), Tenant: tenant, JobID: job, Attempt: 1,
			NodeID: node, Pool: "east", Devices: []contracts.DeviceRef{{Index: slot % 8, UUID: fmt.Sprintf("GPU-%s-%d", node, slot%8), Model: "H100-80GB"}},
			Run: contracts.RunSpec{Duration: contracts.Duration(time.Minute)}, PlanID: fmt.Sprintf("p%d", i/100), Scheduler: "scheduler"}
		pub(contracts.SubjectLedger(node), contracts.LedgerEntryID(contracts.LedgerCommitted, a.ID),
			contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a, Time: at})
		pub(contracts.SubjectRuns(node), contracts.RunEventID(contracts.RunStarted, a.ID),
			contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunStarted, AllocationID: a.ID, Tenant: tenant,
				JobID: job, Attempt: 1, NodeID: node, Devices: a.Devices, Time: at})
		if isLive {
			continue
		}
		res := contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: at, EndedAt: at.Add(time.Minute)}
		pub(contracts.SubjectRuns(node), contracts.RunEventID(contracts.RunEnded, a.ID),
			contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunEnded, AllocationID: a.ID, Tenant: tenant,
				JobID: job, Attempt: 1, NodeID: node, Devices: a.Devices, Time: res.EndedAt, Result: &res})
		pub(contracts.SubjectLedger(node), contracts.LedgerEntryID(contracts.LedgerReleased, a.ID),
			contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerReleased, Allocation: a, Time: res.EndedAt,
				Reason: contracts.ReasonRunEnded, Run: &res})
	}
	<-js.PublishAsyncComplete()
	b.Logf("%d jobs written in %s", n, time.Since(fill).Round(time.Millisecond))

	cfg := resourcemanager.DefaultConfig()
	cfg.Bus = service.BusConfig{NATSURL: srv.URL(), Replicas: 1, Creds: natstest.Service(b, srv, contracts.BusResourceManager)}
	cfg.Name = "rm-bench"
	cfg.HeartbeatTimeout = time.Hour // no heartbeats here: no node is lost while measuring
	cfg.LeaseTTL = 0
	modes := []string{"full", "snapshot"}
	if v := os.Getenv("GPUPLANE_REBUILD_MODES"); v != "" {
		modes = strings.Split(v, ",")
	}
	for _, mode := range modes {
		switch mode {
		case "full":
			cfg.SnapshotInterval = 0
		case "snapshot":
			// A first start writes the snapshot once ready.
			cfg.SnapshotInterval = time.Hour
			sig := readySignal{ch: make(chan struct{}), on: "snapshot written"}
			rctx, cancel := context.WithCancel(ctx)
			done := make(chan error, 1)
			start := time.Now()
			go func() { done <- resourcemanager.Run(rctx, cfg, slog.New(sig)) }()
			select {
			case <-sig.ch:
			case err := <-done:
				b.Fatalf("resource manager ended before it wrote a snapshot: %v", err)
			}
			b.Logf("first start and snapshot written in %s", time.Since(start).Round(time.Millisecond))
			cancel()
			if err := <-done; err != nil {
				b.Fatal(err)
			}
		default:
			b.Fatalf("GPUPLANE_REBUILD_MODES: unknown mode %q (full, snapshot)", mode)
		}
		b.Run(mode, func(b *testing.B) { measureStart(b, cfg, n) })
	}
}

// measureStart measures b.N starts of a resource manager with cfg on
// streams holding n jobs' histories.
func measureStart(b *testing.B, cfg resourcemanager.Config, n int) {
	ctx := context.Background()
	heapNow := func() float64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return float64(m.HeapAlloc)
	}
	var took time.Duration
	var heap float64
	for range b.N {
		sig := readySignal{ch: make(chan struct{})}
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		start := time.Now()
		go func() { done <- resourcemanager.Run(rctx, cfg, slog.New(sig)) }()
		select {
		case <-sig.ch:
		case err := <-done:
			b.Fatalf("resource manager ended before it was ready: %v", err)
		}
		took += time.Since(start)
		running := heapNow()
		cancel()
		if err := <-done; err != nil {
			b.Errorf("resource manager: %v", err)
		}
		heap += running - heapNow()
	}
	b.ReportMetric(took.Seconds()/float64(b.N), "s-to-ready")
	b.ReportMetric(heap/float64(b.N)/float64(n)*100_000/(1<<20), "MiB/100k-jobs")
	b.ReportMetric(float64(n), "jobs")
	b.ReportMetric(0, "ns/op")
}
