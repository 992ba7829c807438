package contracts

import (
	"strconv"
	"strings"
	"time"
)

// DeviceRef names one GPU of a node, or a MIG instance or a share of one.
// A run sees MIG.UUID when MIG is set, the GPU's UUID otherwise.
type DeviceRef struct {
	Index int    `json:"index"`
	UUID  string `json:"uuid"`
	Model string `json:"model"`
	// MIG is set when the allocation holds one MIG instance of the GPU.
	MIG *MIGInstance `json:"mig,omitempty"`
	// Share is set when the allocation holds a fraction of the GPU (run
	// under MPS with these limits).
	Share *GPUShare `json:"share,omitempty"`
}

// MilliGPUs is what the device holds of its GPU in thousandths, as quotas
// and fair share count it (GPURequest.MilliGPUs): a whole GPU 1000, a MIG
// instance its compute slices over 7, a share its compute percent.
func (d DeviceRef) MilliGPUs() int64 {
	switch {
	case d.MIG != nil:
		return GPURequest{Count: 1, MIGProfile: d.MIG.Profile}.MilliGPUs()
	case d.Share != nil:
		return GPURequest{Count: 1, Share: d.Share}.MilliGPUs()
	}
	return 1000
}

// GPUShare is a fraction of one GPU: framebuffer and SM share.
type GPUShare struct {
	MemoryMiB      int64 `json:"memoryMiB"`
	ComputePercent int   `json:"computePercent"` // 1..100
}

// VisibleUUID is what CUDA_VISIBLE_DEVICES names for d.
func (d DeviceRef) VisibleUUID() string {
	if d.MIG != nil && d.MIG.UUID != "" {
		return d.MIG.UUID
	}
	return d.UUID
}

// Allocation is a set of devices of one node given to one attempt of one job.
type Allocation struct {
	// ID is AllocationID(tenant, jobID, attempt): one allocation per attempt.
	ID        string      `json:"id"`
	Tenant    string      `json:"tenant"`
	JobID     string      `json:"jobId"`
	Attempt   int         `json:"attempt"`
	NodeID    string      `json:"nodeId"`
	Pool      string      `json:"pool"`
	Devices   []DeviceRef `json:"devices"`
	Priority  Priority    `json:"priority,omitempty"`
	Run       RunSpec     `json:"run"`
	PlanID    string      `json:"planId,omitempty"`
	Scheduler string      `json:"scheduler,omitempty"`
	// Gang is set on each part of a job that spans several machines: one
	// allocation per machine, ID AllocationPartID, placed all or nothing
	// (the scheduler releases the committed parts when one is refused).
	Gang *GangPart `json:"gang,omitempty"`
	// CPUMilli and MemoryMiB are the host CPU and memory the allocation
	// holds on its node (the request's, per machine).
	CPUMilli  int64 `json:"cpuMilli,omitempty"`
	MemoryMiB int64 `json:"memoryMiB,omitempty"`
	// TraceParent is the W3C traceparent of the job's trace (the submit's),
	// set by the scheduler: the plan, the ledger entries, the run and its
	// usage are done long after the submit and by other services, and
	// carry it so that each job stays one trace.
	TraceParent string `json:"traceparent,omitempty"`
	// Runtime is the policy of the allocation's pool (PoolConfig.Runtime)
	// as the scheduler applied it, the platform's default filled in: the
	// agent runs the allocation under it (host network, mount roots) and
	// refuses a launch it does not allow (CheckRuntime), without reading
	// the pools bucket itself.
	Runtime *PoolRuntime `json:"runtime,omitempty"`
}

// GangPart says which part of a multi-machine job an allocation is. The
// agent passes it to the run (GPUPLANE_GANG_RANK, GPUPLANE_GANG_SIZE,
// GPUPLANE_GANG_NODES) so the job's processes can find each other.
type GangPart struct {
	Rank int `json:"rank"`
	Size int `json:"size"`
	// Nodes are the node IDs of every part, by rank.
	Nodes []string `json:"nodes"`
}

