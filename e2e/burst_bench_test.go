package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"runtime/trace"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// benchFleet has room for every job of a burst at once (160 × 8 H100), so
// the benchmark measures the control plane, not waiting for GPUs.
const benchFleet = `
machineTypes:
  hgx-h100-8: {gpuModel: H100-80GB, gpuCount: 8, nvlink: true}
pools:
  - {name: bench, machineType: hgx-h100-8, count: 160, zone: zone-a, priceClass: on-demand}
`

// BenchmarkBurst measures a burst of 1,000 one-GPU jobs from submit (an
// async JetStream publish per job) to the scheduled event, through the whole
// platform. R1 runs it on one embedded JetStream server with R1 streams;
// R3 on a 3-member cluster in this process (natstest.StartCluster) with
// R3 streams; R3-sync-always the same with every member fsyncing each
// write (sync_interval: always), production's settings. One run gives the
// cost of each (issue 13): both report their ratio to R1 (jobs/s-vs-R1). Beside
// each, in the same run, the raw JetStream publish rate of as many
// messages of the same size to a file-backed stream of the same
// replicas: the ceiling any bus-based control plane works under. R1 also
// counts what the bus carried per job (busmeter_test.go): server messages
// in and out, messages stored by stream and JetStream API requests, to the
// scheduled event and to the running one, and reports the ideal rate,
// the raw publish rate over the messages stored per job. R1-warm is R1
// on a platform that has already served a burst of the same size (its
// one-second jobs ended before the burst measured), after a collection:
// the heap's memory is the process's already, as on a platform that has
// been up for a while. A freshly started process (R1) touches every
// page its heap grows by for the first time during the burst: a page
// fault each, about 10 µs on the 2-core development VM (20,000 first
// touches of 4 KiB took 210 ms there). Both report those faults per job
// (minflt/job), and R1-warm its ratio to R1 (jobs/s-vs-R1).
//
//	make bench   (or: go test -run '^$' -bench Burst -benchtime 1x ./e2e/)
func BenchmarkBurst(b *testing.B) {
	// GPUPLANE_BURST_JOBS sizes the burst (the fleet grows to hold it at
	// once); GPUPLANE_BURST_CPUPROFILE names a file for a CPU profile of
	// the burst alone (start-up and warm-up left out), R1 only;
	// GPUPLANE_BURST_TRACE one for an execution trace of it (go tool trace).
	jobs := envInt(b, "GPUPLANE_BURST_JOBS", 1000)
	// The platform runs here as the all-in-one binary runs it (GOGC and
	// GOMEMLIMIT in the environment still rule: GOGC=100 measures the
	// runtime's default).
	b.Cleanup(gpuplane.TuneGC(gpuplane.DefaultGCPercent))
	profile := os.Getenv("GPUPLANE_BURST_CPUPROFILE")
	fleetYAML := benchFleet
	if machines := (jobs + 7) / 8; machines > 125 {
		fleetYAML = strings.Replace(benchFleet, "count: 160", fmt.Sprintf("count: %d", machines*5/4), 1)
	}
	fl, err := fleet.Parse([]byte(fleetYAML))
	if err != nil {
		b.Fatal(err)
	}
	results := map[string]burstResult{}
	r1 := func(b *testing.B) (*stack, int, *busMeter) {
		s, m := meteredStack(b, &fl)
		return s, 1, m
	}
	for _, topo := range []struct {
		name  string
		start func(b *testing.B) (*stack, int, *busMeter)
		warm  bool // serve a burst of the same size first
	}{
		{name: "R1", start: r1},
		{name: "R1-warm", start: r1, warm: true},
		{name: "R3", start: func(b *testing.B) (*stack, int, *busMeter) { return clusterStack(b, &fl, false), 3, nil }},
		{name: "R3-sync-always", start: func(b *testing.B) (*stack, int, *busMeter) { return clusterStack(b, &fl, true), 3, nil }},
	} {
		b.Run(topo.name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				s, replicas, meter := topo.start(b)
				ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
				waitNodes(b, ctx, s, len(fl.Machines()))
				waitReady(b, ctx, s, fmt.Sprintf("warmup-%d", i))
				if topo.warm {
					warmBurst(b, ctx, s, fmt.Sprintf("w%d", i), jobs)
				}
				baseline := rawPublishRate(b, ctx, s.js, jobs, replicas)
				var idle, from busCounts
				if meter != nil {
					// The platform's background (heartbeats, telemetry)
					// over a second, to take out of the burst's counts.
					idle = meter.read(ctx, b)
					time.Sleep(time.Second)
					from = meter.read(ctx, b)
				}
				stopProfile := func() {}
				// R1-warm's files are R1's with ".warm" appended.
				suffix, profiled := map[string]string{"R1": "", "R1-warm": ".warm"}[topo.name]
				if profile != "" && profiled {
					stopProfile = startCPUProfile(b, profile+suffix)
					b.Cleanup(stopProfile)
				}
				if tr := os.Getenv("GPUPLANE_BURST_TRACE"); tr != "" && profiled {
					stopCPU, stopTrace := stopProfile, startTrace(b, tr+suffix)
					b.Cleanup(stopTrace)
					stopProfile = func() { stopCPU(); stopTrace() }
				}
				faults := minorFaults()
				cpu, cpuStart := processCPU(), time.Now()
				b.StartTimer()
				r := burst(b, ctx, s, fmt.Sprintf("b%d", i), jobs, 10*time.Minute)
				b.StopTimer()
				stopProfile()
				perJob, bound := reportCPU(b, cpu, jobs)
				b.ReportMetric(float64(minorFaults()-faults)/float64(jobs), "minflt/job")
				if meter != nil {
					reportNetCPU(b, perJob, idle, from, cpuStart, jobs)
				}
				b.Logf("CPU to the last scheduled event: %s per job, all in this process; %d cores fully used would schedule %.0f jobs/s",
					perJob.Round(time.Microsecond), runtime.GOMAXPROCS(0), bound)
				if meter != nil {
					toScheduled := meter.read(ctx, b)
					started := waitStarted(b, ctx, r.started, jobs)
					toStarted := meter.read(ctx, b)
					reportBusCost(b, cost(idle, from, toScheduled, jobs), cost(idle, from, toStarted, jobs), started, baseline, r.jobsPerSec)
					b.Logf("to started, %s", deliveries(idle, from, toStarted, jobs))
				}
				cancel()
				r.raw = baseline
				results[topo.name] = r
				b.ReportMetric(r.jobsPerSec, "jobs/s")
				b.ReportMetric(r.p50.Seconds()*1000, "p50-ms")
				b.ReportMetric(r.p99.Seconds()*1000, "p99-ms")
				b.ReportMetric(baseline, "raw-publish/s")
				b.ReportMetric(r.jobsPerSec/baseline, "ratio-to-raw")
				b.Logf("%d jobs submit→scheduled: %.0f jobs/s, p50 %s, p99 %s, max %s (last queued after %s, last scheduled after %s); raw JetStream publish %.0f msg/s (ratio %.3f)",
					jobs, r.jobsPerSec, r.p50.Round(time.Millisecond), r.p99.Round(time.Millisecond), r.max.Round(time.Millisecond),
					r.intake.Round(time.Millisecond), r.total.Round(time.Millisecond), baseline, r.jobsPerSec/baseline)
				if r1, ok := results["R1"]; ok && topo.name != "R1" {
					// R1-warm's ratio is what a cold heap costs R1;
					// R3's what replication costs.
					b.ReportMetric(r.jobsPerSec/r1.jobsPerSec, "jobs/s-vs-R1")
					b.Logf("cost against R1, same machine, same run: %.0f vs %.0f jobs/s (%.2fx), p50 %s vs %s, p99 %s vs %s; raw publish %.0f vs %.0f msg/s (%.2fx)",
						r.jobsPerSec, r1.jobsPerSec, r.jobsPerSec/r1.jobsPerSec, r.p50.Round(time.Millisecond), r1.p50.Round(time.Millisecond),
						r.p99.Round(time.Millisecond), r1.p99.Round(time.Millisecond), r.raw, r1.raw, r.raw/r1.raw)
				}
			}
		})
	}
}

