package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/e2e/oracle"
)

// recoveryBound is how long after a fault ends (the process is back, or
// thawed, or the partition healed) its service must produce useful output
// again: the longest lease (the resource manager's 10 s, longer than a
// NATS election; the scheduler's is 3 s, the heartbeat timeout 6 s) plus
// 2 s to start and rebuild. A replicated service whose other replica
// carries on recovers at once.
const recoveryBound = 12 * time.Second

// job is one job of the workload, drawn up front from the seed.
type job struct {
	tenant, id string
	kind       string // sim, gang, checkpoint, command
	req        contracts.JobRequest
	at         time.Duration // submit, after the workload starts
	viaGateway bool
	cancel     time.Duration // > 0: cancel this long after submit

	mu        sync.Mutex // submitted, for the stall watcher
	submitted time.Time  // first submit attempt
	submitErr error
}

func (j *job) submittedAt() time.Time {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.submitted
}

var tenants = []string{"acme", "globex", "initech", quotaTenant}

// quotaTenant may hold at most quotaMax GPUs in each pool; the suite
// checks it never held more over the ledger's timeline, faults included.
const (
	quotaTenant = "umbrella"
	quotaMax    = 12
)

// setQuota stores quotaTenant's quota, as the gateway's PUT would.
func (p *platform) setQuota(ctx context.Context) error {
	kv, err := p.js.KeyValue(ctx, contracts.BucketQuotas)
	if err != nil {
		return err
	}
	m := float64(quotaMax)
	b, _ := json.Marshal(contracts.TenantQuota{Tenant: quotaTenant, Pools: map[string]contracts.PoolQuota{contracts.QuotaAllPools: {Max: &m}}})
	_, err = kv.Put(ctx, quotaTenant, b)
	return err
}

// workload draws the jobs of a run: steady arrivals at tr.rate over the
// warm-up and fault phases, simulated runs of 8-GPU machine shapes, gangs
// over two machines, checkpointing runs, real commands; one in twenty is
// cancelled while it queues or runs.
func workload(rng *rand.Rand, tr tier) []*job {
	var jobs []*job
	total := tr.warmup + tr.faults
	at := time.Duration(0)
	for i := 0; ; i++ {
		at += time.Duration(rng.ExpFloat64() / tr.rate * float64(time.Second))
		if at >= total {
			break
		}
		j := &job{tenant: tenants[rng.IntN(len(tenants))], id: fmt.Sprintf("chaos-%05d", i), at: at, viaGateway: rng.IntN(2) == 0}
		gpus := []int{1, 1, 2, 2, 4, 8}[rng.IntN(6)]
		j.req = contracts.JobRequest{ID: j.id, Resources: contracts.Resources{GPU: contracts.GPURequest{Count: gpus, Model: "H100-80GB"}}}
		switch p := rng.IntN(100); {
		case p < 10:
			j.kind = "gang"
			j.req.Resources.GPU = contracts.GPURequest{Count: 2 * gpus, Model: "H100-80GB", Nodes: 2}
			j.req.Run.Duration = contracts.Duration(time.Duration(500+rng.IntN(2500)) * time.Millisecond)
		case p < 25:
			j.kind = "checkpoint"
			j.req.Run = contracts.RunSpec{Duration: contracts.Duration(time.Duration(3000+rng.IntN(5000)) * time.Millisecond), Checkpoint: true}
		case p < 40:
			j.kind = "command"
			j.req.Run = contracts.RunSpec{Command: []string{"sh", "-c", fmt.Sprintf("echo chaos %s on $CUDA_VISIBLE_DEVICES; sleep %.1f", j.id, 0.2+rng.Float64())},
				Duration: contracts.Duration(time.Minute)}
		default:
			j.kind = "sim"
			j.req.Run.Duration = contracts.Duration(time.Duration(300+rng.IntN(2700)) * time.Millisecond)
		}
		if j.tenant == quotaTenant && j.kind == "gang" {
			// Within its quota in one pool: a gang of two halves of at
			// most 4 GPUs.
			j.req.Resources.GPU.Count = min(j.req.Resources.GPU.Count, 8)
		}
		if rng.IntN(20) == 0 {
			j.cancel = time.Duration(100+rng.IntN(3000)) * time.Millisecond
		}
		jobs = append(jobs, j)
	}
	return jobs
}

// fault is one injected fault.
type fault struct {
	kind   string // sigkill, sigstop, partition, redis-kill, redis-flush
	target string // process name
	svc    string // the service its recovery is measured on
	down   time.Duration

	at, restored, recovered time.Time // recovered: probe answered (nats, gateway, monitor)
	note                    string
	leaked                  bool          // a partition the cluster routed around
	stall                   time.Duration // longest gap between scheduled events after it
}

