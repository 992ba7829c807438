package resourcemanager_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// nodeAdmin returns the node admin bucket, provisioned as the services do.
func (h *harness) nodeAdmin() jetstream.KeyValue {
	h.t.Helper()
	kv, err := h.bus.KeyValue(h.t.Context(), contracts.BucketNodeAdmin)
	if err != nil {
		h.t.Fatal(err)
	}
	return kv
}

func (h *harness) hold(kv jetstream.KeyValue, ad contracts.NodeAdmin) {
	h.t.Helper()
	b, _ := json.Marshal(ad)
	if _, err := kv.Put(h.t.Context(), ad.NodeID, b); err != nil {
		h.t.Fatal(err)
	}
}

// answer waits for a plan item's answer: "" when committed, else the
// refusal's reason and message.
func (h *harness) answer(plan, allocID string) (contracts.Reason, string) {
	h.t.Helper()
	var r contracts.Refusal
	var refused bool
	h.eventually(plan+" "+allocID+" answered", func() bool {
		r, refused = h.refusal(plan, allocID)
		return refused || h.has(allocID, contracts.LedgerCommitted)
	})
	if !refused {
		return "", ""
	}
	return r.Reason, r.Message
}

// TestCordonedNodesRefuseNewWork: holds present at start are applied
// before the first plan; a cordoned or draining node refuses commits with
// node_cordoned naming the administrator's reason, while what it holds is
// still released; lifting a hold (delete, or cordoned false) and holding
// another node at run time take effect.
func TestCordonedNodesRefuseNewWork(t *testing.T) {
	h := newHarness(t)
	kv := h.nodeAdmin()
	h.hold(kv, contracts.NodeAdmin{SchemaVersion: 1, NodeID: "n1", Cordoned: true, Reason: "replacing a PSU"})
	h.hold(kv, contracts.NodeAdmin{SchemaVersion: 1, NodeID: "n2", Cordoned: true, Drain: true, Reason: "kernel upgrade"})
	if _, err := kv.Put(t.Context(), "n4", []byte("{not json")); err != nil {
		t.Fatal(err)
	}
	h.start(h.config("rm-a"))
	h.ready(h100, 4, "n1", "n2", "n3", "n4")

	h.plan("p1", item("j1", 1, "n1", h100, 0), item("j2", 1, "n2", h100, 0), item("j3", 1, "n3", h100, 0), item("j4", 1, "n4", h100, 0))
	for _, tc := range []struct {
		id, want, words string
	}{
		{"acme/j1/1", string(contracts.RefusedNodeCordoned), "node n1 is cordoned by an administrator: replacing a PSU"},
		{"acme/j2/1", string(contracts.RefusedNodeCordoned), "node n2 is being drained by an administrator: kernel upgrade"},
		{"acme/j3/1", "", ""},
		{"acme/j4/1", string(contracts.RefusedNodeCordoned), "unreadable admin record"},
	} {
		reason, msg := h.answer("p1", tc.id)
		if string(reason) != tc.want || !strings.Contains(msg, tc.words) {
			t.Errorf("%s: %q %q; want %q saying %q", tc.id, reason, msg, tc.want, tc.words)
		}
	}

	// n3 is cordoned while it runs j3: new work is refused, j3's end is
	// still released.
	h.hold(kv, contracts.NodeAdmin{SchemaVersion: 1, NodeID: "n3", Cordoned: true, Reason: "flaky NVLink"})
	h.untilAnswered(t, "n3 cordoned", func(i int) contracts.Allocation {
		return item(fmt.Sprintf("probe-n3-%d", i), 1, "n3", h100, 1+i%3)
	}, contracts.RefusedNodeCordoned)
	h.runEvent("n3", contracts.RunEnded, item("j3", 1, "n3", h100, 0), &contracts.RunResult{Outcome: contracts.OutcomeSucceeded}, "")
	h.eventually("j3 released on a cordoned node", func() bool { return h.has("acme/j3/1", contracts.LedgerReleased) })

	// Lifting holds: n1 by deleting its key, n2 by a record that holds
	// nothing.
	if err := kv.Delete(t.Context(), "n1"); err != nil {
		t.Fatal(err)
	}
	h.hold(kv, contracts.NodeAdmin{SchemaVersion: 1, NodeID: "n2", Reason: "upgraded"})
	for _, node := range []string{"n1", "n2"} {
		h.untilAnswered(t, node+" uncordoned", func(i int) contracts.Allocation {
			return item(fmt.Sprintf("probe-%s-%d", node, i), 1, node, h100, i%4)
		}, "")
	}
}

