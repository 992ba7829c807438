package resourcemanager_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// BenchmarkBurst measures a 1,000-job burst through one resource manager:
// 1,000 single-GPU items in plans of 50 on 250 nodes of 4 GPUs, all of
// which fit; every one must be committed. Reports placements/s.
func BenchmarkBurst(b *testing.B) {
	const nodes, gpus, jobs, perPlan = 250, 4, 1000, 50
	for b.Loop() {
		b.StopTimer()
		h := newHarness(b)
		h.start(h.config("rm-a"))
		var ids []string
		for n := range nodes {
			h.inventory(fmt.Sprintf("n%03d", n), "i1", gpus, h100)
		}
		h.eventually("all registered", func() bool { return len(h.nodeEvents) == nodes })
		b.StartTimer()
		start := time.Now()
		var its []contracts.Allocation
		for j := range jobs {
			it := item(fmt.Sprintf("j%04d", j), 1, fmt.Sprintf("n%03d", j/gpus), h100, j%gpus)
			its = append(its, it)
			ids = append(ids, it.ID)
			if len(its) == perPlan {
				h.plan(fmt.Sprintf("p%03d", j/perPlan), its...)
				its = nil
			}
		}
		h.eventually("all committed", func() bool {
			return len(h.entries) == jobs
		})
		elapsed := time.Since(start)
		b.StopTimer()
		h.locked(func() {
			for _, id := range ids {
				if !h.has(id, contracts.LedgerCommitted) {
					b.Fatalf("%s not committed", id)
				}
			}
		})
		b.ReportMetric(float64(jobs)/elapsed.Seconds(), "placements/s")
		b.StartTimer()
	}
}