func (f *fault) nats() bool { return f.svc == "nats" }

// faultPlan is the kinds of fault a run cycles through, every one at least
// once in a shuffled first round, then drawn at random.
func (p *platform) faultTemplates() []fault {
	var fs []fault
	kinds := map[string][]string{}
	for _, s := range p.svcs {
		kinds[s.kind] = append(kinds[s.kind], s.name)
	}
	var names []string
	for k := range kinds {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		fs = append(fs, fault{kind: "sigkill", target: k, svc: k}, fault{kind: "sigstop", target: k, svc: k})
	}
	fs = append(fs, fault{kind: "sigkill-long", target: "fleet-sim", svc: "fleet-sim"})
	fs = append(fs,
		fault{kind: "sigkill", target: "nats", svc: "nats"},
		fault{kind: "sigstop", target: "nats", svc: "nats"},
		fault{kind: "partition", target: fmt.Sprintf("nats-%d", partitioned), svc: "nats"},
		fault{kind: "redis-kill", target: "redis", svc: "redis"},
		fault{kind: "redis-flush", target: "redis", svc: "redis"},
	)
	return fs
}

// TestChaos runs the production topology as processes (three clustered
// nats-servers with R3 streams, Redis, every service with its replicas,
// two simulated fleets of 8-GPU machines), a workload of gangs, cancels,
// checkpoints and real commands, and seeded faults: SIGKILL and SIGSTOP of
// every service and of NATS nodes, Redis killed and flushed, a partition
// of one NATS node. It then drains and checks the oracle (G1, J1,
// metering), that every job ended as asked, that no run was stopped by a
// NATS node's loss, and prints the figures. See doc.go.
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the platform as processes for minutes")
	}
	tr := chooseTier(t)
	t.Logf("chaos %s tier: seed %d (rerun with GPUPLANE_CHAOS_SEED=%d), warm-up %s, faults %s, %d machines, %.1f jobs/s",
		tr.name, tr.seed, tr.seed, tr.warmup, tr.faults, 2*tr.machines, tr.rate)
	rng := rand.New(rand.NewPCG(tr.seed, 13))
	jobs := workload(rand.New(rand.NewPCG(rng.Uint64(), 1)), tr)
	frng := rand.New(rand.NewPCG(rng.Uint64(), 2))

	bin := t.TempDir()
	build(t, bin)
	dir := logDir(t)
	began := time.Now()
	p := startPlatform(t, tr, bin, dir)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// Up: streams provisioned, every machine heard from, a first job
	// through (a fresh cluster's slow start is finding 1 and 6 of issue
	// 13; the supervisor restarts a service that gives up meanwhile).
	rec := newRecorder()
	p.rec = rec
	waitFor(t, 4*time.Minute, "the services to provision the streams", func() (bool, string) {
		for _, st := range []string{contracts.StreamJobs, contracts.StreamJobEvents, contracts.StreamAllocations, contracts.StreamRuns, contracts.StreamUsage, contracts.StreamHeartbeats} {
			sctx, scancel := context.WithTimeout(ctx, 2*time.Second)
			_, err := p.js.Stream(sctx, st)
			scancel()
			if err != nil {
				return false, st + ": " + err.Error()
			}
		}
		return true, ""
	})
	rec.follow(t, ctx, p.nc, p.js)
	var nodes []string
	for _, s := range p.svcs {
		nodes = append(nodes, s.nodes...)
	}
	canary := &job{tenant: "acme", id: "chaos-canary", req: contracts.JobRequest{ID: "chaos-canary",
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 8, Model: "H100-80GB"}}, Run: contracts.RunSpec{Duration: contracts.Duration(100 * time.Millisecond)}}}
	p.submit(ctx, canary)
	waitFor(t, 4*time.Minute, "every machine's heartbeat and a first job through", func() (bool, string) {
		rec.mu.Lock()
		missing := 0
		for _, n := range nodes {
			if len(rec.heartbeats[n]) == 0 {
				missing++
			}
		}
		rec.mu.Unlock()
		ev, _ := rec.lastState("acme/chaos-canary")
		if canary.submitErr != nil {
			p.submit(ctx, canary)
		}
		return missing == 0 && ev.State == contracts.StateSucceeded, fmt.Sprintf("%d machines unheard, canary %s", missing, ev.State)
	})
	if err := p.setQuota(ctx); err != nil {
		t.Fatalf("quota of %s: %v", quotaTenant, err)
	}
	upAfter := time.Since(began)
	var startExits []string
	for _, s := range p.svcs {
		startExits = append(startExits, s.unexpectedExits()...)
	}
	t.Logf("platform up %.1fs after start (%d services restarted by the supervisor meanwhile)", upAfter.Seconds(), len(startExits))

	// The workload and the faults run together.
	workStart := time.Now()
	faultStart := workStart.Add(tr.warmup)
	var wg sync.WaitGroup
	wg.Go(func() { p.runWorkload(ctx, jobs, workStart) })
	var faults []*fault
	wg.Go(func() { faults = p.runFaults(ctx, t, frng, faultStart, faultStart.Add(tr.faults)) })
	stallCtx, stopStalls := context.WithCancel(ctx)
	var stallWG sync.WaitGroup
	stallWG.Go(func() {
		rec.watchStalls(stallCtx, t, p.js, func() int {
			n := 0
			for _, j := range jobs {
				if at := j.submittedAt(); !at.IsZero() && time.Since(at) > time.Second {
					if ev, ok := rec.lastState(j.tenant + "/" + j.id); !ok || ev.State == contracts.StateQueued {
						n++
					}
				}
			}
			return n
		})
	})
	defer func() { stopStalls(); stallWG.Wait() }()
	wg.Wait()
	faultEnd := time.Now()
	p.restoreAll(t)

	// Drain: every job ends, the consumers empty, billing catches up.
	var violations []string
	violate := func(format string, args ...any) { violations = append(violations, fmt.Sprintf(format, args...)) }
	ended := func(j *job) bool {
		ev, ok := rec.lastState(j.tenant + "/" + j.id)
		return ok && ev.State.Terminal()
	}
	if msg, ok := poll(tr.drain, func() (bool, string) {
		open := 0
		var ex []string
		for _, j := range jobs {
			if !ended(j) {
				open++
				if len(ex) < 5 {
					ev, _ := rec.lastState(j.tenant + "/" + j.id)
					ex = append(ex, fmt.Sprintf("%s/%s %s %s", j.tenant, j.id, ev.Type, ev.Reason))
				}
			}
		}
		return open == 0, fmt.Sprintf("%d jobs not ended: %s", open, strings.Join(ex, ", "))
	}); !ok {
		violate("stuck: %s after a drain of %s", msg, tr.drain)
	}
	drainedJobs := time.Now()
	if msg, ok := poll(90*time.Second, func() (bool, string) { return consumersDrained(ctx, p.js) }); !ok {
		violate("stuck: durable consumers not drained 90s after the jobs ended: %s", msg)
	}
	var rep *oracle.Report
	msg, ok := poll(time.Minute, func() (bool, string) {
		var err error
		if rep, err = oracle.Check(ctx, p.nc); err != nil {
			return false, err.Error()
		}
		ran, billed := 0, 0
		for id := range rep.Runs {
			if _, _, ok := rep.RunSpan(id); ok {
				ran++
				if len(rep.Usage[id]) > 0 {
					billed++
				}
			}
		}
		return billed == ran, fmt.Sprintf("%d runs ended, %d billed", ran, billed)
	})
	if rep == nil {
		t.Fatalf("oracle: %s", msg)
	}
	if !ok {
		violate("billing: %s a minute after the consumers drained", msg)
	}
	billedGPUms, ranGPUms := rep.CheckMetering()
	// Billing equals the run facts, run by run (it adds its violations).
	mismatches := rep.CheckBillingMatchesRuns()
	violations = append(violations, rep.Violations...)

	// Every job ended as asked: succeeded, or cancelled when it was.
	states := map[contracts.JobState]int{}
	for _, j := range jobs {
		if j.submitErr != nil {
			violate("submit: %s/%s never accepted: %v", j.tenant, j.id, j.submitErr)
			continue
		}
		key := j.tenant + "/" + j.id
		ev, ok := rec.lastState(key)
		if !ok {
			violate("lost: job %s (%s, via gateway %v) has no event", key, j.kind, j.viaGateway)
			continue
		}
		states[ev.State]++
		switch {
		case !ev.State.Terminal():
		case ev.State == contracts.StateSucceeded, ev.State == contracts.StateCancelled && j.cancel > 0:
		default:
			oj := rep.Jobs[key]
			var evs []contracts.JobEventType
			if oj != nil {
				evs = oj.Events
			}
			violate("job %s (%s) ended %s: %s %s (events %v)", key, j.kind, ev.State, ev.Reason, ev.Message, evs)
		}
	}

	// Quota: the tenant with a bound never held more than it, in any pool.
	rec.mu.Lock()
	for k, n := range rec.maxHeld {
		if k[0] == quotaTenant && n > quotaMax {
			violate("quota: %s held %d GPUs in pool %s at once, its max is %d", k[0], n, k[1], quotaMax)
		}
	}
	quotaPeak := map[string]int{}
	for k, n := range rec.maxHeld {
		if k[0] == quotaTenant {
			quotaPeak[k[1]] = n
		}
	}
	rec.mu.Unlock()

	// No run stopped by a NATS node's loss: a machine declared lost, or a
	// run ended as its agent's, while the last fault before it was one of
	// NATS.
	rec.mu.Lock()
	stops := slices.Clone(rec.stops)
	requeues := maps.Clone(rec.requeues)
	rec.mu.Unlock()
	for _, f := range faults {
		if f.leaked {
			violate("harness: the partition at %s leaked: NATS node 0 or 1 kept a route to node %d", f.at.Format("15:04:05"), partitioned)
		}
	}
	stoppedBy := map[string]int{}
	for _, s := range stops {
		var cause *fault
		for _, f := range faults {
			if !f.at.After(s.at) && s.at.Sub(f.at) < time.Minute {
				cause = f
			}
		}
		label := "no fault"
		if cause != nil {
			label = cause.kind + " " + cause.svc
		}
		stoppedBy[s.what+" "+string(s.reason)+" after "+label]++
		if cause != nil && cause.nats() {
			violate("NATS loss stopped a run: %s of %s (alloc %s on %s) %s at %s, %.1fs after %s of %s",
				s.what, s.job, s.alloc, s.node, s.reason, s.at.Format("15:04:05.000"), s.at.Sub(cause.at).Seconds(), cause.kind, cause.target)
		}
	}

	// Figures.
	var lines []string
	say := func(format string, args ...any) { lines = append(lines, fmt.Sprintf(format, args...)) }
	say("seed %d, %s tier (rerun: GPUPLANE_CHAOS_SEED=%d%s)", tr.seed, tr.name, tr.seed, map[bool]string{true: " make chaos", false: " go test -run TestChaos ./e2e/chaos/"}[tr.name == "full"])
	say("topology: 3 nats-server (R3, sync_interval always, node %d behind proxies), redis, %s; %d machines × 8 GPUs",
		partitioned, p.replicaSummary(), 2*tr.machines)
	say("up %.1fs after start; services restarted by the supervisor at start-up: %d", upAfter.Seconds(), len(startExits))
	say("jobs: %d submitted (%d gang, %d checkpoint, %d command, %d cancelled by the suite), end states %v, requeues %v",
		len(jobs), count(jobs, "gang"), count(jobs, "checkpoint"), count(jobs, "command"), countCancel(jobs), states, requeues)
	say("oracle: %s; billed %.1f GPU-s, runs used %.1f GPU-s; runs whose billing differs from their run facts: %d",
		rep.Summary(), float64(billedGPUms)/1000, float64(ranGPUms)/1000, len(mismatches))
	say("quota: %s (max %d GPUs per pool) peaked at %v", quotaTenant, quotaMax, quotaPeak)
	byKind := map[string]int{}
	for _, f := range faults {
		byKind[f.kind+" "+f.svc]++
	}
	say("faults: %d over %.0fs: %v", len(faults), faultEnd.Sub(faultStart).Seconds(), byKind)
	say("runs stopped by machine/agent reasons: %v", stoppedBy)
	recov := map[string][]time.Duration{}
	var slow []string
	for _, f := range faults {
		d, ok := p.recovery(rec, f)
		if !ok {
			continue
		}
		recov[f.svc] = append(recov[f.svc], d)
		if after := d - f.down; after > recoveryBound {
			slow = append(slow, fmt.Sprintf("%s %s at %s: no %s output until %.1fs after it ended (down %s)",
				f.kind, f.target, f.at.Format("15:04:05"), f.svc, after.Seconds(), round(f.down)))
		}
	}
	// Stall: the longest time without a scheduled event from each fault
	// to the next (or the end of the workload): what the fault cost the
	// whole platform, not only its own service.
	stalls := map[string][]time.Duration{}
	workEnd := workStart.Add(tr.warmup + tr.faults)
	for i, f := range faults {
		until := workEnd
		if i+1 < len(faults) {
			until = faults[i+1].at
		}
		g := longestGap(rec.outputs("scheduler", nil), f.at, until)
		f.stall = g
		stalls[f.kind+" "+f.svc] = append(stalls[f.kind+" "+f.svc], g)
		if g > f.down+recoveryBound {
			slow = append(slow, fmt.Sprintf("%s %s at %s: nothing scheduled for %.1fs (down %s)",
				f.kind, f.target, f.at.Format("15:04:05"), g.Seconds(), round(f.down)))
		}
	}
	var svcNames []string
	for k := range recov {
		svcNames = append(svcNames, k)
	}
	sort.Strings(svcNames)
	for _, k := range svcNames {
		say("recovery %-16s (fault -> first useful output) %s", k, fmtPct(recov[k]))
	}
	var stallNames []string
	for k := range stalls {
		stallNames = append(stallNames, k)
	}
	sort.Strings(stallNames)
	for _, k := range stallNames {
		say("longest scheduling gap after %-26s %s", k, fmtPct(stalls[k]))
	}
	say("recovery beyond the bound of %s after the fault ended: %d%s", recoveryBound, len(slow), bullet(slow))
	warm, hot := p.latencies(rec, jobs, workStart, faultStart)
	say("submit -> scheduled, warm-up (no faults): %s", fmtPct(warm))
	say("submit -> scheduled, fault phase:         %s", fmtPct(hot))
	say("timeline (5 s windows from the first submit; faults marked *): jobs scheduled / p50 submit -> scheduled of the jobs submitted then%s",
		bullet(p.timeline(rec, jobs, faults, workStart, faultEnd)))
	var exits []string
	for _, s := range p.svcs {
		exits = append(exits, s.unexpectedExits()...)
	}
	say("processes that exited on their own (restarted by the supervisor): %d%s", len(exits), bullet(firstN(exits, 10)))
	say("drain: jobs ended %.1fs after the last fault; whole run %.0fs", drainedJobs.Sub(faultEnd).Seconds(), time.Since(began).Seconds())
	say("violations: %d%s", len(violations), bullet(firstN(violations, 40)))
	t.Log("chaos report\n  " + strings.Join(lines, "\n  "))
	if len(violations) > 0 {
		t.Errorf("%d violations (seed %d)", len(violations), tr.seed)
	}
}

