package contracts

import "time"

// The gateway's run-output, checkpoint, node and fault endpoints (see the
// path list in api.go).

// Trailers of GET .../jobs/{id}/logs. The body is the raw output; what is
// known only at its end travels in HTTP trailers (clients that cannot read
// trailers still get the bytes).
const (
	// HeaderLogAttempt names the attempt whose output the body holds
	// ("all" with ?attempt=all). A header, sent before the body.
	HeaderLogAttempt = "Gpuplane-Log-Attempt"
	// TrailerLogComplete is "true" when the body ends with the end of the
	// run's output (its EOF chunk), "false" when the run is still going or
	// ended without one (a lost node).
	TrailerLogComplete = "Gpuplane-Log-Complete"
	// TrailerExitCode is the exit code the EOF chunk reported (of the last
	// attempt shown); absent without one.
	TrailerExitCode = "Gpuplane-Exit-Code"
	// TrailerLogGaps lists byte ranges of the output that were never
	// received, "attempt 1: 100-200, attempt 2: 0-64"; absent when none.
	TrailerLogGaps = "Gpuplane-Log-Gaps"
)

// FaultRequest is the body of POST /v1/nodes/{node}/faults: a Fault
// without its ID, which the gateway assigns.
type FaultRequest struct {
	Kind FaultKind `json:"kind"`
	// GPU is the GPU's index ("3") or UUID.
	GPU      string   `json:"gpu,omitempty"`
	Code     int      `json:"code,omitempty"`
	Duration Duration `json:"duration,omitempty"`
}

// FaultResponse answers an accepted fault: the inject_fault command is on
// the bus (its Nats-Msg-Id is FaultCommandID(NodeID, Fault.ID)); what it
// did shows in the node's health events and inventory.
type FaultResponse struct {
	NodeID   string `json:"nodeId"`
	Fault    Fault  `json:"fault"`
	Stream   string `json:"stream"`
	Sequence uint64 `json:"sequence"`
}

// CheckpointResponse answers an accepted checkpoint request: the
// checkpoint_run command is on the bus for the node running the job; the
// checkpoint itself is reported as a checkpointed run fact.
type CheckpointResponse struct {
	Tenant       string `json:"tenant"`
	JobID        string `json:"jobId"`
	Attempt      int    `json:"attempt"`
	AllocationID string `json:"allocationId"`
	NodeID       string `json:"nodeId"`
	// CommandID is the command's Nats-Msg-Id (CheckpointCommandID).
	CommandID string `json:"commandId"`
	Stream    string `json:"stream"`
	Sequence  uint64 `json:"sequence"`
}

// NodeStatus is the gateway's view of one node: its latest inventory and
// the last lifecycle fact the resource manager published about it.
type NodeStatus struct {
	NodeInventory
	// Lifecycle is registered, lost or returned; "" before the resource
	// manager has decided anything about the node.
	Lifecycle   NodeLifecycleKind `json:"lifecycle,omitempty"`
	LifecycleAt time.Time         `json:"lifecycleAt,omitzero"`
	// Admin is the node's holds, on the node and on single GPUs, by
	// administrators or the platform (KV
	// BucketNodeAdmin); nil when the node takes new work.
	Admin *NodeAdmin `json:"admin,omitempty"`
}

// NodeList is every node the gateway knows, ordered by ID.
type NodeList struct {
	Nodes []NodeStatus `json:"nodes"`
}
