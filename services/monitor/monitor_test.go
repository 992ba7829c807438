package monitor_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/monitor"
	"github.com/gpuplane/gpuplane/services/monitor/internal/readmodel"
)

func TestConfigValidateReportsEveryProblem(t *testing.T) {
	cfg := monitor.DefaultConfig()
	cfg.Bus.NATSURL = ""
	cfg.Addr = "no-port"
	cfg.SilentAfter = 0
	cfg.EvalInterval = 0
	cfg.RulesFile = filepath.Join(t.TempDir(), "missing.yaml")
	err := cfg.Validate()
	for _, want := range []string{"nats URL", "addr", "silent-after", "eval-interval", "missing.yaml"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate() = %v, want it to mention %q", err, want)
		}
	}
	if err := monitor.DefaultConfig().Validate(); err != nil {
		t.Errorf("defaults do not validate: %v", err)
	}
}

// TestConfigRefusesTheSilenceKind: a rule raising node_silent would mix
// its episodes with the silence detector's on one subject.
func TestConfigRefusesTheSilenceKind(t *testing.T) {
	path := rulesFile(t, "rules:\n  - {kind: node_silent, scope: node, metric: heartbeat_age_s, op: \">\"}\n")
	cfg := monitor.DefaultConfig()
	cfg.RulesFile = path
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), `"node_silent" is the silence detector's`) {
		t.Errorf("Validate() = %v; want it to refuse the node_silent kind", err)
	}
}

