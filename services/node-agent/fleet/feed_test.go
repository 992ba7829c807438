package fleet

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/sim"
)

func publishCommand(t *testing.T, b *bus.Bus, node, allocID string) {
	t.Helper()
	c := contracts.NodeCommand{SchemaVersion: contracts.SchemaVersion, Kind: contracts.CommandStopRun, AllocationID: allocID,
		Tenant: "acme", JobID: "j", Attempt: 1, Reason: contracts.ReasonCancelled, Time: time.Now()}
	if _, err := b.Publish(t.Context(), contracts.SubjectNodeCommands(node),
		contracts.NodeCommandID(contracts.CommandStopRun, allocID), c); err != nil {
		t.Fatal(err)
	}
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(15 * time.Second); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// The start history is a snapshot handed out once per subject; a later
// replay of the same subject reads the stream as it is then.
func TestSharedFeedReplaysHistoryOnceThenTheBus(t *testing.T) {
	b := ConnectBuses(t)
	ctx := t.Context()
	publishCommand(t, b.Op, "n1", "a1")
	publishCommand(t, b.Op, "n2", "a2")
	publishCommand(t, b.Op, "stranger", "a3") // not one of the fleet's machines
	f := newSharedFeed(b.Fleet, slog.New(slog.DiscardHandler), []string{"n1", "n2"})
	if err := f.loadHistory(ctx); err != nil {
		t.Fatal(err)
	}
	publishCommand(t, b.Op, "n1", "a4") // after the snapshot

	replay := func(subject string) []string {
		t.Helper()
		var ids []string
		err := f.Replay(ctx, contracts.StreamNodeCommands, subject, func(_ context.Context, m *bus.Msg) error {
			var c contracts.NodeCommand
			if err := m.Decode(&c); err != nil {
				return err
			}
			ids = append(ids, c.AllocationID)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}
	got := [][]string{
		replay(contracts.SubjectNodeCommands("n1")),       // the snapshot
		replay(contracts.SubjectNodeCommands("n1")),       // the bus now
		replay(contracts.SubjectNodeCommands("n2")),       // the snapshot
		replay(contracts.SubjectNodeCommands("stranger")), // not in the snapshot: the bus
	}
	want := [][]string{{"a1"}, {"a1", "a4"}, {"a2"}, {"a3"}}
	if d := cmp.Diff(want, got); d != "" {
		t.Fatalf("replays (-want +got):\n%s", d)
	}
	if len(f.history) != 0 {
		t.Errorf("history kept after every subject was read: %v", f.history)
	}
}

// The shared consumers start once every agent has subscribed, hand each
// agent its own node's messages in stream order, and acknowledge messages
// for machines outside the fleet without handing them to anyone.
func TestSharedFeedRoutesEachNodesMessagesInOrder(t *testing.T) {
	b := ConnectBuses(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	nodes := []string{"n1", "n2", "n3"}
	f := newSharedFeed(b.Fleet, slog.New(slog.DiscardHandler), nodes)
	if err := f.loadHistory(ctx); err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		for _, n := range []string{"n1", "n2", "stranger"} {
			publishCommand(t, b.Op, n, fmt.Sprintf("%s-%02d", n, i))
		}
	}

	var mu sync.Mutex
	got := map[string][]string{}
	var wg sync.WaitGroup
	for _, n := range []string{"n1", "n2"} {
		wg.Go(func() {
			if err := f.Consume(ctx, contracts.StreamAllocations, contracts.SubjectLedger(n), func(context.Context, *bus.Msg) error {
				return nil
			}); err != nil {
				t.Error(err)
			}
		})
		wg.Go(func() {
			err := f.Consume(ctx, contracts.StreamNodeCommands, contracts.SubjectNodeCommands(n), func(_ context.Context, m *bus.Msg) error {
				var c contracts.NodeCommand
				if err := m.Decode(&c); err != nil {
					return err
				}
				mu.Lock()
				got[n] = append(got[n], c.AllocationID)
				mu.Unlock()
				return nil
			})
			if err != nil {
				t.Error(err)
			}
		})
	}
	done := make(chan error, 1)
	go func() { done <- f.run(ctx) }()

	select {
	case <-f.ready:
		t.Fatal("consumers ready before every agent subscribed")
	case <-time.After(100 * time.Millisecond):
	}
	mu.Lock()
	if len(got) != 0 {
		t.Fatalf("messages handed out before every agent subscribed: %v", got)
	}
	mu.Unlock()
	// n3's agent stopped before subscribing: nothing is left to wait for.
	f.stopped("n3")

	eventually(t, "every command handed out", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(got["n1"]) == 20 && len(got["n2"]) == 20
	})
	for _, n := range []string{"n1", "n2"} {
		if !slices.IsSorted(got[n]) || !strings.HasPrefix(got[n][0], n+"-") {
			t.Errorf("%s got %v, want its own commands in stream order", n, got[n])
		}
	}
	js := b.Op.JetStream()
	eventually(t, "the stranger's commands acknowledged", func() bool {
		c, err := js.Consumer(ctx, contracts.StreamNodeCommands, f.durable)
		if err != nil {
			return false
		}
		info, err := c.Info(ctx)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.Delivered.Stream == 60
	})
	cancel()
	wg.Wait()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// durableConsumers lists the durable consumers of a stream.
func durableConsumers(t *testing.T, js jetstream.JetStream, stream string) []string {
	t.Helper()
	s, err := js.Stream(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	l := s.ListConsumers(t.Context())
	for info := range l.Info() {
		if info.Config.Durable != "" {
			names = append(names, info.Config.Durable)
		}
	}
	if err := l.Err(); err != nil {
		t.Fatal(err)
	}
	slices.Sort(names)
	return names
}

// runFacts lists the kinds of the run facts of an allocation.
func runFacts(t *testing.T, b *bus.Bus, node, allocID string) []string {
	t.Helper()
	var kinds []string
	_, err := b.Replay(t.Context(), bus.FollowSpec{Stream: contracts.StreamRuns, FilterSubjects: []string{contracts.SubjectRuns(node)}},
		func(_ context.Context, m *bus.Msg) error {
			var ev contracts.RunEvent
			if err := m.Decode(&ev); err != nil {
				return err
			}
			if ev.AllocationID == allocID {
				kinds = append(kinds, string(ev.Kind))
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	return kinds
}

func commit(t *testing.T, b *bus.Bus, node, job string) contracts.Allocation {
	t.Helper()
	a := contracts.Allocation{ID: contracts.AllocationID("acme", job, 1), Tenant: "acme", JobID: job, Attempt: 1,
		NodeID: node, Pool: "t4", Run: contracts.RunSpec{Duration: contracts.Duration(time.Hour)},
		Devices: []contracts.DeviceRef{{Index: 0, UUID: sim.UUID(node, 0), Model: "T4"}}}
	e := contracts.LedgerEntry{SchemaVersion: contracts.SchemaVersion, Kind: contracts.LedgerCommitted, Allocation: a, Time: time.Now()}
	if _, err := b.Publish(t.Context(), contracts.SubjectLedger(node), contracts.LedgerEntryID(e.Kind, a.ID), e); err != nil {
		t.Fatal(err)
	}
	return a
}

// startFleet runs f until the returned stop is called.
func startFleet(t *testing.T, b *bus.Bus, f Fleet) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, f, b, nodeagent.Config{HeartbeatInterval: 100 * time.Millisecond,
			TelemetryInterval: 100 * time.Millisecond, StopGrace: time.Second, LogDir: t.TempDir()},
			slog.New(slog.NewTextHandler(io.Discard, nil)))
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("fleet.Run: %v", err)
				}
			case <-time.After(20 * time.Second):
				t.Error("fleet did not stop")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func t4Fleet(pools ...string) Fleet {
	f := Fleet{MachineTypes: map[string]MachineType{"t4x1": {GPUModel: "T4", GPUCount: 1}}}
	for _, p := range pools {
		f.Pools = append(f.Pools, Pool{Name: p, MachineType: "t4x1", Count: 2})
	}
	return f
}

// A fleet keeps one durable consumer per stream whatever its size, and its
// agents act on ledger entries and commands through them as standalone
// agents do through their own.
func TestFleetSharesOneDurablePerStream(t *testing.T) {
	b := ConnectBuses(t)
	startFleet(t, b.Fleet, t4Fleet("t4", "spare"))
	run := commit(t, b.RM, "t4-01", "train")
	other := commit(t, b.RM, "spare-02", "serve")
	for _, a := range []contracts.Allocation{run, other} {
		eventually(t, a.ID+" started", func() bool { return len(runFacts(t, b.Op, a.NodeID, a.ID)) == 1 })
	}
	publishCommand(t, b.Op, "t4-01", run.ID)
	eventually(t, run.ID+" stopped", func() bool { return len(runFacts(t, b.Op, "t4-01", run.ID)) == 2 })

	js := b.Op.JetStream()
	for _, stream := range []string{contracts.StreamAllocations, contracts.StreamNodeCommands} {
		got := durableConsumers(t, js, stream)
		if len(got) != 1 || !strings.HasPrefix(got[0], "node-agent-fleet-") {
			t.Errorf("%s has durable consumers %v, want one for the whole fleet", stream, got)
		}
	}
	if got := runFacts(t, b.Op, "spare-02", other.ID); !slices.Equal(got, []string{"started"}) {
		t.Errorf("spare-02's run has facts %v, want it still running", got)
	}
}

// A fleet of other machines has its own durable, which starts from the
// first entry of the ledger: an allocation that already ran on one of its
// machines is not started again, because the machine's agent rebuilt from
// the start history first.
func TestChangedFleetDoesNotRestartRuns(t *testing.T) {
	b := ConnectBuses(t)
	stop := startFleet(t, b.Fleet, t4Fleet("t4"))
	first := commit(t, b.RM, "t4-01", "first")
	eventually(t, "first run started", func() bool { return len(runFacts(t, b.Op, "t4-01", first.ID)) == 1 })
	stop()
	// A second started fact must be stored, not dropped as a duplicate.
	natstest.ForgetMsgIDs(t, b.Op.JetStream(), contracts.StreamRuns)

	startFleet(t, b.Fleet, t4Fleet("t4", "l4"))
	second := commit(t, b.RM, "t4-01", "second")
	// The second entry follows the first on the node's subject, and a
	// subject's entries are handled in order: once the second has started,
	// the first was seen again.
	eventually(t, "second run started", func() bool { return len(runFacts(t, b.Op, "t4-01", second.ID)) == 1 })
	got := runFacts(t, b.Op, "t4-01", first.ID)
	if n := strings.Count(strings.Join(got, " "), "started"); n != 1 {
		t.Fatalf("first allocation has facts %v: started %d times", got, n)
	}
	if got := durableConsumers(t, b.Op.JetStream(), contracts.StreamAllocations); len(got) != 2 {
		t.Fatalf("ALLOCATIONS durables %v, want one per fleet shape", got)
	}
}
