package e2e

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/autoscaler"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// The operator's view, tested as an operator meets it: Debian's Prometheus
// scrapes the monitor of a running platform every second and evaluates the
// shipped rules file (deploy/monitoring/prometheus-rules.yaml); a scripted
// scenario plays on the simulated fleet; then every expression of the
// shipped Grafana dashboard is queried through Prometheus' HTTP API and
// the alerts that fired are compared with those the scenario provokes.

var monitoringDir = filepath.Join("..", "deploy", "monitoring")

// prometheusTools returns the paths of prometheus and promtool, skipping
// the test when they are not installed, unless GPUPLANE_REQUIRE_PROMETHEUS
// is set (CI installs Debian's prometheus package and sets it).
func prometheusTools(t *testing.T) (prom, promtool string) {
	t.Helper()
	var missing []string
	for _, name := range []string{"prometheus", "promtool"} {
		p, err := exec.LookPath(name)
		if err != nil {
			missing = append(missing, name)
		}
		if name == "prometheus" {
			prom = p
		} else {
			promtool = p
		}
	}
	if len(missing) > 0 {
		if os.Getenv("GPUPLANE_REQUIRE_PROMETHEUS") != "" {
			t.Fatalf("%v not on PATH and GPUPLANE_REQUIRE_PROMETHEUS is set (CI): apt-get install --no-install-recommends prometheus", missing)
		}
		t.Skipf("%v not on PATH (Debian: apt-get install --no-install-recommends prometheus)", missing)
	}
	return prom, promtool
}

// TestShippedPrometheusRulesPassPromtool runs `promtool check rules` on the
// shipped rules file, as an operator loading it would.
func TestShippedPrometheusRulesPassPromtool(t *testing.T) {
	_, promtool := prometheusTools(t)
	out, err := exec.Command(promtool, "check", "rules", filepath.Join(monitoringDir, "prometheus-rules.yaml")).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "SUCCESS") {
		t.Fatalf("promtool check rules: %v\n%s", err, out)
	}
}

// promServer is a Prometheus started by the test.
type promServer struct {
	url string
}

// startPrometheus runs Debian's Prometheus on loopback, scraping target
// (host:port, path /metrics) and evaluating rules every second, with its
// storage in a temporary directory; it stops when the test ends.
func startPrometheus(t *testing.T, prom, target string, rules ...string) *promServer {
	t.Helper()
	var files []string
	for _, r := range rules {
		abs, err := filepath.Abs(r)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, strconv.Quote(abs))
	}
	dir := t.TempDir()
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  scrape_timeout: 900ms
  evaluation_interval: 1s
rule_files: [%s]
scrape_configs:
  - job_name: gpuplane-monitor
    static_configs: [{targets: [%q]}]
`, strings.Join(files, ", "), target)
	cfgPath := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	logf, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(prom, "--config.file="+cfgPath, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr, "--log.level=warn")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		_ = logf.Close()
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			t.Logf("prometheus log:\n%s", b)
		}
	})
	p := &promServer{url: "http://" + addr}
	waitFor(t, 30*time.Second, "prometheus ready", func() (bool, string) {
		select {
		case <-done:
			b, _ := os.ReadFile(logf.Name())
			t.Fatalf("prometheus exited: %s", b)
		default:
		}
		resp, err := http.Get(p.url + "/-/ready")
		if err != nil {
			return false, err.Error()
		}
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status
	})
	return p
}

// promSeries is one series of a query's answer: its labels and its
// samples (one for an instant query).
type promSeries struct {
	Metric map[string]string
	Values []float64
}

// query runs an instant query (at now) or, with a non-zero start, a range
// query from start to now every step.
func (p *promServer) query(expr string, start time.Time, step time.Duration) ([]promSeries, error) {
	q := url.Values{"query": {expr}}
	path := "/api/v1/query"
	now := time.Now()
	if !start.IsZero() {
		path = "/api/v1/query_range"
		q.Set("start", strconv.FormatFloat(float64(start.UnixMilli())/1000, 'f', 3, 64))
		q.Set("end", strconv.FormatFloat(float64(now.UnixMilli())/1000, 'f', 3, 64))
		q.Set("step", step.String())
	}
	resp, err := http.Get(p.url + path + "?" + q.Encode())
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var body struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			Result []struct {
				Metric map[string]string `json:"metric"`
				Value  []any             `json:"value"`
				Values [][]any           `json:"values"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, fmt.Errorf("%s: %w", expr, err)
	}
	if body.Status != "success" {
		return nil, fmt.Errorf("%s: %s", expr, body.Error)
	}
	var out []promSeries
	for _, r := range body.Data.Result {
		s := promSeries{Metric: r.Metric}
		if r.Value != nil {
			r.Values = append(r.Values, r.Value)
		}
		for _, v := range r.Values {
			if len(v) != 2 {
				return nil, fmt.Errorf("%s: sample %v", expr, v)
			}
			str, _ := v[1].(string)
			f, err := strconv.ParseFloat(str, 64)
			if err != nil {
				return nil, fmt.Errorf("%s: sample %v: %w", expr, v, err)
			}
			s.Values = append(s.Values, f)
		}
		out = append(out, s)
	}
	return out, nil
}

