package gateway

import (
	"context"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// inventory is an 8-GPU simulated H100 machine, or one on real GPUs.
func inventory(node, backend string) contracts.NodeInventory {
	inv := contracts.NodeInventory{SchemaVersion: contracts.SchemaVersion, NodeID: node, Hostname: node, Pool: "h100",
		MachineType: "p5.48xlarge", Backend: backend, DriverVersion: "550.54.15", CUDAVersion: "12.4",
		Incarnation: "inc-1", Time: time.Now().UTC().Truncate(time.Millisecond)}
	for i := range 8 {
		inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: "GPU-" + node + "-" + strconv.Itoa(i), Model: "H100-80GB",
			MemoryMiB: 81559, Healthy: true, ComputeCapability: "9.0"})
	}
	return inv
}

func (h *harness) publishInventory(inv contracts.NodeInventory, version int) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := h.bus.Publish(ctx, contracts.SubjectInventory(inv.NodeID), contracts.InventoryID(inv.NodeID, inv.Incarnation, version), inv); err != nil {
		h.t.Fatalf("publish inventory: %v", err)
	}
}

func (h *harness) waitNode(node string) {
	h.t.Helper()
	h.eventually("node "+node+" known", func() bool {
		status, _ := h.do(http.MethodGet, "/v1/nodes/"+node, "", nil)
		return status == http.StatusOK
	})
}

// TestNodesFromInventoryAndLifecycle: the latest inventory of each node
// and its last lifecycle fact, the history replayed before the gateway
// was ready included.
func TestNodesFromInventoryAndLifecycle(t *testing.T) {
	old := inventory("sim-1", "sim")
	old.DriverVersion = "535.0"
	latest := inventory("sim-1", "sim")
	latest.GPUs[3].Healthy = false
	h := startGateway(t, nil, func(h *harness) {
		h.publishInventory(old, 1)
		h.publishInventory(latest, 2)
	})
	h.publishInventory(inventory("a100-1", "sim"), 1)
	at := time.Now().UTC().Truncate(time.Millisecond)
	if _, err := h.bus.Publish(context.Background(), contracts.SubjectNodeLifecycle("sim-1"), "node/lost/sim-1/1",
		contracts.NodeEvent{SchemaVersion: 1, Kind: contracts.NodeLost, NodeID: "sim-1", Pool: "h100", Time: at}); err != nil {
		t.Fatal(err)
	}
	var st contracts.NodeStatus
	h.eventually("sim-1 lost", func() bool {
		h.do(http.MethodGet, "/v1/nodes/sim-1", "", &st)
		return st.Lifecycle == contracts.NodeLost
	})
	if diff := cmp.Diff(contracts.NodeStatus{NodeInventory: latest, Lifecycle: contracts.NodeLost, LifecycleAt: at}, st); diff != "" {
		t.Fatalf("GET node (-want +got):\n%s", diff)
	}
	var list contracts.NodeList
	h.eventually("two nodes", func() bool {
		h.do(http.MethodGet, "/v1/nodes", "", &list)
		return len(list.Nodes) == 2
	})
	if list.Nodes[0].NodeID != "a100-1" || list.Nodes[1].NodeID != "sim-1" {
		t.Fatalf("nodes %s, %s; want a100-1, sim-1", list.Nodes[0].NodeID, list.Nodes[1].NodeID)
	}
	for path, want := range map[string]struct {
		status int
		reason contracts.Reason
	}{
		"/v1/nodes/nope":      {404, contracts.ReasonUnknownNode},
		"/v1/nodes/a.b":       {400, contracts.ReasonInvalidID},
		"/v1/nodes?pool=H.1":  {400, contracts.ReasonInvalidValue},
		"/v1/nodes/x/faults":  {405, contracts.ReasonMethodNotAllowed},
		"/v1/nodes/x/faultsy": {404, contracts.ReasonNotFound},
	} {
		var apiErr contracts.APIError
		if status, body := h.do(http.MethodGet, path, "", &apiErr); status != want.status || apiErr.Error.Reason != want.reason {
			t.Errorf("GET %s: %d %s, want %d %s", path, status, body, want.status, want.reason)
		}
	}
	var pool contracts.NodeList
	if h.do(http.MethodGet, "/v1/nodes?pool=none", "", &pool); len(pool.Nodes) != 0 {
		t.Errorf("pool none has %d nodes", len(pool.Nodes))
	}
}

