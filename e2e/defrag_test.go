package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	"github.com/gpuplane/gpuplane/services/monitor"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// The defragmentation end-to-end test (issue 4: a fragmentation alert
// consolidates small jobs to free a whole machine, only when that lets a
// pending job start). It runs the monitor on deploy/monitoring/rules.yaml
// with pool_fragmented's minute (For: 1m) cut to two seconds.

// fragmentedAlert is the monitor's rule kind whose action is defragment.
const fragmentedAlert = "pool_fragmented"

// defragFleet is three pools of two 4×H100 machines (nodes <pool>-01 and
// <pool>-02): dense, where consolidation frees a machine; tight, where it
// cannot (the moved jobs would not fit elsewhere); quiet, fragmented but
// with nothing waiting.
func defragFleet() *fleet.Fleet {
	f := &fleet.Fleet{MachineTypes: map[string]fleet.MachineType{
		"hgx-h100-4": {GPUModel: "H100-80GB", GPUCount: 4, NVLink: true},
	}}
	for _, p := range []string{"dense", "tight", "quiet"} {
		f.Pools = append(f.Pools, fleet.Pool{Name: p, MachineType: "hgx-h100-4", Count: 2, Zone: "zone-a", PriceClass: "on-demand"})
	}
	return f
}

// withFastFragmentationAlert runs the monitor on the shipped rules file
// with pool_fragmented holding for 2 s instead of a minute.
func withFastFragmentationAlert(t testing.TB) func(*gpuplane.Config) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "deploy", "monitoring", "rules.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	const minute = `kind: pool_fragmented, scope: pool, metric: fragmentation_pct, agg: last, window: 5s, op: ">", threshold: 30, for: 1m,`
	if !bytes.Contains(b, []byte(minute)) {
		t.Fatalf("rules.yaml has no pool_fragmented rule written as %q", minute)
	}
	b = bytes.Replace(b, []byte(minute), []byte(strings.Replace(minute, "for: 1m", "for: 2s", 1)), 1)
	file := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(file, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return func(c *gpuplane.Config) {
		c.Monitor = func(mc *monitor.Config) { mc.RulesFile = file }
	}
}

// alertLog follows one alert kind on OPS.
type alertLog struct {
	mu     sync.Mutex
	alerts []contracts.Alert
}

func (s *stack) watchAlerts(t testing.TB, kind string) *alertLog {
	t.Helper()
	l := &alertLog{}
	s.tail(t, contracts.StreamOps, []string{contracts.SubjectAlert(kind)}, func(m jetstream.Msg) {
		var a contracts.Alert
		if json.Unmarshal(m.Data(), &a) != nil {
			return
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		l.alerts = append(l.alerts, a)
	})
	return l
}

// firing is the first firing alert about pool, if any.
func (l *alertLog) firing(pool string) (contracts.Alert, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, a := range l.alerts {
		if a.State == contracts.AlertFiring && a.Labels[contracts.AlertLabelPool] == pool {
			return a, true
		}
	}
	return contracts.Alert{}, false
}

// summary lists the alerts, for failure messages.
func (l *alertLog) summary() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, a := range l.alerts {
		out = append(out, fmt.Sprintf("%s %s %s (%s, %g)", a.Kind, a.Key, a.State, a.Labels[contracts.AlertLabelAction], a.Value))
	}
	return strings.Join(out, ", ")
}

// oneGPU is a simulated checkpointable job of one H100 in pool.
func oneGPU(id, pool string, d time.Duration) contracts.JobRequest {
	return contracts.JobRequest{ID: id, Pool: pool,
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB"}},
		Run:       contracts.RunSpec{Duration: contracts.Duration(d), Checkpoint: true}}
}

