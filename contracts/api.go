package contracts

import (
	"errors"
	"time"
)

// The gateway's REST API (JSON over HTTP). Paths:
//
//	POST   /v1/tenants/{tenant}/jobs              JobRequest -> 202 SubmitResponse
//	GET    /v1/tenants/{tenant}/jobs              -> 200 JobList (?state=queued&limit=100)
//	GET    /v1/tenants/{tenant}/jobs/{id}         -> 200 JobStatus
//	DELETE /v1/tenants/{tenant}/jobs/{id}         -> 202 SubmitResponse (cancel requested)
//	GET    /v1/tenants/{tenant}/jobs/{id}/events  -> text/event-stream of JobEvent, history first
//	GET    /v1/tenants/{tenant}/events            -> text/event-stream of the tenant's JobEvents
//	GET    /v1/tenants/{tenant}/usage             -> 200 UsageSummary
//	GET    /v1/tenants/{tenant}/jobs/{id}/logs    -> 200 text/plain run output (?attempt=N|all, ?rank=N, ?follow=true)
//	POST   /v1/tenants/{tenant}/jobs/{id}/checkpoint -> 202 CheckpointResponse (409 not_running)
//	GET    /v1/nodes                              -> 200 NodeList (?pool=)
//	GET    /v1/nodes/{node}                       -> 200 NodeStatus
//	POST   /v1/nodes/{node}/faults                FaultRequest -> 202 FaultResponse (admin)
//	GET    /v1/pricebook, PUT /v1/pricebook, GET|PUT|DELETE /v1/tenants/{tenant}/budget,
//	GET    /v1/tenants/{tenant}/invoice?period=   -> billing (types in invoice.go)
//	GET    /healthz                               -> 200 when the bus is connected
//
// Errors are an APIError body with a 4xx/5xx status. The types of the logs,
// checkpoint, node and fault endpoints are in apiops.go.
//
// Every body is JSON, held to its published schema (schema/*.json) as
// strictly as the bus holds it: a body declared as anything but
// application/json is 415 unsupported_media_type (one declared as nothing
// is read as JSON), and a body that is not a JSON object is 400
// invalid_type. A stored document (price book, budget, quota, pool) that
// does not decode is 409 unreadable_document on GET, naming the revision
// that a PUT (?revision=N) replaces; an unreadable node hold shows as a
// cordon with cause unreadable_document until a hold change replaces it.

// APIError is the body of every error answer of the gateway.
type APIError struct {
	Error APIErrorBody `json:"error"`
}

// APIErrorBody says what went wrong, machine-readably.
type APIErrorBody struct {
	Reason  Reason       `json:"reason"`
	Message string       `json:"message"`
	Fields  []FieldError `json:"fields,omitempty"`
}

// SubmitResponse answers an accepted submit or cancel: the request is on
// the bus; its outcome arrives as JobEvents.
type SubmitResponse struct {
	Tenant    string `json:"tenant"`
	JobID     string `json:"jobId"`
	Stream    string `json:"stream"`
	Sequence  uint64 `json:"sequence"`
	Duplicate bool   `json:"duplicate"`
}

// JobStatus is the read model of one job, folded from its JobEvents.
type JobStatus struct {
	Tenant    string       `json:"tenant"`
	JobID     string       `json:"jobId"`
	Name      string       `json:"name,omitempty"`
	State     JobState     `json:"state"`
	Attempt   int          `json:"attempt"`
	Reason    Reason       `json:"reason,omitempty"`
	Message   string       `json:"message,omitempty"`
	Errors    []FieldError `json:"errors,omitempty"`
	Request   *JobRequest  `json:"request,omitempty"`
	Placement *Placement   `json:"placement,omitempty"`
	// Placements lists every machine of a multi-machine job, by rank.
	Placements []Placement `json:"placements,omitempty"`
	ExitCode   *int        `json:"exitCode,omitempty"`
	CreatedAt  time.Time   `json:"createdAt"`
	UpdatedAt  time.Time   `json:"updatedAt"`
	StartedAt  *time.Time  `json:"startedAt,omitempty"`
	EndedAt    *time.Time  `json:"endedAt,omitempty"`
	// Migration is the job's latest move (migrating: under way;
	// migrated: done); Migrations counts the moves completed.
	Migration  *Migration `json:"migration,omitempty"`
	Migrations int        `json:"migrations,omitempty"`
	// Pull is how far the pull of the run's image has come, while the
	// job is scheduled and its image is pulled (pulling events).
	Pull *PullProgress `json:"pull,omitempty"`
	// LastSeq is the JOB_EVENTS sequence of the last event applied.
	LastSeq uint64 `json:"lastSeq"`
}

// ErrStaleEvent is returned (wrapped) by Apply for an event already applied.
var ErrStaleEvent = errors.New("event already applied")

// Apply folds one event (at stream sequence seq) into the status. It is
// idempotent: an event at or below LastSeq is refused with ErrStaleEvent,
// and one the state machine forbids with ErrTransition; the status is then
// unchanged.
func (s *JobStatus) Apply(ev JobEvent, seq uint64) error {
	if seq != 0 && seq <= s.LastSeq {
		return ErrStaleEvent
	}
	to, err := Transition(s.State, ev.Type)
	if err != nil {
		return err
	}
	if s.State == StateNew {
		s.Tenant, s.JobID, s.CreatedAt = ev.Tenant, ev.JobID, ev.Time
	}
	s.State, s.Attempt, s.UpdatedAt, s.LastSeq = to, ev.Attempt, ev.Time, seq
	s.Reason, s.Message = ev.Reason, ev.Message
	if ev.Request != nil {
		s.Request = ev.Request
		s.Name = ev.Request.Name
	}
	if ev.Errors != nil {
		s.Errors = ev.Errors
	}
	if ev.Type == EventRequeued {
		s.Placement, s.Placements, s.StartedAt, s.EndedAt, s.ExitCode = nil, nil, nil, nil, nil
	}
	if ev.Placement != nil {
		s.Placement = ev.Placement
	}
	if ev.Placements != nil {
		s.Placements = ev.Placements
	}
	if ev.ExitCode != nil {
		s.ExitCode = ev.ExitCode
	}
	if ev.StartedAt != nil {
		s.StartedAt = ev.StartedAt
	}
	if ev.EndedAt != nil {
		s.EndedAt = ev.EndedAt
	}
	if ev.Migration != nil {
		s.Migration = ev.Migration
	}
	if ev.Type == EventMigrated {
		s.Migrations++
	}
	switch {
	case ev.Type == EventPulling && ev.Pull != nil:
		s.Pull = ev.Pull
	case ev.Type != EventPulling:
		s.Pull = nil // the pull is over (running), or the attempt is
	}
	return nil
}

// JobList is a page of job statuses.
type JobList struct {
	Jobs []JobStatus `json:"jobs"`
}

// UsageSummary is a tenant's metered usage.
type UsageSummary struct {
	Tenant     string        `json:"tenant"`
	GPUSeconds float64       `json:"gpuSeconds"`
	GPUMillis  int64         `json:"gpuMillis"`
	Records    int           `json:"records"`
	ByJob      []UsageRecord `json:"byJob"`
	// CostMicros sums the records' costs (micro-units of Currency) and
	// OnDemandCostMicros the same usage at on-demand rates.
	CostMicros         int64  `json:"costMicros"`
	OnDemandCostMicros int64  `json:"onDemandCostMicros"`
	Currency           string `json:"currency,omitempty"`
}
