package backfill

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

var t0 = time.Date(2026, 1, 2, 15, 0, 0, 0, time.UTC)

const model = "A100-80GB"

func h(n float64) time.Time { return t0.Add(time.Duration(n * float64(time.Hour))) }

// newNode is a node with nothing held: gpus whole cards (the first mig of
// them in MIG mode with seven 1g instances).
func newNode(id, zone string, gpus, mig int) placement.Node {
	n := placement.Node{ID: id, Pool: "a100", Zone: zone, CPUMilliFree: 64_000, MemoryMiBFree: 512 << 10}
	for i := range gpus {
		g := placement.GPU{Index: i, UUID: fmt.Sprintf("GPU-%s-%d", id, i), Model: model, MemoryMiB: 81920}
		if i < mig {
			g.MIG = true
			for s := range 7 {
				g.Instances = append(g.Instances, placement.MIGSlot{Instance: contracts.MIGInstance{
					UUID: fmt.Sprintf("MIG-%s-%d-%d", id, i, s), Profile: "1g.10gb", GIID: s + 1, Start: s, Size: 1, MemoryMiB: 9728,
				}})
			}
		}
		n.GPUs = append(n.GPUs, g)
	}
	return n
}

// world builds snapshots from node capacities and running jobs, holding
// what the jobs alive hold: an independent model of what Reserve releases.
type world struct{ nodes []placement.Node }

func (w world) snapshot(running []Running, alive func(Running) bool) placement.Snapshot {
	snap := placement.Snapshot{Nodes: make([]placement.Node, len(w.nodes))}
	byID := map[string]*placement.Node{}
	for i, n := range w.nodes {
		n.GPUs = slices.Clone(n.GPUs)
		for j := range n.GPUs {
			n.GPUs[j].Instances = slices.Clone(n.GPUs[j].Instances)
		}
		snap.Nodes[i] = n
		byID[n.ID] = &snap.Nodes[i]
	}
	for _, r := range running {
		n := byID[r.NodeID]
		if n == nil || !alive(r) {
			continue
		}
		n.CPUMilliFree -= r.CPUMilli
		n.MemoryMiBFree -= r.MemoryMiB
		for _, d := range r.Devices {
			for j := range n.GPUs {
				g := &n.GPUs[j]
				if g.Index != d.Index {
					continue
				}
				switch {
				case d.MIG != nil:
					for s := range g.Instances {
						if g.Instances[s].Instance.UUID == d.MIG.UUID {
							g.Instances[s].Held = true
						}
					}
				case d.Share != nil:
					g.ShareMemMiB += d.Share.MemoryMiB
					g.SharePercent += d.Share.ComputePercent
				default:
					g.Held = true
				}
			}
		}
	}
	return snap
}

// now is the snapshot the scheduler sees: everything running is held.
func (w world) now(running []Running) placement.Snapshot {
	return w.snapshot(running, func(Running) bool { return true })
}

// at is the cluster at t if every job ends at its End.
func (w world) at(running []Running, t time.Time) placement.Snapshot {
	return w.snapshot(running, func(r Running) bool { return r.End.IsZero() || r.End.After(t) })
}

func whole(node string, idx ...int) []contracts.DeviceRef {
	var out []contracts.DeviceRef
	for _, i := range idx {
		out = append(out, contracts.DeviceRef{Index: i, UUID: fmt.Sprintf("GPU-%s-%d", node, i), Model: model})
	}
	return out
}

func span(from, to int) []int {
	var out []int
	for i := from; i < to; i++ {
		out = append(out, i)
	}
	return out
}

func gpus(n int) placement.Request {
	return placement.Request{GPU: contracts.GPURequest{Count: n}, CPUMilli: 1000, MemoryMiB: 1024}
}

func gang(machines, perMachine int, topo contracts.Topology) placement.Request {
	r := gpus(machines * perMachine)
	r.GPU.Nodes = machines
	r.GPU.Topology = topo
	return r
}

