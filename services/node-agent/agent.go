// Package nodeagent is gpuplane's node agent: one per machine, it reports
// the machine's GPUs (inventory at start, a heartbeat every 2 s, telemetry
// every second) and runs the allocations the resource manager commits to
// it, reporting each run's start and end as facts on gp.runs.<node>.
//
//	ALLOCATIONS gp.alloc.ledger.<node> ──committed──▶ launch ──▶ RunEvent{started}
//	NODE_COMMANDS gp.cmd.node.<node>   ──stop_run───▶ SIGTERM, grace, SIGKILL
//	                                     run ends  ──▶ RunEvent{ended, Result}
//	Backend (sim, later NVML) ──▶ NodeInventory, Heartbeat, Telemetry
//	Backend health facts      ──▶ HealthEvent, NodeInventory (GPU Healthy)
//	                  ──inject_fault──▶ GPU faults, agent pause, machine death (health.go)
//
// Runs are idempotent on the allocation ID: an allocation that has a run
// fact on gp.runs.<node> (rebuilt from the stream at start) is never
// started again, and one the ledger released is never started at all.
package nodeagent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"
	cdispecs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/catalog"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/mps"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/nvmlgpu"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/sim"
)

// ServiceName is the agent's name on the bus.
const ServiceName = "node-agent"

// Run connects to the bus with cfg.Bus and runs the agent until ctx ends.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	if err := errors.Join(cfg.Bus.Validate(), cfg.Validate()); err != nil {
		return fmt.Errorf("%s: invalid config: %w", ServiceName, err)
	}
	rt, err := service.Start(ctx, ServiceName, cfg.Bus, log)
	if err != nil {
		return err
	}
	defer rt.Close()
	return RunWithBus(ctx, cfg, rt.Bus, rt.Log)
}

// RunWithBus runs the agent on an already connected bus until ctx ends,
// so many simulated agents can share one connection. It returns nil when
// ctx ends, after stopping the runs it started (their end is reported as
// agent_restarted by the next agent of this node).
func RunWithBus(ctx context.Context, cfg Config, b *bus.Bus, log *slog.Logger) error {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("%s: invalid config: %w", ServiceName, err)
	}
	if log == nil {
		log = slog.Default()
	}
	a, err := newAgent(cfg, b, log.With("node_id", cfg.NodeID))
	if err != nil {
		return fmt.Errorf("%s %s: %w", ServiceName, cfg.NodeID, err)
	}
	if c, ok := a.backend.(io.Closer); ok && cfg.Backend == nil {
		defer func() {
			if err := c.Close(); err != nil {
				log.Warn("GPU backend not closed", "node_id", cfg.NodeID, "err", err)
			}
		}()
	}
	return a.run(ctx)
}

// agent is one node agent's state. mu guards the maps; each allocation ID
// is in at most one of active (running or launching) and, once it has a
// fact, facts.
type agent struct {
	cfg         Config
	bus         *bus.Bus
	log         *slog.Logger
	backend     Backend
	runner      Runner
	feed        Feed
	incarnation string
	machine     device.Machine
	gpus        []contracts.GPUInfo
	byUUID      map[string]contracts.GPUInfo

	mu       sync.Mutex
	facts    map[string]*runFacts
	released map[string]releaseNote           // allocations the ledger released, why and where
	closed   closedRuns                       // allocations forgotten once closed (closed.go)
	stops    map[string]contracts.NodeCommand // stops for allocations not started yet
	active   map[string]*activeRun
	runs     sync.WaitGroup // one per watched run, and per container being pulled
	// unstarted are the container runs the ledger committed and did not
	// release, as rebuilt at start: the ones with no run fact are resumed
	// (recoverRuns), since their entries were acked before they started.
	unstarted map[string]contracts.Allocation

	health healthState // GPU health facts, injected faults, pause, death (health.go)

	// mps keeps the MPS daemons of GPUs that hold shares, nil where the
	// agent runs none (mps.go); mpsChanged asks for the inventory again.
	mps        *mps.Supervisor
	mpsChanged chan struct{}

	// images is the image cache of container runs (images.go);
	// imagesChanged asks for the inventory again.
	images        *imageStore
	imagesChanged chan struct{}

	// cdi describes the machine's GPUs to container runs, made at the
	// first (containers.go).
	cdiOnce sync.Once
	cdi     *cdispecs.Spec
}

