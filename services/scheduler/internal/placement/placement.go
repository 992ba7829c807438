// Package placement is the scheduler's pure core: a snapshot of the
// cluster's schedulable GPUs goes in, requests are offered in queue order,
// and decisions come out (where a job goes, or precisely why it waits). It
// never touches the network or the clock, so it is tested with plain tables
// and benchmarked on its own.
//
// The policy of this version is first-fit of whole GPUs: the first node (by
// node ID) in the job's pool, if it names one, with Count free GPUs of the
// requested model, each with at least the requested memory, takes the job's
// lowest-index free GPUs. All GPUs of one job share one model and memory
// size. A job that does not fit does not stop the ones behind it.
//
// Nodes are grouped into buckets of identical GPUs (pool, model, memory);
// each bucket keeps a max segment tree of its nodes' free counts, so
// "first node with at least k free GPUs" costs O(log nodes) and a job that
// fits nowhere costs O(buckets) to reject. A later policy (binpack, spread,
// fragmentation-aware) replaces the choice among the candidate nodes that
// the buckets yield; MIG, fractions and gangs become new kinds of request.
package placement

import (
	"cmp"
	"fmt"
	"slices"

	"github.com/gpuplane/gpuplane/contracts"
)

// GPU is one schedulable device of a node.
type GPU struct {
	Index     int
	UUID      string
	Model     string
	MemoryMiB int64
	// Free is false for a device held by the ledger or assumed by a plan
	// in flight.
	Free bool
}

// Node is one machine the scheduler may place on. GPUs lists only devices
// that may be used (healthy); a node that is not ready is left out of the
// snapshot altogether.
type Node struct {
	ID   string
	Pool string
	GPUs []GPU
}

// Snapshot is the cluster as a cycle sees it.
type Snapshot struct {
	Nodes []Node
}

// Request is one job offered to the placer.
type Request struct {
	// Tenant and Ahead (jobs of the tenant ahead of this one in the queue)
	// only feed the pending message.
	Tenant string
	Ahead  int
	// Count whole GPUs of Model ("" or "any" for any model) with at least
	// MemoryMiB each, on one node of Pool ("" for any pool).
	Count     int
	Model     string
	MemoryMiB int64
	Pool      string
}

// Pending says why a job waits: a stable code and a message for people.
type Pending struct {
	Code    contracts.Reason
	Message string
}

// Decision is the outcome for one request: a node and its devices, or a
// pending reason.
type Decision struct {
	NodeID  string
	Pool    string
	Devices []GPU
	Pending Pending
}

// Placed reports whether the request got a node.
func (d Decision) Placed() bool { return d.NodeID != "" }

// Placer places requests one at a time on a snapshot, consuming the free
// devices it hands out, so no device is given twice in one cycle. It is not
// safe for concurrent use.
type Placer struct {
	nodes   []Node
	pools   map[string]int // nodes per pool
	buckets []*bucket
	byShape map[shapeKey][]*bucket
	placed  int
}

// bucket is the set of nodes holding GPUs of one (pool, model, memory).
type bucket struct {
	pool, model string
	memMiB      int64
	nodes       []bucketNode // in node order
	free        maxTree      // free GPUs per bucket node
	startMax    int          // largest free block when the cycle started
	capMax      int          // most GPUs of this kind on one node
	capNode     string
}

type bucketNode struct {
	ord  int   // index into Placer.nodes
	free []GPU // free devices, lowest index first
}

type shapeKey struct {
	pool, model string
	memMiB      int64
}