func set(ids ...string) map[string]bool {
	m := map[string]bool{}
	for _, id := range ids {
		m[id] = true
	}
	return m
}

func TestReserve(t *testing.T) {
	share := placement.Request{GPU: contracts.GPURequest{Count: 1, Share: &contracts.GPUShare{MemoryMiB: 20000, ComputePercent: 50}}}
	mig := placement.Request{GPU: contracts.GPURequest{Count: 1, MIGProfile: "1g.10gb"}}
	tests := map[string]struct {
		nodes     []placement.Node
		running   []Running
		req       placement.Request
		wantStart time.Time
		wantNodes map[string]bool
		wantNone  bool
	}{
		"fits now: the first node in ID order": {
			nodes:     []placement.Node{newNode("n2", "z", 8, 0), newNode("n1", "z", 8, 0)},
			req:       gpus(8),
			wantStart: t0, wantNodes: set("n1"),
		},
		"earliest node to free up": {
			nodes: []placement.Node{newNode("n1", "z", 8, 0), newNode("n2", "z", 8, 0)},
			running: []Running{
				{NodeID: "n1", Devices: whole("n1", span(0, 8)...), End: h(2)},
				{NodeID: "n2", Devices: whole("n2", span(0, 8)...), End: h(1)},
			},
			req:       gpus(8),
			wantStart: h(1), wantNodes: set("n2"),
		},
		"the End at which enough of a node is free": {
			nodes: []placement.Node{newNode("n1", "z", 8, 0)},
			running: []Running{
				{NodeID: "n1", Devices: whole("n1", 6, 7), End: h(4)},
				{NodeID: "n1", Devices: whole("n1", 0, 1), End: h(1)},
				{NodeID: "n1", Devices: whole("n1", 4, 5), End: h(3)},
				{NodeID: "n1", Devices: whole("n1", 2, 3), End: h(2)},
			},
			req:       gpus(6),
			wantStart: h(3), wantNodes: set("n1"),
		},
		"a job of unknown End never ends": {
			nodes: []placement.Node{newNode("n1", "z", 8, 0), newNode("n2", "z", 8, 0)},
			running: []Running{
				{NodeID: "n1", Devices: whole("n1", span(0, 8)...)},
				{NodeID: "n2", Devices: whole("n2", span(0, 8)...), End: h(5)},
			},
			req:       gpus(4),
			wantStart: h(5), wantNodes: set("n2"),
		},
		"nothing ever frees enough": {
			nodes:    []placement.Node{newNode("n1", "z", 8, 0)},
			running:  []Running{{NodeID: "n1", Devices: whole("n1", 0)}},
			req:      gpus(8),
			wantNone: true,
		},
		"larger than any node": {
			nodes:    []placement.Node{newNode("n1", "z", 8, 0)},
			req:      gpus(16),
			wantNone: true,
		},
		"an End already past counts as now": {
			nodes:     []placement.Node{newNode("n1", "z", 8, 0)},
			running:   []Running{{NodeID: "n1", Devices: whole("n1", span(0, 8)...), End: h(-1)}},
			req:       gpus(8),
			wantStart: t0, wantNodes: set("n1"),
		},
		"host CPU held until a CPU-only job ends": {
			nodes:     []placement.Node{newNode("n1", "z", 8, 0)},
			running:   []Running{{NodeID: "n1", CPUMilli: 63_500, MemoryMiB: 1, End: h(1.5)}},
			req:       gpus(1),
			wantStart: h(1.5), wantNodes: set("n1"),
		},
		"a share frees when the share job ends": {
			nodes: []placement.Node{newNode("n1", "z", 1, 0)},
			running: []Running{{NodeID: "n1", End: h(2), Devices: []contracts.DeviceRef{{
				Index: 0, UUID: "GPU-n1-0", Model: model, Share: &contracts.GPUShare{MemoryMiB: 40000, ComputePercent: 60},
			}}}},
			req:       share,
			wantStart: h(2), wantNodes: set("n1"),
		},
		"a MIG instance frees when its job ends": {
			nodes: []placement.Node{newNode("n1", "z", 1, 1)},
			running: func() []Running {
				var rs []Running
				for s := range 7 {
					rs = append(rs, Running{NodeID: "n1", End: h(float64(7 - s)), Devices: []contracts.DeviceRef{{
						Index: 0, UUID: "GPU-n1-0", Model: model,
						MIG: &contracts.MIGInstance{UUID: fmt.Sprintf("MIG-n1-0-%d", s), Profile: "1g.10gb", GIID: s + 1, Start: s, Size: 1},
					}}})
				}
				return rs
			}(),
			req:       mig,
			wantStart: h(1), wantNodes: set("n1"),
		},
		"a gang starts when its last machine frees": {
			nodes: []placement.Node{newNode("a", "z1", 8, 0), newNode("b", "z1", 8, 0), newNode("c", "z2", 8, 0)},
			running: []Running{
				{NodeID: "b", Devices: whole("b", span(0, 8)...), End: h(1)},
				{NodeID: "c", Devices: whole("c", span(0, 8)...), End: h(2)},
			},
			req:       gang(2, 8, contracts.TopologyAny),
			wantStart: h(1), wantNodes: set("a", "b"),
		},
		"a zone gang waits for one zone": {
			nodes: []placement.Node{
				newNode("a", "z1", 8, 0), newNode("b", "z1", 8, 0),
				newNode("c", "z2", 8, 0), newNode("d", "z2", 8, 0),
			},
			running: []Running{
				{NodeID: "b", Devices: whole("b", span(0, 8)...), End: h(3)},
				{NodeID: "c", Devices: whole("c", span(0, 8)...), End: h(1)},
				{NodeID: "d", Devices: whole("d", span(0, 8)...), End: h(2)},
			},
			req:       gang(2, 8, contracts.TopologyZone),
			wantStart: h(2), wantNodes: set("c", "d"),
		},
		"the same gang without the zone constraint": {
			nodes: []placement.Node{
				newNode("a", "z1", 8, 0), newNode("b", "z1", 8, 0),
				newNode("c", "z2", 8, 0), newNode("d", "z2", 8, 0),
			},
			running: []Running{
				{NodeID: "b", Devices: whole("b", span(0, 8)...), End: h(3)},
				{NodeID: "c", Devices: whole("c", span(0, 8)...), End: h(1)},
				{NodeID: "d", Devices: whole("d", span(0, 8)...), End: h(2)},
			},
			req:       gang(2, 8, contracts.TopologyAny),
			wantStart: h(1), wantNodes: set("a", "c"),
		},
		"a gang needs distinct machines": {
			nodes:    []placement.Node{newNode("a", "z1", 16, 0)},
			req:      gang(2, 8, contracts.TopologyAny),
			wantNone: true,
		},
		"excluded nodes and other pools are skipped": {
			nodes: func() []placement.Node {
				other := newNode("b", "z", 8, 0)
				other.Pool = "h100"
				return []placement.Node{newNode("a", "z", 8, 0), other, newNode("c", "z", 8, 0)}
			}(),
			running: []Running{{NodeID: "c", Devices: whole("c", 0), End: h(1)}},
			req: func() placement.Request {
				r := gpus(8)
				r.Exclude = set("a")
				r.Pool = "a100"
				return r
			}(),
			wantStart: h(1), wantNodes: set("c"),
		},
		"a pool without quota headroom is skipped": {
			nodes: func() []placement.Node {
				other := newNode("b", "z", 8, 0)
				other.Pool = "h100"
				return []placement.Node{newNode("a", "z", 8, 0), other}
			}(),
			running: []Running{{NodeID: "b", Devices: whole("b", 0), End: h(1)}},
			req: func() placement.Request {
				r := gpus(8)
				r.AllowPool = func(p string) bool { return p == "h100" }
				return r
			}(),
			wantStart: h(1), wantNodes: set("b"),
		},
		"cordoned nodes are skipped": {
			nodes: func() []placement.Node {
				a := newNode("a", "z", 8, 0)
				a.Cordoned = true
				return []placement.Node{a, newNode("b", "z", 8, 0)}
			}(),
			running:   []Running{{NodeID: "b", Devices: whole("b", 0), End: h(1)}},
			req:       gpus(8),
			wantStart: h(1), wantNodes: set("b"),
		},
		"an invalid request reserves nothing": {
			nodes:    []placement.Node{newNode("a", "z", 8, 0)},
			req:      placement.Request{GPU: contracts.GPURequest{Count: 3, Nodes: 2}},
			wantNone: true,
		},
		"jobs on nodes outside the snapshot are ignored": {
			nodes:     []placement.Node{newNode("a", "z", 8, 0)},
			running:   []Running{{NodeID: "gone", Devices: whole("gone", 0), End: h(1)}, {NodeID: "a", Devices: whole("a", 0), End: h(1)}},
			req:       gpus(8),
			wantStart: h(1), wantNodes: set("a"),
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			w := world{nodes: tc.nodes}
			snap := w.now(tc.running)
			before := w.now(tc.running)
			pools := map[string]int{}
			if allow := tc.req.AllowPool; allow != nil {
				tc.req.AllowPool = func(p string) bool { pools[p]++; return allow(p) }
			}
			res, ok := Reserve(snap, tc.running, tc.req, t0)
			if diff := cmp.Diff(before, snap); diff != "" {
				t.Fatalf("Reserve modified the snapshot (-before +after):\n%s", diff)
			}
			for p, n := range pools {
				if n > 1 {
					t.Errorf("AllowPool(%q) called %d times, want at most once", p, n)
				}
			}
			if tc.wantNone {
				if ok {
					t.Fatalf("Reserve = %+v, want none", res)
				}
				return
			}
			if !ok {
				t.Fatal("Reserve found no reservation")
			}
			if !res.Start.Equal(tc.wantStart) {
				t.Errorf("Start = %s, want %s", res.Start, tc.wantStart)
			}
			if diff := cmp.Diff(tc.wantNodes, res.Nodes); diff != "" {
				t.Errorf("Nodes (-want +got):\n%s", diff)
			}
			if res.Message == "" {
				t.Error("no message")
			}
		})
	}
}

