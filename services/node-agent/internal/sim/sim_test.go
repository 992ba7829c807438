package sim

import (
	"context"
	"math"
	"regexp"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/catalog"
)

func model(t testing.TB, id string) catalog.Model {
	t.Helper()
	m, err := catalog.Get(id)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

var uuidRE = regexp.MustCompile(`^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

func TestUUIDsAreStableAndDistinct(t *testing.T) {
	// Pinned values: a change of the derivation would make every restarted
	// agent report new devices, orphaning the ledger's allocations.
	for _, c := range []struct {
		node  string
		index int
		want  string
	}{
		{"h100-01", 0, "GPU-2ebef7c3-f8c7-5df5-a911-eb95dc540dc8"},
		{"l4-03", 3, "GPU-23cf735b-ecba-d2bf-4407-641f9f56bbc1"},
	} {
		if got := UUID(c.node, c.index); got != c.want {
			t.Errorf("UUID(%s, %d) = %s, want %s", c.node, c.index, got, c.want)
		}
	}
	seen := map[string]string{}
	for _, node := range []string{"h100-01", "h100-02", "l4-01"} {
		for i := range 8 {
			u := UUID(node, i)
			if !uuidRE.MatchString(u) {
				t.Errorf("UUID(%s, %d) = %q: not shaped like nvidia-smi's GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", node, i, u)
			}
			if prev, dup := seen[u]; dup {
				t.Errorf("UUID(%s, %d) collides with %s", node, i, prev)
			}
			seen[u] = node
		}
	}
}

func TestDiscoverBuildsTheMachine(t *testing.T) {
	b, err := New(Config{NodeID: "h100-01", Model: model(t, "H100-80GB"), Count: 8, NVLink: true})
	if err != nil {
		t.Fatal(err)
	}
	m, _ := b.Discover(context.Background())
	gpus := m.GPUs
	if len(gpus) != 8 {
		t.Fatalf("%d GPUs, want 8", len(gpus))
	}
	buses := map[string]bool{}
	for i, g := range gpus {
		if g.Index != i || g.UUID != UUID("h100-01", i) || g.Model != "H100-80GB" || g.MemoryMiB != 81559 ||
			g.NVLinkDomain != "h100-01" || !g.Healthy {
			t.Errorf("gpu %d = %+v", i, g)
		}
		if buses[g.PCIBusID] {
			t.Errorf("gpu %d: PCI bus %s reused", i, g.PCIBusID)
		}
		buses[g.PCIBusID] = true
	}
	if gpus[0].PCIBusID != "00000000:18:00.0" {
		t.Errorf("gpu 0 PCI bus %s, want the HGX board's 00000000:18:00.0", gpus[0].PCIBusID)
	}
	for _, g := range gpus {
		if g.ComputeCapability != "9.0" || g.MIGEnabled || len(g.MIGInstances) != 0 {
			t.Errorf("gpu %d: compute capability %q, MIG %v %v", g.Index, g.ComputeCapability, g.MIGEnabled, g.MIGInstances)
		}
	}
	if m.DriverVersion != "550.54.15" || m.CUDAVersion != "12.4" || len(m.Topology) != 28 {
		t.Errorf("driver %q, CUDA %q, %d links; want 550.54.15, 12.4 and 28 pairs", m.DriverVersion, m.CUDAVersion, len(m.Topology))
	}

	l4, err := New(Config{NodeID: "l4-01", Model: model(t, "L4"), Count: 4})
	if err != nil {
		t.Fatal(err)
	}
	m, _ = l4.Discover(context.Background())
	gpus = m.GPUs
	for _, g := range gpus {
		if g.NVLinkDomain != "" {
			t.Errorf("PCIe L4 %d in NVLink domain %q", g.Index, g.NVLinkDomain)
		}
	}
}

func TestNewRejectsImpossibleMachines(t *testing.T) {
	for name, cfg := range map[string]Config{
		"nvlink on a PCIe card":   {NodeID: "n", Model: model(t, "L4"), Count: 4, NVLink: true},
		"no GPUs":                 {NodeID: "n", Model: model(t, "T4"), Count: 0},
		"too many GPUs":           {NodeID: "n", Model: model(t, "T4"), Count: MaxGPUs + 1},
		"no node":                 {Model: model(t, "T4"), Count: 1},
		"no model":                {NodeID: "n", Count: 1},
		"bridges on an SXM card":  {NodeID: "n", Model: model(t, "H100-80GB"), Count: 8, NVLinkBridges: true},
		"bridges on an L4":        {NodeID: "n", Model: model(t, "L4"), Count: 2, NVLinkBridges: true},
		"MIG on a V100":           {NodeID: "n", Model: model(t, "V100-32GB"), Count: 8, MIG: MIG{Enabled: true}},
		"a MIG layout too big":    {NodeID: "n", Model: model(t, "A100-80GB"), Count: 8, MIG: MIG{Enabled: true, Layout: []string{"4g.40gb", "4g.40gb"}}},
		"another model's profile": {NodeID: "n", Model: model(t, "H200-141GB"), Count: 8, MIG: MIG{Enabled: true, Layout: []string{"3g.40gb"}}},
		"a layout, MIG off":       {NodeID: "n", Model: model(t, "A100-80GB"), Count: 8, MIG: MIG{Layout: []string{"7g.80gb"}}},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("%s: New succeeded", name)
		}
	}
}

// TestTelemetryIsPlausible drives a machine for ten minutes of samples,
// half its GPUs busy, and checks the readings against what real cards do.
func TestTelemetryIsPlausible(t *testing.T) {
	m := model(t, "H100-80GB")
	b, err := New(Config{NodeID: "h100-01", Model: m, Count: 8, NVLink: true})
	if err != nil {
		t.Fatal(err)
	}
	disc, _ := b.Discover(context.Background())
	gpus := disc.GPUs

	busy := map[string]string{}
	for _, g := range gpus[:4] {
		busy[g.UUID] = "acme/train/1"
	}
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	var prevUtil [8]float64
	var firstBusyTemp, lastBusyTemp float64
	for s := 0; s <= 600; s++ {
		samples, err := b.Sample(context.Background(), start.Add(time.Duration(s)*time.Second), busy)
		if err != nil {
			t.Fatal(err)
		}
		if len(samples) != 8 {
			t.Fatalf("%d samples, want 8", len(samples))
		}
		for i, x := range samples {
			working := i < 4
			if x.Index != i || x.UUID != gpus[i].UUID {
				t.Fatalf("sample %d is for GPU %d %s", i, x.Index, x.UUID)
			}
			if x.FBUsedMiB < 0 || x.FBUsedMiB > m.MemoryMiB || x.FBUsedMiB+x.FBFreeMiB != m.MemoryMiB {
				t.Fatalf("gpu %d: used %d + free %d MiB, total %d", i, x.FBUsedMiB, x.FBFreeMiB, m.MemoryMiB)
			}
			if x.PowerW <= 0 || x.PowerW > m.TDPWatts || x.PowerLimitW != m.TDPWatts {
				t.Fatalf("gpu %d: power %v W outside (0, %v], limit %v W", i, x.PowerW, m.TDPWatts, x.PowerLimitW)
			}
			if !x.Healthy || x.LastXID != 0 || x.ECCDBE != 0 {
				t.Fatalf("gpu %d: healthy %v, last XID %d, %d double-bit errors on a machine without faults", i, x.Healthy, x.LastXID, x.ECCDBE)
			}
			if x.ThrottleReasons&(contracts.ThrottleHWThermal|contracts.ThrottleHWSlowdown) != 0 {
				t.Fatalf("gpu %d at %v °C: thermal throttle %v", i, x.TempC, contracts.ThrottleReasonNames(x.ThrottleReasons))
			}
			if working {
				if x.GPUUtil < 85 || x.GPUUtil > 98 {
					t.Fatalf("busy gpu %d at %ds: util %v, want 85-98", i, s, x.GPUUtil)
				}
				if x.FBUsedMiB < m.MemoryMiB/2 {
					t.Fatalf("busy gpu %d: only %d MiB used", i, x.FBUsedMiB)
				}
				if x.PowerW < 0.8*m.TDPWatts {
					t.Fatalf("busy gpu %d: %v W is not near TDP %v W", i, x.PowerW, m.TDPWatts)
				}
				if x.AllocationID != "acme/train/1" {
					t.Fatalf("busy gpu %d: allocation %q", i, x.AllocationID)
				}
				if len(x.Processes) != 1 || x.Processes[0].PID < 1000 || x.Processes[0].UsedMiB != x.FBUsedMiB ||
					x.Processes[0].PID != samples[0].Processes[0].PID {
					t.Fatalf("busy gpu %d: processes %+v; want the allocation's one process using %d MiB", i, x.Processes, x.FBUsedMiB)
				}
				if x.ThrottleReasons&contracts.ThrottleGPUIdle != 0 || x.SMClockMHz < 0.95*m.MaxSMClockMHz {
					t.Fatalf("busy gpu %d: throttle %v, SM clock %v MHz", i, contracts.ThrottleReasonNames(x.ThrottleReasons), x.SMClockMHz)
				}
				if s > 0 && math.Abs(x.GPUUtil-prevUtil[i]) > 6 {
					t.Fatalf("busy gpu %d jumps from %v to %v %% in a second", i, prevUtil[i], x.GPUUtil)
				}
				prevUtil[i] = x.GPUUtil
			} else {
				if x.GPUUtil != 0 || x.FBUsedMiB != 0 || x.AllocationID != "" {
					t.Fatalf("idle gpu %d: util %v, used %d MiB, allocation %q", i, x.GPUUtil, x.FBUsedMiB, x.AllocationID)
				}
				if x.TempC < 29 || x.TempC > 36 {
					t.Fatalf("idle gpu %d at %v °C, want about 30-35", i, x.TempC)
				}
				if x.PowerW > 2*m.IdleWatts {
					t.Fatalf("idle gpu %d draws %v W", i, x.PowerW)
				}
				if x.ThrottleReasons != contracts.ThrottleGPUIdle || len(x.Processes) != 0 || x.SMClockMHz != m.IdleSMClockMHz {
					t.Fatalf("idle gpu %d: throttle %v, processes %v, clock %v", i, contracts.ThrottleReasonNames(x.ThrottleReasons), x.Processes, x.SMClockMHz)
				}
			}
		}
		if s == 0 {
			firstBusyTemp = samples[0].TempC
		}
		lastBusyTemp = samples[0].TempC
	}
	if firstBusyTemp > 36 || lastBusyTemp < 65 || lastBusyTemp > 82 || lastBusyTemp >= m.SlowdownTempC {
		t.Fatalf("busy gpu warmed from %v to %v °C, want from idle to 65-82, below slowdown", firstBusyTemp, lastBusyTemp)
	}
}

func TestTelemetryIsDeterministic(t *testing.T) {
	cfg := Config{NodeID: "a100-02", Model: model(t, "A100-80GB"), Count: 8, NVLink: true}
	b1, _ := New(cfg)
	b2, _ := New(cfg)
	busy := map[string]string{UUID("a100-02", 5): "t/j/1"}
	start := time.Unix(1_800_000_000, 0)
	for s := range 30 {
		now := start.Add(time.Duration(s) * 700 * time.Millisecond)
		x1, _ := b1.Sample(context.Background(), now, busy)
		x2, _ := b2.Sample(context.Background(), now, busy)
		if d := cmp.Diff(x1, x2); d != "" {
			t.Fatalf("same seed and inputs, different samples at step %d (-1 +2):\n%s", s, d)
		}
	}
	other, _ := New(Config{NodeID: "a100-03", Model: cfg.Model, Count: 8, NVLink: true})
	x1, _ := b1.Sample(context.Background(), start.Add(time.Minute), busy)
	x3, _ := other.Sample(context.Background(), start.Add(time.Minute), map[string]string{UUID("a100-03", 5): "t/j/1"})
	if x1[5].GPUUtil == x3[5].GPUUtil && x1[5].PowerW == x3[5].PowerW {
		t.Errorf("two machines report identical busy figures: seeds are not per node")
	}
}