// AllocationID is the stable ID of a job attempt's allocation. It is the key
// every consumer of the ledger is idempotent on.
func AllocationID(tenant, jobID string, attempt int) string {
	return tenant + "/" + jobID + "/" + strconv.Itoa(attempt)
}

// AllocationPartID is the ID of part rank of a multi-machine job's
// attempt; a single-machine job's allocation is AllocationID.
func AllocationPartID(tenant, jobID string, attempt, rank int) string {
	return AllocationID(tenant, jobID, attempt) + "#" + strconv.Itoa(rank)
}

// IsAllocationPart reports whether id is AllocationPartID of some rank of
// the attempt.
func IsAllocationPart(id, tenant, jobID string, attempt int) bool {
	rank, ok := strings.CutPrefix(id, AllocationID(tenant, jobID, attempt)+"#")
	if !ok {
		return false
	}
	n, err := strconv.Atoi(rank)
	return err == nil && n >= 0 && strconv.Itoa(n) == rank
}

// Plan is a scheduler's proposal, published on SubjectPlan(scheduler). The
// resource manager verifies each item against the latest ledger and commits
// those that still fit; the others are refused individually.
type Plan struct {
	SchemaVersion int    `json:"schemaVersion"`
	ID            string `json:"id"`
	Scheduler     string `json:"scheduler"`
	// Epoch is the scheduler's fencing epoch (leadership term); 0 until
	// leader election exists.
	Epoch uint64       `json:"epoch"`
	Time  time.Time    `json:"time"`
	Items []Allocation `json:"items"`
}

// LedgerKind says what a ledger entry does to an allocation.
type LedgerKind string

const (
	LedgerCommitted LedgerKind = "committed"
	LedgerReleased  LedgerKind = "released"
)

// LedgerEntry is one change to the allocation ledger, published by the
// resource manager on SubjectLedger(node) with
// Nats-Expected-Last-Subject-Sequence set to the last entry it applied for
// that node: the compare-and-set that makes it the single serialization
// point. Its Nats-Msg-Id is LedgerEntryID.
type LedgerEntry struct {
	SchemaVersion int        `json:"schemaVersion"`
	Kind          LedgerKind `json:"kind"`
	Allocation    Allocation `json:"allocation"`
	Time          time.Time  `json:"time"`
	// Reason a release happened (run_ended, cancelled_by_user, node_lost).
	Reason Reason `json:"reason,omitempty"`
	// Run carries the run's own times and outcome on release, when the
	// run started; billing meters StartedAt..EndedAt.
	Run *RunResult `json:"run,omitempty"`
}

// LedgerEntryID is the Nats-Msg-Id of a ledger entry.
func LedgerEntryID(kind LedgerKind, allocationID string) string {
	return "ledger/" + string(kind) + "/" + allocationID
}

// CEType is the CloudEvents type of a ledger entry.
func (e LedgerEntry) CEType() string { return "io.gpuplane.allocation." + string(e.Kind) + ".v1" }

// Refusal is a plan item the resource manager did not commit, published on
// SubjectRefused(tenant). The scheduler forgets what it assumed and retries.
type Refusal struct {
	SchemaVersion int       `json:"schemaVersion"`
	PlanID        string    `json:"planId"`
	AllocationID  string    `json:"allocationId"`
	Tenant        string    `json:"tenant"`
	JobID         string    `json:"jobId"`
	Attempt       int       `json:"attempt"`
	NodeID        string    `json:"nodeId"`
	Reason        Reason    `json:"reason"`
	Message       string    `json:"message"`
	Time          time.Time `json:"time"`
}

// RefusalID is the Nats-Msg-Id of a refusal.
func RefusalID(planID, allocationID string) string { return "refused/" + planID + "/" + allocationID }

// RunKind is what a run fact reports.
type RunKind string

const (
	RunStarted RunKind = "started"
	RunEnded   RunKind = "ended"
	// RunCheckpointed reports a complete checkpoint of a running job (see
	// Checkpoint); a run may report many.
	RunCheckpointed RunKind = "checkpointed"
	// RunPulling reports the progress of the pull of a container run's
	// image (Pull), before it starts: a few reports per pull (its
	// start, about every tenth of it, its end), each RunPullingID.
	RunPulling RunKind = "pulling"
)