func TestMetricsFromStreams(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)

	// History the monitor must read from the start: inventory, lifecycle,
	// job events and ledger entries, with duplicates and refused events.
	publish(t, b, contracts.SubjectInventory("n1"), "inv/n1", inventory("n1", "host-1", "h100", 2))
	publish(t, b, contracts.SubjectInventory("n2"), "inv/n2", inventory("n2", "host-2", "h100", 8))
	publish(t, b, contracts.SubjectInventory("n3"), "inv/n3", inventory("n3", "host-3", "a100", 4))
	publish(t, b, contracts.SubjectNodeLifecycle("n2"), "lost/n2", contracts.NodeEvent{Kind: contracts.NodeLost, NodeID: "n2", Pool: "h100"})
	for i, ev := range []struct {
		tenant, job string
		typ         contracts.JobEventType
	}{
		{"acme", "j1", contracts.EventQueued},
		{"acme", "j1", contracts.EventQueued}, // same event again under another ID: refused
		{"acme", "j2", contracts.EventQueued},
		{"acme", "j2", contracts.EventScheduled},
		{"acme", "j2", contracts.EventRunning},
		{"acme", "j3", contracts.EventRejected},
		{"acme", "j1", contracts.EventRejected}, // duplicate_job_id: the accepted job is unaffected
		{"beta", "j4", contracts.EventQueued},
		{"beta", "j4", contracts.EventCancelled},
	} {
		publish(t, b, contracts.SubjectJobEvents(ev.tenant, ev.job), fmt.Sprintf("ev-%d", i),
			contracts.JobEvent{Type: ev.typ, Tenant: ev.tenant, JobID: ev.job, Attempt: 1})
	}
	a1 := allocation("acme", "j2", "n1", "h100", 2)
	a2 := allocation("beta", "j5", "n1", "h100", 1)
	a3 := allocation("acme", "j6", "n3", "a100", 4)
	for i, e := range []contracts.LedgerEntry{
		{Kind: contracts.LedgerCommitted, Allocation: a1},
		{Kind: contracts.LedgerCommitted, Allocation: a1}, // duplicate under another ID
		{Kind: contracts.LedgerCommitted, Allocation: a2},
		{Kind: contracts.LedgerCommitted, Allocation: a3},
		{Kind: contracts.LedgerReleased, Allocation: a2},
	} {
		publish(t, b, contracts.SubjectLedger(e.Allocation.NodeID), fmt.Sprintf("led-%d", i), e)
	}
	publish(t, b, contracts.SubjectDemand("h100"), "demand-h100", contracts.PoolDemand{Pool: "h100", Time: time.Now(),
		PendingJobs: 3, PendingGPUs: 12, FreeGPUs: 1, TotalGPUs: 2})
	// Telemetry before the start: only the last sample of each node counts.
	publish(t, b, contracts.SubjectTelemetry("n3"), "tel-n3-1", telemetry("n3", "host-3", "a100", gpu(0, "GPU-n3-0", "A100-80GB", 1)))
	publish(t, b, contracts.SubjectTelemetry("n3"), "tel-n3-2", telemetry("n3", "host-3", "a100", contracts.GPUSample{
		Index: 0, UUID: "GPU-n3-0", Model: "A100-80GB", GPUUtil: 100, MemCopyUtil: 93.5, FBUsedMiB: 80000, FBFreeMiB: 1920,
		TempC: 71, PowerW: 398.5, SMClockMHz: 1410, PowerLimitW: 400, ECCSBE: 2, ThrottleReasons: contracts.ThrottleSWPowerCap}))

	addr := startMonitor(t, srv, time.Minute)
	waitHealthy(t, addr)

	// Live telemetry: the second tick replaces the first.
	publish(t, b, contracts.SubjectTelemetry("n1"), "tel-n1-1", telemetry("n1", "host-1", "h100",
		gpu(0, "GPU-n1-0", "H100-80GB", 5), gpu(1, "GPU-n1-1", "H100-80GB", 5)))
	publish(t, b, contracts.SubjectTelemetry("n1"), "tel-n1-2", telemetry("n1", "host-1", "h100",
		contracts.GPUSample{Index: 0, UUID: "GPU-n1-0", Model: "H100-80GB", GPUUtil: 87, MemCopyUtil: 40.5,
			FBUsedMiB: 61440, FBFreeMiB: 20480, TempC: 64, PowerW: 512.25, SMClockMHz: 1980, AllocationID: a1.ID,
			PowerLimitW: 700, ECCDBE: 1, LastXID: 48},
		contracts.GPUSample{Index: 1, UUID: "GPU-n1-1", Model: "H100-80GB", GPUUtil: 0, MemCopyUtil: 0,
			FBUsedMiB: 0, FBFreeMiB: 81920, TempC: 31, PowerW: 70, SMClockMHz: 210}))

	want := slices.Concat(
		dcgmLines(`Hostname="host-1",UUID="GPU-n1-0",device="nvidia0",gpu="0",modelName="H100-80GB",pci_bus_id="00000000:18:00.0",pool="h100"`, "87", "40.5", "61440", "20480", "64", "512.25", "1980",
			"700", "0", "1", "0", "48"),
		dcgmLines(`Hostname="host-1",UUID="GPU-n1-1",device="nvidia1",gpu="1",modelName="H100-80GB",pci_bus_id="00000000:2A:00.0",pool="h100"`, "0", "0", "0", "81920", "31", "70", "210",
			"0", "0", "0", "0", "0"),
		dcgmLines(`Hostname="host-3",UUID="GPU-n3-0",device="nvidia0",gpu="0",modelName="A100-80GB",pci_bus_id="00000000:18:00.0",pool="a100"`, "100", "93.5", "80000", "1920", "71", "398.5", "1410",
			"400", "2", "0", "4", "0"),
		// No job was requeued or moved yet: every counter of each pool the
		// inventory named is there at 0, so increase() sees the first event.
		// No pool was scaled: no autoscaler counters.
		zeroCounters("a100", "h100"),
		[]string{
			// One episode each of gpu_xid and gpu_ecc_dbe: GPU-n1-0.
			`gpuplane_alerts_firing{kind="gpu_ecc_dbe"} 1`,
			`gpuplane_alerts_firing{kind="gpu_ecc_sbe_rising"} 0`,
			`gpuplane_alerts_firing{kind="gpu_hot"} 0`,
			`gpuplane_alerts_firing{kind="gpu_memory_high"} 0`,
			`gpuplane_alerts_firing{kind="gpu_temp_rising"} 0`,
			`gpuplane_alerts_firing{kind="gpu_xid"} 1`,
			`gpuplane_alerts_firing{kind="node_lost"} 0`,
			`gpuplane_alerts_firing{kind="pool_fragmented"} 0`,
			`gpuplane_alerts_firing{kind="pool_util_high"} 0`,
			// Every live GPU is held: nothing free, nothing fragmented.
			`gpuplane_pool_fragmentation_ratio{pool="a100"} 0`,
			`gpuplane_pool_fragmentation_ratio{pool="h100"} 0`,
			`gpuplane_pool_free_milligpus{pool="a100"} 0`,
			`gpuplane_pool_free_milligpus{pool="h100"} 0`,
			`gpuplane_pool_idle_free_milligpus{pool="a100"} 0`,
			`gpuplane_pool_idle_free_milligpus{pool="h100"} 0`,
			// acme's j1 waits, not yet explained; beta's j4 was cancelled.
			`gpuplane_pool_queue_depth{pool="",reason="none"} 1`,
			// n1: two ticks of two GPUs (5, 5, 87, 0); n3: its last sample.
			`gpuplane_node_gpu_util_1m{Hostname="host-1",node="n1",pool="h100"} 24.25`,
			`gpuplane_node_gpu_util_1m{Hostname="host-3",node="n3",pool="a100"} 100`,
			`gpuplane_pool_allocation_ratio{pool="a100"} 1`,
			`gpuplane_pool_allocation_ratio{pool="h100"} 1`,
			`gpuplane_pool_free_gpus{pool="h100"} 1`,
			`gpuplane_pool_gpu_util_1m{pool="a100"} 100`,
			`gpuplane_pool_gpu_util_1m{pool="h100"} 24.25`,
			`gpuplane_pool_pending_gpus{pool="h100"} 12`,
			`gpuplane_pool_pending_jobs{pool="h100"} 3`,
			// Only GPU-n1-0's second sample was held by an allocation (acme's).
			`gpuplane_tenant_gpu_util_1m{tenant="acme"} 87`,
			`gpuplane_allocated_gpus{pool="a100"} 4`,
			`gpuplane_allocated_gpus{pool="h100"} 2`,
			`gpuplane_gpus{pool="a100"} 4`,
			`gpuplane_gpus{pool="h100"} 2`,
			`gpuplane_jobs{state="cancelled",tenant="beta"} 1`,
			`gpuplane_jobs{state="queued",tenant="acme"} 1`,
			`gpuplane_jobs{state="queued",tenant="beta"} 0`,
			`gpuplane_jobs{state="rejected",tenant="acme"} 1`,
			`gpuplane_jobs{state="running",tenant="acme"} 1`,
			`gpuplane_jobs{state="scheduled",tenant="acme"} 0`,
			`gpuplane_nodes{pool="a100"} 1`,
			`gpuplane_nodes{pool="h100"} 1`,
			`gpuplane_queue_depth{tenant="acme"} 1`,
			`gpuplane_queue_depth{tenant="beta"} 0`,
			`gpuplane_telemetry_messages_total 3`,
			`gpuplane_tenant_allocated_gpus{pool="a100",tenant="acme"} 4`,
			`gpuplane_tenant_allocated_gpus{pool="h100",tenant="acme"} 2`,
			`gpuplane_tenant_allocated_gpus{pool="h100",tenant="beta"} 0`,
		})
	slices.Sort(want)
	var got []string
	eventually(t, 10*time.Second, "metrics to match", func() bool {
		got = slices.DeleteFunc(scrape(t, addr), func(l string) bool {
			return strings.HasPrefix(l, "gpuplane_node_telemetry_age_seconds") // a clock, checked below
		})
		return cmp.Equal(want, got)
	}, func() string { return cmp.Diff(want, got) })
	// Every node that sent telemetry has its age exported (n2 is lost, not
	// silent: it never sent any).
	for _, n := range []string{"n1", "n3"} {
		if _, ok := telemetryAge(t, addr, n); !ok {
			t.Errorf("no telemetry age for %s", n)
		}
	}
	if _, ok := telemetryAge(t, addr, "n2"); ok {
		t.Error("a telemetry age for n2, which sent none")
	}

	body := get(t, "http://"+addr+"/metrics")
	for _, help := range []string{"# TYPE DCGM_FI_DEV_GPU_UTIL gauge", "# TYPE gpuplane_telemetry_messages_total counter",
		"# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter"} {
		if !strings.Contains(body, help) {
			t.Errorf("metrics lack %q", help)
		}
	}
}