// runFacts is what gp.runs.<node> holds about one allocation.
type runFacts struct {
	started    *contracts.RunEvent
	ended      bool
	checkpoint string // the last checkpoint reported
}

func newAgent(cfg Config, b *bus.Bus, log *slog.Logger) (*agent, error) {
	a := &agent{
		cfg: cfg, bus: b, log: log, backend: cfg.Backend, runner: cfg.Runner,
		incarnation:   newIncarnation(),
		facts:         map[string]*runFacts{},
		released:      map[string]releaseNote{},
		stops:         map[string]contracts.NodeCommand{},
		active:        map[string]*activeRun{},
		mpsChanged:    make(chan struct{}, 1),
		imagesChanged: make(chan struct{}, 1),
	}
	a.images = newImageStore(cfg, log.With("component", "image-cache"), a.onImagesChange)
	if a.feed = cfg.Feed; a.feed == nil {
		a.feed = NewBusFeed(b, cfg.NodeID, 0)
	}
	if a.backend == nil && cfg.BackendKind != BackendNVML {
		m, err := catalog.Get(cfg.GPUModel)
		if err != nil {
			return nil, err
		}
		if a.backend, err = sim.New(sim.Config{NodeID: cfg.NodeID, Model: m, Count: cfg.GPUCount, NVLink: cfg.NVLink,
			NVLinkBridges: cfg.NVLinkBridges, MIG: sim.MIG{Enabled: cfg.MIGEnabled, Layout: cfg.MIGLayout}}); err != nil {
			return nil, err
		}
	}
	if a.runner == nil {
		dir := cfg.LogDir
		if dir == "" {
			var err error
			if dir, err = os.MkdirTemp("", "gpuplane-node-agent-"+cfg.NodeID+"-*"); err != nil {
				return nil, fmt.Errorf("log dir: %w", err)
			}
			log.Info("run logs in a temporary directory", "dir", dir)
		}
		a.runner = &runner.Local{LogDir: dir, CheckpointDir: cfg.CheckpointDir, Runc: cfg.Runc}
	}
	var err error
	if a.mps, err = newMPS(cfg, log, a.onMPSChange); err != nil {
		return nil, err
	}
	if a.backend == nil && cfg.BackendKind == BackendNVML {
		// Opened last: nothing after it can fail and leave NVML open.
		nb, err := nvmlgpu.Open(nvmlgpu.Config{NodeID: cfg.NodeID, Log: log})
		if err != nil {
			return nil, err
		}
		a.backend = nb
		if a.cfg.MachineType == "" {
			a.cfg.MachineType = nb.MachineType()
		}
	}
	return a, nil
}

