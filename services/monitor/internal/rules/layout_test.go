package rules

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/monitor/internal/window"
)

// TestLayoutsDecideAsEveryField runs random rule sets (every scope,
// metric, aggregation and op, windows and trends of several widths, while
// conditions) over random fleets whose telemetry moves, jumps, arrives
// late and stops, on two engines: one whose rings keep only the fields the
// rules read, one whose rings keep every field as the engine did before
// layouts. Every evaluation must return the same transitions (values
// included, bit for bit) and every scope the same utilisation.
func TestLayoutsDecideAsEveryField(t *testing.T) {
	rng := rand.New(rand.NewPCG(17, 17))
	decided, leanRings := 0, 0
	for trial := range 50 {
		cfg := randomConfig(rng)
		lean, err := New(cfg)
		if err != nil {
			t.Fatalf("trial %d: New: %v", trial, err)
		}
		full, err := newEngine(cfg, true)
		if err != nil {
			t.Fatalf("trial %d: newEngine: %v", trial, err)
		}
		for sc := range numScopes {
			for _, l := range lean.layout[sc] {
				if l.Fields() != window.FieldAll {
					leanRings++
				}
			}
		}
		fleet := 1 + rng.IntN(4)
		gpus := make([][]contracts.GPUSample, fleet)
		for m := range gpus {
			for i := range 1 + rng.IntN(3) {
				gpus[m] = append(gpus[m], contracts.GPUSample{Index: i, UUID: fmt.Sprintf("GPU-%d-%d", m, i), Model: "H100",
					AllocationID: fmt.Sprintf("a%d", rng.IntN(3))})
			}
		}
		tenantOf := func(id string) string { return map[string]string{"a0": "t0", "a1": "t1"}[id] }
		now := t0
		transitions := 0
		for step := range 300 {
			now = now.Add(time.Duration(rng.IntN(3000)) * time.Millisecond)
			if rng.IntN(50) == 0 {
				now = now.Add(time.Duration(rng.IntN(200)) * time.Second) // a silence
			}
			for m := range gpus {
				if rng.IntN(4) == 0 {
					continue // this machine is quiet this step
				}
				for i := range gpus[m] {
					randomSample(rng, &gpus[m][i], step)
				}
				// Samples may be stamped a little late or early.
				at := now.Add(time.Duration(rng.IntN(12000)-8000) * time.Millisecond)
				mach := Machine{Node: fmt.Sprintf("n%d", m), Hostname: fmt.Sprintf("h%d", m), Pool: fmt.Sprintf("p%d", m%2)}
				beat := rng.IntN(2) == 0
				age := NodeValues{HeartbeatAge: time.Duration(rng.IntN(12)) * time.Second}
				for _, e := range []*Engine{lean, full} {
					e.Ingest(mach, at, gpus[m], tenantOf)
					if beat {
						e.IngestNode(mach.Node, mach.Pool, at, age)
					}
				}
			}
			pv := PoolValues{FragmentationPct: float64(rng.IntN(100)), PendingJobs: float64(rng.IntN(3))}
			lean.IngestPool("p0", now, pv)
			full.IngestPool("p0", now, pv)
			got, want := lean.Evaluate(now), full.Evaluate(now)
			transitions += len(want)
			if diff := cmp.Diff(want, got); diff != "" {
				t.Fatalf("trial %d step %d: rules %+v: transitions differ (-every field +layouts):\n%s", trial, step, cfg, diff)
			}
			for _, sc := range scopes {
				fresh := now.Add(-time.Duration(rng.IntN(60)) * time.Second)
				if diff := cmp.Diff(full.Utilisation(now, fresh, sc), lean.Utilisation(now, fresh, sc)); diff != "" {
					t.Fatalf("trial %d step %d: %s utilisation differs:\n%s", trial, step, sc, diff)
				}
			}
		}
		if transitions > 0 {
			decided++
		}
	}
	// Random rules on random data often never fire; most trials must.
	if decided < 35 || leanRings == 0 {
		t.Errorf("%d trials of 50 saw a transition, %d rings kept fewer fields: the test compares too little", decided, leanRings)
	}
}

var windows = []time.Duration{time.Second, 5 * time.Second, 10 * time.Second, 30 * time.Second, time.Minute, 5 * time.Minute}