func TestReserveMessage(t *testing.T) {
	w := world{nodes: []placement.Node{newNode("n1", "z", 8, 0), newNode("n2", "z", 8, 0)}}
	running := []Running{{NodeID: "n1", Devices: whole("n1", 0), End: h(0.5)}, {NodeID: "n2", Devices: whole("n2", 0), End: h(0.5)}}
	tests := map[string]struct {
		req  placement.Request
		want string
	}{
		"one machine": {gpus(8), "capacity reserved on n1 from 2026-01-02T15:30:00Z (in 30m), when running jobs are expected to end"},
		"a gang":      {gang(2, 8, ""), "capacity reserved on n1, n2 from 2026-01-02T15:30:00Z (in 30m), when running jobs are expected to end"},
		"now":         {gpus(4), "capacity reserved on n1 from now (the jobs holding it are expected to have ended)"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			res, ok := Reserve(w.now(running), running, tc.req, t0)
			if !ok || res.Message != tc.want {
				t.Errorf("Reserve = %q, %v; want %q", res.Message, ok, tc.want)
			}
		})
	}
}

func TestBookExclude(t *testing.T) {
	var b Book
	if got := b.Exclude(t0, 0); got != nil {
		t.Fatalf("empty book excludes %v", got)
	}
	b.Add(Reservation{Key: "now", Start: t0, Nodes: set("x")})
	b.Add(Reservation{Key: "soon", Start: h(1), Nodes: set("a")})
	b.Add(Reservation{Key: "later", Start: h(3), Nodes: set("b", "c")})
	tests := map[string]struct {
		now      time.Time
		expected time.Duration
		want     map[string]bool
	}{
		"unknown run time avoids every reserved node":     {t0, 0, set("x", "a", "b", "c")},
		"a negative run time is unknown":                  {t0, -time.Hour, set("x", "a", "b", "c")},
		"short job: only what is reserved from now":       {t0, 30 * time.Minute, set("x")},
		"ending exactly at a reservation's start is fine": {t0, time.Hour, set("x")},
		"ending after a start avoids that reservation":    {t0, 2 * time.Hour, set("x", "a")},
		"long job avoids all":                             {t0, 5 * time.Hour, set("x", "a", "b", "c")},
		"later in the cycle the holes are shorter":        {h(2.5), time.Hour, set("x", "a", "b", "c")},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			if diff := cmp.Diff(tc.want, b.Exclude(tc.now, tc.expected)); diff != "" {
				t.Errorf("Exclude (-want +got):\n%s", diff)
			}
		})
	}
	if got := len(b.Reservations()); got != 3 {
		t.Errorf("Reservations() has %d, want 3", got)
	}
}

