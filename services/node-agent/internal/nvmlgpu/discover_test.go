package nvmlgpu

import (
	"context"
	"fmt"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestDiscoverReadsGPUsAndDriver(t *testing.T) {
	m := newFakeMachine(t)
	m.set(7, func(g *fakeGPU) { g.Name = "Mock NVIDIA A100-SXM4-40GB" }) // not in the catalogue
	b, _, _ := open(t, m)
	got, err := b.Discover(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if got.DriverVersion != "550.54.15" || got.CUDAVersion != "12.4" {
		t.Errorf("driver %q, CUDA %q; want 550.54.15, 12.4", got.DriverVersion, got.CUDAVersion)
	}
	if len(got.GPUs) != 8 {
		t.Fatalf("%d GPUs; want 8", len(got.GPUs))
	}
	for i, g := range got.GPUs {
		want := contracts.GPUInfo{
			Index: i, UUID: m.gpus[i].UUID, Model: "A100-40GB", MemoryMiB: 40960,
			PCIBusID: fmt.Sprintf("00000000:%02x:00.0", i), NVLinkDomain: "node-1-nvl0",
			Healthy: true, ComputeCapability: "8.0",
		}
		if i == 7 {
			want.Model = "Mock NVIDIA A100-SXM4-40GB" // an unknown product keeps its name
		}
		if diff := cmp.Diff(want, g); diff != "" {
			t.Errorf("GPU %d (-want +got):\n%s", i, diff)
		}
	}
	if mt := b.MachineType(); mt != "mixed-x8" {
		t.Errorf("machine type %q; want mixed-x8 (one GPU is another model)", mt)
	}
}

func TestMachineType(t *testing.T) {
	m := newFakeMachine(t)
	b, _, _ := open(t, m)
	if mt := b.MachineType(); mt != "a100-40gb-x8" {
		t.Errorf("machine type %q; want a100-40gb-x8", mt)
	}
}

func TestDiscoverReadsExistingMIGDevices(t *testing.T) {
	m := newFakeMachine(t)
	m.addMIG(0,
		migSpec{uuid: "MIG-aaaa", gi: 1, ci: 0, giProfileIdx: nvml.GPU_INSTANCE_PROFILE_3_SLICE,
			ciProfileIdx: nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE, start: 4, size: 4},
		migSpec{uuid: "MIG-bbbb", gi: 7, ci: 0, giProfileIdx: nvml.GPU_INSTANCE_PROFILE_1_SLICE,
			ciProfileIdx: nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, start: 0, size: 1},
		// Two compute instances sharing one 3-slice GPU instance.
		migSpec{uuid: "MIG-cccc", gi: 2, ci: 1, giProfileIdx: nvml.GPU_INSTANCE_PROFILE_3_SLICE,
			ciProfileIdx: nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE, start: 0, size: 4},
		migSpec{uuid: "MIG-dddd", gi: 2, ci: 0, giProfileIdx: nvml.GPU_INSTANCE_PROFILE_3_SLICE,
			ciProfileIdx: nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, start: 0, size: 4},
	)
	m.addMIG(1, migSpec{uuid: "MIG-eeee", gi: 0, ci: 0, giProfileIdx: nvml.GPU_INSTANCE_PROFILE_7_SLICE,
		ciProfileIdx: nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE, start: 0, size: 8})
	m.addMIG(2, migSpec{uuid: "MIG-ffff", gi: 3, ci: 0, giProfileIdx: nvml.GPU_INSTANCE_PROFILE_2_SLICE,
		ciProfileIdx: nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE, start: 2, size: 2})
	// GPU instances cannot be read without privileges on GPU 2: the
	// profile comes from the MIG device's attributes, without placement.
	m.set(2, func(g *fakeGPU) { g.fail["gi"] = nvml.ERROR_NO_PERMISSION })
	m.set(3, func(g *fakeGPU) { g.migMode = nvml.DEVICE_MIG_ENABLE }) // MIG on, no instance yet
	b, _, _ := open(t, m)
	got, err := b.Discover(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		gpu     int
		enabled bool
		want    []contracts.MIGInstance
	}{
		{0, true, []contracts.MIGInstance{
			{UUID: "MIG-aaaa", Profile: "3g.20gb", GIID: 1, CIID: 0, Start: 4, Size: 4, MemoryMiB: 19968},
			{UUID: "MIG-dddd", Profile: "1c.3g.20gb", GIID: 2, CIID: 0, Start: 0, Size: 4, MemoryMiB: 19968},
			{UUID: "MIG-cccc", Profile: "2c.3g.20gb", GIID: 2, CIID: 1, Start: 0, Size: 4, MemoryMiB: 19968},
			{UUID: "MIG-bbbb", Profile: "1g.5gb", GIID: 7, CIID: 0, Start: 0, Size: 1, MemoryMiB: 4864},
		}},
		{1, true, []contracts.MIGInstance{
			{UUID: "MIG-eeee", Profile: "7g.40gb", GIID: 0, CIID: 0, Start: 0, Size: 8, MemoryMiB: 40192},
		}},
		{2, true, []contracts.MIGInstance{
			{UUID: "MIG-ffff", Profile: "2g.10gb", GIID: 3, CIID: 0, MemoryMiB: 9856},
		}},
		{3, true, nil},
		{4, false, nil},
	}
	for _, tc := range tests {
		g := got.GPUs[tc.gpu]
		if g.MIGEnabled != tc.enabled {
			t.Errorf("GPU %d: MIG enabled %v; want %v", tc.gpu, g.MIGEnabled, tc.enabled)
		}
		if diff := cmp.Diff(tc.want, g.MIGInstances); diff != "" {
			t.Errorf("GPU %d MIG instances (-want +got):\n%s", tc.gpu, diff)
		}
	}
}

func TestMIGProfileNames(t *testing.T) {
	tests := []struct {
		name            string
		ci, gi          uint32
		memMB, totalMiB uint64
		want            string
	}{
		{"A100 40GB 1g", 1, 1, 4864, 40960, "1g.5gb"},
		{"A100 40GB 2g", 2, 2, 9856, 40960, "2g.10gb"},
		{"A100 40GB 3g", 3, 3, 19968, 40960, "3g.20gb"},
		{"A100 40GB 4g", 4, 4, 19968, 40960, "4g.20gb"},
		{"A100 40GB 7g", 7, 7, 40192, 40960, "7g.40gb"},
		{"A100 40GB 1c of 4g", 1, 4, 19968, 40960, "1c.4g.20gb"},
		{"H100 80GB 1g", 1, 1, 9856, 81559, "1g.10gb"},
		{"H100 80GB 3g", 3, 3, 40192, 81559, "3g.40gb"},
		{"H100 80GB 7g", 7, 7, 80384, 81559, "7g.80gb"},
		{"H200 141GB 1g", 1, 1, 16384, 143771, "1g.18gb"},
		{"H200 141GB 3g", 3, 3, 69632, 143771, "3g.71gb"},
		{"unknown total", 1, 1, 10240, 0, "1g.10gb"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := migProfileName(tc.ci, tc.gi, tc.memMB, tc.totalMiB*mib); got != tc.want {
				t.Errorf("migProfileName = %q; want %q", got, tc.want)
			}
		})
	}
}

func TestDiscoverTopology(t *testing.T) {
	// pairs wires GPUs (0,1), (2,3), ... with n direct NVLinks each, the
	// remote end written with a 4-digit domain as some drivers do, and
	// one more link down; no NVSwitch.
	pairs := func(n int) func(m *fakeMachine) {
		return func(m *fakeMachine) {
			for i := range m.gpus {
				m.set(i, func(g *fakeGPU) {
					g.links = nil
					for range n {
						g.links = append(g.links, fmt.Sprintf("0000:%02x:00.0", i^1))
					}
					g.links = append(g.links, "")
				})
			}
		}
	}
	pcieOnly := func(m *fakeMachine) {
		for i := range m.gpus {
			m.set(i, func(g *fakeGPU) { g.links = nil })
		}
	}
	tests := []struct {
		name    string
		setup   func(m *fakeMachine)
		nvlinks func(a, b int) int
		domains []string
	}{
		{"NVSwitch, all to all", func(*fakeMachine) {}, func(a, b int) int { return 12 },
			[]string{"node-1-nvl0", "node-1-nvl0", "node-1-nvl0", "node-1-nvl0", "node-1-nvl0", "node-1-nvl0", "node-1-nvl0", "node-1-nvl0"}},
		{"NVLink bridges in pairs", pairs(4), func(a, b int) int {
			if a/2 == b/2 {
				return 4
			}
			return 0
		}, []string{"node-1-nvl0", "node-1-nvl0", "node-1-nvl1", "node-1-nvl1", "node-1-nvl2", "node-1-nvl2", "node-1-nvl3", "node-1-nvl3"}},
		{"PCIe only", pcieOnly, func(a, b int) int { return 0 }, make([]string, 8)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := newFakeMachine(t)
			tc.setup(m)
			b, _, _ := open(t, m)
			got, err := b.Discover(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			var want []contracts.GPULink
			for a := range 8 {
				for c := a + 1; c < 8; c++ {
					path := contracts.TopoSystem
					switch {
					case a/2 == c/2:
						path = contracts.TopoMultiple
					case a/4 == c/4:
						path = contracts.TopoNode
					}
					want = append(want, contracts.GPULink{A: a, B: c, NVLinks: tc.nvlinks(a, c), Path: path})
				}
			}
			if diff := cmp.Diff(want, got.Topology); diff != "" {
				t.Errorf("topology (-want +got):\n%s", diff)
			}
			var domains []string
			for _, g := range got.GPUs {
				domains = append(domains, g.NVLinkDomain)
			}
			if diff := cmp.Diff(tc.domains, domains); diff != "" {
				t.Errorf("NVLink domains (-want +got):\n%s", diff)
			}
		})
	}
}

func TestDiscoverKeepsGoingWithoutOptionalFields(t *testing.T) {
	m := newFakeMachine(t)
	m.set(0, func(g *fakeGPU) { g.fail["topology"] = nvml.ERROR_NOT_SUPPORTED })
	m.SystemGetCudaDriverVersionFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
	b, _, _ := open(t, m)
	got, err := b.Discover(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if got.CUDAVersion != "" {
		t.Errorf("CUDA version %q; want empty when NVML cannot tell", got.CUDAVersion)
	}
	if got.Topology[0].Path != "" || got.Topology[0].NVLinks != 12 {
		t.Errorf("link 0-1 %+v; want no path, 12 NVLinks", got.Topology[0])
	}
}
