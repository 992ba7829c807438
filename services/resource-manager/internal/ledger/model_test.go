package ledger

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// model is the reference the randomized test compares the ledger with: the
// plainest possible statement of the rules, recomputed from the whole
// history at every question. It shares no code with the ledger.
type model struct {
	inv     map[string][]contracts.GPUInfo
	ready   map[string]bool
	history []contracts.LedgerEntry // entries in the order the log holds them
}

// live returns the allocations committed and not yet released, replaying
// the history from the start.
func (m *model) live() map[string]contracts.Allocation {
	seen := map[string]bool{}
	live := map[string]contracts.Allocation{}
	for _, e := range m.history {
		id := e.Allocation.ID
		switch e.Kind {
		case contracts.LedgerCommitted:
			if !seen[id] {
				live[id] = e.Allocation
			}
		case contracts.LedgerReleased:
			delete(live, id)
		}
		seen[id] = true
	}
	return live
}

func (m *model) everCommitted(id string) (contracts.Allocation, bool) {
	for _, e := range m.history {
		if e.Allocation.ID == id {
			return e.Allocation, true
		}
	}
	return contracts.Allocation{}, false
}

// verify answers like Ledger.Verify, by brute force.
func (m *model) verify(a contracts.Allocation) (contracts.Reason, bool) {
	uuids := []string{}
	for _, d := range a.Devices {
		if d.UUID == "" || slices.Contains(uuids, d.UUID) {
			return contracts.RefusedInvalidPlan, false
		}
		uuids = append(uuids, d.UUID)
	}
	if len(a.Devices) == 0 || a.Attempt < 1 || a.ID != contracts.AllocationID(a.Tenant, a.JobID, a.Attempt) ||
		contracts.ValidateTenant(a.Tenant) != nil || contracts.ValidateID(a.JobID) != nil || contracts.ValidateID(a.NodeID) != nil {
		return contracts.RefusedInvalidPlan, false
	}
	if prev, ok := m.everCommitted(a.ID); ok {
		same := prev.NodeID == a.NodeID && len(prev.Devices) == len(a.Devices)
		for _, d := range prev.Devices {
			same = same && slices.Contains(uuids, d.UUID)
		}
		if same {
			return "", true
		}
		return contracts.RefusedAlreadyPlaced, false
	}
	live := m.live()
	for _, o := range live {
		if o.Tenant == a.Tenant && o.JobID == a.JobID {
			return contracts.RefusedAlreadyPlaced, false
		}
	}
	inv, known := m.inv[a.NodeID]
	if !known {
		return contracts.RefusedUnknownNode, false
	}
	if !m.ready[a.NodeID] {
		return contracts.RefusedNodeNotReady, false
	}
	for _, d := range a.Devices {
		i := slices.IndexFunc(inv, func(g contracts.GPUInfo) bool { return g.UUID == d.UUID })
		switch {
		case i < 0 || inv[i].Index != d.Index:
			return contracts.RefusedUnknownDevice, false
		case inv[i].Model != d.Model:
			return contracts.RefusedModelMismatch, false
		case !inv[i].Healthy:
			return contracts.RefusedDeviceUnhealthy, false
		}
	}
	for _, o := range live {
		for _, od := range o.Devices {
			if o.NodeID == a.NodeID && slices.Contains(uuids, od.UUID) {
				return contracts.RefusedDeviceTaken, false
			}
		}
	}
	return "", false
}

// TestLedgerAgainstModel drives the ledger and the model with the same
// random commits (verified first, as the resource manager does),
// redeliveries, releases, inventory changes and readiness flips, and checks
// after every step that they agree and that no device is held twice (G1).
func TestLedgerAgainstModel(t *testing.T) {
	seeds, steps := 3000, 120
	if testing.Short() {
		seeds = 300
	}
	for seed := range seeds {
		if err := runModel(uint64(seed), steps); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
	}
}