// TestBackfillNeverDelaysTheReservation simulates cycles: random running
// jobs (placed by the real placer), a blocked request reserved, then
// competitors placed around it with Book.Exclude (whole machines kept) or
// Book.Holds (only the reserved devices kept). With every job ending at its
// End, the reserved job fits its reserved nodes at Start, on the very
// devices held; it did not fit anywhere just before Start (earliest); and a
// request Reserve refuses does not fit even once every job of known End has
// ended. With holds, competitors that run past the start use the reserved
// machines' other devices.
func TestBackfillNeverDelaysTheReservation(t *testing.T) {
	for _, holds := range []bool{false, true} {
		t.Run(fmt.Sprintf("holds=%v", holds), func(t *testing.T) {
			var total simStats
			for seed := range uint64(300) {
				t.Run(fmt.Sprint(seed), func(t *testing.T) {
					s := simulate(t, seed, holds)
					total.reserved += s.reserved
					total.none += s.none
					total.onReserved += s.onReserved
					total.later += s.later
					total.alongside += s.alongside
				})
			}
			// The simulation must exercise what it checks: reservations in
			// the future, refusals, and competitors that used reserved
			// nodes (with holds, some running past the start).
			if total.reserved < 100 || total.later < 50 || total.none < 5 || total.onReserved < 20 ||
				(holds && total.alongside < 20) {
				t.Errorf("simulation too tame: %+v", total)
			}
		})
	}
}

