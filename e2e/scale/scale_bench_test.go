package scale

import (
	"context"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
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
	"github.com/gpuplane/gpuplane/libs/natsauth"
)

// BenchmarkScale runs the whole platform as processes on this machine: a
// NATS JetStream server (this test binary in server mode), the scheduler,
// resource manager, monitor, gateway, billing (usage in memory) and
// autoscaler, and M simulated 8×H100 machines in one or more fleet-sim
// processes. It submits J jobs at a steady rate (asynchronous JetStream
// publishes, as BenchmarkBurst does) whose GPU counts and durations are
// drawn from the Alibaba GPU trace (openb_pod_list_default: whole GPUs,
// a fraction counted as one GPU, CPU-only tasks as one GPU), their
// durations compressed so that the offered GPU load is LOAD times the
// fleet's capacity: jobs finish all the time and the queue keeps growing
// (by about (1-1/LOAD) of the submissions), which is the point: the
// scheduling cycle is measured with a large queue and a busy fleet.
//
// It reports the scheduler's cycle time (its debug "cycle" lines: the
// cycle and the publishing of its plans) p50/p99/max overall and at the
// largest queue, submit→scheduled p50/p99/max, jobs completed per second,
// and, at the start, at every tenth of the submissions (or every 100,000
// jobs, whichever is more often) and at the end, each process's resident
// memory and live heap (gctrace) and the NATS server's memory and store:
// growth with history shows as a column that climbs with jobs.
//
// Sizes (defaults small enough for `make bench` on 2 cores):
//
//	GPUPLANE_SCALE_MACHINES        machines of 8 GPUs (1000)
//	GPUPLANE_SCALE_JOBS            jobs submitted (20000)
//	GPUPLANE_SCALE_RATE            jobs submitted per second (250)
//	GPUPLANE_SCALE_LOAD            offered GPU load / capacity (1.5)
//	GPUPLANE_SCALE_FLEET_PROCS     fleet-sim processes (one per 2,500 machines)
//	GPUPLANE_SCALE_TELEMETRY       each machine's telemetry interval (agent default, 1s)
//	GPUPLANE_SCALE_HEARTBEAT       each machine's heartbeat interval (agent default, 2s; the
//	                               resource manager declares a machine lost after 3 intervals of silence)
//	GPUPLANE_SCALE_TRACE           pod list CSV (the shared trace; a Pareto law when absent)
//	GPUPLANE_SCALE_DRAIN           time after the last submit before the end figures (15s)
//	GPUPLANE_SCALE_KEEP=1          keep the processes' logs and the store
//	GPUPLANE_SCALE_PPROF=1         a 30 s CPU profile of the scheduler near the last submit (largest queue), saved as scheduler-cpu.pprof in the kept directory
//	GPUPLANE_SCALE_BIN=DIR         the service binaries, built already (go build -o DIR/ ./services/...)
//
// The full size: GPUPLANE_SCALE_MACHINES=10000 GPUPLANE_SCALE_JOBS=1000000.
//
//	go test -run '^$' -bench Scale -benchtime 1x -timeout 60m ./e2e/scale/
func BenchmarkScale(b *testing.B) {
	if runtime.GOOS != "linux" {
		b.Skip("reads process memory from /proc: Linux only")
	}
	cfg := scaleConfig{
		machines:  envInt(b, "GPUPLANE_SCALE_MACHINES", 1000),
		jobs:      envInt(b, "GPUPLANE_SCALE_JOBS", 20000),
		rate:      envFloat(b, "GPUPLANE_SCALE_RATE", 250),
		load:      envFloat(b, "GPUPLANE_SCALE_LOAD", 1.5),
		drain:     envDuration(b, "GPUPLANE_SCALE_DRAIN", 15*time.Second),
		telemetry: os.Getenv("GPUPLANE_SCALE_TELEMETRY"),
		heartbeat: os.Getenv("GPUPLANE_SCALE_HEARTBEAT"),
	}
	cfg.fleetProcs = envInt(b, "GPUPLANE_SCALE_FLEET_PROCS", (cfg.machines+2499)/2500)
	for range b.N {
		runScale(b, cfg)
	}
}