func newIncarnation() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// run rebuilds the agent's facts, reports runs a previous agent left
// behind, publishes the inventory, then runs its loops together.
func (a *agent) run(ctx context.Context) error {
	machine, err := a.backend.Discover(ctx)
	if err != nil {
		return fmt.Errorf("discover GPUs: %w", err)
	}
	gpus := machine.GPUs
	a.machine = machine
	a.gpus = gpus
	a.byUUID = make(map[string]contracts.GPUInfo, len(gpus))
	for _, g := range gpus {
		a.byUUID[g.UUID] = g
	}
	parent := ctx
	// A machine_death fault ends every loop with ErrMachineDied.
	ctx, a.health.die = context.WithCancelCause(ctx)
	defer a.health.die(nil)
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	g, gctx := errgroup.WithContext(ctx)
	// Heartbeats start before the rebuild: the machine and its runs are
	// alive while a restarted agent replays its ledger and adopts the runs
	// it left behind, and on a busy cluster (or twenty agents of one
	// fleet process restarting at once) that replay outlasted the
	// resource manager's heartbeat timeout: every machine was declared
	// lost and its live runs stopped after a one-second agent restart
	// (seen in the chaos suite). Nobody reads a heartbeat's Runs for
	// anything but display, so the empty list while recovering is fine.
	g.Go(func() error { return a.every(gctx, a.cfg.HeartbeatInterval, a.publishHeartbeat) })
	startErr := func(err error) error {
		stop()
		_ = g.Wait()
		if parent.Err() != nil {
			return nil // told to stop while starting: a stop, not a failure
		}
		return err
	}
	if err := a.rebuild(gctx); err != nil {
		return startErr(err)
	}
	defer a.mps.Close() // after shutdown: the runs' ends give their MPS holds back
	// Before re-adoption, which reclaims the images its runs hold. A cache
	// that does not open fails container runs, not the machine.
	if err := a.images.openExisting(); err != nil {
		a.log.Error("image cache of the previous agent not opened", "err", err)
	}
	defer a.images.close()
	if err := a.recoverRuns(gctx); err != nil {
		return startErr(err)
	}
	// Every share still running holds its GPU's daemon now: the others
	// are left from shares that ended while no agent ran.
	uuids := make([]string, len(gpus))
	for i, g := range gpus {
		uuids[i] = g.UUID
	}
	if err := a.mps.Sweep(gctx, uuids); err != nil && gctx.Err() == nil {
		a.log.Warn("MPS daemons left by the previous agent not all looked at", "err", err)
	}
	if err := a.resumeUnstarted(gctx); err != nil { // recover.go
		return startErr(err)
	}
	if err := a.publishInventory(gctx, a.nextInventoryVersion()); err != nil {
		return startErr(err)
	}
	a.log.Info("node agent started", "incarnation", a.incarnation, "backend", a.backend.Kind(), "gpus", len(gpus))

	if hw, ok := a.backend.(HealthWatcher); ok {
		g.Go(func() error { return a.watchHealth(gctx, hw) })
	}
	// NODES ages messages out (7 days): the inventory is republished well
	// within that, so a service restarted long after this agent still
	// finds the node. Version 1 went out above.
	g.Go(func() error {
		return a.every(gctx, a.cfg.InventoryInterval, func(ctx context.Context, seq uint64) {
			if seq == 1 {
				return
			}
			if err := a.publishInventory(ctx, a.nextInventoryVersion()); err != nil && ctx.Err() == nil {
				a.log.Warn("inventory not republished; next interval tries again", "err", err)
			}
		})
	})
	g.Go(func() error { return a.every(gctx, a.cfg.TelemetryInterval, a.publishTelemetry) })
	g.Go(func() error { return a.republishOnMPSChange(gctx) })
	g.Go(func() error { return a.republishOnImagesChange(gctx) })
	g.Go(func() error {
		return a.feed.Consume(gctx, contracts.StreamAllocations, contracts.SubjectLedger(a.cfg.NodeID), a.onLedger)
	})
	g.Go(func() error {
		return a.feed.Consume(gctx, contracts.StreamNodeCommands, contracts.SubjectNodeCommands(a.cfg.NodeID), a.onCommand)
	})
	err = g.Wait()
	a.shutdown()
	if a.machineDied() {
		a.log.Warn("node agent stopped: its machine died", "incarnation", a.incarnation)
		return ErrMachineDied
	}
	a.log.Info("node agent stopped", "incarnation", a.incarnation)
	return err
}

