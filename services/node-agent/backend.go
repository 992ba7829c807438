package nodeagent

import (
	"context"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/nvmlgpu"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/sim"
)

// Backend is what the agent needs from a machine's GPUs: the simulated
// backend and the NVML one implement it, and nothing above it knows which
// one runs.
type Backend interface {
	// Kind names the backend in the inventory: "sim" or "nvml".
	Kind() string
	// Discover lists the machine's GPUs, driver and topology. The agent
	// publishes them as its inventory; GPU UUIDs are what allocations name.
	Discover(ctx context.Context) (device.Machine, error)
	// Sample reads every GPU at now, one sample per discovered GPU in
	// index order. busy maps the UUID of each GPU held by a running
	// allocation to the allocation ID: a simulation makes those GPUs work,
	// a hardware backend reads real figures and may ignore it. The agent
	// sets GPUSample.AllocationID itself.
	Sample(ctx context.Context, now time.Time, busy map[string]string) ([]contracts.GPUSample, error)
}

// HealthWatcher is implemented by backends that detect GPU faults (XID
// events, double-bit ECC errors, a GPU that fell off the bus, overheating).
// WatchHealth calls report for each fact as it happens, from one goroutine,
// until ctx ends; it returns nil then.
type HealthWatcher interface {
	WatchHealth(ctx context.Context, report func(device.Health)) error
}

// FaultInjector is implemented by the simulated backend: it applies a
// per-GPU fault (xid, ecc_dbe, overheat, clear) so that samples and health
// facts show it. Machine death and agent pause are the agent's own.
type FaultInjector interface {
	InjectFault(f contracts.Fault) error
}

// Runner launches the run of an allocation. Launch returns once the run
// has started (its process exists) or failed to start; ctx bounds the
// launch only. The process ends on its own, at its time limit, or when
// stopped.
type Runner interface {
	Launch(ctx context.Context, l runner.Launch) (runner.Process, error)
}

var (
	_ Backend       = (*sim.Backend)(nil)
	_ HealthWatcher = (*sim.Backend)(nil)
	_ FaultInjector = (*sim.Backend)(nil)
	_ Backend       = (*nvmlgpu.Backend)(nil)
	_ HealthWatcher = (*nvmlgpu.Backend)(nil)
	_ Runner        = (*runner.Local)(nil)
)
