package contracts

import "time"

// Shape is one kind of request that waits: Count jobs each wanting GPUs
// whole GPUs of Model on one machine; or, with MIGProfile, one MIG
// instance of that profile each; or, with Share, that fraction of one GPU
// each. A MIG or share shape has GPUs 1 (the one card it lands on), so a
// reader that predates those fields still sees one GPU per job.
type Shape struct {
	Model string `json:"model"`
	GPUs  int    `json:"gpus"`
	Count int    `json:"count"`
	// MIGProfile is the MIG instance profile ("1g.10gb") each job takes;
	// such jobs fit only on existing instances of it, never on whole GPUs.
	MIGProfile string `json:"migProfile,omitempty"`
	// Share is the framebuffer and compute each job takes on one GPU
	// outside MIG mode; several fit on one GPU.
	Share *GPUShare `json:"share,omitempty"`
}

// Kind says whether s wants whole GPUs, a MIG instance or a share.
func (s Shape) Kind() GPUKind {
	switch {
	case s.MIGProfile != "":
		return GPUKindMIG
	case s.Share != nil:
		return GPUKindShare
	}
	return GPUKindWhole
}

// Equal reports whether s and o describe the same shape and count (Share
// compared by value, not by pointer).
func (s Shape) Equal(o Shape) bool {
	if (s.Share == nil) != (o.Share == nil) || s.Share != nil && *s.Share != *o.Share {
		return false
	}
	return s.Model == o.Model && s.GPUs == o.GPUs && s.Count == o.Count && s.MIGProfile == o.MIGProfile
}

// PoolDemand is the scheduler's view of what waits for a pool, published on
// SubjectDemand(pool) when it changes. Unplaceable lists the shapes that no
// node of the pool can hold even when empty-of-others is not enough: they
// need more machines.
type PoolDemand struct {
	SchemaVersion int       `json:"schemaVersion"`
	Pool          string    `json:"pool"`
	Time          time.Time `json:"time"`
	PendingJobs   int       `json:"pendingJobs"`
	PendingGPUs   int       `json:"pendingGpus"`
	// Shapes of the pending jobs that could run on this pool's machine
	// type but do not fit on its free capacity now.
	Waiting   []Shape `json:"waiting"`
	Nodes     int     `json:"nodes"`
	FreeGPUs  int     `json:"freeGpus"`
	TotalGPUs int     `json:"totalGpus"`
}

// ScaleDirection says which way a pool should go.
type ScaleDirection string

const (
	ScaleUp   ScaleDirection = "up"
	ScaleDown ScaleDirection = "down"
)

// ScaleDecision is an autoscaler decision for one pool on SubjectScale(pool).
type ScaleDecision struct {
	SchemaVersion int            `json:"schemaVersion"`
	ID            string         `json:"id"`
	Pool          string         `json:"pool"`
	Direction     ScaleDirection `json:"direction"`
	CurrentNodes  int            `json:"currentNodes"`
	DesiredNodes  int            `json:"desiredNodes"`
	Reason        string         `json:"reason"`
	Time          time.Time      `json:"time"`
}

// AlertState is firing or resolved.
type AlertState string

const (
	AlertFiring   AlertState = "firing"
	AlertResolved AlertState = "resolved"
)

// Alert is a monitor alert on SubjectAlert(kind). Alerts are de-duplicated
// by Key: one firing and one resolved event per episode.
type Alert struct {
	SchemaVersion int               `json:"schemaVersion"`
	Kind          string            `json:"kind"` // e.g. node_silent, gpu_hot
	Key           string            `json:"key"`  // what it is about, e.g. the node ID
	State         AlertState        `json:"state"`
	Severity      string            `json:"severity"`
	Labels        map[string]string `json:"labels,omitempty"`
	Value         float64           `json:"value"`
	Message       string            `json:"message"`
	Since         time.Time         `json:"since"`
	Time          time.Time         `json:"time"`
}

