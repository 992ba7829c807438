package state

import (
	"fmt"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestSnapshotHoldsLeaveTheCacheAlone: a snapshot's nodes share their GPUs
// and MIG instance lists with each node's cached snapshot (copy on write).
// Holding devices on one snapshot's nodes (a claim, a preemption's
// decision: whole cards, MIG instances, shares, host CPU and memory)
// changes neither the cache nor another snapshot taken before or after:
// each still equals one built afresh.
func TestSnapshotHoldsLeaveTheCacheAlone(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", "A100-80GB", 81920, 2)
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: "m1", Pool: "p", Incarnation: "i1", Time: h.now}
	for i := range 2 {
		g := contracts.GPUInfo{Index: i, UUID: fmt.Sprintf("m1-gpu%d", i), Model: "A100-80GB", MemoryMiB: 81920,
			Healthy: true, MIGEnabled: true}
		for k := range 3 {
			g.MIGInstances = append(g.MIGInstances, contracts.MIGInstance{UUID: fmt.Sprintf("MIG-m1-%d-%d", i, k),
				Profile: "2g.20gb", GIID: k + 1, CIID: 0, Start: 2 * k, Size: 2, MemoryMiB: 20480})
		}
		inv.GPUs = append(inv.GPUs, g)
	}
	h.fact(func(s *Store) []Publish { s.ApplyInventory(inv); return nil })
	fresh := func() []byte {
		h.st.cluster.noSnapCache = true
		defer func() { h.st.cluster.noSnapCache = false }()
		return mustJSON(t, h.st.cluster.snapshot(h.now))
	}
	want := fresh()
	before := h.st.cluster.snapshot(h.now)
	beforeJSON := mustJSON(t, before)
	for _, devs := range [][]contracts.DeviceRef{
		{{UUID: "n1-gpu0"}},
		{{UUID: "n1-gpu1", Share: &contracts.GPUShare{MemoryMiB: 1024, ComputePercent: 10}}},
		{{UUID: "m1-gpu0", MIG: &contracts.MIGInstance{UUID: "MIG-m1-0-1"}}},
		{{UUID: "m1-gpu1", MIG: &contracts.MIGInstance{UUID: "MIG-m1-1-0"}}, {UUID: "m1-gpu1", MIG: &contracts.MIGInstance{UUID: "MIG-m1-1-2"}}},
	} {
		snap := h.st.cluster.snapshot(h.now)
		for i := range snap.Nodes {
			if snap.Nodes[i].ID == devs[0].UUID[:2] {
				holdOn(&snap.Nodes[i], 1000, 1024, devs)
			}
		}
		if got := mustJSON(t, snap); string(got) == string(want) {
			t.Fatalf("holding %+v changed nothing on the snapshot", devs)
		}
		if diff := cmp.Diff(string(want), string(mustJSON(t, h.st.cluster.snapshot(h.now)))); diff != "" {
			t.Fatalf("after holding %+v, a new snapshot differs from a fresh one (-fresh +cached):\n%s", devs, diff)
		}
		if diff := cmp.Diff(string(beforeJSON), string(mustJSON(t, before))); diff != "" {
			t.Fatalf("after holding %+v, an earlier snapshot changed:\n%s", devs, diff)
		}
	}
}