// value is the single value of an instant query, false when it has no
// series.
func (p *promServer) value(t *testing.T, expr string) (float64, bool) {
	t.Helper()
	ss, err := p.query(expr, time.Time{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(ss) == 0 {
		return 0, false
	}
	if len(ss) > 1 {
		t.Fatalf("%s: %d series, want one", expr, len(ss))
	}
	return ss[0].Values[0], true
}

// dashboardTarget is one query of the shipped dashboard.
type dashboardTarget struct {
	panel, refID, expr string
}

// dashboardTargets reads every query of the shipped Grafana dashboard,
// those of panels inside rows included.
func dashboardTargets(t *testing.T) []dashboardTarget {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(monitoringDir, "grafana-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	type panel struct {
		Title   string  `json:"title"`
		Panels  []panel `json:"panels"`
		Targets []struct {
			RefID string `json:"refId"`
			Expr  string `json:"expr"`
		} `json:"targets"`
	}
	var dash struct {
		Panels []panel `json:"panels"`
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatal(err)
	}
	var out []dashboardTarget
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			for _, tg := range p.Targets {
				out = append(out, dashboardTarget{panel: p.Title, refID: tg.RefID, expr: tg.Expr})
			}
			walk(p.Panels)
		}
	}
	walk(dash.Panels)
	return out
}

var grafanaVar = regexp.MustCompile(`\$\{?(__rate_interval|__interval|__range|pool|host|datasource)\}?`)

// concrete replaces Grafana's variables by what the dashboard's "All" and
// a 1 s scrape interval make of them.
func concrete(expr string) string {
	return grafanaVar.ReplaceAllStringFunc(expr, func(v string) string {
		switch strings.Trim(v, "${}") {
		case "__rate_interval":
			return "1m"
		case "__interval":
			return "1s"
		case "__range":
			return "5m"
		default: // pool, host: All
			return ".*"
		}
	})
}

