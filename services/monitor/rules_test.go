package monitor_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/monitor"
)

// TestRuleAlertFiresOnceAndResolvesOnce runs the monitor with a rules file
// and a hot GPU: one firing alert with the drain action, no second firing
// across a restart while it is still hot, one resolution once it cools.
func TestRuleAlertFiresOnceAndResolvesOnce(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	path := rulesFile(t, `
resolution: 100ms
rules:
  - kind: gpu_hot
    scope: gpu
    metric: temp_c
    agg: last
    window: 300ms
    op: ">"
    threshold: 85
    severity: critical
    action: drain_gpu
`)
	cfg := monitor.DefaultConfig()
	cfg.SilentAfter = time.Minute
	cfg.RulesFile = path
	cfg.EvalInterval = 20 * time.Millisecond

	addr, stop := startMonitorWith(t, srv, cfg)
	waitHealthy(t, addr)
	var temp atomic.Int64
	temp.Store(90)
	hotTicks(t, b, "n1", &temp)

	var alerts []idAlert
	eventually(t, 10*time.Second, "gpu_hot firing", func() bool {
		alerts = readAlerts(t, b, "gpu_hot")
		return len(alerts) >= 1
	}, func() string { return fmt.Sprintf("%+v", alerts) })
	first := alerts[0]
	if first.id != "alert/gpu_hot/GPU-n1/1/firing" || first.Key != "GPU-n1" || first.Severity != "critical" ||
		first.Labels[contracts.AlertLabelAction] != contracts.AlertActionDrainGPU || first.Labels[contracts.AlertLabelNode] != "n1" ||
		first.Labels[contracts.AlertLabelPool] != "h100" || first.Value != 90 {
		t.Fatalf("first alert = %+v", first)
	}

	// Restart while hot; a monitor that forgot the open episode would fire
	// it again, which JetStream would hide without this.
	natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamOps)
	stop()
	addr, _ = startMonitorWith(t, srv, cfg)
	waitHealthy(t, addr)
	// Barrier: the restarted monitor has ingested hot samples and evaluated.
	eventually(t, 10*time.Second, "gpu_hot open after restart", func() bool {
		for _, l := range scrape(t, addr) {
			if l == `gpuplane_alerts_firing{kind="gpu_hot"} 1` {
				return true
			}
		}
		return false
	}, func() string { return fmt.Sprint(scrape(t, addr)) })

	temp.Store(60)
	eventually(t, 10*time.Second, "gpu_hot resolved", func() bool {
		alerts = readAlerts(t, b, "gpu_hot")
		return len(alerts) >= 2
	}, func() string { return fmt.Sprintf("%+v", alerts) })
	var ids []string
	for _, a := range readAlerts(t, b, "gpu_hot") {
		ids = append(ids, a.id)
	}
	if diff := cmp.Diff([]string{"alert/gpu_hot/GPU-n1/1/firing", "alert/gpu_hot/GPU-n1/1/resolved"}, ids); diff != "" {
		t.Fatalf("alerts on the bus (-want +got):\n%s", diff)
	}
}

// hotTicks publishes a telemetry sample of one GPU at the temperature temp
// holds every 20 ms until the test ends.
func hotTicks(t *testing.T, b *bus.Bus, node string, temp *atomic.Int64) {
	publishEvery(t, b, node, 20*time.Millisecond, func(i int) (string, contracts.Telemetry) {
		s := gpu(0, "GPU-"+node, "H100-80GB", 50)
		s.TempC = float64(temp.Load())
		return fmt.Sprintf("hot/%s/%d", node, i), telemetry(node, "host-"+node, "h100", s)
	})
}

// TestRestoreReadsOnlyTheMonitorsKinds starts the monitor over an OPS
// stream that already holds one of its own episodes (gpu_hot episode 3,
// resolved) and alerts other services publish on the same subjects: a
// spot notice from the autoscaler and a budget alert from billing, written
// here in a form the monitor cannot read. The monitor must continue its
// own numbering (the next gpu_hot is episode 4) without reading, let alone
// warning about, the others' alerts.
func TestRestoreReadsOnlyTheMonitorsKinds(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	path := rulesFile(t, `
resolution: 100ms
rules:
  - {kind: gpu_hot, scope: gpu, metric: temp_c, agg: last, window: 300ms, op: ">", threshold: 85, severity: critical}
`)
	since := time.Now().Add(-time.Hour)
	publish(t, b, contracts.SubjectAlert("gpu_hot"), "alert/gpu_hot/GPU-n1/3/resolved", contracts.Alert{
		SchemaVersion: contracts.SchemaVersion, Kind: "gpu_hot", Key: "GPU-n1", State: contracts.AlertResolved,
		Labels: map[string]string{contracts.AlertLabelEpisode: "3"}, Since: since, Time: since.Add(time.Minute)})
	publish(t, b, contracts.SubjectAlert(contracts.AlertKindSpotInterruption), "alert/spot_interruption/n1/1767225600/firing",
		contracts.Alert{SchemaVersion: contracts.SchemaVersion, Kind: contracts.AlertKindSpotInterruption, Key: "n1",
			State: contracts.AlertFiring, Labels: map[string]string{contracts.AlertLabelEpisode: "1767225600"}, Since: since, Time: since})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := b.JetStream().Publish(ctx, contracts.SubjectAlert(contracts.AlertKindBudget), []byte("not an alert")); err != nil {
		t.Fatal(err)
	}

	logs := &lockedBuffer{}
	cfg := monitor.DefaultConfig()
	cfg.SilentAfter = time.Minute
	cfg.RulesFile = path
	cfg.EvalInterval = 20 * time.Millisecond
	addr, _ := startMonitorLogged(t, srv, cfg, slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	waitHealthy(t, addr)

	var temp atomic.Int64
	temp.Store(90)
	hotTicks(t, b, "n1", &temp)
	var alerts []idAlert
	eventually(t, 10*time.Second, "gpu_hot firing", func() bool {
		alerts = readAlerts(t, b, "gpu_hot")
		return len(alerts) >= 2
	}, func() string { return fmt.Sprintf("%+v", alerts) })
	if got, want := alerts[1].id, "alert/gpu_hot/GPU-n1/4/firing"; got != want {
		t.Errorf("first alert after restart = %s; want %s", got, want)
	}
	if l := logs.String(); strings.Contains(l, "skipping") || !strings.Contains(l, "alerts=1") {
		t.Errorf("restore read alerts that are not the monitor's, or missed its own; log:\n%s", l)
	}
}

// lockedBuffer is a log sink the monitor writes while the test reads.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
