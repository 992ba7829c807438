package autoscaler_test

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/autoscaler"
	"github.com/gpuplane/gpuplane/services/autoscaler/internal/actuate"
)

func TestFlagsAndValidate(t *testing.T) {
	cfg := autoscaler.DefaultConfig()
	fs := flag.NewFlagSet("autoscaler", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	cfg.RegisterFlags(fs)
	if err := fs.Parse([]string{"-max-nodes", "h100=4, a100=2", "-cooldown", "1m", "-default-max-nodes", "3"}); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(map[string]int{"h100": 4, "a100": 2}, cfg.MaxNodes); diff != "" {
		t.Errorf("MaxNodes (-want +got):\n%s", diff)
	}
	if cfg.Cooldown != time.Minute || cfg.DefaultMaxNodes != 3 {
		t.Errorf("cooldown %s, default max %d", cfg.Cooldown, cfg.DefaultMaxNodes)
	}
	if err := cfg.Validate(); err != nil {
		t.Errorf("valid config: %v", err)
	}
	if err := fs.Parse([]string{"-max-nodes", "h100"}); err == nil {
		t.Error("-max-nodes h100 (no =n) accepted")
	}

	bad := autoscaler.DefaultConfig()
	bad.Bus.Replicas = 2
	bad.MaxNodes = map[string]int{"Bad.Pool": 1, "h100": -1}
	bad.DefaultMaxNodes = -1
	bad.Cooldown = -time.Second
	bad.Pools = map[string]actuate.Pool{"h100": {Min: 2, Max: 1, MachineType: "a3-highgpu-8g", PriceClass: "cheap"}}
	err := bad.Validate()
	for _, want := range []string{"replicas", `invalid pool "Bad.Pool"`, "h100 has maximum -1", "default-max-nodes", "cooldown",
		"min 2, max 1", `price class "cheap"`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate() = %v, want it to mention %q", err, want)
		}
	}
}

