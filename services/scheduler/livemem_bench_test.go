package scheduler

import (
	"context"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

// envInt reads a positive integer from the environment, def when unset.
func envInt(tb testing.TB, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		tb.Fatalf("%s=%q: want a positive number", name, v)
	}
	return n
}

// BenchmarkLiveJobMemory measures what a live scheduler holds per LIVE
// job (issue 17: memory per 100k jobs in each service):
// GPUPLANE_LIVE_JOBS jobs (20,000 by default), every one live, half of
// them queued and each of those having waited GPUPLANE_LIVE_WAITS minutes
// (that many pending events, 10 by default), half running. It reports
// the live heap while the scheduler runs (after a GC, once its first
// cycles have published and, with snapshots, once a snapshot covers the
// streams) less the heap once it stopped (the embedded server's is in
// both), three ways on the same streams: with snapshots, reading the
// streams whole ("snapshots": the compactor holds what it read); started
// again from that snapshot ("from-snapshot"); and without snapshots
// ("no-snapshots": the compactor's share is the difference).
func BenchmarkLiveJobMemory(b *testing.B) {
	n := envInt(b, "GPUPLANE_LIVE_JOBS", 20_000)
	waits := envInt(b, "GPUPLANE_LIVE_WAITS", 10)
	ctx := context.Background()
	ob, base := benchStreams(b, "sched-mem")
	msgs := writeHistory(b, ob, base.Name, n, n, waits)
	b.Logf("%d live jobs (%d waited %d minutes): %d messages written", n, n-n/2, waits, msgs)

	lastSeqs := func() map[string]uint64 {
		out := map[string]uint64{}
		for _, name := range snapshotStreams {
			st, err := ob.JetStream().Stream(ctx, name)
			if err != nil {
				b.Fatal(err)
			}
			out[name] = st.CachedInfo().State.LastSeq
		}
		return out
	}
	heapNow := func() float64 {
		runtime.GC()
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return float64(m.HeapAlloc)
	}
	for _, mode := range []struct {
		name      string
		snapshots bool
	}{{"snapshots", true}, {"from-snapshot", true}, {"no-snapshots", false}} {
		b.Run(mode.name, func(b *testing.B) {
			cfg := base
			if !mode.snapshots {
				cfg.SnapshotInterval = 0
			}
			written := make(chan state.SnapshotMeta, 64)
			cfg.snapshotWritten = func(m state.SnapshotMeta) {
				select {
				case written <- m:
				default:
				}
			}
			var held float64
			for range b.N {
				sig := liveSignal{ch: make(chan struct{}), rebuilt: new(atomic.Int64)}
				sig.Handler = slog.NewTextHandler(b.Output(), nil)
				rctx, cancel := context.WithCancel(ctx)
				done := make(chan error, 1)
				go func() { done <- Run(rctx, cfg, slog.New(sig)) }()
				select {
				case <-sig.ch:
				case err := <-done:
					b.Fatalf("scheduler ended before it was live: %v", err)
				}
				// The first cycles publish every waiting job's reason: wait
				// until the log is quiet for a second.
				seqs := lastSeqs()
				for quiet := time.Now(); time.Since(quiet) < time.Second; {
					time.Sleep(200 * time.Millisecond)
					if now := lastSeqs(); now[contracts.StreamJobEvents] != seqs[contracts.StreamJobEvents] {
						seqs, quiet = now, time.Now()
					}
				}
				if mode.snapshots {
				wait:
					for {
						select {
						case m := <-written:
							for name, seq := range seqs {
								if m.Seqs[name] < seq {
									continue wait
								}
							}
							b.Logf("snapshot: %d open jobs, %d messages", m.Jobs, m.Msgs)
							break wait
						case <-time.After(10 * time.Minute):
							b.Fatal("no snapshot covering the streams written")
						}
					}
				}
				running := heapNow()
				cancel()
				if err := <-done; err != nil {
					b.Errorf("scheduler: %v", err)
				}
				held += running - heapNow()
			}
			b.ReportMetric(held/float64(b.N)/float64(n), "bytes/live-job")
			b.ReportMetric(held/float64(b.N)/float64(n)*100_000/(1<<20), "MiB/100k-live")
			b.ReportMetric(0, "ns/op")
		})
	}
}
