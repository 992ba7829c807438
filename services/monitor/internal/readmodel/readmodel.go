// Package readmodel folds the streams the monitor watches into the state its
// metrics are computed from at scrape time: the latest sample of every GPU,
// jobs by state and tenant, the allocation ledger and the node inventory.
//
// Every Apply method is idempotent on its stream's key (GPU UUID, job,
// allocation ID, node ID), so a replay or a duplicate message is harmless.
// A Model is safe for concurrent use: the followers write, scrapes read.
//
// A node's state lives as long as the node: Forget drops every node that
// left on purpose (ApplyNodeLeft: its machine deleted or reclaimed) and has
// not been heard from since, with its GPUs. Spot machines come and go for
// months, and a model that kept every node it ever saw would grow without
// bound and keep exporting what it last knew of machines long gone. The
// same node ID seen again later is a new node. The node holds (admin)
// mirror BucketNodeAdmin and go when their key does.
package readmodel

import (
	"cmp"
	"crypto/sha256"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// Model is the monitor's read model.
type Model struct {
	mu sync.Mutex

	telemetryMsgs uint64
	gpus          map[string]GPU       // by GPU UUID (node ID + index when the UUID is empty)
	nodeSeen      map[string]time.Time // node ID → time of its latest telemetry

	jobs      map[jobKey]*job
	jobCounts map[string]map[contracts.JobState]int // tenant → state → jobs
	// ended holds each job that reached a terminal state, by endedKeyOf,
	// with that state, instead of its whole record in jobs: a terminal
	// state takes no event (contracts.Transition), so nothing else of it
	// is ever read again, and the whole records (two strings, a job and
	// its counters) grew the monitor by some 900 bytes per job ever run
	// (issue 17's scale run, +90 MB per 100k jobs). What is left is about
	// 40 bytes per ended job.
	ended map[endedKey]contracts.JobState
	ops   ops // queue by reason, moves, scale events (platform.go)

	allocs      map[string]allocation // by allocation ID, committed and not released
	allocTenant map[poolTenant]int    // GPUs allocated, kept at 0 once seen

	nodes map[string]node // by node ID
	// admin is every node's hold (BucketNodeAdmin), by node ID.
	admin map[string]contracts.NodeAdmin
	beats map[string]*beat // heartbeats by node ID (liveness.go)

	demand map[string]contracts.PoolDemand // by pool, the latest

	// forgotBefore is the latest cutoff Forget was given: a node dropped
	// then had not been heard from since before it, so a heartbeat,
	// telemetry, inventory or departure of an unknown node stamped at or
	// before it is a late copy of a dropped node's, not a new node, and is
	// ignored (lateCopy).
	forgotBefore time.Time
}

// GPU is the latest sample of one GPU with the machine it belongs to.
type GPU struct {
	NodeID   string
	Hostname string
	Pool     string
	Sample   contracts.GPUSample
	// PCIBusID is the GPU's PCI bus ID from its node's latest inventory
	// ("" before the inventory names it): telemetry does not carry it.
	PCIBusID string
}

type jobKey struct{ tenant, job string }

type poolTenant struct{ pool, tenant string }

type allocation struct {
	pool, tenant, node string
	gpus               int
	// milli is what it holds of each GPU, by UUID, in thousandths.
	milli map[string]int64
}

type node struct {
	pool string
	gpus int
	lost bool
	// inventoryAt is the stream time of the latest inventory: an
	// inventory after a departure is the node ID back on a new machine.
	inventoryAt time.Time
	// healthy is the health of each GPU, by UUID, from the inventory.
	healthy map[string]bool
	// pciBusID is the PCI bus ID of each GPU, by UUID, from the inventory.
	pciBusID map[string]string
}

// New returns an empty model.
func New() *Model {
	return &Model{
		gpus:        map[string]GPU{},
		nodeSeen:    map[string]time.Time{},
		jobs:        map[jobKey]*job{},
		ended:       map[endedKey]contracts.JobState{},
		ops:         newOps(),
		jobCounts:   map[string]map[contracts.JobState]int{},
		allocs:      map[string]allocation{},
		allocTenant: map[poolTenant]int{},
		nodes:       map[string]node{},
		admin:       map[string]contracts.NodeAdmin{},
		beats:       map[string]*beat{},
		demand:      map[string]contracts.PoolDemand{},
	}
}

// ApplyTelemetry keeps the samples of t as the latest of their GPUs. at is
// when the sample was taken as the stream saw it; samples older than what the
// model holds for a node are counted but otherwise ignored.
func (m *Model) ApplyTelemetry(nodeID string, t contracts.Telemetry, at time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.telemetryMsgs++
	seen, ok := m.nodeSeen[nodeID]
	if ok && at.Before(seen) || m.lateCopy(ok, at) {
		return
	}
	m.nodeSeen[nodeID] = at
	host := t.Hostname
	if host == "" {
		host = nodeID
	}
	for _, s := range t.GPUs {
		key := s.UUID
		if key == "" {
			key = fmt.Sprintf("%s/%d", nodeID, s.Index)
		}
		m.gpus[key] = GPU{NodeID: nodeID, Hostname: host, Pool: t.Pool, Sample: s}
	}
}

// ApplyJobEvent moves a job along the state machine. An event that
// contracts.Transition refuses (a duplicate, a stale or a duplicate_job_id
// rejection) leaves the model unchanged and returns the refusal, which wraps
// contracts.ErrTransition.
func (m *Model) ApplyJobEvent(tenant, jobID string, ev contracts.JobEvent) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := jobKey{tenant, jobID}
	j := m.jobs[k]
	if j == nil {
		if st, ok := m.ended[endedKeyOf(tenant, jobID)]; ok {
			_, err := contracts.Transition(st, ev.Type) // refused: st is terminal
			return err
		}
		j = &job{}
	}
	from := j.state
	to, err := contracts.Transition(from, ev.Type)
	if err != nil {
		return err
	}
	counts := m.jobCounts[tenant]
	if counts == nil {
		counts = map[contracts.JobState]int{}
		m.jobCounts[tenant] = counts
	}
	if from != contracts.StateNew {
		counts[from]--
	}
	counts[to]++
	m.ops.applyJobEvent(j, ev, to)
	j.state = to
	if to.Terminal() {
		delete(m.jobs, k)
		m.ended[endedKeyOf(tenant, jobID)] = to
		return nil
	}
	m.jobs[k] = j
	return nil
}

