package contracts

import (
	"fmt"
	"strings"
)

// Reason is a stable, machine-readable code. Reasons appear in rejected
// events, refused plan items, pending reasons and API error bodies; clients
// switch on them, so a code is never renamed, only added.
type Reason string

// Request rejection reasons (the Reason of a rejected JobEvent or of an API
// error body).
const (
	ReasonInvalidJSON  Reason = "invalid_json"
	ReasonInvalidType  Reason = "invalid_type"
	ReasonUnknownField Reason = "unknown_field"
	ReasonTooLarge     Reason = "too_large"
	// ReasonRateLimited: a tenant sent more requests than its rate allows;
	// Retry-After says when to try again.
	ReasonRateLimited Reason = "rate_limited"
	// ReasonTooManyStreams: a tenant has as many event or log streams
	// open as it may.
	ReasonTooManyStreams       Reason = "too_many_streams"
	ReasonEmptyBody            Reason = "empty_body"
	ReasonUnsupportedSchema    Reason = "unsupported_schema_version"
	ReasonMissingField         Reason = "missing_field"
	ReasonInvalidValue         Reason = "invalid_value"
	ReasonOutOfRange           Reason = "out_of_range"
	ReasonInvalidID            Reason = "invalid_id"
	ReasonInvalidTenant        Reason = "invalid_tenant"
	ReasonTenantMismatch       Reason = "tenant_mismatch"
	ReasonUnknownGPUModel      Reason = "unknown_gpu_model"
	ReasonUnknownPriority      Reason = "unknown_priority"
	ReasonInvalidDuration      Reason = "invalid_duration"
	ReasonConflictingRun       Reason = "conflicting_run_spec"
	ReasonDuplicateJobID       Reason = "duplicate_job_id"
	ReasonUnsatisfiable        Reason = "unsatisfiable"
	ReasonInvalidRequest       Reason = "invalid_request" // several field errors of different kinds
	ReasonUnknownJob           Reason = "unknown_job"
	ReasonAlreadyTerminal      Reason = "already_terminal"
	ReasonMissingMsgID         Reason = "missing_msg_id"
	ReasonInvalidCancelRequest Reason = "invalid_cancel_request"
)

// API answer reasons: the Reason of a gateway error body that is not about
// the request's content.
const (
	ReasonNotFound         Reason = "not_found"          // no such path
	ReasonMethodNotAllowed Reason = "method_not_allowed" // path exists, method does not
	ReasonUnavailable      Reason = "unavailable"        // the bus is unreachable or the read model not ready; retry
	ReasonInternal         Reason = "internal_error"     // a bug: the gateway recovered from it
	// ReasonNotRunning: the operation needs a running job (checkpoint).
	ReasonNotRunning Reason = "not_running"
	// ReasonNotCheckpointable: the job did not declare run.checkpoint.
	ReasonNotCheckpointable Reason = "not_checkpointable"
	// ReasonUnknownNode: no node agent has published an inventory under
	// this ID (the same code as RefusedUnknownNode).
	ReasonUnknownNode Reason = "unknown_node"
	// ReasonNotSimulated: faults are injected only into simulated nodes.
	ReasonNotSimulated Reason = "not_simulated"
)

// Authentication and authorization reasons: the Reason of a 401 or 403. A
// refused login or token never says whether the user exists.
const (
	// ReasonUnauthenticated: no credentials (no Authorization: Bearer).
	ReasonUnauthenticated Reason = "unauthenticated"
	// ReasonInvalidToken: the token is malformed, unknown or revoked.
	ReasonInvalidToken Reason = "invalid_token"
	// ReasonTokenExpired: the token's exp (or session expiry) has passed.
	ReasonTokenExpired Reason = "token_expired"
	// ReasonTokenNotYetValid: the token's nbf is in the future.
	ReasonTokenNotYetValid Reason = "token_not_yet_valid"
	// ReasonWrongAudience: the token was issued for another client.
	ReasonWrongAudience Reason = "wrong_audience"
	// ReasonWrongIssuer: the token was issued by another provider.
	ReasonWrongIssuer Reason = "wrong_issuer"
	// ReasonBadSignature: the signature does not verify against the
	// issuer's keys.
	ReasonBadSignature Reason = "bad_signature"
	// ReasonUnsupportedAlg: the token is unsigned (alg none) or signed
	// with an algorithm the gateway does not accept.
	ReasonUnsupportedAlg Reason = "unsupported_alg"
	// ReasonLoginFailed: a user name and password were refused; the same
	// for an unknown user and a wrong password.
	ReasonLoginFailed Reason = "login_failed"
	// ReasonMethodDisabled: the login method is not configured here.
	ReasonMethodDisabled Reason = "login_method_disabled"
	// ReasonForbidden: authenticated, but no role binding allows this
	// operation on this tenant.
	ReasonForbidden Reason = "forbidden"
	// ReasonAboveGrant: a tenant admin's quota exceeds what the platform
	// granted the tenant.
	ReasonAboveGrant Reason = "above_platform_grant"
)

// Reservation and admission reasons (FLOWS.md, "Scheduling").
const (
	// ReasonRunTimeExceeded: the job used capacity held for a backfill
	// reservation on its promise (expectedRunTime, or run.duration) to end
	// before the reservation starts, ran past it, and was stopped
	// (checkpointed first when it can) and requeued when the reservation
	// came due.
	ReasonRunTimeExceeded Reason = "expected_run_time_exceeded"
	// ReasonShareTooLarge: a share asks for more framebuffer (or memory per
	// GPU) than any card of the fleet that the request may use has.
	ReasonShareTooLarge Reason = "share_larger_than_any_gpu"
	// ReasonDependencyRejected: dependsOn names a job whose request was
	// rejected: it will never run.
	ReasonDependencyRejected Reason = "dependency_rejected"
)

