package runner

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

// The variables a run gets from the agent; a run's own Env cannot set them.
const (
	EnvAllocationID  = "GPUPLANE_ALLOCATION_ID"
	EnvTenant        = "GPUPLANE_TENANT"
	EnvJobID         = "GPUPLANE_JOB_ID"
	EnvAttempt       = "GPUPLANE_ATTEMPT"
	EnvCheckpointDir = "GPUPLANE_CHECKPOINT_DIR"
	EnvRestoreFrom   = "GPUPLANE_RESTORE_FROM"
	// EnvGangRank, EnvGangSize and EnvGangNodes tell each part of a job
	// spanning several machines which part it is and where the others run,
	// so its processes can find each other (torchrun's node rank, world
	// size and rendezvous host). Set only for gang parts.
	EnvGangRank  = "GPUPLANE_GANG_RANK"
	EnvGangSize  = "GPUPLANE_GANG_SIZE"
	EnvGangNodes = "GPUPLANE_GANG_NODES"

	EnvCUDAVisible   = "CUDA_VISIBLE_DEVICES"
	EnvNVIDIAVisible = "NVIDIA_VISIBLE_DEVICES"
	// EnvMPSThreads and EnvMPSMemLimit confine a client of NVIDIA's MPS
	// server to its share of a GPU.
	EnvMPSThreads  = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
	EnvMPSMemLimit = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
)

// Env is the environment of a command run, sorted: a minimal base (PATH,
// HOME, TMPDIR of the agent, never its secrets), the run's own variables,
// then the ones the agent owns, which a run cannot override:
//
//   - CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES: each device's
//     VisibleUUID (a MIG instance's own UUID), in allocation order;
//   - for shares of a GPU (MPS): CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, the
//     smallest compute share (MPS applies one percentage per client), and
//     CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, "i=<MiB>M" per shared device where i
//     is its position in CUDA_VISIBLE_DEVICES (the CUDA device ordinal the
//     run sees);
//   - GPUPLANE_ALLOCATION_ID, _TENANT, _JOB_ID, _ATTEMPT, _CHECKPOINT_DIR
//     and, when a checkpoint exists, _RESTORE_FROM;
//   - for a part of a job spanning several machines: GPUPLANE_GANG_RANK
//     (0-based), GPUPLANE_GANG_SIZE and GPUPLANE_GANG_NODES (every part's
//     node ID, comma-separated, by rank; rank 0's is where the job's
//     processes meet).
func Env(l Launch) []string {
	env := map[string]string{"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	for _, k := range []string{"PATH", "HOME", "TMPDIR"} {
		if v, ok := os.LookupEnv(k); ok {
			env[k] = v
		}
	}
	return runEnv(env, l, true)
}

// ContainerEnv is Env for a container: the run's own variables and the
// agent's, without the host's PATH, HOME and TMPDIR (the image's hold) or
// the checkpoint paths, which oci sets to where the container sees them.
func ContainerEnv(l Launch) []string {
	return runEnv(map[string]string{}, l, false)
}

func runEnv(env map[string]string, l Launch, hostPaths bool) []string {
	for k, v := range l.Spec.Env {
		env[k] = v
	}
	for _, k := range []string{EnvMPSThreads, EnvMPSMemLimit, EnvMPSPipeDir, EnvRestoreFrom, EnvCheckpointDir, EnvGangRank, EnvGangSize, EnvGangNodes} {
		delete(env, k) // set below only when the agent means them
	}
	visible := make([]string, len(l.Devices))
	var limits []string
	threads := 0
	for i, d := range l.Devices {
		visible[i] = d.VisibleUUID()
		if s := d.Share; s != nil {
			limits = append(limits, strconv.Itoa(i)+"="+strconv.FormatInt(s.MemoryMiB, 10)+"M")
			if threads == 0 || s.ComputePercent < threads {
				threads = s.ComputePercent
			}
		}
	}
	devices := strings.Join(visible, ",")
	env[EnvCUDAVisible] = devices
	env[EnvNVIDIAVisible] = devices
	if len(limits) > 0 {
		env[EnvMPSThreads] = strconv.Itoa(threads)
		env[EnvMPSMemLimit] = strings.Join(limits, ",")
	}
	env[EnvAllocationID] = l.AllocationID
	env[EnvTenant] = l.Tenant
	env[EnvJobID] = l.JobID
	env[EnvAttempt] = strconv.Itoa(l.Attempt)
	if l.MPSPipeDir != "" && hostPaths {
		env[EnvMPSPipeDir] = l.MPSPipeDir // where the share's MPS daemon listens
	}
	if l.CheckpointDir != "" && hostPaths {
		env[EnvCheckpointDir] = l.CheckpointDir
	}
	if l.RestoreFrom != "" && hostPaths {
		env[EnvRestoreFrom] = l.RestoreFrom
	}
	if g := l.Gang; g != nil {
		env[EnvGangRank] = strconv.Itoa(g.Rank)
		env[EnvGangSize] = strconv.Itoa(g.Size)
		env[EnvGangNodes] = strings.Join(g.Nodes, ",")
	}
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	slices.Sort(out)
	return out
}

// ValidateDevice reports why d cannot confine a run, nil when it can: a
// MIG instance without its own UUID would make the run see the whole GPU,
// and MPS cannot enforce a share outside 1..100 % or without memory.
func ValidateDevice(d contracts.DeviceRef) error {
	if d.UUID == "" {
		return fmt.Errorf("device %d has no UUID", d.Index)
	}
	if d.MIG != nil && d.MIG.UUID == "" {
		return fmt.Errorf("MIG instance %s of device %d (%s) has no UUID", d.MIG.Profile, d.Index, d.UUID)
	}
	if s := d.Share; s != nil && (s.ComputePercent < 1 || s.ComputePercent > 100 || s.MemoryMiB <= 0) {
		return fmt.Errorf("share of device %d (%s) is %d%% compute and %d MiB; want 1..100%% and > 0 MiB",
			d.Index, d.UUID, s.ComputePercent, s.MemoryMiB)
	}
	return nil
}
