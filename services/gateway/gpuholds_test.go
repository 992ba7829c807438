package gateway

import (
	"encoding/json"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestGPUHolds: an administrator holds and releases single GPUs; the
// edits merge into the node's document, keeping the platform's holds and
// the node's own; the node endpoints show every hold with its cause and
// deadline; lifting the last hold deletes the key.
func TestGPUHolds(t *testing.T) {
	h := startGateway(t, nil, nil)
	inv := inventory("sim-1", "sim")
	inv.GPUs[7].MIGEnabled = true
	inv.GPUs[7].MIGInstances = []contracts.MIGInstance{{UUID: "MIG-sim-1-7-a", Profile: "3g.40gb", Start: 0, Size: 4}}
	h.publishInventory(inv, 1)
	h.waitNode("sim-1")

	// The platform's holds: a spot drain with its deadline, and the
	// scheduler's hold of a sick GPU.
	deadline := time.Now().Add(2 * time.Minute).UTC().Truncate(time.Second)
	since := time.Now().UTC().Truncate(time.Second)
	platform := contracts.NodeAdmin{SchemaVersion: 1, NodeID: "sim-1", Cordoned: true, Drain: true,
		Cause: contracts.ReasonSpotInterruption, Reason: "reclaim notice", Deadline: &deadline,
		GPUs: map[string]contracts.GPUHold{"GPU-sim-1-0": {Cordoned: true, Cause: contracts.ReasonGPUUnhealthy, Reason: "XID 79",
			Alert: "gpu_unhealthy/GPU-sim-1-0", Since: since}}}
	b, _ := json.Marshal(platform)
	h.kvPut(contracts.BucketNodeAdmin, "sim-1", b)
	var st contracts.NodeStatus
	h.eventually("the platform's holds shown", func() bool {
		h.do(http.MethodGet, "/v1/nodes/sim-1", "", fresh(&st))
		return st.Admin != nil && st.Admin.Cause == contracts.ReasonSpotInterruption
	})
	if st.Admin.Deadline == nil || !st.Admin.Deadline.Equal(deadline) || st.Admin.GPUs["GPU-sim-1-0"].Cause != contracts.ReasonGPUUnhealthy {
		t.Fatalf("GET shows %+v", st.Admin)
	}
	var list contracts.NodeList
	if h.do(http.MethodGet, "/v1/nodes", "", fresh(&list)); len(list.Nodes) != 1 || list.Nodes[0].Admin == nil ||
		list.Nodes[0].Admin.GPUs["GPU-sim-1-0"].Reason != "XID 79" {
		t.Fatalf("list: %+v", list.Nodes)
	}

	// An administrator holds GPU 3 by hand and drains GPU 5: the node's
	// hold and GPU 0's stay as the platform wrote them.
	if status, body := h.do(http.MethodPost, "/v1/nodes/sim-1/gpus/GPU-sim-1-3/cordon", `{"reason":"fan noise"}`, fresh(&st)); status != 200 {
		t.Fatalf("cordon GPU 3: %d %s", status, body)
	}
	if status, body := h.do(http.MethodPost, "/v1/nodes/sim-1/gpus/GPU-sim-1-5/drain", "", fresh(&st)); status != 200 {
		t.Fatalf("drain GPU 5: %d %s", status, body)
	}
	var stored contracts.NodeAdmin
	if _, err := h.kvGet(contracts.BucketNodeAdmin, "sim-1", &stored); err != nil {
		t.Fatal(err)
	}
	if !cmp.Equal(*st.Admin, stored, cmpTime) {
		t.Fatalf("answered %+v, stored %+v", st.Admin, stored)
	}
	want := map[string]string{"GPU-sim-1-0": "cordoned/gpu_unhealthy/XID 79", "GPU-sim-1-3": "cordoned//fan noise", "GPU-sim-1-5": "drain//"}
	if diff := cmp.Diff(want, holdsOf(stored)); diff != "" || !stored.Drain || stored.Cause != contracts.ReasonSpotInterruption ||
		stored.Deadline == nil || stored.GPUs["GPU-sim-1-3"].Since.IsZero() {
		t.Fatalf("stored %+v (-want +got):\n%s", stored, diff)
	}
	// Cordoning GPU 3 again changes nothing.
	first := stored.GPUs["GPU-sim-1-3"]
	if h.do(http.MethodPost, "/v1/nodes/sim-1/gpus/GPU-sim-1-3/cordon", "", fresh(&st)); !cmp.Equal(st.Admin.GPUs["GPU-sim-1-3"], first, cmpTime) {
		t.Fatalf("second cordon changed the hold: %+v, was %+v", st.Admin.GPUs["GPU-sim-1-3"], first)
	}

	// An administrator's cordon of the node keeps the GPU holds and the
	// deadline; the node's hold becomes the administrator's.
	if status, body := h.do(http.MethodPost, "/v1/nodes/sim-1/cordon", `{"reason":"taking over"}`, fresh(&st)); status != 200 ||
		st.Admin.Cause != "" || st.Admin.Drain || st.Admin.Deadline == nil || len(st.Admin.GPUs) != 3 {
		t.Fatalf("node cordon over GPU holds: %d %s", status, body)
	}

	// Lifting GPU 0's hold (the scheduler's) and GPU 5's; again is a no-op.
	for _, gpu := range []string{"GPU-sim-1-0", "GPU-sim-1-5", "GPU-sim-1-5"} {
		if status, body := h.do(http.MethodPost, "/v1/nodes/sim-1/gpus/"+gpu+"/uncordon", "", fresh(&st)); status != 200 {
			t.Fatalf("uncordon %s: %d %s", gpu, status, body)
		}
	}
	if diff := cmp.Diff(map[string]string{"GPU-sim-1-3": "cordoned//fan noise"}, holdsOf(*st.Admin)); diff != "" || !st.Admin.Cordoned {
		t.Fatalf("after two GPU uncordons (-want +got):\n%s", diff)
	}
	// Once the node and its last GPU are released, the key is gone.
	if status, body := h.do(http.MethodPost, "/v1/nodes/sim-1/uncordon", "", fresh(&st)); status != 200 || st.Admin != nil {
		t.Fatalf("uncordon node: %d %s", status, body)
	}
	h.do(http.MethodPost, "/v1/nodes/sim-1/gpus/GPU-sim-1-2/cordon", "", fresh(&st))
	if status, body := h.do(http.MethodPost, "/v1/nodes/sim-1/gpus/GPU-sim-1-2/uncordon", "", fresh(&st)); status != 200 || st.Admin != nil {
		t.Fatalf("uncordon of the last GPU: %d %s", status, body)
	}
	if _, err := h.kvGet(contracts.BucketNodeAdmin, "sim-1", &stored); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("hold still in KV after the last GPU was released: %v", err)
	}
	if h.do(http.MethodGet, "/v1/nodes/sim-1", "", fresh(&st)); st.Admin != nil {
		t.Fatalf("GET after the last release: %+v", st.Admin)
	}

	// A GPU hold on a node no agent announces can still be lifted.
	gone, _ := json.Marshal(contracts.NodeAdmin{SchemaVersion: 1, NodeID: "gone-1",
		GPUs: map[string]contracts.GPUHold{"GPU-gone-1-0": {Cordoned: true, Cause: contracts.ReasonOverheating}}})
	h.kvPut(contracts.BucketNodeAdmin, "gone-1", gone)
	if status, body := h.do(http.MethodPost, "/v1/nodes/gone-1/gpus/GPU-gone-1-0/uncordon", "", fresh(&st)); status != 200 || st.Admin != nil {
		t.Fatalf("uncordon a GPU of a node without inventory: %d %s", status, body)
	}
	// A GPU edit does not replace an unreadable hold (the resource manager
	// holds the whole node on it).
	h.kvPut(contracts.BucketNodeAdmin, "sim-1", []byte("{garbled"))

	tests := map[string]refusal{
		"bad node id":          {http.MethodPost, "/v1/nodes/a.b/gpus/GPU-sim-1-1/cordon", "", 400, contracts.ReasonInvalidID, "node", "invalid id"},
		"bad uuid":             {http.MethodPost, "/v1/nodes/sim-1/gpus/GPU.1/cordon", "", 400, contracts.ReasonInvalidID, "uuid", "invalid GPU UUID"},
		"bad uuid, uncordon":   {http.MethodPost, "/v1/nodes/sim-1/gpus/-x/uncordon", "", 400, contracts.ReasonInvalidID, "uuid", "invalid GPU UUID"},
		"unknown node":         {http.MethodPost, "/v1/nodes/ghost/gpus/GPU-ghost-0/cordon", "", 404, contracts.ReasonUnknownNode, "", "no node ghost"},
		"unknown node, lift":   {http.MethodPost, "/v1/nodes/ghost/gpus/GPU-ghost-0/uncordon", "", 404, contracts.ReasonUnknownNode, "", "no node ghost"},
		"unknown GPU":          {http.MethodPost, "/v1/nodes/sim-1/gpus/GPU-sim-1-9/drain", "", 404, contracts.RefusedUnknownDevice, "uuid", "node sim-1 has no GPU GPU-sim-1-9"},
		"MIG instance":         {http.MethodPost, "/v1/nodes/sim-1/gpus/MIG-sim-1-7-a/cordon", "", 400, contracts.ReasonInvalidValue, "uuid", "name GPU-sim-1-7"},
		"unknown field":        {http.MethodPost, "/v1/nodes/sim-1/gpus/GPU-sim-1-1/cordon", `{"why":"x"}`, 400, contracts.ReasonUnknownField, "why", "invalid node hold"},
		"over an unreadable":   {http.MethodPost, "/v1/nodes/sim-1/gpus/GPU-sim-1-1/cordon", "", 409, contracts.ReasonConflict, "", "does not decode"},
		"get cordon":           {http.MethodGet, "/v1/nodes/sim-1/gpus/GPU-sim-1-1/cordon", "", 405, contracts.ReasonMethodNotAllowed, "", "allowed: POST"},
		"no GPU in the path":   {http.MethodPost, "/v1/nodes/sim-1/gpus//cordon", "", 404, contracts.ReasonNotFound, "", "no such path"},
		"unknown GPU, no hold": {http.MethodPost, "/v1/nodes/gone-1/gpus/GPU-gone-1-0/uncordon", "", 404, contracts.ReasonUnknownNode, "", "no node gone-1"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) { h.refused(t, tt) })
	}
	if _, err := h.kvGet(contracts.BucketNodeAdmin, "ghost", &stored); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("a refused hold was stored: %v", err)
	}
}

// holdsOf summarises a document's GPU holds: state/cause/reason by UUID.
func holdsOf(a contracts.NodeAdmin) map[string]string {
	out := map[string]string{}
	for uuid, g := range a.GPUs {
		state := "cordoned"
		if g.Drain {
			state = "drain"
		}
		out[uuid] = state + "/" + string(g.Cause) + "/" + g.Reason
	}
	return out
}
