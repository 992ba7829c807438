package fragsim

import (
	"errors"
	"fmt"
)

// MilliGPU is one whole GPU in the trace's unit.
const MilliGPU = 1000

// MaxGPUsPerNode bounds the devices of one node; the trace has at most 8.
const MaxGPUsPerNode = 16

// maxModels bounds the distinct GPU models of a node list (one bit each).
const maxModels = 64

// ModelSet is a set of GPU models by index in a Models registry. AnyModel
// stands for a task that accepts every model.
type ModelSet uint64

// AnyModel accepts every GPU model, including models unknown to the registry.
const AnyModel ModelSet = ^ModelSet(0)

// Has reports whether model index m is in the set.
func (s ModelSet) Has(m uint8) bool { return s&(1<<m) != 0 }

// Models maps GPU model names to small indexes so that a task's allowed
// models are a bit set. It is built from the node list: a task that names
// only models no node has can never be placed.
type Models struct {
	names []string
	index map[string]uint8
}

// NewModels returns an empty registry.
func NewModels() *Models { return &Models{index: map[string]uint8{}} }

// Add registers a model name and returns its index.
func (m *Models) Add(name string) (uint8, error) {
	if i, ok := m.index[name]; ok {
		return i, nil
	}
	if len(m.names) == maxModels {
		return 0, fmt.Errorf("more than %d distinct GPU models", maxModels)
	}
	i := uint8(len(m.names))
	m.names = append(m.names, name)
	m.index[name] = i
	return i, nil
}

// Name returns the name of model index i.
func (m *Models) Name(i uint8) string { return m.names[i] }

// Set converts model names to a set; no names means any model. Names the
// registry does not know add nothing.
func (m *Models) Set(names []string) ModelSet {
	if len(names) == 0 {
		return AnyModel
	}
	var s ModelSet
	for _, n := range names {
		if i, ok := m.index[n]; ok {
			s |= 1 << i
		}
	}
	return s
}

// Request is what one task asks of one node.
type Request struct {
	CPUMilli  int64
	MemoryMiB int64
	// GPUs is the number of devices; 0 for a CPU-only task.
	GPUs int
	// GPUMilli is the share of each device, 1..1000; below 1000 (a
	// GPU-sharing task) only with GPUs == 1.
	GPUMilli int64
	// Models the task may run on; AnyModel when it names none.
	Models ModelSet
}

// TotalMilliGPU is the GPU demand of the request.
func (r Request) TotalMilliGPU() int64 { return int64(r.GPUs) * r.GPUMilli }

// Shares reports whether the request takes part of one device.
func (r Request) Shares() bool { return r.GPUs == 1 && r.GPUMilli < MilliGPU }

// Validate reports what makes a request impossible to model.
func (r Request) Validate() error {
	var errs []error
	if r.CPUMilli < 0 {
		errs = append(errs, fmt.Errorf("negative CPU %d", r.CPUMilli))
	}
	if r.MemoryMiB < 0 {
		errs = append(errs, fmt.Errorf("negative memory %d", r.MemoryMiB))
	}
	switch {
	case r.GPUs < 0 || r.GPUs > MaxGPUsPerNode:
		errs = append(errs, fmt.Errorf("GPU count %d out of 0..%d", r.GPUs, MaxGPUsPerNode))
	case r.GPUs == 0 && r.GPUMilli != 0:
		errs = append(errs, fmt.Errorf("GPU share %d without a GPU", r.GPUMilli))
	case r.GPUs > 0 && (r.GPUMilli <= 0 || r.GPUMilli > MilliGPU):
		errs = append(errs, fmt.Errorf("GPU share %d out of 1..%d", r.GPUMilli, MilliGPU))
	case r.GPUs > 1 && r.GPUMilli != MilliGPU:
		errs = append(errs, fmt.Errorf("%d GPUs of %d milli each: a multi-GPU task takes whole GPUs", r.GPUs, r.GPUMilli))
	}
	return errors.Join(errs...)
}

// NodeSpec is one machine of a node list.
type NodeSpec struct {
	Name      string
	CPUMilli  int64
	MemoryMiB int64
	GPUs      int
	Model     uint8
	// Machines is how many identical machines the spec stands for in the
	// node list a policy is built from (NewFragAware), so that a scheduler
	// can describe a fleet by its classes; 0 counts as 1. A replay's
	// cluster (NewCluster) has one machine per spec whatever it says.
	Machines int
}

// gpuMilli is the milli-GPU of every machine the spec stands for.
func (s NodeSpec) gpuMilli() float64 {
	return float64(max(s.Machines, 1)) * float64(s.GPUs) * MilliGPU
}

