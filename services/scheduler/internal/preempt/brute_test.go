package preempt_test

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/preempt"
)

// world is a random small cluster, what runs on it and a preemptor.
type world struct {
	nodes      []placement.Node // snapshot order (shuffled)
	running    []preempt.Running
	p          preempt.Preemptor
	minRuntime time.Duration
	// spare is what a tenant may lose to another's preemptor (Options.Spare).
	spare map[preempt.TenantPool]int64
}

var migProfiles = []string{"1g.10gb", "2g.20gb", "3g.40gb"}

// randomWorld builds nodes n0..n{k-1} (some MIG unless wholeOnly), fills
// them with jobs, shares, MIG tenants and cards held by plans in flight,
// and links some whole-card jobs on different nodes into gangs.
func randomWorld(rng *rand.Rand, nodes int, wholeOnly bool) world {
	var w world
	pris := []contracts.Priority{be, norm, high, crit}
	tenants := []string{"research", "other", "third"}
	newJob := func(id, nodeID string) preempt.Running {
		r := job(id, nodeID, pris[rng.IntN(len(pris))], tenant(tenants[rng.IntN(len(tenants))]))
		r.Borrowing = rng.IntN(2) == 0
		r.Checkpointable = rng.IntN(2) == 0
		if rng.IntN(5) == 0 {
			r.StartedAt = time.Time{}
		} else {
			r.StartedAt = t0.Add(-time.Duration(rng.IntN(18)) * 10 * time.Minute)
			if rng.IntN(2) == 0 {
				r.LastCheckpoint = r.StartedAt.Add(time.Duration(rng.IntN(18)) * 5 * time.Minute)
			}
		}
		r.CPUMilli = int64(rng.IntN(4)) * 1000
		return r
	}
	var wholeJobs []int
	for k := range nodes {
		id := fmt.Sprintf("n%d", k)
		if !wholeOnly && rng.IntN(4) == 0 {
			var ps []string
			for range 2 + rng.IntN(3) {
				ps = append(ps, migProfiles[rng.IntN(len(migProfiles))])
			}
			n := migNode(id, ps...)
			n.CPUMilliFree = int64(4+rng.IntN(8)) * 1000
			for s, p := range ps {
				switch rng.IntN(6) {
				case 0: // free
				case 1:
					n.GPUs[0].Instances[s].Held = true // a plan in flight
				default:
					r := newJob(fmt.Sprintf("%s-mig%d", id, s), id)
					mig(s, p)(&r)
					w.running = append(w.running, r)
				}
			}
			w.nodes = append(w.nodes, n)
			continue
		}
		cardsN := 2 + rng.IntN(3)
		n := node(id, cardsN, zone([]string{"z1", "z2"}[rng.IntN(2)]))
		n.CPUMilliFree = int64(4+rng.IntN(8)) * 1000
		if rng.IntN(3) == 0 {
			for i := range n.GPUs {
				n.GPUs[i].NVLinkDomain = []string{"a", "b"}[i*2/cardsN]
			}
		}
		for i := 0; i < cardsN; i++ {
			switch rng.IntN(9) {
			case 0: // free
			case 1:
				n.GPUs[i].Held = true
			case 2, 3, 4, 5: // a whole-card job, sometimes of two cards
				r := newJob(fmt.Sprintf("%s-w%d", id, i), id)
				cards(i)(&r)
				if i+1 < cardsN && rng.IntN(3) == 0 {
					i++
					cards(i)(&r)
				}
				wholeJobs = append(wholeJobs, len(w.running))
				w.running = append(w.running, r)
			default: // shares
				var mem int64
				pct := 0
				for s := range 2 + rng.IntN(3) {
					m, p := int64(1+rng.IntN(4))*8<<10, 10*(1+rng.IntN(4))
					if mem+m > n.GPUs[i].MemoryMiB || pct+p > 100 {
						break
					}
					mem, pct = mem+m, pct+p
					r := newJob(fmt.Sprintf("%s-s%d.%d", id, i, s), id)
					share(i, m, p)(&r)
					w.running = append(w.running, r)
				}
			}
		}
		w.nodes = append(w.nodes, n)
	}
	// Link whole-card jobs of different nodes into gangs: one job, so one
	// priority, tenant and borrowing; parts may have started apart.
	for g := 0; len(wholeJobs) >= 2 && rng.IntN(2) == 0; g++ {
		a, b := wholeJobs[0], wholeJobs[1]
		wholeJobs = wholeJobs[2:]
		if w.running[a].NodeID == w.running[b].NodeID {
			continue
		}
		key := fmt.Sprintf("gang%d", g)
		for _, i := range []int{a, b} {
			w.running[i].Gang, w.running[i].JobID = key, key
			w.running[i].Priority, w.running[i].Tenant, w.running[i].Borrowing =
				w.running[a].Priority, w.running[a].Tenant, w.running[a].Borrowing
		}
	}
	// Some tenants have a guarantee in the pool: they may lose some of
	// what they hold, or nothing.
	for _, tn := range tenants {
		if rng.IntN(2) == 0 {
			if w.spare == nil {
				w.spare = map[preempt.TenantPool]int64{}
			}
			w.spare[preempt.TenantPool{Tenant: tn}] = int64(rng.IntN(4)) * 1000
		}
	}
	w.nodes = cluster(w.nodes, w.running).Nodes
	rng.Shuffle(len(w.nodes), func(i, j int) { w.nodes[i], w.nodes[j] = w.nodes[j], w.nodes[i] })
	w.p = wants(pris[1+rng.IntN(len(pris)-1)], 1)
	w.p.Reclaim = rng.IntN(2) == 0
	w.p.Request.CPUMilli = int64(rng.IntN(6)) * 1000
	switch k := rng.IntN(5); {
	case wholeOnly || k < 2:
		w.p.Request.GPU.Count = 1 + rng.IntN(3)
		if rng.IntN(3) == 0 {
			w.p.Request.GPU.Topology = contracts.TopologyNVLink
		}
	case k < 4:
		shareOf(int64(1+rng.IntN(6))*8<<10, 10*(1+rng.IntN(7)))(&w.p)
	default:
		migOf(migProfiles[rng.IntN(len(migProfiles))])(&w.p)
	}
	if rng.IntN(2) == 0 {
		w.minRuntime = time.Hour
	}
	return w
}