// Checkpoint is a complete checkpoint a run wrote, following the protocol
// in FLOWS.md: the agent gives every run GPUPLANE_CHECKPOINT_DIR (one
// directory per job, kept across attempts); on a checkpoint command it
// sends SIGUSR1 to the run's command (its process group leader); the job writes its state into
// a new subdirectory and then, last, writes the subdirectory's name into
// GPUPLANE_CHECKPOINT_DIR/LATEST (write a temporary file, rename it). The
// agent reports each new LATEST. A later attempt finds the last complete
// checkpoint through LATEST and GPUPLANE_RESTORE_FROM.
type Checkpoint struct {
	// Name is the subdirectory LATEST names.
	Name string `json:"name"`
	// Dir is its full path on the node.
	Dir string `json:"dir"`
	// Requested is true when the checkpoint answered a checkpoint command,
	// false when the job wrote one on its own.
	Requested bool      `json:"requested"`
	Time      time.Time `json:"time"`
}

// RunOutcome is how a run ended.
type RunOutcome string

const (
	OutcomeSucceeded RunOutcome = "succeeded"
	OutcomeFailed    RunOutcome = "failed"
	OutcomeCancelled RunOutcome = "cancelled"
)

// RunResult is the outcome and times of a run that ended.
type RunResult struct {
	Outcome   RunOutcome `json:"outcome"`
	ExitCode  int        `json:"exitCode"`
	StartedAt time.Time  `json:"startedAt,omitzero"`
	EndedAt   time.Time  `json:"endedAt"`
	Reason    Reason     `json:"reason,omitempty"`
	Message   string     `json:"message,omitempty"`
}

// RunEvent is a fact reported by a node agent on SubjectRuns(node). A run
// that never started (cancelled before launch) has only an ended fact with
// a zero StartedAt.
type RunEvent struct {
	SchemaVersion int         `json:"schemaVersion"`
	Kind          RunKind     `json:"kind"`
	AllocationID  string      `json:"allocationId"`
	Tenant        string      `json:"tenant"`
	JobID         string      `json:"jobId"`
	Attempt       int         `json:"attempt"`
	NodeID        string      `json:"nodeId"`
	Devices       []DeviceRef `json:"devices"`
	Time          time.Time   `json:"time"`
	// Result is set on ended.
	Result *RunResult `json:"result,omitempty"`
	// PID is the run's process (group leader) on started, 0 for a
	// simulated run.
	PID int `json:"pid,omitempty"`
	// Checkpoint is set on checkpointed.
	Checkpoint *Checkpoint `json:"checkpoint,omitempty"`
	// Pull is set on pulling.
	Pull *PullProgress `json:"pull,omitempty"`
}

// RunCheckpointID is the Nats-Msg-Id of a checkpointed fact.
func RunCheckpointID(allocationID, name string) string {
	return "run/checkpointed/" + allocationID + "/" + name
}

// RunEventID is the Nats-Msg-Id of a run fact.
func RunEventID(kind RunKind, allocationID string) string {
	return "run/" + string(kind) + "/" + allocationID
}

// CEType is the CloudEvents type of a run event.
func (e RunEvent) CEType() string { return "io.gpuplane.run." + string(e.Kind) + ".v1" }

// NodeCommandKind names a command to a node agent.
type NodeCommandKind string

const (
	// CommandStopRun stops the run of an allocation: SIGTERM, a grace
	// period, SIGKILL. Stopping an allocation the agent has not started yet
	// makes it never start. Idempotent.
	CommandStopRun NodeCommandKind = "stop_run"
	// CommandCheckpointRun asks the run of an allocation to write a
	// checkpoint (SIGUSR1, see Checkpoint); the agent reports it with a
	// checkpointed run fact. A run that does not checkpoint ignores it.
	CommandCheckpointRun NodeCommandKind = "checkpoint_run"
	// CommandInjectFault injects Fault into a simulated machine, for tests
	// and drills; an agent on real GPUs refuses it (logs and acks). An agent
	// applies each Fault.ID once, and never one that was already in the
	// stream when it started (it hit an earlier incarnation).
	CommandInjectFault NodeCommandKind = "inject_fault"
)

