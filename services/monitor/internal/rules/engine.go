// Package rules evaluates the monitor's alert rules over rolling windows of
// GPU telemetry and of the platform metrics the monitor samples (pool
// fragmentation and demand, node heartbeat age). It is pure: samples come
// in with their times, Evaluate takes the current time and returns the
// alerts that start or end, so tests drive it with no clock and no bus.
//
//	Ingest(machine, time, GPU samples) ──> rings per (series, metric)
//	   series: each GPU, its machine, its pool, the tenant holding it
//	IngestPool(pool, time, values), IngestNode(node, time, values) ──> the same rings
//	Evaluate(now) ──> []Transition (firing / resolved, one each per episode)
//
// Every series keeps one window.Ring per metric some rule (or the summary
// window) reads at its scope, sized for the longest window read and keeping
// only the bucket fields those rules' aggregations read (a ring read for
// its last value keeps no sum, min or max), so memory is fixed per series
// and ingest allocates nothing once a series exists.
//
// Episodes are numbered per rule and key; Restore rebuilds the numbering
// and the open episodes from the alerts already published, so a restarted
// monitor neither repeats an alert nor reuses an episode number.
//
// Alert state lives only as long as its series or its open episode: spot
// machines and scaled-down nodes come and go, and a monitor that kept the
// state of every GPU it ever saw would grow without bound. A key's state is
// dropped once its series is forgotten (no sample in any window) and no
// episode is open; the rule's episode floor keeps the highest number a
// dropped key used, and a key met again numbers its episodes above it, so
// an episode number (and with it an alert's message ID, and the decisions
// consumers key on it) is never reused. A key's numbers still increase, but
// need not be consecutive.
package rules

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/monitor/internal/window"
)

// SummaryWindow is the window of the utilisation every series keeps for
// metrics, whether or not a rule reads it.
const SummaryWindow = time.Minute

// Machine is where a telemetry message comes from.
type Machine struct {
	Node     string
	Hostname string
	Pool     string
}

// Engine holds the windows and the alert state. It is safe for concurrent
// use: a follower ingests while a ticker evaluates and scrapes read.
type Engine struct {
	mu    sync.Mutex
	res   time.Duration
	rules []Rule
	// ring[scope][metric] is the index of the metric's ring in a series of
	// that scope, -1 when no rule reads it; size[scope] the rings' buckets.
	ring [numScopes][numMetrics]int
	size [numScopes][]int
	// layout[scope] are the rings' layouts, in ring order: each keeps only
	// the bucket fields the rules (and the summary) reading it need.
	layout [numScopes][]*window.Layout
	// off[scope][i] is where ring i starts in a series' words, off[scope]
	// [len] how many words a series of the scope holds: one allocation per
	// series instead of one per ring and a slice of them.
	off    [numScopes][]int
	series [numScopes]map[string]*series
	// state[rule] by series key.
	state []map[string]*ruleState
	// floor[rule] is the highest episode of a key whose state was dropped:
	// a new state starts there, so no episode number is used twice.
	floor []int
	// span is the longest ring span: a series quiet for longer holds no
	// data and, with no open episode, is forgotten.
	span time.Duration
	// instant are the GPU rules that fire on one sample (the last value,
	// no hold time, no trend, no extra condition): a hot GPU, an XID, a
	// double-bit ECC error. A sample that newly meets one signals urgent,
	// so the monitor evaluates at once instead of at its next tick: these
	// alerts move jobs, and a second's wait is a second of a job on a
	// failing GPU.
	instant []int
	urgent  chan struct{}
}

const (
	numScopes  = 4
	numMetrics = 12
)

func scopeIndex(s Scope) int   { return slices.Index(scopes, s) }
func metricIndex(m Metric) int { return slices.Index(metrics, m) }