func TestNodeSilentFiresOnceAndResolvesOnce(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	const silentAfter = 800 * time.Millisecond

	addr, stop := startMonitorStoppable(t, srv, silentAfter)
	waitHealthy(t, addr)

	// n2 keeps talking for the whole test; n1 sends one tick and falls silent.
	tick(t, b, "n2", "host-2")
	publish(t, b, contracts.SubjectTelemetry("n1"), "n1-once", telemetry("n1", "host-1", "h100", gpu(0, "GPU-1a", "H100-80GB", 50)))

	var alerts []idAlert
	eventually(t, 10*time.Second, "node_silent firing for n1", func() bool {
		alerts = readAlerts(t, b, "node_silent")
		return len(alerts) >= 1
	}, func() string { return fmt.Sprintf("%+v", alerts) })
	first := alerts[0]
	if first.id != "alert/node_silent/n1/1/firing" || first.Key != "n1" || first.State != contracts.AlertFiring ||
		first.Labels["pool"] != "h100" || first.Labels["hostname"] != "host-1" || first.Value < silentAfter.Seconds() {
		t.Fatalf("first alert = %+v", first)
	}
	// The silent node's GPUs are gone from /metrics; the talking node's
	// stay; the silence itself is exported (Prometheus' node_silent).
	eventually(t, 5*time.Second, "n1's GPU series to disappear", func() bool {
		lines := strings.Join(scrape(t, addr), "\n")
		return !strings.Contains(lines, `DCGM_FI_DEV_GPU_UTIL{Hostname="host-1"`) && strings.Contains(lines, `DCGM_FI_DEV_GPU_UTIL{Hostname="host-2"`)
	}, func() string { return strings.Join(scrape(t, addr), "\n") })
	if age, ok := telemetryAge(t, addr, "n1"); !ok || age < silentAfter.Seconds() {
		t.Errorf("n1's telemetry age = %v (exported %v); want at least %v", age, ok, silentAfter.Seconds())
	}

	// Restart while the episode is open. JetStream would hide a re-fired
	// alert under the same message ID, so shorten its memory first: a
	// monitor that forgot the open episode would publish a second firing.
	natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamOps)
	stop()
	addr, _ = startMonitorStoppable(t, srv, silentAfter)
	waitHealthy(t, addr)

	tick(t, b, "n1", "host-1")
	eventually(t, 10*time.Second, "node_silent resolved for n1", func() bool {
		alerts = readAlerts(t, b, "node_silent")
		return len(alerts) >= 2
	}, func() string { return fmt.Sprintf("%+v", alerts) })

	// Barrier: n1's GPUs are back, so every check since resolution ran.
	eventually(t, 5*time.Second, "n1's GPU series to come back", func() bool {
		return strings.Contains(strings.Join(scrape(t, addr), "\n"), `DCGM_FI_DEV_GPU_UTIL{Hostname="host-1"`)
	}, func() string { return "" })
	alerts = readAlerts(t, b, "node_silent")
	var ids []string
	for _, a := range alerts {
		ids = append(ids, a.id)
	}
	wantIDs := []string{"alert/node_silent/n1/1/firing", "alert/node_silent/n1/1/resolved"}
	if diff := cmp.Diff(wantIDs, ids); diff != "" {
		t.Fatalf("alerts on the bus (-want +got):\n%s", diff)
	}
	if r := alerts[1]; r.State != contracts.AlertResolved || r.Key != "n1" || !r.Since.Equal(first.Since) {
		t.Errorf("resolution = %+v, want n1 resolved with Since %v", r, first.Since)
	}
}

