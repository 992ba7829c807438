package autoscaler_test

import (
	"context"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/autoscaler"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
)

// TestOnlyPoolsWithAPolicyAreDecided: with a provider, demand for a pool
// with no scaling policy becomes no decision. No one would act on it, and
// the monitor counted each as a scale-up (gpuplane_scale_decisions_total)
// of a pool that never grows. The pool with a policy is decided as before.
func TestOnlyPoolsWithAPolicyAreDecided(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	publish(t, b, contracts.SubjectInventory("h0"), "inv-h0", inventory("h0", "h100", "a3-highgpu-8g", 8, "H100-80GB"))
	publish(t, b, contracts.SubjectInventory("a0"), "inv-a0", inventory("a0", "a100", "a2-ultragpu-8g", 8, "A100-80GB"))

	clk := &clock{now: time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)}
	cfg := testConfig(t, srv, clk, newSim(t, clk, 0), map[string]autoscaler.Pool{
		"h100": {Min: 0, Max: 4, MachineType: "a3-highgpu-8g", PriceClass: cloud.OnDemand}})
	start(t, cfg)

	// a100's demand first: demand is read in stream order, so once h100's
	// decision is out, a100's demand has been weighed.
	publish(t, b, contracts.SubjectDemand("a100"), "d-a100", contracts.PoolDemand{SchemaVersion: 1, Pool: "a100",
		Nodes: 1, Waiting: []contracts.Shape{{Model: "A100-80GB", GPUs: 8, Count: 2}}})
	publish(t, b, contracts.SubjectDemand("h100"), "d-h100", contracts.PoolDemand{SchemaVersion: 1, Pool: "h100",
		Nodes: 1, Waiting: []contracts.Shape{{Model: "H100-80GB", GPUs: 8, Count: 2}}})
	if d := waitDecision(t, b, "h100"); d.Direction != contracts.ScaleUp || d.DesiredNodes != 3 {
		t.Fatalf("h100 decision = %+v; want up to 3", d)
	}
	if ds := decisionsOf(t, b, "a100"); len(ds) != 0 {
		t.Errorf("decisions for a100, a pool with no scaling policy: %+v", ds)
	}
}

// records keeps every log record, at every level, as "LEVEL msg k=v ...".
type records struct {
	mu    sync.Mutex
	lines []string
}

func (r *records) Enabled(context.Context, slog.Level) bool { return true }
func (r *records) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r *records) WithGroup(string) slog.Handler            { return r }
func (r *records) Handle(_ context.Context, rec slog.Record) error {
	line := rec.Level.String() + " " + rec.Message
	rec.Attrs(func(a slog.Attr) bool {
		line += " " + a.Key + "=" + a.Value.String()
		return true
	})
	r.mu.Lock()
	r.lines = append(r.lines, line)
	r.mu.Unlock()
	return nil
}

// about returns the records that mention s.
func (r *records) about(s string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, l := range r.lines {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return out
}

// TestPoolsWithoutAPolicyAreNoWarning: a pool the autoscaler does not
// manage is a normal configuration. Its demand, however often it comes,
// is said once at info; a decision for it already on the bus (from an
// autoscaler without a provider, or one configured otherwise before) is
// not a warning at every term's replay.
func TestPoolsWithoutAPolicyAreNoWarning(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	publish(t, b, contracts.SubjectInventory("h0"), "inv-h0", inventory("h0", "h100", "a3-highgpu-8g", 8, "H100-80GB"))
	publish(t, b, contracts.SubjectInventory("a0"), "inv-a0", inventory("a0", "a100", "a2-ultragpu-8g", 8, "A100-80GB"))
	at := time.Date(2025, 3, 1, 11, 0, 0, 0, time.UTC)
	publish(t, b, contracts.SubjectScale("a100"), "old-a100", contracts.ScaleDecision{SchemaVersion: 1, ID: "old-a100",
		Pool: "a100", Direction: contracts.ScaleUp, CurrentNodes: 1, DesiredNodes: 2, Time: at})
	// After it in the stream: once its machine exists, the a100 decision
	// has been read.
	publish(t, b, contracts.SubjectScale("h100"), "old-h100", contracts.ScaleDecision{SchemaVersion: 1, ID: "old-h100",
		Pool: "h100", Direction: contracts.ScaleUp, CurrentNodes: 0, DesiredNodes: 1, Time: at})
	for i, count := range []int{1, 2, 3} {
		publish(t, b, contracts.SubjectDemand("a100"), "d-a100-"+strconv.Itoa(i), contracts.PoolDemand{SchemaVersion: 1,
			Pool: "a100", Nodes: 1, Waiting: []contracts.Shape{{Model: "A100-80GB", GPUs: 8, Count: count}}})
	}

	clk := &clock{now: time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)}
	sim := newSim(t, clk, 0)
	cfg := testConfig(t, srv, clk, sim, map[string]autoscaler.Pool{
		"h100": {Min: 0, Max: 4, MachineType: "a3-highgpu-8g", PriceClass: cloud.OnDemand}})
	logs := &records{}
	natstest.RunService(t, "autoscaler", func(ctx context.Context) error { return autoscaler.Run(ctx, cfg, slog.New(logs)) })

	eventually(t, "the h100 decision's machine", func() bool {
		for _, m := range sim.Machines() {
			if strings.HasPrefix(m.Token, "old-h100#") {
				return true
			}
		}
		return false
	})
	// Demand is read in stream order: once h100's is weighed, a100's
	// three were.
	publish(t, b, contracts.SubjectDemand("h100"), "d-h100", contracts.PoolDemand{SchemaVersion: 1, Pool: "h100",
		Nodes: 1, Waiting: []contracts.Shape{{Model: "H100-80GB", GPUs: 8, Count: 3}}})
	eventually(t, "h100's demand weighed", func() bool {
		for _, l := range logs.about("pool=h100") {
			if strings.HasPrefix(l, "INFO scale decision ") || strings.HasPrefix(l, "INFO no scale decision ") {
				return true
			}
		}
		return false
	})

	got := logs.about("a100")
	var said []string
	for _, l := range got {
		if strings.HasPrefix(l, "WARN") || strings.HasPrefix(l, "ERROR") {
			t.Errorf("a pool without a policy logged: %s", l)
		}
		if strings.HasPrefix(l, "INFO no scale decision pool=a100") {
			said = append(said, l)
		}
	}
	if len(said) != 1 || !strings.Contains(said[0], "pool a100 has no scaling policy") {
		t.Errorf("a100's demand said %d times at info, want once: %q", len(said), got)
	}
}