// endedKey identifies an ended job: the first 128 bits of the SHA-256 of
// its tenant and ID (a collision among even 10^12 jobs is ~10^-15
// likely; it would make a new job's events be refused as an ended one's).
type endedKey [16]byte

func endedKeyOf(tenant, jobID string) endedKey {
	h := sha256.New()
	h.Write([]byte(tenant))
	h.Write([]byte{0})
	h.Write([]byte(jobID))
	var k endedKey
	copy(k[:], h.Sum(nil))
	return k
}

// ApplyLedger adds a committed allocation or removes a released one, keyed by
// allocation ID. A commit seen twice or a release of an unknown allocation
// changes nothing.
func (m *Model) ApplyLedger(e contracts.LedgerEntry) {
	m.mu.Lock()
	defer m.mu.Unlock()
	a := e.Allocation
	pt := poolTenant{a.Pool, a.Tenant}
	switch e.Kind {
	case contracts.LedgerCommitted:
		if _, ok := m.allocs[a.ID]; ok {
			return
		}
		m.allocs[a.ID] = allocation{pool: a.Pool, tenant: a.Tenant, node: a.NodeID, gpus: len(a.Devices), milli: deviceMilli(a.Devices)}
		m.allocTenant[pt] += len(a.Devices)
	case contracts.LedgerReleased:
		held, ok := m.allocs[a.ID]
		if !ok {
			return
		}
		delete(m.allocs, a.ID)
		m.allocTenant[poolTenant{held.pool, held.tenant}] -= held.gpus
	}
}

