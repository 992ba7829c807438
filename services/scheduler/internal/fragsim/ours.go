package fragsim

import (
	"cmp"
	"math"
	"slices"
)

// FragAware is our fragmentation-aware policy. It starts from FGD (the
// change of expected fragmentation against the typical workload) and adds
// what the replays show FGD misses:
//
//  1. Device choice for a GPU-sharing task by the room it leaves: the room
//     of a device in use is worth what the frequent sharing sizes can still
//     fill (roomWaste; an idle device is worth all of it, since a whole-GPU
//     task fills it); the task goes where the least completable room is
//     lost, ties to the tightest fit. FGD's measure calls a 530 milli-GPU
//     room a fragment to 65% of tasks although a 470 (a tenth of all tasks)
//     fills it to 94%.
//  2. CPU and memory as co-constraints: a fluid estimate of the idle GPU
//     that the workload's mean CPU and memory per GPU would leave stranded
//     (Stranded), so CPU-heavy and CPU-only tasks go to CPU-rich machines
//     and GPUs are not left idle on machines with no CPU.
//  3. Model pressure: a GPU model that model-restricted tasks will need is
//     kept for them, in proportion to that need over the model's capacity.
//  4. Consolidation: node scores are coarse (Quantum), and equal ones go to
//     the first node in the replay's node order, which packs machines one by
//     one and keeps whole machines idle for multi-GPU tasks (the same effect
//     that FGD's integer scores have in the paper's simulator).
//
// Score is strictly lexicographic: the room lost (sharing tasks), then the
// tightest fit (sharing tasks), then the node term.
type FragAware struct {
	w   *Workload
	opt FragAwareOptions
	// pressure is, by model index, the demand of model-restricted tasks
	// over the model's capacity.
	pressure [maxModels]float64
	// cpuPerGPU and memPerGPU are the GPU tasks' mean CPU (milli) and
	// memory (MiB) per milli-GPU.
	cpuPerGPU, memPerGPU float64
	// roomWaste is, by a device's free milli-GPU, the least room that the
	// frequent sharing sizes leave when they fill it.
	roomWaste [MilliGPU + 1]int64
	// reserve are the multi-GPU kinds of the workload and what losing a
	// node that could host one costs (reserveKind).
	reserve []reserveKind
}

// reserveKind is a multi-GPU task kind that only a minority of the
// machines can host, and the milli-GPU a placement is charged when it
// leaves a node unable to host the kind (reserveKinds).
type reserveKind struct {
	Request
	cost float64
}

// FragAwareOptions tune FragAware; DefaultFragAwareOptions are the
// settings measured best on the openb trace (see the package README).
type FragAwareOptions struct {
	// Workload makes the typical distribution of the fragmentation term.
	Workload WorkloadOptions
	// Quantum (milli-GPU) is the resolution of the node term: closer moves
	// tie, and the tie consolidates.
	Quantum float64
	// Fluid weighs the change of stranded GPU (milli-GPU per milli-GPU).
	Fluid float64
	// StrandMemory counts memory as well as CPU in the stranded estimate.
	StrandMemory bool
	// ModelPressure weighs the placed milli-GPU by its model's pressure.
	ModelPressure float64
	// RoomShare is the share of sharing tasks a size needs to count as
	// frequent when valuing a device's room.
	RoomShare float64
	// Reserve weighs the cost of leaving a node unable to host a
	// multi-GPU kind that it could host and that few machines can
	// (reserveKinds): the early refusals of multigpu20.
	Reserve float64
	// ReserveHome is the largest share of the GPU capacity a kind's home
	// (the machines that fit it idle) may have for the kind to be
	// reserved; kinds most machines can host need no reserve.
	ReserveHome float64
}

// DefaultFragAwareOptions are the settings the replays measured best.
var DefaultFragAwareOptions = FragAwareOptions{
	Workload:      FGDWorkloadOptions,
	Quantum:       40,
	Fluid:         0.75,
	StrandMemory:  true,
	ModelPressure: 0.5,
	RoomShare:     0.03,
	Reserve:       0.15,
	ReserveHome:   0.5,
}

// NewFragAware builds the policy for a cluster and the typical workload
// (here, the pod list itself, as FGD uses it).
func NewFragAware(nodes []NodeSpec, pods []Pod) *FragAware {
	return NewFragAwareWith(nodes, pods, DefaultFragAwareOptions)
}

