// Package catalog holds the real figures of every GPU model named in
// contracts.GPUModels: framebuffer as nvidia-smi reports it, board power,
// clocks and interconnect. The simulated backend builds its GPUs from it;
// the NVML backend will map a device's product name back to a model with
// ByProductName.
package catalog

import (
	"fmt"
	"slices"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

// Model is one GPU model's figures.
type Model struct {
	// ID is the contracts.GPUModels identifier ("H100-80GB").
	ID string
	// ProductName is what nvidia-smi --query-gpu=name (nvmlDeviceGetName) prints.
	ProductName  string
	Architecture string
	// MemoryMiB is the framebuffer total as nvidia-smi reports it
	// (memory.total, DCGM_FI_DEV_FB_FREE+USED), not the marketing size.
	MemoryMiB int64
	// TDPWatts is the default board power limit (power.default_limit).
	TDPWatts float64
	// IdleWatts is a typical draw of an idle card in persistence mode.
	IdleWatts float64
	// MaxSMClockMHz is clocks.max.sm; IdleSMClockMHz the idle clock.
	MaxSMClockMHz  float64
	IdleSMClockMHz float64
	// MaxMemClockMHz is clocks.max.memory.
	MaxMemClockMHz float64
	// ComputeCapability is the CUDA compute capability, "major.minor".
	ComputeCapability string
	// SlowdownTempC is where the hardware slows the clocks down (nvidia-smi
	// -q "GPU Slowdown Temp", NVML_TEMPERATURE_THRESHOLD_SLOWDOWN);
	// ShutdownTempC where it shuts down to protect itself.
	SlowdownTempC float64
	ShutdownTempC float64
	// NVLink is true for the SXM form factors, whose boards connect every
	// GPU by NVLink (through NVSwitch, or a direct mesh); PCIe cards are
	// false.
	NVLink bool
	// NVLinks is the number of NVLink links of one GPU: 6 on V100, 12 on
	// A100 and on H100 PCIe through its bridges, 18 on H100/H200 SXM.
	NVLinks int
	// NVLinkBridge is true for PCIe cards that take NVLink bridges, which
	// join two cards with all their links.
	NVLinkBridge bool
	// HostCPUMilliPerGPU and HostMemoryMiBPerGPU are the host resources a
	// typical cloud machine of this model gives each GPU; an agent that is
	// not told its host size reports GPU count times these.
	HostCPUMilliPerGPU  int64
	HostMemoryMiBPerGPU int64
}

const gib = 1024 // MiB per GiB

// models is the catalogue, in contracts.GPUModels order. Sources: NVIDIA
// datasheets (TDP, clocks, NVLink) and nvidia-smi output of the cards
// (memory.total with a current driver, clocks.max.*, the -q temperature
// thresholds). A100 and H100 PCIe thresholds are the ones nvidia-smi and
// the H100 PCIe product brief give (slowdown 89 °C, shutdown 92 °C).
var models = []Model{
	{ID: "V100-16GB", ProductName: "Tesla V100-SXM2-16GB", Architecture: "Volta",
		MemoryMiB: 16384, TDPWatts: 300, IdleWatts: 40, MaxSMClockMHz: 1530, IdleSMClockMHz: 135, MaxMemClockMHz: 877,
		ComputeCapability: "7.0", SlowdownTempC: 87, ShutdownTempC: 90, NVLink: true, NVLinks: 6,
		HostCPUMilliPerGPU: 8000, HostMemoryMiBPerGPU: 61 * gib},
	{ID: "V100-32GB", ProductName: "Tesla V100-SXM2-32GB", Architecture: "Volta",
		MemoryMiB: 32768, TDPWatts: 300, IdleWatts: 42, MaxSMClockMHz: 1530, IdleSMClockMHz: 135, MaxMemClockMHz: 877,
		ComputeCapability: "7.0", SlowdownTempC: 87, ShutdownTempC: 90, NVLink: true, NVLinks: 6,
		HostCPUMilliPerGPU: 12000, HostMemoryMiBPerGPU: 96 * gib},
	{ID: "A100-40GB", ProductName: "NVIDIA A100-SXM4-40GB", Architecture: "Ampere",
		MemoryMiB: 40960, TDPWatts: 400, IdleWatts: 52, MaxSMClockMHz: 1410, IdleSMClockMHz: 210, MaxMemClockMHz: 1215,
		ComputeCapability: "8.0", SlowdownTempC: 89, ShutdownTempC: 92, NVLink: true, NVLinks: 12,
		HostCPUMilliPerGPU: 12000, HostMemoryMiBPerGPU: 144 * gib},
	{ID: "A100-80GB", ProductName: "NVIDIA A100-SXM4-80GB", Architecture: "Ampere",
		MemoryMiB: 81920, TDPWatts: 400, IdleWatts: 60, MaxSMClockMHz: 1410, IdleSMClockMHz: 210, MaxMemClockMHz: 1593,
		ComputeCapability: "8.0", SlowdownTempC: 89, ShutdownTempC: 92, NVLink: true, NVLinks: 12,
		HostCPUMilliPerGPU: 12000, HostMemoryMiBPerGPU: 144 * gib},
	{ID: "H100-80GB", ProductName: "NVIDIA H100 80GB HBM3", Architecture: "Hopper",
		MemoryMiB: 81559, TDPWatts: 700, IdleWatts: 70, MaxSMClockMHz: 1980, IdleSMClockMHz: 345, MaxMemClockMHz: 2619,
		ComputeCapability: "9.0", SlowdownTempC: 89, ShutdownTempC: 92, NVLink: true, NVLinks: 18,
		HostCPUMilliPerGPU: 24000, HostMemoryMiBPerGPU: 256 * gib},
	{ID: "H100-80GB-PCIE", ProductName: "NVIDIA H100 PCIe", Architecture: "Hopper",
		MemoryMiB: 81559, TDPWatts: 350, IdleWatts: 48, MaxSMClockMHz: 1755, IdleSMClockMHz: 345, MaxMemClockMHz: 1593,
		ComputeCapability: "9.0", SlowdownTempC: 89, ShutdownTempC: 92, NVLinks: 12, NVLinkBridge: true,
		HostCPUMilliPerGPU: 16000, HostMemoryMiBPerGPU: 128 * gib},
	{ID: "H200-141GB", ProductName: "NVIDIA H200", Architecture: "Hopper",
		MemoryMiB: 143771, TDPWatts: 700, IdleWatts: 75, MaxSMClockMHz: 1980, IdleSMClockMHz: 345, MaxMemClockMHz: 3201,
		ComputeCapability: "9.0", SlowdownTempC: 89, ShutdownTempC: 92, NVLink: true, NVLinks: 18,
		HostCPUMilliPerGPU: 24000, HostMemoryMiBPerGPU: 256 * gib},
	{ID: "L4", ProductName: "NVIDIA L4", Architecture: "Ada Lovelace",
		MemoryMiB: 23034, TDPWatts: 72, IdleWatts: 16, MaxSMClockMHz: 2040, IdleSMClockMHz: 210, MaxMemClockMHz: 6251,
		ComputeCapability: "8.9", SlowdownTempC: 92, ShutdownTempC: 95,
		HostCPUMilliPerGPU: 12000, HostMemoryMiBPerGPU: 48 * gib},
	{ID: "T4", ProductName: "Tesla T4", Architecture: "Turing",
		MemoryMiB: 15360, TDPWatts: 70, IdleWatts: 10, MaxSMClockMHz: 1590, IdleSMClockMHz: 300, MaxMemClockMHz: 5001,
		ComputeCapability: "7.5", SlowdownTempC: 93, ShutdownTempC: 96,
		HostCPUMilliPerGPU: 12000, HostMemoryMiBPerGPU: 48 * gib},
	{ID: "L40S", ProductName: "NVIDIA L40S", Architecture: "Ada Lovelace",
		MemoryMiB: 46068, TDPWatts: 350, IdleWatts: 35, MaxSMClockMHz: 2520, IdleSMClockMHz: 210, MaxMemClockMHz: 9001,
		ComputeCapability: "8.9", SlowdownTempC: 92, ShutdownTempC: 95,
		HostCPUMilliPerGPU: 12000, HostMemoryMiBPerGPU: 96 * gib},
}

// MIG reports whether the model supports MIG (contracts.MIGProfiles has
// its profiles and placement rules).
func (m Model) MIG() bool { return contracts.MIGCapable(m.ID) }

// Lookup returns the model with identifier id.
func Lookup(id string) (Model, bool) {
	i := slices.IndexFunc(models, func(m Model) bool { return m.ID == id })
	if i < 0 {
		return Model{}, false
	}
	return models[i], true
}

// Get is Lookup with an error that names the catalogued models.
func Get(id string) (Model, error) {
	if m, ok := Lookup(id); ok {
		return m, nil
	}
	return Model{}, fmt.Errorf("unknown GPU model %q; want one of %s", id, strings.Join(IDs(), ", "))
}

// ByProductName maps an NVML product name back to its model.
func ByProductName(name string) (Model, bool) {
	i := slices.IndexFunc(models, func(m Model) bool { return m.ProductName == name })
	if i < 0 {
		return Model{}, false
	}
	return models[i], true
}

// All returns every model, in contracts.GPUModels order.
func All() []Model { return slices.Clone(models) }

// IDs returns every model identifier.
func IDs() []string {
	ids := make([]string, len(models))
	for i, m := range models {
		ids[i] = m.ID
	}
	return ids
}
