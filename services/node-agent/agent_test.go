package nodeagent_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/service"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/nvmlgpu"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/sim"
)

const (
	tick  = 100 * time.Millisecond // heartbeat and telemetry interval in tests
	limit = 30 * time.Second       // bound of every wait (generous: -race on a loaded 2-core CI box)
)

// testBus is a test's own connection to a NATS server of its own: the
// operator's, which provisions the streams (in memory) and publishes
// commands, forges faults and observes. Agents connect to srv under their
// node's identity (agentBus), and ledger entries come from rm, under the
// resource manager's, as in production: the permissions the tests run
// with are the ones contracts.Access gives each.
type testBus struct {
	*bus.Bus
	srv *natsserver.Server
	rm  *bus.Bus
}

// connect starts a NATS server for t and connects the test's buses to it.
func connect(t *testing.T) *testBus {
	t.Helper()
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "test", CredsFile: natstest.Operator(t, srv),
		Streams: contracts.StreamOptions{Memory: true}})
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	rm, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "resource-manager", SkipProvision: true,
		CredsFile: natstest.Service(t, srv, contracts.BusResourceManager)})
	if err != nil {
		t.Fatalf("connect the resource manager: %v", err)
	}
	t.Cleanup(func() { _ = rm.Close(context.Background()) })
	return &testBus{Bus: b, srv: srv, rm: rm}
}

// agentBus connects node's agent to b's server under the node's own
// identity; it is closed when the test ends.
func agentBus(t *testing.T, b *testBus, node string) *bus.Bus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	ab, err := bus.Connect(ctx, bus.Config{URL: b.srv.URL(), Name: nodeagent.ServiceName + "-" + node,
		CredsFile: natstest.Node(t, b.srv, node), SkipProvision: true})
	if err != nil {
		t.Fatalf("connect agent %s: %v", node, err)
	}
	t.Cleanup(func() { _ = ab.Close(context.Background()) })
	return ab
}

func testConfig(t *testing.T, node string) nodeagent.Config {
	return nodeagent.Config{
		NodeID: node, Pool: "test", Zone: "zone-a", PriceClass: "spot", Labels: map[string]string{"tier": "test"},
		GPUModel: "H100-80GB", GPUCount: 8, NVLink: true,
		HeartbeatInterval: tick, TelemetryInterval: tick, StopGrace: 2 * time.Second,
		LogDir: t.TempDir(),
	}
}

// startAgent runs an agent until the returned stop is called (or the test
// ends); stop waits for RunWithBus to return and fails the test on error.
func startAgent(t *testing.T, b *testBus, cfg nodeagent.Config) (stop func()) {
	t.Helper()
	ab := agentBus(t, b, cfg.NodeID)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
	go func() { done <- nodeagent.RunWithBus(ctx, cfg, ab, log) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("agent %s: %v", cfg.NodeID, err)
				}
			case <-time.After(limit + cfg.StopGrace):
				t.Errorf("agent %s did not stop", cfg.NodeID)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// recorder keeps every message of a stream subject, decoded as T.
type recorder[T any] struct {
	mu   sync.Mutex
	msgs []T
	raw  []*bus.Msg
}

func record[T any](t *testing.T, b *testBus, stream, subject string) *recorder[T] {
	t.Helper()
	r := &recorder[T]{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = b.Follow(ctx, bus.FollowSpec{Stream: stream, FilterSubjects: []string{subject}}, func(_ context.Context, m *bus.Msg) error {
			var v T
			if err := m.Decode(&v); err != nil {
				t.Errorf("%s: %v", subject, err)
				return nil
			}
			r.mu.Lock()
			r.msgs = append(r.msgs, v)
			r.raw = append(r.raw, m)
			r.mu.Unlock()
			return nil
		}, nil)
	}()
	t.Cleanup(func() { cancel(); <-done })
	return r
}

// header returns a header of the i-th message.
func (r *recorder[T]) header(i int, key string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.raw[i].Header.Get(key)
}

func (r *recorder[T]) all() []T {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]T(nil), r.msgs...)
}

// facts returns the run facts of one allocation.
func facts(r *recorder[contracts.RunEvent], allocID string) (started, ended []contracts.RunEvent) {
	for _, ev := range r.all() {
		if ev.AllocationID != allocID {
			continue
		}
		switch ev.Kind {
		case contracts.RunStarted:
			started = append(started, ev)
		case contracts.RunEnded:
			ended = append(ended, ev)
		}
	}
	return started, ended
}

