package autoscaler

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
)

// decisionLog counts the decisions a scaler published, by ID, from its
// "scale decision" log record: JetStream drops a second publish under the
// same message ID within its duplicate window, so the stream alone would
// hide a decision taken twice.
type decisionLog struct {
	mu  sync.Mutex
	ids []string
}

func (l *decisionLog) Enabled(context.Context, slog.Level) bool { return true }
func (l *decisionLog) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *decisionLog) WithGroup(string) slog.Handler            { return l }
func (l *decisionLog) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "scale decision" {
		return nil
	}
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "id" {
			l.mu.Lock()
			l.ids = append(l.ids, a.Value.String())
			l.mu.Unlock()
		}
		return true
	})
	return nil
}

func (l *decisionLog) decisions() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.ids)
}

// Alert decisions are remembered only while their episode fires: over many
// episodes the set stays at most one entry, yet an episode's alert handed
// over again (a redelivery the bus cannot de-duplicate, after the cooldown
// that would otherwise hold it back) is never a second decision, live or
// replayed at a restart.
func TestAlertDecisionsAreOncePerEpisodeAndForgottenOnResolve(t *testing.T) {
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// The scalers use the autoscaler's own identity; the test's client,
	// which publishes alerts as the monitor does and replays them, is the
	// operator.
	connect := func(name, creds string) *bus.Bus {
		b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: name, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
			CredsFile: creds})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = b.Close(context.Background()) })
		return b
	}
	b := connect("test", natstest.Operator(t, srv))
	as := connect("autoscaler", natstest.Service(t, srv, contracts.BusAutoscaler))

	now := time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	cfg := DefaultConfig()
	cfg.Now = func() time.Time { return now } // read only from this goroutine
	cfg.Pools = map[string]Pool{"l4": {Max: 1000, MachineType: "g2-standard-8", PriceClass: cloud.OnDemand, UpCooldown: time.Minute}}
	var live decisionLog
	s := newScaler(cfg, as, slog.New(&live))

	// alert publishes an alert as the monitor does and returns it as the
	// scaler's follower reads it; deliver hands it over.
	seq := 0
	deliver := func(s *scaler, m *bus.Msg) {
		t.Helper()
		if err := s.onAlert(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	alert := func(episode int, st contracts.AlertState) *bus.Msg {
		t.Helper()
		a := contracts.Alert{SchemaVersion: contracts.SchemaVersion, Kind: "pool_util_high", Key: "l4", State: st, Severity: "warning",
			Labels: map[string]string{contracts.AlertLabelAction: contracts.AlertActionScaleUp, contracts.AlertLabelPool: "l4",
				contracts.AlertLabelScope: "pool", contracts.AlertLabelEpisode: strconv.Itoa(episode)},
			Message: "pool GPU utilisation above 90%", Time: now}
		seq++
		if _, err := b.Publish(ctx, contracts.SubjectAlert(a.Kind), fmt.Sprintf("alert-%d", seq), a); err != nil {
			t.Fatal(err)
		}
		data, err := json.Marshal(a)
		if err != nil {
			t.Fatal(err)
		}
		return &bus.Msg{Subject: contracts.SubjectAlert(a.Kind), Data: data}
	}
	decided := func(s *scaler) []string {
		s.mu.Lock()
		defer s.mu.Unlock()
		var ids []string
		for id := range s.decided {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		return ids
	}
	id := func(episode int) string { return "scale/l4/alert/pool_util_high/l4/" + strconv.Itoa(episode) }

	const episodes = 40
	var want []string
	for ep := 1; ep <= episodes; ep++ {
		firing := alert(ep, contracts.AlertFiring)
		deliver(s, firing)
		want = append(want, id(ep))
		now = now.Add(2 * time.Minute) // past the cooldown: only decided holds a repeat back
		deliver(s, firing)
		if err := s.evaluateAll(ctx); err != nil {
			t.Fatal(err)
		}
		if got := decided(s); !slices.Equal(got, []string{id(ep)}) {
			t.Fatalf("episode %d firing: decided %v; want only its own decision", ep, got)
		}
		if ep == episodes {
			break // the last episode stays firing across the restart below
		}
		deliver(s, alert(ep, contracts.AlertResolved))
		if got := decided(s); len(got) != 0 {
			t.Fatalf("episode %d resolved: decided %v; want nothing kept", ep, got)
		}
	}
	if got := live.decisions(); !slices.Equal(got, want) {
		t.Errorf("decisions %v; want one per episode %v", got, want)
	}

	// A restart replays every decision and every alert: the resolved
	// episodes are forgotten again, the one still firing is remembered and
	// not decided a second time, even after its cooldown.
	var restarted decisionLog
	s2 := newScaler(cfg, as, slog.New(&restarted))
	if err := s2.restoreDecisions(ctx); err != nil {
		t.Fatal(err)
	}
	if got := decided(s2); len(got) != episodes {
		t.Errorf("restored %d alert decisions; want %d", len(got), episodes)
	}
	now = now.Add(2 * time.Minute)
	if _, err := b.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamOps, FilterSubjects: []string{contracts.SubjectAlertsAll}},
		func(ctx context.Context, m *bus.Msg) error { deliver(s2, m); return nil }); err != nil {
		t.Fatal(err)
	}
	if err := s2.evaluateAll(ctx); err != nil {
		t.Fatal(err)
	}
	if got := decided(s2); !slices.Equal(got, []string{id(episodes)}) {
		t.Errorf("after the replay decided %v; want only the firing episode %s", got, id(episodes))
	}
	if got := restarted.decisions(); len(got) != 0 {
		t.Errorf("the restarted scaler decided %v again; want nothing", got)
	}
}
