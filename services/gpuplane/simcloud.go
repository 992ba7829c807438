package gpuplane

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync/atomic"
	"time"

	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/autoscaler/simcloud"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// advanceEvery is how often the simulated cloud applies its due
// transitions (boots, reclaims) on the real clock.
const advanceEvery = 250 * time.Millisecond

// simMachines is the simulated cloud of the autoscaled pools and the node
// agents of its machines: a machine that boots starts an agent, one that
// is reclaimed or deleted dies with its runs.
//
//	autoscaler ──Create/Delete/List──▶ simcloud ──Up──▶ fleet.Dynamic.Start (agent registers)
//	ticker (real clock) ──Advance──▶      │     ──Down─▶ fleet.Dynamic.Kill (machine death)
//	test/operator ──Interrupt──▶          └──Watch──▶ autoscaler lists at once: drain, alert
type simMachines struct {
	cloud *simcloud.Provider
	fleet fleet.Fleet
	log   *slog.Logger
	live  atomic.Pointer[liveAgents] // set while run runs
}

type liveAgents struct {
	ctx context.Context
	dyn *fleet.Dynamic
}

func newSimMachines(cfg Config, fl fleet.Fleet, log *slog.Logger) (*simMachines, error) {
	delays := map[string]time.Duration{}
	for _, a := range cfg.Autoscale {
		if _, ok := fl.MachineTypes[a.MachineType]; !ok {
			return nil, fmt.Errorf("autoscale: pool %s: machine type %q is not one of the fleet's (%v); -autoscale \"\" runs without autoscaled pools",
				a.Name, a.MachineType, slices.Sorted(maps.Keys(fl.MachineTypes)))
		}
		delays[a.Name] = a.ProvisionDelay
	}
	s := &simMachines{fleet: fl, log: log}
	var err error
	s.cloud, err = simcloud.New(simcloud.Config{Now: time.Now, PoolProvisionDelay: delays, NoticeAhead: cfg.SpotNotice,
		Hooks: simcloud.Hooks{Up: s.up, Down: s.down}})
	if err != nil {
		return nil, err
	}
	return s, nil
}

func (s *simMachines) up(m cloud.Machine) {
	live := s.live.Load()
	if live == nil {
		s.log.Warn("simulated machine booted with no agent runner", "machine", m.ID)
		return
	}
	fm, err := s.fleet.NewMachine(m.NodeID, m.Pool, m.MachineType, m.PriceClass)
	if err == nil {
		err = live.dyn.Start(live.ctx, fm)
	}
	if err != nil {
		s.log.Error("simulated machine's agent not started", "machine", m.ID, "node_id", m.NodeID, "err", err)
	}
}

func (s *simMachines) down(m cloud.Machine) {
	if live := s.live.Load(); live != nil {
		live.dyn.Kill(m.NodeID)
	}
}

// run drives the simulated cloud with the real clock and runs its
// machines' agents until ctx ends.
func (s *simMachines) run(ctx context.Context, busCfg service.BusConfig, logDir, checkpointDir string) error {
	rt, err := service.Start(ctx, "simulated-cloud", busCfg, s.log)
	if err != nil {
		return err
	}
	defer rt.Close()
	agent := nodeagent.DefaultConfig()
	agent.Bus = busCfg
	agent.LogDir = logDir
	agent.CheckpointDir = checkpointDir
	dyn := fleet.NewDynamic(rt.Bus, agent, s.log)
	s.live.Store(&liveAgents{ctx: ctx, dyn: dyn})
	defer dyn.Wait() // the agents end with ctx
	t := time.NewTicker(advanceEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			s.cloud.Advance()
		}
	}
}
