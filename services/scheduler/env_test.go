package scheduler

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/service"
)

// env is one embedded JetStream server, a running scheduler, and a test
// connection that plays every other service: it submits requests as the
// gateway would, and publishes ledger entries, refusals, run facts and
// inventories as the resource manager and node agents would. It records
// what the scheduler publishes by following the streams, as any reader.
type env struct {
	t      testing.TB
	url    string
	bus    *bus.Bus
	cfg    Config
	stopFn func()

	events, plans, commands, demand, dead *recorder
}

const waitFor = 15 * time.Second

func newEnv(t testing.TB) *env {
	t.Helper()
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	// The test plays every other service, so it connects as the operator;
	// the scheduler runs with its own identity, which proves its
	// permissions suffice (natstest fails the test on a refused access).
	b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "test", Logger: testLogger(t),
		CredsFile: natstest.Operator(t, srv)})
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	e := &env{t: t, url: srv.URL(), bus: b}
	e.cfg = DefaultConfig()
	e.cfg.Bus = service.BusConfig{NATSURL: srv.URL(), Replicas: 1, Creds: natstest.Service(t, srv, contracts.BusScheduler)}
	e.cfg.Name = "sched-test"
	e.cfg.CycleInterval = 2 * time.Millisecond
	e.cfg.DemandInterval = 20 * time.Millisecond
	e.events = e.record(contracts.StreamJobEvents)
	e.plans = e.record(contracts.StreamPlans)
	e.commands = e.record(contracts.StreamNodeCommands)
	e.demand = e.record(contracts.StreamOps, contracts.SubjectDemandAll)
	e.dead = e.record(contracts.StreamDeadLetters)
	return e
}

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// start runs the scheduler until stop (or the end of the test).
func (e *env) start() {
	e.t.Helper()
	if e.stopFn != nil {
		e.t.Fatal("scheduler already running")
	}
	e.stopFn = e.replica()
}

func (e *env) stop() {
	if e.stopFn != nil {
		e.stopFn()
		e.stopFn = nil
	}
}

// recorder keeps every message of a stream (ordered follow from the start).
type recorder struct {
	mu   sync.Mutex
	msgs []*bus.Msg
}

func (e *env) record(stream string, filters ...string) *recorder {
	r := &recorder{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = e.bus.Follow(ctx, bus.FollowSpec{Stream: stream, FilterSubjects: filters}, func(_ context.Context, m *bus.Msg) error {
			r.mu.Lock()
			r.msgs = append(r.msgs, m)
			r.mu.Unlock()
			return nil
		}, nil)
	}()
	e.t.Cleanup(func() { cancel(); <-done })
	return r
}

func (r *recorder) all() []*bus.Msg {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*bus.Msg(nil), r.msgs...)
}

// eventually polls cond until it holds or the deadline passes.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ---- what the scheduler published ----

func decode[T any](t testing.TB, m *bus.Msg) T {
	t.Helper()
	var v T
	if err := json.Unmarshal(m.Data, &v); err != nil {
		t.Fatalf("decode %s: %v", m.Subject, err)
	}
	return v
}

// jobEvents returns a job's events in stream order.
func (e *env) jobEvents(tenant, jobID string) []contracts.JobEvent {
	var out []contracts.JobEvent
	for _, m := range e.events.all() {
		if m.Subject == contracts.SubjectJobEvents(tenant, jobID) {
			out = append(out, decode[contracts.JobEvent](e.t, m))
		}
	}
	return out
}

func (e *env) types(tenant, jobID string) []string {
	var out []string
	for _, ev := range e.jobEvents(tenant, jobID) {
		out = append(out, string(ev.Type))
	}
	return out
}

// waitEvent waits for a job event of type typ and returns the last one.
func (e *env) waitEvent(tenant, jobID string, typ contracts.JobEventType) contracts.JobEvent {
	e.t.Helper()
	var found contracts.JobEvent
	eventually(e.t, fmt.Sprintf("%s event of %s/%s (have %v)", typ, tenant, jobID, e.types(tenant, jobID)), func() bool {
		for _, ev := range e.jobEvents(tenant, jobID) {
			if ev.Type == typ {
				found = ev
				return true
			}
		}
		return false
	})
	return found
}