// alongside counts competitors placed on a reserved machine that run past
// its start: only holds allow them.
type simStats struct{ reserved, later, none, onReserved, alongside int }

func randomEnd(rng *rand.Rand) time.Time {
	switch rng.IntN(10) {
	case 0:
		return time.Time{} // unknown
	case 1:
		return h(-float64(rng.IntN(4)+1) / 4) // overrunning
	}
	return h(float64(rng.IntN(32)+1) / 4)
}

func randomRequest(rng *rand.Rand, zones bool) placement.Request {
	switch rng.IntN(7) {
	case 0:
		return placement.Request{GPU: contracts.GPURequest{Count: 1, Share: &contracts.GPUShare{
			MemoryMiB: int64(rng.IntN(40)+1) * 1000, ComputePercent: rng.IntN(80) + 10}}, CPUMilli: 2000}
	case 1:
		return placement.Request{GPU: contracts.GPURequest{Count: 1, MIGProfile: "1g.10gb"}, CPUMilli: 1000}
	case 2:
		topo := contracts.TopologyAny
		if zones && rng.IntN(2) == 0 {
			topo = contracts.TopologyZone
		}
		return gang(rng.IntN(3)+2, []int{2, 4, 8}[rng.IntN(3)], topo)
	}
	r := gpus(rng.IntN(8) + 1)
	r.CPUMilli = int64(rng.IntN(32)) * 1000
	return r
}