// --- helpers ---

// connect connects the test's own client, which plays the node agents and
// the other services and observes: the operator.
func connect(t testing.TB, srv *natsserver.Server) *bus.Bus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "test", Logger: quietLog(), CredsFile: natstest.Operator(t, srv)})
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	return b
}

func quietLog() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func startMonitor(t *testing.T, srv *natsserver.Server, silentAfter time.Duration) string {
	addr, _ := startMonitorStoppable(t, srv, silentAfter)
	return addr
}

func startMonitorStoppable(t *testing.T, srv *natsserver.Server, silentAfter time.Duration) (string, func()) {
	t.Helper()
	cfg := monitor.DefaultConfig()
	cfg.SilentAfter = silentAfter
	return startMonitorWith(t, srv, cfg)
}

// startMonitorWith runs the monitor until stop is called or the test
// ends, and checks that it stops cleanly within a bounded time.
func startMonitorWith(t testing.TB, srv *natsserver.Server, cfg monitor.Config) (string, func()) {
	t.Helper()
	return startMonitorLogged(t, srv, cfg, quietLog())
}

// startMonitorLogged is startMonitorWith logging to log. The monitor runs
// with its own bus identity, which proves its permissions suffice.
func startMonitorLogged(t testing.TB, srv *natsserver.Server, cfg monitor.Config, log *slog.Logger) (string, func()) {
	t.Helper()
	cfg.Bus = service.BusConfig{NATSURL: srv.URL(), Replicas: 1, Creds: natstest.Service(t, srv, contracts.BusMonitor)}
	cfg.Addr = "127.0.0.1:0"
	listening := make(chan string, 1)
	cfg.OnListen = func(addr string) { listening <- addr }
	exited := make(chan error, 1)
	stop := natstest.RunService(t, "monitor", func(ctx context.Context) error {
		err := monitor.Run(ctx, cfg, log)
		exited <- err
		return err
	})
	select {
	case addr := <-listening:
		return addr, stop
	case err := <-exited:
		t.Fatalf("monitor exited before listening: %v", err)
	case <-time.After(15 * time.Second):
		t.Fatal("monitor not listening after 15s")
	}
	return "", nil
}

