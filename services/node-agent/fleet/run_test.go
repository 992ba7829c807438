package fleet_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

func TestRunStartsOneAgentPerMachineOnOneConnection(t *testing.T) {
	bs := fleet.ConnectBuses(t)
	b := bs.Op
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	f, err := fleet.Parse([]byte(`
machineTypes:
  h100x8: {gpuModel: H100-80GB, gpuCount: 8, nvlink: true}
  l4x4: {gpuModel: L4, gpuCount: 4}
pools:
  - {name: h100, machineType: h100x8, count: 1, zone: zone-a, priceClass: on-demand}
  - {name: l4, machineType: l4x4, count: 2, zone: zone-b, priceClass: spot, labels: {tier: inference}}
`))
	if err != nil {
		t.Fatal(err)
	}

	var mu sync.Mutex
	inventories := map[string]contracts.NodeInventory{}
	telemetry := map[string]int{}
	watch := func(stream, subject string, fn func(*bus.Msg)) {
		go func() {
			_ = b.Follow(ctx, bus.FollowSpec{Stream: stream, FilterSubjects: []string{subject}}, func(_ context.Context, m *bus.Msg) error {
				mu.Lock()
				defer mu.Unlock()
				fn(m)
				return nil
			}, nil)
		}()
	}
	watch(contracts.StreamNodes, contracts.SubjectInventoryAll, func(m *bus.Msg) {
		var inv contracts.NodeInventory
		if err := m.Decode(&inv); err == nil {
			inventories[inv.NodeID] = inv
		}
	})
	watch(contracts.StreamTelemetry, contracts.SubjectTelemetryAll, func(m *bus.Msg) { telemetry[contracts.Token(m.Subject, 2)]++ })

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- fleet.Run(runCtx, f, bs.Fleet, nodeagent.Config{HeartbeatInterval: 100 * time.Millisecond,
			TelemetryInterval: 100 * time.Millisecond, LogDir: t.TempDir()},
			slog.New(slog.NewTextHandler(t.Output(), nil)))
	}()

	want := map[string]int{"h100-01": 8, "l4-01": 4, "l4-02": 4}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		mu.Lock()
		ready := len(inventories) == len(want)
		for n := range want {
			ready = ready && telemetry[n] >= 3
		}
		mu.Unlock()
		if ready {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("fleet did not report: inventories %v, telemetry %v", inventories, telemetry)
		}
	}
	mu.Lock()
	for n, gpus := range want {
		inv := inventories[n]
		if len(inv.GPUs) != gpus {
			t.Errorf("%s reports %d GPUs, want %d", n, len(inv.GPUs), gpus)
		}
	}
	if l4 := inventories["l4-02"]; l4.Pool != "l4" || l4.Zone != "zone-b" || l4.PriceClass != "spot" ||
		l4.Labels["tier"] != "inference" || l4.MachineType != "l4x4" || l4.GPUs[0].NVLinkDomain != "" {
		t.Errorf("l4-02 inventory %+v", l4)
	}
	if h := inventories["h100-01"]; h.GPUs[7].NVLinkDomain != "h100-01" {
		t.Errorf("h100-01 GPUs not in the node's NVLink domain: %+v", h.GPUs[7])
	}
	mu.Unlock()

	stop()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("fleet.Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("fleet did not stop")
	}
}
