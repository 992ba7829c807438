package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"

	cdispecs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
)

// The agent's part in container runs (internal/oci, internal/runner):
//
//	onCommitted ──registered, acked──▶ pullAndLaunch (its own goroutine, runs.go)
//	            ──CheckRuntime (the pool's policy, as the allocation carries it)
//	            ──acquireImage (images.go, MaxConcurrentPulls) ──▶ mounts resolved and held to the pool's roots
//	            │     └─ stop or release meanwhile ──▶ pull given up, ended as the stop says, nothing launched
//	            ──▶ runner.Launch{Container: image, limits, host network, the machine's CDI spec}
//	                 └─ runc missing ──▶ ended: runtime_unavailable
//	agent restart mid-pull ──▶ recoverRuns keeps the commit (no run fact, nothing launched) ──▶ resumed once

// errNotAllowed wraps a launch the allocation's pool policy does not
// allow; its reason is the field error's.
type errNotAllowed struct{ fe *contracts.FieldError }

func (e *errNotAllowed) Error() string { return e.fe.Field + ": " + e.fe.Message }

// checkRuntime refuses a run its pool's policy does not allow: the
// scheduler checked it, the agent checks again what it is about to run
// as root. An allocation without a policy (published before pools had
// one) runs host commands as before, and no mounts.
func checkRuntime(alloc contracts.Allocation) error {
	if fe := contracts.CheckRuntime(alloc.Runtime, true, alloc.Run); fe != nil {
		return &errNotAllowed{fe: fe}
	}
	return nil
}

// containerMounts resolves each mount's source (symbolic links
// followed) and holds the result to the pool's roots again, so that a
// link under a root cannot lead out of it.
func containerMounts(alloc contracts.Allocation) ([]oci.Mount, error) {
	var out []oci.Mount
	for i, m := range alloc.Run.Mounts {
		src, err := filepath.EvalSymlinks(m.Source)
		if err != nil {
			return nil, fmt.Errorf("run.mounts[%d].source %q: %w", i, m.Source, err)
		}
		if !alloc.Runtime.MountAllowed(src) {
			return nil, &errNotAllowed{fe: &contracts.FieldError{Field: fmt.Sprintf("run.mounts[%d].source", i),
				Reason: contracts.ReasonMountNotAllowed, Message: fmt.Sprintf("source %q leads to %q, outside the pool's mount roots", m.Source, src)}}
		}
		out = append(out, oci.Mount{Source: src, Target: m.Target, ReadOnly: m.ReadOnly})
	}
	return out, nil
}

// container is alloc's run as a container of img.
func (a *agent) container(alloc contracts.Allocation, img oci.Image, mounts []oci.Mount) *runner.Container {
	return &runner.Container{
		Image: img, Args: alloc.Run.Args, WorkingDir: alloc.Run.WorkingDir, User: alloc.Run.User, Mounts: mounts,
		ShmSizeMiB: alloc.Run.ShmSizeMiB, CPUMilli: alloc.CPUMilli, MemoryMiB: alloc.MemoryMiB,
		HostNetwork: alloc.Runtime != nil && alloc.Runtime.HostNetwork,
		GPUs:        a.gpuCDI(),
	}
}

// gpuCDI is the CDI description of the machine's GPUs, made once from
// what discovery found: device nodes and driver files on a real machine,
// none on a simulated one (its containers take the same path).
func (a *agent) gpuCDI() *cdispecs.Spec {
	a.cdiOnce.Do(func() {
		sim := a.backend == nil || a.backend.Kind() != BackendNVML
		spec, err := oci.GenerateCDI(a.machine, oci.DiscoverHost(a.machine, sim))
		if err != nil {
			// The devices it could describe still run; the others fail
			// their launch rather than run without their GPU.
			a.log.Error("some GPUs have no CDI description; container runs on them will fail", "err", err)
		}
		a.cdi = spec
	})
	return a.cdi
}

// launchReason is the reason of a run that failed to launch.
func launchReason(err error) contracts.Reason {
	var na *errNotAllowed
	switch {
	case errors.As(err, &na):
		return na.fe.Reason
	case errors.Is(err, runner.ErrRuntimeUnavailable):
		return contracts.ReasonRuntimeUnavailable
	}
	return contracts.ReasonLaunchFailed
}

// prepareContainer holds alloc's image (pulling it, with pulling facts)
// and makes its container; release gives the image back. A run without
// an image needs nothing: nil, a no-op release.
func (a *agent) prepareContainer(ctx context.Context, alloc contracts.Allocation) (*runner.Container, func(), contracts.Reason, error) {
	if !alloc.Run.IsContainer() {
		return nil, func() {}, "", nil
	}
	mounts, err := containerMounts(alloc)
	if err != nil {
		return nil, nil, launchReason(err), err
	}
	img, release, err := a.acquireImage(ctx, alloc)
	if err != nil {
		return nil, nil, imageReason(err), err
	}
	return a.container(alloc, img, mounts), release, "", nil
}
