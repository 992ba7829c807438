package readmodel

import (
	"testing"
	"time"

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