// waitItem waits for a plan item of the job's attempt in a plan other than
// notIn, and returns it.
func (e *env) waitItem(tenant, jobID string, attempt int, notIn string) contracts.Allocation {
	e.t.Helper()
	var found contracts.Allocation
	eventually(e.t, fmt.Sprintf("plan item for %s/%s attempt %d", tenant, jobID, attempt), func() bool {
		for _, m := range e.plans.all() {
			p := decode[contracts.Plan](e.t, m)
			if m.Subject != contracts.SubjectPlan(e.cfg.Name) || p.ID == notIn {
				continue
			}
			for _, it := range p.Items {
				if it.Tenant == tenant && it.JobID == jobID && it.Attempt == attempt {
					found = it
					return true
				}
			}
		}
		return false
	})
	return found
}

// items counts every plan item proposed for a job.
func (e *env) items(tenant, jobID string) int {
	n := 0
	for _, m := range e.plans.all() {
		for _, it := range decode[contracts.Plan](e.t, m).Items {
			if it.Tenant == tenant && it.JobID == jobID {
				n++
			}
		}
	}
	return n
}

func (e *env) stopCommands(node string) []contracts.NodeCommand {
	var out []contracts.NodeCommand
	for _, m := range e.commands.all() {
		if m.Subject == contracts.SubjectNodeCommands(node) {
			out = append(out, decode[contracts.NodeCommand](e.t, m))
		}
	}
	return out
}

// ---- what the other services publish ----

func (e *env) publish(subject, id string, v any) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := e.bus.Publish(ctx, subject, id, v); err != nil {
		e.t.Fatalf("publish %s: %v", subject, err)
	}
}

func (e *env) publishRaw(subject, id string, data []byte) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := e.bus.PublishRaw(ctx, subject, id, data); err != nil {
		e.t.Fatalf("publish %s: %v", subject, err)
	}
}

func (e *env) submit(tenant string, r contracts.JobRequest) {
	e.t.Helper()
	e.publish(contracts.SubjectSubmit(tenant), contracts.SubmitMsgID(tenant, r.ID), r)
}

func (e *env) cancel(tenant, jobID string) {
	e.t.Helper()
	e.publish(contracts.SubjectCancel(tenant), contracts.CancelMsgID(tenant, jobID),
		contracts.CancelRequest{JobID: jobID, Reason: "test"})
}

// barrier submits a marker job and waits for its queued event: the
// requests consumer handles messages in order, so everything submitted
// before the marker has been handled by then.
func (e *env) barrier(tenant string) {
	e.t.Helper()
	id := fmt.Sprintf("marker-%d", time.Now().UnixNano())
	r := request(id, 64, "H100-80GB")
	r.Pool = "nowhere"
	e.submit(tenant, r)
	e.waitEvent(tenant, id, contracts.EventQueued)
}

func (e *env) inventory(id, pool, model string, n int) {
	e.t.Helper()
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: id, Hostname: id, Pool: pool, MachineType: "test",
		Backend: "sim", Incarnation: "inc-1", Time: time.Now().UTC()}
	for i := range n {
		inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: fmt.Sprintf("GPU-%s-%d", id, i), Model: model,
			MemoryMiB: 81920, Healthy: true})
	}
	e.publish(contracts.SubjectInventory(id), contracts.InventoryID(id, inv.Incarnation, 1), inv)
}

func (e *env) nodeEvent(id string, kind contracts.NodeLifecycleKind, seq uint64) {
	e.t.Helper()
	e.publish(contracts.SubjectNodeLifecycle(id), contracts.NodeEventID(kind, id, seq),
		contracts.NodeEvent{SchemaVersion: 1, Kind: kind, NodeID: id, Time: time.Now().UTC()})
}

func (e *env) commit(a contracts.Allocation) {
	e.t.Helper()
	e.publish(contracts.SubjectLedger(a.NodeID), contracts.LedgerEntryID(contracts.LedgerCommitted, a.ID),
		contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a, Time: time.Now().UTC()})
}

func (e *env) release(a contracts.Allocation, reason contracts.Reason, run *contracts.RunResult) {
	e.t.Helper()
	e.publish(contracts.SubjectLedger(a.NodeID), contracts.LedgerEntryID(contracts.LedgerReleased, a.ID),
		contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerReleased, Allocation: a, Time: time.Now().UTC(),
			Reason: reason, Run: run})
}