// TenantOf names the tenant of a committed, unreleased allocation; "" when
// the ledger has none by that ID.
func (m *Model) TenantOf(allocationID string) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.allocs[allocationID].tenant
}

// ApplyDemand keeps the scheduler's latest view of what waits for a pool.
// A view older than the one held is ignored.
func (m *Model) ApplyDemand(d contracts.PoolDemand) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if held, ok := m.demand[d.Pool]; ok && d.Time.Before(held.Time) {
		return
	}
	m.ops.knowPool(d.Pool)
	m.demand[d.Pool] = d
}

// ApplyInventory records the latest inventory of a node. Whether the node is
// lost is decided by lifecycle events only.
// at is the stream's time of the message: an inventory of a node the model
// forgot, stamped before it forgot it, is a late copy and is ignored.
func (m *Model) ApplyInventory(nodeID string, inv contracts.NodeInventory, at time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, ok := m.nodes[nodeID]
	if m.lateCopy(ok, at) {
		return
	}
	n.pool, n.gpus = inv.Pool, len(inv.GPUs)
	m.ops.knowPool(inv.Pool)
	if at.After(n.inventoryAt) {
		n.inventoryAt = at
	}
	n.healthy = make(map[string]bool, len(inv.GPUs))
	n.pciBusID = make(map[string]string, len(inv.GPUs))
	for _, g := range inv.GPUs {
		n.healthy[g.UUID] = g.Healthy
		if g.PCIBusID != "" {
			n.pciBusID[g.UUID] = g.PCIBusID
		}
	}
	m.nodes[nodeID] = n
}

// ApplyNodeEvent marks a node lost, or live again when it returns or
// registers anew. A node unknown to the model (never inventoried, or
// forgotten after it left) is not made up to be marked lost: the resource
// manager declares a departed machine lost after its heartbeats stop,
// which may well be after the model forgot it.
func (m *Model) ApplyNodeEvent(nodeID string, ev contracts.NodeEvent) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, ok := m.nodes[nodeID]
	if !ok && ev.Kind == contracts.NodeLost {
		return
	}
	if !ok {
		n.pool = ev.Pool
	}
	m.ops.knowPool(n.pool)
	switch ev.Kind {
	case contracts.NodeLost:
		n.lost = true
	case contracts.NodeRegistered, contracts.NodeReturned:
		n.lost = false
	}
	m.nodes[nodeID] = n
}

// ApplyNodeAdmin records a node's hold as the BucketNodeAdmin key now says;
// nil (the key deleted) lifts every hold on the node. The latest value
// replaces the earlier one, so a replayed watch is harmless.
func (m *Model) ApplyNodeAdmin(nodeID string, a *contracts.NodeAdmin) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if a == nil {
		delete(m.admin, nodeID)
		return
	}
	m.admin[nodeID] = *a
}

// Snapshot is a consistent copy of the model, sorted for stable output.
type Snapshot struct {
	TelemetryMessages uint64
	// GPUs whose node sent telemetry at or after the freshSince given to
	// Snapshot, by hostname then GPU index.
	GPUs []GPU
	// Jobs by tenant then state; a (tenant, state) pair once seen stays, at 0.
	Jobs []JobCount
	// Pools known from the inventory or the ledger, by name.
	Pools []PoolCount
	// TenantAllocations by pool then tenant; a pair once seen stays, at 0.
	TenantAllocations []TenantAllocation
	// Demand is the scheduler's latest demand of every pool, by pool.
	Demand []contracts.PoolDemand
	// Capacity is the free capacity of every pool with live nodes, by pool.
	Capacity []PoolCapacity
	// Queue counts queued jobs by requested pool and pending reason.
	Queue []QueueCount
	// Counters are the platform's event counters.
	Counters Counters
	// Heartbeats are the latest heartbeats of the nodes expected to be
	// alive, by node.
	Heartbeats []NodeHeartbeat
	// Telemetry is when each node expected to be alive last sent
	// telemetry, by node: the nodes node_silent watches.
	Telemetry []NodeTelemetry
}

