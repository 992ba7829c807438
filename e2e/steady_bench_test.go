package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// steadyFleet is BenchmarkSteadyLoad's fleet: 2,560 GPUs, so that at
// 1,000 jobs/s of half-second jobs the fleet never fills and the latency
// measured is the control plane's, not a wait for GPUs.
func steadyFleet(machines int) string {
	return fmt.Sprintf(`
machineTypes:
  hgx-h100-8: {gpuModel: H100-80GB, gpuCount: 8, nvlink: true}
pools:
  - {name: steady, machineType: hgx-h100-8, count: %d, zone: zone-a, priceClass: on-demand}
`, machines)
}

// steadyJobDuration is each job's simulated run: short, so GPUs come back
// as fast as they are handed out.
const steadyJobDuration = 500 * time.Millisecond

// BenchmarkSteadyLoad offers one-GPU jobs at a fixed rate (rate=1000 and
// rate=5000 jobs/s) for a while, each submitted by a paced publisher on
// JOBS (an async JetStream publish per job, at its due time, whatever the
// platform does: an open loop), and reports submit→scheduled p50, p99 and
// max, the rate achieved, the raw JetStream publish rate beside it and
// what the bus carried per job (busmeter_test.go). The jobs run for half
// a second each on a fleet large enough that it never fills at the lower
// rate.
//
// The load lasts GPUPLANE_STEADY_SECONDS (default 10; `make bench` sets
// the 60); GPUPLANE_STEADY_MACHINES sizes the fleet (default 320
// machines × 8 GPUs).
//
//	go test -run '^$' -bench SteadyLoad -benchtime 1x ./e2e/
func BenchmarkSteadyLoad(b *testing.B) {
	seconds := envInt(b, "GPUPLANE_STEADY_SECONDS", 10)
	// As the all-in-one binary runs (GOGC in the environment still rules).
	b.Cleanup(gpuplane.TuneGC(gpuplane.DefaultGCPercent))
	machines := envInt(b, "GPUPLANE_STEADY_MACHINES", 320)
	// GPUPLANE_STEADY_CPUPROFILE: a CPU profile of each rate's load and
	// drain (start-up left out), in <path>.rate<N>.
	profile := os.Getenv("GPUPLANE_STEADY_CPUPROFILE")
	fl, err := fleet.Parse([]byte(steadyFleet(machines)))
	if err != nil {
		b.Fatal(err)
	}
	for _, rate := range []int{1000, 5000} {
		b.Run("rate="+strconv.Itoa(rate), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				s, meter := meteredStack(b, &fl)
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration(seconds)*6*time.Second+3*time.Minute)
				waitNodes(b, ctx, s, len(fl.Machines()))
				waitReady(b, ctx, s, fmt.Sprintf("warmup-%d", i))
				raw := rawPublishRate(b, ctx, s.js, 1000, 1)
				idle := meter.read(ctx, b)
				time.Sleep(time.Second)
				from := meter.read(ctx, b)
				stopProfile := func() {}
				if profile != "" {
					stopProfile = startCPUProfile(b, fmt.Sprintf("%s.rate%d", profile, rate))
					b.Cleanup(stopProfile)
				}
				cpu, cpuStart := processCPU(), time.Now()
				b.StartTimer()
				r := paced(b, ctx, s, fmt.Sprintf("s%d", i), rate, time.Duration(seconds)*time.Second)
				b.StopTimer()
				stopProfile()
				perJob, bound := reportCPU(b, cpu, r.offered)
				reportNetCPU(b, perJob, idle, from, cpuStart, r.offered)
				b.Logf("CPU over the load and its drain: %s per job offered, all in this process; %d cores fully used would keep up with %.0f jobs/s",
					perJob.Round(time.Microsecond), runtime.GOMAXPROCS(0), bound)
				to := meter.read(ctx, b)
				cancel()
				c := cost(idle, from, to, r.offered)
				b.ReportMetric(r.p50.Seconds()*1000, "p50-ms")
				b.ReportMetric(r.p99.Seconds()*1000, "p99-ms")
				b.ReportMetric(r.max.Seconds()*1000, "max-ms")
				b.ReportMetric(r.achieved, "jobs/s")
				b.ReportMetric(raw, "raw-publish/s")
				b.ReportMetric(c.stored, "stored/job")
				b.Logf("%d jobs offered at %d/s for %ds (publisher at most %s behind): %d scheduled, %.0f jobs/s; submit→scheduled p50 %s, p99 %s, max %s; raw JetStream publish %.0f msg/s",
					r.offered, rate, seconds, r.lag.Round(time.Millisecond), r.scheduled, r.achieved,
					r.p50.Round(time.Millisecond), r.p99.Round(time.Millisecond), r.max.Round(time.Millisecond), raw)
				b.Logf("%s", c)
				b.Logf("%s", deliveries(idle, from, to, r.offered))
				if r.scheduled < r.offered {
					b.Logf("%d jobs not scheduled within the drain bound: the platform fell behind the offered rate", r.offered-r.scheduled)
				}
			}
		})
	}
}

