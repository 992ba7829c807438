package contracts

import (
	"strconv"
	"time"
)

// GPUInfo describes one GPU as discovered by a node agent.
type GPUInfo struct {
	Index     int    `json:"index"`
	UUID      string `json:"uuid"`
	Model     string `json:"model"`
	MemoryMiB int64  `json:"memoryMiB"`
	PCIBusID  string `json:"pciBusId,omitempty"`
	// NVLinkDomain groups GPUs connected by NVLink/NVSwitch; "" means PCIe only.
	NVLinkDomain string `json:"nvlinkDomain,omitempty"`
	Healthy      bool   `json:"healthy"`
}

// NodeInventory is what a node agent publishes on SubjectInventory(node) at
// start and whenever it changes. The latest one per node is the truth.
type NodeInventory struct {
	SchemaVersion int               `json:"schemaVersion"`
	NodeID        string            `json:"nodeId"`
	Hostname      string            `json:"hostname"`
	Pool          string            `json:"pool"`
	Zone          string            `json:"zone,omitempty"`
	MachineType   string            `json:"machineType"`
	PriceClass    string            `json:"priceClass,omitempty"` // on-demand, spot, reserved
	Labels        map[string]string `json:"labels,omitempty"`
	Backend       string            `json:"backend"` // sim or nvml
	CPUMilli      int64             `json:"cpuMilli"`
	MemoryMiB     int64             `json:"memoryMiB"`
	GPUs          []GPUInfo         `json:"gpus"`
	// Incarnation changes every time the agent process starts, so consumers
	// can tell a restart from a redelivery.
	Incarnation string    `json:"incarnation"`
	Time        time.Time `json:"time"`
}

// InventoryID is the Nats-Msg-Id of an inventory.
func InventoryID(nodeID, incarnation string, version int) string {
	return "inv/" + nodeID + "/" + incarnation + "/" + strconv.Itoa(version)
}

// Heartbeat says a node agent is alive; published on SubjectHeartbeat(node).
type Heartbeat struct {
	SchemaVersion int       `json:"schemaVersion"`
	NodeID        string    `json:"nodeId"`
	Incarnation   string    `json:"incarnation"`
	Seq           uint64    `json:"seq"`
	Time          time.Time `json:"time"`
	// Runs are the allocation IDs the agent is running now.
	Runs []string `json:"runs"`
}

// GPUSample is one GPU's readings at one instant. Field comments give the
// dcgm-exporter metric each maps to.
type GPUSample struct {
	Index       int     `json:"index"`
	UUID        string  `json:"uuid"`
	Model       string  `json:"model"`
	GPUUtil     float64 `json:"gpuUtil"`     // DCGM_FI_DEV_GPU_UTIL (%)
	MemCopyUtil float64 `json:"memCopyUtil"` // DCGM_FI_DEV_MEM_COPY_UTIL (%)
	FBUsedMiB   int64   `json:"fbUsedMiB"`   // DCGM_FI_DEV_FB_USED (MiB)
	FBFreeMiB   int64   `json:"fbFreeMiB"`   // DCGM_FI_DEV_FB_FREE (MiB)
	TempC       float64 `json:"tempC"`       // DCGM_FI_DEV_GPU_TEMP (°C)
	PowerW      float64 `json:"powerW"`      // DCGM_FI_DEV_POWER_USAGE (W)
	SMClockMHz  float64 `json:"smClockMHz"`  // DCGM_FI_DEV_SM_CLOCK (MHz)
	// AllocationID is the allocation holding this GPU, "" when idle.
	AllocationID string `json:"allocationId,omitempty"`
}

// Telemetry is one tick of one machine: all its GPUs in one message, on
// SubjectTelemetry(node), about once a second.
type Telemetry struct {
	SchemaVersion int         `json:"schemaVersion"`
	NodeID        string      `json:"nodeId"`
	Hostname      string      `json:"hostname"`
	Pool          string      `json:"pool"`
	Time          time.Time   `json:"time"`
	GPUs          []GPUSample `json:"gpus"`
}

// NodeLifecycleKind names a node lifecycle event.
type NodeLifecycleKind string

const (
	NodeRegistered NodeLifecycleKind = "registered"
	NodeLost       NodeLifecycleKind = "lost"
	NodeReturned   NodeLifecycleKind = "returned"
)

// NodeEvent is a node lifecycle fact decided by the resource manager on
// SubjectNodeLifecycle(node).
type NodeEvent struct {
	SchemaVersion int               `json:"schemaVersion"`
	Kind          NodeLifecycleKind `json:"kind"`
	NodeID        string            `json:"nodeId"`
	Pool          string            `json:"pool"`
	Incarnation   string            `json:"incarnation,omitempty"`
	Reason        string            `json:"reason,omitempty"`
	Time          time.Time         `json:"time"`
}

// NodeEventID is the Nats-Msg-Id of a node event.
func NodeEventID(kind NodeLifecycleKind, nodeID string, seq uint64) string {
	return "node/" + string(kind) + "/" + nodeID + "/" + strconv.FormatUint(seq, 10)
}

// HealthEvent reports a GPU health fact (XID, ECC, thermal) on
// SubjectNodeHealth(node).
type HealthEvent struct {
	SchemaVersion int       `json:"schemaVersion"`
	NodeID        string    `json:"nodeId"`
	GPUUUID       string    `json:"gpuUuid"`
	Kind          string    `json:"kind"` // xid, ecc_dbe, thermal, fell_off_bus
	Code          int       `json:"code,omitempty"`
	Healthy       bool      `json:"healthy"`
	Message       string    `json:"message,omitempty"`
	Time          time.Time `json:"time"`
}