func waitEnded(t *testing.T, r *recorder[contracts.RunEvent], allocID string) contracts.RunEvent {
	t.Helper()
	var ended []contracts.RunEvent
	eventually(t, "ended fact of "+allocID, func() bool { _, ended = facts(r, allocID); return len(ended) > 0 })
	return ended[0]
}

func waitStarted(t *testing.T, r *recorder[contracts.RunEvent], allocID string) contracts.RunEvent {
	t.Helper()
	var started []contracts.RunEvent
	eventually(t, "started fact of "+allocID, func() bool { started, _ = facts(r, allocID); return len(started) > 0 })
	return started[0]
}

func allocation(node, job string, spec contracts.RunSpec, gpus ...int) contracts.Allocation {
	a := contracts.Allocation{ID: contracts.AllocationID("acme", job, 1), Tenant: "acme", JobID: job, Attempt: 1,
		NodeID: node, Pool: "test", Run: spec}
	for _, i := range gpus {
		a.Devices = append(a.Devices, contracts.DeviceRef{Index: i, UUID: sim.UUID(node, i), Model: "H100-80GB"})
	}
	return a
}

// ledger publishes an entry as the resource manager (b.rm), and returns
// its stream sequence. msgID "" means the contract's LedgerEntryID.
func ledger(t *testing.T, b *testBus, kind contracts.LedgerKind, a contracts.Allocation, msgID string) uint64 {
	t.Helper()
	return publishLedger(t, b.rm, kind, a, msgID)
}

// publishLedger publishes a ledger entry on p, whoever p is.
func publishLedger(t *testing.T, p *bus.Bus, kind contracts.LedgerKind, a contracts.Allocation, msgID string) uint64 {
	t.Helper()
	if msgID == "" {
		msgID = contracts.LedgerEntryID(kind, a.ID)
	}
	e := contracts.LedgerEntry{SchemaVersion: contracts.SchemaVersion, Kind: kind, Allocation: a, Time: time.Now()}
	if kind == contracts.LedgerReleased {
		e.Reason = contracts.ReasonNodeLost
	}
	ack, err := p.Publish(context.Background(), contracts.SubjectLedger(a.NodeID), msgID, e)
	if err != nil {
		t.Fatal(err)
	}
	return ack.Sequence
}

func stopRun(t *testing.T, b *testBus, a contracts.Allocation, grace time.Duration) uint64 {
	t.Helper()
	c := contracts.NodeCommand{SchemaVersion: contracts.SchemaVersion, Kind: contracts.CommandStopRun, AllocationID: a.ID,
		Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, Reason: contracts.ReasonCancelled,
		GracePeriod: contracts.Duration(grace), Time: time.Now()}
	ack, err := b.Publish(context.Background(), contracts.SubjectNodeCommands(a.NodeID),
		contracts.NodeCommandID(contracts.CommandStopRun, a.ID), c)
	if err != nil {
		t.Fatal(err)
	}
	return ack.Sequence
}

// waitAcked waits until the agent's durable consumer on stream has acked
// everything up to seq: the agent has handled that message.
func waitAcked(t *testing.T, b *testBus, stream, node string, seq uint64) {
	t.Helper()
	eventually(t, fmt.Sprintf("%s seq %d acked by node %s", stream, seq, node), func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		c, err := b.JetStream().Consumer(ctx, stream, contracts.NodeConsumer(node))
		if err != nil {
			return false
		}
		info, err := c.Info(ctx)
		return err == nil && info.AckFloor.Stream >= seq
	})
}

// countingRunner launches real runs and counts launches per allocation:
// the observable proof that a run was never started twice. It keeps the
// local runner's other methods, so runs left by an agent are re-adopted.
type countingRunner struct {
	*runner.Local
	mu sync.Mutex
	n  map[string]int
}

func newCountingRunner(t *testing.T) *countingRunner {
	return &countingRunner{Local: &runner.Local{LogDir: t.TempDir()}, n: map[string]int{}}
}

func (r *countingRunner) Launch(ctx context.Context, l runner.Launch) (runner.Process, error) {
	r.mu.Lock()
	r.n[l.AllocationID]++
	r.mu.Unlock()
	return r.Local.Launch(ctx, l)
}

func (r *countingRunner) launches(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n[id]
}