// Pending reasons: why a queued job is not placed yet.
const (
	PendingNoNodes          Reason = "no_nodes"
	PendingNoMatchingModel  Reason = "no_matching_gpu_model"
	PendingInsufficientGPUs Reason = "insufficient_free_gpus"
	PendingQueuedBehind     Reason = "queued_behind_higher_priority"
	PendingPlanInFlight     Reason = "plan_in_flight"
	PendingCommitRefused    Reason = "commit_refused"
)

// Refusal reasons: why the resource manager refused a plan item.
const (
	RefusedUnknownNode   Reason = "unknown_node"
	RefusedNodeNotReady  Reason = "node_not_ready"
	RefusedUnknownDevice Reason = "unknown_device"
	RefusedDeviceTaken   Reason = "device_taken"
	// RefusedDeviceUnhealthy: the node's latest inventory marks the GPU
	// unhealthy.
	RefusedDeviceUnhealthy Reason = "device_unhealthy"
	RefusedAlreadyPlaced   Reason = "job_already_allocated"
	RefusedStaleEpoch      Reason = "stale_epoch"
	RefusedInvalidPlan     Reason = "invalid_plan"
	RefusedModelMismatch   Reason = "gpu_model_mismatch"
	RefusedCommitConflict  Reason = "commit_conflict"
	// RefusedPlanExpired: the plan is older than PlansMaxAge (by the
	// ledger's clock) and the item is not committed: the resource manager
	// no longer remembers every allocation that ended since the plan was
	// made, so committing it could run an ended attempt again. The
	// scheduler places the job anew.
	RefusedPlanExpired Reason = "plan_expired"
	// RefusedMIGDisabled: a MIG instance was asked of a GPU whose latest
	// inventory has MIG mode off.
	RefusedMIGDisabled Reason = "mig_disabled"
	// RefusedMIGEnabled: a whole GPU or a share was asked of a GPU in MIG
	// mode; its capacity is its MIG instances.
	RefusedMIGEnabled Reason = "mig_enabled"
	// RefusedMIGInstanceUnknown: the GPU's latest inventory lists no MIG
	// instance with that UUID, or lists it with another profile or
	// placement.
	RefusedMIGInstanceUnknown Reason = "mig_instance_unknown"
	// RefusedMIGInstanceTaken: the MIG instance is held by a live
	// allocation.
	RefusedMIGInstanceTaken Reason = "mig_instance_taken"
	// RefusedMIGInventoryInvalid: the GPU's reported MIG instances break the
	// model's placement rules (or MIG mode is off yet instances are
	// listed); nothing is placed on the GPU until the agent reports a
	// consistent state.
	RefusedMIGInventoryInvalid Reason = "mig_inventory_invalid"
	// RefusedGPUShared: a whole GPU was asked for, but part of it (a share
	// or a MIG instance) is held by a live allocation.
	RefusedGPUShared Reason = "gpu_shared"
	// RefusedShareExceedsGPU: the share, added to the shares already held,
	// would pass the GPU's memory or 100% of its compute.
	RefusedShareExceedsGPU Reason = "share_exceeds_gpu"
	// RefusedHostCapacity: the allocation's host CPU or memory, added to
	// what the node's live allocations hold, passes the node's inventory.
	RefusedHostCapacity Reason = "host_capacity"
)

// Release, stop and failure reasons.
const (
	ReasonRunEnded      Reason = "run_ended"
	ReasonCancelled     Reason = "cancelled_by_user"
	ReasonNodeLost      Reason = "node_lost"
	ReasonExitNonZero   Reason = "exit_non_zero"
	ReasonLaunchFailed  Reason = "launch_failed"
	ReasonAgentRestart  Reason = "agent_restarted"
	ReasonStopRequested Reason = "stop_requested"
)

// FieldError is one machine-readable problem with one field of a message.
// Field is a JSON path such as "resources.gpu.count".
type FieldError struct {
	Field   string `json:"field"`
	Reason  Reason `json:"reason"`
	Message string `json:"message"`
}

func (f FieldError) Error() string {
	if f.Field == "" {
		return fmt.Sprintf("%s: %s", f.Reason, f.Message)
	}
	return fmt.Sprintf("%s: %s: %s", f.Field, f.Reason, f.Message)
}

// ValidationError is the error Validate and Decode functions return. Reason
// summarises: the single reason when all field errors share it, otherwise
// ReasonInvalidRequest.
type ValidationError struct {
	Reason Reason       `json:"reason"`
	Fields []FieldError `json:"fields"`
}

func (v *ValidationError) Error() string {
	msgs := make([]string, 0, len(v.Fields))
	for _, f := range v.Fields {
		msgs = append(msgs, f.Error())
	}
	return fmt.Sprintf("%s: %s", v.Reason, strings.Join(msgs, "; "))
}

// newValidationError builds a ValidationError from field errors, or returns
// nil when there are none.
func newValidationError(fields []FieldError) error {
	if len(fields) == 0 {
		return nil
	}
	reason := fields[0].Reason
	for _, f := range fields[1:] {
		if f.Reason != reason {
			reason = ReasonInvalidRequest
			break
		}
	}
	return &ValidationError{Reason: reason, Fields: fields}
}