func count(jobs []*job, kind string) int {
	n := 0
	for _, j := range jobs {
		if j.kind == kind {
			n++
		}
	}
	return n
}

func countCancel(jobs []*job) int {
	n := 0
	for _, j := range jobs {
		if j.cancel > 0 {
			n++
		}
	}
	return n
}

func bullet(s []string) string {
	if len(s) == 0 {
		return ""
	}
	return "\n    - " + strings.Join(s, "\n    - ")
}

func firstN(s []string, n int) []string {
	if len(s) <= n {
		return s
	}
	return append(slices.Clip(s[:n]), fmt.Sprintf("... and %d more", len(s)-n))
}

func (p *platform) replicaSummary() string {
	n := map[string]int{}
	for _, s := range p.svcs {
		n[s.kind]++
	}
	var parts []string
	for _, k := range []string{"scheduler", "resource-manager", "billing", "monitor", "autoscaler", "gateway", "fleet-sim"} {
		parts = append(parts, fmt.Sprintf("%s×%d", k, n[k]))
	}
	return strings.Join(parts, " ")
}

// latencies are submit -> first scheduled of the jobs submitted in the
// warm-up and in the fault phase (jobs cancelled before placement left out).
func (p *platform) latencies(rec *recorder, jobs []*job, workStart, faultStart time.Time) (warm, hot []time.Duration) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, j := range jobs {
		at, ok := rec.firstScheduled[j.tenant+"/"+j.id]
		if !ok || j.submitted.IsZero() {
			continue
		}
		d := at.Sub(j.submitted)
		if j.submitted.Before(faultStart) {
			warm = append(warm, d)
		} else {
			hot = append(hot, d)
		}
	}
	return warm, hot
}

