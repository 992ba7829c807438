package monitor_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/monitor"
)

// TestNodeLostFromHeartbeats runs the monitor with node_lost at three
// missed 300 ms heartbeats. n1, n2 and n3 beat; n3's machine is deleted
// and it stops (a clean leave); n1 stops. Exactly one firing comes for n1,
// none for n2 (still beating) nor n3, then one resolution when n1 beats
// again.
func TestNodeLostFromHeartbeats(t *testing.T) {
	const interval = 300 * time.Millisecond
	srv := natstest.Start(t)
	b := connect(t, srv)
	path := nodeLostRulesFile(t, interval)
	for _, n := range []string{"n1", "n2", "n3"} {
		publish(t, b, contracts.SubjectInventory(n), "inv/"+n, inventory(n, "host-"+n, "h100", 1))
	}
	cfg := monitor.DefaultConfig()
	cfg.SilentAfter = time.Minute
	cfg.RulesFile = path
	cfg.EvalInterval = 20 * time.Millisecond
	addr, _ := startMonitorWith(t, srv, cfg)
	waitHealthy(t, addr)

	beating := map[string]*atomic.Bool{}
	for _, n := range []string{"n1", "n2", "n3"} {
		beating[n] = beat(t, b, n, interval)
	}
	ages := func() string {
		var out []string
		for _, l := range scrape(t, addr) {
			if strings.HasPrefix(l, "gpuplane_node_heartbeat_age_seconds") {
				out = append(out, l[:strings.LastIndex(l, " ")])
			}
		}
		return strings.Join(out, "\n")
	}
	series := func(n string) string {
		return fmt.Sprintf(`gpuplane_node_heartbeat_age_seconds{node="%s",pool="h100"}`, n)
	}
	eventually(t, 10*time.Second, "every node's heartbeat age exported", func() bool {
		a := ages()
		return strings.Contains(a, series("n1")) && strings.Contains(a, series("n2")) && strings.Contains(a, series("n3"))
	}, ages)

	// n3 leaves cleanly: its agent stops, then its machine is deleted.
	beating["n3"].Store(false)
	publish(t, b, contracts.SubjectMachines("h100"), "machine/deleted/m3", contracts.MachineEvent{
		SchemaVersion: contracts.SchemaVersion, Kind: contracts.MachineDeleted, Pool: "h100", MachineID: "m3", NodeID: "n3", Time: time.Now()})
	eventually(t, 10*time.Second, "n3's heartbeat age gone", func() bool { return !strings.Contains(ages(), series("n3")) }, ages)

	beating["n1"].Store(false)
	var alerts []idAlert
	eventually(t, 10*time.Second, "node_lost firing for n1", func() bool {
		alerts = readAlerts(t, b, "node_lost")
		return len(alerts) >= 1
	}, func() string { return fmt.Sprintf("%+v", alerts) })
	first := alerts[0]
	if first.id != "alert/node_lost/n1/1/firing" || first.Key != "n1" || first.Severity != "critical" ||
		first.Labels[contracts.AlertLabelNode] != "n1" || first.Labels[contracts.AlertLabelPool] != "h100" ||
		first.Labels[contracts.AlertLabelScope] != "node" || first.Value < (3*interval).Seconds() {
		t.Fatalf("first alert = %+v", first)
	}

	beating["n1"].Store(true)
	eventually(t, 10*time.Second, "node_lost resolved for n1", func() bool {
		alerts = readAlerts(t, b, "node_lost")
		return len(alerts) >= 2
	}, func() string { return fmt.Sprintf("%+v", alerts) })
	// n3 went quiet before n1 did, so it has been quiet longer than n1 was
	// when it fired: an alert for it would be on the bus by now.
	var ids []string
	for _, a := range readAlerts(t, b, "node_lost") {
		ids = append(ids, a.id)
	}
	if diff := cmp.Diff([]string{"alert/node_lost/n1/1/firing", "alert/node_lost/n1/1/resolved"}, ids); diff != "" {
		t.Fatalf("alerts on the bus (-want +got):\n%s", diff)
	}
}

// TestHeldCapacityIsNotFree: a cordon in BucketNodeAdmin takes the node's
// free GPUs out of the pool's free capacity; lifting it brings them back.
func TestHeldCapacityIsNotFree(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	for _, n := range []string{"n1", "n2"} {
		publish(t, b, contracts.SubjectInventory(n), "inv/"+n, inventory(n, "host-"+n, "h100", 2))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := b.KeyValue(ctx, contracts.BucketNodeAdmin)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "n2", []byte(`{"nodeId":"n2","cordoned":true,"reason":"maintenance"}`)); err != nil {
		t.Fatal(err)
	}
	addr := startMonitor(t, srv, time.Minute)
	waitHealthy(t, addr)
	free := func(want string) {
		t.Helper()
		line := `gpuplane_pool_free_milligpus{pool="h100"} ` + want
		eventually(t, 10*time.Second, line, func() bool { return slices.Contains(scrape(t, addr), line) },
			func() string { return strings.Join(scrape(t, addr), "\n") })
	}
	// /healthz waits for the holds present at start: no moment shows n2 free.
	if line := `gpuplane_pool_free_milligpus{pool="h100"} 2000`; !slices.Contains(scrape(t, addr), line) {
		t.Fatalf("healthy monitor lacks %s:\n%s", line, strings.Join(scrape(t, addr), "\n"))
	}
	if err := kv.Delete(ctx, "n2"); err != nil {
		t.Fatal(err)
	}
	free("4000")
}

// beat publishes a heartbeat of node every interval while the returned
// flag is set (it starts set), until the test ends; cleanup waits for the
// loop to stop and reports a publish that failed.
func beat(t *testing.T, b *bus.Bus, node string, interval time.Duration) *atomic.Bool {
	var on atomic.Bool
	on.Store(true)
	ctx, cancel := context.WithCancel(context.Background())
	var failed error
	done := make(chan struct{})
	go func() {
		defer close(done)
		for seq := uint64(1); ; {
			if on.Load() {
				hb := contracts.Heartbeat{SchemaVersion: contracts.SchemaVersion, NodeID: node, Incarnation: "i1", Seq: seq, Time: time.Now()}
				if _, err := b.Publish(ctx, contracts.SubjectHeartbeat(node), fmt.Sprintf("hb/%s/%d", node, seq), hb); err != nil && ctx.Err() == nil {
					failed = err
					return
				}
				seq++
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(interval):
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		if failed != nil {
			t.Errorf("heartbeats of %s: %v", node, failed)
		}
	})
	return &on
}

// nodeLostRulesFile writes a rules file holding node_lost alone, firing
// after three missed heartbeats of interval, and returns its path.
func nodeLostRulesFile(t *testing.T, interval time.Duration) string {
	t.Helper()
	return rulesFile(t, fmt.Sprintf(`
resolution: 100ms
rules:
  - {kind: node_lost, scope: node, metric: heartbeat_age_s, agg: last, window: 500ms, op: ">=", threshold: %g, severity: critical}
`, (3*interval).Seconds()))
}

// rulesFile writes a rules file with body and returns its path.
func rulesFile(t *testing.T, body string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
