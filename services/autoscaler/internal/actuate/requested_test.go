package actuate_test

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/autoscaler/internal/actuate"
	"github.com/gpuplane/gpuplane/services/autoscaler/simcloud"
)

type eventLog struct {
	mu  sync.Mutex
	evs []contracts.MachineEvent
}

func (l *eventLog) MachineEvent(_ context.Context, e contracts.MachineEvent) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.evs = append(l.evs, e)
}

// registered says every node registered as soon as its machine runs.
type registered struct{}

func (registered) Registered(string) bool             { return true }
func (registered) LostSince(string) (time.Time, bool) { return time.Time{}, false }

// A create whose reply was lost still yields a requested event for the
// machine it made (found by its token), with the decision that asked for
// it, after the failure and before the machine is ready; and one only.
func TestLostCreateReplyIsStillAnnounced(t *testing.T) {
	clk := &clock{now: t0}
	cl, err := simcloud.New(simcloud.Config{Now: clk.Now, ProvisionDelay: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	events := &eventLog{}
	pool := h100
	pool.Min, pool.IdleFor = 0, time.Hour
	act, err := actuate.New(actuate.Config{Pools: map[string]actuate.Pool{"h100": pool}, Provider: cl,
		Ledger: &ledger{live: map[string][]contracts.Priority{}}, Holds: &holds{drained: map[string]bool{}},
		Events: events, Nodes: registered{}, Now: clk.Now, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		BackoffBase: time.Second, BackoffMax: 30 * time.Second, Breaker: gobreaker.Settings{}})
	if err != nil {
		t.Fatal(err)
	}
	cl.LoseReplies(1)
	if err := act.Apply(up("d1", 0, 1)); err != nil {
		t.Fatal(err)
	}
	for range 180 {
		if err := act.Step(context.Background()); err != nil {
			t.Fatal(err)
		}
		clk.Advance(time.Second)
		cl.Advance()
	}
	events.mu.Lock()
	defer events.mu.Unlock()
	var kinds []contracts.MachineEventKind
	requested := 0
	for _, e := range events.evs {
		kinds = append(kinds, e.Kind)
		if e.Kind == contracts.MachineRequested {
			requested++
			if e.DecisionID != "d1" || e.MachineID != "h100-1" || e.Token != "d1#0" {
				t.Errorf("requested event %+v, want machine h100-1 of d1#0", e)
			}
		}
	}
	if requested != 1 || len(kinds) < 3 || kinds[0] != contracts.MachineFailed {
		t.Fatalf("events %v, want failed, then one requested, then ready", kinds)
	}
	ready := -1
	for i, k := range kinds {
		if k == contracts.MachineReady {
			ready = i
		}
	}
	if ready < 0 || kinds[1] != contracts.MachineRequested || ready < 2 {
		t.Fatalf("events %v, want requested before ready", kinds)
	}
}