// untilAnswered sends one-item plans made by next (a new allocation each
// time) until one is answered with want ("" = committed): for holds
// changed while the resource manager runs, which it applies a moment
// later. Answers other than want or the state before are errors.
func (h *harness) untilAnswered(t *testing.T, what string, next func(i int) contracts.Allocation, want contracts.Reason) {
	t.Helper()
	for i := range 200 {
		a := next(i)
		plan := fmt.Sprintf("%s-%d", strings.ReplaceAll(what, " ", "-"), i)
		h.plan(plan, a)
		reason, msg := h.answer(plan, a.ID)
		if reason == want {
			return
		}
		if reason != "" && reason != contracts.RefusedNodeCordoned && reason != contracts.RefusedDeviceTaken {
			t.Fatalf("%s: probe %s refused with %s: %s", what, a.ID, reason, msg)
		}
	}
	t.Fatalf("%s: never answered %q", what, want)
}

// hostInventory publishes an inventory with a host size.
func (h *harness) hostInventory(node string, gpus int, cpuMilli, memMiB int64) {
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: node, Hostname: node, Pool: "default", MachineType: "sim",
		Backend: "sim", Incarnation: "i1", Time: h.clock.Now(), CPUMilli: cpuMilli, MemoryMiB: memMiB}
	for i := range gpus {
		inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: gpuUUID(node, i), Model: h100, MemoryMiB: 81920, Healthy: true})
	}
	h.publish(contracts.SubjectInventory(node), contracts.InventoryID(node, "i1", 1), inv)
	h.heartbeat(node, "i1")
	h.eventually("registered "+node, func() bool { return h.hasNodeEvent(node, contracts.NodeRegistered, "i1") })
}

// TestHostCPUAndMemoryAreAccounted: items fit the host's CPU and memory
// less what live allocations hold; a release gives it back; a host of
// unknown size (0) is not checked.
func TestHostCPUAndMemoryAreAccounted(t *testing.T) {
	h := newHarness(t)
	h.start(h.config("rm-a"))
	h.hostInventory("n1", 4, 16000, 65536)
	h.hostInventory("n2", 4, 0, 0)
	sized := func(job string, node string, gpu int, cpu, mem int64) contracts.Allocation {
		a := item(job, 1, node, h100, gpu)
		a.CPUMilli, a.MemoryMiB = cpu, mem
		return a
	}
	big := sized("big", "n1", 0, 12000, 32768)
	h.plan("p1", big,
		sized("cpu", "n1", 1, 8000, 1024),           // 4000 left
		sized("mem", "n1", 2, 1000, 40000),          // 32768 left
		sized("fits", "n1", 3, 4000, 32768),         // exactly the rest
		sized("unknown", "n2", 0, 999000, 16777216), // no size declared
	)
	for id, want := range map[string]contracts.Reason{"acme/big/1": "", "acme/cpu/1": contracts.RefusedHostCapacity,
		"acme/mem/1": contracts.RefusedHostCapacity, "acme/fits/1": "", "acme/unknown/1": ""} {
		if got, msg := h.answer("p1", id); got != want {
			t.Errorf("%s: %q %q, want %q", id, got, msg, want)
		}
	}
	h.runEvent("n1", contracts.RunEnded, big, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded}, "")
	h.eventually("big released", func() bool { return h.has(big.ID, contracts.LedgerReleased) })
	h.plan("p2", sized("cpu", "n1", 1, 8000, 1024))
	if got, msg := h.answer("p2", "acme/cpu/1"); got != "" {
		t.Errorf("after the release: %s %s", got, msg)
	}
}

// gangPart is rank of acme's job over nodes, attempt 1, on the given GPU.
func gangPart(job string, rank int, gpu int, nodes ...string) contracts.Allocation {
	a := item(job, 1, nodes[rank], h100, gpu)
	a.ID = contracts.AllocationPartID("acme", job, 1, rank)
	a.Gang = &contracts.GangPart{Rank: rank, Size: len(nodes), Nodes: nodes}
	return a
}