// NewFragAwareWith builds the policy with explicit options.
func NewFragAwareWith(nodes []NodeSpec, pods []Pod, opt FragAwareOptions) *FragAware {
	p := &FragAware{w: NewWorkload(pods, opt.Workload), opt: opt}
	p.roomWaste = roomWaste(pods, opt.RoomShare)
	var cpu, mem, gpu float64
	for _, t := range pods {
		if t.GPUs > 0 {
			cpu += float64(t.CPUMilli)
			mem += float64(t.MemoryMiB)
			gpu += float64(t.TotalMilliGPU())
		}
	}
	if gpu > 0 {
		p.cpuPerGPU = cpu / gpu
		if opt.StrandMemory {
			p.memPerGPU = mem / gpu
		}
	}
	p.pressure = modelPressure(nodes, pods)
	if opt.Reserve > 0 {
		p.reserve = reserveKinds(nodes, pods, opt.Reserve, opt.ReserveHome)
	}
	return p
}

func (*FragAware) Name() string { return "FragAware" }

// Score implements Policy.
func (p *FragAware) Score(n *NodeState, r Request) Choice {
	return p.ScoreDevices(n, r, ^uint64(0))
}

// ScoreDevices is Score with a GPU-sharing request restricted to the
// devices whose bit is set in devices (bit g for device g): the scheduler
// also needs framebuffer on the device, which the model does not track.
// Choice.GPU is -1 when no allowed device has room.
func (p *FragAware) ScoreDevices(n *NodeState, r Request, devices uint64) Choice {
	if !r.Shares() {
		return Choice{Score: p.nodeTerm(n, r, -1), GPU: -1}
	}
	// Devices with different rooms leave different fits, so the room lost
	// and the fit settle the device; the node term only ranks nodes.
	best, bestKey := -1, int64(0)
	for g := range n.GPUs {
		room := n.GPULeft[g]
		if room < r.GPUMilli || devices&(1<<g) == 0 {
			continue
		}
		var before int64 // an idle device: a whole-GPU task fills it
		if room < MilliGPU {
			before = p.roomWaste[room]
		}
		lost := p.roomWaste[room-r.GPUMilli] - before
		// Higher is better: least room lost, then the tightest fit; the
		// first device of equal room wins.
		key := -lost*2*MilliGPU - (room - r.GPUMilli)
		if best < 0 || key > bestKey {
			best, bestKey = g, key
		}
	}
	if best < 0 {
		return Choice{GPU: -1}
	}
	// Lexicographic: |key| < 10^7, the node term within ±4,999 quanta.
	return Choice{Score: float64(bestKey)*1e4 + p.nodeTerm(n, r, best), GPU: best}
}

// nodeTerm rates placing r on the node (a sharing r on device gpu) in
// quanta: FGD's fragmentation change, the change of stranded GPU and the
// model pressure of the placed GPU.
func (p *FragAware) nodeTerm(n *NodeState, r Request, gpu int) float64 {
	delta := p.w.Frag(n) - p.w.FragAfter(n, r, gpu)
	idle := n.GPULeftTotal()
	delta -= p.opt.Fluid * (p.stranded(idle-r.TotalMilliGPU(), n.CPULeft-r.CPUMilli, n.MemLeft-r.MemoryMiB) -
		p.stranded(idle, n.CPULeft, n.MemLeft))
	delta -= p.opt.ModelPressure * p.pressure[n.Model] * float64(r.TotalMilliGPU())
	delta -= p.reserveLost(n, r, gpu)
	q := delta
	if p.opt.Quantum > 0 {
		q = math.Floor(delta / p.opt.Quantum)
	}
	return max(min(q, 4999), -4999)
}

// stranded is the idle milli-GPU of a node (with the given free CPU and
// memory) that the GPU tasks' mean CPU and memory per GPU would leave
// without CPU or memory: a fluid estimate of the GPU that CPU or memory
// exhaustion will strand.
func (p *FragAware) stranded(idle, cpuLeft, memLeft int64) float64 {
	s := 0.0
	if p.cpuPerGPU > 0 {
		s = max(s, float64(idle)-float64(cpuLeft)/p.cpuPerGPU)
	}
	if p.memPerGPU > 0 {
		s = max(s, float64(idle)-float64(memLeft)/p.memPerGPU)
	}
	return s
}

// roomWaste is, for each free milli-GPU r of a device, the least room left
// once r is filled with sharing sizes that make at least share of the
// sharing tasks (an unbounded knapsack on the frequent sizes): 0 for a
// room a frequent size fills exactly, r for one no frequent size fits.
// Rare sizes are left out because they seldom arrive in time to fill a
// room; counting them makes every room look fillable.
func roomWaste(pods []Pod, share float64) [MilliGPU + 1]int64 {
	count := map[int64]int{}
	total := 0
	for _, t := range pods {
		if t.Shares() {
			count[t.GPUMilli]++
			total++
		}
	}
	var sizes []int64
	for m, c := range count {
		if float64(c) >= share*float64(total) {
			sizes = append(sizes, m)
		}
	}
	slices.Sort(sizes)
	var v [MilliGPU + 1]int64
	for r := int64(1); r <= MilliGPU; r++ {
		v[r] = r
		for _, s := range sizes {
			if s > r {
				break
			}
			v[r] = min(v[r], v[r-s])
		}
	}
	return v
}