type burstResult struct {
	// intake is from the first submit to the last queued event; total to
	// the last scheduled one.
	intake, total time.Duration
	jobsPerSec    float64
	p50, p99, max time.Duration
	// raw is the raw publish rate measured beside it (msg/s).
	raw float64
	// started counts the jobs whose running event arrived; it keeps
	// counting after burst returns (see waitStarted).
	started func() int
}

// waitStarted waits, at most 30 s, until n jobs have started (their
// running event arrived), and returns how many have.
func waitStarted(b *testing.B, ctx context.Context, started func() int, n int) int {
	b.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for started() < n {
		select {
		case <-ctx.Done():
			return started()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return started()
}

// reportBusCost reports what the bus carried per job to the scheduled
// event and to the running one, and how close the platform came to the
// bus's own cost: the raw publish rate over the messages stored per job
// (to the running event) is the rate a control plane doing nothing but
// storing those messages would reach.
func reportBusCost(b *testing.B, sched, start busCost, started int, raw, jobsPerSec float64) {
	b.Helper()
	// Every message the platform stores per job counts against the
	// ideal, the running path's too: the bus carries them during the
	// burst, beside the scheduled path.
	ideal := raw / start.stored
	b.ReportMetric(sched.in, "srv-msgs-in/job")
	b.ReportMetric(start.stored, "stored/job")
	b.ReportMetric(ideal, "ideal-jobs/s")
	b.ReportMetric(jobsPerSec/ideal, "of-ideal")
	b.Logf("to scheduled, %s", sched)
	b.Logf("to started (%d of %d jobs running), %s", started, start.jobs, start)
	b.Logf("ideal at the bus's own cost: %.0f msg/s raw / %.2f stored msgs per job = %.0f jobs/s; reached %.0f (%.1f %%)",
		raw, start.stored, ideal, jobsPerSec, 100*jobsPerSec/ideal)
}

// warmBurst serves a burst of n one-second jobs (IDs from prefix), waits
// until the resource manager has released every one's devices (their
// runs ended), and collects the heap: what the burst allocated is
// garbage, and the memory it grew the heap by stays the process's (the
// runtime keeps it up to the next goal).
func warmBurst(b *testing.B, ctx context.Context, s *stack, prefix string, n int) {
	b.Helper()
	var mu sync.Mutex
	released := map[string]bool{}
	done := make(chan struct{})
	// A core subscription sees each ledger entry as JetStream stores it.
	sub, err := s.nc.Subscribe(contracts.SubjectLedgerAll, func(m *nats.Msg) {
		var e contracts.LedgerEntry
		if json.Unmarshal(m.Data, &e) != nil || e.Kind != contracts.LedgerReleased || e.Allocation.Tenant != "bench" ||
			!strings.HasPrefix(e.Allocation.JobID, prefix+"-") {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if !released[e.Allocation.JobID] {
			released[e.Allocation.JobID] = true
			if len(released) == n {
				close(done)
			}
		}
	})
	if err != nil {
		b.Fatal(err)
	}
	defer sub.Unsubscribe()
	w := burst(b, ctx, s, prefix, n, time.Second)
	select {
	case <-done:
	case <-ctx.Done():
		mu.Lock()
		b.Fatalf("only %d of %d warm-up jobs released: %v", len(released), n, ctx.Err())
	}
	runtime.GC()
	b.Logf("warm-up burst: %.0f jobs/s; its %d jobs ended and their devices were released", w.jobsPerSec, n)
}

// minorFaults is the page faults this process took that needed no disk:
// first touches of memory, here of the heap's new pages.
func minorFaults() int64 { return rusage().Minflt }

func burst(b *testing.B, ctx context.Context, s *stack, prefix string, n int, run time.Duration) burstResult {
	b.Helper()
	var mu sync.Mutex
	scheduledAt := make(map[string]time.Time, n)
	var lastQueued time.Time
	running := map[string]bool{}
	done := make(chan struct{})
	// A core subscription sees each event as JetStream stores it.
	sub, err := s.nc.Subscribe(contracts.SubjectTenantJobEvents("bench"), func(m *nats.Msg) {
		now := time.Now()
		if m.Header.Get(contracts.HeaderCEType) == "io.gpuplane.job.running.v1" {
			mu.Lock()
			running[m.Subject] = true
			mu.Unlock()
		}
		if m.Header.Get(contracts.HeaderCEType) == "io.gpuplane.job.queued.v1" {
			mu.Lock()
			lastQueued = now
			mu.Unlock()
		}
		if m.Header.Get(contracts.HeaderCEType) != "io.gpuplane.job.scheduled.v1" {
			return
		}
		id := m.Subject[len("gp.jobs.events.bench."):]
		mu.Lock()
		defer mu.Unlock()
		if _, seen := scheduledAt[id]; !seen {
			scheduledAt[id] = now
			if len(scheduledAt) == n {
				close(done)
			}
		}
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = sub.Unsubscribe() })

	submittedAt := make(map[string]time.Time, n)
	bodies := make([][]byte, n)
	for i := range bodies {
		req := contracts.JobRequest{ID: fmt.Sprintf("%s-%04d", prefix, i),
			Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB"}},
			Run:       contracts.RunSpec{Duration: contracts.Duration(run)}}
		bodies[i], _ = json.Marshal(req)
	}
	start := time.Now()
	futures := make([]jetstream.PubAckFuture, n)
	for i, body := range bodies {
		id := fmt.Sprintf("%s-%04d", prefix, i)
		msg := nats.NewMsg(contracts.SubjectSubmit("bench"))
		msg.Data = body
		msg.Header.Set(contracts.HeaderMsgID, contracts.SubmitMsgID("bench", id))
		submittedAt[id] = time.Now()
		if futures[i], err = s.js.PublishMsgAsync(msg); err != nil {
			b.Fatal(err)
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
	select {
	case <-done:
	case <-ctx.Done():
		mu.Lock()
		b.Fatalf("only %d of %d jobs scheduled: %v", len(scheduledAt), n, ctx.Err())
	}
	mu.Lock()
	defer mu.Unlock()
	var last time.Time
	lat := make([]time.Duration, 0, n)
	for id, t := range scheduledAt {
		lat = append(lat, t.Sub(submittedAt[id]))
		if t.After(last) {
			last = t
		}
	}
	slices.Sort(lat)
	return burstResult{
		intake:     lastQueued.Sub(start),
		total:      last.Sub(start),
		jobsPerSec: float64(n) / last.Sub(start).Seconds(),
		p50:        lat[len(lat)/2],
		p99:        lat[len(lat)*99/100],
		max:        lat[len(lat)-1],
		started: func() int {
			mu.Lock()
			defer mu.Unlock()
			return len(running)
		},
	}
}

// rawPublishRate publishes n messages of a job request's size to a
// file-backed stream of its own with the given replicas, async with
// message IDs as the platform does, and returns messages per second until
// the last ack.
func rawPublishRate(b *testing.B, ctx context.Context, js jetstream.JetStream, n, replicas int) float64 {
	b.Helper()
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: "BENCH_RAW", Subjects: []string{"bench.raw.>"},
		Storage: jetstream.FileStorage, Replicas: replicas}); err != nil {
		b.Fatal(err)
	}
	body := make([]byte, 160)
	start := time.Now()
	futures := make([]jetstream.PubAckFuture, n)
	for i := range futures {
		var err error
		if futures[i], err = js.PublishAsync("bench.raw.x", body, jetstream.WithMsgID(fmt.Sprintf("raw-%d-%d", start.UnixNano(), i))); err != nil {
			b.Fatal(err)
		}
	}
	for _, f := range futures {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			b.Fatal(err)
		}
	}
	return float64(n) / time.Since(start).Seconds()
}

// waitReady submits one job and waits for it to be scheduled: every
// service and every node is up and caught up.
func waitReady(b *testing.B, ctx context.Context, s *stack, id string) {
	b.Helper()
	body, _ := json.Marshal(contracts.JobRequest{ID: id, Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}}, Run: contracts.RunSpec{Duration: contracts.Duration(time.Second)}})
	sub, err := s.nc.SubscribeSync(contracts.SubjectJobEvents("warmup", id))
	if err != nil {
		b.Fatal(err)
	}
	defer sub.Unsubscribe()
	if _, err := s.submitBus(ctx, "warmup", contracts.SubmitMsgID("warmup", id), body); err != nil {
		b.Fatal(err)
	}
	for {
		m, err := sub.NextMsgWithContext(ctx)
		if err != nil {
			b.Fatalf("warm-up job never scheduled: %v", err)
		}
		if m.Header.Get(contracts.HeaderCEType) == "io.gpuplane.job.scheduled.v1" {
			return
		}
	}
}

