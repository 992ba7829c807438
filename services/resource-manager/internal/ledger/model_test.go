package ledger

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// model is the reference the randomized test compares the ledger with: the
// plainest possible statement of the rules, recomputed from the whole
// history at every question. It shares no code with the ledger.
type model struct {
	inv     map[string][]contracts.GPUInfo
	host    map[string]contracts.NodeInventory // only CPUMilli and MemoryMiB
	ready   map[string]bool
	admin   map[string]contracts.NodeAdmin
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
	if len(a.Devices) == 0 || a.Attempt < 1 || !validPart(a) ||
		a.CPUMilli < 0 || a.CPUMilli > contracts.MaxCPUMilli || a.MemoryMiB < 0 || a.MemoryMiB > contracts.MaxHostMemoryMiB ||
		contracts.ValidateTenant(a.Tenant) != nil || contracts.ValidateID(a.JobID) != nil || contracts.ValidateID(a.NodeID) != nil {
		return contracts.RefusedInvalidPlan, false
	}
	for i, d := range a.Devices {
		switch {
		case d.UUID == "",
			d.MIG != nil && d.Share != nil,
			d.MIG != nil && d.MIG.UUID == "",
			d.Share != nil && (d.Share.MemoryMiB <= 0 || d.Share.ComputePercent < 1 || d.Share.ComputePercent > 100):
			return contracts.RefusedInvalidPlan, false
		}
		for _, e := range a.Devices[:i] {
			bothMIG := d.MIG != nil && e.MIG != nil
			if e.UUID == d.UUID && !(bothMIG && e.MIG.UUID != d.MIG.UUID) || bothMIG && e.MIG.UUID == d.MIG.UUID {
				return contracts.RefusedInvalidPlan, false
			}
		}
	}
	if prev, ok := m.everCommitted(a.ID); ok {
		same := prev.NodeID == a.NodeID && len(prev.Devices) == len(a.Devices)
		for _, d := range prev.Devices {
			same = same && slices.ContainsFunc(a.Devices, func(e contracts.DeviceRef) bool { return sameClaim(d, e) })
		}
		if same {
			return "", true
		}
		return contracts.RefusedAlreadyPlaced, false
	}
	live := m.live()
	for _, o := range live {
		// Parts of one attempt of one gang (same machines) may be live
		// together; anything else of the job may not.
		siblings := o.Gang != nil && a.Gang != nil && o.Attempt == a.Attempt &&
			o.Gang.Size == a.Gang.Size && slices.Equal(o.Gang.Nodes, a.Gang.Nodes)
		if o.Tenant == a.Tenant && o.JobID == a.JobID && !siblings {
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
	if ad := m.admin[a.NodeID]; ad.Cordoned || ad.Drain {
		return contracts.RefusedNodeCordoned, false
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
		case gpuHeldIn(m.admin[a.NodeID], d.UUID):
			return contracts.RefusedNodeCordoned, false
		case !migConsistent(inv, i):
			return contracts.RefusedMIGInventoryInvalid, false
		case d.MIG == nil && inv[i].MIGEnabled:
			return contracts.RefusedMIGEnabled, false
		case d.MIG != nil && !inv[i].MIGEnabled:
			return contracts.RefusedMIGDisabled, false
		case d.MIG != nil && !slices.ContainsFunc(inv[i].MIGInstances, func(mi contracts.MIGInstance) bool {
			return mi.UUID == d.MIG.UUID && mi.Profile == d.MIG.Profile && mi.Start == d.MIG.Start && mi.Size == d.MIG.Size
		}):
			return contracts.RefusedMIGInstanceUnknown, false
		}
	}
	for _, d := range a.Devices {
		// What the live allocations hold of d's GPU, by kind.
		var whole, migs, shares bool
		var instTaken bool
		var mem int64
		var compute int
		for _, o := range live {
			if o.NodeID != a.NodeID {
				continue
			}
			for _, od := range o.Devices {
				if od.MIG != nil && d.MIG != nil && od.MIG.UUID == d.MIG.UUID {
					instTaken = true
				}
				if od.UUID != d.UUID {
					continue
				}
				switch {
				case od.MIG != nil:
					migs = true
				case od.Share != nil:
					shares = true
					mem += od.Share.MemoryMiB
					compute += od.Share.ComputePercent
				default:
					whole = true
				}
			}
		}
		g := inv[slices.IndexFunc(inv, func(g contracts.GPUInfo) bool { return g.UUID == d.UUID })]
		switch {
		case d.MIG != nil && instTaken:
			return contracts.RefusedMIGInstanceTaken, false
		case d.MIG != nil && (whole || shares):
			return contracts.RefusedDeviceTaken, false
		case d.Share != nil && (whole || migs):
			return contracts.RefusedDeviceTaken, false
		case d.Share != nil && (mem+d.Share.MemoryMiB > g.MemoryMiB || compute+d.Share.ComputePercent > 100):
			return contracts.RefusedShareExceedsGPU, false
		case d.MIG == nil && d.Share == nil && whole:
			return contracts.RefusedDeviceTaken, false
		case d.MIG == nil && d.Share == nil && (migs || shares):
			return contracts.RefusedGPUShared, false
		}
	}
	var cpu, mem int64
	for _, o := range live {
		if o.NodeID == a.NodeID {
			cpu += o.CPUMilli
			mem += o.MemoryMiB
		}
	}
	h := m.host[a.NodeID]
	if a.CPUMilli > 0 && h.CPUMilli > 0 && cpu+a.CPUMilli > h.CPUMilli ||
		a.MemoryMiB > 0 && h.MemoryMiB > 0 && mem+a.MemoryMiB > h.MemoryMiB {
		return contracts.RefusedHostCapacity, false
	}
	return "", false
}

// validPart reports whether a's ID is its attempt's, or, for a gang part,
// the part's of a well-formed gang that puts this rank on a.NodeID.
func validPart(a contracts.Allocation) bool {
	g := a.Gang
	if g == nil {
		return a.ID == contracts.AllocationID(a.Tenant, a.JobID, a.Attempt)
	}
	if a.ID != contracts.AllocationPartID(a.Tenant, a.JobID, a.Attempt, g.Rank) ||
		g.Size < 1 || g.Size > contracts.MaxNodesPerJob || g.Rank < 0 || g.Rank >= g.Size ||
		len(g.Nodes) != g.Size || g.Nodes[g.Rank] != a.NodeID {
		return false
	}
	for i, n := range g.Nodes {
		if contracts.ValidateID(n) != nil || slices.Contains(g.Nodes[:i], n) {
			return false
		}
	}
	return true
}

// sameClaim reports whether d and e ask for the same thing of a GPU.
func sameClaim(d, e contracts.DeviceRef) bool {
	switch {
	case d.UUID != e.UUID || (d.MIG == nil) != (e.MIG == nil) || (d.Share == nil) != (e.Share == nil):
		return false
	case d.MIG != nil:
		return d.MIG.UUID == e.MIG.UUID
	case d.Share != nil:
		return *d.Share == *e.Share
	default:
		return true
	}
}

// migConsistent reports whether GPU i of an inventory reports a MIG state
// the model's rules allow: no instances without MIG mode; in MIG mode,
// instances with UUIDs not seen before on the node (in inventory order),
// each the size of its profile, at placements valid together.
func migConsistent(inv []contracts.GPUInfo, i int) bool {
	g := inv[i]
	if !g.MIGEnabled {
		return len(g.MIGInstances) == 0
	}
	var ps []contracts.MIGPlacement
	for k, mi := range g.MIGInstances {
		if mi.UUID == "" {
			return false
		}
		for j := 0; j <= i; j++ {
			if !inv[j].MIGEnabled {
				continue // its instances are not read at all
			}
			earlier := inv[j].MIGInstances
			if j == i {
				earlier = earlier[:k]
			}
			if slices.ContainsFunc(earlier, func(o contracts.MIGInstance) bool { return o.UUID == mi.UUID }) {
				return false
			}
		}
		for _, p := range contracts.MIGProfiles(g.Model) {
			if p.Name == mi.Profile && p.MemorySlices != mi.Size {
				return false
			}
		}
		ps = append(ps, mi.Placement())
	}
	return contracts.ValidateMIGPlacements(g.Model, ps) == nil
}

// gpuMiB is every modelled GPU's memory: fixed, so that "shares never sum
// past the card" is exact however often inventories change.
const gpuMiB = 81920

// chooser is where a run's choices come from: a seeded PRNG, or the bytes
// of a fuzz input.
type chooser interface{ IntN(n int) int }

// byteChooser makes choices from fuzz input bytes; once they run out it
// answers 0 and says so.
type byteChooser struct {
	data []byte
	done bool
}

func (b *byteChooser) IntN(n int) int {
	if len(b.data) == 0 {
		b.done = true
		return 0
	}
	v := int(b.data[0])
	b.data = b.data[1:]
	return v % n
}

// TestLedgerAgainstModel drives the ledger and the model with the same
// random commits (verified first, as the resource manager does) of whole
// GPUs, MIG instances and shares, redeliveries, releases, inventory changes
// (MIG mode, layouts, broken reports) and readiness flips, and checks after
// every step that they agree and that G1 holds: no GPU or MIG instance held
// twice, no whole GPU mixed with a share or an instance, no shares past the
// card. At the end of each run a ledger rebuilt from the log must be the
// same. It runs 2,000 seeds (300 with -short or -race);
// GPUPLANE_MODEL_SEEDS=N runs N instead.
func TestLedgerAgainstModel(t *testing.T) {
	seeds, steps := 2000, 120
	if testing.Short() || raceEnabled {
		seeds = 300
	}
	if env := os.Getenv("GPUPLANE_MODEL_SEEDS"); env != "" {
		n, err := strconv.Atoi(env)
		if err != nil || n < 1 {
			t.Fatalf("GPUPLANE_MODEL_SEEDS=%q: want a positive number", env)
		}
		seeds = n
	}
	seen := map[string]int{}
	for seed := range seeds {
		if err := runModel(rand.New(rand.NewPCG(uint64(seed), 0x6770)), steps, nil, seen); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
	}
	t.Logf("verdicts over %d seeds: %v", seeds, seen)
	// The generator must reach every rule, or agreeing proves little.
	for _, want := range []string{"ok", "duplicate", string(contracts.RefusedInvalidPlan), string(contracts.RefusedAlreadyPlaced),
		string(contracts.RefusedUnknownNode), string(contracts.RefusedNodeNotReady), string(contracts.RefusedUnknownDevice),
		string(contracts.RefusedModelMismatch), string(contracts.RefusedDeviceUnhealthy), string(contracts.RefusedDeviceTaken),
		string(contracts.RefusedMIGInventoryInvalid), string(contracts.RefusedMIGEnabled), string(contracts.RefusedMIGDisabled),
		string(contracts.RefusedMIGInstanceUnknown), string(contracts.RefusedMIGInstanceTaken), string(contracts.RefusedGPUShared),
		string(contracts.RefusedShareExceedsGPU), string(contracts.RefusedNodeCordoned), string(contracts.RefusedHostCapacity),
		"ok mig", "ok share", "ok mixed", "ok host", "ok gang", "ok gang sibling"} {
		if seen[want] == 0 && seeds >= 200 {
			t.Errorf("no verify over %d seeds ended %q; seen %v", seeds, want, seen)
		}
	}
}

// FuzzVerifyApply runs the model test with the fuzzer's bytes as the
// choices, until they run out or 300 steps are done (the model replays
// its history at every question: long runs cost quadratic time and find
// nothing the seeds do not).
func FuzzVerifyApply(f *testing.F) {
	for seed := range 8 {
		rng := rand.New(rand.NewPCG(uint64(seed), 1))
		b := make([]byte, 600)
		for i := range b {
			b[i] = byte(rng.IntN(256))
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c := &byteChooser{data: data}
		if err := runModel(c, 300, func() bool { return c.done }, nil); err != nil {
			t.Fatal(err)
		}
	})
}

type stored struct {
	e   contracts.LedgerEntry
	seq uint64
}

// runModel runs steps random operations; done, when not nil, ends the run
// early (the fuzz input ran out). seen, when not nil, counts the verdicts
// by reason ("ok" and "duplicate" for the others, "ok mig", "ok share" and
// "ok mixed" for commits with MIG instances, shares, or several kinds, "ok
// host" for commits asking CPU or memory of a node that declares them, "ok
// gang" for gang parts, "ok gang sibling" for those committed while another
// part of their gang is live).
func runModel(rng chooser, steps int, done func() bool, seen map[string]int) error {
	nodes := []string{"n0", "n1", "n2"}
	models := []string{"H100-80GB", "A100-80GB"}
	l := New(testKeep)
	m := &model{inv: map[string][]contracts.GPUInfo{}, host: map[string]contracts.NodeInventory{},
		ready: map[string]bool{}, admin: map[string]contracts.NodeAdmin{}}
	var seq uint64
	var log []stored

	// migLayout places a random layout of up to three instances on GPU
	// i, as nvidia-smi would; an instance's UUID names its start, so that
	// a later layout may reuse it for another profile.
	migLayout := func(node string, i int, model string) []contracts.MIGInstance {
		profiles := contracts.MIGProfiles(model)
		var layout []string
		for range rng.IntN(4) {
			layout = append(layout, profiles[rng.IntN(len(profiles))].Name)
		}
		ps, err := contracts.PlaceMIG(model, layout)
		if err != nil {
			return nil // does not fit: MIG mode with no instances
		}
		out := make([]contracts.MIGInstance, len(ps))
		for k, pl := range ps {
			p, _ := contracts.LookupMIGProfile(model, pl.Profile)
			out[k] = contracts.MIGInstance{UUID: fmt.Sprintf("MIG-%s-%d-s%d", node, i, pl.Start), Profile: pl.Profile,
				GIID: k + 1, Start: pl.Start, Size: p.MemorySlices, MemoryMiB: p.MemoryMiB}
		}
		return out
	}
	// inventory gives a node 2-4 GPUs of one model, a third of them in
	// MIG mode; some steps later it may shrink, change model or layouts,
	// as a re-discovered node would. Now and then an agent reports a MIG
	// state the rules forbid.
	inventory := func(node string) {
		n := 2 + rng.IntN(3)
		model := models[rng.IntN(len(models))]
		g := make([]contracts.GPUInfo, n)
		for i := range g {
			// One GPU in ten is reported unhealthy (an XID, an ECC error).
			g[i] = contracts.GPUInfo{Index: i, UUID: fmt.Sprintf("GPU-%s-%d", node, i), Model: model,
				MemoryMiB: gpuMiB, Healthy: rng.IntN(10) != 0}
			if rng.IntN(3) == 0 {
				g[i].MIGEnabled = true
				g[i].MIGInstances = migLayout(node, i, model)
			}
			insts := g[i].MIGInstances
			switch rng.IntN(40) {
			case 0: // instances listed with MIG mode off
				g[i].MIGEnabled = false
			case 1: // two instances on the same memory slices
				if len(insts) > 0 {
					dup := insts[0]
					dup.UUID += "-dup"
					g[i].MIGInstances = append(insts, dup)
				}
			case 2: // a size its profile does not have
				if len(insts) > 0 {
					insts[0].Size++
				}
			case 3: // an instance UUID another GPU lists too
				if i > 0 && len(g[0].MIGInstances) > 0 && g[i].MIGEnabled {
					g[i].MIGInstances = append(insts, g[0].MIGInstances[0])
				}
			}
		}
		m.inv[node] = g
		// Host sizes small enough for a few items to fill; 0 is unknown.
		host := contracts.NodeInventory{CPUMilli: []int64{0, 8000, 16000}[rng.IntN(3)], MemoryMiB: []int64{0, 65536, 131072}[rng.IntN(3)]}
		m.host[node] = host
		clone := make([]contracts.GPUInfo, len(g))
		for i, gi := range g {
			gi.MIGInstances = slices.Clone(gi.MIGInstances)
			clone[i] = gi
		}
		// The model judges broken reports itself.
		_ = l.SetInventory(contracts.NodeInventory{NodeID: node, GPUs: clone, CPUMilli: host.CPUMilli, MemoryMiB: host.MemoryMiB})
	}
	// migRef names one MIG instance of GPU idx: one it lists, else one of
	// another GPU of the node, else one that does not exist.
	migRef := func(node string, idx int) *contracts.MIGInstance {
		inv := m.inv[node]
		if i := slices.IndexFunc(inv, func(g contracts.GPUInfo) bool { return g.Index == idx }); i >= 0 && len(inv[i].MIGInstances) > 0 && rng.IntN(4) > 0 {
			mi := inv[i].MIGInstances[rng.IntN(len(inv[i].MIGInstances))]
			return &mi
		}
		for _, g := range inv {
			if len(g.MIGInstances) > 0 && rng.IntN(2) == 0 {
				mi := g.MIGInstances[rng.IntN(len(g.MIGInstances))]
				return &mi
			}
		}
		return &contracts.MIGInstance{UUID: fmt.Sprintf("MIG-%s-%d-s0", node, idx), Profile: "1g.10gb", Size: 1}
	}
	// Shares mostly valid, some past the card, a few malformed.
	shareMiB := []int64{8192, 20480, 40960, 8192, 20480, 40960, 60000, gpuMiB, 8192, 20480, 40960, 8192, 20480, 40960, 60000, gpuMiB, 90000, 0}
	sharePct := []int{10, 25, 50, 1, 33, 51, 75, 100, 10, 25, 50, 34, 25, 50, 75, 100, 101, 0}
	cpus := []int64{0, 0, 1000, 4000, 6000, 0, 2000, 8000, 4000, -1, contracts.MaxCPUMilli + 1}
	mems := []int64{0, 0, 16384, 32768, 65536, 0, 8192, 49152, 16384, -1, contracts.MaxHostMemoryMiB + 1}
	randomItem := func() contracts.Allocation {
		node := nodes[rng.IntN(len(nodes))]
		if rng.IntN(20) == 0 {
			node = "n9"
		}
		jobN := rng.IntN(16)
		job := fmt.Sprintf("j%d", jobN)
		// Jobs j12..j15 span machines: a part per node, the part's rank
		// and size from the job, the nodes in one order (now and then
		// another, which a live sibling's makes a different gang).
		var gang *contracts.GangPart
		if jobN >= 12 && rng.IntN(10) > 0 {
			size := 2 + jobN%2
			gang = &contracts.GangPart{Size: size, Rank: rng.IntN(size), Nodes: slices.Clone(nodes[:size])}
			if rng.IntN(8) == 0 {
				slices.Reverse(gang.Nodes)
			}
			node = gang.Nodes[gang.Rank]
			switch rng.IntN(30) {
			case 0:
				gang.Rank = size
			case 1:
				gang.Nodes[(gang.Rank+1)%size] = node // a machine twice
			case 2:
				node = nodes[(slices.Index(nodes, node)+1)%len(nodes)] // not the rank's node
			}
		}
		attempt := 1 + rng.IntN(2)
		if gang != nil && rng.IntN(8) > 0 {
			attempt = 1 // parts of one attempt, so that siblings meet
		}
		a := contracts.Allocation{Tenant: "acme", JobID: job, Attempt: attempt, NodeID: node, Gang: gang,
			CPUMilli: cpus[rng.IntN(len(cpus)-2)], MemoryMiB: mems[rng.IntN(len(mems)-2)]}
		if rng.IntN(30) == 0 {
			a.CPUMilli = cpus[len(cpus)-2+rng.IntN(2)] // negative or past any machine
		}
		if rng.IntN(30) == 0 {
			a.MemoryMiB = mems[len(mems)-2+rng.IntN(2)]
		}
		a.ID = contracts.AllocationID(a.Tenant, a.JobID, a.Attempt)
		if gang != nil && rng.IntN(20) > 0 && gang.Rank < gang.Size {
			a.ID = contracts.AllocationPartID(a.Tenant, a.JobID, a.Attempt, gang.Rank)
		}
		if rng.IntN(40) == 0 {
			a.ID = "acme/forged/1"
		}
		// Distinct GPUs mostly; one in five repeats the previous GPU
		// (a device twice, or a second MIG instance of it).
		idx := rng.IntN(5)
		for j := range 1 + rng.IntN(3) {
			if j > 0 && rng.IntN(8) > 0 {
				idx = (idx + 1) % 5
			}
			d := contracts.DeviceRef{Index: idx}
			d.UUID = fmt.Sprintf("GPU-%s-%d", node, d.Index)
			if inv := m.inv[node]; len(inv) > 0 {
				d.Model = inv[0].Model
			}
			switch k := rng.IntN(10); {
			case k < 3:
				// Half the time on a GPU in MIG mode, if the node has one.
				var migGPUs []int
				for _, g := range m.inv[node] {
					if g.MIGEnabled {
						migGPUs = append(migGPUs, g.Index)
					}
				}
				if len(migGPUs) > 0 && rng.IntN(2) == 0 {
					d.Index = migGPUs[rng.IntN(len(migGPUs))]
					d.UUID = fmt.Sprintf("GPU-%s-%d", node, d.Index)
				}
				d.MIG = migRef(node, d.Index)
			case k < 6:
				d.Share = &contracts.GPUShare{MemoryMiB: shareMiB[rng.IntN(len(shareMiB))], ComputePercent: sharePct[rng.IntN(len(sharePct))]}
			}
			switch rng.IntN(25) {
			case 0:
				d.Model = "L4"
			case 1:
				d.UUID = fmt.Sprintf("GPU-%s-%d", nodes[rng.IntN(len(nodes))], d.Index)
			case 2:
				d.Index = (d.Index + 1) % 5
			}
			if d.MIG != nil {
				switch rng.IntN(30) {
				case 0:
					d.MIG.Profile = "2g.20gb"
				case 1:
					d.MIG.Start += 2
				case 2:
					d.MIG.UUID = ""
				case 3:
					d.Share = &contracts.GPUShare{MemoryMiB: 1024, ComputePercent: 10}
				}
			}
			a.Devices = append(a.Devices, d)
		}
		return a
	}

	// Every node starts known, and most start ready; later steps change
	// both.
	for _, node := range nodes {
		inventory(node)
		m.ready[node] = rng.IntN(4) > 0
		l.SetReady(node, m.ready[node])
	}
	// try verifies a in the ledger and the model, and commits it when
	// both say it fits, as the resource manager does.
	try := func(a contracts.Allocation) error {
		reason, dup := m.verify(a)
		v := l.Verify(a)
		if v.Reason != reason || v.Duplicate != dup {
			return fmt.Errorf("ledger says %+v, model says reason %q duplicate %v", v, reason, dup)
		}
		if seen != nil {
			seen[verdictName(v, a)]++
			if k := kinds(a); v.OK() && k != "" {
				seen["ok "+k]++
			}
			if h := m.host[a.NodeID]; v.OK() && (a.CPUMilli > 0 && h.CPUMilli > 0 || a.MemoryMiB > 0 && h.MemoryMiB > 0) {
				seen["ok host"]++
			}
			if v.OK() && a.Gang != nil {
				seen["ok gang"]++
				for _, o := range m.live() {
					if o.JobID == a.JobID && o.ID != a.ID {
						seen["ok gang sibling"]++
						break
					}
				}
			}
		}
		if !v.OK() {
			return nil
		}
		seq++
		e := committed(a)
		m.history = append(m.history, e)
		log = append(log, stored{e, seq})
		if err := l.Apply(e, seq); err != nil {
			return fmt.Errorf("apply: %w", err)
		}
		return nil
	}
	for step := range steps {
		if done != nil && done() {
			break
		}
		op := rng.IntN(100)
		var what string
		switch {
		case op < 5:
			node := nodes[rng.IntN(len(nodes))]
			inventory(node)
			what = "inventory " + node
		case op < 10:
			node := nodes[rng.IntN(len(nodes))]
			r := rng.IntN(3) > 0
			m.ready[node] = r
			l.SetReady(node, r)
			what = fmt.Sprintf("ready %s %v", node, r)
		case op < 14:
			// An administrator cordons, drains or frees a node, or holds
			// one GPU of it (frees twice as often, so holds do not pile
			// up).
			node := nodes[rng.IntN(len(nodes))]
			var ad contracts.NodeAdmin
			switch rng.IntN(9) {
			case 0:
				ad = contracts.NodeAdmin{NodeID: node, Cordoned: true, Reason: "maintenance"}
			case 1:
				ad = contracts.NodeAdmin{NodeID: node, Cordoned: true, Drain: true}
			case 2:
				// One GPU held (a MIG instance or share of it too).
				gpu := fmt.Sprintf("GPU-%s-%d", node, rng.IntN(4))
				ad = contracts.NodeAdmin{NodeID: node, GPUs: map[string]contracts.GPUHold{
					gpu: {Cordoned: rng.IntN(2) == 0, Drain: rng.IntN(2) == 0, Cause: contracts.ReasonGPUUnhealthy}}}
			}
			m.admin[node] = ad
			l.SetAdmin(node, ad)
			what = fmt.Sprintf("admin %s %+v", node, ad)
		case op < 66:
			a := randomItem()
			what = fmt.Sprintf("verify %s on %s %s", a.ID, a.NodeID, refs(a.Devices))
			if err := try(a); err != nil {
				return fmt.Errorf("step %d %s: %w", step, what, err)
			}
		case op < 70:
			// A scheduler's gang: one part per machine, each a GPU (or a
			// MIG instance) its node's inventory lists, verified and
			// committed in rank order; any part may be refused.
			jobN := 12 + rng.IntN(4)
			size := 2 + jobN%2
			g := slices.Clone(nodes[:size])
			attempt := 1 + rng.IntN(3)
			what = fmt.Sprintf("gang j%d/%d of %d", jobN, attempt, size)
			for rank := range size {
				a := contracts.Allocation{Tenant: "acme", JobID: fmt.Sprintf("j%d", jobN), Attempt: attempt, NodeID: g[rank],
					Gang: &contracts.GangPart{Rank: rank, Size: size, Nodes: g}, CPUMilli: cpus[rng.IntN(len(cpus)-2)]}
				if rng.IntN(10) == 0 {
					a.Attempt = 1 + rng.IntN(3) // a part of another attempt
				}
				a.ID = contracts.AllocationPartID(a.Tenant, a.JobID, a.Attempt, rank)
				inv := m.inv[a.NodeID]
				gi := inv[rng.IntN(len(inv))]
				d := contracts.DeviceRef{Index: gi.Index, UUID: gi.UUID, Model: gi.Model}
				if gi.MIGEnabled && len(gi.MIGInstances) > 0 {
					mi := gi.MIGInstances[rng.IntN(len(gi.MIGInstances))]
					d.MIG = &mi
				}
				a.Devices = []contracts.DeviceRef{d}
				if err := try(a); err != nil {
					return fmt.Errorf("step %d %s: part %s on %s %s: %w", step, what, a.ID, a.NodeID, refs(a.Devices), err)
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
	if err := checkRebuild(l, m, nodes, log, randomItem); err != nil {
		return err
	}
	return checkStateRoundTrip(l, m, log, randomItem)
}

func verdictName(v Verdict, a contracts.Allocation) string {
	switch {
	case v.Duplicate:
		return "duplicate"
	case v.Refused():
		return string(v.Reason)
	default:
		return "ok"
	}
}

// kinds says what an item asks of its GPUs beyond whole ones: "mig",
// "share", "mixed" (several kinds), "" for whole GPUs only.
func kinds(a contracts.Allocation) string {
	var mig, share, whole bool
	for _, d := range a.Devices {
		switch {
		case d.MIG != nil:
			mig = true
		case d.Share != nil:
			share = true
		default:
			whole = true
		}
	}
	switch {
	case mig && (share || whole) || share && whole:
		return "mixed"
	case mig:
		return "mig"
	case share:
		return "share"
	}
	return ""
}

// refs prints devices for a failure message.
func refs(ds []contracts.DeviceRef) string {
	var b strings.Builder
	for _, d := range ds {
		b.WriteString(" " + d.UUID)
		if d.MIG != nil {
			fmt.Fprintf(&b, "/%s(%s@%d:%d)", d.MIG.UUID, d.MIG.Profile, d.MIG.Start, d.MIG.Size)
		}
		if d.Share != nil {
			fmt.Fprintf(&b, "[%dMiB,%d%%]", d.Share.MemoryMiB, d.Share.ComputePercent)
		}
	}
	return b.String()
}

// checkAgainstModel checks G1 in the ledger's own view (no GPU or MIG
// instance held twice, no whole GPU mixed with a share or a MIG instance,
// no MIG instance mixed with a share, shares within the card), that
// Holder and Shared say the same, and that it holds exactly the model's
// live allocations.
func checkAgainstModel(l *Ledger, m *model, nodes []string) error {
	want := m.live()
	count := 0
	for _, node := range nodes {
		var cpu, mem int64
		for _, a := range want {
			if a.NodeID == node {
				cpu += a.CPUMilli
				mem += a.MemoryMiB
			}
		}
		if c, mm := l.HostUsed(node); c != cpu || mm != mem {
			return fmt.Errorf("HostUsed(%s) = %d milli-CPU, %d MiB; want %d, %d", node, c, mm, cpu, mem)
		}
		whole := map[string]string{} // GPU UUID -> holder
		inst := map[string]string{}  // MIG UUID -> holder
		migOn := map[string]string{} // GPU UUID -> a holder of one of its instances
		shared := map[string][]string{}
		sum := map[string]contracts.GPUShare{}
		for _, a := range l.Live(node) {
			count++
			if _, ok := want[a.ID]; !ok {
				return fmt.Errorf("ledger has %s live, model does not", a.ID)
			}
			for _, d := range a.Devices {
				switch {
				case d.MIG != nil:
					if other, taken := inst[d.MIG.UUID]; taken {
						return fmt.Errorf("G1: MIG instance %s/%s held by %s and %s", node, d.MIG.UUID, other, a.ID)
					}
					inst[d.MIG.UUID], migOn[d.UUID] = a.ID, a.ID
				case d.Share != nil:
					shared[d.UUID] = append(shared[d.UUID], a.ID)
					s := sum[d.UUID]
					s.MemoryMiB += d.Share.MemoryMiB
					s.ComputePercent += d.Share.ComputePercent
					sum[d.UUID] = s
				default:
					if other, taken := whole[d.UUID]; taken {
						return fmt.Errorf("G1: %s/%s held by %s and %s", node, d.UUID, other, a.ID)
					}
					whole[d.UUID] = a.ID
				}
			}
		}
		for gpu, id := range whole {
			if other, ok := migOn[gpu]; ok {
				return fmt.Errorf("G1: %s/%s held whole by %s while %s holds a MIG instance of it", node, gpu, id, other)
			}
			if len(shared[gpu]) > 0 {
				return fmt.Errorf("G1: %s/%s held whole by %s while %v share it", node, gpu, id, shared[gpu])
			}
		}
		for gpu, id := range migOn {
			if len(shared[gpu]) > 0 {
				return fmt.Errorf("G1: %s/%s has a MIG instance held by %s while %v share it", node, gpu, id, shared[gpu])
			}
		}
		for gpu, s := range sum {
			if s.MemoryMiB > gpuMiB || s.ComputePercent > 100 {
				return fmt.Errorf("G1: shares of %s/%s sum to %d MiB and %d%%, past the card", node, gpu, s.MemoryMiB, s.ComputePercent)
			}
			used, holders := l.Shared(node, gpu)
			slices.Sort(holders)
			if used != s || !slices.Equal(holders, shared[gpu]) {
				return fmt.Errorf("Shared(%s, %s) = %+v %v, want %+v %v", node, gpu, used, holders, s, shared[gpu])
			}
		}
		// Every device the ledger knows of: held exactly as the live
		// allocations say, free otherwise.
		for _, g := range m.inv[node] {
			if h := l.Holder(node, g.UUID); h != whole[g.UUID] {
				return fmt.Errorf("Holder(%s, %s) = %q, want %q", node, g.UUID, h, whole[g.UUID])
			}
			if used, _ := l.Shared(node, g.UUID); used != sum[g.UUID] {
				return fmt.Errorf("Shared(%s, %s) = %+v, want %+v", node, g.UUID, used, sum[g.UUID])
			}
			for _, mi := range g.MIGInstances {
				if h := l.Holder(node, mi.UUID); h != inst[mi.UUID] {
					return fmt.Errorf("Holder(%s, %s) = %q, want %q", node, mi.UUID, h, inst[mi.UUID])
				}
			}
		}
		for uuid, id := range inst {
			if h := l.Holder(node, uuid); h != id {
				return fmt.Errorf("Holder(%s, %s) = %q, want %q", node, uuid, h, id)
			}
		}
	}
	if count != len(want) {
		return fmt.Errorf("ledger has %d live allocations, model %d", count, len(want))
	}
	return nil
}

// checkRebuild rebuilds a ledger from the log (entries first, then the
// latest inventories and readiness, as after a crash where the streams are
// read in any order) and checks that it holds what l holds and answers
// Verify as l does.
func checkRebuild(l *Ledger, m *model, nodes []string, log []stored, randomItem func() contracts.Allocation) error {
	r := New(testKeep)
	for _, s := range log {
		if err := r.Apply(s.e, s.seq); err != nil {
			return fmt.Errorf("rebuild: apply %s %s: %w", s.e.Kind, s.e.Allocation.ID, err)
		}
	}
	for node, inv := range m.inv {
		_ = r.SetInventory(contracts.NodeInventory{NodeID: node, GPUs: inv, CPUMilli: m.host[node].CPUMilli, MemoryMiB: m.host[node].MemoryMiB})
	}
	for node, ready := range m.ready {
		r.SetReady(node, ready)
	}
	for node, ad := range m.admin {
		r.SetAdmin(node, ad)
	}
	snapshot := func(x *Ledger) map[string]any {
		out := map[string]any{}
		for _, node := range nodes {
			out[node+" seq"] = x.LastSeq(node)
			out[node+" live"] = x.Live(node)
			cpu, mem := x.HostUsed(node)
			out[node+" host"] = [2]int64{cpu, mem}
			for _, s := range log {
				for _, d := range s.e.Allocation.Devices {
					out[node+" holder "+d.UUID] = x.Holder(node, d.UUID)
					used, holders := x.Shared(node, d.UUID)
					out[node+" shared "+d.UUID] = fmt.Sprint(used, holders)
					if d.MIG != nil {
						out[node+" holder "+d.MIG.UUID] = x.Holder(node, d.MIG.UUID)
					}
				}
			}
		}
		return out
	}
	if diff := cmp.Diff(snapshot(l), snapshot(r)); diff != "" {
		return fmt.Errorf("rebuilt ledger differs (-live +rebuilt):\n%s", diff)
	}
	for range 20 {
		a := randomItem()
		if v, w := l.Verify(a), r.Verify(a); v.Reason != w.Reason || v.Duplicate != w.Duplicate {
			return fmt.Errorf("Verify(%s on %s%s): ledger %+v, rebuilt %+v", a.ID, a.NodeID, refs(a.Devices), v, w)
		}
	}
	return nil
}

// gpuHeldIn is the model's reading of a GPU hold: the GPU's own entry
// cordons or drains it (the node's flags are checked before devices).
func gpuHeldIn(ad contracts.NodeAdmin, uuid string) bool {
	h, ok := ad.GPUs[uuid]
	return ok && (h.Cordoned || h.Drain)
}
