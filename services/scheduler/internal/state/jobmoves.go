package state

import (
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// jobMoves is what only a job being moved (preempted, drained, reclaimed,
// consolidated), preempting others, waiting on a preemption or running on
// a backfill promise has. Most jobs, queued or running, never do: kept in
// the Job itself these fields were ~150 of its ~550 bytes, for each of a
// million jobs. A Job points to one (Job.mv) only while some field is set.
type jobMoves struct {
	// evictMsg is the message of Job.evict.
	evictMsg string
	// evictBy is when the devices go away (a spot reclaim); zero when
	// they stay. evictAt is when the move was decided: a checkpoint asked
	// for then is waited for until CheckpointTimeout (or evictBy) passes.
	evictBy, evictAt time.Time
	// migration is the current attempt's move, once its migrating event
	// was published; moved is the last move, kept until an attempt runs
	// again and migrated is published.
	migration, moved *contracts.Migration
	// avoid are nodes the next attempt must not use, until a part of it
	// commits: a job moved to consolidate capacity stays off the nodes it
	// freed, also when a plan for it is refused and retried.
	avoid map[string]bool
	// note says when preemption will make room for it (waitnote.go);
	// appended to its capacity reasons until a later search says otherwise.
	note string
	// promise is set when the current attempt took devices held for a
	// backfill reservation on its expected run time: it is stopped if it
	// runs past it into the reservation (reserve.go).
	promise *promise
	// victims are the allocations this one preempted, until the ledger
	// releases them: it waits for their devices rather than choosing
	// more victims (what it takes is claimed for it meanwhile: claims).
	victims []string
	// kept is, for a preemption victim, the work the decision that chose
	// it kept: its next attempts do not evict that by priority while the
	// preemptor holds what it took (admin.go). Nil for most jobs.
	kept *kept
}

// noMoves is what moves reads for a job without any: never written.
var noMoves jobMoves

// moves is j's, for reading only (a shared zero value when it has none).
func (j *Job) moves() *jobMoves {
	if j.mv == nil {
		return &noMoves
	}
	return j.mv
}

// movesW is j's, made when it has none, for changing.
func (j *Job) movesW() *jobMoves {
	if j.mv == nil {
		j.mv = &jobMoves{}
	}
	return j.mv
}

// endAttemptMoves forgets what belonged to j's current attempt (a new one
// begins): the last move, the nodes to avoid and the work a preemption
// kept from it stay until they have served, the rest goes, and so does
// the whole record when nothing is left.
func (j *Job) endAttemptMoves() {
	m := j.mv
	if m == nil {
		return
	}
	m.evictMsg, m.victims, m.promise, m.note = "", nil, nil, ""
	m.evictBy, m.evictAt, m.migration = time.Time{}, time.Time{}, nil
	if m.moved == nil && m.avoid == nil && m.kept == nil {
		j.mv = nil
	}
}

// tidyMoves drops j's record once every field of it is back to zero (a
// move published, the nodes to avoid or the kept work served, the
// victims gone): moves() then reads the same zeros, and a job that was
// moved once does not keep ~150 bytes for the rest of its attempt.
func (j *Job) tidyMoves() {
	m := j.mv
	if m != nil && m.evictMsg == "" && m.evictBy.IsZero() && m.evictAt.IsZero() && m.migration == nil &&
		m.moved == nil && len(m.avoid) == 0 && m.note == "" && m.promise == nil && len(m.victims) == 0 && m.kept == nil {
		j.mv = nil
	}
}

// stamp is a wall-clock time in Unix nanoseconds, 0 for the zero time: 8
// bytes where a time.Time takes 24, for times a job keeps that carry no
// monotonic reading (taken in UTC or read from an event).
type stamp int64

func stampOf(t time.Time) stamp {
	if t.IsZero() {
		return 0
	}
	if ns := t.UnixNano(); ns != 0 {
		return stamp(ns)
	}
	// The Unix epoch itself (a clock or an event at 1970-01-01): 1 ns
	// later, since 0 says "unknown" and an unknown queue time never
	// times out.
	return 1
}

// queued is when j was queued (zero when unknown).
func (j *Job) queued() time.Time {
	if j.queuedAt == 0 {
		return time.Time{}
	}
	return time.Unix(0, int64(j.queuedAt)).UTC()
}
