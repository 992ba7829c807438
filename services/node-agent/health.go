package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
)

// ErrMachineDied is what RunWithBus returns after a machine_death fault:
// the simulated machine is gone with its runs. Whoever runs agents (the
// fleet) must not start this node's agent again on its own: a dead machine
// comes back only when someone brings it back.
var ErrMachineDied = errors.New("the machine died (injected machine_death fault)")

// healthState is the agent's part in GPU health and injected faults: the
// health facts it publishes, the fault commands it has seen, and whether
// it is paused or dead.
//
//	Backend.WatchHealth ──fact──▶ HealthEvent on gp.nodes.health.<node>
//	                      Healthy changed ──▶ GPUInfo.Healthy, inventory v+1
//	inject_fault ──▶ xid, ecc_dbe, overheat, clear ──▶ Backend.InjectFault
//	             ──▶ agent_pause: no heartbeats, no telemetry for Duration
//	             ──▶ machine_death: SIGKILL every run, report nothing, stop
type healthState struct {
	seq        atomic.Uint64 // health events published this incarnation
	invVersion atomic.Int64  // inventory versions published this incarnation
	dead       atomic.Bool
	die        context.CancelCauseFunc // ends the agent's loops with ErrMachineDied

	mu          sync.Mutex
	seen        map[string]bool // fault IDs applied, or already in the stream at start
	pausedUntil time.Time
}

// nextInventoryVersion numbers the inventories of this incarnation: the
// hourly republish and the ones a health change causes share one count,
// so their message IDs never collide.
func (a *agent) nextInventoryVersion() int { return int(a.health.invVersion.Add(1)) }

// silenced is true while the agent must not publish heartbeats and
// telemetry: paused by an agent_pause fault, or dead.
func (a *agent) silenced() bool {
	if a.health.dead.Load() {
		return true
	}
	a.health.mu.Lock()
	defer a.health.mu.Unlock()
	return a.cfg.Now().Before(a.health.pausedUntil)
}

// faultHistory notes a fault command found in the stream when the agent
// starts: it hit an earlier incarnation of this machine (a machine that
// died, an agent that restarted), so this one never applies it.
func (a *agent) faultHistory(c contracts.NodeCommand) {
	if c.Kind != contracts.CommandInjectFault || c.Fault == nil || c.Fault.ID == "" {
		return
	}
	a.health.mu.Lock()
	defer a.health.mu.Unlock()
	if a.health.seen == nil {
		a.health.seen = map[string]bool{}
	}
	a.health.seen[c.Fault.ID] = true
}

// onFault handles an inject_fault command. It is idempotent on Fault.ID:
// a redelivered or republished command with a fault ID this incarnation
// has seen does nothing.
func (a *agent) onFault(c contracts.NodeCommand) error {
	if c.Fault == nil {
		return bus.Permanent(errors.New("inject_fault command without a fault"))
	}
	f := *c.Fault
	if err := f.Validate(); err != nil {
		return bus.Permanent(fmt.Errorf("inject_fault: %w", err))
	}
	log := a.log.With("fault_id", f.ID, "fault", f.Kind, "gpu", f.GPU)
	a.health.mu.Lock()
	seen := a.health.seen[f.ID]
	a.health.mu.Unlock()
	if seen {
		log.Debug("fault already applied, or older than this agent; ignored")
		return nil
	}
	switch f.Kind {
	case contracts.FaultMachineDeath:
		a.markFault(f.ID)
		a.machineDeath(log)
		return nil
	case contracts.FaultAgentPause:
		d := f.PauseDuration()
		a.health.mu.Lock()
		a.health.pausedUntil = a.cfg.Now().Add(d)
		a.health.mu.Unlock()
		a.markFault(f.ID)
		log.Warn("agent paused: no heartbeats and no telemetry; runs go on", "duration", d)
		return nil
	}
	fi, ok := a.backend.(FaultInjector)
	if !ok {
		a.markFault(f.ID)
		log.Warn("fault not applied: the "+a.backend.Kind()+" backend's GPUs are real", "backend", a.backend.Kind())
		return nil
	}
	if err := fi.InjectFault(f); err != nil {
		// A GPU this machine does not have: retrying cannot help.
		return bus.Permanent(err)
	}
	a.markFault(f.ID)
	log.Info("fault injected")
	return nil
}

