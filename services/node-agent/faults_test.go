package nodeagent_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/catalog"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/sim"
)

func mustModel(t *testing.T, id string) catalog.Model {
	t.Helper()
	m, err := catalog.Get(id)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// injectFault publishes an inject_fault command as gpuctl and tests do,
// and returns its stream sequence. msgID "" means FaultCommandID.
func injectFault(t *testing.T, b *testBus, node string, f contracts.Fault, msgID string) uint64 {
	t.Helper()
	if msgID == "" {
		msgID = contracts.FaultCommandID(node, f.ID)
	}
	c := contracts.NodeCommand{SchemaVersion: contracts.SchemaVersion, Kind: contracts.CommandInjectFault,
		Reason: "drill", Fault: &f, Time: time.Now()}
	ack, err := b.Publish(context.Background(), contracts.SubjectNodeCommands(node), msgID, c)
	if err != nil {
		t.Fatal(err)
	}
	return ack.Sequence
}

// nodeRecorders follows everything one agent publishes about its node.
type nodeRecorders struct {
	health *recorder[contracts.HealthEvent]
	inv    *recorder[contracts.NodeInventory]
	tel    *recorder[contracts.Telemetry]
	hbs    *recorder[contracts.Heartbeat]
	runs   *recorder[contracts.RunEvent]
}

func recordNode(t *testing.T, b *testBus, node string) nodeRecorders {
	return nodeRecorders{
		health: record[contracts.HealthEvent](t, b, contracts.StreamNodes, contracts.SubjectNodeHealth(node)),
		inv:    record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(node)),
		tel:    record[contracts.Telemetry](t, b, contracts.StreamTelemetry, contracts.SubjectTelemetry(node)),
		hbs:    record[contracts.Heartbeat](t, b, contracts.StreamHeartbeats, contracts.SubjectHeartbeat(node)),
		runs:   record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node)),
	}
}

// waitHealth returns the n-th health event (1-based) once it is there.
func (r nodeRecorders) waitHealth(t *testing.T, n int) contracts.HealthEvent {
	t.Helper()
	eventually(t, fmt.Sprint("health event ", n), func() bool { return len(r.health.all()) >= n })
	return r.health.all()[n-1]
}

// waitTelemetry waits for a telemetry batch whose GPU gpu satisfies ok.
func (r nodeRecorders) waitTelemetry(t *testing.T, what string, gpu int, ok func(contracts.GPUSample) bool) contracts.GPUSample {
	t.Helper()
	var got contracts.GPUSample
	eventually(t, what, func() bool {
		all := r.tel.all()
		for i := len(all) - 1; i >= 0 && i >= len(all)-3; i-- {
			if g := all[i].GPUs[gpu]; ok(g) {
				got = g
				return true
			}
		}
		return false
	})
	return got
}