func TestAgentsReportInventoryHeartbeatsAndTelemetry(t *testing.T) {
	b := connect(t)
	nodes := []string{"h100-01", "h100-02"} // two agents sharing one connection
	inv := map[string]*recorder[contracts.NodeInventory]{}
	hbs := map[string]*recorder[contracts.Heartbeat]{}
	tel := map[string]*recorder[contracts.Telemetry]{}
	for _, n := range nodes {
		inv[n] = record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(n))
		hbs[n] = record[contracts.Heartbeat](t, b, contracts.StreamHeartbeats, contracts.SubjectHeartbeat(n))
		tel[n] = record[contracts.Telemetry](t, b, contracts.StreamTelemetry, contracts.SubjectTelemetry(n))
		cfg := testConfig(t, n)
		cfg.Purpose = "training"
		cfg.Taints = []contracts.Taint{{Key: "gpuplane.io/spot", Value: "true", Effect: contracts.TaintNoSchedule},
			{Key: "team", Effect: contracts.TaintPreferNoSchedule}}
		startAgent(t, b, cfg)
	}
	for _, n := range nodes {
		eventually(t, "inventory of "+n, func() bool { return len(inv[n].all()) == 1 })
		got := inv[n].all()[0]
		if d := cmp.Diff([]contracts.Taint{{Key: "gpuplane.io/spot", Value: "true", Effect: contracts.TaintNoSchedule},
			{Key: "team", Effect: contracts.TaintPreferNoSchedule}}, got.Taints); d != "" || got.Purpose != "training" {
			t.Errorf("inventory of %s: purpose %q, taints (-want +got):\n%s", n, got.Purpose, d)
		}
		if got.NodeID != n || got.Pool != "test" || got.Zone != "zone-a" || got.PriceClass != "spot" ||
			got.Labels["tier"] != "test" || got.Backend != "sim" || got.Incarnation == "" ||
			got.CPUMilli != 8*24000 || got.MemoryMiB != 8*256*1024 || len(got.GPUs) != 8 {
			t.Fatalf("inventory of %s: %+v", n, got)
		}
		for i, g := range got.GPUs {
			if g.UUID != sim.UUID(n, i) || g.MemoryMiB != 81559 || g.NVLinkDomain != n || !g.Healthy {
				t.Fatalf("inventory of %s, gpu %d: %+v", n, i, g)
			}
		}
		if ce := inv[n].header(0, contracts.HeaderCEType); ce != "io.gpuplane.node.inventory.v1" {
			t.Errorf("inventory ce-type %q", ce)
		}

		eventually(t, "3 heartbeats of "+n, func() bool { return len(hbs[n].all()) >= 3 })
		for i, hb := range hbs[n].all()[:3] {
			if hb.NodeID != n || hb.Seq != uint64(i+1) || hb.Incarnation != got.Incarnation || len(hb.Runs) != 0 {
				t.Fatalf("heartbeat %d of %s: %+v", i, n, hb)
			}
		}

		eventually(t, "10 telemetry batches of "+n, func() bool { return len(tel[n].all()) >= 10 })
		batches := tel[n].all()
		for i, m := range batches {
			if m.NodeID != n || len(m.GPUs) != 8 {
				t.Fatalf("batch %d of %s: node %s, %d GPUs; want one message with all 8", i, n, m.NodeID, len(m.GPUs))
			}
			for _, g := range m.GPUs {
				if g.GPUUtil != 0 || g.AllocationID != "" || g.TempC > 36 {
					t.Fatalf("idle machine %s reports %+v", n, g)
				}
			}
			// One batch per tick: never two for the same instant. (Not
			// how far apart: a ticker delayed on a busy machine sends
			// its next tick early to catch up, and that is no fault.)
			if i > 0 && !m.Time.After(batches[i-1].Time) {
				t.Fatalf("batches %d and %d of %s are at %s and %s; want one per tick, each later than the last", i-1, i, n, batches[i-1].Time, m.Time)
			}
		}
	}
}

