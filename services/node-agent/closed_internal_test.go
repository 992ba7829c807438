package nodeagent

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/sim"
)

// launchCounter counts the runner's launches per allocation: a run
// started twice shows as 2.
type launchCounter struct {
	*runner.Local
	mu sync.Mutex
	n  map[string]int
}

func (r *launchCounter) Launch(ctx context.Context, l runner.Launch) (runner.Process, error) {
	r.mu.Lock()
	r.n[l.AllocationID]++
	r.mu.Unlock()
	return r.Local.Launch(ctx, l)
}

// entries counts what the agent keeps per allocation.
func (a *agent) entries() (facts, released, stops, closed int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.facts), len(a.released), len(a.stops), len(a.closed.ids)
}

// TestClosedRunsAreForgottenAndKeepTheirAnswers runs N simulated runs to
// their end and release and counts what the agent keeps: nothing per run
// but the last few closed IDs (issue 17: the maps grew with every run
// ever run). Then every commit and stop of those runs comes again: first
// as new messages while the agent runs (a commit or a stop delivered
// late), then after an agent crash with its durable consumers gone, so
// that the whole ledger and every command are delivered again at their
// old sequences. No run starts twice, no fact is published again, and the
// rebuilt agent keeps no more than the first one did.
func TestClosedRunsAreForgottenAndKeepTheirAnswers(t *testing.T) {
	const node, n, kept = "h100-01", 24, 4
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	connect := func(name, creds string, provision bool) *bus.Bus {
		b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: name, CredsFile: creds, SkipProvision: !provision,
			Streams: contracts.StreamOptions{Memory: true}})
		if err != nil {
			t.Fatalf("connect %s: %v", name, err)
		}
		t.Cleanup(func() { _ = b.Close(context.Background()) })
		return b
	}
	op := connect("test", natstest.Operator(t, srv), true)
	rm := connect("resource-manager", natstest.Service(t, srv, contracts.BusResourceManager), false)
	nb := connect(ServiceName+"-"+node, natstest.Node(t, srv, node), false)

	var mu sync.Mutex
	started, ended := map[string]int{}, map[string]int{}
	sub, err := op.Conn().Subscribe(contracts.SubjectRuns(node), func(m *nats.Msg) {
		var ev contracts.RunEvent
		if err := (&bus.Msg{Data: m.Data}).Decode(&ev); err != nil {
			t.Error(err)
			return
		}
		mu.Lock()
		defer mu.Unlock()
		switch ev.Kind {
		case contracts.RunStarted:
			started[ev.AllocationID]++
		case contracts.RunEnded:
			ended[ev.AllocationID]++
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	count := func(m map[string]int) (ids, total int) {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range m {
			ids, total = ids+1, total+c
		}
		return ids, total
	}
	eventually := func(what string, cond func() bool) {
		t.Helper()
		for !cond() {
			select {
			case <-ctx.Done():
				t.Fatalf("timed out waiting for %s", what)
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
	acked := func(stream string, seq uint64) {
		t.Helper()
		eventually(fmt.Sprintf("%s seq %d acked", stream, seq), func() bool {
			c, err := op.JetStream().Consumer(ctx, stream, contracts.NodeConsumer(node))
			if err != nil {
				return false
			}
			info, err := c.Info(ctx)
			return err == nil && info.AckFloor.Stream >= seq
		})
	}
	counter := &launchCounter{Local: &runner.Local{LogDir: t.TempDir()}, n: map[string]int{}}
	start := func() (*agent, func()) {
		cfg := Config{NodeID: node, Pool: "test", Zone: "zone-a", PriceClass: "spot", GPUModel: "H100-80GB", GPUCount: 8,
			HeartbeatInterval: time.Second, TelemetryInterval: time.Second, StopGrace: time.Second, Runner: counter}.withDefaults()
		a, err := newAgent(cfg, nb, slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelInfo})))
		if err != nil {
			t.Fatal(err)
		}
		a.closed.limit = kept
		actx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- a.run(actx) }()
		return a, func() {
			stop()
			if err := <-done; err != nil {
				t.Errorf("agent: %v", err)
			}
		}
	}
	publish := func(p *bus.Bus, subject, msgID string, v any) uint64 {
		t.Helper()
		ack, err := p.Publish(ctx, subject, msgID, v)
		if err != nil {
			t.Fatal(err)
		}
		return ack.Sequence
	}
	allocs := make([]contracts.Allocation, n)
	for i := range allocs {
		job := fmt.Sprintf("job-%02d", i)
		allocs[i] = contracts.Allocation{ID: contracts.AllocationID("acme", job, 1), Tenant: "acme", JobID: job, Attempt: 1,
			NodeID: node, Pool: "test", Run: contracts.RunSpec{Duration: contracts.Duration(time.Millisecond)},
			Devices: []contracts.DeviceRef{{Index: i % 8, UUID: sim.UUID(node, i%8), Model: "H100-80GB"}}}
	}
	entry := func(kind contracts.LedgerKind, a contracts.Allocation) contracts.LedgerEntry {
		e := contracts.LedgerEntry{SchemaVersion: contracts.SchemaVersion, Kind: kind, Allocation: a, Time: time.Now()}
		if kind == contracts.LedgerReleased {
			e.Reason = contracts.ReasonRunEnded
		}
		return e
	}
	stopCmd := func(a contracts.Allocation) contracts.NodeCommand {
		return contracts.NodeCommand{SchemaVersion: contracts.SchemaVersion, Kind: contracts.CommandStopRun, AllocationID: a.ID,
			Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, Reason: contracts.ReasonCancelled, Time: time.Now()}
	}
	check := func(a *agent, when string) {
		t.Helper()
		facts, released, stops, closed := a.entries()
		if facts != 0 || released != 0 || stops != 0 || closed > kept {
			t.Errorf("%s: the agent keeps %d facts, %d releases, %d stops and %d closed IDs after %d ended runs; want 0, 0, 0 and at most %d",
				when, facts, released, stops, closed, n, kept)
		}
		counter.mu.Lock()
		defer counter.mu.Unlock()
		for _, al := range allocs {
			if c := counter.n[al.ID]; c != 1 {
				t.Errorf("%s: %s launched %d times, want once", when, al.ID, c)
			}
		}
		if ids, total := count(started); ids != n || total != n {
			t.Errorf("%s: %d started facts for %d allocations, want %d for %d", when, total, ids, n, n)
		}
		if ids, total := count(ended); ids != n || total != n {
			t.Errorf("%s: %d ended facts for %d allocations, want %d for %d", when, total, ids, n, n)
		}
	}

	a, stop := start()
	for _, al := range allocs {
		publish(rm, contracts.SubjectLedger(node), contracts.LedgerEntryID(contracts.LedgerCommitted, al.ID), entry(contracts.LedgerCommitted, al))
	}
	eventually("every run ended", func() bool { ids, _ := count(ended); return ids == n })
	var lastEntry, lastCmd uint64
	for _, al := range allocs {
		lastEntry = publish(rm, contracts.SubjectLedger(node), contracts.LedgerEntryID(contracts.LedgerReleased, al.ID), entry(contracts.LedgerReleased, al))
	}
	acked(contracts.StreamAllocations, lastEntry)
	check(a, "after the releases")

	// Late copies, as new messages: the commits (a redelivery past the
	// duplicate window) of the runs still remembered as closed, and a
	// stop of every run, the forgotten ones too.
	for _, al := range allocs[n-kept:] {
		lastEntry = publish(rm, contracts.SubjectLedger(node), "late-"+al.ID, entry(contracts.LedgerCommitted, al))
	}
	acked(contracts.StreamAllocations, lastEntry)
	for _, al := range allocs {
		lastCmd = publish(op, contracts.SubjectNodeCommands(node), contracts.NodeCommandID(contracts.CommandStopRun, al.ID), stopCmd(al))
	}
	acked(contracts.StreamNodeCommands, lastCmd)
	check(a, "after late commits and stops")

	// A crash, and consumers that must be created afresh: every ledger
	// entry and command is delivered again, at its old sequence.
	stop()
	for _, stream := range []string{contracts.StreamAllocations, contracts.StreamNodeCommands} {
		if err := op.JetStream().DeleteConsumer(ctx, stream, contracts.NodeConsumer(node)); err != nil {
			t.Fatalf("delete the %s consumer: %v", stream, err)
		}
	}
	a, stop = start()
	defer stop()
	acked(contracts.StreamAllocations, lastEntry)
	acked(contracts.StreamNodeCommands, lastCmd)
	check(a, "after a crash and every message again")
}
