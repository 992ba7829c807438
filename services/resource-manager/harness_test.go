package resourcemanager_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/service"
	resourcemanager "github.com/gpuplane/gpuplane/services/resource-manager"
)

// clock is an injected clock tests move by hand.
type clock struct{ ns atomic.Int64 }

func newClock() *clock {
	c := &clock{}
	c.ns.Store(time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC).UnixNano())
	return c
}

func (c *clock) Now() time.Time          { return time.Unix(0, c.ns.Load()).UTC() }
func (c *clock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

// counter counts log records by message, so a test can see that something
// it cannot observe on the bus did happen (a compare-and-set conflict).
// RM_TEST_LOG=1 also prints them.
type counter struct {
	mu     sync.Mutex
	counts map[string]int
	// ints are the last integer attributes by message and key
	// ("snapshot loaded.retired_allocations").
	ints map[string]int64
	base slog.Handler
}

func newCounter() *counter {
	var w io.Writer = io.Discard
	if os.Getenv("RM_TEST_LOG") != "" {
		w = os.Stderr
	}
	return &counter{counts: map[string]int{}, ints: map[string]int64{}, base: slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug})}
}

func (c *counter) logger() *slog.Logger { return slog.New(countingHandler{root: c, next: c.base}) }

// countingHandler counts into its root counter and passes records on.
type countingHandler struct {
	root *counter
	next slog.Handler
}

func (h countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h countingHandler) Handle(ctx context.Context, r slog.Record) error {
	h.root.mu.Lock()
	h.root.counts[r.Message]++
	r.Attrs(func(a slog.Attr) bool {
		if a.Value.Kind() == slog.KindInt64 {
			h.root.ints[r.Message+"."+a.Key] = a.Value.Int64()
		}
		return true
	})
	h.root.mu.Unlock()
	return h.next.Handle(ctx, r)
}
func (h countingHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return countingHandler{root: h.root, next: h.next.WithAttrs(as)}
}
func (h countingHandler) WithGroup(g string) slog.Handler {
	return countingHandler{root: h.root, next: h.next.WithGroup(g)}
}

// lastInt is the integer attribute key of the last record logged with
// message msg (its own attributes, not a logger's).
func (c *counter) lastInt(msg, key string) (int64, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	v, ok := c.ints[msg+"."+key]
	return v, ok
}

func (c *counter) count(msg string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.counts[msg]
}

// ledgerRecord is one ALLOCATIONS message the harness saw.
type ledgerRecord struct {
	seq    uint64
	source string
	entry  contracts.LedgerEntry
}

// harness is a real embedded JetStream, a test connection that plays the
// node agents and the scheduler, and a watcher recording what the resource
// managers publish.
type harness struct {
	t     testing.TB
	srv   *natsserver.Server
	bus   *bus.Bus
	clock *clock
	logs  *counter

	mu         sync.Mutex
	entries    []ledgerRecord
	refusals   map[string]contracts.Refusal // by RefusalID
	nodeEvents []contracts.NodeEvent
	deadPlans  int
}

func newHarness(t testing.TB) *harness {
	t.Helper()
	h := &harness{t: t, srv: natstest.Start(t), clock: newClock(), logs: newCounter(), refusals: map[string]contracts.Refusal{}}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	// The test's client plays the scheduler, the node agents and the
	// observers: the operator. Each resource manager runs with its own
	// identity (config), which proves its permissions suffice.
	b, err := bus.Connect(ctx, bus.Config{URL: h.srv.URL(), Name: "test", Logger: slog.New(slog.DiscardHandler),
		CredsFile: natstest.Operator(t, h.srv)})
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	h.bus = b
	wctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() {
		stop()
		wg.Wait()
		_ = b.Close(context.Background())
	})
	wg.Go(func() {
		_ = b.Follow(wctx, bus.FollowSpec{Stream: contracts.StreamAllocations}, func(_ context.Context, m *bus.Msg) error {
			h.mu.Lock()
			defer h.mu.Unlock()
			switch {
			case strings.HasPrefix(m.Subject, "gp.alloc.ledger."):
				var e contracts.LedgerEntry
				if err := m.Decode(&e); err != nil {
					t.Errorf("undecodable ledger entry: %v", err)
					return nil
				}
				h.entries = append(h.entries, ledgerRecord{seq: m.StreamSeq, source: m.Header.Get(contracts.HeaderCESource), entry: e})
			default:
				var r contracts.Refusal
				if err := m.Decode(&r); err != nil {
					t.Errorf("undecodable refusal: %v", err)
					return nil
				}
				h.refusals[m.ID()] = r
			}
			return nil
		}, nil)
	})
	wg.Go(func() {
		_ = b.Follow(wctx, bus.FollowSpec{Stream: contracts.StreamNodes, FilterSubjects: []string{contracts.SubjectNodeLifecycleAll}},
			func(_ context.Context, m *bus.Msg) error {
				var ev contracts.NodeEvent
				if err := m.Decode(&ev); err != nil {
					t.Errorf("undecodable node event: %v", err)
					return nil
				}
				h.mu.Lock()
				h.nodeEvents = append(h.nodeEvents, ev)
				h.mu.Unlock()
				return nil
			}, nil)
	})
	wg.Go(func() {
		_ = b.Follow(wctx, bus.FollowSpec{Stream: contracts.StreamDeadLetters}, func(_ context.Context, m *bus.Msg) error {
			h.mu.Lock()
			if m.Header.Get(contracts.HeaderDeadLetterStream) == contracts.StreamPlans {
				h.deadPlans++
			}
			h.mu.Unlock()
			return nil
		}, nil)
	})
	return h
}