type scaleConfig struct {
	machines, jobs, fleetProcs int
	rate, load                 float64
	drain                      time.Duration
	telemetry, heartbeat       string
}

// tenant submits every job of the benchmark.
const tenant = "scale"

func runScale(b *testing.B, cfg scaleConfig) {
	dir, err := os.MkdirTemp("", "gpuplane-scale-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if b.Failed() || os.Getenv("GPUPLANE_SCALE_KEEP") == "1" {
			b.Logf("logs and store kept in %s", dir)
			return
		}
		_ = os.RemoveAll(dir)
	})
	// GPUPLANE_SCALE_BIN names binaries built already (another
	// checkout's, to compare two trees with the same benchmark).
	bin := os.Getenv("GPUPLANE_SCALE_BIN")
	if bin == "" {
		bin = filepath.Join(dir, "bin")
		buildServices(b, bin)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	srv := startNATS(b, dir)
	procs := []*proc{srv.proc}
	creds := func(name string, role contracts.BusRole) string {
		p, err := srv.trust.WriteCreds(srv.credsDir, contracts.Identity{Name: name, Role: role})
		if err != nil {
			b.Fatal(err)
		}
		return p
	}
	env := func(name string, role contracts.BusRole, level string) []string {
		return []string{"GPUPLANE_NATS_URL=" + srv.url, "GPUPLANE_NATS_CREDS=" + creds(name, role),
			"GPUPLANE_LOG_LEVEL=" + level, "GPUPLANE_OTLP_ENDPOINT=", "GPUPLANE_STREAM_REPLICAS=1"}
	}
	prof := newSchedProfile(b, dir)
	start := func(name string, role contracts.BusRole, level string, args ...string) *proc {
		e := env(name, role, level)
		if name == "scheduler" {
			e = append(e, prof.env()...)
		}
		p := startProc(b, dir, name, filepath.Join(bin, name), args, e)
		procs = append(procs, p)
		return p
	}
	// The scheduler logs each cycle at debug level: its duration is read
	// from there.
	cycles := &cycleLog{}
	sched := start("scheduler", contracts.BusScheduler, "debug", "-allow-host-commands")
	sched.onLine = cycles.line
	// The manager declares a machine lost after three of its intervals
	// without a heartbeat (6 s for the agents' 2 s): a longer interval
	// with the default 6 s would lose machines whose heartbeat is a
	// little late.
	var rmArgs []string
	if cfg.heartbeat != "" {
		every, err := time.ParseDuration(cfg.heartbeat)
		if err != nil {
			b.Fatalf("GPUPLANE_SCALE_HEARTBEAT=%q: %v", cfg.heartbeat, err)
		}
		rmArgs = append(rmArgs, "-heartbeat-timeout", (3 * every).String())
	}
	start("resource-manager", contracts.BusResourceManager, "warn", rmArgs...)
	start("monitor", contracts.BusMonitor, "warn", "-addr", freeAddr(b))
	start("billing", contracts.BusBilling, "warn")
	start("autoscaler", contracts.BusAutoscaler, "warn")
	gwAddr := freeAddr(b)
	start("gateway", contracts.BusGateway, "warn", "-addr", gwAddr, "-admin-token-file", filepath.Join(dir, "admin.token"))
	for k, n := range splitFleet(cfg.machines, cfg.fleetProcs) {
		name := fmt.Sprintf("fleet-sim-%d", k)
		path := filepath.Join(dir, name+".yaml")
		yaml := fmt.Sprintf("machineTypes:\n  hgx-h100-8: {gpuModel: H100-80GB, gpuCount: 8, nvlink: true}\n"+
			"pools:\n  - {name: scale%d, machineType: hgx-h100-8, count: %d, zone: zone-%c, priceClass: on-demand}\n", k, n, 'a'+k%3)
		if err := os.WriteFile(path, []byte(yaml), 0o644); err != nil {
			b.Fatal(err)
		}
		args := []string{"-fleet", path, "-log-dir", filepath.Join(dir, "runs-"+name)}
		if cfg.telemetry != "" {
			args = append(args, "-telemetry-interval", cfg.telemetry)
		}
		if cfg.heartbeat != "" {
			args = append(args, "-heartbeat-interval", cfg.heartbeat)
		}
		p := startProc(b, dir, name, filepath.Join(bin, "fleet-sim"), args, env(name, contracts.BusFleet, "warn"))
		procs = append(procs, p)
	}

	nc, js := connect(b, srv)
	startUp := time.Now()
	waitNodes(b, ctx, js, procs, cfg.machines)
	registered := time.Since(startUp)
	b.Logf("%d machines registered after %s", cfg.machines, registered.Round(time.Millisecond))
	for deadline := time.Now().Add(time.Minute); !healthz("http://" + gwAddr + "/healthz"); time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) {
			b.Fatalf("the gateway is not healthy after a minute:\n%s", procs[6].tail(20))
		}
	}

	w := newWorkload(b, cfg)
	tr := newTracker(cfg.jobs)
	sub, err := nc.Subscribe(contracts.SubjectTenantJobEvents(tenant), tr.event)
	if err != nil {
		b.Fatal(err)
	}
	// Every event matters for the figures: no slow-consumer drops.
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		b.Fatal(err)
	}
	defer sub.Unsubscribe()
	warmUp(b, ctx, js, tr, procs)

	mem := &memTable{}
	sample := func(label string) {
		for _, p := range procs {
			p.scan()
		}
		j, _ := srv.jsz()
		srv.heapProfile()
		mem.add(label, tr, procs, j)
		// As it goes too: a long run's growth shows before its end.
		if len(mem.rows) == 1 {
			fmt.Println("scale: " + mem.header())
		}
		fmt.Println("scale: " + mem.row(mem.rows[len(mem.rows)-1]))
	}
	sample("start")
	every := min(100000, max(1, cfg.jobs/10))
	stopSampler := make(chan struct{})
	samplerDone := make(chan struct{})
	// Logs are read as they grow (the scheduler's debug log would
	// otherwise pile up to be parsed at the end).
	go func() {
		defer close(samplerDone)
		t := time.NewTicker(2 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-stopSampler:
				return
			case <-t.C:
				for _, p := range procs {
					p.scan()
				}
			}
		}
	}()

	b.ResetTimer()
	began := time.Now()
	submit(b, ctx, js, w, tr, cfg.rate, every, func(n int) {
		sample(fmt.Sprintf("%d jobs", n))
		// The queue grows to the end of the submits: the profile's 30 s
		// end near the last one (earlier in a run shorter than that).
		if float64(cfg.jobs-n)/cfg.rate <= 40 {
			prof.start(b, 30)
		}
		for _, p := range procs {
			if p.exited() {
				b.Fatalf("%s exited during the run:\n%s", p.name, p.tail(30))
			}
		}
	})
	submitted := time.Since(began)
	time.Sleep(cfg.drain)
	prof.wait()
	elapsed := time.Since(began)
	b.StopTimer()
	close(stopSampler)
	<-samplerDone
	sample("end")

	// The figures.
	s := tr.summary()
	cyc := cycles.summary()
	b.Logf("%d machines × 8 GPUs (%d fleet-sim processes), %d jobs at %.0f/s (offered load %.2f× capacity, durations ×%.4g of the trace's, p50 %s, p99 %s), submitted in %s; load average %s",
		cfg.machines, cfg.fleetProcs, cfg.jobs, cfg.rate, w.load, w.compress, w.p50.Round(time.Millisecond), w.p99.Round(time.Millisecond),
		submitted.Round(time.Millisecond), loadAvg())
	b.Logf("submit→scheduled: %d scheduled, p50 %s, p99 %s, max %s; %d succeeded (%.1f jobs/s completed over %s), %d failed, %d rejected; at the end %d queued in the scheduler (at most %d during the run), %d not yet read by it",
		s.scheduled, s.p50, s.p99, s.max, s.succeeded, float64(s.succeeded)/elapsed.Seconds(), elapsed.Round(time.Second), s.failed, s.rejected,
		s.queued-s.scheduled, s.maxQueue, cfg.jobs-s.queued-s.rejected)
	b.Logf("scheduling cycle (%d cycles): p50 %s, p99 %s, max %s; most jobs one cycle left waiting %d, cycles that left ≥ 90%% of that: p50 %s, p99 %s, max %s (%d)",
		cyc.n, cyc.p50, cyc.p99, cyc.max, cyc.maxWaiting, cyc.bigP50, cyc.bigP99, cyc.bigMax, cyc.bigN)
	cycles.mu.Lock()
	if len(cycles.refused) > 0 {
		b.Logf("plan items the resource manager refused, by reason: %v", cycles.refused)
	}
	cycles.mu.Unlock()
	for _, p := range procs {
		if w := p.warningSummary(); w != "" {
			b.Logf("%s warnings and errors %s", p.name, w)
		}
	}
	b.Logf("memory over time (RSS MB / live heap MB after the last GC):\n%s", mem.String())
	if ss, err := srv.streams(); err == nil {
		b.Logf("streams at the end (the NATS server's heap profile at each memory row: nats-heap-<row>.pprof in the kept directory):\n%s", streamTable(ss))
	}
	b.ReportMetric(float64(cfg.machines), "machines")
	b.ReportMetric(registered.Seconds(), "registered-s")
	b.ReportMetric(float64(s.scheduled), "scheduled")
	b.ReportMetric(ms(s.p50), "sched-p50-ms")
	b.ReportMetric(ms(s.p99), "sched-p99-ms")
	b.ReportMetric(float64(s.succeeded)/elapsed.Seconds(), "completed/s")
	b.ReportMetric(ms(cyc.p50), "cycle-p50-ms")
	b.ReportMetric(ms(cyc.p99), "cycle-p99-ms")
	b.ReportMetric(ms(cyc.max), "cycle-max-ms")
	b.ReportMetric(float64(s.maxQueue), "max-queued")
	last := mem.rows[len(mem.rows)-1]
	b.ReportMetric(last.storeMB, "store-MB")
	for i, p := range procs {
		b.ReportMetric(last.rss[i], p.name+"-rss-MB")
	}
	for _, p := range procs {
		if p.exited() {
			b.Errorf("%s exited during the run:\n%s", p.name, p.tail(30))
		}
	}
	if s.scheduled == 0 {
		b.Fatal("no job was scheduled")
	}
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// splitFleet shares n machines among k processes.
func splitFleet(n, k int) []int {
	k = max(1, min(k, n))
	out := make([]int, k)
	for i := range out {
		out[i] = n / k
		if i < n%k {
			out[i]++
		}
	}
	return out
}