// JobCount is how many jobs of a tenant are in one state.
type JobCount struct {
	Tenant string
	State  contracts.JobState
	Jobs   int
}

// PoolCount sums up one pool: live nodes (not lost), their GPUs, and the
// GPUs the ledger has allocated.
type PoolCount struct {
	Pool          string
	Nodes         int
	GPUs          int
	AllocatedGPUs int
}

// TenantAllocation is how many GPUs of a pool a tenant holds.
type TenantAllocation struct {
	Pool   string
	Tenant string
	GPUs   int
}

// Snapshot copies the model. GPUs of nodes whose latest telemetry is older
// than freshSince are left out: a silent node's last readings would show a
// machine frozen in time, as a dcgm-exporter that died would not.
// Nor are those of a node that left since its latest telemetry: the
// machine is gone.
func (m *Model) Snapshot(freshSince time.Time) Snapshot {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := Snapshot{TelemetryMessages: m.telemetryMsgs}
	for _, g := range m.gpus {
		if m.nodeSeen[g.NodeID].Before(freshSince) || m.departed(g.NodeID) {
			continue
		}
		g.PCIBusID = m.nodes[g.NodeID].pciBusID[g.Sample.UUID]
		s.GPUs = append(s.GPUs, g)
	}
	slices.SortFunc(s.GPUs, func(a, b GPU) int {
		return cmp.Or(cmp.Compare(a.Hostname, b.Hostname), cmp.Compare(a.NodeID, b.NodeID),
			cmp.Compare(a.Sample.Index, b.Sample.Index), cmp.Compare(a.Sample.UUID, b.Sample.UUID))
	})
	for tenant, counts := range m.jobCounts {
		for state, n := range counts {
			s.Jobs = append(s.Jobs, JobCount{Tenant: tenant, State: state, Jobs: n})
		}
	}
	slices.SortFunc(s.Jobs, func(a, b JobCount) int {
		return cmp.Or(cmp.Compare(a.Tenant, b.Tenant), cmp.Compare(a.State, b.State))
	})
	pools := map[string]*PoolCount{}
	pool := func(name string) *PoolCount {
		p := pools[name]
		if p == nil {
			p = &PoolCount{Pool: name}
			pools[name] = p
		}
		return p
	}
	for _, n := range m.nodes {
		p := pool(n.pool)
		if !n.lost {
			p.Nodes++
			p.GPUs += n.gpus
		}
	}
	for pt, gpus := range m.allocTenant {
		pool(pt.pool).AllocatedGPUs += gpus
		s.TenantAllocations = append(s.TenantAllocations, TenantAllocation{Pool: pt.pool, Tenant: pt.tenant, GPUs: gpus})
	}
	slices.SortFunc(s.TenantAllocations, func(a, b TenantAllocation) int {
		return cmp.Or(cmp.Compare(a.Pool, b.Pool), cmp.Compare(a.Tenant, b.Tenant))
	})
	for _, p := range pools {
		s.Pools = append(s.Pools, *p)
	}
	for _, d := range m.demand {
		s.Demand = append(s.Demand, d)
	}
	slices.SortFunc(s.Demand, func(a, b contracts.PoolDemand) int { return cmp.Compare(a.Pool, b.Pool) })
	slices.SortFunc(s.Pools, func(a, b PoolCount) int { return cmp.Compare(a.Pool, b.Pool) })
	s.Capacity = m.capacity()
	s.Queue = m.ops.queue()
	s.Counters = m.ops.counters()
	s.Heartbeats = m.heartbeats()
	s.Telemetry = m.telemetry()
	return s
}