func (h *harness) config(name string) resourcemanager.Config {
	cfg := resourcemanager.DefaultConfig()
	cfg.Bus = service.BusConfig{NATSURL: h.srv.URL(), Replicas: 1,
		Creds: natstest.Service(h.t, h.srv, contracts.BusResourceManager)}
	cfg.Name = name
	cfg.HeartbeatTimeout = 6 * time.Second
	cfg.LivenessInterval = 10 * time.Millisecond
	cfg.Now = h.clock.Now
	return cfg
}

// rm is one running resource manager.
type rm struct {
	stop func()
}

// start runs a resource manager until the test ends or stop is called.
func (h *harness) start(cfg resourcemanager.Config) *rm {
	h.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- resourcemanager.Run(ctx, cfg, h.logs.logger().With("rm", cfg.Name)) }()
	var once sync.Once
	r := &rm{stop: func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					h.t.Errorf("Run(%s) = %v, want nil on shutdown", cfg.Name, err)
				}
			case <-time.After(20 * time.Second):
				h.t.Errorf("Run(%s) did not return after cancel", cfg.Name)
			}
		})
	}}
	h.t.Cleanup(r.stop)
	return r
}

func (h *harness) publish(subject, id string, v any) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := h.bus.Publish(ctx, subject, id, v); err != nil {
		h.t.Fatalf("publish %s: %v", subject, err)
	}
}

func gpuUUID(node string, i int) string { return fmt.Sprintf("GPU-%s-%d", node, i) }

// inventory publishes a node's inventory as its agent would.
func (h *harness) inventory(node, incarnation string, n int, model string) {
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: node, Hostname: node, Pool: "default",
		MachineType: "sim", Backend: "sim", Incarnation: incarnation, Time: h.clock.Now()}
	for i := range n {
		inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: gpuUUID(node, i), Model: model, MemoryMiB: 81920, Healthy: true})
	}
	h.publish(contracts.SubjectInventory(node), contracts.InventoryID(node, incarnation, 1), inv)
}

var hbSeq atomic.Uint64

func (h *harness) heartbeat(node, incarnation string) {
	seq := hbSeq.Add(1)
	h.publish(contracts.SubjectHeartbeat(node), fmt.Sprintf("hb/%s/%s/%d", node, incarnation, seq),
		contracts.Heartbeat{SchemaVersion: 1, NodeID: node, Incarnation: incarnation, Seq: seq, Time: h.clock.Now()})
}

