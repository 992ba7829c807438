package contracts

import (
	"strconv"
	"time"
)

// DeviceRef names one GPU of a node.
type DeviceRef struct {
	Index int    `json:"index"`
	UUID  string `json:"uuid"`
	Model string `json:"model"`
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
}

// AllocationID is the stable ID of a job attempt's allocation. It is the key
// every consumer of the ledger is idempotent on.
func AllocationID(tenant, jobID string, attempt int) string {
	return tenant + "/" + jobID + "/" + strconv.Itoa(attempt)
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
)

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
)

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
	Time          time.Time       `json:"time"`
}

// NodeCommandID is the Nats-Msg-Id of a node command.
func NodeCommandID(kind NodeCommandKind, allocationID string) string {
	return "cmd/" + string(kind) + "/" + allocationID
}
