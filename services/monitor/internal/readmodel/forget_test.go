package readmodel

import (
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// nodeState is how many entries the model keeps per node and per GPU.
func nodeState(m *Model) (gpus, seen, nodes, beats int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.gpus), len(m.nodeSeen), len(m.nodes), len(m.beats)
}

// join makes node id known the way a machine joining does: inventory,
// telemetry of its GPUs and a heartbeat, all at at.
func join(m *Model, id string, gpus int, at time.Time) {
	inv := contracts.NodeInventory{Pool: "spot"}
	tel := contracts.Telemetry{Hostname: "host-" + id, Pool: "spot"}
	for i := range gpus {
		uuid := fmt.Sprintf("GPU-%s-%d", id, i)
		inv.GPUs = append(inv.GPUs, contracts.GPUInfo{UUID: uuid, Healthy: true})
		tel.GPUs = append(tel.GPUs, contracts.GPUSample{Index: i, UUID: uuid})
	}
	m.ApplyInventory(id, inv, at)
	m.ApplyNodeEvent(id, contracts.NodeEvent{Kind: contracts.NodeRegistered, Pool: "spot"})
	m.ApplyTelemetry(id, tel, at)
	m.ApplyHeartbeat(id, at)
}

// TestChurnKeepsNodesBounded churns spot machines through the model as the
// monitor sees them: every 10 s a machine of 8 GPUs joins, beats and sends
// telemetry for 10 s, and is deleted; the monitor forgets departed nodes
// every second, a silent period after they left. What the model keeps must
// stay bounded by the machines within that period, not grow with every
// machine ever seen.
func TestChurnKeepsNodesBounded(t *testing.T) {
	const (
		machines = 300
		gpusPer  = 8
		lifetime = 10 * time.Second
		silent   = 30 * time.Second
	)
	m := New()
	// The machine alive, those departed within the silent period, and the
	// one joining.
	bound := int(silent/lifetime) + 2
	end := time.Duration(machines)*lifetime + 2*silent
	maxNodes := 0
	for d := time.Duration(0); d <= end; d += time.Second {
		now := t0.Add(d)
		if i := int(d / lifetime); i < machines {
			id := fmt.Sprintf("spot-%d", i)
			if d%lifetime == 0 && i > 0 {
				prev := fmt.Sprintf("spot-%d", i-1)
				m.ApplyNodeLeft(prev, now)
				// The resource manager declares a departed machine lost
				// once its heartbeats stop, which may come after the
				// model forgot it (as here, long after).
				m.ApplyNodeEvent(fmt.Sprintf("spot-%d", i-5), contracts.NodeEvent{Kind: contracts.NodeLost, Pool: "spot"})
			}
			join(m, id, gpusPer, now)
		} else if d == time.Duration(machines)*lifetime {
			m.ApplyNodeLeft(fmt.Sprintf("spot-%d", machines-1), now)
		}
		m.Forget(now.Add(-silent))
		gpus, seen, nodes, beats := nodeState(m)
		if gpus > bound*gpusPer || seen > bound || nodes > bound || beats > bound {
			t.Fatalf("at %s: %d GPUs, %d nodes seen, %d nodes, %d heartbeat records; want at most %d nodes of %d GPUs",
				d, gpus, seen, nodes, beats, bound, gpusPer)
		}
		maxNodes = max(maxNodes, nodes)
	}
	if maxNodes < 2 {
		t.Fatalf("never held more than %d node: the test churns nothing", maxNodes)
	}
	if gpus, seen, nodes, beats := nodeState(m); gpus+seen+nodes+beats != 0 {
		t.Errorf("after every machine left: %d GPUs, %d nodes seen, %d nodes, %d heartbeat records; want none",
			gpus, seen, nodes, beats)
	}
	s := m.Snapshot(time.Time{})
	if len(s.GPUs) != 0 || len(s.Heartbeats) != 0 || len(s.Pools) != 0 || len(s.Capacity) != 0 {
		t.Errorf("after every machine left, the snapshot still shows GPUs %v, heartbeats %v, pools %v, capacity %v",
			s.GPUs, s.Heartbeats, s.Pools, s.Capacity)
	}
}

