package state

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/pprof"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// BenchmarkRunningMemory measures what the store holds per running job:
// the live heap after GC before and after RUNNING_JOBS (default 20,000)
// jobs of the mixed workload are queued, placed by cycles, committed and
// started on a fleet of one machine per job (8 GPUs each, so the mix fits
// with room to spare and every job runs). bytes/job is the live heap's
// growth over the jobs running: the job records, their parts and facts,
// the cluster's allocations and what cycles keep per running allocation.
// GPUPLANE_MEMPROF names a file for an inuse heap profile taken while the
// jobs are held (with -test.memprofilerate=1 for an exact one).
func BenchmarkRunningMemory(b *testing.B) {
	n := envInt("RUNNING_JOBS", 20_000)
	for range b.N {
		st := newBenchStore()
		for i := range n {
			st.ApplyInventory(benchInventory(i))
		}
		st.GoLive()
		st.Cycle() // the fleet's own caches, built by any cycle
		before := liveHeap()
		writeHeapProfile(b, ".before")
		rng := rand.New(rand.NewPCG(3, 4))
		running := 0
		for i := 0; i < n; {
			batch := min(5000, n-i)
			for range batch {
				i++
				benchSubmit(b, st, benchTenant(rng.IntN(benchTenants)), benchRequest(rng, fmt.Sprintf("r%07d", i)), uint64(i))
			}
			running += commitAndStart(b, st, st.Cycle())
		}
		for range 3 { // what the batches' cycles left waiting (an NVLink or gang shape)
			if st.Queued() == 0 {
				break
			}
			running += commitAndStart(b, st, st.Cycle())
		}
		if st.Queued() != 0 {
			b.Fatalf("%d jobs still queued, want every job running", st.Queued())
		}
		st.Cycle() // a steady cycle's kept per-allocation lists
		after := liveHeap()
		writeHeapProfile(b, "")
		runtime.KeepAlive(st)
		b.ReportMetric(float64(after-before)/float64(running), "bytes/job")
		b.ReportMetric(float64(after-before)/float64(running)*10_000/(1<<20), "MiB/10k")
	}
}

// commitAndStart commits and starts every item of res's plans, as the
// resource manager and the nodes would, and returns the jobs placed. The
// facts go through JSON, as the service reads them off the streams: what
// the store keeps of them is then its own, not the plan's strings.
func commitAndStart(b *testing.B, st *Store, res CycleResult) int {
	jobs := map[string]bool{}
	for _, p := range res.Plans {
		for _, a := range p.Items {
			st.ApplyLedger(viaJSON(b, contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a, Time: benchT0}))
			st.ApplyRun(viaJSON(b, contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunStarted, AllocationID: a.ID,
				Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Devices: a.Devices, Time: benchT0}))
			jobs[Key(a.Tenant, a.JobID)] = true
		}
	}
	return len(jobs)
}

// viaJSON is v encoded and decoded again.
func viaJSON[T any](b *testing.B, v T) T {
	var out T
	if err := json.Unmarshal(mustJSON(b, v), &out); err != nil {
		b.Fatal(err)
	}
	return out
}

// writeHeapProfile writes an inuse heap profile to GPUPLANE_MEMPROF (with
// suffix appended) when it is set, after a GC, so it shows what is live:
// the benchmarks write one before the jobs (".before") and one with them,
// for pprof's -diff_base.
func writeHeapProfile(b *testing.B, suffix string) {
	path := os.Getenv("GPUPLANE_MEMPROF")
	if path == "" {
		return
	}
	path += suffix
	runtime.GC()
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkWaitingMemory is BenchmarkQueuedMemory's store after cycles:
// WAITING_JOBS (default 50,000) jobs queued on a 100-machine fleet that
// holds few of them, then cycles a second apart (placements committed and
// started), so that every waiting job has a reason and a published
// pending event behind it, as in a steady deep queue. bytes/job is the
// live heap's growth over the jobs (waiting and running).
func BenchmarkWaitingMemory(b *testing.B) {
	n := envInt("WAITING_JOBS", 50_000)
	for range b.N {
		st := newBenchStore()
		now := benchT0
		st.cfg.Now = func() time.Time { return now }
		for i := range 100 {
			st.ApplyInventory(benchInventory(i))
		}
		st.GoLive()
		st.Cycle()
		before := liveHeap()
		writeHeapProfile(b, ".before")
		rng := rand.New(rand.NewPCG(5, 6))
		for i := range n {
			benchSubmit(b, st, benchTenant(rng.IntN(benchTenants)), benchRequest(rng, fmt.Sprintf("w%07d", i)), uint64(i+1))
		}
		for range 3 {
			commitAndStart(b, st, st.Cycle())
			now = now.Add(PendingRefreshInterval) // the next cycle may publish changed reasons
		}
		after := liveHeap()
		writeHeapProfile(b, "")
		runtime.KeepAlive(st)
		b.ReportMetric(float64(st.Queued()), "waiting")
		b.ReportMetric(float64(after-before)/float64(n), "bytes/job")
	}
}