type series struct {
	// labels are the series' alert labels; nil for a GPU series, whose
	// labels gpu keeps in a struct a quarter of the map's size and
	// labelMap builds when a transition or an aggregate needs them: a
	// 10,000-machine fleet has 80,000 GPU series (issue 17).
	labels map[string]string
	gpu    *gpuLabels
	words  []uint64 // the rings, as Engine.off lays them out
	last   int64    // unix ns of the newest sample
	open   int      // episodes firing on this series
}

type gpuLabels struct {
	node, pool, hostname, uuid, model string
	index                             int
}

// labelMap returns the series' labels. A GPU series' map is new at each
// call.
func (s *series) labelMap() map[string]string {
	g := s.gpu
	if g == nil {
		return s.labels
	}
	return map[string]string{contracts.AlertLabelNode: g.node, contracts.AlertLabelPool: g.pool, "hostname": g.hostname,
		contracts.AlertLabelGPU: g.uuid, "gpu": strconv.Itoa(g.index), "model": g.model,
		contracts.AlertLabelScope: string(ScopeGPU)}
}

type ruleState struct {
	pendingSince time.Time
	firing       bool
	episode      int
	since        time.Time
	// orphanSince is the first evaluation that found the restored open
	// episode without its series: the series gets the engine's span to
	// report before the episode resolves for lack of data.
	orphanSince time.Time
}

// New returns an engine for cfg, which must be valid.
func New(cfg Config) (*Engine, error) { return newEngine(cfg, false) }

// newEngine is New; allFields keeps every bucket field in every ring, as
// the engine did before layouts: the reference the differential tests
// compare with.
func newEngine(cfg Config, allFields bool) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	e := &Engine{res: time.Duration(cfg.Resolution), rules: slices.Clone(cfg.Rules), urgent: make(chan struct{}, 1)}
	for i, r := range e.rules {
		if r.Scope == ScopeGPU && r.For == 0 && r.Trend == 0 && r.Agg == AggLast && len(r.While) == 0 &&
			metricIndex(r.Metric) < numTelemetryMetrics {
			e.instant = append(e.instant, i)
		}
	}
	spans := [numScopes][numMetrics]time.Duration{}
	fields := [numScopes][numMetrics]window.Fields{}
	for sc := range numScopes {
		spans[sc][metricIndex(MetricGPUUtil)] = SummaryWindow
		fields[sc][metricIndex(MetricGPUUtil)] = window.FieldSum // Utilisation's mean
		e.series[sc] = map[string]*series{}
	}
	for _, r := range e.rules {
		sc := scopeIndex(r.Scope)
		for _, metric := range append([]Metric{r.Metric}, conditionMetrics(r.While)...) {
			m := metricIndex(metric)
			spans[sc][m] = max(spans[sc][m], time.Duration(r.Window))
		}
		fields[sc][metricIndex(r.Metric)] |= ruleFields(&r)
		for _, c := range r.While {
			fields[sc][metricIndex(c.Metric)] |= window.FieldLast
		}
		e.state = append(e.state, map[string]*ruleState{})
		e.floor = append(e.floor, 0)
	}
	for sc := range numScopes {
		for m := range numMetrics {
			e.ring[sc][m] = -1
			if spans[sc][m] == 0 {
				continue
			}
			e.ring[sc][m] = len(e.size[sc])
			f := fields[sc][m]
			if allFields {
				f = window.FieldAll
			}
			e.layout[sc] = append(e.layout[sc], window.NewLayout(e.res, f))
			// One more bucket than the window reads: the slot of a sample
			// stamped a bucket ahead must not be the window's oldest.
			e.size[sc] = append(e.size[sc], window.Buckets(spans[sc][m], e.res)+2)
			e.span = max(e.span, spans[sc][m]+2*e.res)
		}
		e.off[sc] = []int{0}
		for ri, n := range e.size[sc] {
			e.off[sc] = append(e.off[sc], e.off[sc][ri]+e.layout[sc][ri].Words(n))
		}
	}
	return e, nil
}