func TestCommittedSimulatedRunsStartAndEnd(t *testing.T) {
	b := connect(t)
	const node = "h100-01"
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	hbs := record[contracts.Heartbeat](t, b, contracts.StreamHeartbeats, contracts.SubjectHeartbeat(node))
	tel := record[contracts.Telemetry](t, b, contracts.StreamTelemetry, contracts.SubjectTelemetry(node))
	startAgent(t, b, testConfig(t, node))

	ok := allocation(node, "ok", contracts.RunSpec{Duration: contracts.Duration(time.Second)}, 0, 1)
	bad := allocation(node, "bad", contracts.RunSpec{Duration: contracts.Duration(300 * time.Millisecond), ExitCode: 2}, 2)
	ledger(t, b, contracts.LedgerCommitted, ok, "")
	ledger(t, b, contracts.LedgerCommitted, bad, "")

	started := waitStarted(t, runs, ok.ID)
	if started.NodeID != node || started.Tenant != "acme" || started.JobID != "ok" || started.Attempt != 1 || len(started.Devices) != 2 {
		t.Fatalf("started fact %+v", started)
	}
	if ce := runs.header(0, contracts.HeaderMsgID); !strings.HasPrefix(ce, "run/started/acme/") {
		t.Errorf("run fact Nats-Msg-Id %q", ce)
	}
	// While it runs, heartbeats name it and its GPUs work.
	eventually(t, "a heartbeat naming the run", func() bool {
		for _, hb := range hbs.all() {
			if len(hb.Runs) == 2 && hb.Runs[0] == bad.ID && hb.Runs[1] == ok.ID {
				return true
			}
		}
		return false
	})
	eventually(t, "telemetry of busy GPUs", func() bool {
		for _, m := range tel.all() {
			g := m.GPUs
			if g[0].AllocationID == ok.ID && g[1].AllocationID == ok.ID && g[0].GPUUtil >= 85 &&
				g[0].GPUUtil > g[3].GPUUtil && g[0].FBUsedMiB > 0 && g[0].FBUsedMiB <= 81559 && g[3].AllocationID == "" {
				return true
			}
		}
		return false
	})

	for _, c := range []struct {
		a        contracts.Allocation
		d        time.Duration
		outcome  contracts.RunOutcome
		exitCode int
		reason   contracts.Reason
	}{
		{ok, time.Second, contracts.OutcomeSucceeded, 0, ""},
		{bad, 300 * time.Millisecond, contracts.OutcomeFailed, 2, contracts.ReasonExitNonZero},
	} {
		s := waitStarted(t, runs, c.a.ID)
		e := waitEnded(t, runs, c.a.ID)
		r := e.Result
		if r == nil || r.Outcome != c.outcome || r.ExitCode != c.exitCode || r.Reason != c.reason {
			t.Fatalf("%s ended with %+v; want %s, exit %d, reason %q", c.a.ID, r, c.outcome, c.exitCode, c.reason)
		}
		if !r.StartedAt.Equal(s.Time) || !e.Time.Equal(r.EndedAt) {
			t.Fatalf("%s: result times %s..%s, started fact at %s, ended fact at %s", c.a.ID, r.StartedAt, r.EndedAt, s.Time, e.Time)
		}
		if d := r.EndedAt.Sub(r.StartedAt); d < c.d || d > c.d+3*time.Second {
			t.Fatalf("%s ran %s, want about %s", c.a.ID, d, c.d)
		}
	}
	eventually(t, "heartbeats after the runs name none", func() bool {
		all := hbs.all()
		return len(all[len(all)-1].Runs) == 0
	})
}

func TestCommandSeesExactlyItsDevices(t *testing.T) {
	b := connect(t)
	const node = "h100-01"
	cfg := testConfig(t, node)
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	startAgent(t, b, cfg)

	a := allocation(node, "cuda", contracts.RunSpec{Command: []string{"sh", "-c", "echo $CUDA_VISIBLE_DEVICES; exit 3"}}, 2, 5)
	ledger(t, b, contracts.LedgerCommitted, a, "")
	e := waitEnded(t, runs, a.ID)
	if r := e.Result; r.Outcome != contracts.OutcomeFailed || r.ExitCode != 3 || r.Reason != contracts.ReasonExitNonZero || r.StartedAt.IsZero() {
		t.Fatalf("result %+v, want failed with exit code 3", r)
	}
	out, err := os.ReadFile(runner.LogPath(cfg.LogDir, a.ID))
	if err != nil {
		t.Fatal(err)
	}
	if want := sim.UUID(node, 2) + "," + sim.UUID(node, 5) + "\n"; string(out) != want {
		t.Fatalf("run log %q, want exactly the allocated UUIDs %q", out, want)
	}
}

