package readmodel

import (
	"cmp"
	"slices"
	"strings"
	"testing"
	"time"

	gocmp "github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestFragmentation(t *testing.T) {
	whole := func(uuid string) contracts.DeviceRef { return contracts.DeviceRef{UUID: uuid} }
	half := func(uuid string) contracts.DeviceRef {
		return contracts.DeviceRef{UUID: uuid, Share: &contracts.GPUShare{ComputePercent: 50}}
	}
	for name, tc := range map[string]struct {
		allocs []contracts.DeviceRef // on node a (GPUs a0, a1); node b (b0, b1) stays idle
		sick   bool                  // b1 unhealthy: b is not idle
		want   float64
	}{
		"all idle":            {want: 0},
		"one GPU taken":       {allocs: []contracts.DeviceRef{whole("a0")}, want: 1.0 / 3},
		"half a GPU taken":    {allocs: []contracts.DeviceRef{half("a0")}, want: 1500.0 / 3500},
		"nothing free":        {allocs: []contracts.DeviceRef{whole("a0"), whole("a1")}, sick: true, want: 0},
		"sick idle machine":   {sick: true, want: 1.0 / 3}, // b0 free beside a sick GPU
		"a whole machine out": {allocs: []contracts.DeviceRef{whole("a0"), whole("a1")}, want: 0},
	} {
		t.Run(name, func(t *testing.T) {
			m := New()
			for _, n := range []string{"a", "b"} {
				inv := contracts.NodeInventory{NodeID: n, Pool: "p", GPUs: []contracts.GPUInfo{
					{UUID: n + "0", Healthy: true}, {UUID: n + "1", Healthy: !(tc.sick && n == "b")}}}
				m.ApplyInventory(n, inv, time.Unix(1, 0))
			}
			if len(tc.allocs) > 0 {
				m.ApplyLedger(contracts.LedgerEntry{Kind: contracts.LedgerCommitted,
					Allocation: contracts.Allocation{ID: "x", NodeID: "a", Pool: "p", Devices: tc.allocs}})
			}
			if tc.sick && len(tc.allocs) == 2 {
				// b0 free on a machine with a sick GPU, nothing idle... and
				// no capacity at all once b0 is taken too.
				m.ApplyLedger(contracts.LedgerEntry{Kind: contracts.LedgerCommitted,
					Allocation: contracts.Allocation{ID: "y", NodeID: "b", Pool: "p", Devices: []contracts.DeviceRef{whole("b0")}}})
			}
			p := m.Pressure()
			if len(p) != 1 || p[0].Pool != "p" {
				t.Fatalf("Pressure() = %+v", p)
			}
			if got := p[0].Fragmentation; got != tc.want {
				t.Errorf("fragmentation = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestCountersStartAtZero: every counter series a pool can have is there at
// 0 from the first fact that names the pool, before its first event, so
// that Prometheus' increase() sees that event. Job counters come with any
// pool the fleet or the scheduler names; the autoscaler's only with a pool
// it acts on (its first machine event or decision).
func TestCountersStartAtZero(t *testing.T) {
	at := time.Unix(1, 0)
	zeroJobs := func(pool string) []PoolLabelCount {
		var out []PoolLabelCount
		for _, r := range RequeueReasons {
			out = append(out, PoolLabelCount{Pool: pool, Label: string(r)})
		}
		return out
	}
	for _, tc := range []struct {
		name     string
		apply    func(m *Model)
		jobPools []string // pools with requeue and move series at 0
		scaled   []string // pools with decision and machine series at 0
	}{
		{name: "nothing known"},
		{name: "inventory", apply: func(m *Model) {
			m.ApplyInventory("n1", contracts.NodeInventory{NodeID: "n1", Pool: "h100"}, at)
		}, jobPools: []string{"h100"}},
		{name: "lifecycle", apply: func(m *Model) {
			m.ApplyNodeEvent("n1", contracts.NodeEvent{Kind: contracts.NodeRegistered, NodeID: "n1", Pool: "a100"})
		}, jobPools: []string{"a100"}},
		{name: "demand", apply: func(m *Model) {
			m.ApplyDemand(contracts.PoolDemand{Pool: "l4", Time: at})
		}, jobPools: []string{"l4"}},
		{name: "machine event", apply: func(m *Model) {
			m.ApplyMachineEvent(contracts.MachineEvent{Kind: contracts.MachineRequested, Pool: "l4-spot", Token: "min/l4-spot/1#0"})
		}, jobPools: []string{"l4-spot"}, scaled: []string{"l4-spot"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := New()
			if tc.apply != nil {
				tc.apply(m)
			}
			c := m.Snapshot(at).Counters
			var wantRequeues []PoolLabelCount
			var wantMoves []MoveCount
			for _, p := range tc.jobPools {
				wantRequeues = append(wantRequeues, zeroJobs(p)...)
				for _, r := range MoveReasons {
					for _, ev := range MoveEvents {
						wantMoves = append(wantMoves, MoveCount{Pool: p, Reason: string(r), Event: ev})
					}
				}
			}
			var wantScale, wantMachines []PoolLabelCount
			for _, p := range tc.scaled {
				for _, d := range ScaleDirections {
					wantScale = append(wantScale, PoolLabelCount{Pool: p, Label: string(d)})
				}
				for _, k := range MachineEventKinds {
					n := uint64(0)
					if k == contracts.MachineRequested {
						n = 1 // the event that named the pool
					}
					wantMachines = append(wantMachines, PoolLabelCount{Pool: p, Label: string(k), N: n})
				}
			}
			sortCounts(wantRequeues)
			sortCounts(wantScale)
			sortCounts(wantMachines)
			sortMoves(wantMoves)
			want := Counters{Requeues: wantRequeues, Moves: wantMoves, ScaleDecisions: wantScale, MachineEvents: wantMachines}
			if diff := gocmp.Diff(want, c, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("counters (-want +got):\n%s", diff)
			}
		})
	}

	// A requeue then counts from 0 to 1 on the series that was there.
	m := New()
	m.ApplyInventory("n1", contracts.NodeInventory{NodeID: "n1", Pool: "h100"}, at)
	placed := &contracts.Placement{NodeID: "n1", Pool: "h100"}
	for _, ev := range []contracts.JobEvent{{Type: contracts.EventQueued, Attempt: 1}, {Type: contracts.EventScheduled, Attempt: 1, Placement: placed},
		{Type: contracts.EventRunning, Attempt: 1, Placement: placed}, {Type: contracts.EventRequeued, Attempt: 2, Reason: contracts.ReasonNodeLost}} {
		if err := m.ApplyJobEvent("acme", "j1", ev); err != nil {
			t.Fatal(err)
		}
	}
	var got []PoolLabelCount
	for _, r := range m.Snapshot(at).Counters.Requeues {
		if r.N > 0 {
			got = append(got, r)
		}
	}
	if diff := gocmp.Diff([]PoolLabelCount{{Pool: "h100", Label: string(contracts.ReasonNodeLost), N: 1}}, got); diff != "" {
		t.Errorf("non-zero requeue counters (-want +got):\n%s", diff)
	}
}

func sortCounts(c []PoolLabelCount) {
	slices.SortFunc(c, func(a, b PoolLabelCount) int {
		return cmp.Or(strings.Compare(a.Pool, b.Pool), strings.Compare(a.Label, b.Label))
	})
}

func sortMoves(c []MoveCount) {
	slices.SortFunc(c, func(a, b MoveCount) int {
		return cmp.Or(strings.Compare(a.Pool, b.Pool), strings.Compare(a.Reason, b.Reason), strings.Compare(string(a.Event), string(b.Event)))
	})
}

// TestGPUsCarryTheirPCIBusID: telemetry does not name a GPU's PCI bus ID;
// the snapshot takes it from the node's inventory, "" until it arrives.
func TestGPUsCarryTheirPCIBusID(t *testing.T) {
	m := New()
	at := time.Unix(1, 0)
	m.ApplyTelemetry("n1", contracts.Telemetry{Hostname: "h1", Pool: "p", GPUs: []contracts.GPUSample{{Index: 0, UUID: "GPU-a"}, {Index: 1, UUID: "GPU-b"}}}, at)
	bus := func() []string {
		var out []string
		for _, g := range m.Snapshot(at).GPUs {
			out = append(out, g.PCIBusID)
		}
		return out
	}
	if diff := gocmp.Diff([]string{"", ""}, bus()); diff != "" {
		t.Errorf("before the inventory (-want +got):\n%s", diff)
	}
	m.ApplyInventory("n1", contracts.NodeInventory{NodeID: "n1", Pool: "p", GPUs: []contracts.GPUInfo{
		{Index: 0, UUID: "GPU-a", PCIBusID: "00000000:18:00.0"}, {Index: 1, UUID: "GPU-b", PCIBusID: "00000000:2A:00.0"}}}, at)
	if diff := gocmp.Diff([]string{"00000000:18:00.0", "00000000:2A:00.0"}, bus()); diff != "" {
		t.Errorf("after the inventory (-want +got):\n%s", diff)
	}
}
