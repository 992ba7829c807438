package contracts

import (
	"fmt"
	"strconv"
	"time"
)

// JobState is where a job is in its life. See the package comment for the
// state machine.
type JobState string

const (
	StateNew       JobState = "" // before the first event
	StateQueued    JobState = "queued"
	StateScheduled JobState = "scheduled"
	StateRunning   JobState = "running"
	StateSucceeded JobState = "succeeded"
	StateFailed    JobState = "failed"
	StateCancelled JobState = "cancelled"
	StateRejected  JobState = "rejected"
)

// Terminal reports whether no event can leave s.
func (s JobState) Terminal() bool {
	switch s {
	case StateSucceeded, StateFailed, StateCancelled, StateRejected:
		return true
	}
	return false
}

// JobEventType names what happened to a job.
type JobEventType string

const (
	EventQueued    JobEventType = "queued"
	EventRejected  JobEventType = "rejected"
	EventPending   JobEventType = "pending"
	EventScheduled JobEventType = "scheduled"
	EventRunning   JobEventType = "running"
	EventSucceeded JobEventType = "succeeded"
	EventFailed    JobEventType = "failed"
	EventCancelled JobEventType = "cancelled"
	EventRequeued  JobEventType = "requeued"
	// EventMigrating: the platform is moving the job off its devices for
	// Reason (spot interruption, unhealthy or hot GPU, drain,
	// defragmentation); Migration says how. The state does not change: the
	// run goes on until it has checkpointed (or the checkpoint timed out),
	// then it is stopped, released and requeued as the next attempt.
	EventMigrating JobEventType = "migrating"
	// EventMigrated: the next attempt of a migrating job runs on its new
	// devices; Migration names where it came from and the checkpoint it
	// restored (none: it restarted).
	EventMigrated JobEventType = "migrated"
	// EventPulling: the node agent is pulling the image of a scheduled
	// container run; Pull says how far it has come. The state does not
	// change.
	EventPulling JobEventType = "pulling"
)

// JobEventTypes lists every event type, for schema generation and docs.
var JobEventTypes = []JobEventType{EventQueued, EventRejected, EventPending, EventScheduled,
	EventRunning, EventSucceeded, EventFailed, EventCancelled, EventRequeued, EventMigrating, EventMigrated, EventPulling}

// transitions is the state machine of the package comment: from state, on
// event, to state.
var transitions = map[JobState]map[JobEventType]JobState{
	StateNew: {
		EventQueued:   StateQueued,
		EventRejected: StateRejected,
	},
	StateQueued: {
		EventPending: StateQueued,
		// A gang whose parts were committed only in part is retried as a
		// new attempt without ever having been scheduled.
		EventRequeued:  StateQueued,
		EventScheduled: StateScheduled,
		EventCancelled: StateCancelled,
		EventFailed:    StateFailed,
	},
	StateScheduled: {
		EventMigrating: StateScheduled,
		EventPulling:   StateScheduled,
		EventRunning:   StateRunning,
		EventRequeued:  StateQueued,
		EventCancelled: StateCancelled,
		EventFailed:    StateFailed,
	},
	StateRunning: {
		EventMigrating: StateRunning,
		EventMigrated:  StateRunning,
		EventSucceeded: StateSucceeded,
		EventFailed:    StateFailed,
		EventCancelled: StateCancelled,
		EventRequeued:  StateQueued,
	},
}

// ErrTransition is returned (wrapped) by Transition for a refused event.
var ErrTransition = fmt.Errorf("transition not allowed")

// AnswersDuplicate reports whether e answers a request that reused a known
// job's ID with another body (a rejected event, reason duplicate_job_id).
// It is published on that job's subject but is never a job's first event:
// a reader that does not hold the job (it forgot it, or dropped it from a
// list) must make no job of it. Every reader's Transition refuses it on a
// job it holds.
func (e JobEvent) AnswersDuplicate() bool {
	return e.Type == EventRejected && e.Reason == ReasonDuplicateJobID
}

// Transition returns the state a job in state from reaches on event ev, or
// an error wrapping ErrTransition when the state machine forbids it.
func Transition(from JobState, ev JobEventType) (JobState, error) {
	if to, ok := transitions[from][ev]; ok {
		return to, nil
	}
	name := string(from)
	if from == StateNew {
		name = "new"
	}
	return from, fmt.Errorf("%w: %s on %s", ErrTransition, ev, name)
}

