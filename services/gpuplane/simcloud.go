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
	// like is, per autoscaled pool, the fleet pool whose zone, purpose,
	// labels and taints its machines take (see settingsOf).
	like map[string]string
	log  *slog.Logger
	live atomic.Pointer[liveAgents] // set while run runs
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
	s := &simMachines{fleet: fl, log: log, like: settingsOf(fl, cfg.Autoscale)}
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
	fm, err := s.machine(m)
	if err == nil {
		err = live.dyn.Start(live.ctx, fm)
	}
	if err != nil {
		s.log.Error("simulated machine's agent not started", "machine", m.ID, "node_id", m.NodeID, "err", err)
	}
}

// machine is what the fleet makes of a machine the cloud booted: the
// machine type's shape, the settings of the pool's fleet template and the
// cloud's price class.
func (s *simMachines) machine(m cloud.Machine) (fleet.Machine, error) {
	like := s.like[m.Pool]
	if like == "" {
		like = m.Pool
	}
	fm, err := s.fleet.NewMachine(m.NodeID, like, m.MachineType, m.PriceClass)
	if err != nil {
		return fleet.Machine{}, err
	}
	fm.Pool = m.Pool
	return fm, nil
}

// settingsOf picks, for each autoscaled pool, the fleet pool its machines
// take their zone, purpose, labels and taints from, so that an autoscaled
// spot machine is tainted and placed like the fleet's spot machines:
//   - the fleet pool of the same name, if any (a pool with count 0 is such a
//     template and boots no machine of its own);
//   - else the first fleet pool of the same machine type and price class
//     (the default l4-spot takes l4's zone-b and spot taint);
//   - else none: the machines get the type's shape and the price class only.
func settingsOf(fl fleet.Fleet, pools []AutoscalePool) map[string]string {
	like := map[string]string{}
	for _, a := range pools {
		for _, p := range fl.Pools {
			if p.Name == a.Name {
				like[a.Name] = p.Name
				break
			}
			if like[a.Name] == "" && p.MachineType == a.MachineType && p.PriceClass == a.PriceClass {
				like[a.Name] = p.Name
			}
		}
	}
	return like
}

func (s *simMachines) down(m cloud.Machine) {
	if live := s.live.Load(); live != nil {
		live.dyn.Kill(m.NodeID)
	}
}

// run drives the simulated cloud with the real clock and runs its
// machines' agents until ctx ends.
func (s *simMachines) run(ctx context.Context, busCfg service.BusConfig, logDir, checkpointDir string, tune func(*nodeagent.Config)) error {
	rt, err := service.Start(ctx, "simulated-cloud", busCfg, s.log)
	if err != nil {
		return err
	}
	defer rt.Close()
	dyn := fleet.NewDynamic(rt.Bus, agentConfig(busCfg, logDir, checkpointDir, tune), s.log)
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
