package nodeagent

import (
	"context"
	"path/filepath"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
)

// checkpointRun asks a running allocation's run for a checkpoint (SIGUSR1
// to its process group; a simulated run writes one at once). The run
// reports it through LATEST, which its watcher turns into a checkpointed
// fact. A command for a run that is not running, or whose job does not
// declare run.checkpoint, is ignored (SIGUSR1 ends a process that does not
// handle it), and each command (message ID) is applied once.
func (a *agent) checkpointRun(c contracts.NodeCommand, msgID string) {
	id := c.AllocationID
	log := a.log.With("allocation_id", id)
	a.mu.Lock()
	run := a.active[id]
	if run != nil && !run.alloc.Run.Checkpoint {
		a.mu.Unlock()
		// SIGUSR1 would end a job that does not handle it.
		log.Warn("checkpoint request ignored: the job does not declare run.checkpoint")
		return
	}
	if run == nil || run.proc == nil || run.stop != nil || run.ckptCmds[msgID] {
		a.mu.Unlock()
		log.Info("checkpoint request ignored: the run is not running, is stopping, or was asked already")
		return
	}
	run.ckptCmds[msgID] = true
	run.ckptAsked = true
	proc := run.proc
	a.mu.Unlock()
	if err := proc.Checkpoint(); err != nil {
		log.Warn("checkpoint not requested", "err", err)
		return
	}
	log.Info("checkpoint requested")
	run.wake()
}

// wake makes the run's watcher look at its log and checkpoints now,
// without blocking.
func (r *activeRun) wake() {
	select {
	case r.poke <- struct{}{}:
	default:
	}
}

// reportCheckpoint publishes a checkpointed fact when LATEST in the run's
// checkpoint directory names a new complete checkpoint. Its message ID
// (RunCheckpointID) makes a report repeated after a crash harmless.
func (a *agent) reportCheckpoint(ctx context.Context, run *activeRun) {
	dir := run.proc.Info().CheckpointDir
	if dir == "" {
		return
	}
	name, ok := runner.LatestCheckpoint(dir)
	if !ok {
		return
	}
	a.mu.Lock()
	if name == run.checkpoint {
		a.mu.Unlock()
		return
	}
	requested := run.ckptAsked
	a.mu.Unlock()
	alloc := run.alloc
	now := a.cfg.Now()
	ev := contracts.RunEvent{Kind: contracts.RunCheckpointed, AllocationID: alloc.ID, Tenant: alloc.Tenant,
		JobID: alloc.JobID, Attempt: alloc.Attempt, Devices: alloc.Devices, Time: now,
		Checkpoint: &contracts.Checkpoint{Name: name, Dir: filepath.Join(dir, name), Requested: requested, Time: now}}
	if err := a.publishRun(ctx, ev); err != nil {
		if ctx.Err() == nil {
			a.log.Warn("checkpoint not reported; next time tries again", "allocation_id", alloc.ID, "err", err)
		}
		return
	}
	a.mu.Lock()
	run.checkpoint, run.ckptAsked = name, false
	a.mu.Unlock()
	a.log.Info("checkpoint reported", "allocation_id", alloc.ID, "checkpoint", name, "requested", requested)
}