func TestGPUFaultsBecomeHealthEventsAndInventory(t *testing.T) {
	b := connect(t)
	const node = "h100-f1"
	r := recordNode(t, b, node)
	startAgent(t, b, testConfig(t, node))
	eventually(t, "first inventory", func() bool { return len(r.inv.all()) == 1 })
	inc := r.inv.all()[0].Incarnation

	// XID 79 on GPU 2: the GPU fell off the bus.
	injectFault(t, b, node, contracts.Fault{ID: "xid79", Kind: contracts.FaultXID, GPU: "2"}, "")
	h := r.waitHealth(t, 1)
	if h.Kind != contracts.HealthFellOffBus || h.Code != 79 || h.Healthy || h.GPUIndex != 2 || h.GPUUUID != sim.UUID(node, 2) ||
		h.NodeID != node || h.Incarnation != inc || h.Seq != 1 || h.SchemaVersion != contracts.SchemaVersion {
		t.Fatalf("health event %+v; want GPU 2 fell off the bus, seq 1 of incarnation %s", h, inc)
	}
	if id := r.health.header(0, contracts.HeaderMsgID); id != contracts.HealthEventID(node, inc, 1) {
		t.Errorf("health event Msg-Id %q, want %q", id, contracts.HealthEventID(node, inc, 1))
	}
	if ce := r.health.header(0, contracts.HeaderCEType); ce != "io.gpuplane.node.health.fell_off_bus.v1" {
		t.Errorf("ce-type %q", ce)
	}
	eventually(t, "inventory with GPU 2 unhealthy", func() bool { return len(r.inv.all()) == 2 })
	inv := r.inv.all()[1]
	for i, g := range inv.GPUs {
		if g.Healthy != (i != 2) {
			t.Fatalf("inventory after XID 79: GPU %d healthy %v", i, g.Healthy)
		}
	}
	if id := r.inv.header(1, contracts.HeaderMsgID); id != contracts.InventoryID(node, inc, 2) || inv.Incarnation != inc {
		t.Errorf("second inventory Msg-Id %q", id)
	}
	r.waitTelemetry(t, "telemetry of GPU 2 off the bus", 2, func(g contracts.GPUSample) bool {
		return !g.Healthy && g.LastXID == 79 && g.GPUUtil == 0 && g.PowerW == 0
	})

	// An application's XID: reported, the GPU stays healthy, so the
	// inventory does not change; the ECC error after it does.
	injectFault(t, b, node, contracts.Fault{ID: "xid13", Kind: contracts.FaultXID, GPU: sim.UUID(node, 5), Code: 13}, "")
	if h := r.waitHealth(t, 2); h.Kind != contracts.HealthXID || h.Code != 13 || !h.Healthy || h.GPUIndex != 5 || h.Seq != 2 {
		t.Fatalf("health event %+v; want XID 13 on GPU 5, healthy", h)
	}
	injectFault(t, b, node, contracts.Fault{ID: "dbe", Kind: contracts.FaultECCDBE, GPU: "6"}, "")
	if h := r.waitHealth(t, 3); h.Kind != contracts.HealthECCDBE || h.Healthy || h.GPUIndex != 6 || h.Seq != 3 {
		t.Fatalf("health event %+v; want a double-bit error on GPU 6", h)
	}
	eventually(t, "inventory with GPU 6 unhealthy", func() bool { return len(r.inv.all()) >= 3 })
	if all := r.inv.all(); len(all) != 3 || all[2].GPUs[6].Healthy || all[2].GPUs[2].Healthy || !all[2].GPUs[5].Healthy {
		t.Fatalf("%d inventories; want one per change of health (XID 13 changes none)", len(all))
	}
	r.waitTelemetry(t, "telemetry of GPU 6's double-bit error", 6, func(g contracts.GPUSample) bool {
		return !g.Healthy && g.ECCDBE == 1 && g.LastXID == 48
	})

	// Clearing the machine brings both back, each with a recovered event.
	injectFault(t, b, node, contracts.Fault{ID: "clear", Kind: contracts.FaultClear}, "")
	for n := 4; n <= 5; n++ {
		if h := r.waitHealth(t, n); h.Kind != contracts.HealthRecovered || !h.Healthy {
			t.Fatalf("health event %d: %+v; want recovered", n, h)
		}
	}
	eventually(t, "inventory with every GPU healthy", func() bool {
		all := r.inv.all()
		for _, g := range all[len(all)-1].GPUs {
			if !g.Healthy {
				return false
			}
		}
		return true
	})
}

func TestOverheatThrottlesThenRecovers(t *testing.T) {
	b := connect(t)
	const node = "h100-f2"
	r := recordNode(t, b, node)
	startAgent(t, b, testConfig(t, node))
	eventually(t, "first inventory", func() bool { return len(r.inv.all()) == 1 })

	injectFault(t, b, node, contracts.Fault{ID: "hot", Kind: contracts.FaultOverheat, GPU: "4",
		Duration: contracts.Duration(time.Second)}, "")
	h := r.waitHealth(t, 1)
	if h.Kind != contracts.HealthThermal || !h.Healthy || h.GPUIndex != 4 || h.Code < 89 {
		t.Fatalf("health event %+v; want GPU 4 thermal, healthy, at 89 °C or more", h)
	}
	hot := r.waitTelemetry(t, "GPU 4 hot and throttled", 4, func(g contracts.GPUSample) bool {
		return g.ThrottleReasons&contracts.ThrottleHWThermal != 0
	})
	if hot.TempC < 88 || !hot.Healthy {
		t.Errorf("throttled GPU 4 at %v °C, healthy %v", hot.TempC, hot.Healthy)
	}
	back := r.waitHealth(t, 2)
	if back.Kind != contracts.HealthThermal || !back.Healthy || back.GPUIndex != 4 || back.Code >= 89 {
		t.Fatalf("health event %+v; want GPU 4 back below its slowdown temperature", back)
	}
	r.waitTelemetry(t, "GPU 4 no longer throttled", 4, func(g contracts.GPUSample) bool {
		return g.ThrottleReasons&contracts.ThrottleHWThermal == 0 && g.TempC < 89
	})
	if n := len(r.inv.all()); n != 1 {
		t.Errorf("%d inventories: overheating changes no GPU's health", n)
	}
}