func simulate(t *testing.T, seed uint64, holds bool) (st simStats) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 11))
	w := world{}
	for i := range rng.IntN(10) + 3 {
		n := newNode(fmt.Sprintf("n%02d", i), fmt.Sprintf("z%d", rng.IntN(2)), []int{4, 8, 8}[rng.IntN(3)], 0)
		if rng.IntN(4) == 0 {
			n = newNode(n.ID, n.Zone, 2, 1)
		}
		w.nodes = append(w.nodes, n)
	}
	// Running jobs, placed by the real placer so nothing is held twice.
	var running []Running
	fill := placement.NewPlacer(w.now(nil), placement.Options{})
	for range rng.IntN(40) + 5 {
		r := randomRequest(rng, true)
		d := fill.Place(r)
		if !d.Placed() {
			continue
		}
		end := randomEnd(rng)
		for _, p := range d.Parts {
			running = append(running, Running{NodeID: p.NodeID, Devices: p.Devices, CPUMilli: r.CPUMilli, MemoryMiB: r.MemoryMiB, End: end})
		}
	}
	blocked := randomRequest(rng, true)
	now := w.now(running)
	res, ok := Reserve(now, running, blocked, t0)
	if !ok {
		st.none++
		// Refused: not even once every job of known End has ended.
		if n := fitting(w.at(running, h(1000)), blocked, nil); n >= blocked.Machines() {
			t.Fatalf("Reserve refused %+v, but it fits %d nodes once all known jobs end", blocked.GPU, n)
		}
		return st
	}
	st.reserved++
	if res.Start.After(t0) {
		st.later++
		// Earliest: at the last moment anything changes before Start, it
		// does not fit yet.
		prev := t0
		for _, r := range running {
			if r.End.After(prev) && r.End.Before(res.Start) {
				prev = r.End
			}
		}
		if n := fitting(w.at(running, prev), blocked, nil); n >= blocked.Machines() {
			t.Fatalf("Reserve start %s, but %+v fits %d nodes at %s already", res.Start, blocked.GPU, n, prev)
		}
	}
	if len(res.Nodes) != blocked.Machines() {
		t.Fatalf("reservation has %d nodes, request spans %d", len(res.Nodes), blocked.Machines())
	}
	// Competitors fill holes around the reservation.
	var book Book
	book.Add(res)
	compete := placement.NewPlacer(now, placement.Options{})
	for range rng.IntN(30) + 5 {
		r := randomRequest(rng, false)
		expected := []time.Duration{0, 15 * time.Minute, time.Hour, 2 * time.Hour, 4 * time.Hour, 8 * time.Hour}[rng.IntN(6)]
		if holds {
			r.Reserved = book.Holds(t0, expected, nil)
		} else {
			r.Exclude = book.Exclude(t0, expected)
		}
		d := compete.Place(r)
		if !d.Placed() {
			continue
		}
		var end time.Time
		if expected > 0 {
			end = t0.Add(expected)
		}
		for _, p := range d.Parts {
			if res.Nodes[p.NodeID] {
				st.onReserved++
				if Delays(res, t0, expected) {
					st.alongside++
				}
			}
			running = append(running, Running{NodeID: p.NodeID, Devices: p.Devices, CPUMilli: r.CPUMilli, MemoryMiB: r.MemoryMiB, End: end})
		}
	}
	// Time passes to Start; every job ends at its End.
	at := w.at(running, res.Start)
	if n := fitting(at, blocked, res.Nodes); n < blocked.Machines() {
		t.Fatalf("at its reserved start %s, %+v fits only %d of its reserved nodes %v", res.Start, blocked.GPU, n, slices.Sorted(maps.Keys(res.Nodes)))
	}
	// On the devices held for it: nothing alive at Start has them.
	for _, r := range running {
		if !r.End.IsZero() && !r.End.After(res.Start) {
			continue
		}
		for _, d := range r.Devices {
			for _, hd := range res.Holds[r.NodeID].Devices {
				if d.UUID == hd.UUID && (d.MIG == nil) == (hd.MIG == nil) && (d.MIG == nil || d.MIG.UUID == hd.MIG.UUID) &&
					d.Share == nil && hd.Share == nil {
					t.Fatalf("device %s held for the reservation is still used at its start by %+v", hd.UUID, r)
				}
			}
		}
	}
	only := blocked
	only.Exclude = map[string]bool{}
	for _, n := range at.Nodes {
		if !res.Nodes[n.ID] {
			only.Exclude[n.ID] = true
		}
	}
	if d := placement.NewPlacer(at, placement.Options{}).Place(only); !d.Placed() {
		t.Fatalf("at its reserved start the placer refuses %+v on %v: %s", blocked.GPU, res.Nodes, d.Pending.Message)
	}
	return st
}