// recovery is the time from the fault to its service's first useful
// output after it: a probe's first 200 (NATS node healthy, gateway,
// monitor) or the first output of that kind on the streams.
func (p *platform) recovery(rec *recorder, f *fault) (time.Duration, bool) {
	if !f.recovered.IsZero() {
		return f.recovered.Sub(f.at), true
	}
	var nodes []string
	if s := p.byName[f.target]; s != nil {
		nodes = s.nodes
	}
	at, ok := firstAfter(rec.outputs(f.svc, nodes), f.at)
	if !ok {
		return 0, false
	}
	return at.Sub(f.at), true
}

// submit sends j through the gateway or the bus, retrying (the same job
// ID: a retry is deduplicated) for up to a minute across NATS faults and
// gateway restarts.
func (p *platform) submit(ctx context.Context, j *job) {
	j.mu.Lock()
	if j.submitted.IsZero() {
		j.submitted = time.Now()
	}
	j.mu.Unlock()
	body, _ := json.Marshal(j.req)
	deadline := time.Now().Add(time.Minute)
	var err error
	for attempt := 0; time.Now().Before(deadline) && ctx.Err() == nil; attempt++ {
		if j.viaGateway {
			err = p.submitGateway(ctx, p.gateways[attempt%len(p.gateways)], j.tenant, body)
		} else {
			msg := nats.NewMsg(contracts.SubjectSubmit(j.tenant))
			msg.Data = body
			msg.Header.Set(contracts.HeaderMsgID, contracts.SubmitMsgID(j.tenant, j.id))
			pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			_, err = p.js.PublishMsg(pctx, msg)
			cancel()
		}
		if err == nil {
			j.submitErr = nil
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	j.submitErr = err
}

func (p *platform) submitGateway(ctx context.Context, gw, tenant string, body []byte) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, gw+"/v1/tenants/"+tenant+"/jobs", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+p.gwToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		var b bytes.Buffer
		_, _ = b.ReadFrom(resp.Body)
		return fmt.Errorf("gateway %s: %d %s", gw, resp.StatusCode, strings.TrimSpace(b.String()))
	}
	return nil
}