// waitNodes waits until the resource manager registered n nodes.
func waitNodes(b testing.TB, ctx context.Context, s *stack, n int) {
	b.Helper()
	stream, err := s.js.Stream(ctx, contracts.StreamNodes)
	if err != nil {
		b.Fatal(err)
	}
	for {
		info, err := stream.Info(ctx, jetstream.WithSubjectFilter(contracts.SubjectNodeLifecycleAll))
		if err == nil && len(info.State.Subjects) >= n {
			return
		}
		select {
		case <-ctx.Done():
			b.Fatalf("nodes not registered: %v", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// clusterStack runs the platform on a fresh 3-member cluster
// (natstest.StartCluster) with R3 streams and buckets, as production
// runs it; syncAlways makes every member fsync each write
// (sync_interval: always, as deploy/ sets).
func clusterStack(b testing.TB, fl *fleet.Fleet, syncAlways bool, tune ...func(*gpuplane.Config)) *stack {
	b.Helper()
	c := natstest.StartClusterWith(b, 3, natsserver.Options{SyncAlways: syncAlways})
	return startStack(b, fl, append([]func(*gpuplane.Config){func(cfg *gpuplane.Config) {
		cfg.NATS = &gpuplane.ExternalNATS{URL: c.URLs(), Trust: c.Trust, Replicas: 3}
	}}, tune...)...)
}

// coldFleet is the fault test's fleet of issue 13: 40 eight-GPU machines.
const coldFleet = `
machineTypes:
  hgx-h100-8: {gpuModel: H100-80GB, gpuCount: 8, nvlink: true}
pools:
  - {name: cold, machineType: hgx-h100-8, count: 40, zone: zone-a, priceClass: on-demand}
`

// BenchmarkColdStart (issue 13, finding 6) starts the platform on a
// fresh 3-member R3 cluster and, as soon as the gateway answers and the
// nodes are registered, submits one-GPU jobs at a steady 5.6 jobs/s (the
// fault test's rate) for 20 s. It reports submit→scheduled p50, p99 and
// max, and how long the first plan waited for the resource manager's
// first ledger entry. Nothing is asserted: the figures are the point.
//
//	go test -run '^$' -bench ColdStart -benchtime 1x ./e2e/
func BenchmarkColdStart(b *testing.B) {
	const rate, jobs = 5.6, 112
	fl, err := fleet.Parse([]byte(coldFleet))
	if err != nil {
		b.Fatal(err)
	}
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		s := clusterStack(b, &fl, os.Getenv("GPUPLANE_BENCH_SYNC") != "")
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		waitNodes(b, ctx, s, len(fl.Machines()))
		var mu sync.Mutex
		var firstPlan, firstCommit time.Time
		for subject, at := range map[string]*time.Time{contracts.SubjectPlansAll: &firstPlan, contracts.SubjectLedgerAll: &firstCommit} {
			sub, err := s.nc.Subscribe(subject, func(*nats.Msg) {
				mu.Lock()
				if at.IsZero() {
					*at = time.Now()
				}
				mu.Unlock()
			})
			if err != nil {
				b.Fatal(err)
			}
			defer sub.Unsubscribe()
		}
		b.StartTimer()
		r := steady(b, ctx, s, fmt.Sprintf("c%d", i), jobs, rate)
		b.StopTimer()
		cancel()
		mu.Lock()
		settle := firstCommit.Sub(firstPlan)
		mu.Unlock()
		b.ReportMetric(r.p50.Seconds()*1000, "p50-ms")
		b.ReportMetric(r.p99.Seconds()*1000, "p99-ms")
		b.ReportMetric(r.max.Seconds()*1000, "max-ms")
		b.ReportMetric(settle.Seconds()*1000, "first-plan-settled-ms")
		b.Logf("cold start on 3 nodes, R3: %d jobs at %.1f/s submit→scheduled p50 %s, p99 %s, max %s; first plan settled after %s",
			jobs, rate, r.p50.Round(time.Millisecond), r.p99.Round(time.Millisecond), r.max.Round(time.Millisecond),
			settle.Round(time.Millisecond))
	}
}

// steady submits n one-GPU jobs at rate per second, each a synchronous
// JetStream publish as the gateway makes, and returns the submit→scheduled
// latencies once all are scheduled.
func steady(b *testing.B, ctx context.Context, s *stack, prefix string, n int, rate float64) burstResult {
	b.Helper()
	var mu sync.Mutex
	scheduledAt := make(map[string]time.Time, n)
	done := make(chan struct{})
	sub, err := s.nc.Subscribe(contracts.SubjectTenantJobEvents("bench"), func(m *nats.Msg) {
		if m.Header.Get(contracts.HeaderCEType) != "io.gpuplane.job.scheduled.v1" {
			return
		}
		now := time.Now()
		id := m.Subject[len("gp.jobs.events.bench."):]
		mu.Lock()
		defer mu.Unlock()
		if _, seen := scheduledAt[id]; !seen {
			scheduledAt[id] = now
			if len(scheduledAt) == n {
				close(done)
			}
		}
	})
	if err != nil {
		b.Fatal(err)
	}
	defer sub.Unsubscribe()
	submittedAt := make(map[string]time.Time, n)
	tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer tick.Stop()
	start := time.Now()
	for i := range n {
		id := fmt.Sprintf("%s-%04d", prefix, i)
		body, _ := json.Marshal(contracts.JobRequest{ID: id,
			Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB"}},
			Run:       contracts.RunSpec{Duration: contracts.Duration(10 * time.Minute)}})
		mu.Lock()
		submittedAt[id] = time.Now()
		mu.Unlock()
		if _, err := s.submitBus(ctx, "bench", contracts.SubmitMsgID("bench", id), body); err != nil {
			b.Fatal(err)
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			b.Fatal(ctx.Err())
		}
	}
	select {
	case <-done:
	case <-ctx.Done():
		mu.Lock()
		b.Fatalf("only %d of %d jobs scheduled: %v", len(scheduledAt), n, ctx.Err())
	}
	mu.Lock()
	defer mu.Unlock()
	lat := make([]time.Duration, 0, n)
	var last time.Time
	for id, t := range scheduledAt {
		lat = append(lat, t.Sub(submittedAt[id]))
		if t.After(last) {
			last = t
		}
	}
	slices.Sort(lat)
	return burstResult{total: last.Sub(start), jobsPerSec: float64(n) / last.Sub(start).Seconds(),
		p50: lat[len(lat)/2], p99: lat[len(lat)*99/100], max: lat[len(lat)-1]}
}

// startCPUProfile writes a CPU profile of what follows to path and returns
// what stops it (idempotent: the burst stops it once the jobs are
// scheduled; Cleanup calls it again).
// startTrace starts an execution trace (go tool trace) into path.
func startTrace(b *testing.B, path string) (stop func()) {
	b.Helper()
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	if err := trace.Start(f); err != nil {
		f.Close()
		b.Fatal(err)
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			trace.Stop()
			_ = f.Close()
		})
	}
}

func startCPUProfile(b *testing.B, path string) (stop func()) {
	b.Helper()
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		b.Fatal(err)
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			pprof.StopCPUProfile()
			_ = f.Close()
		})
	}
}
