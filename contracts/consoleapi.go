package contracts

import "time"

// The gateway's console API (issue 15): the fleet as a live stream, the
// queues, the operations stream and the tenants a caller may see. These
// are answers of the gateway only, never bus messages; the gateway builds
// them from its read models and the KV buckets.

// Fleet event types (the SSE event names of GET /v1/fleet/events).
const (
	// FleetSnapshot carries every node; it is the first event of a stream,
	// and the first after a resume the gateway cannot answer with deltas.
	FleetSnapshot = "snapshot"
	// FleetNodeChanged carries one node as it now is (Node), or its
	// removal (Removed, NodeID).
	FleetNodeChanged = "node"
)

// FleetEvent is the data of one event of GET /v1/fleet/events.
type FleetEvent struct {
	Type string `json:"type" jsonschema:"enum=snapshot,enum=node"`
	// Nodes is every node, ordered by ID (snapshot only).
	Nodes []FleetNode `json:"nodes,omitempty"`
	// Node is the changed node (node events, unless Removed).
	Node *FleetNode `json:"node,omitempty"`
	// NodeID names the node of a node event; Removed says it is gone (its
	// machine deleted or reclaimed).
	NodeID  string `json:"nodeId,omitempty"`
	Removed bool   `json:"removed,omitempty"`
	// Redacted is set when the caller is not a platform admin: owners of
	// other tenants' work show as Hidden.
	Redacted bool      `json:"redacted,omitempty"`
	Time     time.Time `json:"time"`
}

// FleetNode is one machine as the console draws it: its inventory, its
// lifecycle and holds, and per GPU who holds it, its health and use.
type FleetNode struct {
	NodeID      string            `json:"nodeId"`
	Hostname    string            `json:"hostname,omitempty"`
	Pool        string            `json:"pool"`
	Zone        string            `json:"zone,omitempty"`
	MachineType string            `json:"machineType,omitempty"`
	PriceClass  string            `json:"priceClass,omitempty"`
	Backend     string            `json:"backend,omitempty"`
	Labels      map[string]string `json:"labels,omitempty"`
	Taints      []Taint           `json:"taints,omitempty"`
	CPUMilli    int64             `json:"cpuMilli,omitempty"`
	MemoryMiB   int64             `json:"memoryMiB,omitempty"`
	// Lifecycle is registered, lost or returned ("" before the resource
	// manager decided anything).
	Lifecycle   NodeLifecycleKind `json:"lifecycle,omitempty"`
	LifecycleAt time.Time         `json:"lifecycleAt,omitzero"`
	// Admin is the node's holds (cordon, drain, spot notice with its
	// Deadline, holds of single GPUs); nil when it takes new work.
	Admin *NodeAdmin `json:"admin,omitempty"`
	GPUs  []FleetGPU `json:"gpus"`
	// AllocatedMilliGPUs is what the node's owners hold, in thousandths of
	// a GPU (a whole GPU 1000, a MIG slice its share, a share its percent).
	AllocatedMilliGPUs int64 `json:"allocatedMilliGpus"`
	// UpdatedAt is when the gateway last saw the node change.
	UpdatedAt time.Time `json:"updatedAt"`
}

// FleetGPU is one GPU of a FleetNode.
type FleetGPU struct {
	Index        int           `json:"index"`
	UUID         string        `json:"uuid"`
	Model        string        `json:"model"`
	MemoryMiB    int64         `json:"memoryMiB"`
	NVLinkDomain string        `json:"nvlinkDomain,omitempty"`
	Healthy      bool          `json:"healthy"`
	MIGEnabled   bool          `json:"migEnabled,omitempty"`
	MIGInstances []MIGInstance `json:"migInstances,omitempty"`
	MPS          MPSState      `json:"mps,omitempty" jsonschema:"enum=,enum=none,enum=up,enum=down"`
	// Health is the GPU's last health fact (an XID, ECC, thermal, fell off
	// the bus, recovered); nil when none was reported.
	Health *GPUHealth `json:"health,omitempty"`
	// Owners are the allocations on the GPU: one for a whole GPU, one per
	// MIG slice or share.
	Owners []GPUOwner `json:"owners,omitempty"`
	// Util is the GPU's latest telemetry; nil before any.
	Util *GPUUtil `json:"util,omitempty"`
}

