package contracts

import "time"

// Shape is one kind of request that waits: Count jobs each wanting GPUs
// GPUs of Model.
type Shape struct {
	Model string `json:"model"`
	GPUs  int    `json:"gpus"`
	Count int    `json:"count"`
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

// UsageRecord is one metered run segment, published by billing on
// SubjectUsage(tenant) with Nats-Msg-Id UsageID(allocationID). GPU time is
// metered from the run's start to its end at one-millisecond resolution;
// GPUSeconds is GPUMillis/1000 for display.
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
}

// UsageID is the Nats-Msg-Id and idempotency key of a usage record.
func UsageID(allocationID string) string { return "usage/" + allocationID }
