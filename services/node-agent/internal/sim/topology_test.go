package sim

import (
	"context"
	"regexp"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// links turns a topology into a matrix, checking that every pair appears
// once with A < B.
func links(t *testing.T, count int, topo []contracts.GPULink) [][]contracts.GPULink {
	t.Helper()
	m := make([][]contracts.GPULink, count)
	for i := range m {
		m[i] = make([]contracts.GPULink, count)
	}
	seen := map[[2]int]bool{}
	for _, l := range topo {
		if l.A >= l.B || l.A < 0 || l.B >= count || seen[[2]int{l.A, l.B}] {
			t.Fatalf("link %+v: not A < B within %d GPUs, or repeated", l, count)
		}
		seen[[2]int{l.A, l.B}] = true
		m[l.A][l.B], m[l.B][l.A] = l, l
	}
	if want := count * (count - 1) / 2; len(seen) != want {
		t.Fatalf("%d pairs, want %d", len(seen), want)
	}
	return m
}

func TestTopologyPerMachineType(t *testing.T) {
	// Pairs that share a PCIe switch, one socket, or neither, on an 8-GPU
	// machine with two sockets.
	wantPath := func(a, b int) contracts.TopoPath {
		switch {
		case a/2 == b/2:
			return contracts.TopoSingle
		case a/4 == b/4:
			return contracts.TopoNode
		}
		return contracts.TopoSystem
	}
	for name, c := range map[string]struct {
		model         string
		count         int
		nvlink, bridg bool
		pair          func(a, b int) int // NVLinks between a and b
	}{
		"8×H100 SXM: NVSwitch, NV18 everywhere": {"H100-80GB", 8, true, false, func(a, b int) int { return 18 }},
		"8×H200: NVSwitch, NV18":                {"H200-141GB", 8, true, false, func(a, b int) int { return 18 }},
		"8×A100 SXM: NVSwitch, NV12":            {"A100-80GB", 8, true, false, func(a, b int) int { return 12 }},
		"4×H100 SXM: direct mesh, 6 per pair":   {"H100-80GB", 4, true, false, func(a, b int) int { return 6 }},
		"4×A100 SXM: direct mesh, 4 per pair":   {"A100-40GB", 4, true, false, func(a, b int) int { return 4 }},
		"8×V100: hybrid cube-mesh":              {"V100-32GB", 8, true, false, func(a, b int) int { return dgx1Links[a][b] }},
		"8×L4 PCIe: no NVLink":                  {"L4", 8, false, false, func(a, b int) int { return 0 }},
		"8×H100 PCIe, no bridges":               {"H100-80GB-PCIE", 8, false, false, func(a, b int) int { return 0 }},
		"8×H100 PCIe bridged in pairs": {"H100-80GB-PCIE", 8, false, true, func(a, b int) int {
			if a/2 == b/2 {
				return 12
			}
			return 0
		}},
	} {
		b, err := New(Config{NodeID: "n1", Model: model(t, c.model), Count: c.count, NVLink: c.nvlink, NVLinkBridges: c.bridg})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		m, _ := b.Discover(context.Background())
		mat := links(t, c.count, m.Topology)
		for a := range c.count {
			for b := a + 1; b < c.count; b++ {
				l := mat[a][b]
				if l.NVLinks != c.pair(a, b) {
					t.Errorf("%s: GPUs %d-%d have %d NVLinks, want %d", name, a, b, l.NVLinks, c.pair(a, b))
				}
				if c.count == 8 && l.Path != wantPath(a, b) {
					t.Errorf("%s: GPUs %d-%d path %s, want %s", name, a, b, l.Path, wantPath(a, b))
				}
			}
		}
	}
}

// TestDGX1CubeMesh: every V100 spends its 6 links on 4 peers (two of
// them doubled) and has no NVLink to the other 3, as on a DGX-1V.
func TestDGX1CubeMesh(t *testing.T) {
	topo := Topology(model(t, "V100-16GB"), 8, true, false)
	mat := links(t, 8, topo)
	for a := range 8 {
		total, peers, doubled := 0, 0, 0
		for b := range 8 {
			if a == b {
				continue
			}
			n := mat[a][b].NVLinks
			total += n
			if n > 0 {
				peers++
			}
			if n == 2 {
				doubled++
			}
		}
		if total != 6 || peers != 4 || doubled != 2 {
			t.Errorf("GPU %d: %d links to %d peers (%d doubled); want 6 to 4 (2 doubled)", a, total, peers, doubled)
		}
	}
}

func TestNVLinkDomains(t *testing.T) {
	for name, c := range map[string]struct {
		cfg  Config
		want []string
	}{
		"SXM board":          {Config{Model: model(t, "A100-80GB"), Count: 4, NVLink: true}, []string{"n1", "n1", "n1", "n1"}},
		"bridged pairs":      {Config{Model: model(t, "H100-80GB-PCIE"), Count: 4, NVLinkBridges: true}, []string{"n1-nvl0", "n1-nvl0", "n1-nvl1", "n1-nvl1"}},
		"a lone last card":   {Config{Model: model(t, "H100-80GB-PCIE"), Count: 3, NVLinkBridges: true}, []string{"n1-nvl0", "n1-nvl0", ""}},
		"PCIe without links": {Config{Model: model(t, "L40S"), Count: 2}, []string{"", ""}},
	} {
		c.cfg.NodeID = "n1"
		b, err := New(c.cfg)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		m, _ := b.Discover(context.Background())
		for i, g := range m.GPUs {
			if g.NVLinkDomain != c.want[i] {
				t.Errorf("%s: GPU %d in domain %q, want %q", name, i, g.NVLinkDomain, c.want[i])
			}
		}
	}
	if topo := Topology(model(t, "H100-80GB"), 1, true, false); topo != nil {
		t.Errorf("one GPU has links %v", topo)
	}
}

var migUUIDRE = regexp.MustCompile(`^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

func TestMIGDevices(t *testing.T) {
	cfg := Config{NodeID: "a100-mig-01", Model: model(t, "A100-80GB"), Count: 8, NVLink: true,
		MIG: MIG{Enabled: true, Layout: []string{"3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"}}}
	b, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m, _ := b.Discover(context.Background())
	again, _ := New(cfg)
	m2, _ := again.Discover(context.Background())
	// The 3g cannot stay at 0 (the 1g's would need slice 7): it moves to
	// 4 and the others fill 0-3, as nvidia-smi mig -cgi would place them.
	want := []contracts.MIGInstance{
		{Profile: "3g.40gb", Start: 4, Size: 4, MemoryMiB: 40192, GIID: 2},
		{Profile: "2g.20gb", Start: 0, Size: 2, MemoryMiB: 19968, GIID: 3},
		{Profile: "1g.10gb", Start: 2, Size: 1, MemoryMiB: 9728, GIID: 9},
		{Profile: "1g.10gb", Start: 3, Size: 1, MemoryMiB: 9728, GIID: 10},
	}
	seen := map[string]bool{}
	for i, g := range m.GPUs {
		if !g.MIGEnabled || len(g.MIGInstances) != len(want) {
			t.Fatalf("GPU %d: MIG %v with %d instances, want %d", i, g.MIGEnabled, len(g.MIGInstances), len(want))
		}
		for k, inst := range g.MIGInstances {
			if !migUUIDRE.MatchString(inst.UUID) || seen[inst.UUID] {
				t.Errorf("GPU %d instance %d: UUID %q malformed or repeated", i, k, inst.UUID)
			}
			seen[inst.UUID] = true
			if inst.UUID != m2.GPUs[i].MIGInstances[k].UUID || inst.UUID != MIGUUID(cfg.NodeID, i, inst.GIID) {
				t.Errorf("GPU %d instance %d: UUID %s is not stable", i, k, inst.UUID)
			}
			w := want[k]
			w.UUID = inst.UUID
			if inst != w {
				t.Errorf("GPU %d instance %d = %+v, want %+v", i, k, inst, w)
			}
		}
	}
	other, _ := New(Config{NodeID: "a100-mig-02", Model: cfg.Model, Count: 1, MIG: cfg.MIG})
	if m3, _ := other.Discover(context.Background()); seen[m3.GPUs[0].MIGInstances[0].UUID] {
		t.Error("two nodes share a MIG UUID")
	}
}
