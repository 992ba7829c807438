package state

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
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
	mv := j.movesW()
	j.evict, mv.evictMsg, mv.evictBy, mv.evictAt = m.reason, m.msg, m.deadline, s.cfg.Now()
	s.evicting[j.key] = j
	if migrates(m.reason) && (j.State == contracts.StateRunning || j.State == contracts.StateScheduled) {
		mig := contracts.Migration{Reason: m.reason, FromAttempt: j.Attempt, From: placementsOf(j),
			Checkpoint: s.checkpointable(j), KeepOff: slices.Sorted(maps.Keys(mv.avoid))}
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
			mv.migration = &mig
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
	mv := j.moves()
	until := mv.evictAt.Add(s.cfg.CheckpointTimeout)
	if !mv.evictBy.IsZero() {
		grace := min(s.cfg.PreemptGrace, mv.evictBy.Sub(mv.evictAt)/2)
		until = minTime(until, mv.evictBy.Add(-grace-deadlineMargin))
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
	if movedBy(reason) && reason != contracts.ReasonGangIncomplete && s.checkpointable(j) && !j.moves().evictAt.IsZero() {
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
	if j.moves().migration == nil {
		return
	}
	m := *j.mv.migration
	for _, p := range j.parts {
		if p.askedDone {
			m.Checkpointed = true
		}
	}
	j.mv.moved = &m
}

// migrated announces that a moved job runs again.
func (s *Store) migrated(j *Job) {
	m := *j.moves().moved
	m.RestoredFrom = j.lastCheckpoint
	msg := movedMessage(m.From, placementsOf(j), m.FromAttempt, m.Reason)
	if m.RestoredFrom != "" {
		msg += "; restored checkpoint " + m.RestoredFrom
	} else {
		msg += "; restarted: no checkpoint"
	}
	if s.emit(j, contracts.EventMigrated, 0, func(ev *contracts.JobEvent) {
		ev.Reason, ev.Message, ev.Migration = m.Reason, msg, &m
	}) {
		j.mv.moved = nil
		j.tidyMoves()
	}
}

// movedMessage says where a move took a job. A move is decided per
// device, not per machine: a hot or sick GPU, or one GPU's drain, moves
// the job off that GPU, and the next attempt may well run on another GPU
// of the same machine. Naming machines alone then read "moved from
// h100-01 to h100-01": the devices are named, and a move within one
// machine says so. An attempt that landed on the very devices it left
// (the hold was lifted before it was placed) says it is back there.
func movedMessage(from, to []contracts.Placement, fromAttempt int, reason contracts.Reason) string {
	fromNodes, toNodes := nodesOf(from), nodesOf(to)
	switch {
	case slices.Equal(fromNodes, toNodes) && slices.Equal(uuidsOf(from), uuidsOf(to)):
		return fmt.Sprintf("back on %s, where attempt %d ran (%s)", where(to), fromAttempt, reason)
	case len(fromNodes) == 1 && slices.Equal(fromNodes, toNodes):
		return fmt.Sprintf("moved within %s from %s (attempt %d) to %s (%s)", fromNodes[0], gpusOf(from), fromAttempt,
			gpusOf(to), reason)
	}
	return fmt.Sprintf("moved from %s (attempt %d) to %s (%s)", where(from), fromAttempt, where(to), reason)
}

// nodesOf returns the distinct nodes of pl, sorted.
func nodesOf(pl []contracts.Placement) []string {
	out := make([]string, 0, len(pl))
	for _, p := range pl {
		out = append(out, p.NodeID)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// uuidsOf returns the devices of pl by UUID (a MIG instance's own), sorted.
func uuidsOf(pl []contracts.Placement) []string {
	var out []string
	for _, p := range pl {
		for _, d := range p.Devices {
			id := d.UUID
			if d.MIG != nil {
				id = d.MIG.UUID
			}
			out = append(out, id)
		}
	}
	slices.Sort(out)
	return out
}

// where names each node of pl with its devices: "n1 GPUs 0,1, n2 GPU 3".
func where(pl []contracts.Placement) string {
	parts := make([]string, 0, len(pl))
	for _, node := range nodesOf(pl) {
		var on []contracts.Placement
		for _, p := range pl {
			if p.NodeID == node {
				on = append(on, p)
			}
		}
		parts = append(parts, node+" "+gpusOf(on))
	}
	return strings.Join(parts, ", ")
}

// gpusOf names the devices of pl by index, as gpuctl shows them: "GPU
// 0", "GPUs 0,1", a MIG instance or a share with its profile or limits.
func gpusOf(pl []contracts.Placement) string {
	var idx []string
	for _, p := range pl {
		for _, d := range p.Devices {
			s := strconv.Itoa(d.Index)
			switch {
			case d.MIG != nil:
				s += " (MIG " + d.MIG.Profile + ")"
			case d.Share != nil:
				s += " (shared)"
			}
			idx = append(idx, s)
		}
	}
	if len(idx) == 1 {
		return "GPU " + idx[0]
	}
	return "GPUs " + strings.Join(idx, ",")
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