// ringOf is ring ri of series s of scope index sc.
func (e *Engine) ringOf(sc int, s *series, ri int) window.Ring {
	return e.layout[sc][ri].View(s.words[e.off[sc][ri]:e.off[sc][ri+1]])
}

// ruleFields are the bucket fields of its metric's ring that aggregate
// reads for r.
func ruleFields(r *Rule) window.Fields {
	var f window.Fields
	if r.Trend > 0 {
		f |= window.FieldSum // the slope of the bucket means
	}
	switch r.Agg {
	case AggAvg:
		f |= window.FieldSum
	case AggMax:
		f |= window.FieldMax
	case AggMin:
		f |= window.FieldMin
	case AggLast:
		f |= window.FieldLast
	case AggIncrease:
		f |= window.FieldFirst | window.FieldLast
	}
	return f
}

// Kinds are the alert kinds the engine's rules raise, in rule order: the
// only alerts Restore takes.
func (e *Engine) Kinds() []string {
	out := make([]string, len(e.rules))
	for i, r := range e.rules {
		out[i] = r.Kind
	}
	return out
}

// Urgent signals that a sample newly met an instant rule: evaluate now.
func (e *Engine) Urgent() <-chan struct{} { return e.urgent }

// checkInstant signals urgent when sample values v of GPU series key meet
// an instant rule not firing for it. Called under e.mu.
func (e *Engine) checkInstant(key string, v *[numMetrics]float64) {
	for _, ri := range e.instant {
		r := &e.rules[ri]
		if !compare(r.Op, v[metricIndex(r.Metric)], r.Threshold) {
			continue
		}
		if st := e.state[ri][key]; st != nil && st.firing {
			continue
		}
		select {
		case e.urgent <- struct{}{}:
		default:
		}
		return
	}
}

// values reads every metric of a sample, in metrics order.
func values(s *contracts.GPUSample) [numMetrics]float64 {
	var v [numMetrics]float64
	v[0] = s.GPUUtil
	if total := s.FBUsedMiB + s.FBFreeMiB; total > 0 {
		v[1] = float64(s.FBUsedMiB) * 100 / float64(total)
	}
	v[2] = s.TempC
	v[3] = s.PowerW
	v[4] = float64(s.ECCSBE)
	v[5] = float64(s.ECCDBE)
	v[6] = float64(s.LastXID)
	if !s.Healthy {
		v[7] = 1
	}
	if s.ThrottleReasons&(contracts.ThrottleHWThermal|contracts.ThrottleSWThermal|contracts.ThrottleHWPowerBrake) != 0 {
		v[8] = 1
	}
	return v
}

// Ingest adds one telemetry message: the samples of m's GPUs taken at at.
// tenantOf, if not nil, names the tenant holding an allocation ID ("" when
// unknown); tenant windows only see GPUs it names. Ingest allocates only
// when it meets a series for the first time.
func (e *Engine) Ingest(m Machine, at time.Time, gpus []contracts.GPUSample, tenantOf func(allocationID string) string) {
	ns := at.UnixNano()
	e.mu.Lock()
	defer e.mu.Unlock()
	var node, pool *series
	if m.Node != "" {
		node = e.get(ScopeNode, m.Node, func() map[string]string {
			return map[string]string{contracts.AlertLabelNode: m.Node, contracts.AlertLabelPool: m.Pool, "hostname": m.Hostname}
		})
	}
	if m.Pool != "" {
		pool = e.get(ScopePool, m.Pool, func() map[string]string { return map[string]string{contracts.AlertLabelPool: m.Pool} })
	}
	for i := range gpus {
		s := &gpus[i]
		v := values(s)
		key := s.UUID
		if key == "" {
			key = m.Node + "/" + strconv.Itoa(s.Index)
		}
		g := e.get(ScopeGPU, key, nil)
		if g.gpu == nil {
			g.gpu = &gpuLabels{node: m.Node, pool: m.Pool, hostname: m.Hostname, uuid: s.UUID, model: s.Model, index: s.Index}
		}
		e.add(ScopeGPU, g, ns, &v)
		if len(e.instant) > 0 {
			e.checkInstant(key, &v)
		}
		if node != nil {
			e.add(ScopeNode, node, ns, &v)
		}
		if pool != nil {
			e.add(ScopePool, pool, ns, &v)
		}
		if tenantOf != nil && s.AllocationID != "" {
			if t := tenantOf(s.AllocationID); t != "" {
				e.add(ScopeTenant, e.get(ScopeTenant, t, func() map[string]string { return map[string]string{"tenant": t} }), ns, &v)
			}
		}
	}
}

