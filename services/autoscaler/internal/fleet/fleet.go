// Package fleet is the autoscaler's view of the NODES stream: for every pool,
// its machine type (what a new machine of the pool would look like) and how
// many of its nodes are live. The latest inventory of a node is the truth;
// lifecycle events mark it lost or live again. Applying a message twice is
// harmless. A Fleet is safe for concurrent use.
package fleet

import (
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// Fleet folds inventories and lifecycle events.
type Fleet struct {
	mu    sync.Mutex
	nodes map[string]node
}

type node struct {
	pool        string
	machineType string
	gpus        int
	model       string
	lost        bool
	lostSince   time.Time // when the resource manager declared it lost
	// firstSeen is the time of the node's first inventory (the agent's
	// clock): the scheduler cannot have counted the node before it.
	firstSeen time.Time
	layout    layout
}

// layout is what a node's GPUs look like beyond their count and model: what
// MIG and share shapes are sized against.
type layout struct {
	memMiB  int64          // the smallest framebuffer of a GPU of the node's model
	migGPUs int            // GPUs in MIG mode
	mig     map[string]int // MIG instances per profile, nil when none
}

func layoutOf(gpus []contracts.GPUInfo, model string) layout {
	var l layout
	for _, g := range gpus {
		if g.Model == model && g.MemoryMiB > 0 && (l.memMiB == 0 || g.MemoryMiB < l.memMiB) {
			l.memMiB = g.MemoryMiB
		}
		if !g.MIGEnabled {
			continue
		}
		l.migGPUs++
		for _, in := range g.MIGInstances {
			if l.mig == nil {
				l.mig = map[string]int{}
			}
			l.mig[in.Profile]++
		}
	}
	return l
}

// key identifies equal layouts, to find the most common one.
func (l layout) key() string {
	k := strconv.FormatInt(l.memMiB, 10) + "/" + strconv.Itoa(l.migGPUs)
	for _, p := range slices.Sorted(maps.Keys(l.mig)) {
		k += "/" + p + "=" + strconv.Itoa(l.mig[p])
	}
	return k
}

// New returns an empty fleet.
func New() *Fleet { return &Fleet{nodes: map[string]node{}} }

// ApplyInventory records the latest inventory of a node.
func (f *Fleet) ApplyInventory(nodeID string, inv contracts.NodeInventory) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := f.nodes[nodeID]
	if n.machineType == "" {
		n.firstSeen = inv.Time
	}
	n.pool, n.machineType, n.gpus, n.model = inv.Pool, inv.MachineType, len(inv.GPUs), majorityModel(inv.GPUs)
	n.layout = layoutOf(inv.GPUs, n.model)
	f.nodes[nodeID] = n
}

// ApplyNodeEvent marks a node lost, or live again. A node lost twice
// without coming back keeps the first time: it has been gone since then.
func (f *Fleet) ApplyNodeEvent(nodeID string, ev contracts.NodeEvent) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n, ok := f.nodes[nodeID]
	if !ok {
		n.pool = ev.Pool
	}
	switch ev.Kind {
	case contracts.NodeLost:
		if !n.lost {
			n.lostSince = ev.Time
		}
		n.lost = true
	case contracts.NodeRegistered, contracts.NodeReturned:
		n.lost, n.lostSince = false, time.Time{}
	}
	f.nodes[nodeID] = n
}

// LostSince reports when nodeID was declared lost (the resource manager's
// event time, so a restart replaying the stream measures from the same
// instant), and false when it is not lost now.
func (f *Fleet) LostSince(nodeID string) (time.Time, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n, ok := f.nodes[nodeID]
	if !ok || !n.lost {
		return time.Time{}, false
	}
	return n.lostSince, true
}

// PoolOf returns the pool nodeID said it belongs to; false when unknown.
func (f *Fleet) PoolOf(nodeID string) (string, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n, ok := f.nodes[nodeID]
	return n.pool, ok && n.pool != ""
}

// Registered reports whether nodeID's agent registered (an inventory was
// seen) and the node is not lost.
func (f *Fleet) Registered(nodeID string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	n, ok := f.nodes[nodeID]
	return ok && n.machineType != "" && !n.lost
}

// RegisteredAt is Registered with the time of the node's first inventory
// (zero when the inventory carried none).
func (f *Fleet) RegisteredAt(nodeID string) (time.Time, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n, ok := f.nodes[nodeID]
	if !ok || n.machineType == "" || n.lost {
		return time.Time{}, false
	}
	return n.firstSeen, true
}

// Pool describes one pool.
type Pool struct {
	// MachineType is the type most of the pool's nodes have (lost ones
	// included: they still say what the pool is made of); ties go to the
	// type first in name order.
	MachineType string
	// GPUs is the most GPUs a node of that type reported, Model the GPU
	// model most of them have.
	GPUs  int
	Model string
	// MemoryMiB, MIGGPUs and MIG are the GPU layout most live nodes of
	// MachineType report (all of them when none is live; ties to the
	// smallest layout key): one GPU's framebuffer, how many GPUs are in
	// MIG mode and their instances per profile (nil when none). A new
	// machine is assumed to come up like them: the agent never changes
	// MIG mode, so it is the machine image or an administrator that sets
	// it, the same way for every machine of the type.
	MemoryMiB int64
	MIGGPUs   int
	MIG       map[string]int
	// LiveNodes are the nodes not lost, of any type.
	LiveNodes int
}

// Pool returns what the fleet knows of a pool; false when no node of it was
// ever seen.
func (f *Fleet) Pool(name string) (Pool, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var p Pool
	byType := map[string][]node{}
	for _, n := range f.nodes {
		if n.pool != name {
			continue
		}
		byType[n.machineType] = append(byType[n.machineType], n)
		if !n.lost {
			p.LiveNodes++
		}
	}
	if len(byType) == 0 {
		return Pool{}, false
	}
	perType := map[string]int{}
	for t, ns := range byType {
		perType[t] = len(ns)
	}
	p.MachineType = majority(perType)
	models := map[string]int{}
	for _, n := range byType[p.MachineType] {
		p.GPUs = max(p.GPUs, n.gpus)
		if n.model != "" {
			models[n.model]++
		}
	}
	p.Model = majority(models)
	p.MemoryMiB, p.MIGGPUs, p.MIG = typical(byType[p.MachineType]).unpack()
	return p, true
}

// typical returns the most common layout of nodes, counting the live ones
// only when there are any.
func typical(nodes []node) layout {
	live := slices.ContainsFunc(nodes, func(n node) bool { return !n.lost })
	counts, byKey := map[string]int{}, map[string]layout{}
	for _, n := range nodes {
		if live && n.lost {
			continue
		}
		k := n.layout.key()
		counts[k]++
		byKey[k] = n.layout
	}
	return byKey[majority(counts)]
}

func (l layout) unpack() (int64, int, map[string]int) { return l.memMiB, l.migGPUs, maps.Clone(l.mig) }

func majorityModel(gpus []contracts.GPUInfo) string {
	counts := map[string]int{}
	for _, g := range gpus {
		counts[g.Model]++
	}
	return majority(counts)
}

// majority returns the key with the highest count, the smallest such key on
// a tie, "" for an empty map.
func majority(counts map[string]int) string {
	best, bestN := "", 0
	for _, k := range slices.Sorted(maps.Keys(counts)) {
		if counts[k] > bestN {
			best, bestN = k, counts[k]
		}
	}
	return best
}