// heartbeatFed publishes a heartbeat and waits until the managers'
// heartbeat feeds (their ordered consumers of HEARTBEATS) have delivered
// it: a test that moves the fake clock right after a heartbeat would
// otherwise move it before the heartbeat is applied, which a manager must
// take for a gap of its feed.
func (h *harness) heartbeatFed(node, incarnation string) {
	h.t.Helper()
	seq := hbSeq.Add(1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ack, err := h.bus.Publish(ctx, contracts.SubjectHeartbeat(node), fmt.Sprintf("hb/%s/%s/%d", node, incarnation, seq),
		contracts.Heartbeat{SchemaVersion: 1, NodeID: node, Incarnation: incarnation, Seq: seq, Time: h.clock.Now()})
	if err != nil {
		h.t.Fatalf("publish heartbeat: %v", err)
	}
	h.eventually("the heartbeat delivered to the managers", func() bool {
		stream, err := h.bus.JetStream().Stream(ctx, contracts.StreamHeartbeats)
		if err != nil {
			return false
		}
		fed := 0
		for info := range stream.ListConsumers(ctx).Info() {
			if info.Delivered.Stream < ack.Sequence {
				return false
			}
			fed++
		}
		return fed > 0
	})
}

// item is a plan item for tenant acme.
func item(job string, attempt int, node, model string, gpus ...int) contracts.Allocation {
	a := contracts.Allocation{ID: contracts.AllocationID("acme", job, attempt), Tenant: "acme", JobID: job,
		Attempt: attempt, NodeID: node, Pool: "default"}
	for _, i := range gpus {
		a.Devices = append(a.Devices, contracts.DeviceRef{Index: i, UUID: gpuUUID(node, i), Model: model})
	}
	return a
}

func (h *harness) plan(id string, items ...contracts.Allocation) {
	h.t.Helper()
	h.publish(contracts.SubjectPlan("sched-test"), "plan/"+id,
		contracts.Plan{SchemaVersion: 1, ID: id, Scheduler: "sched-test", Time: h.clock.Now(), Items: items})
}

func (h *harness) runEvent(node string, kind contracts.RunKind, a contracts.Allocation, result *contracts.RunResult, id string) {
	h.t.Helper()
	ev := contracts.RunEvent{SchemaVersion: 1, Kind: kind, AllocationID: a.ID, Tenant: a.Tenant, JobID: a.JobID,
		Attempt: a.Attempt, NodeID: node, Devices: a.Devices, Time: h.clock.Now(), Result: result}
	if id == "" {
		id = contracts.RunEventID(kind, a.ID)
	}
	h.publish(contracts.SubjectRuns(node), id, ev)
}

// eventually waits, bounded, for cond.
func (h *harness) eventually(what string, cond func() bool) {
	h.t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		h.mu.Lock()
		ok := cond()
		h.mu.Unlock()
		if ok {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	h.t.Fatalf("timed out waiting for %s", what)
}

// eventuallyAdvancing waits, bounded, for cond; while it does not hold, it
// moves the fake clock on by half a heartbeat interval at a time, calling
// each first (to keep the nodes that should live heartbeating). It is for
// verdicts that a held judgment may postpone by a timeout.
func (h *harness) eventuallyAdvancing(what string, each func(), cond func() bool) {
	h.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for next := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		h.mu.Lock()
		ok := cond()
		h.mu.Unlock()
		if ok {
			return
		}
		if time.Now().After(next) {
			each()
			h.clock.Advance(500 * time.Millisecond)
			next = time.Now().Add(time.Second)
		}
	}
	h.t.Fatalf("timed out waiting for %s", what)
}

// The accessors below are called with h.mu held (inside eventually) or
// through the locking wrappers.

func (h *harness) entriesFor(id string, kind contracts.LedgerKind) []ledgerRecord {
	var out []ledgerRecord
	for _, r := range h.entries {
		if r.entry.Allocation.ID == id && r.entry.Kind == kind {
			out = append(out, r)
		}
	}
	return out
}

func (h *harness) has(id string, kind contracts.LedgerKind) bool {
	return len(h.entriesFor(id, kind)) > 0
}

func (h *harness) refusal(planID, allocID string) (contracts.Refusal, bool) {
	r, ok := h.refusals[contracts.RefusalID(planID, allocID)]
	return r, ok
}

func (h *harness) hasNodeEvent(node string, kind contracts.NodeLifecycleKind, incarnation string) bool {
	return h.countNodeEvents(node, kind, incarnation) > 0
}

func (h *harness) countNodeEvents(node string, kind contracts.NodeLifecycleKind, incarnation string) int {
	n := 0
	for _, ev := range h.nodeEvents {
		if ev.NodeID == node && ev.Kind == kind && (incarnation == "" || ev.Incarnation == incarnation) {
			n++
		}
	}
	return n
}

// locked runs fn with h.mu held.
func (h *harness) locked(fn func()) {
	h.mu.Lock()
	defer h.mu.Unlock()
	fn()
}

// ready registers nodes (inventory plus a heartbeat) and waits for their
// registered events.
func (h *harness) ready(model string, gpus int, nodes ...string) {
	h.t.Helper()
	for _, n := range nodes {
		h.inventory(n, "i1", gpus, model)
		h.heartbeat(n, "i1")
	}
	for _, n := range nodes {
		h.eventually("registered "+n, func() bool { return h.hasNodeEvent(n, contracts.NodeRegistered, "i1") })
	}
}