// get returns the series of scope sc and key, made with the labels
// labels returns if new; labels is nil for a GPU series, whose caller sets
// its gpu labels.
func (e *Engine) get(sc Scope, key string, labels func() map[string]string) *series {
	i := scopeIndex(sc)
	s := e.series[i][key]
	if s == nil {
		s = &series{}
		if labels != nil {
			s.labels = labels()
			s.labels[contracts.AlertLabelScope] = string(sc)
		}
		s.words = make([]uint64, e.off[i][len(e.size[i])])
		// Episodes restored before the series reported are its own.
		for ri, r := range e.rules {
			if st := e.state[ri][key]; r.Scope == sc && st != nil && st.firing {
				s.open++
			}
		}
		e.series[i][key] = s
	}
	return s
}

// add puts a GPU sample's metrics in the series' rings; pool platform
// metrics are left to IngestPool.
func (e *Engine) add(sc Scope, s *series, ns int64, v *[numMetrics]float64) {
	i := scopeIndex(sc)
	for m, r := range e.ring[i][:numTelemetryMetrics] {
		if r >= 0 {
			e.ringOf(i, s, r).Add(ns, v[m])
		}
	}
	s.last = max(s.last, ns)
}

// PoolValues are a pool's platform metrics at one time.
type PoolValues struct {
	// FragmentationPct is the share of the pool's free GPU capacity not on
	// fully idle healthy machines, in % (readmodel.PoolCapacity).
	FragmentationPct float64
	// PendingJobs is how many jobs wait for the pool.
	PendingJobs float64
}

// IngestPool adds a pool's platform metrics taken at at, for the rules
// that read them. The monitor calls it before each evaluation, from its
// read model.
func (e *Engine) IngestPool(pool string, at time.Time, v PoolValues) {
	if pool == "" {
		return
	}
	ns := at.UnixNano()
	e.mu.Lock()
	defer e.mu.Unlock()
	idx := &e.ring[scopeIndex(ScopePool)]
	rf, rp := idx[metricIndex(MetricFragmentationPct)], idx[metricIndex(MetricPendingJobs)]
	if rf < 0 && rp < 0 {
		return // no rule reads them: keep no pool series alive for them
	}
	s := e.get(ScopePool, pool, func() map[string]string { return map[string]string{contracts.AlertLabelPool: pool} })
	if rf >= 0 {
		e.ringOf(scopeIndex(ScopePool), s, rf).Add(ns, v.FragmentationPct)
	}
	if rp >= 0 {
		e.ringOf(scopeIndex(ScopePool), s, rp).Add(ns, v.PendingJobs)
	}
	s.last = max(s.last, ns)
}

// NodeValues are a node's platform metrics at one time.
type NodeValues struct {
	// HeartbeatAge is how long ago the node's agent last sent a heartbeat.
	HeartbeatAge time.Duration
}

