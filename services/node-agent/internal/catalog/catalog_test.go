package catalog

import (
	"slices"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestCatalogueHasRealFigures(t *testing.T) {
	// Framebuffer as nvidia-smi reports memory.total, default power limit,
	// clocks.max.sm and clocks.max.memory, compute capability, slowdown and
	// shutdown temperatures, NVLink links per GPU, and the form factor.
	type figures struct {
		memMiB           int64
		tdpW, smMHz      float64
		memMHz           float64
		cc               string
		slowdown, shutdn float64
		links            int
		sxm, bridge, mig bool
	}
	want := map[string]figures{
		"V100-16GB":      {16384, 300, 1530, 877, "7.0", 87, 90, 6, true, false, false},
		"V100-32GB":      {32768, 300, 1530, 877, "7.0", 87, 90, 6, true, false, false},
		"A100-40GB":      {40960, 400, 1410, 1215, "8.0", 89, 92, 12, true, false, true},
		"A100-80GB":      {81920, 400, 1410, 1593, "8.0", 89, 92, 12, true, false, true},
		"H100-80GB":      {81559, 700, 1980, 2619, "9.0", 89, 92, 18, true, false, true},
		"H100-80GB-PCIE": {81559, 350, 1755, 1593, "9.0", 89, 92, 12, false, true, true},
		"H200-141GB":     {143771, 700, 1980, 3201, "9.0", 89, 92, 18, true, false, true},
		"L4":             {23034, 72, 2040, 6251, "8.9", 92, 95, 0, false, false, false},
		"T4":             {15360, 70, 1590, 5001, "7.5", 93, 96, 0, false, false, false},
		"L40S":           {46068, 350, 2520, 9001, "8.9", 92, 95, 0, false, false, false},
	}
	for id, w := range want {
		m, ok := Lookup(id)
		if !ok {
			t.Errorf("%s: not catalogued", id)
			continue
		}
		got := figures{m.MemoryMiB, m.TDPWatts, m.MaxSMClockMHz, m.MaxMemClockMHz, m.ComputeCapability,
			m.SlowdownTempC, m.ShutdownTempC, m.NVLinks, m.NVLink, m.NVLinkBridge, m.MIG()}
		if got != w {
			t.Errorf("%s: %+v\nwant %+v", id, got, w)
		}
	}
	if len(want) != len(All()) {
		t.Errorf("catalogue has %d models, the test checks %d", len(All()), len(want))
	}
}

// TestMIGProfilesFitTheirModel: the largest MIG instance of a model is a
// little less than its framebuffer (MIG reserves some), never more.
func TestMIGProfilesFitTheirModel(t *testing.T) {
	for _, m := range All() {
		ps := contracts.MIGProfiles(m.ID)
		if len(ps) == 0 {
			continue
		}
		full := ps[len(ps)-1]
		if full.ComputeSlices != 7 || full.MemoryMiB > m.MemoryMiB || full.MemoryMiB < m.MemoryMiB*9/10 {
			t.Errorf("%s: %s has %d MiB of the card's %d", m.ID, full.Name, full.MemoryMiB, m.MemoryMiB)
		}
	}
}

func TestCatalogueCoversExactlyTheContractVocabulary(t *testing.T) {
	if got := IDs(); !slices.Equal(got, contracts.GPUModels) {
		t.Fatalf("catalogue IDs %v, want contracts.GPUModels %v", got, contracts.GPUModels)
	}
}

func TestModelsAreSelfConsistent(t *testing.T) {
	names := map[string]bool{}
	for _, m := range All() {
		if m.ProductName == "" || names[m.ProductName] {
			t.Errorf("%s: product name %q empty or shared", m.ID, m.ProductName)
		}
		names[m.ProductName] = true
		if back, ok := ByProductName(m.ProductName); !ok || back.ID != m.ID {
			t.Errorf("%s: ByProductName(%q) = %q, %v", m.ID, m.ProductName, back.ID, ok)
		}
		if !(m.IdleWatts > 0 && m.IdleWatts < m.TDPWatts/2) {
			t.Errorf("%s: idle power %v W is not a small share of TDP %v W", m.ID, m.IdleWatts, m.TDPWatts)
		}
		if !(m.IdleSMClockMHz > 0 && m.IdleSMClockMHz < m.MaxSMClockMHz) {
			t.Errorf("%s: idle clock %v MHz not below max %v MHz", m.ID, m.IdleSMClockMHz, m.MaxSMClockMHz)
		}
		if !(m.SlowdownTempC > 80 && m.SlowdownTempC < m.ShutdownTempC) {
			t.Errorf("%s: slowdown %v °C, shutdown %v °C", m.ID, m.SlowdownTempC, m.ShutdownTempC)
		}
		if m.NVLink != (m.NVLinks > 0 && !m.NVLinkBridge) || (m.NVLinkBridge && m.NVLinks == 0) {
			t.Errorf("%s: NVLink %v, bridge %v, %d links", m.ID, m.NVLink, m.NVLinkBridge, m.NVLinks)
		}
		if m.HostCPUMilliPerGPU <= 0 || m.HostMemoryMiBPerGPU <= 0 {
			t.Errorf("%s: no host share per GPU", m.ID)
		}
	}
	if _, err := Get("H100"); err == nil {
		t.Error("Get(H100) found a model; want an error naming the known ones")
	}
}