// NewPlacer indexes snap. The snapshot's slices are not modified.
func NewPlacer(snap Snapshot) *Placer {
	p := &Placer{
		nodes:   slices.Clone(snap.Nodes),
		pools:   map[string]int{},
		byShape: map[shapeKey][]*bucket{},
	}
	slices.SortStableFunc(p.nodes, func(a, b Node) int { return cmp.Compare(a.ID, b.ID) })
	index := map[shapeKey]*bucket{}
	total := 0
	for _, n := range p.nodes {
		total += len(n.GPUs)
	}
	// One backing array holds every free device, each bucket node a
	// contiguous run of it: a cycle allocates per bucket, not per node.
	arena := make([]GPU, 0, total)
	var kinds []GPU // distinct (model, memory) of the current node
	for ord, n := range p.nodes {
		p.pools[n.Pool]++
		gpus := n.GPUs
		if !slices.IsSortedFunc(gpus, byIndex) {
			gpus = slices.Clone(gpus)
			slices.SortFunc(gpus, byIndex)
		}
		kinds = kinds[:0]
		for _, g := range gpus {
			if !slices.ContainsFunc(kinds, func(k GPU) bool { return sameKind(k, g) }) {
				kinds = append(kinds, g)
			}
		}
		for _, kg := range kinds {
			k := shapeKey{pool: n.Pool, model: kg.Model, memMiB: kg.MemoryMiB}
			b := index[k]
			if b == nil {
				b = &bucket{pool: k.pool, model: k.model, memMiB: k.memMiB}
				index[k] = b
				p.buckets = append(p.buckets, b)
			}
			start, capacity := len(arena), 0
			for _, g := range gpus {
				if sameKind(g, kg) {
					capacity++ // capacity counts every usable device, free or not
					if g.Free {
						arena = append(arena, g)
					}
				}
			}
			b.nodes = append(b.nodes, bucketNode{ord: ord, free: arena[start:len(arena):len(arena)]})
			if capacity > b.capMax {
				b.capMax, b.capNode = capacity, n.ID
			}
		}
	}
	counts := []int{}
	for _, b := range p.buckets {
		counts = counts[:0]
		for _, bn := range b.nodes {
			counts = append(counts, len(bn.free))
		}
		b.free = newMaxTree(counts)
		b.startMax = b.free.max()
	}
	// Stable bucket order keeps ties and messages deterministic.
	slices.SortFunc(p.buckets, func(a, b *bucket) int {
		return cmp.Or(cmp.Compare(a.pool, b.pool), cmp.Compare(a.model, b.model), cmp.Compare(a.memMiB, b.memMiB))
	})
	return p
}

func byIndex(a, b GPU) int { return cmp.Compare(a.Index, b.Index) }

func sameKind(a, b GPU) bool { return a.Model == b.Model && a.MemoryMiB == b.MemoryMiB }

// Place decides one request and, when it fits, takes its devices out of
// the free pool for the rest of the cycle.
func (p *Placer) Place(r Request) Decision {
	cands := p.candidates(r)
	var (
		best    *bucket
		bestPos = -1
		bestOrd = len(p.nodes)
	)
	for _, b := range cands {
		if b.free.max() < r.Count {
			continue
		}
		pos := b.free.first(r.Count)
		if ord := b.nodes[pos].ord; ord < bestOrd {
			best, bestPos, bestOrd = b, pos, ord
		}
	}
	if best == nil {
		return Decision{Pending: p.why(r, cands)}
	}
	bn := &best.nodes[bestPos]
	// The arena is never written after NewPlacer, so the decision can share
	// it; the capped slice keeps an append by the caller from spilling over.
	devs := bn.free[:r.Count:r.Count]
	bn.free = bn.free[r.Count:]
	best.free.set(bestPos, len(bn.free))
	p.placed++
	n := p.nodes[bestOrd]
	return Decision{NodeID: n.ID, Pool: n.Pool, Devices: devs}
}

// candidates are the buckets whose devices match r, cached per shape.
func (p *Placer) candidates(r Request) []*bucket {
	model := r.Model
	if model == contracts.GPUModelAny {
		model = ""
	}
	k := shapeKey{pool: r.Pool, model: model, memMiB: r.MemoryMiB}
	if c, ok := p.byShape[k]; ok {
		return c
	}
	var c []*bucket
	for _, b := range p.buckets {
		if (k.pool == "" || b.pool == k.pool) && (k.model == "" || b.model == k.model) && b.memMiB >= k.memMiB {
			c = append(c, b)
		}
	}
	p.byShape[k] = c
	return c
}

// Place runs a whole cycle: every request in order on one snapshot.
func Place(snap Snapshot, reqs []Request) []Decision {
	p := NewPlacer(snap)
	out := make([]Decision, len(reqs))
	for i, r := range reqs {
		out[i] = p.Place(r)
	}
	return out
}

