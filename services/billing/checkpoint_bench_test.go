package billing

import (
	"context"
	"io"
	"log/slog"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/billing/internal/biller"
)

// BenchmarkStart measures what a billing start costs before it serves, as
// USAGE grows (issue 17: nothing grows with history): "whole" replays
// USAGE from its first record, as every start did before checkpoints;
// "checkpoint" restores the checkpoint a fold wrote once it forgot what
// the store holds, and replays the records after it (GPUPLANE_BILLSTART_TAIL,
// default 1,000). USAGE holds GPUPLANE_BILLSTART_RECORDS settled runs'
// records (default 100,000) over 20 tenants; the store is a memory store
// that applied them all.
//
//	go test -run '^$' -bench BenchmarkStart -benchtime 3x ./services/billing/
func BenchmarkStart(b *testing.B) {
	records, tail := benchEnv("GPUPLANE_BILLSTART_RECORDS", 100_000), benchEnv("GPUPLANE_BILLSTART_TAIL", 1_000)
	srv := natstest.Start(b)
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	bs, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "bench", Logger: log, CredsFile: natstest.Operator(b, srv)})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = bs.Close(ctx) }()
	if err := bs.EnsureStreams(ctx); err != nil {
		b.Fatal(err)
	}
	kv, err := bs.KeyValue(ctx, contracts.BucketSnapshots)
	if err != nil {
		b.Fatal(err)
	}
	store := NewMemoryStore()
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	publish := func(from, to int) {
		recs := make([]contracts.UsageRecord, 0, to-from)
		var pend []*bus.Pending
		for i := from; i < to; i++ {
			alloc := "a-" + strconv.Itoa(i)
			tenant := "t" + strconv.Itoa(i%20)
			rec := contracts.UsageRecord{ID: contracts.UsageSegmentID(alloc, 0), AllocationID: alloc, Tenant: tenant,
				JobID: "j" + strconv.Itoa(i), NodeID: "n1", Pool: "p", GPUModel: "H100-80GB", GPUs: 1,
				Start: t0.Add(time.Duration(i) * time.Second), End: t0.Add(time.Duration(i+60) * time.Second),
				GPUMillis: 60_000, SchemaVersion: 1, UsageSegment: contracts.UsageSegment{Final: true}}
			p, err := bs.PublishAsync(ctx, contracts.SubjectUsage(tenant), rec.ID, rec)
			if err != nil {
				b.Fatal(err)
			}
			pend = append(pend, p)
			recs = append(recs, rec)
			if len(pend) == 4096 || i == to-1 {
				for _, p := range pend {
					if _, err := p.Wait(ctx); err != nil {
						b.Fatal(err)
					}
				}
				pend = pend[:0]
			}
		}
		if _, err := store.Apply(ctx, recs); err != nil {
			b.Fatal(err)
		}
	}
	publish(0, records-tail)
	cfg := biller.Config{Bus: bs, Index: store, Log: log}
	fold := biller.New(cfg)
	if err := fold.Rebuild(ctx); err != nil {
		b.Fatal(err)
	}
	for range 6 { // closes the epochs and forgets them (keepRounds later)
		if _, err := fold.Forget(ctx); err != nil {
			b.Fatal(err)
		}
	}
	state, seq, err := fold.Checkpoint()
	if err != nil {
		b.Fatal(err)
	}
	created, err := usageCreated(ctx, bs)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := checkpointStore(kv).Write(ctx, seq, func() ([]byte, error) {
		return marshalCheckpoint(created, state)
	}); err != nil {
		b.Fatal(err)
	}
	publish(records-tail, records)
	b.Logf("USAGE holds %d records; the checkpoint covers %d and is %d bytes", records, seq, len(state))
	for _, mode := range []string{"whole", "checkpoint"} {
		b.Run(mode, func(b *testing.B) {
			for range b.N {
				var bl *biller.Biller
				var used *checkpointFile
				if mode == "whole" {
					bl = biller.New(cfg)
					if err := bl.Rebuild(ctx); err != nil {
						b.Fatal(err)
					}
				} else if bl, used, err = startBiller(ctx, bs, kv, cfg, store, log); err != nil || used == nil {
					b.Fatalf("no start from the checkpoint: %v", err)
				}
				if bl.Seq() != uint64(records) {
					b.Fatalf("started at USAGE %d, want %d", bl.Seq(), records)
				}
			}
			b.ReportMetric(b.Elapsed().Seconds()*1000/float64(b.N), "ms/start")
		})
	}
}

func benchEnv(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}
