package monitor_test

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/monitor"
	"github.com/gpuplane/gpuplane/services/monitor/internal/readmodel"
)

// TestPlatformMetricsAndDefragmentAlert feeds real events through the bus,
// each counted fact also published again under another message ID (a
// redelivery JetStream cannot hide): the queue by reason, preemptions,
// migrations and scale events count each fact once; fragmentation follows
// the ledger; and pool_fragmented fires once while jobs wait, then
// resolves once when the queue empties.
func TestPlatformMetricsAndDefragmentAlert(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	path := rulesFile(t, `
resolution: 100ms
rules:
  - kind: pool_fragmented
    scope: pool
    metric: fragmentation_pct
    window: 300ms
    op: ">"
    threshold: 30
    for: 200ms
    while: [{metric: pending_jobs, op: ">", threshold: 0}]
    action: defragment
`)

	// Two idle 2-GPU machines and one 2-GPU machine with one GPU taken:
	// free 5000 milli-GPU, 4000 of it on idle machines: 20% fragmented.
	for _, n := range []string{"n1", "n2", "n3"} {
		publish(t, b, contracts.SubjectInventory(n), "inv/"+n, inventory(n, "host-"+n, "h100", 2))
	}
	a1 := allocation("acme", "j1", "n1", "h100", 1)
	publish(t, b, contracts.SubjectLedger("n1"), "led-1", contracts.LedgerEntry{Kind: contracts.LedgerCommitted, Allocation: a1})
	publish(t, b, contracts.SubjectDemand("h100"), "demand-1", contracts.PoolDemand{Pool: "h100", Time: time.Now(), PendingJobs: 1, PendingGPUs: 2})

	placed := &contracts.Placement{AllocationID: a1.ID, NodeID: "n1", Pool: "h100"}
	from := []contracts.Placement{*placed}
	events := []struct {
		job string
		ev  contracts.JobEvent
	}{
		{"j1", contracts.JobEvent{Type: contracts.EventQueued, Attempt: 1, Request: &contracts.JobRequest{Pool: "h100"}}},
		{"j1", contracts.JobEvent{Type: contracts.EventScheduled, Attempt: 1, Placement: placed}},
		{"j1", contracts.JobEvent{Type: contracts.EventRunning, Attempt: 1, Placement: placed}},
		{"j1", contracts.JobEvent{Type: contracts.EventMigrating, Attempt: 1,
			Migration: &contracts.Migration{Reason: contracts.ReasonDefragment, FromAttempt: 1, From: from, Checkpoint: true}}},
		{"j1", contracts.JobEvent{Type: contracts.EventRequeued, Attempt: 2, Reason: contracts.ReasonPreempted}},
		{"j1", contracts.JobEvent{Type: contracts.EventScheduled, Attempt: 2, Placement: placed}},
		{"j1", contracts.JobEvent{Type: contracts.EventRunning, Attempt: 2, Placement: placed}},
		{"j1", contracts.JobEvent{Type: contracts.EventMigrated, Attempt: 2,
			Migration: &contracts.Migration{Reason: contracts.ReasonDefragment, FromAttempt: 1, From: from, Checkpointed: true}}},
		{"j2", contracts.JobEvent{Type: contracts.EventQueued, Attempt: 1}},
		{"j2", contracts.JobEvent{Type: contracts.EventPending, Attempt: 1, Reason: contracts.PendingQuotaExceeded}},
		{"j3", contracts.JobEvent{Type: contracts.EventQueued, Attempt: 1, Request: &contracts.JobRequest{Pool: "h100"}}},
	}
	for i, e := range events {
		e.ev.Tenant, e.ev.JobID = "acme", e.job
		for copy := range 2 {
			publish(t, b, contracts.SubjectJobEvents("acme", e.job), fmt.Sprintf("ev-%d-%d", i, copy), e.ev)
		}
	}
	for copy := range 2 {
		publish(t, b, contracts.SubjectScale("h100"), fmt.Sprintf("scale-%d", copy), contracts.ScaleDecision{ID: "d1", Pool: "h100",
			Direction: contracts.ScaleUp, CurrentNodes: 3, DesiredNodes: 4, Time: time.Now()})
		for _, kind := range []contracts.MachineEventKind{contracts.MachineRequested, contracts.MachineReady} {
			publish(t, b, contracts.SubjectMachines("h100"), fmt.Sprintf("machine-%s-%d", kind, copy), contracts.MachineEvent{
				Kind: kind, Pool: "h100", MachineID: "m1", Time: time.Now()})
		}
	}

	cfg := monitor.DefaultConfig()
	cfg.SilentAfter = time.Minute
	cfg.RulesFile = path
	cfg.EvalInterval = 20 * time.Millisecond
	addr, _ := startMonitorWith(t, srv, cfg)
	waitHealthy(t, addr)

	// Every counter series of h100 is there, at 0 unless counted: the pool
	// is known from its inventory, and as one the autoscaler acts on from
	// its machine events.
	want := withCounts(slices.Concat(zeroCounters("h100"), zeroScaled("h100")),
		`gpuplane_job_migrations_total{event="migrated",pool="h100",reason="defragment"} 1`,
		`gpuplane_job_migrations_total{event="migrating",pool="h100",reason="defragment"} 1`,
		`gpuplane_job_requeues_total{pool="h100",reason="preempted"} 1`,
		`gpuplane_machine_events_total{kind="ready",pool="h100"} 1`,
		`gpuplane_machine_events_total{kind="requested",pool="h100"} 1`,
		`gpuplane_pool_fragmentation_ratio{pool="h100"} 0.2`,
		`gpuplane_pool_free_milligpus{pool="h100"} 5000`,
		`gpuplane_pool_idle_free_milligpus{pool="h100"} 4000`,
		`gpuplane_pool_queue_depth{pool="",reason="none"} 0`, // j2 before its pending reason
		`gpuplane_pool_queue_depth{pool="",reason="quota_exceeded"} 1`,
		`gpuplane_pool_queue_depth{pool="h100",reason="none"} 1`,
		`gpuplane_preemptions_total{pool="h100"} 1`,
		`gpuplane_scale_decisions_total{direction="up",pool="h100"} 1`,
	)
	platform := func() []string {
		var out []string
		for _, l := range scrape(t, addr) {
			for _, p := range []string{"gpuplane_job_", "gpuplane_machine_", "gpuplane_pool_fragmentation", "gpuplane_pool_free_milli",
				"gpuplane_pool_idle", "gpuplane_pool_queue", "gpuplane_preemptions", "gpuplane_scale_"} {
				if strings.HasPrefix(l, p) {
					out = append(out, l)
				}
			}
		}
		return out
	}
	var got []string
	eventually(t, 10*time.Second, "platform metrics", func() bool {
		got = platform()
		return cmp.Equal(want, got)
	}, func() string { return cmp.Diff(want, got) })
	// 20% is not fragmented enough: nothing fires.
	if a := readAlerts(t, b, "pool_fragmented"); len(a) != 0 {
		t.Fatalf("pool_fragmented at 20%%: %+v", a)
	}

	// A second job takes one GPU of n2: free 4000, idle 2000: 50%.
	a2 := allocation("acme", "j4", "n2", "h100", 1)
	publish(t, b, contracts.SubjectLedger("n2"), "led-2", contracts.LedgerEntry{Kind: contracts.LedgerCommitted, Allocation: a2})
	var alerts []idAlert
	eventually(t, 10*time.Second, "pool_fragmented firing", func() bool {
		alerts = readAlerts(t, b, "pool_fragmented")
		return len(alerts) >= 1
	}, func() string { return fmt.Sprintf("%+v", alerts) })
	if a := alerts[0]; a.id != "alert/pool_fragmented/h100/1/firing" || a.Labels[contracts.AlertLabelAction] != contracts.AlertActionDefragment ||
		a.Labels[contracts.AlertLabelPool] != "h100" || a.Value != 50 {
		t.Fatalf("firing alert = %+v", a)
	}

	// The queue empties: the alert resolves although the pool stays
	// fragmented.
	publish(t, b, contracts.SubjectDemand("h100"), "demand-2", contracts.PoolDemand{Pool: "h100", Time: time.Now(), PendingJobs: 0})
	eventually(t, 10*time.Second, "pool_fragmented resolved", func() bool {
		alerts = readAlerts(t, b, "pool_fragmented")
		return len(alerts) >= 2
	}, func() string { return fmt.Sprintf("%+v", alerts) })
	// Barrier: more evaluations ran; still exactly one episode.
	eventually(t, 5*time.Second, "the alert closed in /metrics", func() bool {
		return slices.Contains(scrape(t, addr), `gpuplane_alerts_firing{kind="pool_fragmented"} 0`)
	}, func() string { return strings.Join(scrape(t, addr), "\n") })
	var ids []string
	for _, a := range readAlerts(t, b, "pool_fragmented") {
		ids = append(ids, a.id)
	}
	if diff := cmp.Diff([]string{"alert/pool_fragmented/h100/1/firing", "alert/pool_fragmented/h100/1/resolved"}, ids); diff != "" {
		t.Fatalf("alerts on the bus (-want +got):\n%s", diff)
	}
}

// zeroScaled are the autoscaler's counter series of a pool it acts on, at 0.
func zeroScaled(pools ...string) []string {
	var out []string
	for _, p := range pools {
		for _, d := range readmodel.ScaleDirections {
			out = append(out, fmt.Sprintf(`gpuplane_scale_decisions_total{direction=%q,pool=%q} 0`, d, p))
		}
		for _, k := range readmodel.MachineEventKinds {
			out = append(out, fmt.Sprintf(`gpuplane_machine_events_total{kind=%q,pool=%q} 0`, k, p))
		}
	}
	return out
}

// withCounts returns base with each series of lines set to the value lines
// give it (added when base lacks it), sorted as scrape sorts.
func withCounts(base []string, lines ...string) []string {
	byName := map[string]string{}
	for _, l := range slices.Concat(base, lines) {
		byName[l[:strings.LastIndexByte(l, ' ')]] = l
	}
	out := slices.Collect(maps.Values(byName))
	slices.Sort(out)
	return out
}