// why explains a request that did not fit, from the most fundamental
// cause to the most transient.
func (p *Placer) why(r Request, cands []*bucket) Pending {
	shape := describe(r)
	switch {
	case r.Pool != "" && p.pools[r.Pool] == 0:
		return Pending{contracts.PendingNoNodes, fmt.Sprintf("%s; no nodes in pool %s", shape, r.Pool)}
	case len(p.nodes) == 0:
		return Pending{contracts.PendingNoNodes, shape + "; no nodes are registered"}
	case len(cands) == 0:
		where := "no node"
		if r.Pool != "" {
			where += " in pool " + r.Pool
		}
		return Pending{contracts.PendingNoMatchingModel, fmt.Sprintf("%s; %s has %s GPUs", shape, where, kind(r))}
	}
	var capMax, startMax, freeMax int
	var capNode, freeNode string
	for _, b := range cands {
		if b.capMax > capMax {
			capMax, capNode = b.capMax, b.capNode
		}
		startMax = max(startMax, b.startMax)
		if m := b.free.max(); m > freeMax {
			freeMax, freeNode = m, p.nodes[b.nodes[b.free.first(m)].ord].ID
		} else if m == freeMax && m > 0 {
			// ties go to the first node, as placement would
			if n := p.nodes[b.nodes[b.free.first(m)].ord].ID; n < freeNode {
				freeNode = n
			}
		}
	}
	ahead := aheadText(r)
	switch {
	case capMax < r.Count:
		return Pending{contracts.PendingInsufficientGPUs,
			fmt.Sprintf("%s; the largest machine has %d (%s)%s", shape, capMax, capNode, ahead)}
	case startMax >= r.Count:
		return Pending{contracts.PendingQueuedBehind,
			fmt.Sprintf("%s; the free GPUs went to %s placed ahead of it this cycle%s", shape, plural(p.placed, "job"), ahead)}
	case freeMax == 0:
		free := "no " + kind(r) + " GPU is free"
		if kind(r) == "any" {
			free = "no GPU is free"
		}
		return Pending{contracts.PendingInsufficientGPUs, fmt.Sprintf("%s; %s%s", shape, free, ahead)}
	default:
		return Pending{contracts.PendingInsufficientGPUs,
			fmt.Sprintf("%s; largest free block is %s on %s%s", shape, plural(freeMax, "GPU"), freeNode, ahead)}
	}
}

// describe says what r needs: "needs 8×H100-80GB on one machine".
func describe(r Request) string {
	s := fmt.Sprintf("needs %d×%s", r.Count, kind(r))
	if r.MemoryMiB > 0 {
		s += fmt.Sprintf(" with ≥%d MiB each", r.MemoryMiB)
	}
	s += " on one machine"
	if r.Pool != "" {
		s += " in pool " + r.Pool
	}
	return s
}

func kind(r Request) string {
	if r.Model == "" || r.Model == contracts.GPUModelAny {
		return "any"
	}
	return r.Model
}

func aheadText(r Request) string {
	if r.Tenant == "" {
		return ""
	}
	return fmt.Sprintf("; %s ahead in queue %s", plural(r.Ahead, "job"), r.Tenant)
}

func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// maxTree is a segment tree of non-negative counts answering "first
// position holding at least k" and "largest value" in O(log n).
type maxTree struct {
	size int
	t    []int
}

func newMaxTree(vals []int) maxTree {
	size := 1
	for size < len(vals) {
		size <<= 1
	}
	t := make([]int, 2*size)
	copy(t[size:], vals)
	for i := size - 1; i >= 1; i-- {
		t[i] = max(t[2*i], t[2*i+1])
	}
	return maxTree{size: size, t: t}
}

func (m *maxTree) max() int { return m.t[1] }

// first returns the lowest position holding at least k, or -1.
func (m *maxTree) first(k int) int {
	if m.t[1] < k {
		return -1
	}
	i := 1
	for i < m.size {
		if m.t[2*i] >= k {
			i = 2 * i
		} else {
			i = 2*i + 1
		}
	}
	return i - m.size
}

func (m *maxTree) set(pos, v int) {
	i := pos + m.size
	m.t[i] = v
	for i > 1 {
		i >>= 1
		m.t[i] = max(m.t[2*i], m.t[2*i+1])
	}
}