// Alert labels the monitor's rule alerts carry, so that a consumer (the
// autoscaler, the resource manager) acts on an alert without knowing the
// rule that raised it. AlertLabelAction is absent when the alert only
// informs.
const (
	AlertLabelAction  = "action"
	AlertLabelScope   = "scope" // gpu, node, pool or tenant: what Key names
	AlertLabelNode    = "node"
	AlertLabelPool    = "pool"
	AlertLabelGPU     = "gpu_uuid"
	AlertLabelEpisode = "episode"
	// AlertLabelDeadline is an RFC 3339 time the alert's subject goes
	// away (a spot reclaim).
	AlertLabelDeadline = "deadline"
	// AlertLabelMachine is the provider's machine ID.
	AlertLabelMachine = "machine"
)

// Alert kinds raised outside the monitor's rule file.
const (
	// AlertKindSpotInterruption: the provider gave notice it reclaims a
	// spot machine (key: node ID; labels node, pool, machine, deadline).
	// The autoscaler raises it and drains the node (NodeAdmin Cause
	// spot_interruption); it resolves when the machine is gone.
	AlertKindSpotInterruption = "spot_interruption"
)

// Actions an alert asks for in its AlertLabelAction label, while firing.
const (
	// AlertActionScaleUp: the pool (label pool) needs more machines.
	AlertActionScaleUp = "scale_up"
	// AlertActionDrainGPU: take no new work on the GPU (label gpu_uuid of
	// node) and move its runs away.
	AlertActionDrainGPU = "drain_gpu"
	// AlertActionGPUUnhealthy: the GPU is faulty; cordon it, migrate its runs.
	AlertActionGPUUnhealthy = "gpu_unhealthy"
	// AlertActionDefragment: free capacity of the pool (label pool) is
	// fragmented; consolidate small jobs when that lets a pending job
	// start.
	AlertActionDefragment = "defragment"
)

// MachineEventKind is what happened to a machine the autoscaler manages.
type MachineEventKind string

const (
	MachineRequested   MachineEventKind = "requested"   // a create call was accepted (token)
	MachineReady       MachineEventKind = "ready"       // its node agent registered
	MachineDraining    MachineEventKind = "draining"    // held before deletion
	MachineDeleted     MachineEventKind = "deleted"     // deleted by the autoscaler
	MachineInterrupted MachineEventKind = "interrupted" // spot notice received
	MachineReclaimed   MachineEventKind = "reclaimed"   // the provider took it back
	MachineFailed      MachineEventKind = "failed"      // a call for it failed (Message says why)
)

// MachineEvent is a fact about one machine the autoscaler manages, on
// SubjectMachines(pool) with Nats-Msg-Id MachineEventID.
type MachineEvent struct {
	SchemaVersion int              `json:"schemaVersion"`
	Kind          MachineEventKind `json:"kind"`
	Pool          string           `json:"pool"`
	MachineID     string           `json:"machineId,omitempty"`
	NodeID        string           `json:"nodeId,omitempty"`
	// Token is the idempotency token of the create call (requested).
	Token      string     `json:"token,omitempty"`
	DecisionID string     `json:"decisionId,omitempty"`
	Deadline   *time.Time `json:"deadline,omitempty"`
	Message    string     `json:"message,omitempty"`
	Time       time.Time  `json:"time"`
}

// MachineEventID is the Nats-Msg-Id of a machine event: one per kind and
// machine (or token, before a machine ID is known).
func MachineEventID(kind MachineEventKind, machineOrToken string) string {
	return "machine/" + string(kind) + "/" + machineOrToken
}