// modelPressure is, by model index, the GPU demand of model-restricted
// tasks over the model's capacity. At 100% arrived the tasks ask for the
// whole capacity, so a restricted task's share of the demand, spread over
// its models by their capacity, is what those models must keep for it.
func modelPressure(nodes []NodeSpec, pods []Pod) [maxModels]float64 {
	var capacity, pressure [maxModels]float64
	var total, demand float64
	for _, n := range nodes {
		capacity[n.Model] += n.gpuMilli()
		total += n.gpuMilli()
	}
	for _, t := range pods {
		demand += float64(t.TotalMilliGPU())
	}
	if demand == 0 {
		return pressure
	}
	for _, t := range pods {
		if t.Models == AnyModel || t.GPUs == 0 {
			continue
		}
		var allowed float64
		for m := range maxModels {
			if t.Models.Has(uint8(m)) {
				allowed += capacity[m]
			}
		}
		if allowed == 0 {
			continue
		}
		need := float64(t.TotalMilliGPU()) / demand * total
		for m := range maxModels {
			if t.Models.Has(uint8(m)) && capacity[m] > 0 {
				pressure[m] += need / allowed // need·capacity[m]/allowed over capacity[m]
			}
		}
	}
	return pressure
}

// reserveLost is the cost of the multi-GPU kinds that node n could host
// and could not once r is placed (a sharing r on device gpu).
func (p *FragAware) reserveLost(n *NodeState, r Request, gpu int) float64 {
	if len(p.reserve) == 0 {
		return 0
	}
	whole := n.wholeFree
	switch {
	case r.Shares():
		if gpu >= 0 && n.GPULeft[gpu] == MilliGPU {
			whole--
		}
	case r.GPUs > 0:
		whole -= r.GPUs
	}
	cpu, mem := n.CPULeft-r.CPUMilli, n.MemLeft-r.MemoryMiB
	lost := 0.0
	for i := range p.reserve {
		k := &p.reserve[i]
		if n.wholeFree < k.GPUs || n.CPULeft < k.CPUMilli || n.MemLeft < k.MemoryMiB || !k.Models.Has(n.Model) {
			continue // it could not host k before either
		}
		if whole < k.GPUs || cpu < k.CPUMilli || mem < k.MemoryMiB {
			lost += k.cost
		}
	}
	return lost
}

// reserveKinds groups the multi-GPU tasks of pods by request and prices
// the kinds whose home (the machines that fit the kind when idle: enough
// GPUs, CPU, memory, the model) holds at most maxHome of the GPU capacity:
// weight × the kind's milli-GPU × its pressure, which is the kind's demand
// by 100% arrived over its home's capacity, times how much smaller than
// the fleet that home is, at most 1. On the openb node list an 8-GPU task
// asking 120 cores fits only the 39 128-core G3 machines (5% of the GPUs):
// its pressure is 1, and breaking an idle G3 costs 2 × 8,000 × weight; the
// 64- and 88-core 8-GPU tasks fit 71% of the GPUs and are not reserved.
// The product (demand over home, squared scarcity) and maxHome were chosen
// on the replays (README): demand over home alone prices a kind that 39
// machines must host like one that 600 can, and reserving every
// multi-GPU kind spreads work onto the small, model-restricted machines.
// Kinds no machine fits are left out.
func reserveKinds(nodes []NodeSpec, pods []Pod, weight, maxHome float64) []reserveKind {
	var capacity, demand float64
	for _, n := range nodes {
		capacity += n.gpuMilli()
	}
	need := map[Request]float64{}
	for _, t := range pods {
		demand += float64(t.TotalMilliGPU())
		if t.GPUs > 1 {
			need[t.Request] += float64(t.TotalMilliGPU())
		}
	}
	var out []reserveKind
	for r, d := range need {
		var home float64
		for _, n := range nodes {
			if n.GPUs >= r.GPUs && n.CPUMilli >= r.CPUMilli && n.MemoryMiB >= r.MemoryMiB && r.Models.Has(n.Model) {
				home += n.gpuMilli()
			}
		}
		if home == 0 || home > maxHome*capacity {
			continue
		}
		pressure := min(d/demand*capacity/home*capacity/home, 1)
		out = append(out, reserveKind{Request: r, cost: weight * pressure * float64(r.TotalMilliGPU())})
	}
	// A fixed order keeps the sum's rounding, and so the replays,
	// deterministic.
	slices.SortFunc(out, func(a, b reserveKind) int {
		return cmp.Or(cmp.Compare(a.GPUs, b.GPUs), cmp.Compare(a.CPUMilli, b.CPUMilli), cmp.Compare(a.MemoryMiB, b.MemoryMiB), cmp.Compare(a.Models, b.Models))
	})
	return out
}