// IngestNode adds a node's platform metrics taken at at, for the rules
// that read them. The monitor calls it before each evaluation for every
// node it expects to hear from; a node it stops calling it for (one that
// left cleanly) has no sample left once the window passes, so a firing
// rule resolves and a pending one never fires. pool, when not empty,
// fills a pool label the series lacks (a node first met here, before its
// inventory was read).
func (e *Engine) IngestNode(node, pool string, at time.Time, v NodeValues) {
	if node == "" {
		return
	}
	ns := at.UnixNano()
	e.mu.Lock()
	defer e.mu.Unlock()
	r := e.ring[scopeIndex(ScopeNode)][metricIndex(MetricHeartbeatAge)]
	if r < 0 {
		return // no rule reads it: keep no node series alive for it
	}
	s := e.get(ScopeNode, node, func() map[string]string {
		return map[string]string{contracts.AlertLabelNode: node, contracts.AlertLabelPool: pool}
	})
	if pool != "" && s.labels[contracts.AlertLabelPool] == "" {
		// Copy, not update: transitions already returned share the map.
		labels := maps.Clone(s.labels)
		labels[contracts.AlertLabelPool] = pool
		s.labels = labels
	}
	e.ringOf(scopeIndex(ScopeNode), s, r).Add(ns, v.HeartbeatAge.Seconds())
	s.last = max(s.last, ns)
}

// Transition is an alert episode starting or ending.
type Transition struct {
	Kind     string
	Scope    Scope
	Key      string
	Episode  int
	State    contracts.AlertState
	Severity string
	Action   string
	Summary  string
	// Value is the aggregate (for a trend rule, the projected value) at the
	// transition; 0 when a series stopped reporting.
	Value  float64
	Since  time.Time // when the condition started to hold
	At     time.Time
	Labels map[string]string
}

// ID is the deterministic message ID of the transition's alert: one per
// rule, key, episode and state, so a republished alert is dropped.
func (t Transition) ID() string {
	return "alert/" + t.Kind + "/" + t.Key + "/" + strconv.Itoa(t.Episode) + "/" + string(t.State)
}

// Alert is the contracts message for the transition.
func (t Transition) Alert() contracts.Alert {
	labels := make(map[string]string, len(t.Labels)+2)
	for k, v := range t.Labels {
		if v != "" {
			labels[k] = v
		}
	}
	labels[contracts.AlertLabelEpisode] = strconv.Itoa(t.Episode)
	if t.Action != "" {
		labels[contracts.AlertLabelAction] = t.Action
	}
	msg := fmt.Sprintf("%s %s: %s (value %.4g)", t.Scope, t.Key, t.Summary, t.Value)
	if t.State == contracts.AlertResolved {
		msg = fmt.Sprintf("%s %s: resolved after %s: %s", t.Scope, t.Key, t.At.Sub(t.Since).Round(time.Millisecond), t.Summary)
	}
	return contracts.Alert{SchemaVersion: contracts.SchemaVersion, Kind: t.Kind, Key: t.Key, State: t.State,
		Severity: t.Severity, Labels: labels, Value: t.Value, Message: msg, Since: t.Since, Time: t.At}
}

// value is the rule's aggregate over its window and whether the rule
// holds; ok is false when the window holds no sample.
func (e *Engine) value(r *Rule, s *series, now int64) (v float64, holds, ok bool) {
	v, holds, ok = e.aggregate(r, s, now)
	for _, c := range r.While {
		if !holds {
			break
		}
		last, ok := e.ringOf(scopeIndex(r.Scope), s, e.ring[scopeIndex(r.Scope)][metricIndex(c.Metric)]).Last(now, time.Duration(r.Window))
		holds = ok && compare(c.Op, last, c.Threshold)
	}
	return v, holds, ok
}

