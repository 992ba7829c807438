package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os/exec"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/telemetry"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/logship"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/mps"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
)

// watchInterval is how often a running command's log is shipped and its
// checkpoint directory looked at.
const watchInterval = 250 * time.Millisecond

// NoExitCode is the exit code of a run fact when no process status
// exists: the run never started, or the agent lost it.
const NoExitCode = -1

// activeRun is a run being launched (proc nil) or running.
type activeRun struct {
	alloc     contracts.Allocation
	proc      runner.Process
	startedAt time.Time
	// stop is why the run was asked to stop, nil while nobody asked.
	stop *stopRequest
	// recovered is set for a run a previous agent started.
	recovered bool
	// checkpoint is the last checkpoint reported (or restored from at
	// launch); ckptAsked is set by a checkpoint command until the next
	// new checkpoint is reported; ckptCmds are the commands applied.
	checkpoint string
	ckptAsked  bool
	ckptCmds   map[string]bool
	// poke makes the run's watcher look at its log and checkpoints now.
	poke chan struct{}
	// mps are the run's holds on the MPS daemons of its shared GPUs
	// (mps.go), given back when it ends.
	mps []*mps.Lease
	// image gives back the run's hold on its container image (nil for a
	// run without one), once it has ended.
	image func()
	// cancelPull ends the preparation of a container's launch (its pull
	// above all) when a stop or a release comes first; nil for a host
	// run, which is launched at once.
	cancelPull context.CancelFunc
}

// releaseImage gives back the run's image, once; the cache may then
// collect it.
func (r *activeRun) releaseImage() {
	if r.image != nil {
		r.image()
		r.image = nil
	}
}

func newActiveRun(alloc contracts.Allocation) *activeRun {
	return &activeRun{alloc: alloc, ckptCmds: map[string]bool{}, poke: make(chan struct{}, 1)}
}

// stopRequest says how a stopped run's end is reported.
type stopRequest struct {
	outcome  contracts.RunOutcome
	reason   contracts.Reason
	message  string
	grace    time.Duration
	shutdown bool // the agent itself is stopping: report nothing
}