// NodeState is the free capacity of one node: what a Policy scores. GPULeft
// holds each device's free milli-GPU by device index (GPUs entries).
type NodeState struct {
	Model     uint8
	GPUs      int
	CPUCap    int64
	MemCap    int64
	CPULeft   int64
	MemLeft   int64
	GPULeft   [MaxGPUsPerNode]int64
	wholeFree int // devices with GPULeft == MilliGPU
	// fragOf is the workload frag was measured against; Assign clears it.
	fragOf *Workload
	frag   float64
}

// newNodeState is an idle node.
func newNodeState(s NodeSpec) NodeState {
	n := NodeState{Model: s.Model, GPUs: s.GPUs, CPUCap: s.CPUMilli, MemCap: s.MemoryMiB,
		CPULeft: s.CPUMilli, MemLeft: s.MemoryMiB, wholeFree: s.GPUs}
	for g := range s.GPUs {
		n.GPULeft[g] = MilliGPU
	}
	return n
}

// NewNodeState is a node with the given free capacity: gpuLeft holds each
// device's free milli-GPU (at most MaxGPUsPerNode devices, each clamped to
// 0..MilliGPU). The scheduler's placement builds one per equivalence class
// of nodes to score it with FragAware.
func NewNodeState(model uint8, cpuLeft, memLeft int64, gpuLeft []int64) NodeState {
	n := NodeState{Model: model, GPUs: min(len(gpuLeft), MaxGPUsPerNode), CPUCap: cpuLeft, MemCap: memLeft,
		CPULeft: cpuLeft, MemLeft: memLeft}
	for g := range n.GPUs {
		n.GPULeft[g] = max(0, min(gpuLeft[g], MilliGPU))
		if n.GPULeft[g] == MilliGPU {
			n.wholeFree++
		}
	}
	return n
}

// GPULeftTotal is the node's free milli-GPU over all devices.
func (n *NodeState) GPULeftTotal() int64 {
	var t int64
	for _, l := range n.GPULeft[:n.GPUs] {
		t += l
	}
	return t
}

// WholeFree is the number of devices nobody uses.
func (n *NodeState) WholeFree() int { return n.wholeFree }

// Fits reports whether r fits the node's free capacity and GPU model: the
// filter every policy's candidates pass.
func (n *NodeState) Fits(r Request) bool {
	if n.CPULeft < r.CPUMilli || n.MemLeft < r.MemoryMiB {
		return false
	}
	if r.GPUs == 0 {
		return true
	}
	if n.GPUs == 0 || !r.Models.Has(n.Model) {
		return false
	}
	if r.GPUMilli == MilliGPU {
		return n.wholeFree >= r.GPUs
	}
	for _, l := range n.GPULeft[:n.GPUs] {
		if l >= r.GPUMilli {
			return true
		}
	}
	return false
}

// Assign takes r from the node: a GPU-sharing request from device gpu,
// whole GPUs from the lowest-index idle devices. It refuses, changing
// nothing, what does not fit, so no policy can over-allocate.
func (n *NodeState) Assign(r Request, gpu int) error {
	if !n.Fits(r) {
		return fmt.Errorf("request %+v does not fit node %+v", r, *n)
	}
	if r.Shares() {
		if gpu < 0 || gpu >= n.GPUs || n.GPULeft[gpu] < r.GPUMilli {
			return fmt.Errorf("device %d cannot hold %d milli-GPU", gpu, r.GPUMilli)
		}
		if n.GPULeft[gpu] == MilliGPU {
			n.wholeFree--
		}
		n.GPULeft[gpu] -= r.GPUMilli
	} else {
		need := r.GPUs
		for g := 0; g < n.GPUs && need > 0; g++ {
			if n.GPULeft[g] == MilliGPU {
				n.GPULeft[g] = 0
				n.wholeFree--
				need--
			}
		}
	}
	n.CPULeft -= r.CPUMilli
	n.MemLeft -= r.MemoryMiB
	n.fragOf = nil
	return nil
}

// Cluster is the state of every node.
type Cluster struct {
	Nodes []NodeState
	// Specs are the nodes as listed, by the same index.
	Specs []NodeSpec
}

// NewCluster returns the cluster idle.
func NewCluster(specs []NodeSpec) *Cluster {
	c := &Cluster{Nodes: make([]NodeState, len(specs)), Specs: specs}
	for i, s := range specs {
		c.Nodes[i] = newNodeState(s)
	}
	return c
}

// GPUCapacity is the cluster's milli-GPU.
func GPUCapacity(specs []NodeSpec) int64 {
	var t int64
	for _, s := range specs {
		t += int64(s.GPUs) * MilliGPU
	}
	return t
}
