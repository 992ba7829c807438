package ledger

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// BenchmarkRetiredHistory measures what the ledger's heap grows by per
// job of history once the history is longer than the retired records'
// window (issue 17: nothing grows with history). Jobs are committed and
// released (a few live at once) at GPUPLANE_RETIRED_RATE jobs per second
// of log time (default 2) for 2 and then 4 days of log time; the figure
// is the heap's growth between the two, per job. "keep=forever" is the
// ledger as it was (a record per ended job for good: a window longer than
// the run), measured in the same run as the baseline; "keep=default" is
// Keep(contracts.PlansMaxAge).
func BenchmarkRetiredHistory(b *testing.B) {
	rate := 2.0
	if v := os.Getenv("GPUPLANE_RETIRED_RATE"); v != "" {
		r, err := strconv.ParseFloat(v, 64)
		if err != nil || r <= 0 {
			b.Fatalf("GPUPLANE_RETIRED_RATE=%q: want jobs per second > 0", v)
		}
		rate = r
	}
	const day = 24 * time.Hour
	for _, tc := range []struct {
		name string
		keep time.Duration
	}{{"keep=forever", 1000 * day}, {"keep=default", Keep(contracts.PlansMaxAge, DefaultMargin)}} {
		b.Run(tc.name, func(b *testing.B) {
			for range b.N {
				jobs2, heap2, retired2, _ := retiredHistory(b, tc.keep, rate, 2*day)
				jobs4, heap4, retired4, took := retiredHistory(b, tc.keep, rate, 4*day)
				b.ReportMetric(float64(took.Nanoseconds())/float64(jobs4), "ns/job")
				b.ReportMetric(float64(int64(heap4)-int64(heap2))/float64(jobs4-jobs2), "B/job-of-history")
				b.ReportMetric(float64(heap4)/1e6, "MB-heap@4d")
				b.ReportMetric(float64(retired2), "retired@2d")
				b.ReportMetric(float64(retired4), "retired@4d")
			}
		})
	}
}

// retiredHistory runs span of log time through a fresh ledger and
// returns the jobs run, the live heap with the ledger (less the heap
// without it), the retired records it holds and the time the jobs took
// (a commit and a release each, as Apply).
func retiredHistory(b *testing.B, keep time.Duration, rate float64, span time.Duration) (jobs int, heap uint64, retired int, took time.Duration) {
	b.Helper()
	const nodes, gpus = 16, 8
	start := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	before := liveHeap()
	l := New(keep)
	for n := range nodes {
		id := fmt.Sprintf("n%02d", n)
		inv := contracts.NodeInventory{NodeID: id}
		for g := range gpus {
			d := dev(id, g, "H100-80GB")
			inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: g, UUID: d.UUID, Model: d.Model, MemoryMiB: 81920, Healthy: true})
		}
		if err := l.SetInventory(inv); err != nil {
			b.Fatal(err)
		}
		l.SetReady(id, true)
	}
	seqs := make([]uint64, nodes)
	apply := func(e contracts.LedgerEntry, node int) {
		seqs[node]++
		if err := l.Apply(e, seqs[node]); err != nil {
			b.Fatal(err)
		}
	}
	jobs = int(span.Seconds() * rate)
	step := time.Duration(float64(time.Second) / rate)
	const live = nodes * gpus / 2 // each job runs live steps
	var running []contracts.Allocation
	var at []int
	began := time.Now()
	for i := range jobs {
		t := start.Add(time.Duration(i) * step)
		if len(running) == live {
			e := released(running[0])
			e.Time = t
			apply(e, at[0])
			running, at = running[1:], at[1:]
		}
		node := i % nodes
		id := fmt.Sprintf("n%02d", node)
		a := alloc("acme", "j"+strconv.Itoa(i), 1, id, dev(id, (i/nodes)%gpus, "H100-80GB"))
		e := committed(a)
		e.Time = t
		apply(e, node)
		running, at = append(running, a), append(at, node)
	}
	took = time.Since(began)
	heap = liveHeap() - before
	retired = l.Retired()
	runtime.KeepAlive(l)
	return jobs, heap, retired, took
}

// liveHeap is the heap in use after a collection.
func liveHeap() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}
