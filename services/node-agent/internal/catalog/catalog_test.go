package catalog

import (
	"slices"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestCatalogueHasRealFigures(t *testing.T) {
	// Framebuffer as nvidia-smi reports memory.total, default power limit,
	// clocks.max.sm, and whether the form factor has NVLink.
	want := map[string]struct {
		memMiB int64
		tdpW   float64
		smMHz  float64
		nvlink bool
	}{
		"V100-16GB":      {16384, 300, 1530, true},
		"V100-32GB":      {32768, 300, 1530, true},
		"A100-40GB":      {40960, 400, 1410, true},
		"A100-80GB":      {81920, 400, 1410, true},
		"H100-80GB":      {81559, 700, 1980, true},
		"H100-80GB-PCIE": {81559, 350, 1755, false},
		"H200-141GB":     {143771, 700, 1980, true},
		"L4":             {23034, 72, 2040, false},
		"T4":             {15360, 70, 1590, false},
		"L40S":           {46068, 350, 2520, false},
	}
	for id, w := range want {
		m, ok := Lookup(id)
		if !ok {
			t.Errorf("%s: not catalogued", id)
			continue
		}
		if m.MemoryMiB != w.memMiB || m.TDPWatts != w.tdpW || m.MaxSMClockMHz != w.smMHz || m.NVLink != w.nvlink {
			t.Errorf("%s: memory %d MiB, TDP %v W, max SM %v MHz, nvlink %v; want %d, %v, %v, %v",
				id, m.MemoryMiB, m.TDPWatts, m.MaxSMClockMHz, m.NVLink, w.memMiB, w.tdpW, w.smMHz, w.nvlink)
		}
	}
	if len(want) != len(All()) {
		t.Errorf("catalogue has %d models, the test checks %d", len(All()), len(want))
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
		if m.HostCPUMilliPerGPU <= 0 || m.HostMemoryMiBPerGPU <= 0 {
			t.Errorf("%s: no host share per GPU", m.ID)
		}
	}
	if _, err := Get("H100"); err == nil {
		t.Error("Get(H100) found a model; want an error naming the known ones")
	}
}
