package billing_test

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/billing"
	"github.com/gpuplane/gpuplane/services/billing/internal/projector"
)

// benchRecord is the i-th usage record of a busy month, as billing writes
// them: 50 tenants, 20 pools, a new job every record (a record per run),
// segments starting 10 s apart, so that records come in time order as
// they do in USAGE.
func benchRecord(i int) contracts.UsageRecord {
	tenant, job := fmt.Sprintf("tenant-%02d", i%50), fmt.Sprintf("job-%07d", i)
	id := contracts.AllocationID(tenant, job, 1)
	start := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC).Add(time.Duration(i) * 10 * time.Second)
	return contracts.UsageRecord{SchemaVersion: 1, ID: contracts.UsageSegmentID(id, 0), AllocationID: id, Tenant: tenant,
		JobID: job, Attempt: 1, NodeID: fmt.Sprintf("node-%03d", i%200), Pool: fmt.Sprintf("pool-%02d", i%20),
		GPUModel: "H100-80GB", GPUs: 8, Start: start, End: start.Add(time.Hour), GPUMillis: 8 * 3_600_000, GPUSeconds: 28800,
		Time: start.Add(time.Hour),
		UsageSegment: contracts.UsageSegment{Final: true, Reason: contracts.ReasonRunEnded, Seconds: 3600, GPUShare: "8",
			PriceClass: contracts.PriceOnDemand, PriceVersion: "v1", Currency: "USD", GPURateMicros: 4_000_000,
			OnDemandRateMicros: 4_000_000, GPUCostMicros: 32_000_000, CostMicros: 32_000_000, OnDemandCostMicros: 32_000_000}}
}

// BenchmarkUsageIngest measures what billing's feed does with each usage
// record of USAGE: decode it and apply it to the store (idempotence marker
// and five running totals), in batches of 1024 as the feed takes them,
// with as many batches applying at once as the feed allows (InFlight; the
// bus's ConsumeBatchPipelined does the same). Run it with -cpu 1
// (GOMAXPROCS=1): the Redis figure is the one that matters, the in-memory
// store is the baseline in the same run, and redis-inflight1 is the feed
// applying one batch at a time. The records are encoded before the timer
// starts (not measured; all of them, so that no store works while the
// timer is stopped).
func BenchmarkUsageIngest(b *testing.B) {
	const batch = 1024
	var server *redisServer
	stores := []struct {
		name     string
		inFlight int
		open     func(b *testing.B) billing.Store
	}{
		{"memory", 0, func(*testing.B) billing.Store { server = nil; return billing.NewMemoryStore() }},
		{"redis", 0, func(b *testing.B) billing.Store {
			server = startRedis(b, false)
			return newRedisStore(b, server, billing.RedisConfig{})
		}},
		{"redis-inflight1", 1, func(b *testing.B) billing.Store {
			server = startRedis(b, false)
			return newRedisStore(b, server, billing.RedisConfig{})
		}},
	}
	for _, st := range stores {
		b.Run(st.name, func(b *testing.B) {
			ctx := context.Background()
			store := st.open(b)
			if _, err := store.Open(ctx); err != nil {
				b.Fatal(err)
			}
			p := projector.New(projector.Config{Store: store, Log: quietLog(), Unavailable: billing.ErrStoreUnavailable,
				Changed: billing.ErrGenerationChanged, InFlight: st.inFlight})
			inFlight := st.inFlight
			if inFlight == 0 {
				inFlight = 2 // projector.Config's default
			}
			msgs := make([]*bus.Msg, b.N)
			for i := range msgs {
				rec := benchRecord(i)
				data, _ := json.Marshal(rec)
				msgs[i] = &bus.Msg{Subject: contracts.SubjectUsage(rec.Tenant), Data: data}
			}
			runtime.GC()
			redisCPU0 := server.cpu(b)
			cpu0 := processCPU()
			b.ResetTimer()
			var waits []func() []error
			settle := func() {
				if errs := waits[0](); errs != nil {
					b.Fatalf("batch: %v", errs[0])
				}
				waits = waits[1:]
			}
			for done := 0; done < b.N; done += batch {
				if len(waits) == inFlight {
					settle()
				}
				waits = append(waits, p.StartBatch(ctx, msgs[done:min(done+batch, b.N)]))
			}
			for len(waits) > 0 {
				settle()
			}
			b.StopTimer()
			goCPU := processCPU() - cpu0
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "records/s")
			// CPU time per record, of this process and of Redis: what the
			// figure would be with a core each, whatever else runs here.
			b.ReportMetric(float64(goCPU.Microseconds())/float64(b.N), "go-cpu-µs/record")
			if server != nil {
				b.ReportMetric(float64((server.cpu(b)-redisCPU0).Microseconds())/float64(b.N), "redis-cpu-µs/record")
			}
			var n int64
			for t := range min(50, b.N) {
				tot, err := store.Tenant(ctx, fmt.Sprintf("tenant-%02d", t))
				if err != nil {
					b.Fatal(err)
				}
				n += tot.Records
			}
			if n != int64(b.N) || p.Applied() != int64(b.N) {
				b.Fatalf("the store counted %d records (%d new), %d were fed", n, p.Applied(), b.N)
			}
		})
	}
}

// BenchmarkUsageIngestFromStream is the whole feed: records published to
// USAGE on an embedded JetStream first, then taken by the feed's durable
// consumer in batches and applied to the store, acks included. With -cpu
// 1 the NATS server shares the one core with the feed.
func BenchmarkUsageIngestFromStream(b *testing.B) {
	for _, name := range []string{"memory", "redis"} {
		b.Run(name, func(b *testing.B) {
			ctx := context.Background()
			srv := natstest.Start(b)
			// One connection publishes the records and feeds the projector,
			// both billing's own work: billing's identity.
			bb, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "bench", Logger: quietLog(),
				Streams: contracts.StreamOptions{Memory: true}, CredsFile: natstest.Service(b, srv, contracts.BusBilling)})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { _ = bb.Close(context.Background()) })
			for i := range b.N {
				rec := benchRecord(i)
				if _, err := bb.Publish(ctx, contracts.SubjectUsage(rec.Tenant), rec.ID, rec); err != nil {
					b.Fatal(err)
				}
			}
			var store billing.Store = billing.NewMemoryStore()
			if name == "redis" {
				store = newRedisStore(b, startRedis(b, false), billing.RedisConfig{})
			}
			p := projector.New(projector.Config{Bus: bb, Store: store, Log: quietLog(), Unavailable: billing.ErrStoreUnavailable,
				Changed: billing.ErrGenerationChanged})
			runCtx, stop := context.WithCancel(ctx)
			done := make(chan error, 1)
			b.ResetTimer()
			go func() { done <- p.Run(runCtx) }()
			for p.Applied() < int64(b.N) {
				time.Sleep(time.Millisecond)
			}
			b.StopTimer()
			stop()
			if err := <-done; err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "records/s")
		})
	}
}

// processCPU is the CPU time this process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