// rebuild reads the node's own history before any consumer runs: the run
// facts (what was started or ended), the stop commands (what must not
// start) and the ledger's releases (what must never start; a closed
// allocation is forgotten as its release is read, closed.go), so that
// neither a redelivery nor the order in which the durable consumers
// deliver can start a run twice or start a stopped one.
func (a *agent) rebuild(ctx context.Context) error {
	if err := a.replayRuns(ctx); err != nil {
		return err
	}
	node := a.cfg.NodeID
	err := a.feed.Replay(ctx, contracts.StreamNodeCommands, contracts.SubjectNodeCommands(node), func(_ context.Context, m *bus.Msg) error {
		var c contracts.NodeCommand
		if err := m.Decode(&c); err != nil {
			a.log.Warn("skipping undecodable node command", "stream_seq", m.StreamSeq, "err", err)
			return nil
		}
		if c.Kind == contracts.CommandStopRun && (a.facts[c.AllocationID] == nil || !a.facts[c.AllocationID].ended) {
			// Kept for runs that did not end either: one a previous agent
			// left running is stopped once re-adopted (recoverRuns).
			a.stops[c.AllocationID] = c
		}
		a.faultHistory(c) // faults hit earlier incarnations, never this one
		return nil
	})
	if err != nil {
		return fmt.Errorf("replay node commands: %w", err)
	}
	err = a.feed.Replay(ctx, contracts.StreamAllocations, contracts.SubjectLedger(node), func(_ context.Context, m *bus.Msg) error {
		if !fromResourceManager(m) {
			// A forged release would keep a real allocation from running.
			a.log.Warn("skipping a ledger entry not published by the resource manager",
				"source", m.Header.Get(contracts.HeaderCESource), "stream_seq", m.StreamSeq)
			return nil
		}
		var e contracts.LedgerEntry
		if err := m.Decode(&e); err != nil {
			a.log.Warn("skipping undecodable ledger entry", "stream_seq", m.StreamSeq, "err", err)
			return nil
		}
		switch id := e.Allocation.ID; {
		case e.Kind == contracts.LedgerReleased:
			a.mu.Lock()
			a.released[id] = releaseNote{reason: e.Reason, seq: m.StreamSeq}
			delete(a.unstarted, id)
			a.maybeClose(id) // after the commands: a closed run's stop goes too
			a.mu.Unlock()
		case e.Kind == contracts.LedgerCommitted && e.Allocation.Run.IsContainer() && id != "" && e.Allocation.NodeID == node:
			// Its entry is acked before its image is pulled: a previous
			// agent may have died pulling it, and nothing redelivers it.
			if a.unstarted == nil {
				a.unstarted = map[string]contracts.Allocation{}
			}
			a.unstarted[id] = e.Allocation
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("replay ledger: %w", err)
	}
	return nil
}

// replayRuns merges every fact of gp.runs.<node> into a.facts.
func (a *agent) replayRuns(ctx context.Context) error {
	err := a.feed.Replay(ctx, contracts.StreamRuns, contracts.SubjectRuns(a.cfg.NodeID), func(_ context.Context, m *bus.Msg) error {
		var ev contracts.RunEvent
		if err := m.Decode(&ev); err != nil {
			a.log.Warn("skipping undecodable run fact", "stream_seq", m.StreamSeq, "err", err)
			return nil
		}
		a.mu.Lock()
		a.recordFact(ev)
		a.mu.Unlock()
		return nil
	})
	if err != nil {
		return fmt.Errorf("replay runs: %w", err)
	}
	return nil
}

// recordFact notes a published run fact; a.mu must be held. A pulling
// fact is not one: a run whose image was being pulled has not started,
// and an agent that finds only pulling facts must still start it.
func (a *agent) recordFact(ev contracts.RunEvent) {
	if ev.Kind == contracts.RunPulling {
		return
	}
	f := a.facts[ev.AllocationID]
	if f == nil {
		f = &runFacts{}
		a.facts[ev.AllocationID] = f
	}
	switch ev.Kind {
	case contracts.RunStarted:
		f.started = &ev
	case contracts.RunEnded:
		f.ended = true
		a.maybeClose(ev.AllocationID)
	case contracts.RunCheckpointed:
		if ev.Checkpoint != nil {
			f.checkpoint = ev.Checkpoint.Name
		}
	}
}

// resourceManagerSource is the CloudEvents source prefix of every
// resource manager replica: the bus sets the source to "/gpuplane/<its
// connection name>", and a replica's name is "resource-manager" (its
// ServiceName) or, when replicas tell their writes apart, starts with it.
const resourceManagerSource = "/gpuplane/resource-manager"

// fromResourceManager reports whether a ledger entry carries the resource
// manager's identity. The bus's permissions already let only the resource
// manager publish ledger entries; this check is the agent's own defence
// in depth (issue 12): a ledger entry runs a command as root on the
// node's GPUs, so one published by anyone else (an operator's hand, a
// misconfigured identity) must never run.
func fromResourceManager(m *bus.Msg) bool {
	return strings.HasPrefix(m.Header.Get(contracts.HeaderCESource), resourceManagerSource)
}

// onLedger handles one entry of gp.alloc.ledger.<node>.
func (a *agent) onLedger(ctx context.Context, m *bus.Msg) error {
	if !fromResourceManager(m) {
		// Dead-lettered, not retried: kept for an operator to see, never run.
		src := m.Header.Get(contracts.HeaderCESource)
		a.log.Warn("refusing a ledger entry not published by the resource manager",
			"source", src, "stream_seq", m.StreamSeq)
		return bus.Permanent(fmt.Errorf("ledger entry seq %d from %q, not the resource manager", m.StreamSeq, src))
	}
	var e contracts.LedgerEntry
	if err := m.Decode(&e); err != nil {
		return bus.Permanent(err)
	}
	telemetry.Annotate(ctx, telemetry.AllocAttrs(e.Allocation.Tenant, e.Allocation.JobID, e.Allocation.NodeID, e.Allocation.Attempt)...)
	id := e.Allocation.ID
	switch {
	case id == "":
		return bus.Permanent(errors.New("ledger entry without an allocation ID"))
	case e.Allocation.NodeID != a.cfg.NodeID:
		return bus.Permanent(fmt.Errorf("allocation %s is for node %q, not %q", id, e.Allocation.NodeID, a.cfg.NodeID))
	}
	switch e.Kind {
	case contracts.LedgerCommitted:
		return a.onCommitted(ctx, e.Allocation, m.NumDelivered > 1, m.StreamSeq)
	case contracts.LedgerReleased:
		a.onReleased(e, m.StreamSeq)
		return nil
	default:
		return bus.Permanent(fmt.Errorf("unknown ledger entry kind %q", e.Kind))
	}
}

// onCommitted starts an allocation's run unless it already has a run
// fact, is running (or being launched), was released, or was stopped
// before it started. A host command's run is launched here: the entry is
// acked once its started fact is published, and a failure redelivers it.
// A container's run is launched by a goroutine of its own (pullAndLaunch)
// and the entry acked at once: its image may take minutes to pull, and
// the ledger's single worker must not hold every other run of the machine
// (or the entry, unacked past its AckWait) for that long. seq is the
// entry's ledger sequence (closed.go).
func (a *agent) onCommitted(ctx context.Context, alloc contracts.Allocation, redelivered bool, seq uint64) error {
	id := alloc.ID
	log := a.log.With("allocation_id", id)
	a.mu.Lock()
	forgotten := a.mustLookUp(id, seq)
	a.mu.Unlock()
	if redelivered || forgotten {
		// An earlier delivery may have published a started fact whose
		// acknowledgement was lost, or the allocation may be closed and
		// forgotten: look again before deciding.
		if err := a.lookup(ctx, id, forgotten); err != nil {
			return fmt.Errorf("look up allocation %s: %w", id, err)
		}
	}
	a.mu.Lock()
	_, running := a.active[id]
	stop, stopped := a.stops[id]
	switch {
	case a.closed.has(id):
		a.mu.Unlock()
		log.Debug("allocation closed (ended and released); not starting it again")
		return nil
	case a.facts[id] != nil:
		a.mu.Unlock()
		log.Debug("allocation already has run facts; not starting it again")
		return nil
	case running:
		// Also a container whose image is being pulled: one pull, one
		// launch, however often its entry is delivered.
		a.mu.Unlock()
		return nil
	case a.isReleased(id):
		a.mu.Unlock()
		log.Info("allocation was released before it started; not starting it")
		return nil
	case stopped:
		a.mu.Unlock()
		reason := stop.Reason
		if reason == "" {
			reason = contracts.ReasonStopRequested
		}
		log.Info("allocation was stopped before it started; reporting it cancelled")
		if err := a.publishEnded(ctx, alloc, contracts.RunResult{Outcome: contracts.OutcomeCancelled,
			ExitCode: NoExitCode, EndedAt: a.cfg.Now(), Reason: reason, Message: "stopped before it started"}); err != nil {
			return err
		}
		a.mu.Lock()
		delete(a.stops, id) // the ended fact now guards it
		a.mu.Unlock()
		return nil
	}
	devices, err := a.devices(alloc)
	if err != nil {
		a.mu.Unlock()
		log.Warn("allocation cannot run here", "err", err)
		return a.publishEnded(ctx, alloc, contracts.RunResult{Outcome: contracts.OutcomeFailed,
			ExitCode: NoExitCode, EndedAt: a.cfg.Now(), Reason: contracts.ReasonLaunchFailed, Message: err.Error()})
	}
	run := newActiveRun(alloc)
	a.active[id] = run
	if !alloc.Run.IsContainer() {
		a.mu.Unlock()
		if err := a.launch(ctx, ctx, run, devices); err != nil {
			a.drop(run) // the redelivered entry starts it afresh
			return err
		}
		return nil
	}
	// A stop or a release while the image is pulled cancels the pull.
	pctx, cancel := context.WithCancel(ctx)
	run.cancelPull = cancel
	a.runs.Add(1)
	a.mu.Unlock()
	go a.pullAndLaunch(ctx, pctx, run, devices)
	return nil
}

// A container's launch that could not publish its facts (the bus away)
// tries again after launchRetry, doubled at each failure up to
// maxLaunchRetry, for as long as the agent runs: its ledger entry is
// acked, so nothing else tries again (an agent that stops leaves it to
// the next one).
const (
	launchRetry    = time.Second
	maxLaunchRetry = 30 * time.Second
)

// pullAndLaunch launches a container's run (launch) from its own
// goroutine, with pctx (cancelled by a stop or a release) bounding the
// pull, and tries again while the agent runs if its facts could not be
// published. The run stays in a.active meanwhile: a redelivered entry
// finds it, and a stop or a release reaches it. An agent that stops
// first leaves it to the next agent (recoverRuns resumes it).
func (a *agent) pullAndLaunch(ctx, pctx context.Context, run *activeRun, devices []contracts.DeviceRef) {
	defer a.runs.Done()
	defer run.abandonPull() // its context's resources; the run no longer needs it
	id := run.alloc.ID
	for wait := launchRetry; ; wait = min(2*wait, maxLaunchRetry) {
		err := a.launch(ctx, pctx, run, devices)
		if err == nil {
			return
		}
		if ctx.Err() != nil {
			a.drop(run)
			return
		}
		a.log.Warn("container run not launched; trying again", "allocation_id", id, "err", err, "in", wait)
		select {
		case <-ctx.Done():
			a.drop(run)
			return
		case <-time.After(wait):
		}
		a.mu.Lock()
		cur, registered := a.active[id]
		again := a.facts[id] == nil && (cur == run || !registered)
		if again {
			a.active[id] = run // an adoption that failed left it
		}
		a.mu.Unlock()
		if !again {
			a.drop(run) // its facts were recorded after all, or another run took it over
			return
		}
	}
}

// drop forgets run in a.active unless another took its place.
func (a *agent) drop(run *activeRun) {
	a.mu.Lock()
	if a.active[run.alloc.ID] == run {
		delete(a.active, run.alloc.ID)
		a.maybeClose(run.alloc.ID)
	}
	a.mu.Unlock()
}

// errStoppedBeforeStart is the launch of a run stopped or released while
// it was being prepared (its image pulled): it ends as its stop says.
var errStoppedBeforeStart = errors.New("stopped before it started")

// launch prepares run (its pool's policy, its image pulled with pulling
// facts, its MPS daemon) and starts it. pctx bounds the preparation, ctx
// the rest. It returns nil once the run is started (and watched), or
// once its end is reported (what can never start, a stop or a release
// that came first); an error, with ctx alive, is a fact that could not
// be published, and leaves run in a.active with nothing held, for its
// caller to drop or try again.
func (a *agent) launch(ctx, pctx context.Context, run *activeRun, devices []contracts.DeviceRef) error {
	alloc := run.alloc
	id := alloc.ID
	log := a.log.With("allocation_id", id)
	// notLaunched reports a run that will not start: its end leaves
	// a.active only once recorded, so that neither a redelivered entry
	// nor a retry starts it meanwhile. A stop or a release that came
	// while it was prepared is its end, whatever else failed.
	notLaunched := func(reason contracts.Reason, exitCode int, err error) error {
		if ctx.Err() != nil {
			return ctx.Err() // shutting down: a later agent starts it
		}
		res := contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: exitCode, EndedAt: a.cfg.Now(),
			Reason: reason, Message: err.Error()}
		a.mu.Lock()
		stop := run.stop
		a.mu.Unlock()
		if stop != nil && !stop.shutdown {
			res = contracts.RunResult{Outcome: stop.outcome, ExitCode: NoExitCode, EndedAt: res.EndedAt,
				Reason: stop.reason, Message: errStoppedBeforeStart.Error()}
			log.Info("run stopped or released before it started", "reason", stop.reason, "err", err)
		} else {
			log.Warn("run not launched", "reason", reason, "err", err)
		}
		if err := a.publishEnded(ctx, alloc, res); err != nil {
			return err
		}
		a.drop(run)
		return nil
	}
	if err := checkRuntime(alloc); err != nil {
		return notLaunched(launchReason(err), NoExitCode, err)
	}
	ctr, releaseImage, reason, err := a.prepareContainer(pctx, alloc)
	if err != nil {
		return notLaunched(reason, NoExitCode, err)
	}
	run.image = releaseImage

	// A share runs only once its GPU's MPS daemon is up: without one the
	// limits in its environment are ignored.
	leases, mpsPipeDir, mpsShmDir, err := a.acquireMPS(pctx, devices)
	if err != nil {
		run.releaseImage()
		return notLaunched(contracts.ReasonMPSUnavailable, NoExitCode, err)
	}
	run.mps = leases
	holdsBack := func() {
		run.releaseMPS()
		run.mps = nil
		run.releaseImage()
	}

	// The last look before the launch: nothing starts once its
	// allocation was stopped or released (a stop from here on stops it
	// as soon as it is launched).
	a.mu.Lock()
	stopped := run.stop != nil
	a.mu.Unlock()
	if stopped || pctx.Err() != nil {
		holdsBack()
		return notLaunched(contracts.ReasonStopRequested, NoExitCode, errStoppedBeforeStart)
	}

	// A simulated run's clock starts inside Launch: its start is taken
	// before, so the reported run never looks shorter than its duration.
	launchedAt := a.cfg.Now()
	proc, err := a.runner.Launch(ctx, runner.Launch{AllocationID: id, Tenant: alloc.Tenant, JobID: alloc.JobID,
		Attempt: alloc.Attempt, Spec: alloc.Run, Devices: devices, StopGrace: a.cfg.StopGrace, Gang: alloc.Gang,
		MPSPipeDir: mpsPipeDir, MPSShmDir: mpsShmDir, Container: ctr})
	if err != nil {
		holdsBack()
		if errors.Is(err, runner.ErrAlreadyLaunched) {
			// The second guard: a run was launched for it and its facts
			// do not say so (they were lost). Report what became of it.
			log.Warn("a run was already launched for this allocation; adopting it instead", "err", err)
			a.drop(run)
			return a.adopt(ctx, id)
		}
		if err := notLaunched(launchReason(err), launchExitCode(err), err); err != nil {
			return err
		}
		a.forget(id)
		return nil
	}
	startedAt := a.cfg.Now()
	info := proc.Info()
	if info.PID == 0 { // simulated
		startedAt = launchedAt
	}
	if info.LogPath != "" && !info.Simulated { // a simulated run's shipper keeps no record
		if err := logship.Reset(info.LogPath); err != nil {
			log.Warn("the log of a fresh run may be shipped from a stale offset", "err", err)
		}
	}
	a.mu.Lock()
	run.proc, run.startedAt, run.checkpoint = proc, startedAt, info.RestoredFrom
	pending := run.stop // a stop that came while launching
	a.mu.Unlock()
	if pending != nil {
		proc.Stop(pending.grace)
	}
	started := contracts.RunEvent{Kind: contracts.RunStarted, AllocationID: id, Tenant: alloc.Tenant,
		JobID: alloc.JobID, Attempt: alloc.Attempt, Devices: alloc.Devices, Time: startedAt, PID: info.PID}
	if err := a.publishRun(ctx, started); err != nil {
		// Without its started fact the run does not exist for anyone:
		// kill it and forget it, so that it is started afresh.
		proc.Stop(0)
		proc.Wait()
		holdsBack()
		a.forget(id)
		a.mu.Lock()
		run.proc, run.startedAt, run.checkpoint = nil, time.Time{}, ""
		a.mu.Unlock()
		return err
	}
	log.Info("run started", "devices", len(devices), "command", len(alloc.Run.Command) > 0, "image", alloc.Run.Image, "pid", info.PID,
		"restored_from", info.RestoredFrom)
	a.runs.Add(1)
	go a.watch(ctx, run)
	return nil
}

// isReleased reports whether the ledger released allocation id; a.mu must
// be held.
func (a *agent) isReleased(id string) bool {
	_, ok := a.released[id]
	return ok
}

// devices checks that every device of alloc is a GPU of this machine and
// can confine a run (runner.ValidateDevice), and returns them in
// allocation order; a.mu must be held.
func (a *agent) devices(alloc contracts.Allocation) ([]contracts.DeviceRef, error) {
	if len(alloc.Devices) == 0 {
		return nil, errors.New("allocation has no devices")
	}
	for _, d := range alloc.Devices {
		if _, ok := a.byUUID[d.UUID]; !ok {
			return nil, fmt.Errorf("device %d (%s) is not a GPU of this node", d.Index, d.UUID)
		}
		if err := runner.ValidateDevice(d); err != nil {
			return nil, err
		}
	}
	return alloc.Devices, nil
}

// launchExitCode is the shell's code for a command that could not run.
func launchExitCode(err error) int {
	switch {
	case errors.Is(err, exec.ErrNotFound), errors.Is(err, fs.ErrNotExist):
		return 127
	case errors.Is(err, fs.ErrPermission):
		return 126
	}
	return NoExitCode
}

// watch follows a run until it ends: it ships its log and reports its
// checkpoints as they come (every watchInterval for a command; for a
// simulated run, which writes both only on request, when poked), then
// reports its end, ships the rest of its log and forgets its state.
func (a *agent) watch(ctx context.Context, run *activeRun) {
	defer a.runs.Done()
	id := run.alloc.ID
	log := a.log.With("allocation_id", id)
	info := run.proc.Info()
	ship := a.shipper(run.alloc, info, run.proc)
	flush := func(ctx context.Context) {
		if ship != nil {
			if err := ship.Flush(ctx); err != nil && ctx.Err() == nil {
				log.Warn("run output not shipped; next time tries again", "err", err)
			}
		}
	}
	var tick, first <-chan time.Time
	if info.PID != 0 {
		t := time.NewTicker(watchInterval)
		defer t.Stop()
		tick = t.C
	}
	if info.Simulated {
		// Its first lines wait (Config.SimLogDelay): off the hot path of
		// a burst of starts, and in its last chunk if it ends first.
		t := time.NewTimer(a.cfg.SimLogDelay)
		defer t.Stop()
		first = t.C
	} else {
		flush(ctx)
	}
	for running := true; running; {
		select {
		case <-run.proc.Done():
			running = false
		case <-tick:
		case <-first:
			first = nil
		case <-run.poke:
		}
		if running && ctx.Err() == nil {
			flush(ctx)
			a.reportCheckpoint(ctx, run)
		}
	}
	exit := run.proc.Wait()
	run.releaseMPS() // the run's processes are gone: its GPU may stop its daemon
	run.releaseImage()
	endedAt := a.cfg.Now()
	if run.recovered && !exit.EndedAt.IsZero() {
		endedAt = exit.EndedAt // it may have ended while no agent ran
	}
	a.mu.Lock()
	stop := run.stop
	delete(a.active, id)
	a.mu.Unlock()
	if (stop != nil && stop.shutdown && exit.Stopped) || a.machineDied() {
		// Reported by the next agent of this node: from the shim's exit
		// file for a command, as agent_restarted for a simulated run.
		return
	}
	pctx := ctx
	if ctx.Err() != nil {
		// The run ended on its own while the agent stops: still worth a
		// short try, the bus is open until RunWithBus returns.
		var cancel context.CancelFunc
		pctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
	}
	a.reportCheckpoint(pctx, run) // one written just before the end counts
	res := runResult(exit, stop, run, endedAt)
	if err := a.publishEnded(pctx, run.alloc, res); err != nil {
		log.Error("run end not published; the next agent reports it", "err", err)
		return
	}
	log.Info("run ended", "outcome", res.Outcome, "exit_code", res.ExitCode)
	a.finish(pctx, ship, id, res.ExitCode, !info.Simulated)
}

// finish ships the rest of an ended run's log, then forgets the run's
// state (when it has any: a simulated run leaves none in the runner);
// whatever fails is left for the next agent to finish.
func (a *agent) finish(ctx context.Context, ship *logship.Shipper, id string, exitCode int, hasState bool) {
	if ship != nil {
		if err := ship.Finish(ctx, exitCode); err != nil {
			a.log.Warn("end of run output not shipped; the next agent ships it", "allocation_id", id, "err", err)
			return
		}
	}
	if hasState {
		a.forget(id)
	}
}

// shipper ships a run's log, nil when it has none the agent can read.
// proc, when it holds its log itself (a simulated run's, in memory only:
// logship.Source), is read instead of a file.
func (a *agent) shipper(alloc contracts.Allocation, info runner.Info, proc any) *logship.Shipper {
	run := logship.Run{AllocationID: alloc.ID, Tenant: alloc.Tenant, JobID: alloc.JobID, Attempt: alloc.Attempt, NodeID: a.cfg.NodeID}
	if src, ok := proc.(logship.Source); ok && info.Simulated {
		return logship.NewVolatileSource(a.bus, run, src, a.cfg.Now)
	}
	if info.LogPath == "" {
		return nil
	}
	if info.Simulated {
		// It dies with this agent: no later one resumes its shipping.
		return logship.NewVolatile(a.bus, run, info.LogPath, a.cfg.Now)
	}
	s, err := logship.New(a.bus, run, info.LogPath, a.cfg.Now)
	if err != nil {
		a.log.Warn("run output will not be shipped", "allocation_id", alloc.ID, "err", err)
		return nil
	}
	return s
}

// runResult turns how a run ended into the result reported.
func runResult(exit runner.Exit, stop *stopRequest, run *activeRun, endedAt time.Time) contracts.RunResult {
	res := contracts.RunResult{ExitCode: exit.Code, StartedAt: run.startedAt, EndedAt: endedAt}
	switch {
	case errors.Is(exit.Err, runner.ErrLaunch):
		res.Outcome, res.Reason, res.Message = contracts.OutcomeFailed, contracts.ReasonLaunchFailed, exit.Err.Error()
		res.ExitCode, res.StartedAt = launchExitCode(exit.Err), time.Time{}
	case stop != nil && exit.Stopped:
		res.Outcome, res.Reason, res.Message = stop.outcome, stop.reason, stop.message
	case run.recovered && exit.Stopped:
		// Stopped with no stop on record: the previous agent stopped it
		// as it shut down.
		res.Outcome, res.Reason = contracts.OutcomeFailed, contracts.ReasonAgentRestart
		res.Message = "the run was stopped when the node agent stopped"
	case run.recovered && errors.Is(exit.Err, runner.ErrLost):
		res.Outcome, res.Reason = contracts.OutcomeFailed, contracts.ReasonAgentRestart
		res.Message = "the node agent restarted and the run's process and exit status were gone"
	case exit.TimedOut:
		res.Outcome, res.Reason, res.Message = contracts.OutcomeFailed, contracts.ReasonExitNonZero, "killed at its time limit"
	case exit.Err != nil:
		res.Outcome, res.Reason, res.Message = contracts.OutcomeFailed, contracts.ReasonExitNonZero, exit.Err.Error()
	case exit.Code == 0:
		res.Outcome = contracts.OutcomeSucceeded
	default:
		res.Outcome, res.Reason = contracts.OutcomeFailed, contracts.ReasonExitNonZero
	}
	return res
}

// onReleased notes a release so the allocation never starts; a run still
// going is stopped, since its devices are no longer its own (the usual
// release follows the run's end and finds nothing running).
func (a *agent) onReleased(e contracts.LedgerEntry, seq uint64) {
	id := e.Allocation.ID
	a.mu.Lock()
	if !a.closed.has(id) { // a redelivered release of a closed one: nothing to note
		a.released[id] = releaseNote{reason: e.Reason, seq: seq}
	}
	delete(a.stops, id)
	run := a.active[id]
	a.maybeClose(id) // an ended run's release (the usual one) closes it
	var proc runner.Process
	if run != nil && run.stop == nil {
		outcome := contracts.OutcomeFailed
		if e.Reason == contracts.ReasonCancelled {
			outcome = contracts.OutcomeCancelled
		}
		run.stop = &stopRequest{outcome: outcome, reason: e.Reason, grace: a.cfg.StopGrace,
			message: "the allocation was released while its run was running"}
		proc = run.proc
	}
	a.mu.Unlock()
	if proc != nil {
		a.log.Warn("allocation released while running; stopping its run", "allocation_id", id, "reason", e.Reason)
		proc.Stop(a.cfg.StopGrace)
	} else if run != nil {
		run.abandonPull()
	}
}

// abandonPull cancels the preparation of a container's launch that a
// stop or a release came before: its pull is given up (the cache's pull
// too when no other run waits for it) and nothing is launched.
func (r *activeRun) abandonPull() {
	if r.cancelPull != nil {
		r.cancelPull()
	}
}

// onCommand handles one command of gp.cmd.node.<node>.
func (a *agent) onCommand(ctx context.Context, m *bus.Msg) error {
	var c contracts.NodeCommand
	if err := m.Decode(&c); err != nil {
		return bus.Permanent(err)
	}
	if c.AllocationID == "" && c.Kind != contracts.CommandInjectFault {
		return bus.Permanent(errors.New("node command without an allocation ID"))
	}
	switch c.Kind {
	case contracts.CommandStopRun:
		return a.stopRun(ctx, c)
	case contracts.CommandCheckpointRun:
		a.checkpointRun(c, m.ID()) // checkpoints.go
		return nil
	case contracts.CommandInjectFault:
		return a.onFault(c) // health.go
	default:
		return bus.Permanent(fmt.Errorf("unknown node command %q", c.Kind))
	}
}

// stopRun stops a running allocation, or remembers the stop so the
// allocation never starts (commands and the ledger are different streams:
// the stop may come first). Idempotent: the stop of an allocation closed
// and forgotten (closed.go) is looked up in the streams of record first,
// so that it finds the run ended rather than waiting for a start.
func (a *agent) stopRun(ctx context.Context, c contracts.NodeCommand) error {
	id := c.AllocationID
	a.mu.Lock()
	_, active := a.active[id]
	forgotten := !active && a.closed.below > 0 && a.facts[id] == nil && !a.closed.has(id)
	a.mu.Unlock()
	if forgotten {
		if err := a.lookup(ctx, id, true); err != nil {
			return fmt.Errorf("look up allocation %s: %w", id, err)
		}
	}
	grace := c.GracePeriod.D()
	if grace <= 0 {
		grace = a.cfg.StopGrace
	}
	reason := c.Reason
	if reason == "" {
		reason = contracts.ReasonStopRequested
	}
	a.mu.Lock()
	run, running := a.active[id]
	switch {
	case running:
		if run.stop == nil {
			run.stop = &stopRequest{outcome: contracts.OutcomeCancelled, reason: reason, grace: grace, message: "stopped on request"}
		}
		proc := run.proc // nil while launching: the launcher applies the stop
		a.mu.Unlock()
		if proc != nil {
			a.log.Info("stopping run", "allocation_id", id, "reason", reason, "grace", grace)
			proc.Stop(grace)
		} else {
			run.abandonPull()
		}
	case a.facts[id] != nil, a.closed.has(id):
		a.mu.Unlock() // already ended
	default:
		a.stops[id] = c
		a.mu.Unlock()
		a.log.Info("stop for an allocation not started; it will not start", "allocation_id", id)
	}
	return nil
}

// shutdown stops every run when the agent stops and waits for them (at
// most the stop grace and a little more).
func (a *agent) shutdown() {
	a.mu.Lock()
	var procs []runner.Process
	for _, r := range a.active {
		if r.stop == nil {
			r.stop = &stopRequest{shutdown: true}
		} // a run already being stopped on request still reports its end
		if r.proc != nil {
			procs = append(procs, r.proc)
		}
	}
	a.mu.Unlock()
	for _, p := range procs {
		p.Stop(a.cfg.StopGrace)
	}
	done := make(chan struct{})
	go func() { a.runs.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(a.cfg.StopGrace + 5*time.Second):
		a.log.Error("runs did not stop in time")
	}
}

func (a *agent) publishEnded(ctx context.Context, alloc contracts.Allocation, res contracts.RunResult) error {
	// The run may have left a.active already: carry its job's trace here.
	ctx = telemetry.WithTraceParent(ctx, alloc.TraceParent)
	return a.publishRun(ctx, contracts.RunEvent{Kind: contracts.RunEnded, AllocationID: alloc.ID, Tenant: alloc.Tenant,
		JobID: alloc.JobID, Attempt: alloc.Attempt, Devices: alloc.Devices, Time: res.EndedAt, Result: &res})
}

// traceParent is the run's job trace, "" for no run.
func (r *activeRun) traceParent() string {
	if r == nil {
		return ""
	}
	return r.alloc.TraceParent
}

// publishRun publishes a run fact and records it.
func (a *agent) publishRun(ctx context.Context, ev contracts.RunEvent) error {
	ev.SchemaVersion = contracts.SchemaVersion
	ev.NodeID = a.cfg.NodeID
	id := contracts.RunEventID(ev.Kind, ev.AllocationID)
	if ev.Kind == contracts.RunCheckpointed && ev.Checkpoint != nil {
		id = contracts.RunCheckpointID(ev.AllocationID, ev.Checkpoint.Name)
	}
	// A run fact continues its job's trace (the allocation's), whatever
	// goroutine reports it (a run's watcher, recovery after a restart).
	a.mu.Lock()
	tp := a.active[ev.AllocationID].traceParent()
	a.mu.Unlock()
	ctx, span := telemetry.StartJobSpan(ctx, a.bus.Tracer(), "run "+string(ev.Kind)+" "+ev.JobID, tp,
		telemetry.AllocAttrs(ev.Tenant, ev.JobID, ev.NodeID, ev.Attempt)...)
	defer span.End()
	if _, err := a.bus.Publish(ctx, contracts.SubjectRuns(a.cfg.NodeID), id, ev, bus.CESubject(ev.AllocationID)); err != nil {
		return fmt.Errorf("publish run %s of %s: %w", ev.Kind, ev.AllocationID, err)
	}
	a.mu.Lock()
	a.recordFact(ev)
	a.mu.Unlock()
	return nil
}
