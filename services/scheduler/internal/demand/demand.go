// Package demand summarises, per pool, what waits for GPUs: the figures the
// autoscaler and monitor read from gp.sched.demand.<pool>. It is pure: the
// scheduler's snapshot and the jobs left waiting after a cycle go in.
package demand

import (
	"cmp"
	"slices"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// Compute returns one PoolDemand per pool among pools, the pools of snap,
// and the pools waiting requests name. used is how many GPUs of each pool
// the cycle just placed (still free in snap). A GPU counts as free when it
// is whole: not held, not in MIG mode, no share of it held. A waiting
// request without a pool counts against every pool that has GPUs of an
// allowed model. Its shape is listed as Waiting in a pool when one of the
// pool's machines could hold it on an empty machine (or when the pool has
// no machine yet, so nothing says it could not):
//   - whole GPUs: the allowed model the pool has and the GPUs of one
//     machine; a gang of n machines counts n times in the shape's Count,
//     since it needs n machines;
//   - a MIG instance: some machine of the pool has an instance of that
//     profile, on a GPU of an allowed model;
//   - a share: some machine has a GPU outside MIG mode of an allowed model
//     with the share's memory (and the request's minimum).
//
// Equal MIG and share requests group into one shape with their profile or
// share, so the autoscaler can pack them onto instances and cards instead
// of counting each as a whole GPU.
func Compute(snap placement.Snapshot, used map[string]int, waiting []placement.Request, pools []string, now time.Time) map[string]contracts.PoolDemand {
	type poolView struct {
		d      contracts.PoolDemand
		kinds  []kind
		mig    []migKind
		shapes map[shapeKey]int
	}
	views := map[string]*poolView{}
	view := func(pool string) *poolView {
		v := views[pool]
		if v == nil {
			v = &poolView{d: contracts.PoolDemand{SchemaVersion: contracts.SchemaVersion, Pool: pool, Time: now,
				Waiting: []contracts.Shape{}}, shapes: map[shapeKey]int{}}
			views[pool] = v
		}
		return v
	}
	for _, p := range pools {
		view(p)
	}
	// onNode counts a node's whole GPUs by kind, in the order the node
	// lists them: a node has one or two kinds, and a map a node was 10,000
	// maps a cycle (and put a pool's kinds in random order).
	type kindCount struct {
		k gpuKind
		n int
	}
	var onNode []kindCount
	add := func(k gpuKind, n int) {
		for i := range onNode {
			if onNode[i].k == k {
				onNode[i].n += n
				return
			}
		}
		onNode = append(onNode, kindCount{k, n})
	}
	for _, n := range snap.Nodes {
		v := view(n.Pool)
		v.d.Nodes++
		onNode = onNode[:0]
		for _, g := range n.GPUs {
			v.d.TotalGPUs++
			if !g.Held && !g.MIG && g.ShareMemMiB == 0 && g.SharePercent == 0 {
				v.d.FreeGPUs++
			}
			k := gpuKind{g.Model, g.MemoryMiB}
			if !g.MIG {
				add(k, 1)
				continue
			}
			// A card in MIG mode holds only its instances: it still says
			// the pool has the model (a kind, with no whole GPU or share
			// to offer), and its profiles.
			add(k, 0)
			for _, in := range g.Instances {
				mk := migKind{model: g.Model, profile: in.Instance.Profile, memMiB: in.Instance.MemoryMiB}
				if !slices.Contains(v.mig, mk) {
					v.mig = append(v.mig, mk)
				}
			}
		}
		for _, kc := range onNode {
			k, c := kc.k, kc.n
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
	// Equal requests count alike: each adds the same to the same pools
	// (what a request adds reads only its GPU request, pool and runtime
	// verdicts, and the snapshot), so a deep queue of a few shapes is
	// counted once per shape, times its number.
	for _, g := range groupRequests(waiting) {
		r, n := g.r, g.n
		perMachine, machines := 1, r.Machines()
		gpus := 1 // a MIG instance or a share needs one GPU
		if r.GPU.Kind() == contracts.GPUKindWhole {
			perMachine, gpus = max(1, r.GPU.Count/machines), r.GPU.Count
		}
		count := func(v *poolView) {
			v.d.PendingJobs += n
			v.d.PendingGPUs += gpus * n
			key := shapeKey{model: contracts.GPUModelAny, gpus: perMachine, mig: r.GPU.MIGProfile}
			if allowed := r.GPU.AllowedModels(); len(allowed) == 1 {
				key.model = allowed[0]
			}
			if s := r.GPU.Share; s != nil && r.GPU.MIGProfile == "" {
				key.share, key.shareMemMiB, key.sharePercent = true, s.MemoryMiB, s.ComputePercent
			}
			// Among several allowed models, name the one this pool's
			// machine can hold the request on.
			model, holds := holder(v.kinds, v.mig, r, perMachine)
			if holds && len(r.GPU.AllowedModels()) > 1 {
				key.model = model
			}
			if holds || v.d.Nodes == 0 {
				v.shapes[key] += machines * n
			}
		}
		if r.Pool != "" {
			count(view(r.Pool))
			continue
		}
		for pool, v := range views {
			// A pool whose runtime policy does not run the job (a host
			// command in an images-only pool) would not take it however
			// many machines it had: no demand there.
			if r.PoolRuns != nil && !r.PoolRuns(pool) {
				continue
			}
			if slices.ContainsFunc(v.kinds, func(k kind) bool { return modelAllowed(r, k.model) && k.memMiB >= r.GPU.MemoryMiB }) {
				count(v)
			}
		}
	}
	for _, v := range views {
		for k, c := range v.shapes {
			v.d.Waiting = append(v.d.Waiting, k.shape(c))
		}
	}
	out := make(map[string]contracts.PoolDemand, len(views))
	for pool, v := range views {
		slices.SortFunc(v.d.Waiting, compareShapes)
		out[pool] = v.d
	}
	return out
}

// kind is one GPU model and size a pool has.
type kind struct {
	model  string
	memMiB int64
	most   int // most GPUs of this kind outside MIG mode on one machine
}

// migKind is one MIG instance profile some machine of a pool has.
type migKind struct {
	model, profile string
	memMiB         int64
}

// shapeKey groups equal waiting requests; unlike contracts.Shape it holds
// the share by value, so equal shares group.
type shapeKey struct {
	model        string
	gpus         int
	mig          string
	share        bool
	shareMemMiB  int64
	sharePercent int
}

func (k shapeKey) shape(count int) contracts.Shape {
	s := contracts.Shape{Model: k.model, GPUs: k.gpus, Count: count, MIGProfile: k.mig}
	if k.share {
		s.Share = &contracts.GPUShare{MemoryMiB: k.shareMemMiB, ComputePercent: k.sharePercent}
	}
	return s
}

func modelAllowed(r placement.Request, model string) bool {
	allowed := r.GPU.AllowedModels()
	return allowed == nil || slices.Contains(allowed, model)
}

// holder reports whether an empty machine of the pool could hold r (with
// perMachine whole GPUs on one machine), and on which allowed model: the
// first that can.
func holder(kinds []kind, mig []migKind, r placement.Request, perMachine int) (string, bool) {
	switch r.GPU.Kind() {
	case contracts.GPUKindMIG:
		for _, m := range mig {
			if m.profile == r.GPU.MIGProfile && modelAllowed(r, m.model) && m.memMiB >= r.GPU.MemoryMiB {
				return m.model, true
			}
		}
	case contracts.GPUKindShare:
		mem := max(r.GPU.MemoryMiB, r.GPU.Share.MemoryMiB)
		for _, k := range kinds {
			if k.most > 0 && modelAllowed(r, k.model) && k.memMiB >= mem {
				return k.model, true
			}
		}
	default:
		for _, k := range kinds {
			if k.most >= perMachine && modelAllowed(r, k.model) && k.memMiB >= r.GPU.MemoryMiB {
				return k.model, true
			}
		}
	}
	return "", false
}

// compareShapes orders shapes by model, GPUs, then whole before MIG
// (by profile) before shares (by memory, then compute).
func compareShapes(a, b contracts.Shape) int {
	share := func(s contracts.Shape) (bool, int64, int) {
		if s.Share == nil {
			return false, 0, 0
		}
		return true, s.Share.MemoryMiB, s.Share.ComputePercent
	}
	ah, am, ap := share(a)
	bh, bm, bp := share(b)
	return cmp.Or(cmp.Compare(a.Model, b.Model), cmp.Compare(a.GPUs, b.GPUs),
		compareBool(ah, bh), cmp.Compare(a.MIGProfile, b.MIGProfile), cmp.Compare(am, bm), cmp.Compare(ap, bp))
}

func compareBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case !a:
		return -1
	}
	return 1
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
		slices.EqualFunc(a.Waiting, b.Waiting, contracts.Shape.Equal)
}

// ungrouped, set by tests, counts every request on its own.
var ungrouped bool

// requestGroup is a number of waiting requests equal in every field
// Compute reads.
type requestGroup struct {
	r placement.Request
	n int
}

// groupKey is what Compute reads of a request: its GPU request but the
// topology, and its pool. A request with a runtime verdict (PoolRuns, a
// closure) is not grouped.
type groupKey struct {
	count, nodes       int
	model, models, mig string
	memMiB             int64
	share              bool
	shareMemMiB        int64
	sharePercent       int
	pool               string
}

// groupRequests groups waiting's requests that Compute counts alike, in
// the order their first member comes.
func groupRequests(waiting []placement.Request) []requestGroup {
	var groups []requestGroup
	if ungrouped { // the tests' reference: one group per request
		for _, r := range waiting {
			groups = append(groups, requestGroup{r, 1})
		}
		return groups
	}
	at := map[groupKey]int{}
	for i := range waiting {
		r := &waiting[i]
		if r.PoolRuns != nil {
			groups = append(groups, requestGroup{*r, 1})
			continue
		}
		g := &r.GPU
		k := groupKey{count: g.Count, nodes: g.Nodes, model: g.Model, mig: g.MIGProfile, memMiB: g.MemoryMiB, pool: r.Pool}
		if len(g.Models) > 0 {
			// A separator no model name holds: ["a,b"] and ["a","b"] differ.
			k.models = strings.Join(g.Models, "\x00") + "\x00"
		}
		if g.Share != nil {
			k.share, k.shareMemMiB, k.sharePercent = true, g.Share.MemoryMiB, g.Share.ComputePercent
		}
		if j, ok := at[k]; ok {
			groups[j].n++
			continue
		}
		at[k] = len(groups)
		groups = append(groups, requestGroup{*r, 1})
	}
	return groups
}
