package fleet_test

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/sim"
)

func TestNewMachine(t *testing.T) {
	f := fleet.Default()
	tests := map[string]struct {
		node, pool, typ, price string
		want                   fleet.Machine
		err                    string
	}{
		"a pool of the fleet lends its zone, labels and taints": {node: "l4-x1", pool: "l4", typ: "pcie-l4-4",
			want: fleet.Machine{NodeID: "l4-x1", Pool: "l4", Zone: "zone-b", MachineType: "pcie-l4-4", PriceClass: "spot",
				Purpose: "inference", GPUModel: "L4", GPUCount: 4}},
		"a pool the fleet lacks: only the type's shape": {node: "as-1", pool: "burst", typ: "hgx-h100-8", price: "spot",
			want: fleet.Machine{NodeID: "as-1", Pool: "burst", MachineType: "hgx-h100-8", PriceClass: "spot",
				GPUModel: "H100-80GB", GPUCount: 8, NVLink: true}},
		"unknown type":  {node: "x", pool: "burst", typ: "tpu", err: `unknown machine type "tpu"`},
		"bad pool":      {node: "x", pool: "Bad.Pool", typ: "pcie-l4-4", err: "invalid pool"},
		"bad price":     {node: "x", pool: "burst", typ: "pcie-l4-4", price: "cheap", err: `price class "cheap"`},
		"empty node ID": {node: "", pool: "burst", typ: "pcie-l4-4", err: "node ID"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			m, err := f.NewMachine(tt.node, tt.pool, tt.typ, tt.price)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("err %v; want it to mention %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if m.NodeID != tt.want.NodeID || m.Pool != tt.want.Pool || m.Zone != tt.want.Zone || m.MachineType != tt.want.MachineType ||
				m.PriceClass != tt.want.PriceClass || m.Purpose != tt.want.Purpose || m.GPUModel != tt.want.GPUModel ||
				m.GPUCount != tt.want.GPUCount || m.NVLink != tt.want.NVLink {
				t.Errorf("machine %+v; want %+v", m, tt.want)
			}
			// Labels and taints are the pool's: those of its static
			// machines when the fleet has the pool, none otherwise.
			var like *fleet.Machine
			for _, sm := range f.Machines() {
				if sm.Pool == tt.pool {
					like = &sm
					break
				}
			}
			switch {
			case like == nil && (len(m.Labels) != 0 || len(m.Taints) != 0):
				t.Errorf("machine of a pool the fleet lacks has labels %v, taints %v", m.Labels, m.Taints)
			case like != nil && (!reflect.DeepEqual(m.Labels, like.Labels) || !reflect.DeepEqual(m.Taints, like.Taints) ||
				len(m.Taints) == 0):
				t.Errorf("labels %v, taints %v; want the pool's %v, %v (a spot pool has a taint)", m.Labels, m.Taints, like.Labels, like.Taints)
			}
		})
	}
}

// A machine started at run time registers and runs work; killed, its run
// dies with it and nothing more is reported; started again, it comes back
// as a new incarnation.
func TestDynamicStartAndKill(t *testing.T) {
	bs := fleet.ConnectBuses(t)
	b := bs.Op
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	var mu sync.Mutex
	incarnations := map[string]bool{}
	runs := map[string][]contracts.RunEvent{}
	follow := func(stream, subject string, fn func(*bus.Msg)) {
		go func() {
			_ = b.Follow(ctx, bus.FollowSpec{Stream: stream, FilterSubjects: []string{subject}}, func(_ context.Context, m *bus.Msg) error {
				mu.Lock()
				defer mu.Unlock()
				fn(m)
				return nil
			}, nil)
		}()
	}
	follow(contracts.StreamNodes, contracts.SubjectInventory("spot-1"), func(m *bus.Msg) {
		var inv contracts.NodeInventory
		if m.Decode(&inv) == nil && len(inv.GPUs) == 4 && inv.Pool == "l4" {
			incarnations[inv.Incarnation] = true
		}
	})
	follow(contracts.StreamRuns, contracts.SubjectRuns("spot-1"), func(m *bus.Msg) {
		var ev contracts.RunEvent
		if m.Decode(&ev) == nil {
			runs[ev.AllocationID] = append(runs[ev.AllocationID], ev)
		}
	})
	seen := func(cond func() bool) func() bool {
		return func() bool { mu.Lock(); defer mu.Unlock(); return cond() }
	}

	d := fleet.NewDynamic(bs.Fleet, nodeagent.Config{HeartbeatInterval: 100 * time.Millisecond, TelemetryInterval: 100 * time.Millisecond,
		LogDir: t.TempDir()}, slog.New(slog.NewTextHandler(t.Output(), nil)))
	m, err := fleet.Default().NewMachine("spot-1", "l4", "pcie-l4-4", "")
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	defer func() { stop(); d.Wait() }()
	if err := d.Start(runCtx, m); err != nil {
		t.Fatal(err)
	}
	if err := d.Start(runCtx, m); err == nil {
		t.Error("a second Start of a running machine succeeded")
	}
	eventuallyT(t, "inventory of spot-1", seen(func() bool { return len(incarnations) == 1 }))

	pidFile := filepath.Join(t.TempDir(), "pid")
	alloc := contracts.Allocation{ID: contracts.AllocationID("acme", "j1", 1), Tenant: "acme", JobID: "j1", Attempt: 1,
		NodeID: "spot-1", Pool: "l4", Run: contracts.RunSpec{Command: []string{"sh", "-c", "echo $$ > " + pidFile + "; exec sleep 60"}},
		Devices: []contracts.DeviceRef{{Index: 0, UUID: sim.UUID("spot-1", 0), Model: "L4"}}}
	if _, err := bs.RM.Publish(ctx, contracts.SubjectLedger("spot-1"), contracts.LedgerEntryID(contracts.LedgerCommitted, alloc.ID),
		contracts.LedgerEntry{SchemaVersion: contracts.SchemaVersion, Kind: contracts.LedgerCommitted, Allocation: alloc, Time: time.Now()}); err != nil {
		t.Fatal(err)
	}
	var pid int
	eventuallyT(t, "the run's PID", func() bool {
		data, err := os.ReadFile(pidFile)
		pid, _ = strconv.Atoi(strings.TrimSpace(string(data)))
		return err == nil && pid > 0
	})
	eventuallyT(t, "the run started", seen(func() bool { return len(runs[alloc.ID]) > 0 }))

	if !d.Kill("spot-1") {
		t.Fatal("Kill: spot-1 not running")
	}
	if d.Kill("nope") {
		t.Error("Kill of an unknown machine reported it running")
	}
	eventuallyT(t, "the agent stopped", func() bool { return len(d.Running()) == 0 })
	eventuallyT(t, "the run killed", func() bool { return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) })
	mu.Lock()
	for _, ev := range runs[alloc.ID] {
		if ev.Kind == contracts.RunEnded {
			t.Errorf("a reclaimed machine reported its run ended: %+v", ev)
		}
	}
	mu.Unlock()

	if err := d.Start(runCtx, m); err != nil {
		t.Fatalf("start again after death: %v", err)
	}
	eventuallyT(t, "a second incarnation of spot-1", seen(func() bool { return len(incarnations) == 2 }))
}

func eventuallyT(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(15 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 15s", what)
		}
	}
}