// TestGangPartGetsItsRankAndPeers: a part of a job spanning machines
// learns which part it is and where the others run.
func TestGangPartGetsItsRankAndPeers(t *testing.T) {
	b := connect(t)
	const node = "h100-02"
	cfg := testConfig(t, node)
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	startAgent(t, b, cfg)

	a := allocation(node, "train", contracts.RunSpec{Command: []string{"sh", "-c",
		`echo "$GPUPLANE_GANG_RANK|$GPUPLANE_GANG_SIZE|$GPUPLANE_GANG_NODES|$GPUPLANE_ALLOCATION_ID"`},
		Env: map[string]string{"GPUPLANE_GANG_RANK": "0"}}, 0, 1)
	a.ID = contracts.AllocationPartID("acme", "train", 1, 1)
	a.Gang = &contracts.GangPart{Rank: 1, Size: 3, Nodes: []string{"h100-01", node, "h100-03"}}
	ledger(t, b, contracts.LedgerCommitted, a, "")
	if e := waitEnded(t, runs, a.ID); e.Result.Outcome != contracts.OutcomeSucceeded {
		t.Fatalf("result %+v", e.Result)
	}
	out, err := os.ReadFile(runner.LogPath(cfg.LogDir, a.ID))
	if err != nil {
		t.Fatal(err)
	}
	if want := "1|3|h100-01,h100-02,h100-03|acme/train/1#1\n"; string(out) != want {
		t.Fatalf("run log %q, want %q", out, want)
	}
}

func TestStopRunKillsTheCommandWithinTheGrace(t *testing.T) {
	b := connect(t)
	const node = "h100-01"
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	startAgent(t, b, testConfig(t, node))

	for _, c := range []struct {
		job      string
		command  []string
		exitCode int
	}{
		{"polite", []string{"sleep", "60"}, 128 + 15},
		// Ignores SIGTERM (and so does its sleep): SIGKILL after the grace.
		{"stubborn", []string{"sh", "-c", `trap "" TERM; sleep 60`}, 128 + 9},
	} {
		const grace = 500 * time.Millisecond
		a := allocation(node, c.job, contracts.RunSpec{Command: c.command}, 0)
		ledger(t, b, contracts.LedgerCommitted, a, "")
		waitStarted(t, runs, a.ID)
		stoppedAt := time.Now()
		stopRun(t, b, a, grace)
		stopRun(t, b, a, grace) // a repeated command is harmless
		e := waitEnded(t, runs, a.ID)
		took := time.Since(stoppedAt)
		r := e.Result
		if r.Outcome != contracts.OutcomeCancelled || r.Reason != contracts.ReasonCancelled || r.ExitCode != c.exitCode {
			t.Fatalf("%s: result %+v, want cancelled by the user with exit %d", c.job, r, c.exitCode)
		}
		if took > grace+3*time.Second {
			t.Fatalf("%s: ended %s after the stop, grace is %s", c.job, took, grace)
		}
	}
}

func TestStopBeforeCommitNeverStarts(t *testing.T) {
	b := connect(t)
	const node = "h100-01"
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	cfg := testConfig(t, node)
	counter := newCountingRunner(t)
	cfg.Runner = counter

	// Before the agent exists: both in its backlog, in the worst order.
	early := allocation(node, "early", contracts.RunSpec{Duration: contracts.Duration(time.Minute)}, 0)
	stopRun(t, b, early, 0)
	ledger(t, b, contracts.LedgerCommitted, early, "")
	startAgent(t, b, cfg)

	// While it runs: the stop is handled before the commit arrives.
	late := allocation(node, "late", contracts.RunSpec{Duration: contracts.Duration(time.Minute)}, 1)
	waitAcked(t, b, contracts.StreamNodeCommands, node, stopRun(t, b, late, 0))
	ledger(t, b, contracts.LedgerCommitted, late, "")

	for _, a := range []contracts.Allocation{early, late} {
		e := waitEnded(t, runs, a.ID)
		if r := e.Result; r.Outcome != contracts.OutcomeCancelled || r.Reason != contracts.ReasonCancelled ||
			!r.StartedAt.IsZero() || r.ExitCode != nodeagent.NoExitCode {
			t.Fatalf("%s: result %+v, want cancelled with no start", a.ID, r)
		}
		if started, _ := facts(runs, a.ID); len(started) != 0 || counter.launches(a.ID) != 0 {
			t.Fatalf("%s was started (%d facts, %d launches)", a.ID, len(started), counter.launches(a.ID))
		}
	}
}

