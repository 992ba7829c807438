package rules

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/gpuplane/gpuplane/contracts"
)

// Scope is what a rule's series is about.
type Scope string

const (
	ScopeGPU    Scope = "gpu"    // one GPU, keyed by UUID
	ScopeNode   Scope = "node"   // every GPU of a machine, keyed by node ID
	ScopePool   Scope = "pool"   // every GPU of a pool, keyed by pool name
	ScopeTenant Scope = "tenant" // every GPU a tenant's allocations hold, keyed by tenant
)

var scopes = []Scope{ScopeGPU, ScopeNode, ScopePool, ScopeTenant}

// Metric is the value of a GPU sample a rule watches.
type Metric string

const (
	MetricGPUUtil    Metric = "gpu_util"     // GPUSample.GPUUtil, %
	MetricMemUsedPct Metric = "mem_used_pct" // FBUsed/(FBUsed+FBFree), %
	MetricTempC      Metric = "temp_c"       // °C
	MetricPowerW     Metric = "power_w"      // W
	MetricECCSBE     Metric = "ecc_sbe"      // volatile single-bit ECC count
	MetricECCDBE     Metric = "ecc_dbe"      // volatile double-bit ECC count
	MetricXID        Metric = "xid"          // last XID, 0 when none
	MetricUnhealthy  Metric = "unhealthy"    // 1 when the agent marked the GPU unhealthy
	MetricThrottled  Metric = "throttled"    // 1 when thermal or power-brake throttled
	// Platform metrics of a pool, fed by IngestPool from the read model
	// (scope pool only), not by telemetry.
	MetricFragmentationPct Metric = "fragmentation_pct" // free capacity not on idle machines, % (see readmodel.PoolCapacity)
	MetricPendingJobs      Metric = "pending_jobs"      // jobs waiting for the pool, as the scheduler last said
	// MetricHeartbeatAge is a node metric fed by IngestNode (scope node
	// only): seconds since the node's agent last sent a heartbeat, sampled
	// at each evaluation while the node is expected to be alive.
	MetricHeartbeatAge Metric = "heartbeat_age_s"
)

var metrics = []Metric{MetricGPUUtil, MetricMemUsedPct, MetricTempC, MetricPowerW, MetricECCSBE,
	MetricECCDBE, MetricXID, MetricUnhealthy, MetricThrottled, MetricFragmentationPct, MetricPendingJobs,
	MetricHeartbeatAge}

// numTelemetryMetrics is how many metrics, first in metrics, come from GPU
// samples; the others are platform metrics, each of one scope.
const numTelemetryMetrics = 9

// platformScope is the only scope a platform metric may be read at: the
// monitor samples it for series of that scope alone.
var platformScope = map[Metric]Scope{
	MetricFragmentationPct: ScopePool,
	MetricPendingJobs:      ScopePool,
	MetricHeartbeatAge:     ScopeNode,
}

// Agg reduces a window to one value.
type Agg string

const (
	AggAvg      Agg = "avg"
	AggMax      Agg = "max"
	AggMin      Agg = "min"
	AggLast     Agg = "last"
	AggIncrease Agg = "increase" // last − first: for counters such as ECC
)

var aggs = []Agg{AggAvg, AggMax, AggMin, AggLast, AggIncrease}

// Op compares the aggregate with the threshold.
type Op string

const (
	OpGT Op = ">"
	OpGE Op = ">="
	OpLT Op = "<"
	OpLE Op = "<="
)

var ops = []Op{OpGT, OpGE, OpLT, OpLE}

// Actions a rule asks of the platform, carried in the alert's
// contracts.AlertLabelAction label.
const (
	ActionScaleUp      = contracts.AlertActionScaleUp
	ActionDrainGPU     = contracts.AlertActionDrainGPU
	ActionGPUUnhealthy = contracts.AlertActionGPUUnhealthy
	ActionDefragment   = contracts.AlertActionDefragment
)

// Duration is a time.Duration written as "90s" or "5m" in the file.
type Duration time.Duration

// UnmarshalText parses a Go duration.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// MarshalText writes the duration as Go does.
func (d Duration) MarshalText() ([]byte, error) { return []byte(time.Duration(d).String()), nil }