// every calls fn at once and then every interval until ctx ends.
// Publishing failures are logged by fn, never fatal: the next tick tries
// again.
func (a *agent) every(ctx context.Context, interval time.Duration, fn func(ctx context.Context, seq uint64)) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	for seq := uint64(1); ; seq++ {
		// A tick that cannot be delivered within a few intervals is stale.
		tctx, cancel := context.WithTimeout(ctx, max(3*interval, time.Second))
		fn(tctx, seq)
		cancel()
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

func (a *agent) publishInventory(ctx context.Context, version int) error {
	inv := contracts.NodeInventory{
		SchemaVersion: contracts.SchemaVersion,
		NodeID:        a.cfg.NodeID,
		Hostname:      a.cfg.Hostname,
		Pool:          a.cfg.Pool,
		Zone:          a.cfg.Zone,
		MachineType:   a.cfg.MachineType,
		PriceClass:    a.cfg.PriceClass,
		Labels:        a.cfg.Labels,
		Purpose:       a.cfg.Purpose,
		Taints:        a.cfg.Taints,
		Backend:       a.backend.Kind(),
		DriverVersion: a.machine.DriverVersion,
		CUDAVersion:   a.machine.CUDAVersion,
		Topology:      a.machine.Topology,
		CPUMilli:      a.cfg.CPUMilli,
		MemoryMiB:     a.cfg.MemoryMiB,
		GPUs:          a.withMPS(a.inventoryGPUs()),
		Images:        a.images.inventory(),
		Incarnation:   a.incarnation,
		Time:          a.cfg.Now(),
	}
	for _, g := range inv.GPUs {
		if m, ok := catalog.Lookup(g.Model); ok {
			if a.cfg.CPUMilli == 0 {
				inv.CPUMilli += m.HostCPUMilliPerGPU
			}
			if a.cfg.MemoryMiB == 0 {
				inv.MemoryMiB += m.HostMemoryMiBPerGPU
			}
		}
	}
	_, err := a.bus.Publish(ctx, contracts.SubjectInventory(a.cfg.NodeID),
		contracts.InventoryID(a.cfg.NodeID, a.incarnation, version), inv)
	if err != nil {
		return fmt.Errorf("publish inventory: %w", err)
	}
	return nil
}

func (a *agent) publishHeartbeat(ctx context.Context, seq uint64) {
	if a.silenced() {
		return // paused or dead: the resource manager sees silence
	}
	hb := contracts.Heartbeat{
		SchemaVersion: contracts.SchemaVersion,
		NodeID:        a.cfg.NodeID,
		Incarnation:   a.incarnation,
		Seq:           seq,
		Time:          a.cfg.Now(),
		Runs:          a.running(),
	}
	id := "hb/" + a.cfg.NodeID + "/" + a.incarnation + "/" + strconv.FormatUint(seq, 10)
	// Each try waits for its ack at most half an interval, and tries go
	// on until the tick's context ends: a publish sent to a NATS server
	// that died with it is never acked, and waiting out the bus's usual
	// 5 s for that ack (longer than two intervals) would leave the node
	// silent past the resource manager's heartbeat timeout, while the
	// reconnected connection could have carried the retry at once. The
	// message ID makes every retry one heartbeat in the stream.
	try := max(a.cfg.HeartbeatInterval/2, 250*time.Millisecond)
	for {
		tctx, cancel := context.WithTimeout(ctx, try)
		_, err := a.bus.Publish(tctx, contracts.SubjectHeartbeat(a.cfg.NodeID), id, hb, bus.NoRetry())
		cancel()
		switch {
		case err == nil || ctx.Err() != nil:
			return
		case errors.Is(err, bus.ErrPermissionDenied):
			a.log.Warn("heartbeat not published", "seq", seq, "err", err)
			return
		}
		a.log.Debug("heartbeat publish failed; retrying", "seq", seq, "err", err)
		select {
		case <-ctx.Done():
			a.log.Warn("heartbeat not published", "seq", seq, "err", err)
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (a *agent) publishTelemetry(ctx context.Context, seq uint64) {
	if a.silenced() {
		return
	}
	now := a.cfg.Now()
	busy := a.busyGPUs()
	samples, err := a.backend.Sample(ctx, now, busy)
	if err != nil {
		a.log.Warn("telemetry not sampled", "err", err)
		return
	}
	for i := range samples {
		samples[i].AllocationID = busy[samples[i].UUID]
	}
	tel := contracts.Telemetry{
		SchemaVersion: contracts.SchemaVersion,
		NodeID:        a.cfg.NodeID,
		Hostname:      a.cfg.Hostname,
		Pool:          a.cfg.Pool,
		Time:          now,
		GPUs:          samples,
	}
	id := "tel/" + a.cfg.NodeID + "/" + a.incarnation + "/" + strconv.FormatUint(seq, 10)
	if _, err := a.bus.Publish(ctx, contracts.SubjectTelemetry(a.cfg.NodeID), id, tel); err != nil && ctx.Err() == nil {
		a.log.Warn("telemetry not published", "seq", seq, "err", err)
	}
}

// running is the sorted IDs of the allocations whose run is launching or
// running.
func (a *agent) running() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	ids := make([]string, 0, len(a.active))
	for id := range a.active {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// busyGPUs maps each GPU of a started run to its allocation.
func (a *agent) busyGPUs() map[string]string {
	a.mu.Lock()
	defer a.mu.Unlock()
	busy := map[string]string{}
	for id, r := range a.active {
		if r.proc == nil {
			continue
		}
		for _, d := range r.alloc.Devices {
			if d.MIG != nil && d.MIG.UUID != "" {
				busy[d.MIG.UUID] = id // the backend finds its MIG device
				continue
			}
			busy[d.UUID] = id
		}
	}
	return busy
}