func TestRedeliveredCommitDoesNotStartTwice(t *testing.T) {
	b := connect(t)
	const node = "h100-01"
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	cfg := testConfig(t, node)
	counter := newCountingRunner(t)
	cfg.Runner = counter
	startAgent(t, b, cfg)

	a := allocation(node, "once", contracts.RunSpec{Duration: contracts.Duration(500 * time.Millisecond)}, 3)
	ledger(t, b, contracts.LedgerCommitted, a, "")
	waitStarted(t, runs, a.ID)
	// The same entry again under another message ID, as a redelivery past
	// JetStream's duplicate window looks: once while the run runs, once
	// after it ended.
	waitAcked(t, b, contracts.StreamAllocations, node, ledger(t, b, contracts.LedgerCommitted, a, "again-1"))
	waitEnded(t, runs, a.ID)
	waitAcked(t, b, contracts.StreamAllocations, node, ledger(t, b, contracts.LedgerCommitted, a, "again-2"))

	if n := counter.launches(a.ID); n != 1 {
		t.Fatalf("launched %d times, want once", n)
	}
	if started, ended := facts(runs, a.ID); len(started) != 1 || len(ended) != 1 {
		t.Fatalf("%d started and %d ended facts, want one each", len(started), len(ended))
	}
}

func TestRestartMidRunReportsAgentRestartedAndNeverStartsAgain(t *testing.T) {
	b := connect(t)
	const node = "h100-01"
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	inv := record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(node))
	cfg := testConfig(t, node)
	counter := newCountingRunner(t)
	cfg.Runner = counter

	stop := startAgent(t, b, cfg)
	long := allocation(node, "long", contracts.RunSpec{Command: []string{"sleep", "60"}}, 0, 1, 2, 3)
	committedSeq := ledger(t, b, contracts.LedgerCommitted, long, "")
	started := waitStarted(t, runs, long.ID)
	stop()

	// The new agent reads the whole ledger again with a fresh durable: only
	// its run facts keep it from starting the allocation a second time.
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	if err := b.JetStream().DeleteConsumer(ctx, contracts.StreamAllocations, "node-agent-"+node); err != nil {
		t.Fatal(err)
	}
	startAgent(t, b, cfg)
	e := waitEnded(t, runs, long.ID)
	// The stopping agent stopped the command (SIGTERM): its shim kept the
	// exit code for the next agent.
	if r := e.Result; r.Outcome != contracts.OutcomeFailed || r.Reason != contracts.ReasonAgentRestart ||
		!r.StartedAt.Equal(started.Time) || r.EndedAt.Before(r.StartedAt) || r.ExitCode != 128+15 {
		t.Fatalf("result %+v, want failed agent_restarted from %s with exit code 143", r, started.Time)
	}
	eventually(t, "second inventory", func() bool { return len(inv.all()) == 2 })
	if i := inv.all(); i[0].Incarnation == i[1].Incarnation {
		t.Fatalf("both agents have incarnation %s", i[0].Incarnation)
	}
	waitAcked(t, b, contracts.StreamAllocations, node, committedSeq)
	if n := counter.launches(long.ID); n != 1 {
		t.Fatalf("launched %d times, want once", n)
	}
	if s, _ := facts(runs, long.ID); len(s) != 1 {
		t.Fatalf("%d started facts", len(s))
	}
}

func TestAllocationsThatMustNotRun(t *testing.T) {
	b := connect(t)
	const node = "h100-01"
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	cfg := testConfig(t, node)
	counter := newCountingRunner(t)
	cfg.Runner = counter

	// Committed and released while the agent was away (the node was lost):
	// its devices may be someone else's now.
	gone := allocation(node, "gone", contracts.RunSpec{Duration: contracts.Duration(time.Minute)}, 0)
	ledger(t, b, contracts.LedgerCommitted, gone, "")
	releasedSeq := ledger(t, b, contracts.LedgerReleased, gone, "")
	startAgent(t, b, cfg)

	missing := allocation(node, "missing", contracts.RunSpec{Command: []string{"/nonexistent/program"}}, 1)
	foreign := allocation(node, "foreign", contracts.RunSpec{Duration: contracts.Duration(time.Second)}, 2)
	foreign.Devices[0].UUID = sim.UUID("other-node", 2)
	ledger(t, b, contracts.LedgerCommitted, missing, "")
	ledger(t, b, contracts.LedgerCommitted, foreign, "")

	for _, a := range []contracts.Allocation{missing, foreign} {
		e := waitEnded(t, runs, a.ID)
		if r := e.Result; r.Outcome != contracts.OutcomeFailed || r.Reason != contracts.ReasonLaunchFailed || !r.StartedAt.IsZero() {
			t.Fatalf("%s: result %+v, want failed launch with no start", a.ID, r)
		}
		if s, _ := facts(runs, a.ID); len(s) != 0 {
			t.Fatalf("%s has a started fact", a.ID)
		}
	}
	if e := waitEnded(t, runs, missing.ID); e.Result.ExitCode != 127 {
		t.Errorf("missing program: exit code %d, want 127", e.Result.ExitCode)
	}
	waitAcked(t, b, contracts.StreamAllocations, node, releasedSeq)
	if s, e := facts(runs, gone.ID); len(s)+len(e) != 0 || counter.launches(gone.ID) != 0 {
		t.Fatalf("released allocation: %d started, %d ended, %d launches; want nothing", len(s), len(e), counter.launches(gone.ID))
	}
}