func connect(b *testing.B, srv *natsProc) (*nats.Conn, jetstream.JetStream) {
	b.Helper()
	path, err := srv.trust.WriteCreds(srv.credsDir, contracts.Identity{Name: "scale-bench", Role: contracts.BusOperator})
	if err != nil {
		b.Fatal(err)
	}
	opts, err := natsauth.ClientOptions(path)
	if err != nil {
		b.Fatal(err)
	}
	nc, err := nats.Connect(srv.url, append(opts, nats.Name("scale-bench"), nats.MaxReconnects(-1))...)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(nc.Close)
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(4096))
	if err != nil {
		b.Fatal(err)
	}
	return nc, js
}

// waitNodes waits until the resource manager has registered n machines.
func waitNodes(b *testing.B, ctx context.Context, js jetstream.JetStream, procs []*proc, n int) {
	b.Helper()
	deadline := time.Now().Add(10 * time.Minute)
	have := 0
	for time.Now().Before(deadline) {
		for _, p := range procs {
			if p.exited() {
				b.Fatalf("%s exited while starting:\n%s", p.name, p.tail(30))
			}
		}
		if s, err := js.Stream(ctx, contracts.StreamNodes); err == nil {
			if info, err := s.Info(ctx, jetstream.WithSubjectFilter(contracts.SubjectNodeLifecycleAll)); err == nil {
				if have = len(info.State.Subjects); have >= n {
					return
				}
			}
		}
		time.Sleep(500 * time.Millisecond)
	}
	b.Fatalf("%d of %d machines registered after 10 minutes", have, n)
}