// GPUHealth is a GPU's last health fact.
type GPUHealth struct {
	Kind    HealthKind `json:"kind"`
	Code    int        `json:"code,omitempty"`
	Healthy bool       `json:"healthy"`
	Message string     `json:"message,omitempty"`
	Time    time.Time  `json:"time"`
}

// GPUOwner is one allocation on a GPU. Hidden is another tenant's work,
// shown to a caller who is not a platform admin without its tenant, job
// or allocation.
type GPUOwner struct {
	Tenant       string `json:"tenant,omitempty"`
	JobID        string `json:"jobId,omitempty"`
	AllocationID string `json:"allocationId,omitempty"`
	Hidden       bool   `json:"hidden,omitempty"`
	// MIG is the MIG instance held (its UUID), Share the share; neither
	// for a whole GPU.
	MIG   string    `json:"mig,omitempty"`
	Share *GPUShare `json:"share,omitempty"`
	// MilliGPUs is what the allocation holds of the GPU (DeviceRef.MilliGPUs).
	MilliGPUs int64 `json:"milliGpus"`
}

// GPUUtil is a GPU's latest telemetry sample, as the console needs it.
type GPUUtil struct {
	GPUUtil   float64   `json:"gpuUtil"`
	FBUsedMiB int64     `json:"fbUsedMiB"`
	TempC     float64   `json:"tempC"`
	PowerW    float64   `json:"powerW"`
	Time      time.Time `json:"time"`
}

// QueueList is GET /v1/queues: per pool, the tenants with work there in
// fair-share order, each with what waits and why.
type QueueList struct {
	// Priorities are the priority classes, highest first: the scheduler
	// serves a higher class before any tenant's lower one.
	Priorities []Priority  `json:"priorities"`
	Pools      []PoolQueue `json:"pools"`
	Time       time.Time   `json:"time"`
}

// PoolQueue is one pool's queue. Pool "*" holds the jobs that name no
// pool (any pool may take them).
type PoolQueue struct {
	Pool string `json:"pool"`
	// Tenants in fair-share order: the lowest weighted share first (the
	// gateway's view of the scheduler's order; the scheduler's dominant
	// share also counts CPU and memory).
	Tenants []TenantQueue `json:"tenants"`
}

// TenantQueue is one tenant's work in one pool.
type TenantQueue struct {
	Tenant string `json:"tenant"`
	// Order is the place in the fair-share order, from 1.
	Order int `json:"order"`
	// Weight is the tenant's fair-share weight (1 when unset).
	Weight float64 `json:"weight"`
	// Quota is the tenant's quota in the pool; nil when none applies.
	Quota *PoolQuota `json:"quota,omitempty"`
	// UsedGPUs is what the tenant's scheduled and running jobs hold in the
	// pool, in GPUs (MIG slices and shares as fractions).
	UsedGPUs float64 `json:"usedGpus"`
	// Share is UsedGPUs over Weight, the order's key.
	Share float64 `json:"share"`
	// Running counts the tenant's scheduled and running jobs in the pool.
	Running int `json:"running"`
	// WaitingByPriority counts the waiting jobs per priority class.
	WaitingByPriority map[string]int `json:"waitingByPriority,omitempty"`
	// Waiting are the queued jobs, highest class first, then oldest.
	Waiting []WaitingJob `json:"waiting"`
}

// WaitingJob is one queued job and why it waits.
type WaitingJob struct {
	JobID    string   `json:"jobId"`
	Name     string   `json:"name,omitempty"`
	Priority Priority `json:"priority" jsonschema:"enum=critical,enum=high,enum=normal,enum=best-effort"`
	// GPUs is what it asks for, in GPUs (MilliGPUs / 1000).
	GPUs    float64 `json:"gpus"`
	Attempt int     `json:"attempt"`
	// Reason and Message are the scheduler's last pending reason ("" until
	// its first cycle decided one).
	Reason  Reason `json:"reason,omitempty"`
	Message string `json:"message,omitempty"`
	// Reservation is the backfill reservation the scheduler holds for the
	// job ("capacity reserved on h100-03 from ..."), when it holds one.
	Reservation string    `json:"reservation,omitempty"`
	QueuedAt    time.Time `json:"queuedAt"`
	UpdatedAt   time.Time `json:"updatedAt"`
}