// TestLedgerEntriesNotFromTheResourceManagerAreRefused: the agent acts
// only on ledger entries the resource manager published (issue 12's
// defence in depth). The operator may publish anywhere, so its forgeries
// reach the agent: a forged commit is dead-lettered and never run, and a
// forged release in the history does not keep the real commit from
// running.
func TestLedgerEntriesNotFromTheResourceManagerAreRefused(t *testing.T) {
	tests := []struct {
		name string
		// forge publishes the forgery, before (history) or after the
		// agent started, and returns the allocation the real resource
		// manager then commits.
		forge   func(t *testing.T, b *testBus, node string) (forgedSeq uint64, real contracts.Allocation)
		history bool
	}{
		{name: "forged commit", forge: func(t *testing.T, b *testBus, node string) (uint64, contracts.Allocation) {
			forged := allocation(node, "forged", contracts.RunSpec{Duration: contracts.Duration(time.Minute)}, 0)
			return publishLedger(t, b.Bus, contracts.LedgerCommitted, forged, ""),
				allocation(node, "real", contracts.RunSpec{Duration: contracts.Duration(time.Second)}, 1)
		}},
		{name: "forged release in the history", history: true, forge: func(t *testing.T, b *testBus, node string) (uint64, contracts.Allocation) {
			real := allocation(node, "real", contracts.RunSpec{Duration: contracts.Duration(time.Second)}, 1)
			return publishLedger(t, b.Bus, contracts.LedgerReleased, real, ""), real
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := connect(t)
			const node = "h100-01"
			runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
			dead := record[json.RawMessage](t, b, contracts.StreamDeadLetters,
				contracts.SubjectDeadLetter(contracts.StreamAllocations, contracts.NodeConsumer(node)))
			cfg := testConfig(t, node)
			counter := newCountingRunner(t)
			cfg.Runner = counter
			var forgedSeq uint64
			var real contracts.Allocation
			if tc.history {
				forgedSeq, real = tc.forge(t, b, node)
				startAgent(t, b, cfg)
			} else {
				startAgent(t, b, cfg)
				forgedSeq, real = tc.forge(t, b, node)
			}
			if src := "/gpuplane/" + b.Name(); strings.HasPrefix(src, "/gpuplane/resource-manager") {
				t.Fatalf("the forger's source %s is the resource manager's", src)
			}
			waitAcked(t, b, contracts.StreamAllocations, node, forgedSeq)
			ledger(t, b, contracts.LedgerCommitted, real, "")
			// The real commit runs: a forged release did not stop it.
			waitEnded(t, runs, real.ID)
			for _, ev := range runs.all() {
				if ev.AllocationID != real.ID {
					t.Errorf("a run fact of %s, which only the forger committed: %+v", ev.AllocationID, ev)
				}
			}
			if n := counter.launches(real.ID); n != 1 {
				t.Errorf("%s launched %d times, want 1", real.ID, n)
			}
			// The forgery is parked as a dead letter, with the reason.
			eventually(t, "the forged entry dead-lettered", func() bool { return len(dead.all()) == 1 })
			if r := dead.header(0, contracts.HeaderDeadLetterReason); !strings.Contains(r, "not the resource manager") {
				t.Errorf("dead letter reason %q", r)
			}
		})
	}
}

