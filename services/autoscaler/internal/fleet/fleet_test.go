package fleet

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

func inv(pool, machineType string, gpus int, model string) contracts.NodeInventory {
	i := contracts.NodeInventory{Pool: pool, MachineType: machineType}
	for range gpus {
		i.GPUs = append(i.GPUs, contracts.GPUInfo{Model: model})
	}
	return i
}

func TestPoolTakesTheMostCommonMachineType(t *testing.T) {
	f := New()
	f.ApplyInventory("n1", inv("h100", "a3-highgpu-8g", 8, "H100-80GB"))
	f.ApplyInventory("n2", inv("h100", "a3-highgpu-8g", 7, "H100-80GB")) // one GPU fell off the bus
	f.ApplyInventory("n3", inv("h100", "a3-highgpu-4g", 4, "H100-80GB"))
	f.ApplyInventory("n4", inv("a100", "a2-highgpu-4g", 4, "A100-80GB"))
	f.ApplyNodeEvent("n1", contracts.NodeEvent{Kind: contracts.NodeLost})
	f.ApplyNodeEvent("n1", contracts.NodeEvent{Kind: contracts.NodeLost}) // redelivered

	got, ok := f.Pool("h100")
	want := Pool{MachineType: "a3-highgpu-8g", GPUs: 8, Model: "H100-80GB", LiveNodes: 2}
	if diff := cmp.Diff(want, got); !ok || diff != "" {
		t.Errorf("Pool(h100) ok=%v (-want +got):\n%s", ok, diff)
	}
	f.ApplyNodeEvent("n1", contracts.NodeEvent{Kind: contracts.NodeReturned})
	if got, _ := f.Pool("h100"); got.LiveNodes != 3 {
		t.Errorf("after n1 returned: %d live nodes, want 3", got.LiveNodes)
	}
	if _, ok := f.Pool("l4"); ok {
		t.Error("Pool(l4) known with no node seen")
	}
}

func TestMachineTypeTieGoesToNameOrder(t *testing.T) {
	f := New()
	f.ApplyInventory("n1", inv("p", "type-b", 8, "L4"))
	f.ApplyInventory("n2", inv("p", "type-a", 4, "L4"))
	if got, _ := f.Pool("p"); got.MachineType != "type-a" || got.GPUs != 4 {
		t.Errorf("Pool(p) = %+v, want type-a with 4 GPUs", got)
	}
}

// LostSince keeps the first loss of an episode (a redelivery or a second
// lost does not restart the grace) and forgets it when the node comes back.
func TestLostSince(t *testing.T) {
	t0 := time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	f := New()
	f.ApplyInventory("n1", inv("l4", "g2", 1, "L4"))
	if _, lost := f.LostSince("n1"); lost {
		t.Fatal("n1 lost before any lost event")
	}
	f.ApplyNodeEvent("n1", contracts.NodeEvent{Kind: contracts.NodeLost, Time: t0})
	f.ApplyNodeEvent("n1", contracts.NodeEvent{Kind: contracts.NodeLost, Time: t0.Add(time.Minute)})
	if since, lost := f.LostSince("n1"); !lost || !since.Equal(t0) {
		t.Errorf("LostSince(n1) = %v, %v; want %v, true", since, lost, t0)
	}
	for _, back := range []contracts.NodeLifecycleKind{contracts.NodeReturned, contracts.NodeRegistered} {
		f.ApplyNodeEvent("n1", contracts.NodeEvent{Kind: contracts.NodeLost, Time: t0})
		f.ApplyNodeEvent("n1", contracts.NodeEvent{Kind: back, Time: t0.Add(time.Second)})
		if _, lost := f.LostSince("n1"); lost {
			t.Errorf("n1 still lost after %s", back)
		}
	}
	if pool, ok := f.PoolOf("n1"); !ok || pool != "l4" {
		t.Errorf("PoolOf(n1) = %q, %v; want l4", pool, ok)
	}
}

// migInv is an inventory of gpus H100s of 80 GB, the first migGPUs of them
// in MIG mode with the given instances each.
func migInv(machineType string, gpus, migGPUs int, profiles ...string) contracts.NodeInventory {
	i := contracts.NodeInventory{Pool: "h100", MachineType: machineType}
	for g := range gpus {
		info := contracts.GPUInfo{Index: g, Model: "H100-80GB", MemoryMiB: 81559, MIGEnabled: g < migGPUs}
		if info.MIGEnabled {
			for _, p := range profiles {
				info.MIGInstances = append(info.MIGInstances, contracts.MIGInstance{Profile: p})
			}
		}
		i.GPUs = append(i.GPUs, info)
	}
	return i
}

// The pool's machine carries the GPU memory and MIG layout of its type's
// typical live node: what MIG and share shapes are sized against.
func TestPoolCarriesTheMIGLayout(t *testing.T) {
	tests := map[string]struct {
		nodes map[string]contracts.NodeInventory
		lost  []string
		want  Pool
	}{
		"no MIG": {
			nodes: map[string]contracts.NodeInventory{"n1": migInv("a3", 8, 0)},
			want:  Pool{MachineType: "a3", GPUs: 8, Model: "H100-80GB", MemoryMiB: 81559, LiveNodes: 1},
		},
		"all GPUs in MIG mode, instances summed per profile": {
			nodes: map[string]contracts.NodeInventory{"n1": migInv("a3", 8, 8, "1g.10gb", "1g.10gb", "3g.40gb")},
			want: Pool{MachineType: "a3", GPUs: 8, Model: "H100-80GB", MemoryMiB: 81559, MIGGPUs: 8,
				MIG: map[string]int{"1g.10gb": 16, "3g.40gb": 8}, LiveNodes: 1},
		},
		"the most common layout of the type wins": {
			nodes: map[string]contracts.NodeInventory{
				"n1": migInv("a3", 8, 4, "7g.80gb"), "n2": migInv("a3", 8, 4, "7g.80gb"), "n3": migInv("a3", 8, 0),
			},
			want: Pool{MachineType: "a3", GPUs: 8, Model: "H100-80GB", MemoryMiB: 81559, MIGGPUs: 4,
				MIG: map[string]int{"7g.80gb": 4}, LiveNodes: 3},
		},
		"live nodes say the layout when some are": {
			nodes: map[string]contracts.NodeInventory{
				"n1": migInv("a3", 8, 4, "7g.80gb"), "n2": migInv("a3", 8, 4, "7g.80gb"), "n3": migInv("a3", 8, 0),
			},
			lost: []string{"n1", "n2"},
			want: Pool{MachineType: "a3", GPUs: 8, Model: "H100-80GB", MemoryMiB: 81559, LiveNodes: 1},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			f := New()
			for id, i := range tc.nodes {
				f.ApplyInventory(id, i)
				f.ApplyInventory(id, i) // redelivered: no change
			}
			for _, id := range tc.lost {
				f.ApplyNodeEvent(id, contracts.NodeEvent{Kind: contracts.NodeLost})
			}
			got, ok := f.Pool("h100")
			if diff := cmp.Diff(tc.want, got); !ok || diff != "" {
				t.Errorf("Pool(h100) ok=%v (-want +got):\n%s", ok, diff)
			}
		})
	}
}
