package billing_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/billing"
)

// BenchmarkHistoryMemory measures what running billing keeps per job of
// history (issue 17: "memory per 100k jobs in each service; nothing grows
// with history"), with the in-memory store (make run's, and the one
// whose totals live in billing's heap). For each size in
// GPUPLANE_BILLHIST_JOBS (default "5000,20000"; e.g. "10000,40000" for the
// issue's figure) a fresh embedded NATS and billing bill that many jobs
// as the resource manager and node agents report them: per job a ledger
// commit, the agent's ended fact on RUNS and the release (both bill the
// same run: the second finds it billed), 8 tenants, 64 nodes, waves of
// GPUPLANE_BILLHIST_LIVE (512) jobs. Billing's share of the heap is the
// heap while it runs (its store included) less the heap once it stopped
// and the store is dropped, both after two GCs: the embedded server keeps
// the streams either way.
//
// It reports per size billing's heap (billing-KiB-<n>), and the
// difference between the largest and smallest size per job of history
// (B/job-history: a fixed cost cancels). GPUPLANE_BILLHIST_PROFILE=dir
// writes a heap profile of each size while billing runs (heap-<n>.pprof;
// compare with go tool pprof -base), sampled every 4 KiB.
// GPUPLANE_BILLHIST_SETTLE (11s) is the wait before the two end
// measurements. GPUPLANE_BILLHIST_STORE=redis runs billing on a Redis
// store (a fresh redis-server per size) instead: production's
// configuration, where the totals are not in billing's heap and what is
// left there is billing's own (the biller's).
func BenchmarkHistoryMemory(b *testing.B) {
	sizes := []int{5000, 20000}
	if v := os.Getenv("GPUPLANE_BILLHIST_JOBS"); v != "" {
		sizes = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n <= 0 {
				b.Fatalf("GPUPLANE_BILLHIST_JOBS: %q is not a job count", f)
			}
			sizes = append(sizes, n)
		}
	}
	wave := 512
	if v := os.Getenv("GPUPLANE_BILLHIST_LIVE"); v != "" {
		var err error
		if wave, err = strconv.Atoi(v); err != nil || wave < 1 {
			b.Fatalf("GPUPLANE_BILLHIST_LIVE: %q", v)
		}
	}
	settle := natstest.BlockCacheSettle(b, "GPUPLANE_BILLHIST_SETTLE")
	profDir := os.Getenv("GPUPLANE_BILLHIST_PROFILE")
	if profDir != "" {
		old := runtime.MemProfileRate
		runtime.MemProfileRate = 4096
		b.Cleanup(func() { runtime.MemProfileRate = old })
	}
	for range b.N {
		var held []float64
		for _, n := range sizes {
			h, took := driveBilling(b, n, wave, profDir, settle)
			held = append(held, h)
			b.ReportMetric(h/1024, fmt.Sprintf("billing-KiB-%d", n))
			b.Logf("%d jobs: billing holds %.0f KiB (%.0f B/job), %s", n, h/1024, h/float64(n), took.Round(time.Millisecond))
		}
		if len(sizes) > 1 {
			lo, hi := 0, len(sizes)-1
			b.ReportMetric((held[hi]-held[lo])/float64(sizes[hi]-sizes[lo]), "B/job-history")
		}
	}
	b.ReportMetric(0, "ns/op")
}

// driveBilling bills n jobs through one fresh billing, wave at a time,
// and returns billing's heap once they are all in the store.
func driveBilling(b *testing.B, n, wave int, profDir string, settle time.Duration) (held float64, took time.Duration) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := natstest.Start(b)
	ob, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "bench", Logger: quietLog(), CredsFile: natstest.Operator(b, srv)})
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
	const nodes, tenants = 64, 8
	for i := range nodes {
		node := fmt.Sprintf("n%03d", i)
		inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: node, Pool: "h100", PriceClass: "on-demand", Incarnation: "i1", Time: t0}
		for g := range 8 {
			inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: g, UUID: fmt.Sprintf("GPU-%s-%d", node, g), Model: "H100-80GB",
				MemoryMiB: 81920, Healthy: true})
		}
		pub(contracts.SubjectInventory(node), contracts.InventoryID(node, "i1", 1), inv)
	}
	flush()

	var store billing.Store = billing.NewMemoryStore()
	if os.Getenv("GPUPLANE_BILLHIST_STORE") == "redis" {
		r := startRedis(b, false)
		defer r.kill()
		store = newRedisStore(b, r, billing.RedisConfig{})
	}
	cfg := billing.DefaultConfig()
	cfg.Bus = service.BusConfig{NATSURL: srv.URL(), Replicas: 1, Creds: natstest.Service(b, srv, contracts.BusBilling)}
	cfg.Store = store
	cfg.StoreRetryDelay = 200 * time.Millisecond
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- billing.Run(rctx, cfg, quietLog()) }()
	billed := func() int64 {
		var sum int64
		for t := range tenants {
			tot, err := store.Tenant(ctx, fmt.Sprintf("t%d", t))
			if err != nil {
				b.Fatal(err)
			}
			sum += tot.Records
		}
		return sum
	}
	start := time.Now()
	for first := 0; first < n; first += wave {
		last := min(first+wave, n)
		for i := first; i < last; i++ {
			slot := i - first
			a := alloc(fmt.Sprintf("t%d", i%tenants), fmt.Sprintf("j%07d", i), 1, fmt.Sprintf("n%03d", (slot/8)%nodes), 1)
			a.Devices[0].Index, a.Devices[0].UUID = slot%8, fmt.Sprintf("GPU-%s-%d", a.NodeID, slot%8)
			ran := time.Duration(1+i%300) * time.Second
			rel := released(a, ran)
			pub(contracts.SubjectLedger(a.NodeID), contracts.LedgerEntryID(contracts.LedgerCommitted, a.ID), committed(a))
			pub(contracts.SubjectRuns(a.NodeID), contracts.RunEventID(contracts.RunEnded, a.ID),
				contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunEnded, AllocationID: a.ID, Tenant: a.Tenant,
					JobID: a.JobID, Attempt: 1, NodeID: a.NodeID, Devices: a.Devices, Time: rel.Run.EndedAt, Result: rel.Run})
			pub(contracts.SubjectLedger(a.NodeID), contracts.LedgerEntryID(contracts.LedgerReleased, a.ID), rel)
		}
		flush()
		deadline := time.Now().Add(2 * time.Minute)
		for billed() < int64(last) {
			select {
			case err := <-done:
				b.Fatalf("billing ended: %v", err)
			default:
			}
			if time.Now().After(deadline) {
				b.Fatalf("%d of %d jobs billed after 2 minutes", billed(), last)
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	took = time.Since(start)
	// Billing reads each run twice (the release and the agent's fact) and
	// its output again: what its consumers lag by is not what it keeps.
	natstest.CaughtUp(b, js, contracts.StreamAllocations, contracts.StreamRuns, contracts.StreamUsage)
	if got := billed(); got != int64(n) {
		b.Fatalf("%d records in the totals, want one per job (%d)", got, n)
	}
	heapNow := func() float64 {
		runtime.GC()
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return float64(m.HeapAlloc)
	}
	time.Sleep(settle)
	running := heapNow()
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
	stop()
	if err := <-done; err != nil {
		b.Fatalf("billing: %v", err)
	}
	cfg.Store, store = nil, nil
	time.Sleep(settle)
	return running - heapNow(), took
}
