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
// once. 250 nodes × 8 H100 hold the burst (1,500 GPUs). In "forgetting"
// the scheduler has forgotten an ended job before the burst, so every new
// job's ID is first looked up in JOB_EVENTS (state/recall.go): what that
// read costs a submit once a scheduler has run longer than
// -remember-ended.
func BenchmarkBurstSubmitToScheduled(b *testing.B) {
	for _, forgetting := range []bool{false, true} {
		name := "remembering"
		if forgetting {
			name = "forgetting"
		}
		b.Run(name, func(b *testing.B) { benchBurst(b, forgetting) })
	}
}

func benchBurst(b *testing.B, forgetting bool) {
	const jobs, nodes = 1000, 250
	var plans int
	var elapsed time.Duration
	for range b.N {
		b.StopTimer()
		e := newEnv(b)
		for i := range nodes {
			e.inventory(fmt.Sprintf("n%03d", i), "east", h100, 8)
		}
		if forgetting {
			e.cfg.RetainEnded, e.cfg.RetainEndedMax = time.Nanosecond, 0
			e.cfg.RememberEnded, e.cfg.shortMemory, e.cfg.retireEvery = 100*time.Millisecond, true, 10*time.Millisecond
		}
		e.autoCommit()
		e.start()
		e.barrier("warmup")
		if forgetting {
			e.submit("warmup", request("old", 64, h100))
			e.cancel("warmup", "old")
			e.waitEvent("warmup", "old", contracts.EventCancelled)
			time.Sleep(300 * time.Millisecond) // past 1.25 × RememberEnded: forgotten
		}
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