func waitHealthy(t testing.TB, addr string) {
	t.Helper()
	var last string
	eventually(t, 10*time.Second, "/healthz 200", func() bool {
		resp, err := http.Get("http://" + addr + "/healthz")
		if err != nil {
			last = err.Error()
			return false
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		last = fmt.Sprintf("%d %s", resp.StatusCode, body)
		return resp.StatusCode == http.StatusOK
	}, func() string { return last })
}

func get(t testing.TB, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %v", url, resp.StatusCode, err)
	}
	return string(body)
}

// scrape returns the DCGM_ and gpuplane_ sample lines of /metrics, sorted.
func scrape(t testing.TB, addr string) []string {
	t.Helper()
	var out []string
	for line := range strings.Lines(get(t, "http://"+addr+"/metrics")) {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "DCGM_") || strings.HasPrefix(line, "gpuplane_") {
			out = append(out, line)
		}
	}
	slices.Sort(out)
	return out
}

func dcgmLines(labels string, values ...string) []string {
	names := []string{"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
		"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_POWER_MGMT_LIMIT",
		"DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
		"DCGM_FI_DEV_XID_ERRORS"}
	var out []string
	for i, n := range names {
		out = append(out, n+"{"+labels+"} "+values[i])
	}
	return out
}

// telemetryAge is gpuplane_node_telemetry_age_seconds of node, false when
// it is not exported.
func telemetryAge(t testing.TB, addr, node string) (float64, bool) {
	t.Helper()
	for _, l := range scrape(t, addr) {
		if strings.HasPrefix(l, "gpuplane_node_telemetry_age_seconds{") && strings.Contains(l, `node="`+node+`"`) {
			v, err := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64)
			if err != nil {
				t.Fatalf("%s: %v", l, err)
			}
			return v, true
		}
	}
	return 0, false
}