func runModel(seed uint64, steps int) error {
	rng := rand.New(rand.NewPCG(seed, 0x6770))
	nodes := []string{"n0", "n1", "n2"}
	models := []string{"H100-80GB", "A100-80GB"}
	l := New()
	m := &model{inv: map[string][]contracts.GPUInfo{}, ready: map[string]bool{}}
	var seq uint64
	type stored struct {
		e   contracts.LedgerEntry
		seq uint64
	}
	var log []stored

	// inventory gives a node 2-4 GPUs of one model; some steps later it
	// may shrink or change model, as a re-discovered node would.
	inventory := func(node string) {
		n := 2 + rng.IntN(3)
		model := models[rng.IntN(len(models))]
		g := make([]contracts.GPUInfo, n)
		for i := range g {
			// One GPU in ten is reported unhealthy (an XID, an ECC error).
			g[i] = contracts.GPUInfo{Index: i, UUID: fmt.Sprintf("GPU-%s-%d", node, i), Model: model, Healthy: rng.IntN(10) != 0}
		}
		m.inv[node] = g
		l.SetInventory(contracts.NodeInventory{NodeID: node, GPUs: slices.Clone(g)})
	}
	randomItem := func() contracts.Allocation {
		node := nodes[rng.IntN(len(nodes))]
		if rng.IntN(20) == 0 {
			node = "n9"
		}
		job := fmt.Sprintf("j%d", rng.IntN(12))
		a := contracts.Allocation{Tenant: "acme", JobID: job, Attempt: 1 + rng.IntN(2), NodeID: node}
		a.ID = contracts.AllocationID(a.Tenant, a.JobID, a.Attempt)
		if rng.IntN(40) == 0 {
			a.ID = "acme/forged/1"
		}
		for range 1 + rng.IntN(3) {
			d := contracts.DeviceRef{Index: rng.IntN(5)}
			d.UUID = fmt.Sprintf("GPU-%s-%d", node, d.Index)
			if inv := m.inv[node]; len(inv) > 0 {
				d.Model = inv[0].Model
			}
			switch rng.IntN(25) {
			case 0:
				d.Model = "L4"
			case 1:
				d.UUID = fmt.Sprintf("GPU-%s-%d", nodes[rng.IntN(len(nodes))], d.Index)
			case 2:
				d.Index = (d.Index + 1) % 5
			}
			a.Devices = append(a.Devices, d)
		}
		return a
	}

	for step := range steps {
		op := rng.IntN(100)
		var what string
		switch {
		case op < 5:
			node := nodes[rng.IntN(len(nodes))]
			inventory(node)
			what = "inventory " + node
		case op < 12:
			node := nodes[rng.IntN(len(nodes))]
			r := rng.IntN(3) > 0
			m.ready[node] = r
			l.SetReady(node, r)
			what = fmt.Sprintf("ready %s %v", node, r)
		case op < 70:
			a := randomItem()
			reason, dup := m.verify(a)
			v := l.Verify(a)
			what = fmt.Sprintf("verify %s on %s %v", a.ID, a.NodeID, a.Devices)
			if v.Reason != reason || v.Duplicate != dup {
				return fmt.Errorf("step %d %s: ledger says %+v, model says reason %q duplicate %v", step, what, v, reason, dup)
			}
			if v.OK() {
				seq++
				e := committed(a)
				m.history = append(m.history, e)
				log = append(log, stored{e, seq})
				if err := l.Apply(e, seq); err != nil {
					return fmt.Errorf("step %d %s: apply: %w", step, what, err)
				}
			}
		case op < 88:
			live := m.live()
			if len(live) == 0 {
				continue
			}
			ids := make([]string, 0, len(live))
			for id := range live {
				ids = append(ids, id)
			}
			slices.Sort(ids)
			a := live[ids[rng.IntN(len(ids))]]
			seq++
			e := released(a)
			m.history = append(m.history, e)
			log = append(log, stored{e, seq})
			if err := l.Apply(e, seq); err != nil {
				return fmt.Errorf("step %d release %s: %w", step, a.ID, err)
			}
			what = "release " + a.ID
		default:
			// Redelivery: an old entry again, at its own sequence or
			// without one (a deduplicated publish). Must change nothing.
			if len(log) == 0 {
				continue
			}
			s := log[rng.IntN(len(log))]
			at := s.seq
			if rng.IntN(2) == 0 {
				at = 0
			}
			if err := l.Apply(s.e, at); err != nil {
				return fmt.Errorf("step %d redeliver %s: %w", step, s.e.Allocation.ID, err)
			}
			what = fmt.Sprintf("redeliver %s %s at %d", s.e.Kind, s.e.Allocation.ID, at)
		}
		if err := checkAgainstModel(l, m, nodes); err != nil {
			return fmt.Errorf("step %d (%s): %w", step, what, err)
		}
	}
	return nil
}

// checkAgainstModel checks G1 in the ledger's own view and that it holds
// exactly the model's live allocations.
func checkAgainstModel(l *Ledger, m *model, nodes []string) error {
	want := m.live()
	count := 0
	for _, node := range nodes {
		holder := map[string]string{}
		for _, a := range l.Live(node) {
			count++
			if _, ok := want[a.ID]; !ok {
				return fmt.Errorf("ledger has %s live, model does not", a.ID)
			}
			for _, d := range a.Devices {
				if other, taken := holder[d.UUID]; taken {
					return fmt.Errorf("G1: %s/%s held by %s and %s", node, d.UUID, other, a.ID)
				}
				holder[d.UUID] = a.ID
				if h := l.Holder(node, d.UUID); h != a.ID {
					return fmt.Errorf("Holder(%s, %s) = %q, want %q", node, d.UUID, h, a.ID)
				}
			}
		}
	}
	if count != len(want) {
		return fmt.Errorf("ledger has %d live allocations, model %d", count, len(want))
	}
	return nil
}