// aggregate is value without the While conditions.
func (e *Engine) aggregate(r *Rule, s *series, now int64) (v float64, holds, ok bool) {
	sc := scopeIndex(r.Scope)
	ring := e.ringOf(sc, s, e.ring[sc][metricIndex(r.Metric)])
	// Fast paths: the bucket walks a rule without a trend needs.
	if r.Trend == 0 && (r.Agg == AggLast || r.Agg == AggIncrease) {
		if r.Agg == AggLast {
			v, ok = ring.Last(now, time.Duration(r.Window))
		} else {
			v, ok = ring.Increase(now, time.Duration(r.Window))
		}
		return v, ok && compare(r.Op, v, r.Threshold), ok
	}
	var st window.Stats
	if r.Trend > 0 {
		st = ring.StatsSlope(now, time.Duration(r.Window))
	} else {
		st = ring.Stats(now, time.Duration(r.Window))
	}
	if st.Count == 0 {
		return 0, false, false
	}
	switch r.Agg {
	case AggAvg:
		v = st.Mean()
	case AggMax:
		v = st.Max
	case AggMin:
		v = st.Min
	case AggLast:
		v = st.Last
	case AggIncrease:
		v = st.Last - st.First
	}
	if r.Trend == 0 {
		return v, compare(r.Op, v, r.Threshold), true
	}
	proj := v + st.Slope*time.Duration(r.Trend).Seconds()
	toward := st.Slope > 0
	if r.Op == OpLT || r.Op == OpLE {
		toward = st.Slope < 0
	}
	return proj, toward && !compare(r.Op, v, r.Threshold) && compare(r.Op, proj, r.Threshold), true
}

func compare(op Op, v, threshold float64) bool {
	switch op {
	case OpGT:
		return v > threshold
	case OpGE:
		return v >= threshold
	case OpLT:
		return v < threshold
	case OpLE:
		return v <= threshold
	}
	return false
}

// Evaluate checks every rule against every series at now and returns the
// episodes that start or end, sorted by kind then key: a rule that has held
// for its For fires once; a firing rule that no longer holds, or whose
// series has no sample left in its window, resolves once. Series with no
// sample in any window and no open episode are forgotten.
func (e *Engine) Evaluate(now time.Time) []Transition {
	ns := now.UnixNano()
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []Transition
	for ri := range e.rules {
		r := &e.rules[ri]
		states := e.state[ri]
		all := e.series[scopeIndex(r.Scope)]
		for key, s := range all {
			v, holds, _ := e.value(r, s, ns)
			st := states[key]
			switch {
			case holds && st == nil:
				st = &ruleState{episode: e.floor[ri]}
				states[key] = st
				fallthrough
			case holds && !st.firing:
				if st.pendingSince.IsZero() {
					st.pendingSince = now
				}
				if now.Sub(st.pendingSince) >= time.Duration(r.For) {
					st.firing, st.since = true, st.pendingSince
					st.episode++
					s.open++
					out = append(out, transition(r, key, st, contracts.AlertFiring, v, now, s.labelMap()))
				}
			case !holds && st != nil:
				st.pendingSince = time.Time{}
				if st.firing {
					st.firing = false
					s.open--
					out = append(out, transition(r, key, st, contracts.AlertResolved, v, now, s.labelMap()))
				}
			}
		}
		for key, st := range states {
			if _, ok := all[key]; ok {
				continue
			}
			if !st.firing {
				// The series was forgotten: no sample in any window, so
				// nothing pending either. Only the episode number
				// matters, and the floor keeps it.
				e.floor[ri] = max(e.floor[ri], st.episode)
				delete(states, key)
				continue
			}
			// An episode restored from the bus whose series never came
			// back: it resolves (once; the state goes at the next
			// evaluation).
			if st.orphanSince.IsZero() {
				st.orphanSince = now
			}
			if now.Sub(st.orphanSince) <= e.span {
				continue
			}
			st.firing, st.pendingSince = false, time.Time{}
			out = append(out, transition(r, key, st, contracts.AlertResolved, 0, now, map[string]string{
				contracts.AlertLabelScope: string(r.Scope)}))
		}
	}
	for sc := range numScopes {
		for key, s := range e.series[sc] {
			if s.open == 0 && ns-s.last > int64(e.span) {
				delete(e.series[sc], key)
			}
		}
	}
	slices.SortFunc(out, func(a, b Transition) int {
		return cmp.Or(cmp.Compare(a.Kind, b.Kind), cmp.Compare(a.Key, b.Key), cmp.Compare(a.State, b.State))
	})
	return out
}

