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
	// ComputeCapability is the CUDA compute capability, "major.minor" ("9.0").
	ComputeCapability string `json:"computeCapability,omitempty"`
	// MIGEnabled is the GPU's current MIG mode. The agent reads it and the
	// instances below; it never changes them (an administrator does).
	MIGEnabled bool `json:"migEnabled,omitempty"`
	// MIGInstances are the MIG devices that exist on this GPU now.
	MIGInstances []MIGInstance `json:"migInstances,omitempty"`
	// MPS is the state of the GPU's MPS control daemon, which enforces
	// the shares (GPUShare) of it; "" where the agent runs no MPS (a
	// simulated machine).
	MPS MPSState `json:"mps,omitempty" jsonschema:"enum=,enum=none,enum=up,enum=down"`
}

// MPSState is the state of a GPU's MPS control daemon: the agent starts
// one before the first share of the GPU launches and stops it once the
// GPU holds no share.
type MPSState string

const (
	// MPSNone: no share holds the GPU and no daemon runs.
	MPSNone MPSState = "none"
	// MPSUp: the daemon runs; shares of the GPU launch.
	MPSUp MPSState = "up"
	// MPSDown: a share needs the daemon and it is not running (it did not
	// start, or it died and is being restarted): new shares of the GPU
	// fail with ReasonMPSUnavailable.
	MPSDown MPSState = "down"
)

// MIGInstance is one MIG device (a GPU instance with its compute instance)
// of a GPU. Start and Size are its placement on the parent in memory
// slices, as nvidia-smi mig -lgip reports them ("placements: {0,2,4}:2").
type MIGInstance struct {
	UUID      string `json:"uuid"`    // MIG-<uuid>, what CUDA_VISIBLE_DEVICES takes
	Profile   string `json:"profile"` // "1g.10gb", "3g.40gb", ...
	GIID      int    `json:"giId"`
	CIID      int    `json:"ciId"`
	Start     int    `json:"start"`
	Size      int    `json:"size"`
	MemoryMiB int64  `json:"memoryMiB"`
}

// GPULink is how two GPUs of a machine reach each other, as
// `nvidia-smi topo -m` shows it. A < B; every pair appears once.
type GPULink struct {
	A int `json:"a"`
	B int `json:"b"`
	// NVLinks is the number of active NVLink links between the two (through
	// an NVSwitch every GPU reaches every other with all its links); 0 when
	// they talk over PCIe only.
	NVLinks int `json:"nvlinks"`
	// Path is the closest common ancestor on PCIe: one of the TopoPath values.
	Path TopoPath `json:"path"`
}

// TopoPath is nvidia-smi's name for the PCIe path between two GPUs, from
// nearest to farthest; it mirrors NVML's GpuTopologyLevel.
type TopoPath string

const (
	TopoInternal   TopoPath = "X"    // same board (NVML TOPOLOGY_INTERNAL)
	TopoSingle     TopoPath = "PIX"  // one PCIe switch
	TopoMultiple   TopoPath = "PXB"  // several PCIe switches, no host bridge
	TopoHostBridge TopoPath = "PHB"  // a PCIe host bridge
	TopoNode       TopoPath = "NODE" // host bridges within one NUMA node
	TopoSystem     TopoPath = "SYS"  // across NUMA nodes (SMP interconnect)
)

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
	// Purpose is what the machine is for (training, inference, ...).
	Purpose string `json:"purpose,omitempty"`
	// Taints keep jobs that do not tolerate them off the node.
	Taints  []Taint `json:"taints,omitempty"`
	Backend string  `json:"backend"` // sim or nvml
	// DriverVersion and CUDAVersion are the NVIDIA driver's ("550.54.15")
	// and the CUDA version it supports ("12.4").
	DriverVersion string `json:"driverVersion,omitempty"`
	CUDAVersion   string `json:"cudaVersion,omitempty"`
	// Topology links every pair of the machine's GPUs (by index).
	Topology  []GPULink `json:"topology,omitempty"`
	CPUMilli  int64     `json:"cpuMilli"`
	MemoryMiB int64     `json:"memoryMiB"`
	GPUs      []GPUInfo `json:"gpus"`
	// Images are the container images the node holds in its cache: each by
	// its manifest digest ("sha256:...") and by every reference it was
	// pulled as, in ImageRef's form. The scheduler prefers, all else
	// equal, a node that holds a job's image (its locality score).
	Images []string `json:"images,omitempty"`
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
	// PowerLimitW is the enforced power limit: DCGM_FI_DEV_POWER_MGMT_LIMIT (W).
	PowerLimitW float64 `json:"powerLimitW,omitempty"`
	// ECCSBE and ECCDBE are the volatile single- and double-bit ECC error
	// counts since the driver loaded: DCGM_FI_DEV_ECC_SBE_VOL_TOTAL,
	// DCGM_FI_DEV_ECC_DBE_VOL_TOTAL.
	ECCSBE int64 `json:"eccSbe,omitempty"`
	ECCDBE int64 `json:"eccDbe,omitempty"`
	// ThrottleReasons is NVML's clocks-event-reasons bit mask:
	// DCGM_FI_DEV_CLOCK_THROTTLE_REASONS. ThrottleReasonNames decodes it.
	ThrottleReasons uint64 `json:"throttleReasons,omitempty"`
	// LastXID is the last XID error the GPU raised: DCGM_FI_DEV_XID_ERRORS.
	LastXID int `json:"lastXid,omitempty"`
	// Processes are the compute processes on the GPU now.
	Processes []GPUProcess `json:"processes,omitempty"`
	// Healthy is false once the agent has seen a fault that makes the GPU
	// unusable (XID 79/48/..., double-bit ECC, fell off the bus).
	Healthy bool `json:"healthy"`
	// AllocationID is the allocation holding this GPU, "" when idle.
	AllocationID string `json:"allocationId,omitempty"`
}