// fitting counts the nodes (of among, nil for all) one machine of r fits,
// the most of any one zone when r is a zone gang.
func fitting(snap placement.Snapshot, r placement.Request, among map[string]bool) int {
	perZone := map[string]int{}
	best := 0
	for i := range snap.Nodes {
		n := &snap.Nodes[i]
		if among != nil && !among[n.ID] {
			continue
		}
		if _, ok := placement.FitNode(n, r); !ok {
			continue
		}
		zone := ""
		if r.Machines() > 1 && r.GPU.Topology == contracts.TopologyZone {
			zone = n.Zone
		}
		perZone[zone]++
		best = max(best, perZone[zone])
	}
	return best
}

// BenchmarkReserve reserves on clusters of 8-GPU nodes, each with a few jobs
// of random End, for a request that fits nowhere now: the worst case, every
// node examined.
func BenchmarkReserve(b *testing.B) {
	for _, size := range []int{1_000, 10_000} {
		for _, tc := range []struct {
			name string
			req  placement.Request
		}{
			{"8gpu", gpus(8)},
			{"gang-4x8", gang(4, 8, contracts.TopologyAny)},
			{"zone-gang-4x8", gang(4, 8, contracts.TopologyZone)},
		} {
			b.Run(fmt.Sprintf("nodes=%d/%s", size, tc.name), func(b *testing.B) {
				rng := rand.New(rand.NewPCG(3, 4))
				w := world{}
				var running []Running
				for i := range size {
					id := fmt.Sprintf("n%05d", i)
					w.nodes = append(w.nodes, newNode(id, fmt.Sprintf("z%d", i%8), 8, 0))
					for g := 0; g < 8; g += 2 {
						end := h(float64(rng.IntN(96)+1) / 4)
						if rng.IntN(10) == 0 {
							end = time.Time{}
						}
						running = append(running, Running{NodeID: id, Devices: whole(id, g, g+1), CPUMilli: 4000, End: end})
					}
				}
				snap := w.now(running)
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					if _, ok := Reserve(snap, running, tc.req, t0); !ok {
						b.Fatal("no reservation")
					}
				}
				b.ReportMetric(float64(size), "nodes")
			})
		}
	}
}

// TestWait: a reservation's wait is rounded for people, so its message
// changes with its facts rather than every cycle, and never reads "0s".
func TestWait(t *testing.T) {
	tests := map[time.Duration]string{
		0:                               "under 10s",
		4 * time.Second:                 "under 10s",
		26 * time.Second:                "30s",
		2*time.Minute + 58*time.Second:  "3m",
		59*time.Minute + 40*time.Second: "1h",
		time.Hour + 33*time.Minute:      "1h30m",
		26*time.Hour + 4*time.Minute:    "26h",
		-time.Minute:                    "under 10s",
	}
	for d, want := range tests {
		if got := Wait(d); got != want {
			t.Errorf("Wait(%s) = %q, want %q", d, got, want)
		}
	}
}

