package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/mps"
)

// DefaultMPSDir holds the MPS directories of a machine's GPUs: under /run,
// which a reboot empties as it ends the daemons, and short enough for the
// control socket's path.
const DefaultMPSDir = "/run/gpuplane/mps"

// The agent's part in MPS (internal/mps): a share's launch holds its
// GPU's control daemon, which is up before the run starts, and the run's
// end gives it back; a re-adopted share holds it again; the inventory
// carries each GPU's daemon state and is republished when one changes.
//
//	onCommitted ──acquireMPS──▶ daemon up ──▶ Launch (CUDA_MPS_PIPE_DIRECTORY, its /dev/shm)
//	                     └─ not up ──▶ RunEvent{ended, failed, mps_unavailable}
//	watch: run ended ──▶ releaseMPS ──▶ last share of the GPU: daemon quit
//	recoverRuns ──holdMPS (re-adopted shares)──▶ Sweep (daemons no share needs)

// newMPS is the agent's MPS supervisor, nil where the agent runs no MPS:
// a simulated machine without a stand-in control program. A machine read
// through NVML runs nvidia-cuda-mps-control unless told otherwise; where
// that program is missing its shares fail with mps_unavailable rather
// than run unenforced.
func newMPS(cfg Config, log *slog.Logger, onChange func(string, contracts.MPSState)) (*mps.Supervisor, error) {
	control := cfg.MPSControl
	nvml := (cfg.Backend == nil && cfg.BackendKind == BackendNVML) || (cfg.Backend != nil && cfg.Backend.Kind() == BackendNVML)
	if control == "" && nvml {
		control = mps.DefaultControl
	}
	if control == "" {
		return nil, nil
	}
	dir := cfg.MPSDir
	if dir == "" {
		dir = DefaultMPSDir
	}
	s, err := mps.New(mps.Config{Control: control, Root: dir, HostShm: cfg.MPSHostShm, Log: log, OnChange: onChange})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// onMPSChange asks for the inventory to be republished with the GPUs' new
// MPS states. It runs under the supervisor's lock: it only signals.
func (a *agent) onMPSChange(string, contracts.MPSState) {
	select {
	case a.mpsChanged <- struct{}{}:
	default: // one republish pending already covers this change
	}
}

// republishOnMPSChange publishes the inventory each time a GPU's MPS
// state changed, until ctx ends.
func (a *agent) republishOnMPSChange(ctx context.Context) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-a.mpsChanged:
		}
		if err := a.publishInventory(ctx, a.nextInventoryVersion()); err != nil && ctx.Err() == nil {
			a.log.Warn("inventory with new MPS states not published; the next change or interval tries again", "err", err)
		}
	}
}

// withMPS is the GPUs as the inventory reports them: each with its MPS
// daemon's state, where the agent runs MPS.
func (a *agent) withMPS(gpus []contracts.GPUInfo) []contracts.GPUInfo {
	if !a.mps.Enabled() {
		return gpus
	}
	out := slices.Clone(gpus)
	for i := range out {
		out[i].MPS = a.mps.State(out[i].UUID)
	}
	return out
}

// sharedGPUs is the GPUs of devices held as shares, each once.
func sharedGPUs(devices []contracts.DeviceRef) []string {
	var uuids []string
	for _, d := range devices {
		if d.Share != nil && !slices.Contains(uuids, d.UUID) {
			uuids = append(uuids, d.UUID)
		}
	}
	return uuids
}

// errMPS wraps every reason a share cannot launch for want of MPS.
var errMPS = errors.New(string(contracts.ReasonMPSUnavailable))

// acquireMPS brings up the MPS daemon of every GPU the run holds a share
// of, and returns the holds, the pipe directory the run talks to and the
// daemon's /dev/shm, which the run must have as its own (none for a run
// without shares or where the agent runs no MPS). One MPS client reaches
// one daemon, so a run may hold shares of one GPU only (a share request
// asks for one GPU).
func (a *agent) acquireMPS(ctx context.Context, devices []contracts.DeviceRef) (leases []*mps.Lease, pipeDir, shmDir string, err error) {
	uuids := sharedGPUs(devices)
	if len(uuids) == 0 || !a.mps.Enabled() {
		return nil, "", "", nil
	}
	if len(uuids) > 1 {
		return nil, "", "", fmt.Errorf("%w: the run holds shares of %d GPUs; one MPS client reaches one GPU's daemon", errMPS, len(uuids))
	}
	l, err := a.mps.Acquire(ctx, uuids[0])
	if err != nil {
		return nil, "", "", fmt.Errorf("%w: %w", errMPS, err)
	}
	return []*mps.Lease{l}, l.PipeDir, l.ShmDir, nil
}

// holdMPS holds the daemons of a re-adopted run's shared GPUs, adopting
// them or starting them again; it never fails the run, which runs
// already.
func (a *agent) holdMPS(run *activeRun) {
	for _, uuid := range sharedGPUs(run.alloc.Devices) {
		l, err := a.mps.Hold(uuid)
		if err != nil {
			a.log.Error("MPS daemon of a re-adopted share not held", "allocation_id", run.alloc.ID, "gpu_uuid", uuid, "err", err)
			continue
		}
		if l != nil {
			run.mps = append(run.mps, l)
		}
	}
}

// releaseMPS gives back a run's holds, once its process has ended.
func (r *activeRun) releaseMPS() {
	for _, l := range r.mps {
		l.Release()
	}
}
