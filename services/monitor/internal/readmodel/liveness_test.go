package readmodel

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestHeartbeats checks which nodes the node_lost rule watches, whatever
// order the heartbeat and machine streams are read in.
func TestHeartbeats(t *testing.T) {
	t0 := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	type step struct {
		beat bool // a heartbeat, else a clean departure
		s    int
	}
	tests := map[string]struct {
		steps []step
		want  []NodeHeartbeat // of node n1, pool h100
	}{
		"beats":                   {steps: []step{{true, 1}, {true, 3}}, want: []NodeHeartbeat{{"n1", "h100", at(3)}}},
		"out of order":            {steps: []step{{true, 3}, {true, 1}}, want: []NodeHeartbeat{{"n1", "h100", at(3)}}},
		"left":                    {steps: []step{{true, 1}, {false, 2}}},
		"left, read first":        {steps: []step{{false, 2}, {true, 1}}},
		"left, then back":         {steps: []step{{true, 1}, {false, 2}, {true, 5}}, want: []NodeHeartbeat{{"n1", "h100", at(5)}}},
		"left, then back, replay": {steps: []step{{false, 2}, {true, 5}, {true, 1}}, want: []NodeHeartbeat{{"n1", "h100", at(5)}}},
		"never beat":              {steps: []step{{false, 2}}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			m := New()
			m.ApplyInventory("n1", contracts.NodeInventory{NodeID: "n1", Pool: "h100"}, at(0))
			for _, st := range tc.steps {
				if st.beat {
					m.ApplyHeartbeat("n1", at(st.s))
				} else {
					m.ApplyNodeLeft("n1", at(st.s))
				}
			}
			if diff := cmp.Diff(tc.want, m.Heartbeats(), cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("Heartbeats (-want +got):\n%s", diff)
			}
		})
	}
	if got := (NodeHeartbeat{Last: at(5)}).Age(at(4)); got != 0 {
		t.Errorf("Age before the heartbeat = %s, want 0", got)
	}
}

// TestFragmentationLeavesHeldCapacityOut: capacity an operator or the
// platform held takes no new work, so it is neither free nor idle. Nodes a
// (a0, a1) and b (b0, b1) of pool p, one GPU of a taken.
func TestFragmentationLeavesHeldCapacityOut(t *testing.T) {
	tests := map[string]struct {
		admin *contracts.NodeAdmin // on node b
		want  PoolCapacity
	}{
		"no hold": {want: PoolCapacity{Pool: "p", FreeMilli: 3000, IdleMilli: 2000}},
		"b cordoned": {admin: &contracts.NodeAdmin{Cordoned: true},
			want: PoolCapacity{Pool: "p", FreeMilli: 1000}},
		"b drained": {admin: &contracts.NodeAdmin{Cordoned: true, Drain: true},
			want: PoolCapacity{Pool: "p", FreeMilli: 1000}},
		"b1 held": {admin: &contracts.NodeAdmin{GPUs: map[string]contracts.GPUHold{"b1": {Cordoned: true}}},
			want: PoolCapacity{Pool: "p", FreeMilli: 2000}},
		"a hold lifted": {admin: &contracts.NodeAdmin{GPUs: map[string]contracts.GPUHold{"b1": {}}},
			want: PoolCapacity{Pool: "p", FreeMilli: 3000, IdleMilli: 2000}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			m := New()
			for _, n := range []string{"a", "b"} {
				m.ApplyInventory(n, contracts.NodeInventory{NodeID: n, Pool: "p", GPUs: []contracts.GPUInfo{
					{UUID: n + "0", Healthy: true}, {UUID: n + "1", Healthy: true}}}, time.Unix(1, 0))
			}
			m.ApplyLedger(contracts.LedgerEntry{Kind: contracts.LedgerCommitted, Allocation: contracts.Allocation{
				ID: "x", NodeID: "a", Pool: "p", Devices: []contracts.DeviceRef{{UUID: "a0"}}}})
			// A hold on b that is then replaced: only the latest counts.
			m.ApplyNodeAdmin("b", &contracts.NodeAdmin{Cordoned: true})
			m.ApplyNodeAdmin("b", nil)
			if tc.admin != nil {
				m.ApplyNodeAdmin("b", tc.admin)
			}
			got := m.Snapshot(time.Time{}).Capacity
			if diff := cmp.Diff([]PoolCapacity{tc.want}, got); diff != "" {
				t.Errorf("capacity (-want +got):\n%s", diff)
			}
		})
	}
}
