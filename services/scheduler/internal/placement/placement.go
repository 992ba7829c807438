// Package placement is the scheduler's pure core: a snapshot of the
// cluster's schedulable capacity goes in, requests are offered in queue
// order, and decisions come out (the machines and devices a job takes, or
// precisely why it waits). It never touches the network or the clock, so it
// is tested with plain tables and benchmarked on its own.
//
// A request asks for whole GPUs on one machine, whole GPUs split evenly
// over several machines (a gang, placed all or nothing), one existing MIG
// instance, or a share (framebuffer and compute percent) of one GPU; and
// host CPU and memory per machine. Filters are exact (pool, quota headroom,
// selector, taints, cordon, reservations, models, memory, topology); the
// choice among the nodes that pass is the pool's policy (binpack, spread,
// topology, or fragaware, ours, which reuses fragsim's FragAware). Equal
// choices go to the first node in node ID order.
//
// Speed comes from equivalence classes: nodes whose free state is the same
// up to a permutation of interchangeable GPUs (same pool, zone, taints,
// hardware, and free GPUs, shares and MIG instances) score the same, so a
// class is scored once per request shape and cached; only the first member
// (in node order) that passes the per-node checks (CPU, memory, selector,
// reservations) is taken. See README.md for the pipeline.
package placement

import (
	"github.com/gpuplane/gpuplane/contracts"
)

// GPU is one healthy device of a node and what is held of it.
type GPU struct {
	Index     int
	UUID      string
	Model     string
	MemoryMiB int64
	// NVLinkDomain groups GPUs connected by NVLink; "" means PCIe only.
	NVLinkDomain string
	// Held: the whole card is held (ledger or plan in flight), so nothing
	// else fits on it.
	Held bool
	// MIG: MIG mode is on, so the card's capacity is its Instances only
	// (never a whole card, never a share).
	MIG bool
	// Instances are the MIG instances that exist on the card; the agent
	// never creates them, placement picks a free one.
	Instances []MIGSlot
	// ShareMemMiB and SharePercent are the framebuffer and compute held by
	// shares of the card (MIG and Held false); a card with either above
	// zero is no longer free as a whole card.
	ShareMemMiB  int64
	SharePercent int
}

// MIGSlot is one existing MIG instance and whether an allocation holds it.
type MIGSlot struct {
	Instance contracts.MIGInstance
	Held     bool
}

// Node is one machine the scheduler may place on. GPUs lists only healthy
// devices; a node that is not ready is left out of the snapshot.
type Node struct {
	ID, Pool, Zone string
	Labels         map[string]string
	Taints         []contracts.Taint
	// Cordoned nodes take no new work.
	Cordoned bool
	// CPUMilliFree and MemoryMiBFree are the host capacity left; a
	// request's CPU and memory (per machine) must fit in them.
	CPUMilliFree, MemoryMiBFree int64
	// CPUMilliCapacity and MemoryMiBCapacity are the host's totals, for
	// telling a request no machine could ever hold (100 cores on 48-core
	// hosts) from one that waits; 0 means not reported: no bound.
	CPUMilliCapacity, MemoryMiBCapacity int64
	GPUs                                []GPU
}

// Snapshot is the cluster as one scheduling cycle sees it.
type Snapshot struct {
	Nodes []Node
}

// Request is one job offered to the placer.
type Request struct {
	// Tenant and Ahead (jobs of the tenant ahead of this one in the queue)
	// only feed the pending message: "2 jobs ahead in queue research".
	Tenant string
	Ahead  int
	// GPU is what the job asks of GPUs: Count whole GPUs (over GPU.Nodes
	// machines), one MIG instance of GPU.MIGProfile, or one GPU.Share;
	// allowed models, minimum framebuffer per GPU, topology.
	GPU contracts.GPURequest
	// CPUMilli and MemoryMiB are host CPU and memory per machine.
	CPUMilli, MemoryMiB int64
	// Pool restricts placement to one pool; "" means any pool.
	Pool string
	// Selector keeps the job to nodes carrying every label.
	Selector map[string]string
	// Tolerations let the job onto tainted nodes: NoSchedule taints must
	// be tolerated; untolerated PreferNoSchedule taints make a node a last
	// resort, used only when no other node fits.
	Tolerations []contracts.Toleration
	// AllowPool says whether the tenant's quota leaves headroom in a pool;
	// nil allows every pool. Place calls it at most once per pool.
	AllowPool func(pool string) bool
	// PoolRuns says whether a pool's runtime policy runs the job (a host
	// command only where the pool allows them, mounts only from its
	// roots: contracts.CheckRuntime); nil runs it everywhere. Place calls
	// it at most once per pool.
	PoolRuns func(pool string) bool
	// Prefer marks the nodes that already hold the job's image: among
	// nodes of equal rank (the policy's score, tier and pool order), a
	// preferred one is taken before the first in node order. It never
	// outweighs a better score, so locality costs no fragmentation. nil
	// prefers none.
	Prefer func(node string) bool
	// Exclude names nodes the job must not use at all (nodes a moved job
	// freed); nil excludes none.
	Exclude map[string]bool
	// Reserved are the holds of backfill reservations the job must not
	// delay, by node: on those nodes it may use only what the holds leave
	// (Hold). Place tries them last, and only for a one-machine request
	// (a gang keeps off them). nil holds nothing.
	Reserved map[string]Hold
	// ExcludeKey names the contents of Exclude and Reserved when the
	// caller reuses one set for many requests (the reservations a job must
	// avoid): requests with the same key share pending explanations within
	// a cycle. Empty: not shared.
	ExcludeKey string
	// Extra is appended to the pending message (queue and quota facts the
	// caller knows): "quota research/h100 at 16 of 16".
	Extra string
}

// Machines is how many machines the request spans (at least 1).
func (r Request) Machines() int { return r.GPU.Machines() }

// Pending says why a job waits: a stable code and a message for people.
type Pending struct {
	Code    contracts.Reason
	Message string
}

// Unsatisfiable reports whether no node of the snapshot could ever hold the
// request, even with nothing running (or the request is malformed): the
// scheduler may say so rather than wait.
func (p Pending) Unsatisfiable() bool { return p.Code == contracts.ReasonUnsatisfiable }

// Part is what a decision takes on one machine. Devices carry MIG or Share
// for a MIG instance or a share.
type Part struct {
	NodeID, Pool, Zone string
	Devices            []contracts.DeviceRef
}

// Decision is the outcome for one request: one Part per machine (in rank
// order), or why it waits.
type Decision struct {
	Parts   []Part
	Pending Pending
}

// Placed reports whether the request got its machines.
func (d Decision) Placed() bool { return len(d.Parts) > 0 }

// Options tune a Placer.
type Options struct {
	// Policy gives the placement policy of a pool; nil, or an invalid
	// answer, means contracts.PolicyFragAware.
	Policy func(pool string) contracts.PlacementPolicy
	// Workload is the recent request mix fragaware optimises for; nil
	// means DefaultWorkload.
	Workload []contracts.GPURequest
	// Exhaustive searches every request afresh, remembering no earlier
	// failure of the cycle (explanations are still memoised until the
	// next placement, as they always were): the reference the tests
	// compare the remembering path with. Slow.
	Exhaustive bool
}