func (e *env) refuse(a contracts.Allocation, reason contracts.Reason) {
	e.t.Helper()
	e.publish(contracts.SubjectRefused(a.Tenant), contracts.RefusalID(a.PlanID, a.ID),
		contracts.Refusal{SchemaVersion: 1, PlanID: a.PlanID, AllocationID: a.ID, Tenant: a.Tenant, JobID: a.JobID,
			Attempt: a.Attempt, NodeID: a.NodeID, Reason: reason, Message: "refused by the test", Time: time.Now().UTC()})
}

func (e *env) runStarted(a contracts.Allocation, at time.Time) {
	e.t.Helper()
	e.publish(contracts.SubjectRuns(a.NodeID), contracts.RunEventID(contracts.RunStarted, a.ID),
		contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunStarted, AllocationID: a.ID, Tenant: a.Tenant,
			JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Devices: a.Devices, Time: at})
}

func (e *env) runEnded(a contracts.Allocation, res contracts.RunResult) {
	e.t.Helper()
	e.publish(contracts.SubjectRuns(a.NodeID), contracts.RunEventID(contracts.RunEnded, a.ID),
		contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunEnded, AllocationID: a.ID, Tenant: a.Tenant,
			JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Devices: a.Devices, Time: res.EndedAt, Result: &res})
}

// autoCommit plays a resource manager that commits every plan item it
// reads, until the test ends.
func (e *env) autoCommit() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = e.bus.Follow(ctx, bus.FollowSpec{Stream: contracts.StreamPlans}, func(ctx context.Context, m *bus.Msg) error {
			var p contracts.Plan
			if err := m.Decode(&p); err != nil {
				return err
			}
			for _, a := range p.Items {
				if _, err := e.bus.Publish(ctx, contracts.SubjectLedger(a.NodeID), contracts.LedgerEntryID(contracts.LedgerCommitted, a.ID),
					contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a, Time: time.Now().UTC()}); err != nil {
					return err
				}
			}
			return nil
		}, nil)
	}()
	e.t.Cleanup(func() { cancel(); <-done })
}

func request(id string, gpus int, model string) contracts.JobRequest {
	return contracts.JobRequest{ID: id, Resources: contracts.Resources{GPU: contracts.GPURequest{Count: gpus, Model: model}},
		Run: contracts.RunSpec{Duration: contracts.Duration(30 * time.Second)}}
}

// countByKind counts a job's events by type and attempt ("scheduled/1").
func countByKind(evs []contracts.JobEvent) map[string]int {
	out := map[string]int{}
	for _, ev := range evs {
		k := string(ev.Type) + "/" + fmt.Sprint(ev.Attempt)
		if ev.Type == contracts.EventPending {
			k += "/" + string(ev.Reason)
		}
		out[k]++
	}
	return out
}

func hasPrefix(s string, prefixes ...string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

func mustMarshal(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// submitMany publishes n job requests from several goroutines, so the test
// is not what limits the scheduler's intake.
func (e *env) submitMany(n int, req func(i int) (string, contracts.JobRequest)) {
	e.t.Helper()
	const workers = 8
	errs := make(chan error, workers)
	for w := range workers {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), waitFor)
			defer cancel()
			for i := w; i < n; i += workers {
				tenant, r := req(i)
				if _, err := e.bus.Publish(ctx, contracts.SubjectSubmit(tenant), contracts.SubmitMsgID(tenant, r.ID), r); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range workers {
		if err := <-errs; err != nil {
			e.t.Fatalf("submit: %v", err)
		}
	}
}

// waitScheduled waits until n scheduled events are in JOB_EVENTS and
// returns how many there are.
func (e *env) waitScheduled(n int) int {
	e.t.Helper()
	count := func() int {
		c := 0
		for _, m := range e.events.all() {
			if strings.Contains(m.ID(), "/"+string(contracts.EventScheduled)+"/") {
				c++
			}
		}
		return c
	}
	eventually(e.t, fmt.Sprintf("%d jobs scheduled", n), func() bool { return count() >= n })
	return count()
}