func TestRedeliveredFaultAppliesOnce(t *testing.T) {
	b := connect(t)
	const node = "h100-f3"
	r := recordNode(t, b, node)
	startAgent(t, b, testConfig(t, node))
	eventually(t, "first inventory", func() bool { return len(r.inv.all()) == 1 })

	f := contracts.Fault{ID: "dbe-once", Kind: contracts.FaultECCDBE, GPU: "1"}
	injectFault(t, b, node, f, "")
	// The same fault under other message IDs, as a redelivery past the
	// duplicate window or a second gpuctl call looks.
	injectFault(t, b, node, f, "again-1")
	waitAcked(t, b, contracts.StreamNodeCommands, node, injectFault(t, b, node, f, "again-2"))
	r.waitHealth(t, 1)
	g := r.waitTelemetry(t, "telemetry after the fault", 1, func(g contracts.GPUSample) bool { return g.ECCDBE > 0 })
	if g.ECCDBE != 1 {
		t.Fatalf("double-bit count %d after one fault sent three times; want 1", g.ECCDBE)
	}
	if n := len(r.health.all()); n != 1 {
		t.Fatalf("%d health events, want 1", n)
	}
}

func TestFaultsThatCannotApply(t *testing.T) {
	b := connect(t)
	const node = "h100-f4"
	r := recordNode(t, b, node)
	startAgent(t, b, testConfig(t, node))
	eventually(t, "first inventory", func() bool { return len(r.inv.all()) == 1 })
	dlq := record[contracts.NodeCommand](t, b, contracts.StreamDeadLetters,
		contracts.SubjectDeadLetter(contracts.StreamNodeCommands, contracts.NodeConsumer(node)))

	for _, f := range []contracts.Fault{
		{ID: "no-such-gpu", Kind: contracts.FaultXID, GPU: "9"},
		{ID: "", Kind: contracts.FaultXID},
		{ID: "bad-kind", Kind: "meteor"},
	} {
		injectFault(t, b, node, f, "cmd-"+f.ID+string(f.Kind))
	}
	eventually(t, "three dead letters", func() bool { return len(dlq.all()) == 3 })
	for i, want := range []string{"no GPU 9 on node h100-f4", "fault ID is empty", `fault kind "meteor"`} {
		if reason := dlq.header(i, contracts.HeaderDeadLetterReason); !strings.Contains(reason, want) {
			t.Errorf("dead letter %d: reason %q does not say %q", i, reason, want)
		}
	}
	// The agent goes on: a valid fault after them applies.
	injectFault(t, b, node, contracts.Fault{ID: "ok", Kind: contracts.FaultXID, GPU: "0", Code: 31}, "")
	if h := r.waitHealth(t, 1); h.Code != 31 || h.GPUIndex != 0 {
		t.Fatalf("health event %+v, want XID 31 on GPU 0", h)
	}
}

// realGPUs is a backend that, like NVML, cannot be given faults: the
// simulated machine with its fault injection and health watching hidden.
type realGPUs struct{ nodeagent.Backend }

func TestRealGPUsRefuseFaults(t *testing.T) {
	b := connect(t)
	const node = "h100-f5"
	r := recordNode(t, b, node)
	cfg := testConfig(t, node)
	m, err := sim.New(sim.Config{NodeID: node, Model: mustModel(t, "H100-80GB"), Count: 8, NVLink: true})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Backend = realGPUs{m}
	startAgent(t, b, cfg)
	eventually(t, "first inventory", func() bool { return len(r.inv.all()) == 1 })
	waitAcked(t, b, contracts.StreamNodeCommands, node,
		injectFault(t, b, node, contracts.Fault{ID: "x", Kind: contracts.FaultXID, GPU: "3"}, ""))
	r.waitTelemetry(t, "telemetry after the refused fault", 3, func(g contracts.GPUSample) bool { return g.Healthy })
	if n, k := len(r.health.all()), len(r.inv.all()); n != 0 || k != 1 {
		t.Fatalf("%d health events and %d inventories after a fault on real GPUs; want none and the first", n, k)
	}
}