// TestDefragConsolidatesSmallJobsForAWholeMachine spreads 1-GPU jobs over
// the two machines of each pool, then submits a whole-machine job to
// dense and to tight:
//   - dense (2+2 small jobs): 4 GPUs are free but no machine has 4. Once
//     pool_fragmented fires, the small jobs of one machine (at most 4)
//     are moved to the other (migrating and migrated, reason defragment,
//     restoring their checkpoints) and the big job starts on the machine
//     freed; every small job still succeeds.
//   - tight (2+3): the alert fires too, but moving either machine's jobs
//     would not leave them room elsewhere (3 GPUs free in all), so nothing
//     moves while the big job waits.
//   - quiet (1+1, nothing waiting): the alert never fires, nothing moves.
//
// The small jobs of tight and quiet run far longer than the test and are
// cancelled at its end: one of them ending on its own would make
// consolidation possible in tight (and the scheduler rightly take it).
// The oracle then finds no GPU given twice and no job lost.
func TestDefragConsolidatesSmallJobsForAWholeMachine(t *testing.T) {
	// -min-runtime short, so the age of the small jobs never decides.
	s := startStack(t, defragFleet(), withScheduler(time.Second, 2*time.Second), withFastFragmentationAlert(t))
	h := s.watchHistory(t)
	alerts := s.watchAlerts(t, fragmentedAlert)
	t.Cleanup(func() {
		if t.Failed() {
			for _, key := range []string{"initech/dense-big", "acme/d-1", "acme/d-2", "acme/d-3", "acme/d-4"} {
				t.Logf("%s:\n%s", key, describeEvents(h.of(key)))
			}
			t.Logf("alerts: %s", alerts.summary())
			for _, r := range s.allocations(t).refusals {
				t.Logf("refused: %+v", r)
			}
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	// Spread, so the small jobs land on both machines of each pool.
	for _, pool := range []string{"dense", "tight", "quiet"} {
		var doc contracts.PoolDoc
		if code, b := s.callAPI(t, http.MethodPut, "/v1/pools/"+pool, contracts.PoolConfig{Policy: contracts.PolicySpread}, &doc); code != http.StatusOK ||
			doc.Config == nil || doc.Config.Policy != contracts.PolicySpread {
			t.Fatalf("PUT pool %s: %d %s", pool, code, b)
		}
	}

	// dense's small jobs must outlive the big job's wait until moving
	// them is worth it (two 1-GPU moves cost 2 × 30 s of GPU time: the
	// 4-GPU job must have waited 15 s) by more than the 30 s a restart
	// costs (a job about to end is waited for, not moved), and end in the
	// test's time (their checkpoints carry their progress over the move);
	// the others only end when cancelled.
	const smallLen, foreverLen = 75 * time.Second, time.Hour
	small := map[string][]string{ // pool -> job IDs, tenant acme
		"dense": {"d-1", "d-2", "d-3", "d-4"},
		"tight": {"t-1", "t-2", "t-3", "t-4", "t-5"},
		"quiet": {"q-1", "q-2"},
	}
	pools := []string{"dense", "tight", "quiet"}
	for _, pool := range pools {
		for _, id := range small[pool] {
			d := foreverLen
			if pool == "dense" {
				d = smallLen
			}
			s.submitJob(t, ctx, "acme", oneGPU(id, pool, d))
		}
	}
	perNode := map[string][]string{} // node -> jobs of attempt 1
	for _, pool := range pools {
		for _, id := range small[pool] {
			ev := h.awaitState(t, time.Minute, "acme/"+id, contracts.StateRunning)
			if ev.Placement == nil || ev.Attempt != 1 {
				t.Fatalf("acme/%s running as %+v attempt %d", id, ev.Placement, ev.Attempt)
			}
			perNode[ev.Placement.NodeID] = append(perNode[ev.Placement.NodeID], id)
		}
	}
	layout := func(pool string) []int {
		out := []int{len(perNode[pool+"-01"]), len(perNode[pool+"-02"])}
		slices.Sort(out)
		return out
	}
	for pool, want := range map[string][]int{"dense": {2, 2}, "tight": {2, 3}, "quiet": {1, 1}} {
		if got := layout(pool); !slices.Equal(got, want) {
			t.Fatalf("pool %s: small jobs per machine %v (%v), want %v under spread", pool, got, perNode, want)
		}
	}

	big := func(id, pool string) contracts.JobRequest {
		return contracts.JobRequest{ID: id, Pool: pool,
			Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 4, Model: "H100-80GB"}},
			Run:       contracts.RunSpec{Duration: contracts.Duration(3 * time.Second)}}
	}
	s.submitJob(t, ctx, "initech", big("dense-big", "dense"))
	s.submitJob(t, ctx, "initech", big("tight-big", "tight"))

	// dense: the alert fires, the jobs of one machine move, the big job
	// gets that machine.
	sched := h.await(t, 2*time.Minute, "initech/dense-big", "scheduled", isType(contracts.EventScheduled, 1))
	fired, ok := alerts.firing("dense")
	if !ok {
		t.Fatalf("dense-big scheduled with no %s alert for dense: %s", fragmentedAlert, alerts.summary())
	}
	if fired.Labels[contracts.AlertLabelAction] != contracts.AlertActionDefragment {
		t.Errorf("alert %+v: want action %s", fired, contracts.AlertActionDefragment)
	}
	if sched.Placement == nil || len(sched.Placement.Devices) != 4 {
		t.Fatalf("dense-big scheduled as %+v", sched.Placement)
	}
	freed := sched.Placement.NodeID
	var moved []string
	for _, id := range small["dense"] {
		if h.count("acme/"+id, contracts.EventMigrating) > 0 {
			moved = append(moved, id)
		}
	}
	// The moved jobs are exactly those that were on the machine the big
	// job got: no more (a move that frees nothing is progress lost for
	// nothing), no fewer (the GPUs would be given twice).
	want := slices.Clone(perNode[freed])
	slices.Sort(want)
	if !slices.Equal(moved, want) || len(moved) == 0 || len(moved) > 4 {
		t.Fatalf("moved %v for dense-big on %s, want the jobs there: %v (1 to 4 of them)", moved, freed, want)
	}
	for _, id := range moved {
		key := "acme/" + id
		mig := h.await(t, 10*time.Second, key, "migrating", isType(contracts.EventMigrating, 1))
		if mig.Reason != contracts.ReasonDefragment || mig.Migration == nil || mig.Migration.Reason != contracts.ReasonDefragment ||
			!mig.Migration.Checkpoint || mig.Migration.FromAttempt != 1 {
			t.Errorf("%s migrating with %s %+v, want reason %s, a checkpoint asked, from attempt 1",
				key, mig.Reason, mig.Migration, contracts.ReasonDefragment)
		}
		// The move followed the alert (times are ordered, not measured).
		if mig.Time.Before(fired.Time) {
			t.Errorf("%s migrating at %s, before the alert fired at %s", key, mig.Time, fired.Time)
		}
		done := h.await(t, time.Minute, key, "migrated", isType(contracts.EventMigrated, 2))
		if done.Reason != contracts.ReasonDefragment || done.Migration == nil || done.Migration.RestoredFrom == "" {
			t.Errorf("%s migrated with %s %+v, want reason %s restoring a checkpoint", key, done.Reason, done.Migration, contracts.ReasonDefragment)
		}
		run := h.await(t, time.Minute, key, "running again", isType(contracts.EventRunning, 2))
		if run.Placement == nil || run.Placement.NodeID == freed || run.Placement.Pool != "dense" {
			t.Errorf("%s attempt 2 runs on %+v, want dense's other machine (not %s)", key, run.Placement, freed)
		}
	}
	h.awaitState(t, time.Minute, "initech/dense-big", contracts.StateSucceeded)

	// tight's alert fired too, and the scheduler has gone through many
	// cycles since (every move above made some): by the time dense's
	// small jobs are done, a move in tight would have happened.
	alerts.await(t, "tight")
	// quiet is as fragmented as the others (its free GPUs are all beside
	// running work) but nothing waits for it: that alone keeps its alert
	// off.
	waitFor(t, 30*time.Second, "quiet fragmented with nothing pending on /metrics", func() (bool, string) {
		frag, ok1 := s.poolGauge(t, "gpuplane_pool_fragmentation_ratio", "quiet")
		pend, ok2 := s.poolGauge(t, "gpuplane_pool_pending_jobs", "quiet")
		return ok1 && ok2 && frag == 1 && pend == 0, fmt.Sprintf("fragmentation %g (%t), pending %g (%t)", frag, ok1, pend, ok2)
	})
	for _, id := range small["dense"] {
		end := h.awaitState(t, 3*time.Minute, "acme/"+id, contracts.StateSucceeded)
		if want := 1 + btoi(slices.Contains(moved, id)); end.Attempt != want {
			t.Errorf("acme/%s ended at attempt %d, want %d: %s", id, end.Attempt, want, h.types("acme/"+id))
		}
		if !slices.Contains(moved, id) && h.count("acme/"+id, contracts.EventMigrating) != 0 {
			t.Errorf("acme/%s was moved, though not on %s: %s", id, freed, h.types("acme/"+id))
		}
	}
	// Nothing waits in tight or quiet any more once cancelled; every job
	// there ends at its first attempt, never moved, and tight-big never
	// got GPUs.
	cancelJob := func(tenant, id string) {
		t.Helper()
		if code, b := s.callAPI(t, http.MethodDelete, "/v1/tenants/"+tenant+"/jobs/"+id+"?reason=e2e+done", nil, nil); code != http.StatusAccepted {
			t.Fatalf("cancel %s/%s: %d %s", tenant, id, code, b)
		}
	}
	cancelJob("initech", "tight-big")
	h.awaitState(t, time.Minute, "initech/tight-big", contracts.StateCancelled)
	if n := h.count("initech/tight-big", contracts.EventScheduled); n != 0 {
		t.Errorf("tight-big was scheduled: %s", h.types("initech/tight-big"))
	}
	for _, pool := range []string{"tight", "quiet"} {
		for _, id := range small[pool] {
			cancelJob("acme", id)
			end := h.awaitState(t, time.Minute, "acme/"+id, contracts.StateCancelled)
			if end.Attempt != 1 || h.count("acme/"+id, contracts.EventMigrating) != 0 {
				t.Errorf("acme/%s in %s was moved: %s", id, pool, h.types("acme/"+id))
			}
		}
	}
	if a, ok := alerts.firing("quiet"); ok {
		t.Errorf("%s fired for quiet with nothing waiting: %+v", fragmentedAlert, a)
	}
	t.Logf("alerts: %s; dense-big on %s after moving %v", alerts.summary(), freed, moved)

	s.checkOracle(t)
	// A moved job's next attempt is planned once its last attempt is
	// released, and every node was known before the first plan: nothing
	// here has a reason to be refused.
	for _, r := range s.allocations(t).refusals {
		t.Errorf("the resource manager refused %+v", r)
	}
}

// await waits for pool's first firing alert.
func (l *alertLog) await(t testing.TB, pool string) contracts.Alert {
	t.Helper()
	var a contracts.Alert
	waitFor(t, time.Minute, fragmentedAlert+" firing for "+pool, func() (bool, string) {
		var ok bool
		a, ok = l.firing(pool)
		return ok, l.summary()
	})
	return a
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// poolGauge reads the monitor's gauge name for pool from /metrics.
func (s *stack) poolGauge(t testing.TB, name, pool string) (float64, bool) {
	t.Helper()
	resp, err := http.Get(s.ep.MetricsURL)
	if err != nil {
		t.Fatalf("metrics: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("metrics: %d %v", resp.StatusCode, err)
	}
	prefix := name + `{pool="` + pool + `"} `
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), prefix); ok {
			f, err := strconv.ParseFloat(v, 64)
			return f, err == nil
		}
	}
	return 0, false
}

// describeEvents lists events with their times, places and messages, for
// failure messages.
func describeEvents(evs []contracts.JobEvent) string {
	var b strings.Builder
	for _, ev := range evs {
		where := ""
		if ev.Placement != nil {
			where = fmt.Sprintf(" on %s %v", ev.Placement.NodeID, uuidsOf(ev.Placement.Devices))
		}
		fmt.Fprintf(&b, "  %s %s#%d%s %s %s\n", ev.Time.Format("15:04:05.000"), ev.Type, ev.Attempt, where, ev.Reason, ev.Message)
	}
	return b.String()
}
