// Package runner starts the runs of allocations on the local machine: a
// real command through os/exec in its own process group, or a simulated
// run that only waits. Both keep the run's output in a per-allocation log
// file and end on their own, at a time limit, or when stopped.
package runner

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// Launch is one allocation's run to start.
type Launch struct {
	AllocationID string
	Spec         contracts.RunSpec
	// DeviceUUIDs are the GPUs the run may see, in allocation order.
	DeviceUUIDs []string
	// StopGrace is the SIGTERM-to-SIGKILL grace applied when a command
	// reaches its time limit.
	StopGrace time.Duration
}

// Exit is how a run ended.
type Exit struct {
	// Code is the process exit code, 128+signal when a signal killed it
	// (as shells and container runtimes report it), -1 when unknown.
	Code int
	// Stopped is set when Stop was called before the run ended.
	Stopped bool
	// TimedOut is set when a command was killed at its time limit.
	TimedOut bool
	// Err is a failure to wait for the run, other than a non-zero exit.
	Err error
}

// Process is a started run.
type Process interface {
	// Wait blocks until the run has ended and returns how. It may be
	// called any number of times.
	Wait() Exit
	// Done is closed when the run has ended.
	Done() <-chan struct{}
	// Stop ends the run: SIGTERM to its process group, then SIGKILL once
	// grace has passed (at once when grace <= 0). It returns at once and
	// is idempotent; stopping an ended run does nothing.
	Stop(grace time.Duration)
}

// Local starts runs on this machine.
type Local struct {
	// LogDir holds one log file per allocation (LogPath); it is created
	// when missing.
	LogDir string
}

// ErrLaunch wraps every failure to start a run.
var ErrLaunch = errors.New("launch failed")

// Launch starts l: a command when l.Spec.Command is set, a simulated run
// of l.Spec.Duration otherwise. It returns once the process exists; ctx
// bounds the launch only, never the run.
func (r *Local) Launch(ctx context.Context, l Launch) (Process, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(r.LogDir, 0o755); err != nil {
		return nil, fmt.Errorf("%w: log dir: %w", ErrLaunch, err)
	}
	logFile, err := os.OpenFile(LogPath(r.LogDir, l.AllocationID), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, fmt.Errorf("%w: log file: %w", ErrLaunch, err)
	}
	if len(l.Spec.Command) == 0 {
		return startSim(l, logFile), nil
	}
	p, err := startExec(l, logFile)
	if err != nil {
		_ = logFile.Close()
		return nil, fmt.Errorf("%w: %w", ErrLaunch, err)
	}
	return p, nil
}

// LogPath is where the output of allocationID's run is kept under dir.
// Allocation IDs are tenant/job/attempt; tenants have no '_' and attempts
// are digits, so replacing '/' by '_' keeps names unique.
func LogPath(dir, allocationID string) string {
	return filepath.Join(dir, strings.ReplaceAll(allocationID, "/", "_")+".log")
}

// Env is the environment of a command run: a minimal base (PATH, HOME,
// TMPDIR of the agent, never its secrets), the run's own variables, then
// the ones the agent owns and a run cannot override: the allocation ID and
// the visible devices for CUDA and the NVIDIA container runtime.
func Env(l Launch) []string {
	env := map[string]string{"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	for _, k := range []string{"PATH", "HOME", "TMPDIR"} {
		if v, ok := os.LookupEnv(k); ok {
			env[k] = v
		}
	}
	for k, v := range l.Spec.Env {
		env[k] = v
	}
	devices := strings.Join(l.DeviceUUIDs, ",")
	env["GPUPLANE_ALLOCATION_ID"] = l.AllocationID
	env["CUDA_VISIBLE_DEVICES"] = devices
	env["NVIDIA_VISIBLE_DEVICES"] = devices
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	return out
}
