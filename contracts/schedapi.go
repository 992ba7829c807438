package contracts

import (
	"bytes"
	"fmt"
	"time"
	"unicode/utf8"
)

// The gateway's scheduling administration and describe endpoints (the
// other paths are listed in api.go). Quotas, pool settings and node holds
// are KV documents (BucketQuotas, BucketPools, BucketNodeAdmin) written
// with the same validation the scheduler applies when it reads them.
//
//	GET    /v1/quotas                      -> 200 QuotaList (every tenant with a quota)
//	GET    /v1/quotas/{tenant}             -> 200 QuotaDoc (Quota nil: none)
//	PUT    /v1/quotas/{tenant}             TenantQuota -> 200 QuotaDoc
//	DELETE /v1/quotas/{tenant}             -> 200 QuotaDoc without Quota
//	GET    /v1/pools                       -> 200 PoolList (configured pools and pools of known nodes)
//	GET    /v1/pools/{pool}                -> 200 PoolDoc (Config nil: the scheduler's default)
//	PUT    /v1/pools/{pool}                PoolConfig -> 200 PoolDoc
//	POST   /v1/nodes/{node}/cordon         NodeAdminRequest (optional) -> 200 NodeStatus
//	POST   /v1/nodes/{node}/drain          NodeAdminRequest (optional) -> 200 NodeStatus
//	POST   /v1/nodes/{node}/uncordon       -> 200 NodeStatus (lifts every hold of the node, its GPUs' too)
//	POST   /v1/nodes/{node}/gpus/{uuid}/cordon    NodeAdminRequest (optional) -> 200 NodeStatus
//	POST   /v1/nodes/{node}/gpus/{uuid}/drain     NodeAdminRequest (optional) -> 200 NodeStatus
//	POST   /v1/nodes/{node}/gpus/{uuid}/uncordon  -> 200 NodeStatus (lifts that GPU's hold only; 404 unknown_device, unknown_node)
//	GET    /v1/tenants/{tenant}/jobs/{id}/describe -> 200 JobDescription
//
// A PUT with ?revision=N replaces the document only if it is still at
// revision N (0: only if there is none); otherwise 409 conflict.

// QuotaDoc is a tenant's quota as stored, with its KV revision.
type QuotaDoc struct {
	Tenant string `json:"tenant"`
	// Quota is nil when the tenant has none: no bound, weight 1.
	Quota    *TenantQuota `json:"quota,omitempty"`
	Revision uint64       `json:"revision,omitempty"`
}

// QuotaList is every stored quota, ordered by tenant.
type QuotaList struct {
	Quotas []QuotaDoc `json:"quotas"`
}

// PoolDoc is a pool's settings as stored, with its KV revision.
type PoolDoc struct {
	Pool string `json:"pool"`
	// Config is nil when no administrator configured the pool: the
	// scheduler's defaults apply.
	Config   *PoolConfig `json:"config,omitempty"`
	Revision uint64      `json:"revision,omitempty"`
	// Nodes counts the nodes of the pool the gateway knows.
	Nodes int `json:"nodes"`
}

// PoolList is every pool that is configured or has nodes, ordered by name.
type PoolList struct {
	Pools []PoolDoc `json:"pools"`
}

// MaxAdminReason bounds the reason an administrator gives a node hold.
const MaxAdminReason = 1024

// NodeAdminRequest is the optional body of a cordon, drain or uncordon.
type NodeAdminRequest struct {
	Reason string `json:"reason,omitempty"`
}

// DecodeTenantQuota decodes and validates a quota document for tenant
// (JSON, no unknown fields) and fills in its schema version and tenant.
func DecodeTenantQuota(data []byte, tenant string) (TenantQuota, error) {
	var q TenantQuota
	if err := decodeValidated(data, &q, func() error { return q.Validate(tenant) }); err != nil {
		return q, err
	}
	q.SchemaVersion, q.Tenant = SchemaVersion, tenant
	return q, nil
}

// DecodePoolConfig decodes and validates a pool configuration for pool
// and fills in its schema version and pool.
func DecodePoolConfig(data []byte, pool string) (PoolConfig, error) {
	var c PoolConfig
	if err := decodeValidated(data, &c, func() error { return c.Validate(pool) }); err != nil {
		return c, err
	}
	c.SchemaVersion, c.Pool = SchemaVersion, pool
	return c, nil
}

// DecodeNodeAdminRequest decodes a cordon, drain or uncordon body; an
// empty body is a request without a reason.
func DecodeNodeAdminRequest(data []byte) (NodeAdminRequest, error) {
	var r NodeAdminRequest
	if len(bytes.TrimSpace(data)) == 0 {
		return r, nil
	}
	err := decodeValidated(data, &r, func() error {
		if n := utf8.RuneCountInString(r.Reason); n > MaxAdminReason { // characters, as the schema counts
			return newValidationError([]FieldError{{Field: "reason", Reason: ReasonOutOfRange,
				Message: fmt.Sprintf("reason is %d characters, limit is %d", n, MaxAdminReason)}})
		}
		return nil
	})
	return r, err
}

// MaxDescribeEvents bounds the events a JobDescription lists: the latest
// ones are kept.
const MaxDescribeEvents = 200

// JobDescription is everything the platform can say about one job, folded
// from its JobEvents: what it asked for, where it is, why it waits, and
// its history. `gpuctl describe` prints it.
type JobDescription struct {
	Tenant  string   `json:"tenant"`
	JobID   string   `json:"jobId"`
	Name    string   `json:"name,omitempty"`
	State   JobState `json:"state"`
	Attempt int      `json:"attempt"`
	// Pending is why a queued job is not placed: the latest pending event
	// of its current attempt. Nil unless the job is queued and the
	// scheduler said why.
	Pending *PendingStatus `json:"pending,omitempty"`
	// Reason and Message are the latest event's (a terminal job's why).
	Reason  Reason       `json:"reason,omitempty"`
	Message string       `json:"message,omitempty"`
	Errors  []FieldError `json:"errors,omitempty"`
	// Request is the normalized request.
	Request   *JobRequest `json:"request,omitempty"`
	DependsOn []string    `json:"dependsOn,omitempty"`
	// Placements is where the current attempt runs, one per machine, by
	// rank; empty until it is scheduled.
	Placements []Placement `json:"placements,omitempty"`
	ExitCode   *int        `json:"exitCode,omitempty"`
	CreatedAt  time.Time   `json:"createdAt"`
	UpdatedAt  time.Time   `json:"updatedAt"`
	StartedAt  *time.Time  `json:"startedAt,omitempty"`
	EndedAt    *time.Time  `json:"endedAt,omitempty"`
	// Events is the job's history, oldest first: the latest
	// MaxDescribeEvents; EventsOmitted counts the older ones left out.
	Events        []EventSummary `json:"events"`
	EventsOmitted int            `json:"eventsOmitted,omitempty"`
}

// PendingStatus is why a queued job waits.
type PendingStatus struct {
	Reason  Reason `json:"reason"`
	Message string `json:"message,omitempty"`
	// Since is when the scheduler first gave this reason in a row (the
	// message may have changed since).
	Since time.Time `json:"since"`
}

// EventSummary is one event of a job's history.
type EventSummary struct {
	Seq     uint64       `json:"seq"`
	Type    JobEventType `json:"type"`
	Attempt int          `json:"attempt"`
	Time    time.Time    `json:"time"`
	Reason  Reason       `json:"reason,omitempty"`
	Message string       `json:"message,omitempty"`
}