// UsageRecord is one metered run segment, published by billing on
// SubjectUsage(tenant) with Nats-Msg-Id UsageSegmentID(allocationID,
// Segment). A run is metered in whole seconds, [floor(start), ceil(end)),
// cut into segments at UTC midnights and at price changes; Start and End
// are the segment's bounds, GPUMillis is GPUs × Seconds × 1000 and
// GPUSeconds is GPUMillis/1000 for display. Records written before
// segments existed have ID UsageID(allocationID), millisecond bounds and
// no price fields. Costs are integer micro-units of Currency; see
// services/billing/README.md for the rounding rules.
type UsageRecord struct {
	SchemaVersion int       `json:"schemaVersion"`
	ID            string    `json:"id"`
	AllocationID  string    `json:"allocationId"`
	Tenant        string    `json:"tenant"`
	JobID         string    `json:"jobId"`
	Attempt       int       `json:"attempt"`
	NodeID        string    `json:"nodeId"`
	Pool          string    `json:"pool"`
	GPUModel      string    `json:"gpuModel"`
	GPUs          int       `json:"gpus"`
	Start         time.Time `json:"start"`
	End           time.Time `json:"end"`
	GPUMillis     int64     `json:"gpuMillis"`
	GPUSeconds    float64   `json:"gpuSeconds"`
	Time          time.Time `json:"time"`
	UsageSegment
}

// UsageSegment is what a usage record says about its segment and its price.
type UsageSegment struct {
	// Segment numbers an allocation's records from 0; Final marks the last
	// segment of a bill. A provisional bill that is voided has its own
	// final record; the bill that replaces it numbers on after the voids.
	Segment int  `json:"segment,omitempty"`
	Final   bool `json:"final,omitempty"`
	// Reason the allocation was released (run_ended, cancelled_by_user,
	// node_lost, ...).
	Reason Reason `json:"reason,omitempty"`
	// Provisional marks the records of a run billed to the time the
	// resource manager released it as node_lost: the end of the run as its
	// agent observed it is the truth, and when the agent reports it (on its
	// return) billing voids these records and bills that end instead.
	Provisional bool `json:"provisional,omitempty"`
	// Voids names the record (its ID) this one cancels: the same segment
	// with every quantity and cost negated (Seconds, GPUMillis, GPUSeconds
	// and the costs are that record's, times -1), so sums over records are
	// sums over what stands. Only provisional records are ever voided.
	Voids   string      `json:"voids,omitempty"`
	Devices []DeviceRef `json:"devices,omitempty"`
	// Seconds is End − Start in whole seconds.
	Seconds int64 `json:"seconds,omitempty"`
	// GPUShare is the GPU equivalents held, an exact fraction: "2" for two
	// whole GPUs, "3/7" for a MIG 3g instance, "1/2" for half a card.
	GPUShare   string     `json:"gpuShare,omitempty"`
	PriceClass PriceClass `json:"priceClass,omitempty"`
	// PriceVersion is the price book version in effect over the segment;
	// empty (and the costs zero) when the book had none then.
	PriceVersion string `json:"priceVersion,omitempty"`
	Currency     string `json:"currency,omitempty"`
	// Unpriced is set when the version prices neither the GPU model nor
	// "*": the time is metered, its GPU cost is zero.
	Unpriced bool `json:"unpriced,omitempty"`
	// GPURateMicros is the price of one GPU-hour of GPUModel in PriceClass;
	// OnDemandRateMicros the same at on-demand, for savings.
	GPURateMicros      int64 `json:"gpuRateMicros,omitempty"`
	OnDemandRateMicros int64 `json:"onDemandRateMicros,omitempty"`
	// CPUMilli and MemoryMiB are what the job requested, billed when the
	// version has CPU or memory rates.
	CPUMilli  int64 `json:"cpuMilli,omitempty"`
	MemoryMiB int64 `json:"memoryMiB,omitempty"`
	// Each cost is rounded half to even to the micro-unit on its own;
	// CostMicros is their sum, OnDemandCostMicros the same usage priced at
	// on-demand rates (what spot or reserved saved is the difference).
	GPUCostMicros      int64 `json:"gpuCostMicros,omitempty"`
	CPUCostMicros      int64 `json:"cpuCostMicros,omitempty"`
	MemoryCostMicros   int64 `json:"memoryCostMicros,omitempty"`
	CostMicros         int64 `json:"costMicros,omitempty"`
	OnDemandCostMicros int64 `json:"onDemandCostMicros,omitempty"`
}

// UsageID is the Nats-Msg-Id and idempotency key of a usage record.
func UsageID(allocationID string) string { return "usage/" + allocationID }