// FaultKind names a fault a simulated machine can be given.
type FaultKind string

const (
	FaultXID          FaultKind = "xid"           // an XID error on one GPU; Code (default 79: fell off the bus)
	FaultECCDBE       FaultKind = "ecc_dbe"       // a double-bit ECC error on one GPU
	FaultOverheat     FaultKind = "overheat"      // one GPU runs hot (above its slowdown temperature)
	FaultMachineDeath FaultKind = "machine_death" // the machine and its agent stop at once; runs die
	FaultAgentPause   FaultKind = "agent_pause"   // the agent stops publishing for Duration; runs go on
	FaultClear        FaultKind = "clear"         // every fault of the GPU (or of the machine when GPU is empty) ends
)

// Fault is a fault to inject. GPU names the GPU by UUID or by index ("3");
// empty means the first GPU for per-GPU faults and the whole machine for
// clear. Duration bounds overheat and agent_pause (0: until cleared for
// overheat, 30s for agent_pause).
type Fault struct {
	ID       string    `json:"id"`
	Kind     FaultKind `json:"kind"`
	GPU      string    `json:"gpu,omitempty"`
	Code     int       `json:"code,omitempty"`
	Duration Duration  `json:"duration,omitempty"`
}

// NodeCommand is a command for one node agent on SubjectNodeCommands(node).
type NodeCommand struct {
	SchemaVersion int             `json:"schemaVersion"`
	Kind          NodeCommandKind `json:"kind"`
	AllocationID  string          `json:"allocationId"`
	Tenant        string          `json:"tenant"`
	JobID         string          `json:"jobId"`
	Attempt       int             `json:"attempt"`
	Reason        Reason          `json:"reason"`
	GracePeriod   Duration        `json:"gracePeriod,omitempty"`
	// Fault is set on inject_fault (AllocationID is empty then).
	Fault *Fault    `json:"fault,omitempty"`
	Time  time.Time `json:"time"`
}

// FaultCommandID is the Nats-Msg-Id of an inject_fault command.
func FaultCommandID(nodeID, faultID string) string {
	return "cmd/inject_fault/" + nodeID + "/" + faultID
}

// CheckpointCommandID is the Nats-Msg-Id of a checkpoint_run command; seq
// tells the requests of one allocation apart.
func CheckpointCommandID(allocationID string, seq int) string {
	return "cmd/checkpoint_run/" + allocationID + "/" + strconv.Itoa(seq)
}

// LogChunk is a piece of a run's output (stdout and stderr interleaved as
// written), published by the node agent on SubjectLogs(tenant, job, node) with
// Nats-Msg-Id LogChunkID. Offset is the byte offset of Data in the run's
// log; the last chunk of a run has EOF set (and ExitCode). Data is the raw
// bytes as a string; invalid UTF-8 is replaced.
type LogChunk struct {
	SchemaVersion int       `json:"schemaVersion"`
	AllocationID  string    `json:"allocationId"`
	Tenant        string    `json:"tenant"`
	JobID         string    `json:"jobId"`
	Attempt       int       `json:"attempt"`
	NodeID        string    `json:"nodeId"`
	Offset        int64     `json:"offset"`
	Data          string    `json:"data"`
	EOF           bool      `json:"eof,omitempty"`
	ExitCode      int       `json:"exitCode,omitempty"`
	Time          time.Time `json:"time"`
}

// LogChunkID is the Nats-Msg-Id of a log chunk.
func LogChunkID(allocationID string, offset int64, eof bool) string {
	id := "log/" + allocationID + "/" + strconv.FormatInt(offset, 10)
	if eof {
		id += "/eof"
	}
	return id
}

// MaxLogChunk is the most bytes of output one LogChunk carries.
const MaxLogChunk = 32 << 10

// NodeCommandID is the Nats-Msg-Id of a node command.
func NodeCommandID(kind NodeCommandKind, allocationID string) string {
	return "cmd/" + string(kind) + "/" + allocationID
}