// pacedResult is what paced measured.
type pacedResult struct {
	offered, scheduled int
	// achieved is scheduled jobs per second from the first submit to the
	// last scheduled event.
	achieved      float64
	p50, p99, max time.Duration
	// lag is how far behind its schedule the publisher ever was.
	lag time.Duration
}

// paced submits one-GPU jobs at rate per second for d, each at its due
// time, then waits (bounded) for their scheduled events. Latency runs from
// each job's publish to its scheduled event as a core subscription sees it.
func paced(b *testing.B, ctx context.Context, s *stack, prefix string, rate int, d time.Duration) pacedResult {
	b.Helper()
	n := int(float64(rate) * d.Seconds())
	submittedAt := make([]time.Time, n)
	scheduledAt := make([]time.Time, n)
	// queuedAt splits the latency: submit→queued is the scheduler's
	// intake, queued→scheduled the cycle, the commit and the event.
	queuedAt := make([]time.Time, n)
	// plannedAt and committedAt split queued→scheduled further: the plan
	// that placed the job seen on PLANS, its ledger entry on ALLOCATIONS.
	plannedAt, committedAt := make([]time.Time, n), make([]time.Time, n)
	// runningAt and releasedAt split how long a job holds its GPU, which
	// at a fixed rate decides whether the fleet keeps room: committed→
	// running is the agent's start (its started fact on RUNS), running→
	// released the run itself (a fixed steadyJobDuration), its end fact
	// and the release.
	runningAt, releasedAt := make([]time.Time, n), make([]time.Time, n)
	var mu sync.Mutex
	scheduled := 0
	done := make(chan struct{})
	prefixLen := len(contracts.SubjectJobEvents("bench", prefix+"-"))
	sub, err := s.nc.Subscribe(contracts.SubjectTenantJobEvents("bench"), func(m *nats.Msg) {
		ceType := m.Header.Get(contracts.HeaderCEType)
		queued := ceType == "io.gpuplane.job.queued.v1"
		if !queued && ceType != "io.gpuplane.job.scheduled.v1" || len(m.Subject) <= prefixLen {
			return
		}
		now := time.Now()
		k, err := strconv.Atoi(m.Subject[prefixLen:])
		if err != nil || k < 0 || k >= n {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if queued {
			if queuedAt[k].IsZero() {
				queuedAt[k] = now
			}
			return
		}
		if scheduledAt[k].IsZero() {
			scheduledAt[k] = now
			if scheduled++; scheduled == n {
				close(done)
			}
		}
	})
	if err != nil {
		b.Fatal(err)
	}
	defer sub.Unsubscribe()
	index := func(tenant, job string) int {
		if tenant != "bench" || !strings.HasPrefix(job, prefix+"-") {
			return -1
		}
		k, err := strconv.Atoi(job[len(prefix)+1:])
		if err != nil || k < 0 || k >= n {
			return -1
		}
		return k
	}
	for subject, firstAt := range map[string][]time.Time{contracts.SubjectPlansAll: plannedAt, contracts.SubjectLedgerAll: committedAt,
		contracts.SubjectRunsAll: runningAt} {
		psub, err := s.nc.Subscribe(subject, func(m *nats.Msg) {
			now := time.Now()
			at := firstAt
			var items []contracts.Allocation
			switch {
			case subject == contracts.SubjectRunsAll:
				var ev contracts.RunEvent
				if json.Unmarshal(m.Data, &ev) != nil || ev.Kind != contracts.RunStarted {
					return
				}
				items = []contracts.Allocation{{Tenant: ev.Tenant, JobID: ev.JobID}}
			case subject == contracts.SubjectPlansAll:
				var p contracts.Plan
				if json.Unmarshal(m.Data, &p) != nil {
					return
				}
				items = p.Items
			default:
				var e contracts.LedgerEntry
				if json.Unmarshal(m.Data, &e) != nil || e.Kind != contracts.LedgerCommitted && e.Kind != contracts.LedgerReleased {
					return
				}
				items = []contracts.Allocation{e.Allocation}
				if e.Kind == contracts.LedgerReleased {
					at = releasedAt
				}
			}
			mu.Lock()
			defer mu.Unlock()
			for _, a := range items {
				if k := index(a.Tenant, a.JobID); k >= 0 && at[k].IsZero() {
					at[k] = now
				}
			}
		})
		if err != nil {
			b.Fatal(err)
		}
		defer psub.Unsubscribe()
	}
	if err := s.nc.Flush(); err != nil {
		b.Fatal(err)
	}
	bodies := make([][]byte, n)
	for i := range bodies {
		bodies[i], _ = json.Marshal(contracts.JobRequest{ID: fmt.Sprintf("%s-%d", prefix, i),
			Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB"}},
			Run:       contracts.RunSpec{Duration: contracts.Duration(steadyJobDuration)}})
	}
	// Its own JetStream context: an open loop at 5,000/s may have more
	// acks outstanding than nats.go's default 4,000 allows.
	js, err := jetstream.New(s.nc, jetstream.WithPublishAsyncMaxPending(n+1))
	if err != nil {
		b.Fatal(err)
	}
	futures := make([]jetstream.PubAckFuture, 0, n)
	var lag time.Duration
	interval := time.Second / time.Duration(rate)
	start := time.Now()
	for i := 0; i < n; {
		// Publish every job due by now, then sleep to the next one's time.
		due := min(n, int(time.Since(start)/interval)+1)
		if due > i+1 {
			lag = max(lag, time.Since(start)-time.Duration(i)*interval)
		}
		for ; i < due; i++ {
			msg := nats.NewMsg(contracts.SubjectSubmit("bench"))
			msg.Data = bodies[i]
			msg.Header.Set(contracts.HeaderMsgID, contracts.SubmitMsgID("bench", fmt.Sprintf("%s-%d", prefix, i)))
			mu.Lock()
			submittedAt[i] = time.Now()
			mu.Unlock()
			f, err := js.PublishMsgAsync(msg)
			if err != nil {
				b.Fatal(err)
			}
			futures = append(futures, f)
		}
		if i < n {
			time.Sleep(time.Until(start.Add(time.Duration(i) * interval)))
		}
	}
	for _, f := range futures {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			b.Fatal(err)
		case <-ctx.Done():
			b.Fatal("publish acks: ", ctx.Err())
		}
	}
	// Drain: a platform that keeps up needs a moment; one that fell
	// behind gets a bound, and what it did not schedule is reported.
	drain := time.NewTimer(max(time.Minute, 5*d))
	defer drain.Stop()
	select {
	case <-done:
	case <-drain.C:
	case <-ctx.Done():
	}
	mu.Lock()
	defer mu.Unlock()
	lat := make([]time.Duration, 0, n)
	var intake, after, toPlan, toCommit, toEvent []time.Duration
	var last time.Time
	for k, t := range scheduledAt {
		if t.IsZero() {
			continue
		}
		lat = append(lat, t.Sub(submittedAt[k]))
		if q := queuedAt[k]; !q.IsZero() {
			intake, after = append(intake, q.Sub(submittedAt[k])), append(after, t.Sub(q))
			if p, c := plannedAt[k], committedAt[k]; !p.IsZero() && !c.IsZero() {
				toPlan, toCommit, toEvent = append(toPlan, p.Sub(q)), append(toCommit, c.Sub(p)), append(toEvent, t.Sub(c))
			}
		}
		if t.After(last) {
			last = t
		}
	}
	if len(lat) == 0 {
		b.Fatalf("none of %d jobs scheduled", n)
	}
	slices.Sort(lat)
	pct := func(d []time.Duration) string {
		if len(d) == 0 {
			return "none"
		}
		slices.Sort(d)
		return fmt.Sprintf("p50 %s, p99 %s", d[len(d)/2].Round(time.Millisecond), d[len(d)*99/100].Round(time.Millisecond))
	}
	b.Logf("submit→queued (intake) %s; queued→scheduled %s: queued→plan %s, plan→committed %s, committed→scheduled %s",
		pct(intake), pct(after), pct(toPlan), pct(toCommit), pct(toEvent))
	var toRunning, toReleased []time.Duration
	for k, c := range committedAt {
		if r, rel := runningAt[k], releasedAt[k]; !c.IsZero() && !r.IsZero() && !rel.IsZero() {
			toRunning, toReleased = append(toRunning, r.Sub(c)), append(toReleased, rel.Sub(r))
		}
	}
	b.Logf("GPU held (runs of %s): committed→running %s, running→released %s (%d jobs)",
		steadyJobDuration, pct(toRunning), pct(toReleased), len(toRunning))
	return pacedResult{offered: n, scheduled: len(lat), achieved: float64(len(lat)) / last.Sub(start).Seconds(),
		p50: lat[len(lat)/2], p99: lat[len(lat)*99/100], max: lat[len(lat)-1], lag: lag}
}

// envInt is the positive integer in environment variable name, or def.
func envInt(b *testing.B, name string, def int) int {
	b.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		b.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}
