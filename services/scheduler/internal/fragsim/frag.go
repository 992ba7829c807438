package fragsim

import (
	"cmp"
	"slices"
)

// TypicalTask is one kind of task of a workload and its share of it.
type TypicalTask struct {
	Request
	// Spec is the allowed-models string the kind was grouped by.
	Spec string
	// Weight is the kind's share of the workload; the weights of a
	// Workload sum to 1.
	Weight float64
}

// WorkloadOptions say how a pod list becomes a typical distribution.
type WorkloadOptions struct {
	// Coverage keeps the most frequent kinds until they account for this
	// share of the tasks, then renormalises (FGD: 0.95). 0 or 1 keeps all.
	Coverage float64
	// ByMemory makes tasks that differ only in memory separate kinds and
	// makes the fragmentation measure check memory too. FGD ignores memory.
	ByMemory bool
	// GPUWeight counts a whole-GPU task as 1 + GPUs×GPUWeight tasks (FGD's
	// gpuResWeight, 0 in the paper's runs).
	GPUWeight float64
}

// FGDWorkloadOptions are the settings of the paper's runs.
var FGDWorkloadOptions = WorkloadOptions{Coverage: 0.95}

// Workload is the typical task distribution a fragmentation measure is
// taken against.
type Workload struct {
	Tasks    []TypicalTask
	byMemory bool
	// cpuOnly is the total weight of the CPU-only kinds: every idle GPU is
	// a fragment to them.
	cpuOnly float64
	// gpu holds the GPU kinds by ascending GPUMilli, so that one pass over
	// a node's sorted devices measures them all.
	gpu []TypicalTask
}

// NewWorkload groups pods into kinds, as the FGD paper's simulator does:
// by CPU, GPU share, GPU count and model constraint (and memory when
// ByMemory), most frequent first.
func NewWorkload(pods []Pod, opt WorkloadOptions) *Workload {
	type key struct {
		cpu, mem, milli int64
		gpus            int
		spec            string
	}
	counts := map[key]float64{}
	reqs := map[key]Request{}
	var total float64
	for _, p := range pods {
		k := key{cpu: p.CPUMilli, milli: p.GPUMilli, gpus: p.GPUs, spec: p.Spec}
		if opt.ByMemory {
			k.mem = p.MemoryMiB
		}
		w := 1.0
		if opt.GPUWeight > 0 && p.GPUMilli == MilliGPU {
			w = 1 + float64(p.GPUs)*opt.GPUWeight
		}
		counts[k] += w
		total += w
		r := p.Request
		if !opt.ByMemory {
			r.MemoryMiB = 0
		}
		reqs[k] = r
	}
	tasks := make([]TypicalTask, 0, len(counts))
	for k, c := range counts {
		tasks = append(tasks, TypicalTask{Request: reqs[k], Spec: k.spec, Weight: c})
	}
	// Most frequent first; ties in the reverse of the paper's resource
	// order (CPU, GPU share, GPU count, model), so the cut-off matches.
	slices.SortFunc(tasks, func(a, b TypicalTask) int {
		return cmp.Or(cmp.Compare(b.Weight, a.Weight), cmp.Compare(b.CPUMilli, a.CPUMilli),
			cmp.Compare(b.GPUMilli, a.GPUMilli), cmp.Compare(b.GPUs, a.GPUs), cmp.Compare(b.Spec, a.Spec),
			cmp.Compare(b.MemoryMiB, a.MemoryMiB))
	})
	if opt.Coverage > 0 && opt.Coverage < 1 {
		want, cum := opt.Coverage*total, 0.0
		n := 0
		for n < len(tasks) && cum < want {
			cum += tasks[n].Weight
			n++
		}
		tasks, total = tasks[:n], cum
	}
	w := &Workload{Tasks: tasks, byMemory: opt.ByMemory}
	for i := range w.Tasks {
		w.Tasks[i].Weight /= total
		t := w.Tasks[i]
		if t.GPUs == 0 {
			w.cpuOnly += t.Weight
		} else {
			w.gpu = append(w.gpu, t)
		}
	}
	slices.SortStableFunc(w.gpu, func(a, b TypicalTask) int { return cmp.Compare(a.GPUMilli, b.GPUMilli) })
	return w
}

// Frag is the node's fragmentation against the workload, in milli-GPU: the
// expected idle GPU capacity that a task drawn from the workload could not
// use (F_n(M) of the FGD paper). To a task that cannot run on the node at
// all (CPU-only, wrong model, not enough CPU, or too few devices with room)
// all idle GPU is a fragment; to one that can, the idle share of each device
// with less room than the task asks.
//
// Frag caches its result in n until n changes, so one NodeState must not
// be scored from two goroutines at once.
func (w *Workload) Frag(n *NodeState) float64 {
	if n.fragOf == w {
		return n.frag
	}
	var sorted [MaxGPUsPerNode]int64
	copy(sorted[:], n.GPULeft[:n.GPUs])
	insertionSort(sorted[:n.GPUs])
	n.frag, n.fragOf = w.fragSorted(n.Model, n.CPULeft, n.MemLeft, sorted[:n.GPUs]), w
	return n.frag
}

// FragAfter is the node's fragmentation once r is assigned to it (a
// GPU-sharing r to device gpu), leaving n as it is.
func (w *Workload) FragAfter(n *NodeState, r Request, gpu int) float64 {
	var left [MaxGPUsPerNode]int64
	copy(left[:], n.GPULeft[:n.GPUs])
	applyGPUs(left[:n.GPUs], r, gpu)
	insertionSort(left[:n.GPUs])
	return w.fragSorted(n.Model, n.CPULeft-r.CPUMilli, n.MemLeft-r.MemoryMiB, left[:n.GPUs])
}

// applyGPUs takes r's GPU share from the devices as NodeState.Assign does.
func applyGPUs(left []int64, r Request, gpu int) {
	if r.GPUs == 0 {
		return
	}
	if r.Shares() {
		left[gpu] -= r.GPUMilli
		return
	}
	need := r.GPUs
	for g := range left {
		if need == 0 {
			break
		}
		if left[g] == MilliGPU {
			left[g] = 0
			need--
		}
	}
}

// fragSorted measures a node given its devices' free milli-GPU in
// ascending order.
func (w *Workload) fragSorted(model uint8, cpuLeft, memLeft int64, sorted []int64) float64 {
	var idle int64
	for _, l := range sorted {
		idle += l
	}
	if idle == 0 {
		return 0
	}
	all := float64(idle)
	frag := w.cpuOnly * all
	var below int64 // free milli-GPU of the devices with less room than the kind asks
	j := 0
	for i := range w.gpu {
		k := &w.gpu[i]
		for j < len(sorted) && sorted[j] < k.GPUMilli {
			below += sorted[j]
			j++
		}
		if !k.Models.Has(model) || cpuLeft < k.CPUMilli || (w.byMemory && memLeft < k.MemoryMiB) || len(sorted)-j < k.GPUs {
			frag += k.Weight * all
		} else {
			frag += k.Weight * float64(below)
		}
	}
	return frag
}

func insertionSort(a []int64) {
	for i := 1; i < len(a); i++ {
		for j := i; j > 0 && a[j] < a[j-1]; j-- {
			a[j], a[j-1] = a[j-1], a[j]
		}
	}
}
