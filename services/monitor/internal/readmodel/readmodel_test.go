package readmodel

import (
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestJobsFollowTheStateMachine(t *testing.T) {
	m := New()
	steps := []struct {
		tenant, job string
		ev          contracts.JobEventType
		refused     bool
	}{
		{"acme", "j1", contracts.EventQueued, false},
		{"acme", "j1", contracts.EventQueued, true}, // redelivered
		{"acme", "j1", contracts.EventPending, false},
		{"acme", "j2", contracts.EventQueued, false},
		{"acme", "j2", contracts.EventScheduled, false},
		{"acme", "j2", contracts.EventRunning, false},
		{"acme", "j2", contracts.EventSucceeded, false},
		{"acme", "j2", contracts.EventRequeued, true}, // terminal: nothing leaves it
		{"acme", "j1", contracts.EventRejected, true}, // duplicate_job_id rejection of an accepted job
		{"beta", "j1", contracts.EventRunning, true},  // same job ID, other tenant, never queued
	}
	for _, s := range steps {
		err := m.ApplyJobEvent(s.tenant, s.job, contracts.JobEvent{Type: s.ev})
		if s.refused != errors.Is(err, contracts.ErrTransition) {
			t.Fatalf("%s/%s %s: err = %v, want refused = %v", s.tenant, s.job, s.ev, err, s.refused)
		}
	}
	want := []JobCount{
		{Tenant: "acme", State: contracts.StateQueued, Jobs: 1},
		{Tenant: "acme", State: contracts.StateRunning, Jobs: 0},
		{Tenant: "acme", State: contracts.StateScheduled, Jobs: 0},
		{Tenant: "acme", State: contracts.StateSucceeded, Jobs: 1},
	}
	if diff := cmp.Diff(want, m.Snapshot(time.Time{}).Jobs); diff != "" {
		t.Errorf("jobs (-want +got):\n%s", diff)
	}
}

func TestLedgerIsIdempotentOnAllocationID(t *testing.T) {
	m := New()
	alloc := func(id, pool, tenant string, gpus int) contracts.Allocation {
		return contracts.Allocation{ID: id, Pool: pool, Tenant: tenant, Devices: make([]contracts.DeviceRef, gpus)}
	}
	a1, a2 := alloc("acme/j1/1", "h100", "acme", 2), alloc("beta/j1/1", "h100", "beta", 1)
	for _, e := range []contracts.LedgerEntry{
		{Kind: contracts.LedgerCommitted, Allocation: a1},
		{Kind: contracts.LedgerCommitted, Allocation: a1},
		{Kind: contracts.LedgerCommitted, Allocation: a2},
		{Kind: contracts.LedgerReleased, Allocation: a2},
		{Kind: contracts.LedgerReleased, Allocation: a2},
		{Kind: contracts.LedgerReleased, Allocation: alloc("ghost/j/1", "h100", "ghost", 8)},
	} {
		m.ApplyLedger(e)
	}
	m.ApplyInventory("n1", contracts.NodeInventory{Pool: "h100", GPUs: make([]contracts.GPUInfo, 8)}, time.Unix(1, 0))
	m.ApplyInventory("n2", contracts.NodeInventory{Pool: "h100", GPUs: make([]contracts.GPUInfo, 8)}, time.Unix(1, 0))
	m.ApplyNodeEvent("n2", contracts.NodeEvent{Kind: contracts.NodeLost})
	s := m.Snapshot(time.Time{})
	if diff := cmp.Diff([]PoolCount{{Pool: "h100", Nodes: 1, GPUs: 8, AllocatedGPUs: 2}}, s.Pools); diff != "" {
		t.Errorf("pools (-want +got):\n%s", diff)
	}
	wantTenants := []TenantAllocation{{Pool: "h100", Tenant: "acme", GPUs: 2}, {Pool: "h100", Tenant: "beta", GPUs: 0}}
	if diff := cmp.Diff(wantTenants, s.TenantAllocations); diff != "" {
		t.Errorf("tenant allocations (-want +got):\n%s", diff)
	}
	m.ApplyNodeEvent("n2", contracts.NodeEvent{Kind: contracts.NodeReturned})
	if got := m.Snapshot(time.Time{}).Pools[0]; got.Nodes != 2 || got.GPUs != 16 {
		t.Errorf("after n2 returned: %+v, want 2 nodes and 16 GPUs", got)
	}
}

func TestSnapshotLeavesOutSilentNodes(t *testing.T) {
	m := New()
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	m.ApplyTelemetry("n1", contracts.Telemetry{Hostname: "host-1", GPUs: []contracts.GPUSample{{Index: 0, UUID: "GPU-1"}}}, t0)
	m.ApplyTelemetry("n2", contracts.Telemetry{Hostname: "host-2", GPUs: []contracts.GPUSample{{Index: 0, UUID: "GPU-2"}}}, t0.Add(time.Minute))
	s := m.Snapshot(t0.Add(time.Second))
	if len(s.GPUs) != 1 || s.GPUs[0].NodeID != "n2" || s.TelemetryMessages != 2 {
		t.Errorf("snapshot = %+v, want only n2's GPU and 2 messages", s)
	}
}

func TestDemandAndTenantOf(t *testing.T) {
	m := New()
	t0 := time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC)
	m.ApplyDemand(contracts.PoolDemand{Pool: "h100", Time: t0.Add(time.Second), PendingJobs: 3, PendingGPUs: 12})
	m.ApplyDemand(contracts.PoolDemand{Pool: "h100", Time: t0, PendingJobs: 9}) // older: ignored
	m.ApplyDemand(contracts.PoolDemand{Pool: "a100", Time: t0, PendingJobs: 1, PendingGPUs: 1})
	var got []string
	for _, d := range m.Snapshot(t0).Demand {
		got = append(got, d.Pool)
		if d.Pool == "h100" && (d.PendingJobs != 3 || d.PendingGPUs != 12) {
			t.Errorf("h100 demand = %+v, want the newer view", d)
		}
	}
	if diff := cmp.Diff([]string{"a100", "h100"}, got); diff != "" {
		t.Errorf("demand pools (-want +got):\n%s", diff)
	}

	a := contracts.Allocation{ID: "a1", Tenant: "acme", Pool: "h100", Devices: []contracts.DeviceRef{{UUID: "G1"}}}
	m.ApplyLedger(contracts.LedgerEntry{Kind: contracts.LedgerCommitted, Allocation: a})
	if got := m.TenantOf("a1"); got != "acme" {
		t.Errorf("TenantOf(a1) = %q, want acme", got)
	}
	m.ApplyLedger(contracts.LedgerEntry{Kind: contracts.LedgerReleased, Allocation: a})
	if got := m.TenantOf("a1"); got != "" {
		t.Errorf("TenantOf(released a1) = %q, want empty", got)
	}
}
