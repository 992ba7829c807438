package placement

import (
	"cmp"
	"errors"
	"fmt"
	"slices"

	"github.com/gpuplane/gpuplane/contracts"
)

// FitNode reports whether one machine's part of r (Count/Machines whole
// GPUs, or the MIG instance, or the share) fits node n as it stands, and
// the devices it would take. It applies every per-node rule Place applies
// (cordon, Exclude, Reserved holds, Pool, AllowPool, Selector, NoSchedule
// taints, host CPU and memory, models, framebuffer, NVLink) but no policy: whole GPUs are the
// lowest indices (with TopologyNVLink, of the tightest domain that holds
// them), a MIG instance is taken from the card with the fewest free
// instances, a share from the tightest card. Zone constraints span machines
// and are not checked. n is not modified.
//
// It is the reference the Placer is tested against, and what preemption
// uses to ask "would it fit once these jobs are gone".
func FitNode(n *Node, r Request) ([]contracts.DeviceRef, bool) {
	if n == nil || validate(&r) != nil || !admits(n, r) {
		return nil, false
	}
	if h, ok := r.Reserved[n.ID]; ok {
		held := h.Held(n)
		n = &held
		if !admits(n, r) { // host capacity within the spare
			return nil, false
		}
	}
	gpus := n.GPUs // only read below
	if !gpusSorted(gpus) {
		gpus = slices.Clone(gpus)
		slices.SortStableFunc(gpus, func(a, b GPU) int { return cmp.Compare(a.Index, b.Index) })
	}
	switch r.GPU.Kind() {
	case contracts.GPUKindMIG:
		return fitMIG(gpus, r)
	case contracts.GPUKindShare:
		return fitShare(gpus, r)
	}
	return fitWhole(gpus, r)
}

// admits applies the rules that do not depend on the node's GPUs.
func admits(n *Node, r Request) bool {
	switch {
	case n.Cordoned, r.Exclude[n.ID]:
		return false
	case r.Pool != "" && n.Pool != r.Pool:
		return false
	case r.PoolRuns != nil && !r.PoolRuns(n.Pool):
		return false
	case n.CPUMilliFree < r.CPUMilli || n.MemoryMiBFree < r.MemoryMiB:
		return false
	case !contracts.Selected(r.Selector, n.Labels):
		return false
	case !contracts.Tolerated(r.Tolerations, n.Taints, contracts.TaintNoSchedule):
		return false
	case r.AllowPool != nil && !r.AllowPool(n.Pool):
		return false
	}
	return true
}

// modelAllowed reports whether model is among allowed (nil allows all).
func modelAllowed(allowed []string, model string) bool {
	return allowed == nil || slices.Contains(allowed, model)
}

// wholeFree reports whether g can be taken as a whole card.
func wholeFree(g *GPU) bool {
	return !g.Held && !g.MIG && g.ShareMemMiB == 0 && g.SharePercent == 0
}

func ref(g *GPU) contracts.DeviceRef {
	return contracts.DeviceRef{Index: g.Index, UUID: g.UUID, Model: g.Model}
}

// fitWhole takes k whole GPUs of one model: the first model (by lowest
// index) that has them.
func fitWhole(gpus []GPU, r Request) ([]contracts.DeviceRef, bool) {
	k := r.GPU.Count / r.Machines()
	allowed := r.GPU.AllowedModels()
	nvlink := r.GPU.Topology == contracts.TopologyNVLink
	var tried []string
	for i := range gpus {
		model := gpus[i].Model
		if slices.Contains(tried, model) || !modelAllowed(allowed, model) {
			continue
		}
		tried = append(tried, model)
		ok := func(g *GPU) bool {
			return g.Model == model && wholeFree(g) && g.MemoryMiB >= r.GPU.MemoryMiB
		}
		var picked []int
		if nvlink {
			picked = tightestDomain(gpus, k, ok)
		} else {
			for j := range gpus {
				if len(picked) < k && ok(&gpus[j]) {
					picked = append(picked, j)
				}
			}
		}
		if len(picked) == k {
			out := make([]contracts.DeviceRef, k)
			for j, p := range picked {
				out[j] = ref(&gpus[p])
			}
			return out, true
		}
	}
	return nil, false
}

// tightestDomain returns the positions of the k lowest-index GPUs passing ok
// in the NVLink domain with the fewest such GPUs that still has k (ties to
// the domain of the lowest index), or nil.
func tightestDomain(gpus []GPU, k int, ok func(*GPU) bool) []int {
	best, bestFree := "", 0
	var seen []string
	for i := range gpus {
		d := gpus[i].NVLinkDomain
		if d == "" || slices.Contains(seen, d) {
			continue
		}
		seen = append(seen, d)
		free := 0
		for j := range gpus {
			if gpus[j].NVLinkDomain == d && ok(&gpus[j]) {
				free++
			}
		}
		if free >= k && (bestFree == 0 || free < bestFree) {
			best, bestFree = d, free
		}
	}
	if bestFree == 0 {
		return nil
	}
	var picked []int
	for j := range gpus {
		if len(picked) < k && gpus[j].NVLinkDomain == best && ok(&gpus[j]) {
			picked = append(picked, j)
		}
	}
	return picked
}

