package nodeagent

import (
	"context"
	"errors"
	"fmt"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
)

// runRecoverer is a Runner whose runs outlive the agent (runner.Local:
// commands run under a shim with their state on disk). Without one, every
// run a previous agent left is reported lost.
type runRecoverer interface {
	// Recover returns the runs a previous agent launched and did not
	// forget: running ones adopted, ended ones with how they ended.
	Recover() ([]runner.Leftover, error)
	// Adopt is Recover for one allocation; runner.ErrNoRun when none.
	Adopt(allocationID string) (runner.Leftover, error)
	// Forget drops an ended run's state once its end is reported.
	Forget(allocationID string) error
}

var _ runRecoverer = (*runner.Local)(nil)

// recoverRuns deals with every run a previous agent of this node left,
// before any consumer runs. Facts rebuilt from gp.runs.<node> decide what
// is reported, so doing this again (after a crash halfway) repeats
// nothing:
//
//   - a run that ended (its shim recorded the exit code) is reported ended
//     with that code, unless its ended fact exists;
//   - a run still running is re-adopted: watched, its log shipped from
//     where shipping stopped; stopped at once when its allocation was
//     released or stopped while no agent ran;
//   - a run whose process and exit status are both gone (its shim was
//     killed), and every started run this agent has no state for (a
//     simulated run lives in the agent and died with it), is reported
//     failed with reason agent_restarted.
//
// A run started before its started fact was published gets that fact now,
// with its real start time.
func (a *agent) recoverRuns(ctx context.Context) error {
	var leftovers []runner.Leftover
	if rec, ok := a.runner.(runRecoverer); ok {
		var err error
		// A run whose state cannot be read is reported lost below, if it
		// has a started fact: one unreadable directory must not keep the
		// node from working.
		if leftovers, err = rec.Recover(); err != nil {
			a.log.Error("some runs of the previous agent could not be recovered", "err", err)
		}
	}
	have := map[string]bool{}
	for _, l := range leftovers {
		have[l.Launch.AllocationID] = true
		if err := a.takeOver(ctx, l); err != nil {
			return err
		}
	}
	if err := a.reportLost(ctx, have); err != nil {
		return err
	}
	// Every running container reclaimed its image: the holds left are of
	// runs that ended while no agent ran.
	a.dropUnclaimedImages()
	a.keepUnstarted(have)
	a.mu.Lock()
	for id := range a.stops {
		if a.facts[id] != nil {
			delete(a.stops, id) // only stops of allocations that never started remain
		}
	}
	a.mu.Unlock()
	return nil
}

// keepUnstarted keeps, of the container runs committed and not
// released, those a previous agent acked the commit of and never started
// (it died pulling their images, typically): no run fact, and nothing
// launched (have: takeOver dealt with those). A run is never started
// twice: one the runner launched is in have, one with a started fact is
// never launched again.
func (a *agent) keepUnstarted(have map[string]bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for id := range a.unstarted {
		if a.facts[id] != nil || have[id] {
			delete(a.unstarted, id)
		}
	}
}

// resumeUnstarted commits afresh the runs keepUnstarted kept, once
// re-adopted shares hold their MPS daemons (and the others are swept):
// onCommitted decides as for any entry (a stop that came meanwhile ends
// the run, a release drops it), and a redelivery of the entry later
// finds the run launching.
func (a *agent) resumeUnstarted(ctx context.Context) error {
	a.mu.Lock()
	resume := a.unstarted
	a.unstarted = nil
	a.mu.Unlock()
	for _, alloc := range resume {
		a.log.Info("resuming a container run the previous agent did not start", "allocation_id", alloc.ID, "image", alloc.Run.Image)
		// Not released as the rebuild read the ledger: not closed either,
		// whatever its sequence (the highest one skips the look-up).
		if err := a.onCommitted(ctx, alloc, false, ^uint64(0)); err != nil {
			return err
		}
	}
	return nil
}

// adopt takes over the run already launched for allocation id.
func (a *agent) adopt(ctx context.Context, id string) error {
	rec, ok := a.runner.(runRecoverer)
	if !ok {
		return fmt.Errorf("allocation %s: %w, and the runner cannot tell what became of it", id, runner.ErrAlreadyLaunched)
	}
	l, err := rec.Adopt(id)
	if err != nil {
		return fmt.Errorf("adopt the run of %s: %w", id, err)
	}
	return a.takeOver(ctx, l)
}