// warmUp submits one job and waits for it to be scheduled: every service
// is up and caught up.
func warmUp(b *testing.B, ctx context.Context, js jetstream.JetStream, tr *tracker, procs []*proc) {
	b.Helper()
	body, _ := json.Marshal(contracts.JobRequest{ID: "warmup", Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}},
		Run: contracts.RunSpec{Duration: contracts.Duration(time.Second)}})
	msg := nats.NewMsg(contracts.SubjectSubmit(tenant))
	msg.Data = body
	msg.Header.Set(contracts.HeaderMsgID, contracts.SubmitMsgID(tenant, "warmup"))
	if _, err := js.PublishMsg(ctx, msg); err != nil {
		b.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Minute)
	for !tr.warm() {
		if time.Now().After(deadline) {
			b.Fatalf("the warm-up job was not scheduled in 3 minutes; scheduler:\n%s", procs[1].tail(20))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// workload is the jobs to submit: GPUs and a duration each.
type workload struct {
	gpus     []int
	dur      []time.Duration
	compress float64
	// load is the GPUs busy at the end of the submissions over the
	// fleet's, as the workload was made (cfg.load unless the trace's
	// durations cannot fill the fleet in the run).
	load     float64
	p50, p99 time.Duration
}

// newWorkload draws cfg.jobs tasks from the trace's pod list (or a Pareto
// law when the trace is not here) and compresses their durations so that
// their GPU-seconds arrive at cfg.load times the fleet's capacity.
func newWorkload(b *testing.B, cfg scaleConfig) *workload {
	b.Helper()
	type task struct {
		gpus int
		secs float64
	}
	var tasks []task
	path := cmpOr(os.Getenv("GPUPLANE_SCALE_TRACE"), "../../../shared/traces/alibaba-gpu-v2023/openb_pod_list_default.csv")
	if f, err := os.Open(path); err == nil {
		r := csv.NewReader(f)
		header, err := r.Read()
		if err != nil {
			b.Fatalf("%s: %v", path, err)
		}
		col := map[string]int{}
		for i, h := range header {
			col[h] = i
		}
		for {
			rec, err := r.Read()
			if err == io.EOF {
				break
			}
			if err != nil {
				b.Fatalf("%s: %v", path, err)
			}
			g, _ := strconv.Atoi(rec[col["num_gpu"]])
			del, err1 := strconv.ParseFloat(rec[col["deletion_time"]], 64)
			sch, err2 := strconv.ParseFloat(rec[col["scheduled_time"]], 64)
			if err1 != nil || err2 != nil || del <= sch {
				continue
			}
			tasks = append(tasks, task{max(1, g), del - sch})
		}
		_ = f.Close()
		b.Logf("durations and GPU counts from %s (%d tasks)", path, len(tasks))
	} else {
		// Pareto, alpha 1.1, from 60 s: heavy-tailed as the trace is.
		rng := rand.New(rand.NewPCG(17, 17))
		for range 10000 {
			g := 1
			if rng.IntN(50) == 0 {
				g = []int{2, 4, 8}[rng.IntN(3)]
			}
			tasks = append(tasks, task{g, 60 / math.Pow(1-rng.Float64(), 1/1.1)})
		}
		b.Logf("no trace at %s (%v): durations from a Pareto law", path, err)
	}
	// The trace's tail is very long (its longest task ran 145 days):
	// durations are capped at its 99th percentile, so that one draw of a
	// months-long task does not decide the offered load of a short run.
	secs := make([]float64, len(tasks))
	for i, t := range tasks {
		secs[i] = t.secs
	}
	slices.Sort(secs)
	limit := secs[len(secs)*99/100]
	rng := rand.New(rand.NewPCG(1, 7))
	w := &workload{gpus: make([]int, cfg.jobs), dur: make([]time.Duration, cfg.jobs)}
	drawn := make([]float64, cfg.jobs)
	for i := range cfg.jobs {
		t := tasks[rng.IntN(len(tasks))]
		w.gpus[i], drawn[i] = t.gpus, min(t.secs, limit)
	}
	w.compress, w.load = compression(cfg, w.gpus, drawn)
	for i := range cfg.jobs {
		// At least a second: a job shorter than its own scheduling
		// measures nothing.
		w.dur[i] = max(time.Second, time.Duration(drawn[i]*w.compress*float64(time.Second)).Round(time.Second))
	}
	sorted := slices.Sorted(slices.Values(w.dur))
	w.p50, w.p99 = sorted[len(sorted)/2], sorted[len(sorted)*99/100]
	return w
}

// compression is the factor c on the trace's durations that makes the
// GPUs busy at the end of the submissions cfg.load times the fleet's:
// rate × mean(gpus × min(c × duration, T)) = load × GPUs, T the time the
// submissions take. The mean over the whole trace would not do: with its
// tail, most of a long job's GPU-seconds fall after a short run ends, and
// the queue never grows. Found by bisection (the left side grows with c);
// never more than 1 (the trace's own durations), so a fleet too large to
// fill in the run gets the trace's durations and a lower load (which
// compression's second result says).
func compression(cfg scaleConfig, gpus []int, secs []float64) (c, load float64) {
	window := float64(cfg.jobs) / cfg.rate
	busy := func(c float64) float64 {
		var sum float64
		for i, g := range gpus {
			sum += float64(g) * min(max(1, c*secs[i]), window)
		}
		return cfg.rate * sum / float64(len(gpus))
	}
	target := cfg.load * float64(8*cfg.machines)
	lo, hi := 1e-9, 1.0
	if busy(hi) < target {
		return hi, busy(hi) / float64(8*cfg.machines)
	}
	for range 100 {
		mid := math.Sqrt(lo * hi)
		if busy(mid) < target {
			lo = mid
		} else {
			hi = mid
		}
	}
	return hi, busy(hi) / float64(8*cfg.machines)
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// submit publishes the jobs at rate per second in batches every 10 ms,
// calling mark after every `every` jobs.
func submit(b *testing.B, ctx context.Context, js jetstream.JetStream, w *workload, tr *tracker, rate float64, every int, mark func(n int)) {
	b.Helper()
	start := time.Now()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	var futures []jetstream.PubAckFuture
	settle := func() {
		for _, f := range futures {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				b.Fatalf("submit: %v", err)
			case <-ctx.Done():
				b.Fatal(ctx.Err())
			}
		}
		futures = futures[:0]
	}
	for i := 0; i < len(w.gpus); {
		<-tick.C
		due := min(len(w.gpus), int(time.Since(start).Seconds()*rate)+1)
		for ; i < due; i++ {
			id := jobID(i)
			body, _ := json.Marshal(contracts.JobRequest{ID: id,
				Resources: contracts.Resources{GPU: contracts.GPURequest{Count: w.gpus[i], Model: "H100-80GB"}},
				Run:       contracts.RunSpec{Duration: contracts.Duration(w.dur[i])}})
			msg := nats.NewMsg(contracts.SubjectSubmit(tenant))
			msg.Data = body
			msg.Header.Set(contracts.HeaderMsgID, contracts.SubmitMsgID(tenant, id))
			tr.submitted(i)
			f, err := js.PublishMsgAsync(msg)
			if err != nil {
				b.Fatalf("submit %s: %v", id, err)
			}
			futures = append(futures, f)
			if (i+1)%every == 0 {
				settle()
				mark(i + 1)
			}
		}
		if len(futures) > 2048 {
			settle()
		}
	}
	settle()
}

func jobID(i int) string { return fmt.Sprintf("s-%07d", i) }

// tracker records each job's submit and first scheduled time and counts
// the ends, from a core subscription to the tenant's events (it sees each
// as JetStream stores it).
type tracker struct {
	mu                                     sync.Mutex
	submittedAt, scheduledAt               []int64 // unix nanos, 0: not yet
	scheduled, succeeded, failed, rejected int
	warmedUp                               bool
	// queued counts the jobs the scheduler accepted (queued events) and
	// nsubmitted the jobs published: queued-scheduled is the scheduler's
	// queue, nsubmitted-queued-rejected what it has not read yet.
	queued, nsubmitted, maxQueue int
}

func newTracker(n int) *tracker {
	return &tracker{submittedAt: make([]int64, n), scheduledAt: make([]int64, n)}
}

func (t *tracker) submitted(i int) {
	now := time.Now().UnixNano()
	t.mu.Lock()
	t.submittedAt[i] = now
	t.nsubmitted++
	t.mu.Unlock()
}

func (t *tracker) warm() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.warmedUp
}

func (t *tracker) event(m *nats.Msg) {
	now := time.Now().UnixNano()
	ce := m.Header.Get(contracts.HeaderCEType)
	id := m.Subject[strings.LastIndexByte(m.Subject, '.')+1:]
	t.mu.Lock()
	defer t.mu.Unlock()
	if id == "warmup" {
		t.warmedUp = t.warmedUp || ce == "io.gpuplane.job.scheduled.v1"
		return
	}
	n, err := strconv.Atoi(strings.TrimPrefix(id, "s-"))
	if err != nil || n < 0 || n >= len(t.scheduledAt) {
		return
	}
	switch ce {
	case "io.gpuplane.job.queued.v1":
		t.queued++
		t.maxQueue = max(t.maxQueue, t.queued-t.scheduled)
	case "io.gpuplane.job.scheduled.v1":
		if t.scheduledAt[n] == 0 {
			t.scheduledAt[n] = now
			t.scheduled++
		}
	case "io.gpuplane.job.succeeded.v1":
		t.succeeded++
	case "io.gpuplane.job.failed.v1":
		t.failed++
	case "io.gpuplane.job.rejected.v1":
		t.rejected++
	}
}

type trackerSummary struct {
	scheduled, succeeded, failed, rejected int
	queued, maxQueue                       int
	p50, p99, max                          time.Duration
}

func (t *tracker) summary() trackerSummary {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := trackerSummary{scheduled: t.scheduled, succeeded: t.succeeded, failed: t.failed, rejected: t.rejected,
		queued: t.queued, maxQueue: t.maxQueue}
	lat := make([]time.Duration, 0, t.scheduled)
	for i, at := range t.scheduledAt {
		if at != 0 && t.submittedAt[i] != 0 {
			lat = append(lat, time.Duration(at-t.submittedAt[i]))
		}
	}
	if len(lat) > 0 {
		slices.Sort(lat)
		s.p50, s.p99, s.max = lat[len(lat)/2].Round(time.Millisecond), lat[len(lat)*99/100].Round(time.Millisecond), lat[len(lat)-1].Round(time.Millisecond)
	}
	return s
}

// counts is what the memory table prints beside each row: jobs
// scheduled, succeeded, in the scheduler's queue, and submitted but not
// read by the scheduler yet.
func (t *tracker) counts() (scheduled, succeeded, queue, unread int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.scheduled, t.succeeded, t.queued - t.scheduled, t.nsubmitted - t.queued - t.rejected
}

// cycleLog collects the scheduler's "cycle" debug lines:
// msg=cycle ... placed=N waiting=N took=12.3ms.
type cycleLog struct {
	mu      sync.Mutex
	took    []time.Duration
	waiting []int
	// refused counts the plan items the resource manager refused, by
	// reason (the scheduler logs each).
	refused map[string]int
}

func (c *cycleLog) line(line string) {
	if strings.Contains(line, `msg="plan item refused"`) {
		_, reason, _ := strings.Cut(line, " reason=")
		reason, _, _ = strings.Cut(reason, " ")
		c.mu.Lock()
		if c.refused == nil {
			c.refused = map[string]int{}
		}
		c.refused[strings.TrimSpace(reason)]++
		c.mu.Unlock()
		return
	}
	if !strings.Contains(line, "msg=cycle ") {
		return
	}
	var took time.Duration
	waiting := -1
	for f := range strings.FieldsSeq(line) {
		if v, ok := strings.CutPrefix(f, "took="); ok {
			took, _ = time.ParseDuration(v)
		} else if v, ok := strings.CutPrefix(f, "waiting="); ok {
			waiting, _ = strconv.Atoi(v)
		}
	}
	if took <= 0 {
		return
	}
	c.mu.Lock()
	c.took = append(c.took, took)
	c.waiting = append(c.waiting, waiting)
	c.mu.Unlock()
}

type cycleSummary struct {
	n, bigN, maxWaiting    int
	p50, p99, max          time.Duration
	bigP50, bigP99, bigMax time.Duration
}

func (c *cycleLog) summary() cycleSummary {
	c.mu.Lock()
	defer c.mu.Unlock()
	var s cycleSummary
	s.n = len(c.took)
	s.p50, s.p99, s.max = pct(c.took)
	for _, w := range c.waiting {
		s.maxWaiting = max(s.maxWaiting, w)
	}
	var big []time.Duration
	for i, w := range c.waiting {
		if w*10 >= s.maxWaiting*9 {
			big = append(big, c.took[i])
		}
	}
	s.bigN = len(big)
	s.bigP50, s.bigP99, s.bigMax = pct(big)
	return s
}

func pct(ds []time.Duration) (p50, p99, mx time.Duration) {
	if len(ds) == 0 {
		return 0, 0, 0
	}
	s := slices.Sorted(slices.Values(ds))
	r := func(d time.Duration) time.Duration { return d.Round(10 * time.Microsecond) }
	return r(s[len(s)/2]), r(s[len(s)*99/100]), r(s[len(s)-1])
}

// memTable is each process's memory at the marks of the run.
type memTable struct {
	names []string
	rows  []memRow
}

type memRow struct {
	label                               string
	at                                  time.Time
	scheduled, succeeded, queue, unread int
	rss, heap, cpu                      []float64
	storeMB, natsMemMB                  float64
	messages                            uint64
}

func (m *memTable) add(label string, tr *tracker, procs []*proc, j jsz) {
	if m.names == nil {
		for _, p := range procs {
			m.names = append(m.names, p.name)
		}
	}
	r := memRow{label: label, at: time.Now(), storeMB: float64(j.Storage) / (1 << 20), natsMemMB: float64(j.Memory) / (1 << 20), messages: j.Messages}
	r.scheduled, r.succeeded, r.queue, r.unread = tr.counts()
	for _, p := range procs {
		p.mu.Lock()
		r.heap = append(r.heap, p.heapMB)
		p.mu.Unlock()
		r.rss = append(r.rss, rssMB(p.cmd.Process.Pid))
		r.cpu = append(r.cpu, cpuSeconds(p.cmd.Process.Pid))
	}
	m.rows = append(m.rows, r)
}

func (m *memTable) header() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "%-12s %6s %9s %9s %8s %8s", "at", "t-s", "scheduled", "succeeded", "queued", "unread")
	for _, n := range m.names {
		fmt.Fprintf(&sb, " %18s", n)
	}
	fmt.Fprintf(&sb, " %10s %10s", "store-MB", "stored-msg")
	return sb.String()
}