// zeroCounters are the job counter series of pools no job was requeued or
// moved in: at 0 from the pool's first inventory.
func zeroCounters(pools ...string) []string {
	var out []string
	for _, p := range pools {
		out = append(out, `gpuplane_preemptions_total{pool="`+p+`"} 0`)
		for _, r := range readmodel.RequeueReasons {
			out = append(out, fmt.Sprintf(`gpuplane_job_requeues_total{pool=%q,reason=%q} 0`, p, r))
		}
		for _, r := range readmodel.MoveReasons {
			for _, ev := range readmodel.MoveEvents {
				out = append(out, fmt.Sprintf(`gpuplane_job_migrations_total{event=%q,pool=%q,reason=%q} 0`, ev, p, r))
			}
		}
	}
	return out
}

func eventually(t testing.TB, d time.Duration, what string, cond func() bool, state func() string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if cond() {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("timed out after %s waiting for %s; last state:\n%s", d, what, state())
}

func publish(t *testing.T, b *bus.Bus, subject, id string, v any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := b.Publish(ctx, subject, id, v); err != nil {
		t.Fatalf("publish %s: %v", subject, err)
	}
}

// tick publishes a telemetry sample for a node every 100 ms until the test
// ends; cleanup waits for it to stop.
func tick(t *testing.T, b *bus.Bus, node, host string) {
	publishEvery(t, b, node, 100*time.Millisecond, func(i int) (string, contracts.Telemetry) {
		return fmt.Sprintf("tick/%s/%d", node, i), telemetry(node, host, "h100", gpu(0, "GPU-"+node, "H100-80GB", 50))
	})
}

// publishEvery publishes sample(i) on node's telemetry subject every
// interval until the test ends; cleanup waits for the loop to stop and
// reports a publish that failed.
func publishEvery(t *testing.T, b *bus.Bus, node string, every time.Duration, sample func(i int) (string, contracts.Telemetry)) {
	ctx, cancel := context.WithCancel(context.Background())
	var failed error
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			id, msg := sample(i)
			if _, err := b.Publish(ctx, contracts.SubjectTelemetry(node), id, msg); err != nil && ctx.Err() == nil {
				failed = err
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(every):
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		if failed != nil {
			t.Errorf("telemetry for %s: %v", node, failed)
		}
	})
}

type idAlert struct {
	id string
	contracts.Alert
}

func readAlerts(t *testing.T, b *bus.Bus, kind string) []idAlert {
	t.Helper()
	var out []idAlert
	_, err := b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamOps,
		FilterSubjects: []string{contracts.SubjectAlert(kind)}}, func(_ context.Context, m *bus.Msg) error {
		var a contracts.Alert
		if err := m.Decode(&a); err != nil {
			return err
		}
		out = append(out, idAlert{m.ID(), a})
		return nil
	})
	if err != nil {
		t.Fatalf("read alerts: %v", err)
	}
	return out
}

func inventory(node, host, pool string, gpus int) contracts.NodeInventory {
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: node, Hostname: host, Pool: pool, MachineType: "m", Incarnation: "i1"}
	for i := range gpus {
		inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: fmt.Sprintf("GPU-%s-%d", node, i), Model: "H100-80GB", Healthy: true,
			PCIBusID: fmt.Sprintf("00000000:%02X:00.0", []int{0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb}[i%8])})
	}
	return inv
}

func allocation(tenant, job, node, pool string, gpus int) contracts.Allocation {
	a := contracts.Allocation{ID: contracts.AllocationID(tenant, job, 1), Tenant: tenant, JobID: job, Attempt: 1, NodeID: node, Pool: pool}
	for i := range gpus {
		a.Devices = append(a.Devices, contracts.DeviceRef{Index: i, UUID: fmt.Sprintf("GPU-%s-%d", node, i), Model: "H100-80GB"})
	}
	return a
}

func telemetry(node, host, pool string, gpus ...contracts.GPUSample) contracts.Telemetry {
	return contracts.Telemetry{SchemaVersion: 1, NodeID: node, Hostname: host, Pool: pool, Time: time.Now(), GPUs: gpus}
}

func gpu(index int, uuid, model string, util float64) contracts.GPUSample {
	return contracts.GPUSample{Index: index, UUID: uuid, Model: model, GPUUtil: util}
}
