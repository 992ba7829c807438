package state

import (
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"testing"
)

// BenchmarkQueuedMemory measures what the store holds per queued job: the
// live heap after GC before and after queueing QUEUED_JOBS (default
// 100,000) jobs of the mixed workload on an empty 100-machine fleet (no
// cycle runs, so every job stays queued). bytes/job is the live heap's
// growth over the jobs queued. GPUPLANE_MEMPROF names a file for an inuse
// heap profile taken while the jobs are held (BenchmarkRunningMemory).
func BenchmarkQueuedMemory(b *testing.B) {
	n := 100_000
	if v, err := strconv.Atoi(os.Getenv("QUEUED_JOBS")); err == nil && v > 0 {
		n = v
	}
	for range b.N {
		st := newBenchStore()
		for i := range 100 {
			st.ApplyInventory(benchInventory(i))
		}
		st.GoLive()
		before := liveHeap()
		writeHeapProfile(b, ".before")
		rng := rand.New(rand.NewPCG(1, 2))
		for i := range n {
			benchSubmit(b, st, benchTenant(rng.IntN(benchTenants)), benchRequest(rng, fmt.Sprintf("q%07d", i)), uint64(i+1))
		}
		after := liveHeap()
		writeHeapProfile(b, "")
		if st.Queued() != n {
			b.Fatalf("%d queued, want %d", st.Queued(), n)
		}
		runtime.KeepAlive(st)
		b.ReportMetric(float64(after-before)/float64(n), "bytes/job")
		b.ReportMetric(float64(after-before)/float64(n)*100_000/(1<<20), "MiB/100k")
	}
}

func liveHeap() int64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}