// fitMIG takes a free instance of the profile from the MIG card with the
// fewest free instances (ties to the lowest index), its lowest start.
func fitMIG(gpus []GPU, r Request) ([]contracts.DeviceRef, bool) {
	allowed := r.GPU.AllowedModels()
	bestGPU, bestSlot, bestFree := -1, -1, 0
	for i := range gpus {
		g := &gpus[i]
		if !g.MIG || g.Held || !modelAllowed(allowed, g.Model) {
			continue
		}
		slot, free := -1, 0
		for s := range g.Instances {
			in := &g.Instances[s]
			if in.Held {
				continue
			}
			free++
			if in.Instance.Profile == r.GPU.MIGProfile && in.Instance.MemoryMiB >= r.GPU.MemoryMiB &&
				(slot < 0 || in.Instance.Start < g.Instances[slot].Instance.Start) {
				slot = s
			}
		}
		if slot >= 0 && (bestGPU < 0 || free < bestFree) {
			bestGPU, bestSlot, bestFree = i, slot, free
		}
	}
	if bestGPU < 0 {
		return nil, false
	}
	d := ref(&gpus[bestGPU])
	in := gpus[bestGPU].Instances[bestSlot].Instance
	d.MIG = &in
	return []contracts.DeviceRef{d}, true
}

// shareFits reports whether a share of mem MiB and pct percent fits g.
func shareFits(g *GPU, mem int64, pct int) bool {
	return !g.Held && !g.MIG && g.ShareMemMiB+mem <= g.MemoryMiB && g.SharePercent+pct <= 100
}

// fitShare takes the share from the tightest card: least compute left after
// it, then least framebuffer left, then lowest index.
func fitShare(gpus []GPU, r Request) ([]contracts.DeviceRef, bool) {
	s := r.GPU.Share
	allowed := r.GPU.AllowedModels()
	best := -1
	for i := range gpus {
		g := &gpus[i]
		if !modelAllowed(allowed, g.Model) || g.MemoryMiB < r.GPU.MemoryMiB || !shareFits(g, s.MemoryMiB, s.ComputePercent) {
			continue
		}
		if best < 0 {
			best = i
			continue
		}
		b := &gpus[best]
		if c := cmp.Or(cmp.Compare(100-g.SharePercent, 100-b.SharePercent),
			cmp.Compare(g.MemoryMiB-g.ShareMemMiB, b.MemoryMiB-b.ShareMemMiB)); c < 0 {
			best = i
		}
	}
	if best < 0 {
		return nil, false
	}
	d := ref(&gpus[best])
	d.Share = &contracts.GPUShare{MemoryMiB: s.MemoryMiB, ComputePercent: s.ComputePercent}
	return []contracts.DeviceRef{d}, true
}

var errInvalid = errors.New("invalid request")

// validate reports what makes r impossible to place on any cluster. The
// scheduler validates requests when they are submitted; this keeps the
// placer total over any input (no panic, no division by zero).
func validate(r *Request) error {
	g := &r.GPU // by pointer: Place asks it of every request
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", errInvalid, fmt.Sprintf(format, args...))
	}
	switch {
	case g.Count < 1 || g.Count > contracts.MaxGPUsPerJob:
		return bad("gpu count %d; want 1 to %d", g.Count, contracts.MaxGPUsPerJob)
	case g.Nodes < 0 || g.Nodes > contracts.MaxNodesPerJob:
		return bad("nodes %d; want 0 to %d", g.Nodes, contracts.MaxNodesPerJob)
	case g.Count%g.Machines() != 0:
		return bad("count %d does not split evenly over %d machines", g.Count, g.Machines())
	case g.MemoryMiB < 0 || g.MemoryMiB > contracts.MaxGPUMemoryMiB:
		return bad("gpu memory %d MiB; want 0 to %d", g.MemoryMiB, contracts.MaxGPUMemoryMiB)
	case r.CPUMilli < 0 || r.MemoryMiB < 0:
		return bad("host cpu %d milli or memory %d MiB is negative", r.CPUMilli, r.MemoryMiB)
	case !slices.Contains(contracts.Topologies, g.Topology):
		return bad("unknown topology %q", g.Topology)
	case g.MIGProfile != "" && g.Share != nil:
		return bad("a request is a MIG instance or a share, not both")
	}
	if g.MIGProfile != "" || g.Share != nil {
		if g.Count != 1 || g.Machines() != 1 {
			return bad("a MIG instance or a share is one device on one machine; count %d over %d machines", g.Count, g.Machines())
		}
	}
	if s := g.Share; s != nil && (s.ComputePercent < 1 || s.ComputePercent > 100 || s.MemoryMiB < 1 || s.MemoryMiB > contracts.MaxGPUMemoryMiB) {
		return bad("share of %d%% compute and %d MiB; want 1 to 100%% and 1 to %d MiB", s.ComputePercent, s.MemoryMiB, contracts.MaxGPUMemoryMiB)
	}
	return nil
}