func (a *agent) markFault(id string) {
	a.health.mu.Lock()
	defer a.health.mu.Unlock()
	if a.health.seen == nil {
		a.health.seen = map[string]bool{}
	}
	a.health.seen[id] = true
}

// machineDeath kills every run at once, with no end facts (the next agent
// of this node reports them lost), silences the agent and stops it with
// ErrMachineDied.
func (a *agent) machineDeath(log *slog.Logger) {
	a.health.dead.Store(true)
	a.mu.Lock()
	procs := make([]runner.Process, 0, len(a.active))
	for _, r := range a.active {
		if r.stop == nil {
			r.stop = &stopRequest{}
		}
		r.stop.shutdown, r.stop.grace = true, 0 // a launch in flight kills what it starts
		if r.proc != nil {
			procs = append(procs, r.proc)
		}
	}
	a.mu.Unlock()
	for _, p := range procs {
		p.Stop(0)
	}
	log.Warn("machine death injected: every run killed, the agent stops and reports nothing more", "runs", len(procs))
	if a.health.die != nil {
		a.health.die(ErrMachineDied)
	}
}

// machineDied reports whether the agent stopped because its machine died.
func (a *agent) machineDied() bool { return a.health.dead.Load() }

// watchHealth publishes every health fact of the backend until ctx ends.
func (a *agent) watchHealth(ctx context.Context, hw HealthWatcher) error {
	err := hw.WatchHealth(ctx, func(h device.Health) { a.onHealth(ctx, h) })
	if err != nil && ctx.Err() == nil {
		return fmt.Errorf("watch GPU health: %w", err)
	}
	return nil
}

// onHealth publishes one health fact as a HealthEvent and, when it changes
// whether a GPU may take new work, the inventory with that GPU's new
// health, so the resource manager stops (or resumes) placing work on it.
func (a *agent) onHealth(ctx context.Context, h device.Health) {
	if a.health.dead.Load() {
		return
	}
	node := a.cfg.NodeID
	seq := a.health.seq.Add(1)
	ev := contracts.HealthEvent{SchemaVersion: contracts.SchemaVersion, NodeID: node, Incarnation: a.incarnation,
		Seq: seq, GPUUUID: h.GPUUUID, GPUIndex: h.GPUIndex, Kind: h.Kind, Code: h.Code, Healthy: h.Healthy,
		Message: h.Message, Time: a.cfg.Now()}
	log := a.log.With("gpu_uuid", h.GPUUUID, "health", h.Kind, "code", h.Code, "healthy", h.Healthy)
	if _, err := a.bus.Publish(ctx, contracts.SubjectNodeHealth(node), contracts.HealthEventID(node, a.incarnation, seq),
		ev, bus.CESubject(h.GPUUUID)); err != nil {
		if ctx.Err() == nil {
			log.Error("health event not published; the inventory still carries the GPU's health", "err", err)
		}
	} else {
		log.Warn("GPU health: " + h.Message)
	}
	if !a.setGPUHealthy(h.GPUUUID, h.Healthy) {
		return
	}
	if err := a.publishInventory(ctx, a.nextInventoryVersion()); err != nil && ctx.Err() == nil {
		log.Error("inventory with the GPU's new health not published", "err", err)
	}
}

// setGPUHealthy records a GPU's health in the inventory and reports
// whether it changed. The GPU slice is replaced, never written in place,
// so an inventory being published keeps a consistent copy.
func (a *agent) setGPUHealthy(uuid string, healthy bool) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	for i, g := range a.gpus {
		if g.UUID != uuid {
			continue
		}
		if g.Healthy == healthy {
			return false
		}
		gpus := append([]contracts.GPUInfo(nil), a.gpus...)
		gpus[i].Healthy = healthy
		a.gpus = gpus
		a.byUUID[uuid] = gpus[i]
		return true
	}
	return false
}

// inventoryGPUs is the GPUs as the inventory reports them now.
func (a *agent) inventoryGPUs() []contracts.GPUInfo {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.gpus
}