// TestFaultRequestsValidated is the catalogue of bad fault requests: each
// gets its specific reason on its field, and no command reaches the bus.
func TestFaultRequestsValidated(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.publishInventory(inventory("sim-1", "sim"), 1)
	h.publishInventory(inventory("real-1", "nvml"), 1)
	h.waitNode("sim-1")
	h.waitNode("real-1")
	tests := map[string]struct {
		node, body string
		status     int
		reason     contracts.Reason
		field      string
	}{
		"empty body":              {"sim-1", ``, 400, contracts.ReasonEmptyBody, ""},
		"not json":                {"sim-1", `xid`, 400, contracts.ReasonInvalidJSON, ""},
		"truncated":               {"sim-1", `{"kind":`, 400, contracts.ReasonInvalidJSON, ""},
		"trailing data":           {"sim-1", `{"kind":"xid"} {}`, 400, contracts.ReasonInvalidJSON, ""},
		"unknown field":           {"sim-1", `{"kind":"xid","gpus":1}`, 400, contracts.ReasonUnknownField, "gpus"},
		"missing kind":            {"sim-1", `{"gpu":"1"}`, 400, contracts.ReasonMissingField, "kind"},
		"unknown kind":            {"sim-1", `{"kind":"meteor"}`, 400, contracts.ReasonInvalidValue, "kind"},
		"kind as number":          {"sim-1", `{"kind":7}`, 400, contracts.ReasonInvalidType, "kind"},
		"gpu as number":           {"sim-1", `{"kind":"xid","gpu":3}`, 400, contracts.ReasonInvalidType, "gpu"},
		"gpu index out of range":  {"sim-1", `{"kind":"xid","gpu":"8"}`, 400, contracts.ReasonOutOfRange, "gpu"},
		"gpu unknown uuid":        {"sim-1", `{"kind":"ecc_dbe","gpu":"GPU-nope"}`, 400, contracts.RefusedUnknownDevice, "gpu"},
		"gpu of another node":     {"sim-1", `{"kind":"overheat","gpu":"GPU-real-1-0"}`, 400, contracts.RefusedUnknownDevice, "gpu"},
		"gpu on machine death":    {"sim-1", `{"kind":"machine_death","gpu":"1"}`, 400, contracts.ReasonInvalidValue, "gpu"},
		"code on ecc":             {"sim-1", `{"kind":"ecc_dbe","code":48}`, 400, contracts.ReasonInvalidValue, "code"},
		"negative xid":            {"sim-1", `{"kind":"xid","code":-1}`, 400, contracts.ReasonOutOfRange, "code"},
		"xid too large":           {"sim-1", `{"kind":"xid","code":65536}`, 400, contracts.ReasonOutOfRange, "code"},
		"code as string":          {"sim-1", `{"kind":"xid","code":"79"}`, 400, contracts.ReasonInvalidType, "code"},
		"bad duration":            {"sim-1", `{"kind":"agent_pause","duration":"soon"}`, 400, contracts.ReasonInvalidDuration, "duration"},
		"negative duration":       {"sim-1", `{"kind":"overheat","duration":"-5s"}`, 400, contracts.ReasonInvalidDuration, "duration"},
		"duration on xid":         {"sim-1", `{"kind":"xid","duration":"30s"}`, 400, contracts.ReasonInvalidValue, "duration"},
		"duration too long":       {"sim-1", `{"kind":"agent_pause","duration":"48h"}`, 400, contracts.ReasonOutOfRange, "duration"},
		"several problems":        {"sim-1", `{"kind":"meteor","code":-1,"duration":"x"}`, 400, contracts.ReasonInvalidRequest, "duration"},
		"unknown node":            {"nope", `{"kind":"xid"}`, 404, contracts.ReasonUnknownNode, ""},
		"bad node id":             {"a.b", `{"kind":"xid"}`, 400, contracts.ReasonInvalidID, "node"},
		"node on real GPUs":       {"real-1", `{"kind":"xid"}`, 409, contracts.ReasonNotSimulated, ""},
		"bad body, unknown node":  {"nope", `{"kind":"meteor"}`, 400, contracts.ReasonInvalidValue, "kind"},
		"oversized body":          {"sim-1", `{"kind":"xid","gpu":"` + string(make([]byte, maxFaultBody)) + `"}`, 413, contracts.ReasonTooLarge, ""},
		"gpu uuid of real on sim": {"sim-1", `{"kind":"clear","gpu":"GPU-real-1-3"}`, 400, contracts.RefusedUnknownDevice, "gpu"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			h.postRefused(t, "/v1/nodes/"+tt.node+"/faults", tt.body, tt.status, tt.reason, tt.field)
		})
	}
	if n := h.streamMsgs(contracts.StreamNodeCommands); n != 0 {
		t.Fatalf("a refused fault reached the bus: NODE_COMMANDS holds %d messages", n)
	}
}