// Rule is one alert rule: the Agg of Metric over Window, for each series of
// Scope, compared with Threshold by Op; an alert of Kind fires once the
// comparison has held for For and resolves on the first evaluation where it
// no longer holds (or the series has no sample in Window).
//
// A trend rule (Trend > 0) warns before the threshold is crossed: it holds
// while the aggregate does not yet cross Threshold but the aggregate plus
// Window's slope times Trend does, that is when at the current rate the
// threshold would be crossed within Trend.
type Rule struct {
	Kind      string   `yaml:"kind" json:"kind"`
	Scope     Scope    `yaml:"scope" json:"scope"`
	Metric    Metric   `yaml:"metric" json:"metric"`
	Agg       Agg      `yaml:"agg" json:"agg"`
	Window    Duration `yaml:"window" json:"window"`
	Op        Op       `yaml:"op" json:"op"`
	Threshold float64  `yaml:"threshold" json:"threshold"`
	For       Duration `yaml:"for" json:"for"`
	Trend     Duration `yaml:"trend,omitempty" json:"trend,omitempty"`
	Severity  string   `yaml:"severity" json:"severity"`
	// Action is what the platform should do while the alert fires
	// (scale_up, drain_gpu, gpu_unhealthy); "" only informs.
	Action  string `yaml:"action,omitempty" json:"action,omitempty"`
	Summary string `yaml:"summary,omitempty" json:"summary,omitempty"`
	// While lists further conditions on the same series that must hold
	// too, each on the last value of its metric in Window: defragment only
	// while jobs wait.
	While []Condition `yaml:"while,omitempty" json:"while,omitempty"`
}

// Condition compares the last value of Metric with Threshold by Op.
type Condition struct {
	Metric    Metric  `yaml:"metric" json:"metric"`
	Op        Op      `yaml:"op" json:"op"`
	Threshold float64 `yaml:"threshold" json:"threshold"`
}

// Config is a rules file.
type Config struct {
	// Resolution is the width of a window bucket (default 5s): windows are
	// exact to one bucket.
	Resolution Duration `yaml:"resolution" json:"resolution"`
	Rules      []Rule   `yaml:"rules" json:"rules"`
}

// DefaultConfig returns the built-in rules, those of issue 4.
func DefaultConfig() Config {
	return Config{Resolution: Duration(5 * time.Second), Rules: []Rule{
		{Kind: "pool_util_high", Scope: ScopePool, Metric: MetricGPUUtil, Agg: AggAvg, Window: Duration(time.Minute),
			Op: OpGT, Threshold: 90, For: Duration(5 * time.Minute), Severity: "warning", Action: ActionScaleUp,
			Summary: "pool GPU utilisation above 90% for 5 minutes"},
		{Kind: "pool_fragmented", Scope: ScopePool, Metric: MetricFragmentationPct, Agg: AggLast, Window: Duration(5 * time.Second),
			Op: OpGT, Threshold: 30, For: Duration(time.Minute), Severity: "warning", Action: ActionDefragment,
			While:   []Condition{{Metric: MetricPendingJobs, Op: OpGT, Threshold: 0}},
			Summary: "over 30% of the pool's free GPU capacity is off idle machines while jobs wait: defragment"},
		// Three missed 2 s heartbeats, as the resource manager declares a
		// node lost (contracts/FLOWS.md, "Nodes"). A machine the autoscaler
		// deleted or the provider reclaimed is not expected to beat.
		{Kind: "node_lost", Scope: ScopeNode, Metric: MetricHeartbeatAge, Agg: AggLast, Window: Duration(5 * time.Second),
			Op: OpGE, Threshold: 6, Severity: "critical",
			Summary: "machine lost: no heartbeat for 3 intervals (6 s)"},
		{Kind: "gpu_memory_high", Scope: ScopeGPU, Metric: MetricMemUsedPct, Agg: AggLast, Window: Duration(5 * time.Second),
			Op: OpGT, Threshold: 90, For: Duration(time.Minute), Severity: "warning",
			Summary: "GPU memory above 90% for 1 minute"},
		{Kind: "gpu_hot", Scope: ScopeGPU, Metric: MetricTempC, Agg: AggLast, Window: Duration(5 * time.Second),
			Op: OpGT, Threshold: 85, Severity: "critical", Action: ActionDrainGPU,
			Summary: "GPU above 85 °C"},
		// A trend alone fires for every GPU warming up from idle (30 °C
		// climbing towards a working 70-76 °C projects far past 85 °C):
		// only a GPU already above 80 °C, still climbing for a minute,
		// is on its way to overheating.
		{Kind: "gpu_temp_rising", Scope: ScopeGPU, Metric: MetricTempC, Agg: AggLast, Window: Duration(2 * time.Minute),
			Op: OpGT, Threshold: 85, Trend: Duration(5 * time.Minute), For: Duration(time.Minute), Severity: "warning",
			While:   []Condition{{Metric: MetricTempC, Op: OpGT, Threshold: 80}},
			Summary: "GPU above 80 °C and on course to pass 85 °C within 5 minutes"},
		{Kind: "gpu_xid", Scope: ScopeGPU, Metric: MetricXID, Agg: AggLast, Window: Duration(5 * time.Second),
			Op: OpGT, Threshold: 0, Severity: "critical", Action: ActionGPUUnhealthy,
			Summary: "GPU raised an XID error"},
		{Kind: "gpu_ecc_dbe", Scope: ScopeGPU, Metric: MetricECCDBE, Agg: AggLast, Window: Duration(5 * time.Second),
			Op: OpGT, Threshold: 0, Severity: "critical", Action: ActionGPUUnhealthy,
			Summary: "GPU has double-bit ECC errors"},
		{Kind: "gpu_ecc_sbe_rising", Scope: ScopeGPU, Metric: MetricECCSBE, Agg: AggIncrease, Window: Duration(5 * time.Minute),
			Op: OpGT, Threshold: 0, Severity: "warning",
			Summary: "GPU single-bit ECC errors rising, often before double-bit ones"},
	}}
}

