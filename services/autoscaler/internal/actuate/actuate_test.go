package actuate_test

import (
	"context"
	"io"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/sony/gobreaker/v2"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/autoscaler/internal/actuate"
	"github.com/gpuplane/gpuplane/services/autoscaler/simcloud"
)

var t0 = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)

type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// ledger is a stateful stand-in for the allocation ledger: node → live
// allocation priorities.
type ledger struct {
	mu   sync.Mutex
	live map[string][]contracts.Priority
}

func (l *ledger) Live(node string) []contracts.Priority {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.live[node])
}

func (l *ledger) set(node string, ps ...contracts.Priority) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.live[node] = ps
}

// holds records drain holds like the NodeAdmin bucket would.
type holds struct{ drained map[string]bool }

func (h *holds) Drain(_ context.Context, node, _ string) error { h.drained[node] = true; return nil }
func (h *holds) Lift(_ context.Context, node string) error     { delete(h.drained, node); return nil }

type world struct {
	clk    *clock
	cloud  *simcloud.Provider
	ledger *ledger
	holds  *holds
	act    *actuate.Actuator
}

func newWorld(t *testing.T, pool actuate.Pool, breaker gobreaker.Settings) *world {
	t.Helper()
	w := &world{clk: &clock{now: t0}, ledger: &ledger{live: map[string][]contracts.Priority{}}, holds: &holds{drained: map[string]bool{}}}
	var err error
	w.cloud, err = simcloud.New(simcloud.Config{Now: w.clk.Now, ProvisionDelay: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	w.act, err = actuate.New(actuate.Config{Pools: map[string]actuate.Pool{"h100": pool}, Provider: w.cloud,
		Ledger: w.ledger, Holds: w.holds, Now: w.clk.Now, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		BackoffBase: time.Second, BackoffMax: 30 * time.Second, Breaker: breaker})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// run steps the actuator once a (fake) second for d, moving the cloud too.
func (w *world) run(t *testing.T, d time.Duration) {
	t.Helper()
	for range int(d / time.Second) {
		if err := w.act.Step(context.Background()); err != nil {
			t.Fatal(err)
		}
		w.clk.Advance(time.Second)
		w.cloud.Advance()
	}
}

// live lists the machines not deleted, as "ID token".
func (w *world) live() []string {
	var out []string
	for _, m := range w.cloud.Machines() {
		if m.State != cloud.Deleted {
			out = append(out, m.ID+" "+m.Token)
		}
	}
	return out
}

func up(id string, current, desired int) contracts.ScaleDecision {
	return contracts.ScaleDecision{ID: id, Pool: "h100", Direction: contracts.ScaleUp, CurrentNodes: current, DesiredNodes: desired}
}

var h100 = actuate.Pool{Min: 1, Max: 4, MachineType: "a3-highgpu-8g", PriceClass: cloud.OnDemand,
	DownCooldown: time.Minute, IdleFor: 5 * time.Minute}

func TestScaleUp(t *testing.T) {
	tests := map[string]struct {
		decisions []contracts.ScaleDecision
		lose      int // replies lost by the provider
		want      []string
	}{
		"two more machines": {
			decisions: []contracts.ScaleDecision{up("d1", 0, 2)},
			want:      []string{"h100-1 d1#0", "h100-2 d1#1"},
		},
		"capped at the pool maximum": {
			decisions: []contracts.ScaleDecision{up("d1", 0, 9)},
			want:      []string{"h100-1 d1#0", "h100-2 d1#1", "h100-3 d1#2", "h100-4 d1#3"},
		},
		"a decision applied twice creates once": {
			decisions: []contracts.ScaleDecision{up("d1", 0, 2), up("d1", 0, 2)},
			want:      []string{"h100-1 d1#0", "h100-2 d1#1"},
		},
		"lost replies are retried with the same token": {
			decisions: []contracts.ScaleDecision{up("d1", 0, 3)},
			lose:      3,
			want:      []string{"h100-1 d1#0", "h100-2 d1#1", "h100-3 d1#2"},
		},
		"a newer decision counts the machines already made": {
			decisions: []contracts.ScaleDecision{up("d1", 0, 1), up("d2", 1, 3)},
			want:      []string{"h100-1 d1#0", "h100-2 d2#0", "h100-3 d2#1"},
		},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			pool := h100
			pool.Min = 0
			pool.IdleFor = time.Hour // no scale-down in this test
			w := newWorld(t, pool, gobreaker.Settings{})
			w.cloud.LoseReplies(tt.lose)
			for _, d := range tt.decisions {
				if err := w.act.Apply(d); err != nil {
					t.Fatal(err)
				}
				w.run(t, 2*time.Minute)
			}
			if diff := cmp.Diff(tt.want, w.live()); diff != "" {
				t.Errorf("machines (-want +got):\n%s", diff)
			}
		})
	}
}

func TestApplyRejects(t *testing.T) {
	w := newWorld(t, h100, gobreaker.Settings{})
	for name, d := range map[string]contracts.ScaleDecision{
		"unknown pool": {ID: "x", Pool: "a100", Direction: contracts.ScaleUp, DesiredNodes: 1},
		"scale down":   {ID: "x", Pool: "h100", Direction: contracts.ScaleDown, CurrentNodes: 2, DesiredNodes: 1},
	} {
		if err := w.act.Apply(d); err == nil {
			t.Errorf("%s: Apply accepted %+v", name, d)
		}
	}
	if _, err := actuate.New(actuate.Config{Pools: map[string]actuate.Pool{"h100": {Min: 3, Max: 2, PriceClass: "cheap"}}}); err == nil {
		t.Error("New accepted a config without provider and with min > max")
	}
}

// The provider fails for ten minutes while a scale-up is due, replies of
// creates it applied are lost, and the breaker goes half-open at every
// attempt: the backoff alone must bound the calls, and the tokens must
// prevent a second machine.
func TestFailingProviderMakesNoDuplicatesAndFewCalls(t *testing.T) {
	tests := map[string]struct {
		breaker   gobreaker.Settings
		wantCalls int // most calls over the failing ten minutes
	}{
		// Backoff 1,2,4,8,16 then 30s: about 5+ (600-31)/30 ≈ 24 attempts.
		"backoff only (breaker never holds)": {breaker: gobreaker.Settings{Timeout: time.Nanosecond}, wantCalls: 26},
		// The breaker trips after 5 failures and holds for longer than
		// the test runs in real time: later attempts make no call.
		"breaker open": {breaker: gobreaker.Settings{Timeout: time.Hour, ReadyToTrip: func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= 5 }}, wantCalls: 5},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			pool := h100
			pool.IdleFor = time.Hour
			w := newWorld(t, pool, tt.breaker)
			if err := w.act.Apply(up("d1", 0, 3)); err != nil {
				t.Fatal(err)
			}
			// One create lands and its reply is lost, then the provider
			// goes down.
			w.cloud.LoseReplies(1)
			w.run(t, time.Second)
			w.cloud.SetFailing(true, nil)
			before := total(w.cloud.Calls())
			w.run(t, 10*time.Minute)
			calls := total(w.cloud.Calls()) - before
			t.Logf("%d provider calls over 10 failing minutes", calls)
			if calls > tt.wantCalls {
				t.Errorf("%d calls while failing for 10 minutes; want at most %d", calls, tt.wantCalls)
			}
			if name == "breaker open" {
				return // the breaker holds in real time; recovery is the other case
			}
			w.cloud.SetFailing(false, nil)
			w.run(t, 2*time.Minute)
			want := []string{"h100-1 d1#0", "h100-2 d1#1", "h100-3 d1#2"}
			if diff := cmp.Diff(want, w.live()); diff != "" {
				t.Errorf("machines after recovery (-want +got):\n%s", diff)
			}
			if n := len(w.cloud.Machines()); n != 3 {
				t.Errorf("%d machines ever created; want 3", n)
			}
		})
	}
}