func (m *memTable) row(r memRow) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "%-12s %6.0f %9d %9d %8d %8d", r.label, r.at.Sub(m.rows[0].at).Seconds(), r.scheduled, r.succeeded, max(0, r.queue), max(0, r.unread))
	for i := range m.names {
		fmt.Fprintf(&sb, " %18s", fmt.Sprintf("%.0f/%.0f", r.rss[i], r.heap[i]))
	}
	fmt.Fprintf(&sb, " %10.0f %10d", r.storeMB, r.messages)
	return sb.String()
}

func (m *memTable) String() string {
	var sb strings.Builder
	sb.WriteString(m.header() + "\n")
	for _, r := range m.rows {
		sb.WriteString(m.row(r) + "\n")
	}
	// CPU seconds each process used over the run: where the time went.
	first, last := m.rows[0], m.rows[len(m.rows)-1]
	fmt.Fprintf(&sb, "%-57s", "CPU seconds over the run")
	for i := range m.names {
		fmt.Fprintf(&sb, " %18.1f", last.cpu[i]-first.cpu[i])
	}
	sb.WriteString("\n")
	return sb.String()
}

func loadAvg() string {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(data))
	return strings.Join(f[:min(3, len(f))], " ")
}

func envInt(b *testing.B, name string, def int) int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	v, err := strconv.Atoi(s)
	if err != nil || v < 1 {
		b.Fatalf("%s: %q is not a positive integer", name, s)
	}
	return v
}

func envFloat(b *testing.B, name string, def float64) float64 {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil || v <= 0 {
		b.Fatalf("%s: %q is not a positive number", name, s)
	}
	return v
}

func envDuration(b *testing.B, name string, def time.Duration) time.Duration {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	v, err := time.ParseDuration(s)
	if err != nil || v < 0 {
		b.Fatalf("%s: %q is not a duration", name, s)
	}
	return v
}

// healthz is whether GET url answers 200 within a second.
func healthz(url string) bool {
	c := http.Client{Timeout: time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return false
	}
	_ = resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}