func TestAgentPauseSilencesHeartbeatsAndTelemetry(t *testing.T) {
	b := connect(t)
	const node = "h100-f6"
	r := recordNode(t, b, node)
	startAgent(t, b, testConfig(t, node))
	eventually(t, "heartbeats", func() bool { return len(r.hbs.all()) >= 3 })

	// A simulated run that ends while the agent is paused: runs go on,
	// and their facts are still reported.
	a := allocation(node, "through-pause", contracts.RunSpec{Duration: contracts.Duration(500 * time.Millisecond)}, 0)
	ledger(t, b, contracts.LedgerCommitted, a, "")
	waitStarted(t, r.runs, a.ID)
	const pause = 1500 * time.Millisecond
	pausedAt := time.Now()
	waitAcked(t, b, contracts.StreamNodeCommands, node, injectFault(t, b, node,
		contracts.Fault{ID: "nap", Kind: contracts.FaultAgentPause, Duration: contracts.Duration(pause)}, ""))
	ended := waitEnded(t, r.runs, a.ID)
	eventually(t, "heartbeats again after the pause", func() bool {
		hbs := r.hbs.all()
		return len(hbs) > 0 && hbs[len(hbs)-1].Time.After(pausedAt.Add(pause+3*tick))
	})

	// The longest silence of each stream covers the pause, and the run's
	// end falls inside the heartbeats' silence.
	gap := func(times []time.Time) (from, to time.Time) {
		for i := 1; i < len(times); i++ {
			if d := times[i].Sub(times[i-1]); d > to.Sub(from) {
				from, to = times[i-1], times[i]
			}
		}
		return from, to
	}
	var hbTimes, telTimes []time.Time
	for _, h := range r.hbs.all() {
		hbTimes = append(hbTimes, h.Time)
	}
	for _, x := range r.tel.all() {
		telTimes = append(telTimes, x.Time)
	}
	for name, times := range map[string][]time.Time{"heartbeats": hbTimes, "telemetry": telTimes} {
		from, to := gap(times)
		if d := to.Sub(from); d < pause-tick || d > pause+5*time.Second {
			t.Errorf("%s: longest silence %s, want about the %s pause", name, d, pause)
		}
	}
	if from, to := gap(hbTimes); !ended.Time.After(from) || !ended.Time.Before(to) {
		t.Errorf("run ended at %s, outside the heartbeats' silence %s..%s", ended.Time, from, to)
	}
	if res := ended.Result; res.Outcome != contracts.OutcomeSucceeded {
		t.Errorf("run through the pause: %+v", res)
	}
}

func TestMachineDeathKillsRunsAndStopsTheAgent(t *testing.T) {
	b := connect(t)
	const node = "h100-f7"
	r := recordNode(t, b, node)
	cfg := testConfig(t, node)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
	ab := agentBus(t, b, node)
	go func() { done <- nodeagent.RunWithBus(ctx, cfg, ab, log) }()
	eventually(t, "first inventory", func() bool { return len(r.inv.all()) == 1 })

	pidFile := filepath.Join(t.TempDir(), "pid")
	long := allocation(node, "long", contracts.RunSpec{Command: []string{"sh", "-c", `echo $$ > ` + pidFile + `; exec sleep 60`}}, 0, 1)
	simulated := allocation(node, "simulated", contracts.RunSpec{Duration: contracts.Duration(time.Minute)}, 2)
	ledger(t, b, contracts.LedgerCommitted, long, "")
	ledger(t, b, contracts.LedgerCommitted, simulated, "")
	waitStarted(t, r.runs, long.ID)
	waitStarted(t, r.runs, simulated.ID)
	var pid int
	eventually(t, "the command's PID", func() bool {
		data, err := os.ReadFile(pidFile)
		pid, _ = strconv.Atoi(strings.TrimSpace(string(data)))
		return err == nil && pid > 0
	})

	injectFault(t, b, node, contracts.Fault{ID: "boom", Kind: contracts.FaultMachineDeath}, "")
	select {
	case err := <-done:
		if !errors.Is(err, nodeagent.ErrMachineDied) {
			t.Fatalf("RunWithBus returned %v, want ErrMachineDied", err)
		}
	case <-time.After(limit):
		t.Fatal("the agent did not stop after its machine died")
	}
	// The command is gone (killed, and reaped by the runner), not left
	// behind.
	eventually(t, "the command killed", func() bool { return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) })
	counts := func() [3]int { return [3]int{len(r.hbs.all()), len(r.tel.all()), len(r.runs.all())} }
	before := counts()
	// A dead machine says nothing: no ended facts, no heartbeats, no
	// telemetry, however long we listen. (Absence needs a wait: ten ticks.)
	time.Sleep(10 * tick)
	if after := counts(); after != before {
		t.Fatalf("messages after death (heartbeats, telemetry, run facts): %v then %v", before, after)
	}
	if _, ended := facts(r.runs, long.ID); len(ended) != 0 {
		t.Fatalf("a dead machine reported its run ended: %+v", ended)
	}

	// The machine comes back (someone starts its agent): the runs are
	// reported lost, and the old death command is history, not a new death.
	// A fresh durable consumer makes the new agent read it again at once.
	dctx, dcancel := context.WithTimeout(context.Background(), limit)
	defer dcancel()
	if err := b.JetStream().DeleteConsumer(dctx, contracts.StreamNodeCommands, contracts.NodeConsumer(node)); err != nil {
		t.Fatal(err)
	}
	startAgent(t, b, cfg)
	for _, a := range []contracts.Allocation{long, simulated} {
		if e := waitEnded(t, r.runs, a.ID); e.Result.Outcome != contracts.OutcomeFailed {
			t.Errorf("%s after the machine came back: %+v", a.ID, e.Result)
		}
	}
	eventually(t, "heartbeats of the new agent", func() bool {
		hbs := r.hbs.all()
		return len(hbs) > before[0]+3
	})
}