// TestForget covers what is forgotten and when, and what is not.
func TestForget(t *testing.T) {
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	m := New()
	join(m, "gone", 2, at(0))    // leaves at 5 s
	join(m, "silent", 2, at(0))  // goes quiet without leaving
	join(m, "back", 2, at(0))    // leaves at 5 s, back on a new machine at 7 s
	join(m, "stays", 2, at(0))   // beats on
	join(m, "late-hb", 1, at(0)) // leaves at 5 s, but beats on past it
	for _, id := range []string{"gone", "back", "late-hb"} {
		m.ApplyNodeLeft(id, at(5))
	}
	join(m, "back", 2, at(7))
	m.ApplyHeartbeat("late-hb", at(6))
	m.ApplyHeartbeat("stays", at(9))

	// A departed machine's GPUs go from the snapshot at once, before they
	// would go stale.
	s := m.Snapshot(at(0))
	for _, g := range s.GPUs {
		if g.NodeID == "gone" {
			t.Errorf("snapshot shows GPU %s of a departed node", g.Sample.UUID)
		}
	}

	// Not yet a silent period past the departure: nothing is dropped.
	if n := m.Forget(at(4)); n != 0 {
		t.Fatalf("Forget(4s) dropped %d nodes; want none before anyone left", n)
	}
	if n := m.Forget(at(10)); n != 1 {
		t.Fatalf("Forget(10s) dropped %d nodes; want 1 (gone)", n)
	}
	m.mu.Lock()
	for _, id := range []string{"silent", "back", "stays", "late-hb"} {
		if _, ok := m.nodes[id]; !ok {
			t.Errorf("%s was forgotten; only a node that left and was not heard from since may be", id)
		}
	}
	_, inNodes := m.nodes["gone"]
	_, inSeen := m.nodeSeen["gone"]
	_, inBeats := m.beats["gone"]
	gpus := 0
	for _, g := range m.gpus {
		if g.NodeID == "gone" {
			gpus++
		}
	}
	m.mu.Unlock()
	if inNodes || inSeen || inBeats || gpus > 0 {
		t.Errorf("gone is kept: inventory %v, telemetry %v, heartbeats %v, %d GPUs", inNodes, inSeen, inBeats, gpus)
	}

	// Late copies stamped before the cutoff (a heartbeat or a sample
	// delayed in another stream, the resource manager's lost verdict) do
	// not bring the departed node back.
	m.ApplyHeartbeat("gone", at(4))
	m.ApplyTelemetry("gone", contracts.Telemetry{GPUs: []contracts.GPUSample{{UUID: "GPU-gone-0"}}}, at(4))
	m.ApplyInventory("gone", contracts.NodeInventory{Pool: "spot"}, at(4))
	m.ApplyNodeLeft("gone", at(5))
	m.ApplyNodeEvent("gone", contracts.NodeEvent{Kind: contracts.NodeLost, Pool: "spot"})
	if _, _, nodes, beats := nodeState(m); nodes != 4 || beats != 4 {
		t.Errorf("after late copies of gone's messages: %d nodes, %d heartbeat records; want 4 each", nodes, beats)
	}
	for _, h := range m.Heartbeats() {
		if h.Node == "gone" {
			t.Errorf("a late heartbeat of a forgotten node is watched again: %+v", h)
		}
	}

	// The same ID on a new machine later is a new node, with all of it.
	join(m, "gone", 1, at(20))
	s = m.Snapshot(at(20))
	var hb []string
	for _, h := range s.Heartbeats {
		hb = append(hb, h.Node)
	}
	if fmt.Sprint(hb) != "[back gone late-hb silent stays]" {
		t.Errorf("heartbeats watched = %v; want gone back among them", hb)
	}
	if len(s.GPUs) != 1 || s.GPUs[0].NodeID != "gone" {
		t.Errorf("fresh GPUs = %+v; want gone's new one", s.GPUs)
	}
	if len(s.Pools) != 1 || s.Pools[0].Nodes != 5 || s.Pools[0].GPUs != 8 {
		t.Errorf("pools = %+v; want 5 live nodes with 8 GPUs", s.Pools)
	}
	// It leaves again and is forgotten again.
	m.ApplyNodeLeft("gone", at(21))
	if n := m.Forget(at(30)); n != 1 {
		t.Errorf("second departure: Forget dropped %d nodes; want 1", n)
	}

	// Back once more, and its inventory read before any heartbeat or
	// telemetry: a node that spoke after it left is not forgotten.
	m.ApplyInventory("gone", contracts.NodeInventory{Pool: "spot", GPUs: []contracts.GPUInfo{{UUID: "GPU-gone-new", Healthy: true}}}, at(40))
	if n := m.Forget(at(50)); n != 0 {
		t.Errorf("Forget dropped %d nodes; want none: gone came back with a fresh inventory", n)
	}
	m.mu.Lock()
	_, kept := m.nodes["gone"]
	m.mu.Unlock()
	if !kept {
		t.Error("the fresh inventory of a node back after it left was forgotten")
	}
}