func TestReleaseWhileRunningStopsTheRun(t *testing.T) {
	b := connect(t)
	const node = "h100-01"
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	startAgent(t, b, testConfig(t, node))

	a := allocation(node, "lost", contracts.RunSpec{Duration: contracts.Duration(time.Minute)}, 0)
	ledger(t, b, contracts.LedgerCommitted, a, "")
	waitStarted(t, runs, a.ID)
	ledger(t, b, contracts.LedgerReleased, a, "")
	e := waitEnded(t, runs, a.ID)
	if r := e.Result; r.Outcome != contracts.OutcomeFailed || r.Reason != contracts.ReasonNodeLost {
		t.Fatalf("result %+v, want failed node_lost", r)
	}
}

func TestRunConnectsWithItsBusConfig(t *testing.T) {
	srv := natstest.Start(t)
	cfg := testConfig(t, "l4-01")
	cfg.GPUModel, cfg.GPUCount, cfg.NVLink = "L4", 4, false
	cfg.Bus = service.BusConfig{NATSURL: srv.URL(), Replicas: 1, Creds: natstest.Node(t, srv, "l4-01")}

	bad := cfg
	bad.Bus.Replicas, bad.GPUCount = 2, 0
	if err := nodeagent.Run(context.Background(), bad, nil); err == nil ||
		!strings.Contains(err.Error(), "replicas") || !strings.Contains(err.Error(), "gpu count") {
		t.Fatalf("Run with a broken config: %v; want both problems reported", err)
	}

	// A node agent may not create streams: the services (here the
	// operator observing) do.
	observer, err := bus.Connect(context.Background(), bus.Config{URL: srv.URL(), Name: "observer", CredsFile: natstest.Operator(t, srv)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = observer.Close(context.Background()) })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- nodeagent.Run(ctx, cfg, slog.New(slog.NewTextHandler(t.Output(), nil))) }()
	eventually(t, "inventory of l4-01", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		s, err := observer.JetStream().Stream(ctx, contracts.StreamNodes)
		if err != nil {
			return false
		}
		m, err := s.GetLastMsgForSubject(ctx, contracts.SubjectInventory("l4-01"))
		return err == nil && strings.Contains(string(m.Data), `"model":"L4"`)
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(limit):
		t.Fatal("Run did not return after cancel")
	}
}

// TestInventoryIsRepublished: NODES ages messages out, so the agent
// republishes its inventory on an interval, under new message IDs (one
// incarnation), for services that start long after it.
func TestInventoryIsRepublished(t *testing.T) {
	b := connect(t)
	inv := record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory("n-inv"))
	cfg := testConfig(t, "n-inv")
	cfg.InventoryInterval = 3 * tick
	startAgent(t, b, cfg)
	eventually(t, "three inventories", func() bool { return len(inv.all()) >= 3 })
	all := inv.all()
	if all[0].Incarnation == "" || all[1].Incarnation != all[0].Incarnation || all[2].Incarnation != all[0].Incarnation {
		t.Fatalf("republished inventories changed incarnation: %q %q %q", all[0].Incarnation, all[1].Incarnation, all[2].Incarnation)
	}
}

// TestNVMLBackendRefusesToStartWithoutTheDriver: an agent told to read
// the machine's GPUs through NVML, on a machine without the NVIDIA
// driver, stops at once with an error naming the missing library, and
// publishes nothing.
func TestNVMLBackendRefusesToStartWithoutTheDriver(t *testing.T) {
	if lib := nvml.New(); lib.Init() == nvml.SUCCESS {
		_ = lib.Shutdown()
		t.Skip("this machine has the NVIDIA driver (libnvidia-ml.so.1 loads): the refusal needs a machine without it")
	}
	b := connect(t)
	cfg := testConfig(t, "gpu-01")
	cfg.BackendKind = nodeagent.BackendNVML
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	err := nodeagent.RunWithBus(ctx, cfg, agentBus(t, b, "gpu-01"), slog.New(slog.NewTextHandler(t.Output(), nil)))
	if !errors.Is(err, nvmlgpu.ErrLibraryNotFound) {
		t.Fatalf("RunWithBus: %v; want an error wrapping nvmlgpu.ErrLibraryNotFound", err)
	}
	for _, want := range []string{"gpu-01", "NVIDIA driver library libnvidia-ml.so.1 not found", "use backend sim"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	s, err := b.JetStream().Stream(ctx, contracts.StreamNodes)
	if err != nil {
		t.Fatal(err)
	}
	if m, err := s.GetLastMsgForSubject(ctx, contracts.SubjectInventory("gpu-01")); err == nil {
		t.Errorf("an agent that refused to start published an inventory: %s", m.Data)
	}
}