// Load reads a rules file, YAML or JSON (JSON is YAML), and validates it.
// Unknown fields are errors: a misspelt "threshhold" must not silently
// become 0.
func Load(path string) (Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("rules: %w", err)
	}
	cfg, err := Parse(b)
	if err != nil {
		return Config{}, fmt.Errorf("rules %s: %w", path, err)
	}
	return cfg, nil
}

// Parse decodes and validates a rules file's content.
func Parse(b []byte) (Config, error) {
	var cfg Config
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&cfg); err != nil {
		return Config{}, fmt.Errorf("decode: %w", err)
	}
	if cfg.Resolution == 0 {
		cfg.Resolution = Duration(5 * time.Second)
	}
	for i := range cfg.Rules {
		r := &cfg.Rules[i]
		if r.Agg == "" {
			r.Agg = AggLast
		}
		if r.Window == 0 {
			r.Window = cfg.Resolution
		}
		if r.Severity == "" {
			r.Severity = "warning"
		}
	}
	return cfg, cfg.Validate()
}

// ForeignKinds are the alert kinds other services publish on
// contracts.SubjectAlert (contracts/FLOWS.md): a rule may not raise one, or
// the monitor would take their alerts, replayed at start, for its own
// episodes and resolve an alert it never raised.
var ForeignKinds = []string{contracts.AlertKindSpotInterruption, contracts.AlertKindBudget}

// MaxWindow bounds a rule's window: a ring covering it is kept per series.
const MaxWindow = time.Hour

// Validate reports every problem at once.
func (c Config) Validate() error {
	var errs []error
	res := time.Duration(c.Resolution)
	if res < time.Millisecond || res > time.Minute {
		errs = append(errs, fmt.Errorf("resolution %s: want 1ms to 1m", res))
	}
	kinds := map[string]bool{}
	for i, r := range c.Rules {
		bad := func(format string, a ...any) {
			errs = append(errs, fmt.Errorf("rule %d (%q): %s", i, r.Kind, fmt.Sprintf(format, a...)))
		}
		switch {
		case r.Kind == "":
			bad("kind is empty")
		case strings.ContainsAny(r.Kind, ".*> \t/"):
			bad("kind must be one subject token, no '.', '*', '>', '/' or space")
		case kinds[r.Kind]:
			bad("kind is used by another rule")
		case slices.Contains(ForeignKinds, r.Kind):
			bad("kind is raised by another service on the same subject")
		}
		kinds[r.Kind] = true
		if !slices.Contains(scopes, r.Scope) {
			bad("scope %q: want one of %v", r.Scope, scopes)
		}
		if !slices.Contains(metrics, r.Metric) {
			bad("metric %q: want one of %v", r.Metric, metrics)
		}
		for _, c := range r.While {
			if !slices.Contains(metrics, c.Metric) {
				bad("while metric %q: want one of %v", c.Metric, metrics)
			}
			if !slices.Contains(ops, c.Op) {
				bad("while op %q: want one of %v", c.Op, ops)
			}
		}
		for _, m := range append([]Metric{r.Metric}, conditionMetrics(r.While)...) {
			if sc, ok := platformScope[m]; ok && r.Scope != sc {
				bad("metric %q is a %s metric: want scope %s", m, sc, sc)
			}
		}
		if !slices.Contains(aggs, r.Agg) {
			bad("agg %q: want one of %v", r.Agg, aggs)
		}
		if !slices.Contains(ops, r.Op) {
			bad("op %q: want one of %v", r.Op, ops)
		}
		if w := time.Duration(r.Window); w <= 0 || w > MaxWindow {
			bad("window %s: want > 0 and <= %s", w, MaxWindow)
		}
		if r.For < 0 || r.Trend < 0 {
			bad("for and trend must not be negative")
		}
		if r.Trend > 0 && time.Duration(r.Window) < 2*res {
			bad("a trend needs a window of at least two buckets (%s)", 2*res)
		}
	}
	return errors.Join(errs...)
}

func conditionMetrics(cs []Condition) []Metric {
	out := make([]Metric, 0, len(cs))
	for _, c := range cs {
		out = append(out, c.Metric)
	}
	return out
}
