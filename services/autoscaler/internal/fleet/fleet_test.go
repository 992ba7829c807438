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
