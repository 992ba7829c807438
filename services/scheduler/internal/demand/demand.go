// Package demand summarises, per pool, what waits for GPUs: the figures the
// autoscaler and monitor read from gp.sched.demand.<pool>. It is pure: the
// scheduler's snapshot and the jobs left waiting after a cycle go in.
package demand

import (
	"cmp"
	"slices"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// Compute returns one PoolDemand per pool among pools, the pools of snap,
// and the pools waiting requests name. used is how many GPUs of each pool
// the cycle just placed (still free in snap). A GPU counts as free when it
// is whole: not held, not in MIG mode, no share of it held. A waiting
// request without a pool counts against every pool that has GPUs of an
// allowed model. Its shape (the allowed model the pool has, and the GPUs of
// one machine; a MIG instance or a share counts as one GPU) is listed as
// Waiting in a pool when one of the pool's machines could hold it (or when
// the pool has no machine yet, so nothing says it could not); a gang of n
// machines counts n times in the shape's Count, since it needs n machines.
func Compute(snap placement.Snapshot, used map[string]int, waiting []placement.Request, pools []string, now time.Time) map[string]contracts.PoolDemand {
	type kind struct {
		model  string
		memMiB int64
		most   int // most GPUs of this kind on one machine
	}
	type poolView struct {
		d      contracts.PoolDemand
		kinds  []kind
		shapes map[contracts.Shape]int
	}
	views := map[string]*poolView{}
	view := func(pool string) *poolView {
		v := views[pool]
		if v == nil {
			v = &poolView{d: contracts.PoolDemand{SchemaVersion: contracts.SchemaVersion, Pool: pool, Time: now,
				Waiting: []contracts.Shape{}}, shapes: map[contracts.Shape]int{}}
			views[pool] = v
		}
		return v
	}
	for _, p := range pools {
		view(p)
	}
	for _, n := range snap.Nodes {
		v := view(n.Pool)
		v.d.Nodes++
		onNode := map[gpuKind]int{}
		for _, g := range n.GPUs {
			v.d.TotalGPUs++
			if !g.Held && !g.MIG && g.ShareMemMiB == 0 && g.SharePercent == 0 {
				v.d.FreeGPUs++
			}
			onNode[gpuKind{g.Model, g.MemoryMiB}]++
		}
		for k, c := range onNode {
			i := slices.IndexFunc(v.kinds, func(x kind) bool { return x.model == k.model && x.memMiB == k.memMiB })
			if i < 0 {
				v.kinds = append(v.kinds, kind{model: k.model, memMiB: k.memMiB, most: c})
			} else {
				v.kinds[i].most = max(v.kinds[i].most, c)
			}
		}
	}
	for pool, n := range used {
		if v := views[pool]; v != nil {
			v.d.FreeGPUs = max(0, v.d.FreeGPUs-n)
		}
	}
	matches := func(k kind, r placement.Request) bool {
		allowed := r.GPU.AllowedModels()
		return (allowed == nil || slices.Contains(allowed, k.model)) && k.memMiB >= r.GPU.MemoryMiB
	}
	for _, r := range waiting {
		perMachine, machines := 1, r.Machines()
		gpus := 1 // a MIG instance or a share needs one GPU
		if r.GPU.Kind() == contracts.GPUKindWhole {
			perMachine, gpus = max(1, r.GPU.Count/machines), r.GPU.Count
		}
		count := func(v *poolView) {
			v.d.PendingJobs++
			v.d.PendingGPUs += gpus
			model := contracts.GPUModelAny
			if allowed := r.GPU.AllowedModels(); len(allowed) == 1 {
				model = allowed[0]
			}
			holds := v.d.Nodes == 0
			for _, k := range v.kinds {
				if matches(k, r) && k.most >= perMachine {
					if !holds && len(r.GPU.AllowedModels()) > 1 {
						model = k.model // the allowed model this pool has
					}
					holds = true
				}
			}
			if holds {
				v.shapes[contracts.Shape{Model: model, GPUs: perMachine}] += machines
			}
		}
		if r.Pool != "" {
			count(view(r.Pool))
			continue
		}
		for _, v := range views {
			if slices.ContainsFunc(v.kinds, func(k kind) bool { return matches(k, r) }) {
				count(v)
			}
		}
	}
	for _, v := range views {
		for s, c := range v.shapes {
			s.Count = c
			v.d.Waiting = append(v.d.Waiting, s)
		}
	}
	out := make(map[string]contracts.PoolDemand, len(views))
	for pool, v := range views {
		slices.SortFunc(v.d.Waiting, func(a, b contracts.Shape) int {
			return cmp.Or(cmp.Compare(a.Model, b.Model), cmp.Compare(a.GPUs, b.GPUs))
		})
		out[pool] = v.d
	}
	return out
}

type gpuKind struct {
	model  string
	memMiB int64
}

// Same reports whether a and b say the same, ignoring when they were made.
func Same(a, b contracts.PoolDemand) bool {
	a.Time, b.Time = time.Time{}, time.Time{}
	return a.Pool == b.Pool && a.PendingJobs == b.PendingJobs && a.PendingGPUs == b.PendingGPUs &&
		a.Nodes == b.Nodes && a.FreeGPUs == b.FreeGPUs && a.TotalGPUs == b.TotalGPUs &&
		slices.Equal(a.Waiting, b.Waiting)
}