// TestFaultLandsOnTheNodesCommandSubject: an accepted fault is one
// inject_fault command for the node, with a new fault ID and its
// FaultCommandID; every request is a new fault.
func TestFaultLandsOnTheNodesCommandSubject(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.publishInventory(inventory("sim-1", "sim"), 1)
	h.waitNode("sim-1")
	tests := []struct {
		body string
		want contracts.Fault
	}{
		{`{"kind":"xid","gpu":"3","code":79}`, contracts.Fault{Kind: contracts.FaultXID, GPU: "3", Code: 79}},
		{`{"kind":"xid"}`, contracts.Fault{Kind: contracts.FaultXID}},
		{`{"kind":"ecc_dbe","gpu":"GPU-sim-1-5"}`, contracts.Fault{Kind: contracts.FaultECCDBE, GPU: "GPU-sim-1-5"}},
		{`{"kind":"overheat","gpu":"0","duration":"2m"}`, contracts.Fault{Kind: contracts.FaultOverheat, GPU: "0", Duration: contracts.Duration(2 * time.Minute)}},
		{`{"kind":"agent_pause","duration":"45s"}`, contracts.Fault{Kind: contracts.FaultAgentPause, Duration: contracts.Duration(45 * time.Second)}},
		{`{"kind":"machine_death"}`, contracts.Fault{Kind: contracts.FaultMachineDeath}},
		{`{"kind":"clear"}`, contracts.Fault{Kind: contracts.FaultClear}},
		{`{"kind":"clear"}`, contracts.Fault{Kind: contracts.FaultClear}}, // again: a second fault
	}
	seen := map[string]bool{}
	for i, tt := range tests {
		var res contracts.FaultResponse
		if status, body := h.do(http.MethodPost, "/v1/nodes/sim-1/faults", tt.body, &res); status != http.StatusAccepted {
			t.Fatalf("%s: %d %s", tt.body, status, body)
		}
		if res.NodeID != "sim-1" || res.Stream != contracts.StreamNodeCommands || res.Sequence != uint64(i+1) ||
			contracts.ValidateID(res.Fault.ID) != nil || seen[res.Fault.ID] {
			t.Fatalf("%s answered %+v; want a new fault ID at NODE_COMMANDS #%d", tt.body, res, i+1)
		}
		seen[res.Fault.ID] = true
		want := tt.want
		want.ID = res.Fault.ID
		if diff := cmp.Diff(want, res.Fault); diff != "" {
			t.Errorf("%s: fault in the answer (-want +got):\n%s", tt.body, diff)
		}
		msgs := h.messages(contracts.StreamNodeCommands, contracts.SubjectNodeCommandsAll)
		m := msgs[len(msgs)-1]
		if m.Subject != contracts.SubjectNodeCommands("sim-1") || m.ID() != contracts.FaultCommandID("sim-1", res.Fault.ID) || m.StreamSeq != res.Sequence {
			t.Fatalf("command on %s with Nats-Msg-Id %q at #%d; want %s, %q, #%d", m.Subject, m.ID(), m.StreamSeq,
				contracts.SubjectNodeCommands("sim-1"), contracts.FaultCommandID("sim-1", res.Fault.ID), res.Sequence)
		}
		var cmd contracts.NodeCommand
		if err := m.Decode(&cmd); err != nil {
			t.Fatal(err)
		}
		if cmd.Kind != contracts.CommandInjectFault || cmd.SchemaVersion != contracts.SchemaVersion || cmd.AllocationID != "" ||
			cmd.Fault == nil || cmd.Time.IsZero() {
			t.Fatalf("command %+v", cmd)
		}
		if diff := cmp.Diff(want, *cmd.Fault); diff != "" {
			t.Errorf("%s: fault on the bus (-want +got):\n%s", tt.body, diff)
		}
	}
}
