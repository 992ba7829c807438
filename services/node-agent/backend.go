package nodeagent

import (
	"context"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/sim"
)

// Backend is what the agent needs from a machine's GPUs. The simulated
// backend implements it now; an NVML backend (with MIG) will later.
type Backend interface {
	// Kind names the backend in the inventory: "sim" or "nvml".
	Kind() string
	// Discover lists the machine's GPUs. The agent publishes them as its
	// inventory; their UUIDs are what allocations name.
	Discover(ctx context.Context) ([]contracts.GPUInfo, error)
	// Sample reads every GPU at now, one sample per discovered GPU in
	// index order. busy maps the UUID of each GPU held by a running
	// allocation to the allocation ID: a simulation makes those GPUs work,
	// a hardware backend reads real figures and may ignore it. The agent
	// sets GPUSample.AllocationID itself.
	Sample(ctx context.Context, now time.Time, busy map[string]string) ([]contracts.GPUSample, error)
}

// Runner launches the run of an allocation. Launch returns once the run
// has started (its process exists) or failed to start; ctx bounds the
// launch only. The process ends on its own, at its time limit, or when
// stopped.
type Runner interface {
	Launch(ctx context.Context, l runner.Launch) (runner.Process, error)
}

var (
	_ Backend = (*sim.Backend)(nil)
	_ Runner  = (*runner.Local)(nil)
)