func total(m map[string]int) int {
	n := 0
	for _, v := range maps.All(m) {
		n += v
	}
	return n
}

func TestScaleDown(t *testing.T) {
	type step struct {
		busy map[string][]contracts.Priority // ledger changes before the step
		run  time.Duration
	}
	tests := map[string]struct {
		cooldown    time.Duration
		steps       []step
		wantLive    []string
		wantDrained []string
	}{
		"idle machines go, down to min, one per cooldown": {
			cooldown: time.Minute,
			steps:    []step{{run: 20 * time.Minute}},
			wantLive: []string{"h100-3 d1#2"},
		},
		"no cooldown: a deleted machine is not drained again": {
			steps:    []step{{run: 20 * time.Minute}},
			wantLive: []string{"h100-3 d1#2"},
		},
		"busy machines stay": {
			steps: []step{{busy: map[string][]contracts.Priority{"h100-1": {contracts.PriorityNormal}, "h100-2": {contracts.PriorityBestEffort}},
				run: 20 * time.Minute}},
			wantLive: []string{"h100-1 d1#0", "h100-2 d1#1"},
		},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			pool := h100
			pool.DownCooldown = tt.cooldown
			w := newWorld(t, pool, gobreaker.Settings{})
			if err := w.act.Apply(up("d1", 0, 3)); err != nil {
				t.Fatal(err)
			}
			w.run(t, 2*time.Minute)
			for _, s := range tt.steps {
				for node, ps := range s.busy {
					w.ledger.set(node, ps...)
				}
				w.run(t, s.run)
			}
			if diff := cmp.Diff(tt.wantLive, w.live()); diff != "" {
				t.Errorf("machines (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.wantDrained, slices.Sorted(maps.Keys(w.holds.drained))); diff != "" {
				t.Errorf("drain holds left (-want +got):\n%s", diff)
			}
		})
	}
}

