package gpuplane_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

func TestMain(m *testing.M) {
	nodeagent.MaybeRunShim()
	m.Run()
}

// The autoscaled pool is filled to its minimum with machines whose agents
// register; a spot notice drains the node, and after the reclaim the pool
// is refilled with a new machine.
func TestAutoscaledSpotPool(t *testing.T) {
	fl, err := fleet.Parse([]byte(`
machineTypes:
  l4x1: {gpuModel: L4, gpuCount: 1}
pools:
  - {name: static, machineType: l4x1, count: 1}
`))
	if err != nil {
		t.Fatal(err)
	}
	cfg := gpuplane.Config{NATSPort: -1, GatewayAddr: "127.0.0.1:0", MetricsAddr: "127.0.0.1:0", Fleet: &fl,
		AgentLogDir: t.TempDir(), SpotNotice: time.Second, Identities: natsauth.DefaultDescription(),
		Autoscale: []gpuplane.AutoscalePool{{Name: "spot", MachineType: "l4x1", PriceClass: cloud.Spot, Min: 1, Max: 2}}}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ready := make(chan gpuplane.Endpoints, 1)
	stopped := make(chan struct{})
	var runErr error
	go func() {
		defer close(stopped)
		runErr = gpuplane.Run(ctx, cfg, slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn})),
			func(ep gpuplane.Endpoints) { ready <- ep })
	}()
	defer func() {
		cancel()
		<-stopped
		if runErr != nil {
			t.Errorf("Run: %v", runErr)
		}
	}()
	var ep gpuplane.Endpoints
	select {
	case ep = <-ready:
	case <-stopped:
		t.Fatal("Run returned before it was ready")
	}
	if ep.Cloud == nil {
		t.Fatal("no simulated cloud in Endpoints")
	}
	b, err := bus.Connect(ctx, bus.Config{URL: ep.NATSURL, Name: "test", CredsFile: ep.Creds["operator"]})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close(context.Background())

	registered := func(node string) bool {
		found := false
		_, err := b.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamNodes, FilterSubjects: []string{contracts.SubjectInventory(node)}},
			func(context.Context, *bus.Msg) error { found = true; return nil })
		return err == nil && found
	}
	eventually(t, "a machine of the pool registers", func() bool { return registered("spot-1") })

	if err := ep.Cloud.Interrupt("spot-1"); err != nil {
		t.Fatal(err)
	}
	kv, err := b.KeyValue(ctx, contracts.BucketNodeAdmin)
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "spot-1 drained", func() bool {
		e, err := kv.Get(ctx, "spot-1")
		var na contracts.NodeAdmin
		return err == nil && json.Unmarshal(e.Value(), &na) == nil && na.Drain && na.Cause == contracts.ReasonSpotInterruption
	})
	eventually(t, "a replacement registers", func() bool { return registered("spot-2") })
	eventually(t, "spot-1 reclaimed and its hold lifted", func() bool {
		_, err := kv.Get(ctx, "spot-1")
		return err != nil && ep.Cloud.Machines()[0].State == cloud.Deleted
	})
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 30s", what)
		}
	}
}
