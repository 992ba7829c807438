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
// committed and released), 1 % still running. It reports the heap the
// store then holds per 100,000 jobs, with every ended job kept whole (as
// before issue 17) and with ended jobs retired, and the replay's speed.
func BenchmarkStoreMemory(b *testing.B) {
	n := 20_000
	if v := os.Getenv("GPUPLANE_REBUILD_JOBS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil {
			b.Fatal(err)
		}
	}
	for _, mode := range []struct {
		name   string
		retain bool
	}{{"all-kept", false}, {"retired", true}} {
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
					cfg.RetainTerminal, cfg.RetainTerminalMax = 10*time.Minute, 20_000
				}
				st := New(cfg)
				inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: "n0", Pool: "p", Incarnation: "i", Time: now}
				for g := range 8 {
					inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: g, UUID: fmt.Sprintf("g%d", g), Model: h100, MemoryMiB: 81920, Healthy: true})
				}
				st.ApplyInventory(inv)
				start := time.Now()
				var seq uint64
				at := now.Add(-24 * time.Hour)
				for i := range n {
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
					if i >= n-n/100 {
						continue
					}
					ev(contracts.EventSucceeded, contracts.StateSucceeded, nil)
					if i%(1<<16) == 0 {
						st.RetireTerminal()
					}
				}
				st.RetireTerminal()
				took += time.Since(start)
				runtime.GC()
				runtime.ReadMemStats(&after)
				heap += float64(after.HeapAlloc) - float64(before.HeapAlloc)
				whole, retired := st.Retained()
				b.Logf("%d jobs: %d whole, %d retired", n, whole, retired)
				runtime.KeepAlive(st)
			}
			b.ReportMetric(heap/float64(b.N)/float64(n)*100_000/(1<<20), "MiB/100k-jobs")
			b.ReportMetric(float64(n*b.N)/took.Seconds(), "jobs/s")
			b.ReportMetric(0, "ns/op")
		})
	}
}
