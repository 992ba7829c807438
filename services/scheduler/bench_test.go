package scheduler

import (
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// BenchmarkBurstSubmitToScheduled measures the whole service on a real
// embedded JetStream: a burst of 1,000 job requests from four tenants,
// submitted concurrently, until every job's scheduled event is in
// JOB_EVENTS, against a resource manager that commits every plan item at
// once. 250 nodes × 8 H100 hold the burst (1,500 GPUs).
func BenchmarkBurstSubmitToScheduled(b *testing.B) {
	const jobs, nodes = 1000, 250
	var plans int
	var elapsed time.Duration
	for range b.N {
		b.StopTimer()
		e := newEnv(b)
		for i := range nodes {
			e.inventory(fmt.Sprintf("n%03d", i), "east", h100, 8)
		}
		e.autoCommit()
		e.start()
		e.barrier("warmup")
		b.StartTimer()
		start := time.Now()
		e.submitMany(jobs, func(i int) (string, contracts.JobRequest) {
			return fmt.Sprintf("t%d", i%4), request(fmt.Sprintf("b%04d", i), 1+i%2, h100)
		})
		e.waitScheduled(jobs)
		elapsed += time.Since(start)
		b.StopTimer()
		plans += len(e.plans.all())
		e.stop()
	}
	b.ReportMetric(float64(jobs*b.N)/elapsed.Seconds(), "jobs/s")
	b.ReportMetric(float64(plans)/float64(b.N), "plans/burst")
}
