package state

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// BenchmarkStoreMemory replays the histories of GPUPLANE_REBUILD_JOBS
// jobs (20,000 by default) into a store, as a rebuild does: 99 % of them
// succeeded (queued, scheduled, running, succeeded, their allocation
// committed and released), 1 % (GPUPLANE_RUNNING) still running, their
// ends spread over GPUPLANE_HISTORY (10 days by default). It reports the heap the store
// then holds per 100,000 jobs, with every ended job kept whole (as before
// issue 17), with ended jobs retired and their records kept for ever, and
// with records kept a day (windowed: RememberEnded), and the replay's
// speed.
func BenchmarkStoreMemory(b *testing.B) {
	n := 20_000
	if v := os.Getenv("GPUPLANE_REBUILD_JOBS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil {
			b.Fatal(err)
		}
	}
	running := n / 100
	if v := os.Getenv("GPUPLANE_RUNNING"); v != "" {
		var err error
		if running, err = strconv.Atoi(v); err != nil || running < 0 || running > n {
			b.Fatalf("GPUPLANE_RUNNING=%q: want 0 to %d", v, n)
		}
	}
	history := 10 * 24 * time.Hour
	if v := os.Getenv("GPUPLANE_HISTORY"); v != "" {
		var err error
		if history, err = time.ParseDuration(v); err != nil {
			b.Fatal(err)
		}
	}
	for _, mode := range []struct {
		name     string
		retain   bool
		remember time.Duration
	}{{"all-kept", false, 0}, {"retired", true, 0}, {"windowed", true, 24 * time.Hour}} {
		b.Run(mode.name, func(b *testing.B) {
			var heap float64
			var took time.Duration
			for range b.N {
				runtime.GC()
				var before, after runtime.MemStats
				runtime.ReadMemStats(&before)
				now := time.Date(2026, 1, 2, 0, 0, 0, 0, time.UTC)
				cfg := Config{Scheduler: "s", Boot: "b", Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
					Now: func() time.Time { return now }}
				if mode.retain {
					cfg.RetainTerminal, cfg.RetainTerminalMax, cfg.RememberEnded = 10*time.Minute, 20_000, mode.remember
				}
				st := New(cfg)
				inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: "n0", Pool: "p", Incarnation: "i", Time: now}
				for g := range 8 {
					inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: g, UUID: fmt.Sprintf("g%d", g), Model: h100, MemoryMiB: 81920, Healthy: true})
				}
				st.ApplyInventory(inv)
				start := time.Now()
				var seq uint64
				for i := range n {
					at := now.Add(-history + time.Duration(i)*(history/time.Duration(n)))
					tenant, id := fmt.Sprintf("t%d", i%8), fmt.Sprintf("j%07d", i)
					req := job(id, 1, h100).Normalized(tenant)
					ev := func(typ contracts.JobEventType, state contracts.JobState, fill func(*contracts.JobEvent)) {
						seq++
						e := contracts.JobEvent{SchemaVersion: 1, Type: typ, Tenant: tenant, JobID: id, Attempt: 1, State: state, Time: at}
						if fill != nil {
							fill(&e)
						}
						st.ReplayJobEvent(e, seq, contracts.JobEventID(tenant, id, typ, 1, 0))
					}
					ev(contracts.EventQueued, contracts.StateQueued, func(e *contracts.JobEvent) { e.Request, e.SubmitSeq = &req, uint64(i+1) })
					ev(contracts.EventScheduled, contracts.StateScheduled, nil)
					ev(contracts.EventRunning, contracts.StateRunning, nil)
					if i >= n-running {
						continue
					}
					ev(contracts.EventSucceeded, contracts.StateSucceeded, nil)
					if i%(1<<13) == 0 { // the rebuild retires every 64k messages, about 8k jobs
						st.RetireTerminal()
					}
				}
				st.RetireTerminal()
				took += time.Since(start)
				runtime.GC()
				runtime.ReadMemStats(&after)
				heap += float64(after.HeapAlloc) - float64(before.HeapAlloc)
				whole, retired := st.Retained()
				b.Logf("%d jobs over %s: %d whole, %d retired records held", n, history, whole, retired)
				runtime.KeepAlive(st)
			}
			b.ReportMetric(heap/float64(b.N)/float64(n)*100_000/(1<<20), "MiB/100k-jobs")
			b.ReportMetric(heap/float64(b.N)/(1<<20), "MiB")
			b.ReportMetric(float64(n*b.N)/took.Seconds(), "jobs/s")
			b.ReportMetric(0, "ns/op")
		})
	}
}