// takeOver makes a run a previous agent launched this agent's own, or
// reports how it ended (see recoverRuns).
func (a *agent) takeOver(ctx context.Context, l runner.Leftover) error {
	id := l.Launch.AllocationID
	log := a.log.With("allocation_id", id)
	alloc := contracts.Allocation{ID: id, Tenant: l.Launch.Tenant, JobID: l.Launch.JobID, Attempt: l.Launch.Attempt,
		NodeID: a.cfg.NodeID, Devices: l.Launch.Devices, Run: l.Launch.Spec}
	info := l.Proc.Info()
	a.mu.Lock()
	f := a.facts[id]
	_, running := a.active[id]
	a.mu.Unlock()
	if running {
		return nil
	}
	if f != nil && f.ended {
		// Reported already: what may remain is the end of its log.
		select {
		case <-l.Proc.Done():
		default:
			log.Warn("a run reported ended is still running; killing it")
			l.Proc.Stop(0)
		}
		a.runs.Add(1)
		go func() {
			defer a.runs.Done()
			exit := l.Proc.Wait()
			a.finish(ctx, a.shipper(alloc, info, nil), id, exit.Code, true)
		}()
		return nil
	}

	run := newActiveRun(alloc)
	run.recovered, run.proc, run.checkpoint = true, l.Proc, info.RestoredFrom
	select {
	case <-l.Proc.Done():
	default:
		a.holdMPS(run) // a share still running keeps its GPU's daemon
		if c := l.Launch.Container; c != nil {
			// A container still running keeps its image from collection.
			release, err := a.reclaimImage(c.Image.Lease)
			if err != nil {
				log.Warn("the image hold of a re-adopted container was not reclaimed", "image", c.Image.Ref, "err", err)
			}
			run.image = release
		}
	}
	run.startedAt = info.StartedAt
	if f != nil && f.started != nil {
		run.startedAt = f.started.Time
		if f.checkpoint != "" {
			run.checkpoint = f.checkpoint
		}
	} else if !info.StartedAt.IsZero() {
		// Started, never announced: the previous agent died in between.
		started := contracts.RunEvent{Kind: contracts.RunStarted, AllocationID: id, Tenant: alloc.Tenant,
			JobID: alloc.JobID, Attempt: alloc.Attempt, Devices: alloc.Devices, Time: info.StartedAt, PID: info.PID}
		if err := a.publishRun(ctx, started); err != nil {
			return err
		}
	}

	a.mu.Lock()
	if rel, released := a.released[id]; released {
		reason := rel.reason
		if reason == "" {
			reason = contracts.ReasonStopRequested
		}
		outcome := contracts.OutcomeFailed
		if reason == contracts.ReasonCancelled {
			outcome = contracts.OutcomeCancelled
		}
		// Its devices may be someone else's already: no grace.
		run.stop = &stopRequest{outcome: outcome, reason: reason,
			message: "the allocation was released while the node agent was away"}
	} else if c, stopped := a.stops[id]; stopped {
		reason := c.Reason
		if reason == "" {
			reason = contracts.ReasonStopRequested
		}
		grace := c.GracePeriod.D()
		if grace <= 0 {
			grace = a.cfg.StopGrace
		}
		run.stop = &stopRequest{outcome: contracts.OutcomeCancelled, reason: reason, grace: grace, message: "stopped on request"}
	}
	a.active[id] = run
	stop := run.stop
	a.mu.Unlock()

	select {
	case <-l.Proc.Done():
		log.Info("found a run that ended while no agent ran", "exit_code", l.Proc.Wait().Code)
	default:
		log.Info("re-adopted a running run", "pid", info.PID, "started_at", info.StartedAt)
		if stop != nil {
			log.Warn("re-adopted run was released or stopped meanwhile; stopping it", "reason", stop.reason)
			l.Proc.Stop(stop.grace)
		}
	}
	a.runs.Add(1)
	go a.watch(ctx, run)
	return nil
}

// reportLost ends the runs with a started fact and no ended one that no
// runner state accounts for: they died with the previous agent.
func (a *agent) reportLost(ctx context.Context, have map[string]bool) error {
	now := a.cfg.Now()
	var lost []*contracts.RunEvent
	a.mu.Lock()
	for id, f := range a.facts {
		if f.started != nil && !f.ended && !have[id] {
			lost = append(lost, f.started)
		}
	}
	a.mu.Unlock()
	for _, s := range lost {
		id := s.AllocationID
		ev := contracts.RunEvent{Kind: contracts.RunEnded, AllocationID: id, Tenant: s.Tenant, JobID: s.JobID,
			Attempt: s.Attempt, Devices: s.Devices, Time: now,
			Result: &contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: NoExitCode,
				StartedAt: s.Time, EndedAt: now, Reason: contracts.ReasonAgentRestart,
				Message: "the node agent restarted while the run was running"}}
		if err := a.publishRun(ctx, ev); err != nil {
			return err
		}
		a.log.Warn("reported a run lost to an agent restart", "allocation_id", id)
	}
	return nil
}

// forget drops an ended run's state in the runner, if it keeps any.
func (a *agent) forget(id string) {
	rec, ok := a.runner.(runRecoverer)
	if !ok {
		return
	}
	if err := rec.Forget(id); err != nil && !errors.Is(err, runner.ErrNoRun) {
		a.log.Warn("run state not forgotten; the next agent tries again", "allocation_id", id, "err", err)
	}
}