func transition(r *Rule, key string, st *ruleState, state contracts.AlertState, v float64, now time.Time, labels map[string]string) Transition {
	return Transition{Kind: r.Kind, Scope: r.Scope, Key: key, Episode: st.episode, State: state, Severity: r.Severity,
		Action: r.Action, Summary: r.Summary, Value: v, Since: st.since, At: now, Labels: labels}
}

// Restore applies an alert published earlier (in stream order). It reports
// false for an alert of a kind no rule raises (another rule file, node
// silence, budgets), which it ignores. The episode counter never goes back;
// a firing alert reopens its episode, which resolves at the first
// evaluation where the rule does not hold.
func (e *Engine) Restore(a contracts.Alert) (bool, error) {
	ri := slices.IndexFunc(e.rules, func(r Rule) bool { return r.Kind == a.Kind })
	if ri < 0 {
		return false, nil
	}
	ep, err := strconv.Atoi(a.Labels[contracts.AlertLabelEpisode])
	if err != nil || ep < 1 {
		return true, fmt.Errorf("alert %s/%s has no valid %s label: %q", a.Kind, a.Key, contracts.AlertLabelEpisode,
			a.Labels[contracts.AlertLabelEpisode])
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	st := e.state[ri][a.Key]
	if st == nil {
		st = &ruleState{episode: e.floor[ri]}
		e.state[ri][a.Key] = st
	}
	if ep < st.episode {
		return true, nil
	}
	s := e.series[scopeIndex(e.rules[ri].Scope)][a.Key]
	if st.firing && s != nil {
		s.open--
	}
	st.episode, st.since, st.pendingSince = ep, a.Since, time.Time{}
	st.firing = a.State == contracts.AlertFiring
	if st.firing {
		st.pendingSince, st.orphanSince = a.Since, time.Time{}
		if s != nil {
			s.open++
		}
	}
	return true, nil
}

// Aggregate is one series' utilisation over SummaryWindow.
type Aggregate struct {
	Scope  Scope
	Key    string
	Labels map[string]string
	// Mean is the mean GPU utilisation (%) over the window and the series'
	// GPUs; Samples how many GPU samples it averages.
	Mean    float64
	Samples int
}

// Utilisation returns the mean GPU utilisation over SummaryWindow of every
// series of scope with a sample at or after freshSince, sorted by key: a
// silent machine's last minute is not shown as if it were the present.
func (e *Engine) Utilisation(now, freshSince time.Time, sc Scope) []Aggregate {
	e.mu.Lock()
	defer e.mu.Unlock()
	i := scopeIndex(sc)
	if i < 0 {
		return nil
	}
	ri := e.ring[i][metricIndex(MetricGPUUtil)]
	var out []Aggregate
	for key, s := range e.series[i] {
		if s.last < freshSince.UnixNano() {
			continue
		}
		st := e.ringOf(i, s, ri).Stats(now.UnixNano(), SummaryWindow)
		if st.Count > 0 {
			out = append(out, Aggregate{Scope: sc, Key: key, Labels: s.labelMap(), Mean: st.Mean(), Samples: st.Count})
		}
	}
	slices.SortFunc(out, func(a, b Aggregate) int { return cmp.Compare(a.Key, b.Key) })
	return out
}

// Firing counts the open episodes by kind, every rule's kind present.
func (e *Engine) Firing() map[string]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make(map[string]int, len(e.rules))
	for ri, r := range e.rules {
		n := 0
		for _, st := range e.state[ri] {
			if st.firing {
				n++
			}
		}
		out[r.Kind] = n
	}
	return out
}
