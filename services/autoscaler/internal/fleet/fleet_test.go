package fleet

import (
	"testing"

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