// The tests' own reading of the rules, written apart from the package's.

func eligible(w world, v preempt.Running) bool {
	if !v.StartedAt.IsZero() && t0.Sub(v.StartedAt) < w.minRuntime {
		return false
	}
	own := v.Tenant == w.p.Request.Tenant
	if v.Priority.Rank() < w.p.Priority.Rank() && (own || v.Borrowing) {
		return true
	}
	return w.p.Reclaim && v.Borrowing && !own && v.Priority.Rank() <= w.p.Priority.Rank()
}

// withinSpare: the victims take no tenant other than the preemptor's below
// its guarantee (w.spare: what each may lose).
func withinSpare(w world, victims []preempt.Running) bool {
	lost := map[preempt.TenantPool]int64{}
	for _, v := range victims {
		if v.Tenant == w.p.Request.Tenant {
			continue
		}
		k := preempt.TenantPool{Tenant: v.Tenant, Pool: v.Pool}
		limit, ok := w.spare[k]
		if !ok {
			continue
		}
		for _, d := range v.Devices {
			lost[k] += d.MilliGPUs()
		}
		if lost[k] > limit {
			return false
		}
	}
	return true
}

// units groups running into what is evicted together, keeping only the
// units every part of which is eligible.
func units(w world) [][]preempt.Running {
	var out [][]preempt.Running
	byGang := map[string]int{}
	bad := map[int]bool{}
	for _, r := range w.running {
		i, ok := byGang[r.Gang]
		if r.Gang == "" || !ok {
			i = len(out)
			out = append(out, nil)
			if r.Gang != "" {
				byGang[r.Gang] = i
			}
		}
		out[i] = append(out[i], r)
		if !eligible(w, r) {
			bad[i] = true
		}
	}
	var keep [][]preempt.Running
	for i, u := range out {
		if !bad[i] {
			keep = append(keep, u)
		}
	}
	return keep
}

// victimCost is the minimality order as a tuple: highest priority, GPUs
// (milli), jobs, progress lost, not checkpointable.
func victimCost(victims []preempt.Running) [5]int64 {
	var c [5]int64
	c[0] = -100
	jobs := map[string]time.Duration{}
	noCkpt := map[string]bool{}
	for _, v := range victims {
		for _, d := range v.Devices {
			switch {
			case d.MIG != nil:
				c[1] += contracts.GPURequest{Count: 1, MIGProfile: d.MIG.Profile}.MilliGPUs()
			case d.Share != nil:
				c[1] += int64(d.Share.ComputePercent) * 10
			default:
				c[1] += 1000
			}
		}
		key := cmp.Or(v.Gang, "alloc/"+v.AllocationID)
		var lost time.Duration
		if !v.StartedAt.IsZero() {
			lost = t0.Sub(v.StartedAt)
			if v.LastCheckpoint.After(v.StartedAt) {
				lost = t0.Sub(v.LastCheckpoint)
			}
		}
		jobs[key] = max(jobs[key], lost)
		noCkpt[key] = noCkpt[key] || !v.Checkpointable
		c[0] = max(c[0], int64(v.Priority.Rank()))
	}
	c[2] = int64(len(jobs))
	for k, l := range jobs {
		c[3] += int64(l)
		if noCkpt[k] {
			c[4]++
		}
	}
	return c
}

// bruteForce tries every subset of eligible units on every node.
func bruteForce(w world) (best [5]int64, bestNode string, found bool) {
	snap := placement.Snapshot{Nodes: w.nodes}
	ids := make([]string, 0, len(w.nodes))
	for _, n := range w.nodes {
		ids = append(ids, n.ID)
	}
	slices.Sort(ids)
	us := units(w)
	for _, id := range ids {
		var here [][]preempt.Running
		for _, u := range us {
			if slices.ContainsFunc(u, func(r preempt.Running) bool { return r.NodeID == id }) {
				here = append(here, u)
			}
		}
		for mask := 0; mask < 1<<len(here); mask++ {
			var victims []preempt.Running
			for i, u := range here {
				if mask&(1<<i) != 0 {
					victims = append(victims, u...)
				}
			}
			if !withinSpare(w, victims) {
				continue
			}
			n := release(snap, id, victims)
			if _, ok := placement.FitNode(&n, perMachine(w.p)); !ok {
				continue
			}
			if c := victimCost(victims); !found || slices.Compare(c[:], best[:]) < 0 {
				best, bestNode, found = c, id, true
			}
		}
	}
	return best, bestNode, found
}