func TestDemandBecomesAScaleDecision(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	for i := range 2 {
		publish(t, b, contracts.SubjectInventory(fmt.Sprintf("h%d", i)), fmt.Sprintf("inv-h%d", i),
			inventory(fmt.Sprintf("h%d", i), "h100", "a3-highgpu-8g", 8, "H100-80GB"))
	}
	publish(t, b, contracts.SubjectInventory("a0"), "inv-a0", inventory("a0", "a100", "a2-ultragpu-4g", 4, "A100-80GB"))
	publish(t, b, contracts.SubjectInventory("l0"), "inv-l0", inventory("l0", "l4", "g2-standard-8", 1, "L4"))

	t0 := time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	clk := &clock{now: t0}
	cfg := autoscaler.DefaultConfig()
	cfg.Bus = busConfig(t, srv)
	cfg.MaxNodes = map[string]int{"h100": 6}
	cfg.DefaultMaxNodes = 3
	cfg.Cooldown = 30 * time.Second
	cfg.Now = clk.Now
	stop := start(t, cfg)

	// Three 8-GPU jobs wait on a pool of two 8-GPU machines: +3.
	seq1 := publish(t, b, contracts.SubjectDemand("h100"), "d1", contracts.PoolDemand{SchemaVersion: 1, Pool: "h100",
		Nodes: 2, TotalGPUs: 16, PendingJobs: 3, PendingGPUs: 24, Waiting: []contracts.Shape{{Model: "H100-80GB", GPUs: 8, Count: 3}}})
	want := []contracts.ScaleDecision{{SchemaVersion: 1, ID: fmt.Sprintf("scale/h100/%d/up-5", seq1), Pool: "h100",
		Direction: contracts.ScaleUp, CurrentNodes: 2, DesiredNodes: 5, Time: t0,
		Reason: "3 jobs waiting (3×8 GPUs H100-80GB) need 3 more a3-highgpu-8g machines of 8 GPUs"}}
	waitDecisions(t, b, want)

	// More demand inside the cooldown: held back. The a100 demand behind it
	// is a barrier: the follower decides in stream order.
	seq2 := publish(t, b, contracts.SubjectDemand("h100"), "d2", contracts.PoolDemand{SchemaVersion: 1, Pool: "h100",
		Nodes: 2, Waiting: []contracts.Shape{{Model: "H100-80GB", GPUs: 8, Count: 5}}})
	seqA := publish(t, b, contracts.SubjectDemand("a100"), "d3", contracts.PoolDemand{SchemaVersion: 1, Pool: "a100",
		Nodes: 1, Waiting: []contracts.Shape{{Model: "A100-80GB", GPUs: 2, Count: 3}}})
	want = append(want, contracts.ScaleDecision{SchemaVersion: 1, ID: fmt.Sprintf("scale/a100/%d/up-3", seqA), Pool: "a100",
		Direction: contracts.ScaleUp, CurrentNodes: 1, DesiredNodes: 3, Time: t0,
		Reason: "3 jobs waiting (3×2 GPUs A100-80GB) need 2 more a2-ultragpu-4g machines of 4 GPUs"})
	waitDecisions(t, b, want)

	// The cooldown ends: the tick decides the held-back demand, capped.
	t1 := clk.Advance(31 * time.Second)
	want = append(want, contracts.ScaleDecision{SchemaVersion: 1, ID: fmt.Sprintf("scale/h100/%d/up-6", seq2), Pool: "h100",
		Direction: contracts.ScaleUp, CurrentNodes: 2, DesiredNodes: 6, Time: t1,
		Reason: "5 jobs waiting (5×8 GPUs H100-80GB) need 5 more a3-highgpu-8g machines of 8 GPUs; capped at the pool maximum of 6 nodes"})
	waitDecisions(t, b, want)

	// Restart, long after the cooldown, with JetStream's duplicate window
	// gone: the latest demands are decided again and must not be repeated.
	natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamOps)
	stop()
	clk.Advance(time.Hour)
	start(t, cfg)
	seqL := publish(t, b, contracts.SubjectDemand("l4"), "d4", contracts.PoolDemand{SchemaVersion: 1, Pool: "l4",
		Nodes: 1, Waiting: []contracts.Shape{{Model: "L4", GPUs: 1, Count: 1}}})
	want = append(want, contracts.ScaleDecision{SchemaVersion: 1, ID: fmt.Sprintf("scale/l4/%d/up-2", seqL), Pool: "l4",
		Direction: contracts.ScaleUp, CurrentNodes: 1, DesiredNodes: 2, Time: t1.Add(time.Hour),
		Reason: "1 job waiting (1×1 GPU L4) need 1 more g2-standard-8 machine of 1 GPU"})
	waitDecisions(t, b, want)
}

// --- helpers ---

type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Advance(d time.Duration) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	return c.now
}

// connect connects the test's own client, which plays the node agents and
// the other services and observes: the operator.
func connect(t *testing.T, srv *natsserver.Server) *bus.Bus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "test", Logger: quietLog(), CredsFile: natstest.Operator(t, srv)})
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	return b
}

// busConfig is the autoscaler's bus configuration on srv, with its own
// identity: the tests prove its permissions suffice.
func busConfig(t *testing.T, srv *natsserver.Server) service.BusConfig {
	return service.BusConfig{NATSURL: srv.URL(), Replicas: 1, Creds: natstest.Service(t, srv, contracts.BusAutoscaler)}
}

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// start runs the autoscaler until stop is called or the test ends, and
// checks that it stops cleanly within a bounded time.
func start(t *testing.T, cfg autoscaler.Config) (stop func()) {
	t.Helper()
	return natstest.RunService(t, "autoscaler", func(ctx context.Context) error { return autoscaler.Run(ctx, cfg, quietLog()) })
}

func publish(t *testing.T, b *bus.Bus, subject, id string, v any) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ack, err := b.Publish(ctx, subject, id, v)
	if err != nil {
		t.Fatalf("publish %s: %v", subject, err)
	}
	return ack.Sequence
}