// TestHoldsTakeWhatIsBusyNowFirst: a reservation holds the devices its job
// needs, those that running jobs free first, so that what is free now
// stays usable by jobs that run past its start; and a later reservation
// never counts on a device an earlier one holds.
func TestHoldsTakeWhatIsBusyNowFirst(t *testing.T) {
	w := world{nodes: []placement.Node{newNode("n1", "z", 4, 0)}}
	running := []Running{{NodeID: "n1", Devices: whole("n1", 2, 3), CPUMilli: 8000, End: h(1)}}
	r := gpus(3)
	r.CPUMilli = 16_000
	res, ok := Reserve(w.now(running), running, r, t0)
	if !ok || !res.Start.Equal(h(1)) {
		t.Fatalf("Reserve = %+v, %v", res, ok)
	}
	var held []int
	for _, d := range res.Holds["n1"].Devices {
		held = append(held, d.Index)
	}
	slices.Sort(held)
	if diff := cmp.Diff([]int{0, 2, 3}, held); diff != "" {
		t.Errorf("held devices (-want +got):\n%s", diff)
	}
	if h := res.Holds["n1"]; h.SpareCPUMilli != 64_000-16_000 {
		t.Errorf("spare CPU %d, want %d", h.SpareCPUMilli, 64_000-16_000)
	}
	// A long job takes GPU 1 now; a second blocked job reserves only what
	// the first leaves: nothing on n1 until the first's job ends (never,
	// for planning: its End is unknown).
	p := placement.NewPlacer(w.now(running), placement.Options{})
	long := gpus(1)
	long.Reserved = res.Holds
	if d := p.Place(long); !d.Placed() || d.Parts[0].Devices[0].Index != 1 {
		t.Fatalf("a long job beside the reservation: %+v", d)
	}
	second := gpus(2)
	second.Reserved = res.Holds
	if res2, ok := Reserve(w.now(running), running, second, t0); ok {
		t.Errorf("a second reservation counted on held devices: %+v", res2)
	}
}

// TestPlannerAnswersAsReserve: one planner asked for many requests in turn
// (as a cycle asks for its reservations, each taking what the earlier
// ones hold) answers each as Reserve does afresh: what it derived once
// from the snapshot and the running jobs is not changed by an answer.
func TestPlannerAnswersAsReserve(t *testing.T) {
	reserved := 0
	for seed := range uint64(40) {
		rng := rand.New(rand.NewPCG(seed, 29))
		w := world{}
		for i := range rng.IntN(10) + 3 {
			w.nodes = append(w.nodes, newNode(fmt.Sprintf("n%02d", i), fmt.Sprintf("z%d", rng.IntN(2)), []int{4, 8, 8}[rng.IntN(3)], 0))
		}
		var running []Running
		fill := placement.NewPlacer(w.now(nil), placement.Options{})
		for range rng.IntN(40) + 5 {
			r := randomRequest(rng, true)
			if d := fill.Place(r); d.Placed() {
				end := randomEnd(rng)
				for _, p := range d.Parts {
					running = append(running, Running{NodeID: p.NodeID, Devices: p.Devices, CPUMilli: r.CPUMilli, End: end})
				}
			}
		}
		snap := w.now(running)
		planner := NewPlanner(snap, running, t0)
		var book Book
		for i := range 8 {
			r := randomRequest(rng, true)
			r.Reserved = book.Holds(t0, 0, nil)
			got, gotOK := planner.Reserve(r)
			want, wantOK := Reserve(snap, running, r, t0)
			if gotOK != wantOK || !got.Start.Equal(want.Start) || fmt.Sprint(got.Nodes) != fmt.Sprint(want.Nodes) ||
				!cmp.Equal(got.Holds, want.Holds) || got.Message != want.Message {
				t.Fatalf("seed %d, request %d: the planner answers %+v, %v; Reserve %+v, %v", seed, i, got, gotOK, want, wantOK)
			}
			if gotOK {
				book.Add(got)
				reserved++
			}
		}
	}
	if reserved < 100 {
		t.Errorf("only %d of 320 requests reserved: the test checks too little", reserved)
	}
}