// Choose against every subset of eligible victims on small nodes: it finds
// a choice exactly when one exists, the cheapest one, on the first node
// that has it.
func TestChooseMatchesBruteForce(t *testing.T) {
	for seed := range uint64(1000) {
		rng := rand.New(rand.NewPCG(seed, 17))
		w := randomWorld(rng, 1+rng.IntN(3), false)
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			snap := placement.Snapshot{Nodes: w.nodes}
			ch, ok := preempt.Choose(snap, w.running, w.p, preempt.Options{Now: t0, MinRuntime: w.minRuntime, Spare: w.spare})
			best, bestNode, found := bruteForce(w)
			if ok != found {
				t.Fatalf("Choose ok=%v, brute force found=%v (best %v on %s); choice %+v", ok, found, best, bestNode, ch)
			}
			if !ok {
				return
			}
			checkChoice(t, snap, w.running, w.p, ch)
			for _, v := range ch.Victims {
				if !eligible(w, v) {
					t.Errorf("victim %s is not eligible", v.AllocationID)
				}
			}
			if !withinSpare(w, ch.Victims) {
				t.Errorf("victims %v take a tenant below its guarantee (spare %v)", ch.Victims, w.spare)
			}
			if got := victimCost(ch.Victims); got != best || ch.Parts[0].NodeID != bestNode {
				t.Errorf("Choose cost %v on %s, brute force %v on %s; reason %q", got, ch.Parts[0].NodeID, best, bestNode, ch.Reason)
			}
		})
	}
}

// Multi-machine choices are greedy, node by node, then reprieved: what is
// checked is that there is a choice exactly when k machines fit with every
// eligible victim gone, and that no victim of it could be spared.
func TestChooseMultiMachineRandom(t *testing.T) {
	for seed := range uint64(500) {
		rng := rand.New(rand.NewPCG(seed, 29))
		w := randomWorld(rng, 3+rng.IntN(3), true)
		k := 2 + rng.IntN(2)
		w.p.Request.GPU.Count = k * (1 + rng.IntN(2))
		w.p.Request.GPU.Nodes = k
		w.p.Request.GPU.Topology = []contracts.Topology{contracts.TopologyAny, contracts.TopologyNVLink, contracts.TopologyZone}[rng.IntN(3)]
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			snap := placement.Snapshot{Nodes: w.nodes}
			// Half the worlds keep guarantees: the choice must keep to them
			// (whether one exists is then not checked: every eligible victim
			// gone may take a tenant below its guarantee).
			spare := w.spare
			if seed%2 == 0 {
				spare = nil
			}
			w.spare = spare
			ch, ok := preempt.Choose(snap, w.running, w.p, preempt.Options{Now: t0, MinRuntime: w.minRuntime, Spare: spare})
			var all []preempt.Running
			for _, u := range units(w) {
				all = append(all, u...)
			}
			if want := enoughMachines(w, snap, all, k); ok != want && (spare == nil || ok) {
				t.Fatalf("Choose ok=%v; with every eligible victim gone enough machines=%v", ok, want)
			}
			if !ok {
				return
			}
			checkChoice(t, snap, w.running, w.p, ch)
			for _, v := range ch.Victims {
				if !eligible(w, v) {
					t.Errorf("victim %s is not eligible", v.AllocationID)
				}
			}
			if !withinSpare(w, ch.Victims) {
				t.Errorf("victims %v take a tenant below its guarantee (spare %v)", ch.Victims, spare)
			}
			for _, v := range ch.Victims {
				key := cmp.Or(v.Gang, v.AllocationID)
				spared := slices.DeleteFunc(slices.Clone(ch.Victims), func(r preempt.Running) bool { return cmp.Or(r.Gang, r.AllocationID) == key })
				if enoughMachines(w, snap, spared, k) {
					t.Errorf("victim %s could be spared; reason %q", v.AllocationID, ch.Reason)
				}
			}
		})
	}
}

// enoughMachines: k nodes (of one zone, for zone topology) fit the
// preemptor's parts once victims are gone.
func enoughMachines(w world, snap placement.Snapshot, victims []preempt.Running, k int) bool {
	perZone := map[string]int{}
	for _, n := range w.nodes {
		rn := release(snap, n.ID, victims)
		if _, ok := placement.FitNode(&rn, perMachine(w.p)); ok {
			z := ""
			if w.p.Request.GPU.Topology == contracts.TopologyZone {
				z = n.Zone
			}
			perZone[z]++
		}
	}
	for _, c := range perZone {
		if c >= k {
			return true
		}
	}
	return false
}