// TestPrometheusSeesTheScenario runs the platform with a static pool
// (h100: two 4×H100 machines) and an autoscaled one (burst: one machine at
// least, two at most), Debian's Prometheus beside it, and this scenario:
//
//   - a best-effort job takes a whole h100 machine; two checkpointable
//     1-GPU jobs run on the other;
//   - an XID on the first one's GPU: it migrates (gpu_unhealthy);
//     then a double-bit ECC error on that same GPU;
//   - an overheat on the second one's GPU: gpu_hot, the monitor's
//     drain_gpu, and it migrates (overheating);
//   - a critical 4-GPU job preempts the best-effort one (preempted);
//   - two whole-machine jobs in burst: one waits, the autoscaler scales
//     the pool up, both succeed, and it scales back down: the machine that
//     left raises nothing (no node_silent, no node_lost).
//
// Then every dashboard expression must answer with data, above 0 at some
// point of the scenario (the SBE panel aside: no fault makes single-bit
// errors); the counter panels must show each counted event (increase()
// over a series that started at 0); and exactly the alerts the faults
// cause must have fired: gpu_xid and gpu_ecc_dbe on the XID GPU, gpu_hot
// on the overheated one, none from the GPUs warming up under their jobs.
func TestPrometheusSeesTheScenario(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Prometheus and the whole platform")
	}
	prom, _ := prometheusTools(t)
	const burst = "burst"
	fl := &fleet.Fleet{
		MachineTypes: map[string]fleet.MachineType{"hgx-h100-4": {GPUModel: "H100-80GB", GPUCount: 4, NVLink: true}},
		Pools: []fleet.Pool{
			{Name: "h100", MachineType: "hgx-h100-4", Count: 2, Zone: "zone-a", PriceClass: cloud.OnDemand},
			{Name: burst, MachineType: "hgx-h100-4", Count: 0, Zone: "zone-a", PriceClass: cloud.OnDemand},
		},
	}
	s := startStack(t, fl, withScheduler(time.Second, time.Second), func(c *gpuplane.Config) {
		c.Autoscale = []gpuplane.AutoscalePool{{Name: burst, MachineType: "hgx-h100-4", PriceClass: cloud.OnDemand,
			Min: 1, Max: 2, ProvisionDelay: 500 * time.Millisecond, UpCooldown: time.Second,
			// Back down soon after the burst: a machine that leaves on
			// purpose takes its series with it and must raise nothing.
			DownCooldown: time.Second, IdleFor: 2 * time.Second}}
		c.Autoscaler = func(ac *autoscaler.Config) { ac.ActuateEvery = 250 * time.Millisecond }
	})
	h := s.watchHistory(t)
	ops := s.watchOps(t, burst)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	waitFor(t, 30*time.Second, "the burst pool at its minimum", func() (bool, string) {
		return len(ops.events(contracts.MachineReady)) >= 1, ops.summary()
	})

	metrics, err := url.Parse(s.ep.MetricsURL)
	if err != nil {
		t.Fatal(err)
	}
	// Beside the shipped rules, gpu_temp_rising as it was before its 80 °C
	// floor, under another name: the scenario's GPUs warming up under
	// their jobs must fire it, and not the shipped one.
	unflooredRules := filepath.Join(t.TempDir(), "unfloored.yaml")
	if err := os.WriteFile(unflooredRules, []byte(`groups:
  - name: before
    rules:
      - alert: gpu_temp_rising_unfloored
        expr: DCGM_FI_DEV_GPU_TEMP <= 85 and predict_linear(DCGM_FI_DEV_GPU_TEMP[2m], 300) > 85
        for: 30s
`), 0o644); err != nil {
		t.Fatal(err)
	}
	p := startPrometheus(t, prom, metrics.Host, filepath.Join(monitoringDir, "prometheus-rules.yaml"), unflooredRules)
	start := time.Now()
	// Barrier: Prometheus scrapes the monitor, and every counter the
	// scenario will move is there at 0 before its first event.
	zero := []string{
		`gpuplane_job_requeues_total{pool="h100",reason="gpu_unhealthy"}`,
		`gpuplane_job_requeues_total{pool="h100",reason="overheating"}`,
		`gpuplane_job_requeues_total{pool="h100",reason="preempted"}`,
		`gpuplane_preemptions_total{pool="h100"}`,
		`gpuplane_job_migrations_total{pool="h100",reason="gpu_unhealthy",event="migrating"}`,
		`gpuplane_job_migrations_total{pool="h100",reason="gpu_unhealthy",event="migrated"}`,
		`gpuplane_job_migrations_total{pool="h100",reason="overheating",event="migrating"}`,
		`gpuplane_job_migrations_total{pool="h100",reason="overheating",event="migrated"}`,
		`gpuplane_scale_decisions_total{pool="burst",direction="up"}`,
	}
	waitFor(t, 30*time.Second, "the scenario's counters at 0 in Prometheus", func() (bool, string) {
		for _, e := range zero {
			if v, ok := p.value(t, e); !ok || v != 0 {
				return false, fmt.Sprintf("%s: %v (present %v)", e, v, ok)
			}
		}
		return true, ""
	})

	one := func(id string, d time.Duration, checkpoint bool) contracts.JobRequest {
		return contracts.JobRequest{ID: id, Pool: "h100", Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB"}},
			Run: contracts.RunSpec{Duration: contracts.Duration(d), Checkpoint: checkpoint}}
	}
	// The burst pool: two whole machines' worth while it has one.
	for i := range 2 {
		s.submitJob(t, ctx, "acme", fourH100(fmt.Sprintf("burst-%d", i), burst, 8*time.Second, false))
	}
	beBig := fourH100("be-big", "h100", 10*time.Minute, false)
	beBig.Priority = contracts.PriorityBestEffort
	s.submitJob(t, ctx, "acme", beBig)
	big := h.awaitState(t, time.Minute, "acme/be-big", contracts.StateRunning)
	s.submitJob(t, ctx, "acme", one("xid-victim", 40*time.Second, true))
	s.submitJob(t, ctx, "globex", one("hot-victim", 40*time.Second, true))
	xidRun := h.awaitState(t, time.Minute, "acme/xid-victim", contracts.StateRunning)
	hotRun := h.awaitState(t, time.Minute, "globex/hot-victim", contracts.StateRunning)
	xidGPU, hotGPU := xidRun.Placement.Devices[0].UUID, hotRun.Placement.Devices[0].UUID
	// Barrier: Prometheus has seen the pool fragmented (two GPUs free
	// beside the victims, none on an idle machine) before the faults move
	// the victims onto them.
	waitFor(t, 30*time.Second, "h100 fragmented in Prometheus", func() (bool, string) {
		v, ok := p.value(t, `gpuplane_pool_fragmentation_ratio{pool="h100"}`)
		return ok && v > 0, fmt.Sprintf("%v (present %v)", v, ok)
	})

	injectFault(t, ctx, s, xidRun.Placement.NodeID, contracts.Fault{ID: "prom-xid", Kind: contracts.FaultXID, GPU: xidGPU, Code: contracts.DefaultFaultXID})
	h.await(t, time.Minute, "acme/xid-victim", "migrated", isType(contracts.EventMigrated, 2))
	injectFault(t, ctx, s, xidRun.Placement.NodeID, contracts.Fault{ID: "prom-dbe", Kind: contracts.FaultECCDBE, GPU: xidGPU})
	injectFault(t, ctx, s, hotRun.Placement.NodeID, contracts.Fault{ID: "prom-hot", Kind: contracts.FaultOverheat, GPU: hotGPU})
	h.await(t, time.Minute, "globex/hot-victim", "migrated", isType(contracts.EventMigrated, 2))

	s.submitJob(t, ctx, "initech", contracts.JobRequest{ID: "crit", Pool: "h100", Priority: contracts.PriorityCritical,
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 4, Model: "H100-80GB"}},
		Run:       contracts.RunSpec{Duration: contracts.Duration(2 * time.Second)}})
	if req := h.await(t, time.Minute, "acme/be-big", "requeued", isType(contracts.EventRequeued, 2)); req.Reason != contracts.ReasonPreempted {
		t.Errorf("be-big requeued with %s, want %s", req.Reason, contracts.ReasonPreempted)
	}
	h.awaitState(t, time.Minute, "initech/crit", contracts.StateSucceeded)
	for i := range 2 {
		h.awaitState(t, 90*time.Second, fmt.Sprintf("acme/burst-%d", i), contracts.StateSucceeded)
	}
	if len(ops.ups()) == 0 {
		t.Fatalf("no scale-up decision for %s: %s", burst, ops.summary())
	}
	waitFor(t, time.Minute, "the burst pool back at its minimum", func() (bool, string) {
		return len(ops.events(contracts.MachineDeleted)) >= 1, ops.summary()
	})
	for _, k := range []string{"acme/xid-victim", "globex/hot-victim"} {
		if ev, _ := h.last(k); ev.Placement != nil && slices.ContainsFunc(ev.Placement.Devices, func(d contracts.DeviceRef) bool {
			return d.UUID == xidGPU || d.UUID == hotGPU
		}) {
			t.Errorf("%s still on a faulty GPU: %+v", k, ev.Placement)
		}
	}
	t.Logf("scenario played in %s; machines: %s", time.Since(start).Round(time.Second), ops.summary())

	// Every counted event is in Prometheus, and increase() shows it:
	// each of these series was scraped at 0 before its event.
	counted := map[string]float64{
		`gpuplane_job_requeues_total{pool="h100",reason="gpu_unhealthy"}`:                     1,
		`gpuplane_job_requeues_total{pool="h100",reason="overheating"}`:                       1,
		`gpuplane_job_requeues_total{pool="h100",reason="preempted"}`:                         1,
		`gpuplane_preemptions_total{pool="h100"}`:                                             1,
		`gpuplane_job_migrations_total{pool="h100",reason="gpu_unhealthy",event="migrating"}`: 1,
		`gpuplane_job_migrations_total{pool="h100",reason="gpu_unhealthy",event="migrated"}`:  1,
		`gpuplane_job_migrations_total{pool="h100",reason="overheating",event="migrating"}`:   1,
		`gpuplane_job_migrations_total{pool="h100",reason="overheating",event="migrated"}`:    1,
		`sum(gpuplane_scale_decisions_total{pool="burst",direction="up"})`:                    float64(len(ops.ups())),
		`sum(gpuplane_machine_events_total{pool="burst",kind="ready"}) - 1`:                   1, // the minimum's machine was there before
		`sum(gpuplane_machine_events_total{pool="burst",kind="requested"}) - 1`:               1,
		`gpuplane_machine_events_total{pool="burst",kind="draining"}`:                         1,
		`gpuplane_machine_events_total{pool="burst",kind="deleted"}`:                          1,
		// The DBE's XID 48 came after the XID 79: the last XID.
		`count(DCGM_FI_DEV_XID_ERRORS{UUID="` + xidGPU + `"} == 48)`:      1,
		`count(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{UUID="` + xidGPU + `"} > 0)`: 1,
	}
	waitFor(t, 30*time.Second, "Prometheus to scrape the scenario's end", func() (bool, string) {
		for _, e := range slices.Sorted(maps.Keys(counted)) {
			if v, ok := p.value(t, e); !ok || v < counted[e] {
				return false, fmt.Sprintf("%s = %v (present %v), want %v", e, v, ok, counted[e])
			}
		}
		return true, ""
	})
	for _, e := range slices.Sorted(maps.Keys(counted)) {
		if !strings.HasPrefix(e, "gpuplane_") {
			continue
		}
		raw, _ := p.value(t, e)
		inc, ok := p.value(t, "increase("+e+"[5m])")
		if !ok || inc < raw-1e-9 {
			t.Errorf("increase(%s[5m]) = %v (present %v), want at least the %v events counted", e, inc, ok, raw)
		}
	}

	// No decision for h100, a pool with no scaling policy; every GPU
	// series carries dcgm-exporter's device and pci_bus_id.
	for _, e := range []string{`gpuplane_scale_decisions_total{pool="h100"}`,
		`DCGM_FI_DEV_GPU_UTIL{device!~"nvidia[0-9]+"}`, `DCGM_FI_DEV_GPU_UTIL{pci_bus_id!~"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}[.][0-9]"}`} {
		if ss, err := p.query(e, start, time.Second); err != nil || len(ss) > 0 {
			t.Errorf("%s: %d series (%v); want none", e, len(ss), err)
		}
	}

	// Every dashboard expression runs and answers with data, above 0 at
	// some point of the scenario.
	end := time.Now()
	maybeEmpty := map[string]string{
		"increase(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "no fault makes single-bit ECC errors (an odd one may come on a weak card)",
	}
	targets := dashboardTargets(t)
	var report []string
	for _, tg := range targets {
		expr := concrete(tg.expr)
		ss, err := p.query(expr, start, time.Second) // the scrape interval: every sample is seen
		if err != nil {
			t.Errorf("panel %q %s: %v", tg.panel, tg.refID, err)
			continue
		}
		most, n := 0.0, 0
		for _, s := range ss {
			for _, v := range s.Values {
				if !math.IsNaN(v) { // 0/0: a GPU off the bus reports no memory
					most = max(most, v)
					n++
				}
			}
		}
		report = append(report, fmt.Sprintf("%-40s %s: %d series, max %.4g", tg.panel, tg.refID, len(ss), most))
		why := ""
		for prefix, w := range maybeEmpty {
			if strings.HasPrefix(expr, prefix) {
				why = w
			}
		}
		if why == "" && (n == 0 || most <= 0) {
			t.Errorf("panel %q %s: %s: %d series, max %v over the scenario; want data above 0", tg.panel, tg.refID, expr, len(ss), most)
		}
	}
	t.Logf("%d dashboard expressions over %s:\n  %s", len(targets), end.Sub(start).Round(time.Second), strings.Join(report, "\n  "))

	// Before and after the 80 °C floor, in the same run: the GPUs warming
	// up under their jobs fire the rule without it (for: 30s, so this
	// waits for a warm-up of half a minute or more) ...
	firedFor := func(expr string) map[string]bool {
		ss, err := p.query(expr, start, time.Second) // the scrape interval: every sample is seen
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]bool{}
		for _, s := range ss {
			out[s.Metric["alertname"]+"/"+cmp.Or(s.Metric["UUID"], s.Metric["Hostname"], s.Metric["pool"], s.Metric["node"])] = true
		}
		return out
	}
	var unfloored map[string]bool
	waitFor(t, 90*time.Second, "the unfloored trend rule firing on a warm-up", func() (bool, string) {
		unfloored = firedFor(`ALERTS{alertname="gpu_temp_rising_unfloored",alertstate="firing"}`)
		return len(unfloored) > 0, ""
	})

	// ... while exactly the alerts the faults cause fired of the shipped
	// rules (ALERTS over the whole run), keyed by alert and GPU: no
	// gpu_temp_rising. A single-bit ECC warning is expected only where the
	// GPU's counter did rise.
	want := map[string]bool{"gpu_xid/" + xidGPU: true, "gpu_ecc_dbe/" + xidGPU: true, "gpu_hot/" + hotGPU: true}
	sbe, err := p.query(`increase(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL[5m]) > 0`, start, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range sbe {
		want["gpu_ecc_sbe_rising/"+s.Metric["UUID"]] = true
	}
	fired := firedFor(`ALERTS{alertstate="firing",alertname!="gpu_temp_rising_unfloored"}`)
	if !maps.Equal(want, fired) {
		t.Errorf("alerts fired %v; want exactly %v", slices.Sorted(maps.Keys(fired)), slices.Sorted(maps.Keys(want)))
	}
	t.Logf("after %s: alerts fired: %v; the trend rule without its floor fired for %d warming GPUs (be-big on %s)",
		time.Since(start).Round(time.Second), slices.Sorted(maps.Keys(fired)), len(unfloored), big.Placement.NodeID)

	// The active alerts Prometheus serves agree: the faults persist.
	var active struct {
		Data struct {
			Alerts []struct {
				Labels map[string]string `json:"labels"`
				State  string            `json:"state"`
			} `json:"alerts"`
		} `json:"data"`
	}
	resp, err := http.Get(p.url + "/api/v1/alerts")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(&active); err != nil {
		t.Fatal(err)
	}
	for _, a := range active.Data.Alerts {
		key := a.Labels["alertname"] + "/" + cmp.Or(a.Labels["UUID"], a.Labels["Hostname"], a.Labels["pool"], a.Labels["node"])
		if a.State == "firing" && !want[key] && a.Labels["alertname"] != "gpu_temp_rising_unfloored" {
			t.Errorf("active alert %s (%v) is none the scenario causes", key, a.Labels)
		}
	}
}