// GPUProcess is one process using a GPU.
type GPUProcess struct {
	PID     int   `json:"pid"`
	UsedMiB int64 `json:"usedMiB"`
}

// Throttle reason bits, NVML's nvmlClocksEventReason* values.
const (
	ThrottleGPUIdle          uint64 = 0x1
	ThrottleAppClocksSetting uint64 = 0x2
	ThrottleSWPowerCap       uint64 = 0x4
	ThrottleHWSlowdown       uint64 = 0x8
	ThrottleSyncBoost        uint64 = 0x10
	ThrottleSWThermal        uint64 = 0x20
	ThrottleHWThermal        uint64 = 0x40
	ThrottleHWPowerBrake     uint64 = 0x80
	ThrottleDisplayClocks    uint64 = 0x100
)

var throttleNames = []struct {
	bit  uint64
	name string
}{
	{ThrottleGPUIdle, "gpu_idle"}, {ThrottleAppClocksSetting, "applications_clocks_setting"},
	{ThrottleSWPowerCap, "sw_power_cap"}, {ThrottleHWSlowdown, "hw_slowdown"},
	{ThrottleSyncBoost, "sync_boost"}, {ThrottleSWThermal, "sw_thermal_slowdown"},
	{ThrottleHWThermal, "hw_thermal_slowdown"}, {ThrottleHWPowerBrake, "hw_power_brake_slowdown"},
	{ThrottleDisplayClocks, "display_clock_setting"},
}

// ThrottleReasonNames decodes a throttle reason mask into names, in bit order.
func ThrottleReasonNames(mask uint64) []string {
	var out []string
	for _, t := range throttleNames {
		if mask&t.bit != 0 {
			out = append(out, t.name)
		}
	}
	return out
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

// HealthKind names a GPU health fact.
type HealthKind string

const (
	// HealthXID is an XID error; Code is the XID. Whether it makes the GPU
	// unhealthy depends on the XID (79 fell off the bus, 48 double-bit ECC,
	// 63/64 row remapping, 74 NVLink, 92/94/95 ECC, 119/120 GSP).
	HealthXID HealthKind = "xid"
	// HealthECCDBE is a rise of the volatile double-bit ECC error count.
	HealthECCDBE HealthKind = "ecc_dbe"
	// HealthThermal is a GPU at or above its slowdown temperature (Healthy
	// stays true: the GPU works, slowly) or back below it.
	HealthThermal HealthKind = "thermal"
	// HealthFellOffBus is a GPU the driver can no longer reach.
	HealthFellOffBus HealthKind = "fell_off_bus"
	// HealthRecovered says a GPU reported unhealthy before is usable again
	// (after a reset by an administrator, or a cleared simulated fault).
	HealthRecovered HealthKind = "recovered"
)

// HealthEvent reports a GPU health fact on SubjectNodeHealth(node). Its
// Nats-Msg-Id is HealthEventID.
type HealthEvent struct {
	SchemaVersion int        `json:"schemaVersion"`
	NodeID        string     `json:"nodeId"`
	Incarnation   string     `json:"incarnation,omitempty"`
	Seq           uint64     `json:"seq"` // per agent incarnation, from 1
	GPUUUID       string     `json:"gpuUuid"`
	GPUIndex      int        `json:"gpuIndex"`
	Kind          HealthKind `json:"kind"`
	Code          int        `json:"code,omitempty"`
	// Healthy is whether the GPU may still be given to new work.
	Healthy bool      `json:"healthy"`
	Message string    `json:"message,omitempty"`
	Time    time.Time `json:"time"`
}

// HealthEventID is the Nats-Msg-Id of a health event.
func HealthEventID(nodeID, incarnation string, seq uint64) string {
	return "health/" + nodeID + "/" + incarnation + "/" + strconv.FormatUint(seq, 10)
}

// CEType is the CloudEvents type of a health event.
func (e HealthEvent) CEType() string { return "io.gpuplane.node.health." + string(e.Kind) + ".v1" }
