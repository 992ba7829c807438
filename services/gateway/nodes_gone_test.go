package gateway

import (
	"context"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// publishMachineEvent publishes one autoscaler machine event as the
// autoscaler does (SubjectMachines, MachineEventID).
func (h *harness) publishMachineEvent(ev contracts.MachineEvent) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := h.bus.Publish(ctx, contracts.SubjectMachines(ev.Pool), contracts.MachineEventID(ev.Kind, ev.MachineID), ev); err != nil {
		h.t.Fatalf("publish machine event: %v", err)
	}
}

// nodeIDs is GET /v1/nodes (of pool, "" for all) as node IDs.
func (h *harness) nodeIDs(pool string) []string {
	h.t.Helper()
	path := "/v1/nodes"
	if pool != "" {
		path += "?pool=" + pool
	}
	var list contracts.NodeList
	if status, body := h.do(http.MethodGet, path, "", &list); status != http.StatusOK {
		h.t.Fatalf("GET %s: %d %s", path, status, body)
	}
	ids := []string{}
	for _, n := range list.Nodes {
		ids = append(ids, n.NodeID)
	}
	return ids
}

// TestMachinesTakenAwayLeaveTheFleet: a machine the autoscaler scaled
// down (or its provider reclaimed) stops heartbeating, so the resource
// manager calls its node lost, and the fleet listing showed it as lost
// for ever. It left on purpose: it is no longer listed (nor counted in
// its pool), GET of it says where it went, and the same node ID on a new
// machine (a later inventory) is listed again. What the streams held
// before the gateway started is applied before it answers.
func TestMachinesTakenAwayLeaveTheFleet(t *testing.T) {
	t0 := time.Now().UTC().Add(-time.Minute).Truncate(time.Millisecond)
	spot := func(node string, at time.Time) contracts.NodeInventory {
		inv := inventory(node, "sim")
		inv.Pool, inv.Time = "l4-spot", at
		return inv
	}
	h := startGateway(t, nil, func(h *harness) {
		h.publishInventory(spot("l4-spot-1", t0), 1)
		h.publishInventory(spot("l4-spot-2", t0), 1)
		h.publishMachineEvent(contracts.MachineEvent{SchemaVersion: 1, Kind: contracts.MachineDeleted, Pool: "l4-spot",
			MachineID: "l4-spot-1", NodeID: "l4-spot-1", Message: "idle, drained and deleted", Time: t0.Add(10 * time.Second)})
		// The resource manager's verdict on the silence that follows.
		if _, err := h.bus.Publish(context.Background(), contracts.SubjectNodeLifecycle("l4-spot-1"), "node/lost/l4-spot-1/1",
			contracts.NodeEvent{SchemaVersion: 1, Kind: contracts.NodeLost, NodeID: "l4-spot-1", Pool: "l4-spot",
				Reason: "no heartbeat", Time: t0.Add(20 * time.Second)}); err != nil {
			t.Fatal(err)
		}
	})
	// Ready means caught up: no wait.
	if got := h.nodeIDs(""); !slices.Equal(got, []string{"l4-spot-2"}) {
		t.Fatalf("nodes at start %v, want [l4-spot-2]: l4-spot-1 was scaled down", got)
	}

	h.publishMachineEvent(contracts.MachineEvent{SchemaVersion: 1, Kind: contracts.MachineReclaimed, Pool: "l4-spot",
		MachineID: "l4-spot-2", NodeID: "l4-spot-2", Message: "the provider took the machine back", Time: t0.Add(30 * time.Second)})
	h.eventually("l4-spot-2 gone", func() bool { return len(h.nodeIDs("l4-spot")) == 0 })
	for node, want := range map[string]string{
		"l4-spot-1": "no node l4-spot-1: its machine l4-spot-1 was deleted by the autoscaler at",
		"l4-spot-2": "no node l4-spot-2: its machine l4-spot-2 was reclaimed by its provider at",
	} {
		var apiErr contracts.APIError
		status, body := h.do(http.MethodGet, "/v1/nodes/"+node, "", &apiErr)
		if status != http.StatusNotFound || apiErr.Error.Reason != contracts.ReasonUnknownNode || !strings.HasPrefix(apiErr.Error.Message, want) {
			t.Errorf("GET %s: %d %s; want 404 unknown_node %q...", node, status, body, want)
		}
	}
	var pools contracts.PoolList
	if status, body := h.do(http.MethodGet, "/v1/pools", "", &pools); status != http.StatusOK {
		t.Fatalf("GET /v1/pools: %d %s", status, body)
	}
	for _, p := range pools.Pools {
		if p.Pool == "l4-spot" && p.Nodes != 0 {
			t.Errorf("pool l4-spot counts %d nodes, want 0", p.Nodes)
		}
	}

	// The same node ID on a new machine: its inventory is later than the
	// deletion.
	back := spot("l4-spot-1", time.Now().UTC().Truncate(time.Millisecond))
	back.Incarnation = "inc-2"
	h.publishInventory(back, 1)
	h.eventually("l4-spot-1 back", func() bool { return slices.Equal(h.nodeIDs(""), []string{"l4-spot-1"}) })
	h.waitNode("l4-spot-1")
}

// TestMachineEventsOnlyTakeAwayWhatLeft: only deleted and reclaimed take
// a node away, only one that names it, and an older event than the last
// changes nothing.
func TestMachineEventsOnlyTakeAwayWhatLeft(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	tests := []struct {
		name   string
		events []contracts.MachineEvent
		listed bool
	}{
		{"deleted after the inventory", []contracts.MachineEvent{{Kind: contracts.MachineDeleted, NodeID: "n", Time: t0.Add(time.Second)}}, false},
		{"reclaimed after the inventory", []contracts.MachineEvent{{Kind: contracts.MachineReclaimed, NodeID: "n", Time: t0.Add(time.Second)}}, false},
		{"deleted before the inventory", []contracts.MachineEvent{{Kind: contracts.MachineDeleted, NodeID: "n", Time: t0.Add(-time.Second)}}, true},
		{"an older deletion after a newer one", []contracts.MachineEvent{
			{Kind: contracts.MachineDeleted, NodeID: "n", Time: t0.Add(time.Second)},
			{Kind: contracts.MachineDeleted, NodeID: "n", Time: t0.Add(-time.Second)}}, false},
		{"draining", []contracts.MachineEvent{{Kind: contracts.MachineDraining, NodeID: "n", Time: t0.Add(time.Second)}}, true},
		{"interrupted", []contracts.MachineEvent{{Kind: contracts.MachineInterrupted, NodeID: "n", Time: t0.Add(time.Second)}}, true},
		{"failed", []contracts.MachineEvent{{Kind: contracts.MachineFailed, NodeID: "n", Time: t0.Add(time.Second)}}, true},
		{"another node deleted", []contracts.MachineEvent{{Kind: contracts.MachineDeleted, NodeID: "m", Time: t0.Add(time.Second)}}, true},
		{"deleted naming no node", []contracts.MachineEvent{{Kind: contracts.MachineDeleted, Time: t0.Add(time.Second)}}, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := newNodeModel()
			inv := inventory("n", "sim")
			inv.Time = t0
			m.applyInventory(inv, 1)
			for _, ev := range tc.events {
				m.applyMachineEvent(ev)
			}
			_, listed := m.node("n")
			_, gone := m.gone("n")
			if listed != tc.listed || len(m.list("")) != map[bool]int{true: 1}[tc.listed] || gone == tc.listed {
				t.Fatalf("listed %v (list %d), gone %v; want listed %v", listed, len(m.list("")), gone, tc.listed)
			}
		})
	}
}