// Ops event types (the SSE event names of GET /v1/ops/events).
const (
	OpsAlert      = "alert"
	OpsScale      = "scale"
	OpsMachine    = "machine"
	OpsMigration  = "migration"
	OpsPreemption = "preemption"
	// OpsDropped is the last event of a stream whose reader fell too far
	// behind: reconnect with Last-Event-ID to resume.
	OpsDropped = "dropped"
)

// OpsEvent is the data of one event of GET /v1/ops/events: one of Alert,
// Scale, Machine or Job is set, and Nodes and Jobs link what it is about.
type OpsEvent struct {
	Type string `json:"type" jsonschema:"enum=alert,enum=scale,enum=machine,enum=migration,enum=preemption,enum=dropped"`
	// Summary says it for people in one line.
	Summary string         `json:"summary"`
	Pool    string         `json:"pool,omitempty"`
	Nodes   []string       `json:"nodes,omitempty"`
	Jobs    []JobRef       `json:"jobs,omitempty"`
	Alert   *Alert         `json:"alert,omitempty"`
	Scale   *ScaleDecision `json:"scale,omitempty"`
	Machine *MachineEvent  `json:"machine,omitempty"`
	// Job is the job event of a migration (migrating, migrated) or a
	// preemption (requeued, failed or cancelled with reason preempted).
	Job  *JobEvent `json:"job,omitempty"`
	Time time.Time `json:"time"`
}

// JobRef names one job.
type JobRef struct {
	Tenant string `json:"tenant"`
	JobID  string `json:"jobId"`
}

// TenantList is GET /v1/tenants: the tenants the caller may see, with its
// role on each.
type TenantList struct {
	Tenants []TenantAccess `json:"tenants"`
	// All is set for a platform admin, who may see every tenant (the
	// list names those the platform knows of).
	All bool `json:"all,omitempty"`
}

// TenantAccess is one tenant and the caller's role there.
type TenantAccess struct {
	Tenant string `json:"tenant"`
	Role   string `json:"role"`
}

// UsageSeries is GET /v1/tenants/{tenant}/usage/series: a tenant's metered
// usage and cost over time, per pool and price class, for the console's
// cost charts. A record that spans several steps is shared among them in
// proportion to its time in each (its integer sums stay exact).
type UsageSeries struct {
	Tenant string `json:"tenant"`
	// Step is the width of a point: hour or day (UTC).
	Step string `json:"step" jsonschema:"enum=hour,enum=day"`
	// Pool is the pool kept, when one was asked for.
	Pool     string `json:"pool,omitempty"`
	Currency string `json:"currency,omitempty"`
	// Points are ordered by start, pool and price class; a step without
	// usage has no point.
	Points []UsagePoint `json:"points"`
	// Totals are the sums per pool and price class over the whole series.
	Totals []UsagePoint `json:"totals"`
}

// UsagePoint is the usage of one pool and price class over one step
// (Start is its beginning; zero in Totals).
type UsagePoint struct {
	Start      time.Time `json:"start,omitzero"`
	Pool       string    `json:"pool"`
	PriceClass string    `json:"priceClass,omitempty"`
	GPUMillis  int64     `json:"gpuMillis"`
	GPUSeconds float64   `json:"gpuSeconds"`
	CostMicros int64     `json:"costMicros"`
	// OnDemandCostMicros is the same usage at on-demand rates; SavedMicros
	// is what spot or reserved capacity saved (the difference).
	OnDemandCostMicros int64 `json:"onDemandCostMicros"`
	SavedMicros        int64 `json:"savedMicros"`
}

// NodeTelemetry is GET /v1/nodes/{node}/telemetry: a machine's recent
// telemetry (the TELEMETRY stream keeps minutes of it), oldest first, for
// the console's sparklines.
type NodeTelemetry struct {
	NodeID string    `json:"nodeId"`
	Since  time.Time `json:"since"`
	// Samples are the machine's telemetry batches since Since, thinned
	// evenly to at most the points asked for (the latest always kept).
	Samples []Telemetry `json:"samples"`
	// Read is how many batches the stream held since Since.
	Read int `json:"read"`
}
