package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
)

// NewMachine describes a machine of type machineType created at run time
// (by a simulated cloud provider) for pool, under nodeID. When f has a
// pool of that name, the machine takes its zone, purpose, labels and
// taints; priceClass, when set, overrides the pool's.
func (f Fleet) NewMachine(nodeID, pool, machineType, priceClass string) (Machine, error) {
	if err := contracts.ValidateID(nodeID); err != nil {
		return Machine{}, fmt.Errorf("fleet: new machine: node ID: %w", err)
	}
	if err := contracts.ValidatePool(pool); err != nil {
		return Machine{}, fmt.Errorf("fleet: new machine %s: %w", nodeID, err)
	}
	if _, ok := f.MachineTypes[machineType]; !ok {
		return Machine{}, fmt.Errorf("fleet: new machine %s: unknown machine type %q; want one of %v",
			nodeID, machineType, slices.Sorted(maps.Keys(f.MachineTypes)))
	}
	p := Pool{Name: pool} // a pool f does not describe has the type's shape only
	if i := slices.IndexFunc(f.Pools, func(p Pool) bool { return p.Name == pool }); i >= 0 {
		p = f.Pools[i]
	}
	m := f.machine(nodeID, p, machineType, p.taints())
	if priceClass != "" {
		if !slices.Contains(nodeagent.PriceClasses, priceClass) {
			return Machine{}, fmt.Errorf("fleet: new machine %s: price class %q; want one of %v", nodeID, priceClass, nodeagent.PriceClasses)
		}
		m.PriceClass = priceClass
	}
	return m, nil
}

// Dynamic runs the agents of machines that come and go while it runs, as
// a cloud provider's machines do: Start when a machine has booted, Kill
// when it is reclaimed or deleted. Each agent reads the bus on its own
// consumers (a standalone agent's, named after its node), so machines can
// join without restarting the static fleet's shared feed. It is safe for
// concurrent use.
type Dynamic struct {
	bus      *bus.Bus
	template nodeagent.Config
	log      *slog.Logger

	mu     sync.Mutex
	agents map[string]*dynamicAgent // node ID → running agent
	wg     sync.WaitGroup
}

type dynamicAgent struct {
	feed   *machineFeed
	cancel context.CancelFunc
	done   chan struct{}
}

// killFallback is how long Kill waits for the agent to die of the injected
// fault before it cancels the agent outright (an agent still starting has
// not taken its commands yet).
const killFallback = 5 * time.Second

// dynamicInactive removes the consumers of a machine that is gone.
const dynamicInactive = time.Hour

// NewDynamic returns a Dynamic whose agents share b and are configured
// from template as Configs does.
func NewDynamic(b *bus.Bus, template nodeagent.Config, log *slog.Logger) *Dynamic {
	if log == nil {
		log = slog.Default()
	}
	return &Dynamic{bus: b, template: template, log: log, agents: map[string]*dynamicAgent{}}
}

// Start runs m's agent until ctx ends or Kill. It fails when m's agent is
// already running (a node ID names one live machine).
func (d *Dynamic) Start(ctx context.Context, m Machine) error {
	c := machineConfig(d.template, m)
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.agents[m.NodeID]; ok {
		return fmt.Errorf("fleet: start %s: its agent is already running", m.NodeID)
	}
	feed := &machineFeed{Feed: nodeagent.NewBusFeed(d.bus, m.NodeID, dynamicInactive), node: m.NodeID, log: d.log}
	c.Feed = feed
	actx, cancel := context.WithCancel(ctx)
	a := &dynamicAgent{feed: feed, cancel: cancel, done: make(chan struct{})}
	d.agents[m.NodeID] = a
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		defer close(a.done)
		defer cancel()
		err := nodeagent.RunWithBus(actx, c, d.bus, d.log)
		switch {
		case errors.Is(err, nodeagent.ErrMachineDied):
			d.log.Info("simulated machine gone", "node_id", m.NodeID)
		case err != nil && actx.Err() == nil:
			d.log.Error("simulated machine's agent failed", "node_id", m.NodeID, "err", err)
		}
		d.mu.Lock()
		if d.agents[m.NodeID] == a {
			delete(d.agents, m.NodeID)
		}
		d.mu.Unlock()
	}()
	d.log.Info("simulated machine started", "node_id", m.NodeID, "pool", m.Pool, "machine_type", m.MachineType, "gpus", m.GPUCount)
	return nil
}

// Kill ends nodeID's machine as a reclaim does: every run is killed at
// once and nothing more is reported (no run ends, no heartbeats), as the
// agent's machine_death fault does. It returns at once and reports
// whether the machine was running.
func (d *Dynamic) Kill(nodeID string) bool {
	d.mu.Lock()
	a, ok := d.agents[nodeID]
	d.mu.Unlock()
	if !ok {
		return false
	}
	a.feed.kill()
	go func() {
		select {
		case <-a.done:
		case <-time.After(killFallback):
			d.log.Warn("simulated machine did not die of its fault; stopping its agent", "node_id", nodeID)
			a.cancel()
		}
	}()
	return true
}

// Running lists the node IDs whose agent runs, sorted.
func (d *Dynamic) Running() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Sorted(maps.Keys(d.agents))
}

// Wait blocks until every agent started has stopped.
func (d *Dynamic) Wait() { d.wg.Wait() }

// machineFeed is the nodeagent.Feed of one dynamic machine: a standalone
// agent's feed (the machine's own durable consumers) plus a way in for the
// death of the machine. A machine's death is not a command anyone sends
// on the bus (the provider takes the machine away), so it is handed to the
// agent's command handler directly, as the machine_death fault the agent
// already knows.
type machineFeed struct {
	nodeagent.Feed
	node string
	log  *slog.Logger

	mu     sync.Mutex
	dead   bool
	cmd    bus.Handler
	cmdCtx context.Context
}

var _ nodeagent.Feed = (*machineFeed)(nil)

// Consume is the bus feed's, with the command handler kept for kill.
func (f *machineFeed) Consume(ctx context.Context, stream, subject string, h bus.Handler) error {
	if stream == contracts.StreamNodeCommands {
		f.mu.Lock()
		f.cmd, f.cmdCtx = h, ctx
		dead := f.dead
		f.mu.Unlock()
		if dead {
			f.deliverDeath(ctx, h)
		}
	}
	return f.Feed.Consume(ctx, stream, subject, h)
}

// kill delivers the death now if the agent takes commands, or as soon as
// it does.
func (f *machineFeed) kill() {
	f.mu.Lock()
	f.dead = true
	h, ctx := f.cmd, f.cmdCtx
	f.mu.Unlock()
	if h != nil {
		f.deliverDeath(ctx, h)
	}
}

func (f *machineFeed) deliverDeath(ctx context.Context, h bus.Handler) {
	c := contracts.NodeCommand{SchemaVersion: contracts.SchemaVersion, Kind: contracts.CommandInjectFault,
		Fault: &contracts.Fault{ID: "machine-gone", Kind: contracts.FaultMachineDeath}, Time: time.Now()}
	data, err := json.Marshal(c)
	if err == nil {
		err = h(ctx, &bus.Msg{Subject: contracts.SubjectNodeCommands(f.node), Data: data})
	}
	if err != nil && ctx.Err() == nil {
		f.log.Warn("machine death not delivered", "node_id", f.node, "err", err)
	}
}
