package state

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// Migration (FLOWS.md, "Migration"): a job moved for its devices' sake
// (a spot reclaim, an unhealthy or hot GPU, a drain, defragmentation) is
// announced with migrating, asked to checkpoint when it can, stopped once
// the checkpoint is reported (or the wait timed out, or its deadline
// nears), released, requeued as its next attempt, and announced with
// migrated when that attempt runs, restoring the last checkpoint. A
// preemption victim follows the same checkpoint-first stop without the
// migrating and migrated events: it is not moved for its own sake, it
// waits in the queue.

// deadlineMargin is kept between a stop's end (checkpoint wait and grace)
// and a deadline: the agent needs a moment to report the end before its
// machine goes.
const deadlineMargin = 5 * time.Second

// migrates reports whether r moves a job for its devices' sake.
func migrates(r contracts.Reason) bool {
	switch r {
	case contracts.ReasonSpotInterruption, contracts.ReasonGPUUnhealthy, contracts.ReasonOverheating,
		contracts.ReasonDrained, contracts.ReasonDefragment:
		return true
	}
	return false
}

// move is one decision to move a job's current attempt.
type move struct {
	reason    contracts.Reason
	msg       string
	deadline  time.Time // zero: the devices stay
	triggered time.Time // when the fact that caused it was recorded
}

// evictJob starts moving j's current attempt, unless it is already being
// moved or stopped: the first reason wins.
func (s *Store) evictJob(j *Job, m move) {
	if j.evict != "" || j.cancel || j.State.Terminal() {
		return
	}
	j.evict, j.evictMsg, j.evictBy, j.evictAt = m.reason, m.msg, m.deadline, s.cfg.Now()
	s.evicting[j.key] = j
	if migrates(m.reason) && (j.State == contracts.StateRunning || j.State == contracts.StateScheduled) {
		mig := contracts.Migration{Reason: m.reason, FromAttempt: j.Attempt, From: placementsOf(j),
			Checkpoint: s.checkpointable(j), KeepOff: slices.Sorted(maps.Keys(j.avoid))}
		if !m.deadline.IsZero() {
			d := m.deadline.UTC()
			mig.Deadline = &d
		}
		if !m.triggered.IsZero() {
			t := m.triggered.UTC()
			mig.TriggeredAt = &t
		}
		plan := "it is stopped now and restarts"
		if j.lastCheckpoint != "" {
			plan = "it is stopped now and restores checkpoint " + j.lastCheckpoint
		}
		if mig.Checkpoint {
			plan = "it is asked to checkpoint, then stopped"
		}
		if s.emit(j, contracts.EventMigrating, 0, func(ev *contracts.JobEvent) {
			ev.Reason, ev.Message, ev.Migration = m.reason, m.msg+"; "+plan, &mig
		}) {
			j.migration = &mig
		}
	}
	s.advance(j)
}

// checkpointable reports whether j's run can be asked for a checkpoint:
// it declared the protocol and a part has started.
func (s *Store) checkpointable(j *Job) bool {
	return j.Request != nil && j.Request.Run.Checkpoint && j.count(func(p *part) bool { return p.started != nil }) > 0
}

// checkpointWait is until when a move waits for the checkpoint it asked
// for: CheckpointTimeout after the decision, ended early enough before a
// deadline to leave the stop's grace and a margin.
func (s *Store) checkpointWait(j *Job) time.Time {
	until := j.evictAt.Add(s.cfg.CheckpointTimeout)
	if !j.evictBy.IsZero() {
		grace := min(s.cfg.PreemptGrace, j.evictBy.Sub(j.evictAt)/2)
		until = minTime(until, j.evictBy.Add(-grace-deadlineMargin))
	}
	return until
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// stopParts stops every live part of j for reason. A move (preemption,
// migration) of a checkpointable job first asks each started part for a
// checkpoint and stops the parts only when every one reported it, or when
// the wait runs out: SIGTERM right after SIGUSR1 would cut the checkpoint
// short. A gang's parts are stopped together, as its checkpoint is one.
func (s *Store) stopParts(j *Job, reason contracts.Reason) {
	if movedBy(reason) && reason != contracts.ReasonGangIncomplete && s.checkpointable(j) && !j.evictAt.IsZero() {
		now := s.cfg.Now()
		waiting := false
		for _, p := range j.parts {
			if !p.live() || p.stopSent != "" || p.started == nil {
				continue
			}
			a := p.alloc
			// The command's ID is the attempt's: asking twice (a repeat
			// after a restart) is dropped by JetStream.
			cmd := contracts.NodeCommand{SchemaVersion: contracts.SchemaVersion, Kind: contracts.CommandCheckpointRun,
				AllocationID: a.ID, Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, Reason: reason, Time: now.UTC()}
			if !p.askedDone {
				if !p.askedSent {
					s.out = append(s.out, Publish{Subject: contracts.SubjectNodeCommands(a.NodeID), Key: j.key, Msg: cmd,
						ID: contracts.CheckpointCommandID(a.ID, 1000)})
					p.askedSent = true
				}
				waiting = true
			}
		}
		if waiting && now.Before(s.checkpointWait(j)) {
			return // a later fact, or the cycle after the wait ends, stops it
		}
	}
	for _, p := range j.parts {
		if p.live() && p.stopSent == "" {
			s.stop(j, p, reason)
		}
	}
}

// keepMove remembers, as j is requeued, the move its attempt was in, so
// that the next attempt to run announces it (migrated). The requeue's own
// reason may differ (the spot machine was reclaimed before the stop
// landed: node_lost): the job still moved for the migration's reason.
func (s *Store) keepMove(j *Job) {
	if j.migration == nil {
		return
	}
	m := *j.migration
	for _, p := range j.parts {
		if p.askedDone {
			m.Checkpointed = true
		}
	}
	j.moved = &m
}

// migrated announces that a moved job runs again.
func (s *Store) migrated(j *Job) {
	m := *j.moved
	m.RestoredFrom = j.lastCheckpoint
	to := strings.Join(nodesOf(placementsOf(j)), ", ")
	from := strings.Join(nodesOf(m.From), ", ")
	msg := fmt.Sprintf("moved from %s (attempt %d) to %s (%s)", from, m.FromAttempt, to, m.Reason)
	if m.RestoredFrom != "" {
		msg += "; restored checkpoint " + m.RestoredFrom
	} else {
		msg += "; restarted: no checkpoint"
	}
	if s.emit(j, contracts.EventMigrated, 0, func(ev *contracts.JobEvent) {
		ev.Reason, ev.Message, ev.Migration = m.Reason, msg, &m
	}) {
		j.moved = nil
	}
}

func nodesOf(pl []contracts.Placement) []string {
	out := make([]string, len(pl))
	for i, p := range pl {
		out[i] = p.NodeID
	}
	return out
}

// checkEvicting advances the jobs being moved whose checkpoint wait ran
// out: no fact would wake them.
func (s *Store) checkEvicting() {
	now := s.cfg.Now()
	for _, j := range s.evicting {
		if j.evict == "" || j.State.Terminal() {
			delete(s.evicting, j.key)
			continue
		}
		if !now.Before(s.checkpointWait(j)) {
			s.advance(j)
		}
	}
}