// JobEvent is a fact about one job, published by the scheduler on
// SubjectJobEvents(tenant, jobID). Fields beyond the common ones are set
// only by the event types named in their comments.
type JobEvent struct {
	SchemaVersion int          `json:"schemaVersion"`
	Type          JobEventType `json:"type"`
	Tenant        string       `json:"tenant"`
	JobID         string       `json:"jobId"`
	// Attempt counts placements: 1 for the first, +1 on each requeue.
	Attempt int       `json:"attempt"`
	State   JobState  `json:"state"`
	Time    time.Time `json:"time"`
	// Reason is a machine-readable code (rejected, pending, failed,
	// cancelled, requeued); Message says it for people.
	Reason  Reason `json:"reason,omitempty"`
	Message string `json:"message,omitempty"`
	// Errors lists every field problem of a rejected request.
	Errors []FieldError `json:"errors,omitempty"`
	// Request is the normalized request (queued).
	Request *JobRequest `json:"request,omitempty"`
	// SubmitSeq is the JOBS stream sequence of the request (queued): the
	// platform's arrival order, which FIFO within a priority class follows.
	SubmitSeq uint64 `json:"submitSeq,omitempty"`
	// Placement is where the job runs (scheduled, running).
	Placement *Placement `json:"placement,omitempty"`
	// Placements is every part of a multi-machine job, by rank
	// (scheduled, running).
	Placements []Placement `json:"placements,omitempty"`
	// ExitCode of the run (succeeded, failed).
	ExitCode *int `json:"exitCode,omitempty"`
	// StartedAt and EndedAt are the run's times as the agent saw them
	// (running: StartedAt; terminal: both).
	StartedAt *time.Time `json:"startedAt,omitempty"`
	EndedAt   *time.Time `json:"endedAt,omitempty"`
	// Migration describes a move (migrating, migrated).
	Migration *Migration `json:"migration,omitempty"`
	// Pull is how far the pull of the run's image has come (pulling).
	Pull *PullProgress `json:"pull,omitempty"`
}

// Migration is how a job is moved: on migrating, the plan (checkpoint
// first or restart, and by when); on migrated, where from and what the new
// attempt restored.
type Migration struct {
	// Reason is why: spot_interruption, gpu_unhealthy, overheating,
	// node_drained or defragment.
	Reason Reason `json:"reason"`
	// FromAttempt is the attempt that was moved; From its placements.
	FromAttempt int         `json:"fromAttempt"`
	From        []Placement `json:"from,omitempty"`
	// Checkpoint is true when the run is asked to checkpoint before it is
	// stopped (it declared run.checkpoint and has started); false: it is
	// stopped at once and its next attempt restores its last checkpoint
	// written on its own, or restarts.
	Checkpoint bool `json:"checkpoint"`
	// Deadline is when the devices go away (a spot machine's reclaim);
	// the checkpoint wait ends before it.
	Deadline *time.Time `json:"deadline,omitempty"`
	// TriggeredAt is when the fact that caused the move was recorded
	// (notice, alert, inventory), for reaction times.
	TriggeredAt *time.Time `json:"triggeredAt,omitempty"`
	// RestoredFrom (migrated) is the checkpoint the new attempt was given
	// in GPUPLANE_RESTORE_FROM, as the scheduler last saw it reported;
	// empty when it restarted.
	RestoredFrom string `json:"restoredFrom,omitempty"`
	// Checkpointed (migrated) is true when the moved run wrote a
	// checkpoint at the platform's request before it stopped.
	Checkpointed bool `json:"checkpointed,omitempty"`
	// KeepOff (migrating, defragment) are the nodes the move frees for
	// another job: the next attempt stays off them until it commits.
	KeepOff []string `json:"keepOff,omitempty"`
}

// Placement is where an allocation put a job.
type Placement struct {
	AllocationID string      `json:"allocationId"`
	NodeID       string      `json:"nodeId"`
	Pool         string      `json:"pool"`
	Devices      []DeviceRef `json:"devices"`
}

// JobEventID is the deterministic event ID (and Nats-Msg-Id) of a job
// event. Pending events carry a sequence (the reason's ordinal) so a changed
// reason is a new event while a repeated one is a duplicate.
func JobEventID(tenant, jobID string, typ JobEventType, attempt int, seq int) string {
	id := "job/" + tenant + "/" + jobID + "/" + string(typ) + "/" + strconv.Itoa(attempt)
	if seq > 0 {
		id += "/" + strconv.Itoa(seq)
	}
	return id
}

// CloudEvents type of a job event.
func (e JobEvent) CEType() string { return "io.gpuplane.job." + string(e.Type) + ".v1" }