// Work placed on a machine after it was chosen (idle) but before the hold
// was seen: work above best effort cancels the scale-down; best-effort work
// is waited for (the drain moves it off).
func TestWorkLandingMidDrain(t *testing.T) {
	tests := map[string]struct {
		priority    contracts.Priority
		wantLive    []string // while the work runs
		wantDrained []string
	}{
		"normal work cancels": {priority: contracts.PriorityNormal,
			wantLive: []string{"h100-1 d1#0", "h100-2 d1#1"}},
		"best effort is waited for": {priority: contracts.PriorityBestEffort,
			wantLive: []string{"h100-1 d1#0", "h100-2 d1#1"}, wantDrained: []string{"h100-1"}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			pool := h100
			pool.DownCooldown = time.Hour // one scale-down in this test
			w := newWorld(t, pool, gobreaker.Settings{})
			if err := w.act.Apply(up("d1", 0, 2)); err != nil {
				t.Fatal(err)
			}
			for i := 0; len(w.holds.drained) == 0; i++ {
				if i > 3600 {
					t.Fatal("no machine drained in an hour of idleness")
				}
				w.run(t, time.Second)
			}
			if diff := cmp.Diff([]string{"h100-1"}, slices.Sorted(maps.Keys(w.holds.drained))); diff != "" {
				t.Fatalf("drained (-want +got):\n%s", diff)
			}
			w.ledger.set("h100-1", tt.priority)
			w.run(t, 10*time.Minute)
			if diff := cmp.Diff(tt.wantLive, w.live()); diff != "" {
				t.Errorf("machines while busy (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.wantDrained, slices.Sorted(maps.Keys(w.holds.drained))); diff != "" {
				t.Errorf("drain holds while busy (-want +got):\n%s", diff)
			}
			if tt.priority != contracts.PriorityBestEffort {
				return
			}
			w.ledger.set("h100-1")
			w.run(t, 2*time.Second)
			if diff := cmp.Diff([]string{"h100-2 d1#1"}, w.live()); diff != "" {
				t.Errorf("machines once the drained one is idle (-want +got):\n%s", diff)
			}
			if len(w.holds.drained) != 0 {
				t.Errorf("holds left after delete: %v", w.holds.drained)
			}
		})
	}
}