// TestGangPartsCommitPerNode: the parts of a multi-machine job are
// allocations of their own nodes: a plan of two parts commits both, a
// refused part does not stop the other (all or nothing is the
// scheduler's), and each part is released on its own.
func TestGangPartsCommitPerNode(t *testing.T) {
	h := newHarness(t)
	h.start(h.config("rm-a"))
	h.ready(h100, 2, "n1", "n2")

	g0, g1 := gangPart("train", 0, 0, "n1", "n2"), gangPart("train", 1, 0, "n1", "n2")
	h.plan("p1", g0, g1)
	for _, p := range []contracts.Allocation{g0, g1} {
		if reason, msg := h.answer("p1", p.ID); reason != "" {
			t.Fatalf("part %s refused: %s %s", p.ID, reason, msg)
		}
	}
	h.locked(func() {
		e := h.entriesFor(g1.ID, contracts.LedgerCommitted)[0].entry.Allocation
		if e.NodeID != "n2" || e.Gang == nil || e.Gang.Rank != 1 || e.Gang.Size != 2 || strings.Join(e.Gang.Nodes, ",") != "n1,n2" {
			t.Errorf("committed part %+v does not carry its gang", e)
		}
	})

	// Another gang: its part on n2 finds GPU 0 taken by train; its part
	// on n1 still commits (the scheduler releases it).
	o0, o1 := gangPart("other", 0, 1, "n1", "n2"), gangPart("other", 1, 0, "n1", "n2")
	h.plan("p2", o0, o1)
	if reason, msg := h.answer("p2", o0.ID); reason != "" {
		t.Errorf("part %s refused: %s %s", o0.ID, reason, msg)
	}
	if reason, _ := h.answer("p2", o1.ID); reason != contracts.RefusedDeviceTaken {
		t.Errorf("part %s: %q, want %s", o1.ID, reason, contracts.RefusedDeviceTaken)
	}

	// Parts end one by one.
	for _, p := range []contracts.Allocation{g1, o0, g0} {
		h.runEvent(p.NodeID, contracts.RunEnded, p, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded}, "")
		h.eventually(p.ID+" released", func() bool { return h.has(p.ID, contracts.LedgerReleased) })
	}
}

// share asks for a quarter of GPU gpu of node.
func share(job string, node string, gpu int) contracts.Allocation {
	a := item(job, 1, node, h100, gpu)
	a.Devices[0].Share = &contracts.GPUShare{MemoryMiB: 20480, ComputePercent: 25}
	return a
}

// TestHeldGPUsRefuseNewWork: a GPU held on its own (NodeAdmin.GPUs, as the
// scheduler writes for a sick or hot GPU) refuses any item that includes
// it, a share of it too, with node_cordoned naming the GPU and the cause;
// the node's other GPUs still take work; lifting the hold at run time
// lets the GPU take work again.
func TestHeldGPUsRefuseNewWork(t *testing.T) {
	h := newHarness(t)
	kv := h.nodeAdmin()
	held := gpuUUID("n1", 1)
	h.hold(kv, contracts.NodeAdmin{SchemaVersion: 1, NodeID: "n1", GPUs: map[string]contracts.GPUHold{
		held: {Cordoned: true, Cause: contracts.ReasonGPUUnhealthy, Reason: "XID 79", Alert: "gpu_unhealthy/" + held, Since: h.clock.Now()},
	}})
	h.start(h.config("rm-a"))
	h.ready(h100, 4, "n1")

	tests := map[string]struct {
		item  contracts.Allocation
		want  contracts.Reason
		words string
	}{
		"whole GPU held":         {item: item("whole", 1, "n1", h100, 1), want: contracts.RefusedNodeCordoned, words: "GPU " + held + " on node n1 is cordoned for gpu_unhealthy: XID 79"},
		"held among others":      {item: item("multi", 1, "n1", h100, 0, 1), want: contracts.RefusedNodeCordoned, words: held},
		"share on held GPU":      {item: share("shared", "n1", 1), want: contracts.RefusedNodeCordoned, words: "gpu_unhealthy"},
		"other GPU on same node": {item: item("other", 1, "n1", h100, 2)},
		"share of another GPU":   {item: share("shared-ok", "n1", 3)},
	}
	var items []contracts.Allocation
	for _, tc := range tests {
		items = append(items, tc.item)
	}
	h.plan("p1", items...)
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			reason, msg := h.answer("p1", tc.item.ID)
			if reason != tc.want || !strings.Contains(msg, tc.words) {
				t.Errorf("%s: %q %q; want %q saying %q", tc.item.ID, reason, msg, tc.want, tc.words)
			}
		})
	}

	// The hold is lifted (the alert resolved, or an administrator lifted
	// that GPU's hold): the GPU takes work again.
	h.hold(kv, contracts.NodeAdmin{SchemaVersion: 1, NodeID: "n1", GPUs: map[string]contracts.GPUHold{}})
	h.untilAnswered(t, "n1 GPU 1 lifted", func(i int) contracts.Allocation {
		return item(fmt.Sprintf("probe-%d", i), 1, "n1", h100, 1)
	}, "")
}