func randomConfig(rng *rand.Rand) Config {
	res := []time.Duration{time.Second, 5 * time.Second}[rng.IntN(2)]
	cfg := Config{Resolution: Duration(res)}
	for i := range 1 + rng.IntN(8) {
		r := Rule{Kind: fmt.Sprintf("k%d", i), Scope: scopes[rng.IntN(len(scopes))], Agg: aggs[rng.IntN(len(aggs))],
			Window: Duration(windows[rng.IntN(len(windows))]), Op: ops[rng.IntN(len(ops))], Severity: "warning"}
		if rng.IntN(3) == 0 {
			r.For = Duration(time.Duration(rng.IntN(20)) * time.Second)
		}
		if rng.IntN(3) == 0 && time.Duration(r.Window) >= 2*res {
			r.Trend = Duration(time.Duration(1+rng.IntN(300)) * time.Second)
		}
		r.Metric, r.Threshold = randomMetric(rng, r.Scope)
		for range rng.IntN(3) {
			m, th := randomMetric(rng, r.Scope)
			r.While = append(r.While, Condition{Metric: m, Op: ops[rng.IntN(len(ops))], Threshold: th})
		}
		cfg.Rules = append(cfg.Rules, r)
	}
	return cfg
}

// randomMetric is a metric that may be read at scope and a threshold in
// its range.
func randomMetric(rng *rand.Rand, sc Scope) (Metric, float64) {
	ms := slices.DeleteFunc(slices.Clone(metrics), func(m Metric) bool {
		ps, ok := platformScope[m]
		return ok && ps != sc
	})
	m := ms[rng.IntN(len(ms))]
	switch m {
	case MetricECCSBE, MetricECCDBE:
		return m, float64(rng.IntN(4))
	case MetricXID, MetricUnhealthy, MetricThrottled, MetricPendingJobs:
		return m, float64(rng.IntN(2))
	case MetricHeartbeatAge:
		return m, float64(rng.IntN(10))
	}
	return m, float64(rng.IntN(100))
}

// randomSample moves a GPU's readings: random walks for gauges, rising
// counters, flags now and then.
func randomSample(rng *rand.Rand, s *contracts.GPUSample, step int) {
	s.GPUUtil = min(100, max(0, s.GPUUtil+float64(rng.IntN(41)-20)))
	s.TempC = min(95, max(25, s.TempC+float64(rng.IntN(7)-3)+float64(rng.IntN(100))/100))
	s.PowerW = float64(100 + rng.IntN(600))
	s.FBUsedMiB = int64(rng.IntN(80000))
	s.FBFreeMiB = 80000 - s.FBUsedMiB
	if rng.IntN(10) == 0 {
		s.ECCSBE += int64(rng.IntN(3))
	}
	if rng.IntN(100) == 0 {
		s.ECCDBE++
	}
	s.LastXID = 0
	if rng.IntN(30) == 0 {
		s.LastXID = []int{13, 48, 79}[rng.IntN(3)]
	}
	s.Healthy = rng.IntN(20) != 0
	s.ThrottleReasons = 0
	if rng.IntN(15) == 0 {
		s.ThrottleReasons = contracts.ThrottleHWThermal
	}
	_ = step
}

// TestDefaultLayouts pins what the default rules' rings keep: the figures
// the monitor's memory per machine rests on.
func TestDefaultLayouts(t *testing.T) {
	e, err := New(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	want := map[Scope]map[Metric]window.Fields{
		ScopeGPU: {MetricGPUUtil: window.FieldSum, MetricMemUsedPct: window.FieldLast,
			MetricTempC: window.FieldSum | window.FieldLast, MetricECCSBE: window.FieldFirst | window.FieldLast,
			MetricECCDBE: window.FieldLast, MetricXID: window.FieldLast},
		ScopeNode:   {MetricGPUUtil: window.FieldSum, MetricHeartbeatAge: window.FieldLast},
		ScopePool:   {MetricGPUUtil: window.FieldSum, MetricFragmentationPct: window.FieldLast, MetricPendingJobs: window.FieldLast},
		ScopeTenant: {MetricGPUUtil: window.FieldSum},
	}
	for sc, metricsWant := range want {
		got := map[Metric]window.Fields{}
		for m, ri := range e.ring[scopeIndex(sc)] {
			if ri >= 0 {
				got[metrics[m]] = e.layout[scopeIndex(sc)][ri].Fields()
			}
		}
		if diff := cmp.Diff(metricsWant, got); diff != "" {
			t.Errorf("%s rings (-want +got):\n%s", sc, diff)
		}
	}
}