// waitDecisions waits until the decisions on the bus are exactly want, in
// order, each published under its own ID as Nats-Msg-Id.
func waitDecisions(t *testing.T, b *bus.Bus, want []contracts.ScaleDecision) {
	t.Helper()
	var got []contracts.ScaleDecision
	deadline := time.Now().Add(10 * time.Second)
	for {
		got = got[:0]
		_, err := b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamOps,
			FilterSubjects: []string{contracts.SubjectScaleAll}}, func(_ context.Context, m *bus.Msg) error {
			var d contracts.ScaleDecision
			if err := m.Decode(&d); err != nil {
				return err
			}
			if m.ID() != d.ID || m.Subject != contracts.SubjectScale(d.Pool) {
				return fmt.Errorf("decision %s came as %s on %s", d.ID, m.ID(), m.Subject)
			}
			got = append(got, d)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(got) >= len(want) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("scale decisions (-want +got):\n%s", diff)
	}
}

func inventory(node, pool, machineType string, gpus int, model string) contracts.NodeInventory {
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: node, Hostname: node, Pool: pool, MachineType: machineType, Incarnation: "i1"}
	for i := range gpus {
		inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: fmt.Sprintf("GPU-%s-%d", node, i), Model: model, Healthy: true})
	}
	return inv
}

// TestMIGDemandIsSizedByInstances: a pool of 8-GPU machines whose cards
// are in MIG mode with seven 1g.10gb instances each holds 56 such jobs per
// machine, as its live machine's inventory shows; 57 waiting need two more
// machines, not eight.
func TestMIGDemandIsSizedByInstances(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	inv := inventory("m0", "mig", "a3-highgpu-8g", 8, "H100-80GB")
	for i := range inv.GPUs {
		inv.GPUs[i].MIGEnabled = true
		for k := range 7 {
			inv.GPUs[i].MIGInstances = append(inv.GPUs[i].MIGInstances, contracts.MIGInstance{
				UUID: fmt.Sprintf("MIG-m0-%d-%d", i, k), Profile: "1g.10gb", GIID: k + 1, Start: k, Size: 1, MemoryMiB: 9856})
		}
	}
	publish(t, b, contracts.SubjectInventory("m0"), "inv-m0", inv)
	t0 := time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	cfg := autoscaler.DefaultConfig()
	cfg.Bus = busConfig(t, srv)
	cfg.DefaultMaxNodes = 10
	cfg.Now = (&clock{now: t0}).Now
	start(t, cfg)
	seq := publish(t, b, contracts.SubjectDemand("mig"), "d1", contracts.PoolDemand{SchemaVersion: 1, Pool: "mig",
		Nodes: 1, TotalGPUs: 8, PendingJobs: 57, PendingGPUs: 57,
		Waiting: []contracts.Shape{{Model: "H100-80GB", GPUs: 1, Count: 57, MIGProfile: "1g.10gb"}}})
	got := waitDecision(t, b, "mig")
	if got.ID != fmt.Sprintf("scale/mig/%d/up-3", seq) || got.CurrentNodes != 1 || got.DesiredNodes != 3 {
		t.Fatalf("decision %+v, want 1 -> 3 nodes (57 instances at 56 per machine)", got)
	}
}

// waitDecision waits for the first decision of pool.
func waitDecision(t *testing.T, b *bus.Bus, pool string) contracts.ScaleDecision {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var got *contracts.ScaleDecision
		_, err := b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamOps,
			FilterSubjects: []string{contracts.SubjectScale(pool)}}, func(_ context.Context, m *bus.Msg) error {
			var d contracts.ScaleDecision
			if err := m.Decode(&d); err != nil {
				return err
			}
			if got == nil {
				got = &d
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if got != nil {
			return *got
		}
		if time.Now().After(deadline) {
			t.Fatalf("no decision for pool %s", pool)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