// cancelJob publishes j's cancel on the bus, retrying for a minute.
func (p *platform) cancelJob(ctx context.Context, j *job) {
	body, _ := json.Marshal(contracts.CancelRequest{JobID: j.id, Reason: "chaos"})
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		msg := nats.NewMsg(contracts.SubjectCancel(j.tenant))
		msg.Data = body
		msg.Header.Set(contracts.HeaderMsgID, contracts.CancelMsgID(j.tenant, j.id))
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := p.js.PublishMsg(pctx, msg)
		cancel()
		if err == nil {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// runWorkload submits each job at its time (each in its own goroutine, so
// that a submit held up by a fault does not hold up the next one) and
// cancels those marked.
func (p *platform) runWorkload(ctx context.Context, jobs []*job, start time.Time) {
	var wg sync.WaitGroup
	for _, j := range jobs {
		if d := time.Until(start.Add(j.at)); d > 0 {
			select {
			case <-time.After(d): // the job's arrival time
			case <-ctx.Done():
				return
			}
		}
		wg.Go(func() {
			p.submit(ctx, j)
			if j.cancel > 0 {
				select {
				case <-time.After(j.cancel): // the cancel's moment
				case <-ctx.Done():
					return
				}
				p.cancelJob(ctx, j)
			}
		})
	}
	wg.Wait()
}

// runFaults injects one fault at a time from start to end: the first
// round covers every template in a seeded order, then templates are
// drawn at random. After each, it waits for the faulted NATS node to be
// healthy again (the fault model is one node at a time) and 1-3 s more.
func (p *platform) runFaults(ctx context.Context, t *testing.T, rng *rand.Rand, start, end time.Time) []*fault {
	if d := time.Until(start); d > 0 {
		time.Sleep(d) // the warm-up runs without faults
	}
	templates := p.faultTemplates()
	// The first round alternates a fault of NATS or Redis with one of a
	// service, each kind in seeded order, so that even the small tier's
	// ten or so faults take a NATS node down, partition it and lose Redis.
	var infra, services []int
	for _, i := range rng.Perm(len(templates)) {
		if svc := templates[i].svc; svc == "nats" || svc == "redis" {
			infra = append(infra, i)
		} else {
			services = append(services, i)
		}
	}
	var order []int
	for len(infra)+len(services) > 0 {
		for _, q := range []*[]int{&infra, &services} {
			if len(*q) > 0 {
				order = append(order, (*q)[0])
				*q = (*q)[1:]
			}
		}
	}
	var done []*fault
	for i := 0; time.Now().Before(end) && ctx.Err() == nil; i++ {
		tpl := templates[rng.IntN(len(templates))]
		if i < len(order) {
			tpl = templates[order[i]]
		}
		f := tpl
		p.inject(ctx, t, rng, &f, end)
		done = append(done, &f)
		t.Logf("fault %d at %s: %s %s down %s %s", len(done), f.at.Format("15:04:05.000"), f.kind, f.target, round(f.down), f.note)
		time.Sleep(time.Duration(1000+rng.IntN(2000)) * time.Millisecond)
	}
	return done
}

// pick returns a random replica of service kind.
func (p *platform) pick(rng *rand.Rand, kind string) *svc {
	var c []*svc
	for _, s := range p.svcs {
		if s.kind == kind {
			c = append(c, s)
		}
	}
	return c[rng.IntN(len(c))]
}

// inject applies f, holds it for its down time, undoes it, and for the
// NATS, gateway and monitor faults waits for the probe.
func (p *platform) inject(ctx context.Context, t *testing.T, rng *rand.Rand, f *fault, end time.Time) {
	between := func(lo, hi int) time.Duration { return time.Duration(lo+rng.IntN(hi-lo)) * time.Millisecond }
	var probe func() bool
	switch {
	case f.svc == "nats":
		n := p.nats.nodes[rng.IntN(3)]
		if f.kind == "partition" {
			n = p.nats.nodes[partitioned]
		}
		f.target = n.name
		probe = func() bool { return n.healthy(ctx) }
		switch f.kind {
		case "sigkill":
			f.down = between(1000, 5000)
			f.at = time.Now()
			if err := n.kill(); err != nil {
				t.Error(err)
			}
			time.Sleep(f.down)
			if err := n.start(); err != nil {
				t.Error(err)
			}
		case "sigstop":
			f.down = between(1000, 4000)
			f.at = time.Now()
			n.signal(syscall.SIGSTOP)
			time.Sleep(f.down)
			n.signal(syscall.SIGCONT)
		case "partition":
			f.down = between(3000, 8000)
			f.at = time.Now()
			f.note = fmt.Sprintf("(%d links cut", p.nats.cut())
			// The partition is real only if the others lose node 2 too:
			// routes it could reach them by outside the proxies would
			// show here.
			if _, ok := poll(f.down, func() (bool, string) {
				return !p.nats.routed(ctx, 0, partitioned) && !p.nats.routed(ctx, 1, partitioned), ""
			}); ok {
				f.note += "; n0 and n1 have no route to n2)"
			} else {
				f.note += "; n0 or n1 still routes to n2: the partition leaked)"
				f.leaked = true
			}
			time.Sleep(time.Until(f.at.Add(f.down)))
			p.nats.heal()
		}
	case f.kind == "redis-kill":
		f.down = between(500, 2000)
		f.at = time.Now()
		if err := p.redis.kill(); err != nil {
			t.Error(err)
		}
		time.Sleep(f.down)
		if err := p.redis.start(); err != nil {
			t.Error(err)
		}
	case f.kind == "redis-flush":
		f.at = time.Now()
		if err := p.redis.flush(ctx); err != nil {
			f.note = err.Error()
		}
	default:
		s := p.pick(rng, f.svc)
		// A freeze hits the leader where there is one (the worst case:
		// the standby must take over and the thawed leader be fenced);
		// a kill hits it one time in two.
		if f.kind == "sigstop" || rng.IntN(2) == 0 {
			if l := p.leader(ctx, f.svc); l != nil {
				s = l
				f.note = "(the leader)"
			}
		}
		f.target = s.name
		if s.probe != "" {
			probe = func() bool { return httpOK(ctx, s.probe) }
		}
		switch f.kind {
		case "sigkill-long":
			// Longer than the resource manager's 6 s heartbeat timeout:
			// the machines are lost, their runs requeued, and the agent
			// that comes back reports how they really ended (finding 3).
			f.down = between(7000, 10000)
			f.at = time.Now()
			if err := s.kill(); err != nil {
				t.Error(err)
			}
			time.Sleep(f.down)
			if err := s.start(); err != nil {
				f.note = err.Error()
			}
		case "sigkill":
			f.down = between(200, 2000)
			f.at = time.Now()
			if err := s.kill(); err != nil {
				t.Error(err)
			}
			time.Sleep(f.down)
			if err := s.start(); err != nil {
				f.note = err.Error() // the supervisor was first
			}
		case "sigstop":
			// Longer than the scheduler's 3 s lease now and then: a frozen
			// leader must be replaced, and fenced when it thaws.
			f.down = between(1000, 5000)
			f.at = time.Now()
			s.signal(syscall.SIGSTOP)
			time.Sleep(f.down)
			s.signal(syscall.SIGCONT)
		}
	}
	f.restored = time.Now()
	if probe != nil {
		if _, ok := poll(2*time.Minute, func() (bool, string) { return probe(), "" }); ok {
			f.recovered = time.Now()
		} else {
			f.note += " (never healthy again within 2m)"
		}
	}
	// One fault at a time: while jobs still arrive, the next waits until
	// this one's service, and the scheduler, have produced output again,
	// so that each recovery and stall is its own fault's.
	var nodes []string
	if s := p.byName[f.target]; s != nil {
		nodes = s.nodes
	}
	if wait := min(30*time.Second, time.Until(end)); wait > 0 {
		if _, ok := poll(wait, func() (bool, string) {
			_, sched := firstAfter(p.rec.outputs("scheduler", nil), f.restored)
			mine := p.rec.outputs(f.svc, nodes)
			_, own := firstAfter(mine, f.restored)
			return sched && (own || mine == nil), ""
		}); !ok && wait == 30*time.Second {
			f.note += " (no output 30s after it ended)"
		}
	}
}

// restoreAll thaws, heals and starts whatever a fault left down.
func (p *platform) restoreAll(t *testing.T) {
	t.Helper()
	p.nats.heal()
	for _, n := range p.nats.nodes {
		n.signal(syscall.SIGCONT)
		if !n.running() {
			if err := n.start(); err != nil {
				t.Error(err)
			}
		}
	}
	if !p.redis.running() {
		if err := p.redis.start(); err != nil {
			t.Error(err)
		}
	}
	for _, s := range p.svcs {
		s.signal(syscall.SIGCONT)
		if !s.running() {
			if err := s.start(); err != nil {
				t.Log(err)
			}
		}
	}
}

// timeline is, per 5 s window of the run, how many scheduled events came
// and the median submit -> scheduled of the jobs submitted in it, with the
// faults that began in it: where a stall sits and what preceded it.
func (p *platform) timeline(rec *recorder, jobs []*job, faults []*fault, start, end time.Time) []string {
	const w = 5 * time.Second
	n := int(end.Sub(start)/w) + 1
	sched := make([]int, n)
	lat := make([][]time.Duration, n)
	marks := make([][]string, n)
	idx := func(t time.Time) int { return int(t.Sub(start) / w) }
	rec.mu.Lock()
	for _, at := range rec.scheduled {
		if i := idx(at); i >= 0 && i < n {
			sched[i]++
		}
	}
	for _, j := range jobs {
		if at, ok := rec.firstScheduled[j.tenant+"/"+j.id]; ok && !j.submitted.IsZero() {
			if i := idx(j.submitted); i >= 0 && i < n {
				lat[i] = append(lat[i], at.Sub(j.submitted))
			}
		}
	}
	rec.mu.Unlock()
	for _, f := range faults {
		if i := idx(f.at); i >= 0 && i < n {
			marks[i] = append(marks[i], fmt.Sprintf("*%s %s %s", f.kind, f.target, round(f.down)))
		}
	}
	var out []string
	var row []string
	for i := range n {
		p50, _, _ := percentiles(lat[i])
		cell := fmt.Sprintf("+%3ds %3d/%-7s", i*5, sched[i], round(p50))
		if len(marks[i]) > 0 {
			out = append(out, strings.Join(append(row, cell+" "+strings.Join(marks[i], ", ")), " | "))
			row = nil
			continue
		}
		row = append(row, cell)
		if len(row) == 4 {
			out = append(out, strings.Join(row, " | "))
			row = nil
		}
	}
	if len(row) > 0 {
		out = append(out, strings.Join(row, " | "))
	}
	return out
}

// longestGap is the longest time in [from, to) without a time of ts (in
// any order), the edges counting as events.
func longestGap(ts []time.Time, from, to time.Time) time.Duration {
	var in []time.Time
	for _, x := range ts {
		if !x.Before(from) && x.Before(to) {
			in = append(in, x)
		}
	}
	slices.SortFunc(in, func(a, b time.Time) int { return a.Compare(b) })
	prev, g := from, time.Duration(0)
	for _, x := range append(in, to) {
		g = max(g, x.Sub(prev))
		prev = x
	}
	return g
}

// leaseKeys are the lease keys of the services that run active/standby.
var leaseKeys = map[string]string{
	"scheduler":        contracts.LeaseKeyScheduler("scheduler"),
	"resource-manager": contracts.LeaseKeyResourceManager,
	"autoscaler":       contracts.LeaseKeyAutoscaler,
	"monitor":          contracts.LeaseKeyMonitor,
}

// leader is the replica of kind holding its lease now, or nil. A holder
// ends with its process's start time in base-36 nanoseconds: the leader is
// the replica started last before that time.
func (p *platform) leader(ctx context.Context, kind string) *svc {
	key, ok := leaseKeys[kind]
	if !ok {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	kv, err := p.js.KeyValue(ctx, contracts.BucketLeases)
	if err != nil {
		return nil
	}
	e, err := kv.Get(ctx, key)
	if err != nil {
		return nil
	}
	var l contracts.Lease
	if json.Unmarshal(e.Value(), &l) != nil || time.Now().After(l.Expires) {
		return nil
	}
	i := strings.LastIndex(l.Holder, "-")
	ns, err := strconv.ParseInt(l.Holder[i+1:], 36, 64)
	if err != nil {
		return nil
	}
	since := time.Unix(0, ns)
	var best *svc
	var bestAt time.Time
	for _, s := range p.svcs {
		s.mu.Lock()
		at, up := s.started, s.cmd != nil
		s.mu.Unlock()
		if s.kind == kind && up && !at.After(since) && at.After(bestAt) {
			best, bestAt = s, at
		}
	}
	return best
}
