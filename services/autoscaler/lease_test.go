package autoscaler_test

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/autoscaler"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/autoscaler/internal/actuate"
	"github.com/gpuplane/gpuplane/services/autoscaler/simcloud"
)

// TestOnlyTheLeaseHolderScales runs two autoscaler replicas on one lease
// and one provider. While the first leads, demand is decided once, by it,
// and the standby creates nothing; when the leader stops, the standby
// takes the lease and decides the next demand.
func TestOnlyTheLeaseHolderScales(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	publish(t, b, contracts.SubjectInventory("h0"), "inv-h0", inventory("h0", "h100", "a3-highgpu-8g", 8, "H100-80GB"))
	sim, err := simcloud.New(simcloud.Config{Now: time.Now})
	if err != nil {
		t.Fatal(err)
	}
	replica := func(name string) autoscaler.Config {
		cfg := autoscaler.DefaultConfig()
		cfg.Bus = busConfig(t, srv)
		cfg.Instance = name
		cfg.LeaseTTL = 300 * time.Millisecond
		cfg.Provider = sim
		cfg.Cooldown = 0
		cfg.Pools = map[string]actuate.Pool{"h100": {Min: 0, Max: 8, MachineType: "a3-highgpu-8g", PriceClass: cloud.OnDemand}}
		return cfg
	}
	// Who published each decision (its CloudEvents source).
	var mu sync.Mutex
	var sources []string
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() {
		_ = b.Follow(ctx, bus.FollowSpec{Stream: contracts.StreamOps, FilterSubjects: []string{contracts.SubjectScaleAll}},
			func(_ context.Context, m *bus.Msg) error {
				mu.Lock()
				sources = append(sources, m.Header.Get(contracts.HeaderCESource))
				mu.Unlock()
				return nil
			}, nil)
	}()
	decided := func() []string { mu.Lock(); defer mu.Unlock(); return append([]string(nil), sources...) }

	stopA := start(t, replica("autoscaler-a"))
	eventually(t, "autoscaler-a leading", func() bool { return leaseHolder(t, b) == "autoscaler-a" })
	start(t, replica("autoscaler-b"))
	publish(t, b, contracts.SubjectDemand("h100"), "d1", contracts.PoolDemand{SchemaVersion: 1, Pool: "h100",
		Nodes: 1, Waiting: []contracts.Shape{{Model: "H100-80GB", GPUs: 8, Count: 1}}})
	eventually(t, "the leader's decision and machine", func() bool { return len(decided()) == 1 && len(sim.Machines()) == 1 })
	// The standby had the same demand to act on; give it a few of its
	// one-second re-evaluations to show it does not.
	time.Sleep(2500 * time.Millisecond)
	if got := decided(); len(got) != 1 || got[0] != "/gpuplane/autoscaler-a" || len(sim.Machines()) != 1 {
		t.Fatalf("decisions by %v, %d machines; want one decision by autoscaler-a and one machine", got, len(sim.Machines()))
	}

	stopA()
	eventually(t, "autoscaler-b leading", func() bool { return leaseHolder(t, b) == "autoscaler-b" })
	publish(t, b, contracts.SubjectDemand("h100"), "d2", contracts.PoolDemand{SchemaVersion: 1, Pool: "h100",
		Nodes: 1, Waiting: []contracts.Shape{{Model: "H100-80GB", GPUs: 8, Count: 4}}})
	eventually(t, "the new leader's decision", func() bool {
		got := decided()
		return len(got) == 2 && got[1] == "/gpuplane/autoscaler-b"
	})
}

// leaseHolder is the replica name in the autoscaler lease's holder, or ""
// while none holds it.
func leaseHolder(t *testing.T, b *bus.Bus) string {
	t.Helper()
	kv, err := b.KeyValue(context.Background(), contracts.BucketLeases)
	if err != nil {
		t.Fatal(err)
	}
	e, err := kv.Get(context.Background(), contracts.LeaseKeyAutoscaler)
	if err != nil {
		return ""
	}
	var l contracts.Lease
	if err := json.Unmarshal(e.Value(), &l); err != nil || time.Now().After(l.Expires) {
		return ""
	}
	for _, name := range []string{"autoscaler-a", "autoscaler-b"} {
		if len(l.Holder) > len(name) && l.Holder[:len(name)+1] == name+"-" {
			return name
		}
	}
	return ""
}
