package monitor_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/monitor"
)

// TestDepartedNodeSilenceResolvesOnce: n1 falls silent and node_silent
// fires; its machine is then deleted, which resolves the episode once
// (saying the node left) and fires nothing more while it stays gone. The
// same node ID back on a new machine is a new node: its GPUs are exported
// again and its next silence is a new episode, numbered above the old.
func TestDepartedNodeSilenceResolvesOnce(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	const silentAfter = 800 * time.Millisecond

	addr := startMonitor(t, srv, silentAfter)
	waitHealthy(t, addr)
	tick(t, b, "n2", "host-2")
	publish(t, b, contracts.SubjectTelemetry("n1"), "n1-once", telemetry("n1", "host-1", "h100", gpu(0, "GPU-1a", "H100-80GB", 50)))

	var alerts []idAlert
	show := func() string { return fmt.Sprintf("%+v", alerts) }
	eventually(t, 10*time.Second, "node_silent firing for n1", func() bool {
		alerts = readAlerts(t, b, "node_silent")
		return len(alerts) >= 1
	}, show)

	publish(t, b, contracts.SubjectMachines("h100"), "machine/deleted/m1", contracts.MachineEvent{
		SchemaVersion: contracts.SchemaVersion, Kind: contracts.MachineDeleted, Pool: "h100", MachineID: "m1", NodeID: "n1", Time: time.Now()})
	eventually(t, 10*time.Second, "node_silent resolved for n1", func() bool {
		alerts = readAlerts(t, b, "node_silent")
		return len(alerts) >= 2
	}, show)
	resolved := alerts[1]
	if resolved.id != "alert/node_silent/n1/1/resolved" || !strings.Contains(resolved.Message, "left") {
		t.Fatalf("resolution = %+v; want n1's episode 1 resolved as departed", resolved)
	}
	// Nor does Prometheus' node_silent see it: a machine that left has no
	// telemetry age.
	if age, ok := telemetryAge(t, addr, "n1"); ok {
		t.Errorf("departed n1 still has a telemetry age (%v s): Prometheus' node_silent would fire for it", age)
	}

	// n1's ID on a new machine: sends once, then falls silent again.
	publish(t, b, contracts.SubjectTelemetry("n1"), "n1-back", telemetry("n1", "host-9", "h100", gpu(0, "GPU-9a", "H100-80GB", 50)))
	eventually(t, 10*time.Second, "n1's new GPU exported", func() bool {
		return strings.Contains(strings.Join(scrape(t, addr), "\n"), `DCGM_FI_DEV_GPU_UTIL{Hostname="host-9"`)
	}, func() string { return strings.Join(scrape(t, addr), "\n") })
	eventually(t, 10*time.Second, "node_silent firing for n1 back", func() bool {
		alerts = readAlerts(t, b, "node_silent")
		return len(alerts) >= 3
	}, show)
	var ids []string
	for _, a := range alerts {
		ids = append(ids, a.id)
	}
	want := []string{"alert/node_silent/n1/1/firing", "alert/node_silent/n1/1/resolved", "alert/node_silent/n1/2/firing"}
	if diff := cmp.Diff(want, ids); diff != "" {
		t.Fatalf("alerts on the bus (-want +got):\n%s", diff)
	}
	// Episode 2 is the new machine's silence, not the departed node's
	// fired again: it is silent since the new machine's sample.
	if back := alerts[2]; !back.Since.After(resolved.Time) || back.Labels["hostname"] != "host-9" {
		t.Errorf("second episode = %+v; want n1 on host-9 silent since after %v", back, resolved.Time)
	}
}

// TestDepartedNodeLostResolvesOnce: n1's agent stops and node_lost fires;
// its machine is then reclaimed, which resolves the episode once, and the
// node is not watched again: no second firing, none still open.
func TestDepartedNodeLostResolvesOnce(t *testing.T) {
	const interval = 200 * time.Millisecond
	srv := natstest.Start(t)
	b := connect(t, srv)
	path := nodeLostRulesFile(t, interval)
	publish(t, b, contracts.SubjectInventory("n1"), "inv/n1", inventory("n1", "host-1", "h100", 1))
	cfg := monitor.DefaultConfig()
	cfg.SilentAfter = time.Second
	cfg.RulesFile = path
	cfg.EvalInterval = 20 * time.Millisecond
	addr, _ := startMonitorWith(t, srv, cfg)
	waitHealthy(t, addr)

	beating := beat(t, b, "n1", interval)
	eventually(t, 10*time.Second, "n1's heartbeat age exported", func() bool {
		return strings.Contains(strings.Join(scrape(t, addr), "\n"), `gpuplane_node_heartbeat_age_seconds{node="n1"`)
	}, func() string { return strings.Join(scrape(t, addr), "\n") })
	beating.Store(false)
	var alerts []idAlert
	show := func() string { return fmt.Sprintf("%+v", alerts) }
	eventually(t, 10*time.Second, "node_lost firing for n1", func() bool {
		alerts = readAlerts(t, b, "node_lost")
		return len(alerts) >= 1
	}, show)

	publish(t, b, contracts.SubjectMachines("h100"), "machine/reclaimed/m1", contracts.MachineEvent{
		SchemaVersion: contracts.SchemaVersion, Kind: contracts.MachineReclaimed, Pool: "h100", MachineID: "m1", NodeID: "n1", Time: time.Now()})
	eventually(t, 10*time.Second, "node_lost resolved for n1", func() bool {
		alerts = readAlerts(t, b, "node_lost")
		return len(alerts) >= 2
	}, show)
	// No episode stays open: the firing gauge drops to 0 and the heartbeat
	// age of the departed node is gone.
	firing := `gpuplane_alerts_firing{kind="node_lost"} 0`
	eventually(t, 10*time.Second, "no node_lost open, n1 not watched", func() bool {
		lines := strings.Join(scrape(t, addr), "\n")
		return strings.Contains(lines, firing) && !strings.Contains(lines, `node="n1"`)
	}, func() string { return strings.Join(scrape(t, addr), "\n") })
	var ids []string
	for _, a := range readAlerts(t, b, "node_lost") {
		ids = append(ids, a.id)
	}
	if diff := cmp.Diff([]string{"alert/node_lost/n1/1/firing", "alert/node_lost/n1/1/resolved"}, ids); diff != "" {
		t.Fatalf("alerts on the bus (-want +got):\n%s", diff)
	}
}
