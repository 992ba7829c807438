package runner

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	cdispecs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci"
)

// Container is a run of an image: its shim supervises `runc run` of the
// run's bundle in the foreground instead of a host command, so the run's
// output, exit code, stop with grace, checkpoints and re-adoption by a
// restarted agent are those of a host command. Launch.Spec.Command
// replaces the image's ENTRYPOINT and Args its CMD.
type Container struct {
	Image      oci.Image   `json:"image"`
	Args       []string    `json:"args,omitempty"`
	WorkingDir string      `json:"workingDir,omitempty"`
	User       string      `json:"user,omitempty"`
	Mounts     []oci.Mount `json:"mounts,omitempty"`
	ShmSizeMiB int64       `json:"shmSizeMiB,omitempty"`
	// CPUMilli and MemoryMiB are the container's cgroup limits, the
	// allocation's host share; 0 means none.
	CPUMilli  int64 `json:"cpuMilli,omitempty"`
	MemoryMiB int64 `json:"memoryMiB,omitempty"`
	// HostNetwork runs it in the host's network namespace, where its pool
	// allows it (gangs, for NCCL).
	HostNetwork bool `json:"hostNetwork,omitempty"`
	// GPUs is the CDI description of the machine's GPUs
	// (oci.GenerateCDI): the container gets exactly the edits of
	// Launch.Devices. Nil gives a run with devices no launch.
	GPUs *cdispecs.Spec `json:"-"`
}

// EnvMPSPipeDir tells a CUDA client where its MPS control daemon listens.
const EnvMPSPipeDir = "CUDA_MPS_PIPE_DIRECTORY"

// ErrRuntimeUnavailable wraps the launch error of a container run on a
// machine without runc (reason runtime_unavailable); host commands still
// run there.
var ErrRuntimeUnavailable = oci.ErrUnavailable

// containerRun is what the shim, and an agent that adopts the run, need
// to reach the container: runc's ID and state root, and the bundle.
type containerRun struct {
	ID      string      `json:"id"`
	Runtime oci.Runtime `json:"runtime"`
	Bundle  string      `json:"bundle"`
	// PIDFile is where runc writes the container's pid once it exists.
	PIDFile string `json:"pidFile"`
}

// runcTimeout bounds one runc kill, state or delete.
const runcTimeout = 10 * time.Second

// In the run's state directory.
const (
	bundleDir    = "bundle"
	containerPID = "container.pid"
)

func (r *Local) runcRoot() string {
	if r.RuncRoot != "" {
		return r.RuncRoot
	}
	return filepath.Join(r.LogDir, "runc")
}

// startContainer prepares l's bundle and starts its shim on `runc run`.
func (r *Local) startContainer(ctx context.Context, l Launch, logPath string) (Process, error) {
	rt, err := oci.LookRuntime(r.Runc, r.runcRoot())
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrLaunch, err)
	}
	c := l.Container
	edits, err := oci.EditsFor(c.GPUs, l.Devices)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrLaunch, err)
	}
	id := oci.ContainerID(l.AllocationID)
	return r.startShim(l, logPath, func(dir string) (runSpec, func(), error) {
		if err := r.clearStale(ctx, rt, id); err != nil {
			return runSpec{}, nil, err
		}
		mounts := slices.Clone(c.Mounts)
		env := ContainerEnv(l)
		if l.MPSPipeDir != "" {
			// The share's MPS daemon, at the same path inside.
			mounts = append(mounts, oci.Mount{Source: l.MPSPipeDir, Target: l.MPSPipeDir})
			env = append(env, EnvMPSPipeDir+"="+l.MPSPipeDir)
		}
		if l.MPSShmDir != "" {
			// ...and its /dev/shm, over the container's own.
			mounts = append(mounts, oci.Mount{Source: l.MPSShmDir, Target: "/dev/shm"})
		}
		b, err := oci.CreateBundle(filepath.Join(dir, bundleDir), oci.Config{
			ID: id, Image: c.Image, Command: l.Spec.Command, Args: c.Args, Env: env, WorkingDir: c.WorkingDir,
			User: c.User, Mounts: mounts, ShmSizeMiB: c.ShmSizeMiB, CPUMilli: c.CPUMilli, MemoryMiB: c.MemoryMiB,
			HostNetwork: c.HostNetwork, CgroupParent: r.CgroupParent, GPUs: edits,
			CheckpointDir: l.CheckpointDir, RestoreFrom: l.RestoreFrom,
		})
		if err != nil {
			return runSpec{}, nil, err
		}
		// The job writes its checkpoints as its own user, not the agent's.
		u := b.Spec.Process.User
		if err := os.Chown(l.CheckpointDir, int(u.UID), int(u.GID)); err != nil {
			_ = oci.RemoveBundle(b.Dir)
			return runSpec{}, nil, fmt.Errorf("checkpoint dir: %w", err)
		}
		pidFile := filepath.Join(dir, containerPID)
		spec := runSpec{Launch: l, Argv: rt.RunArgv(b.Dir, id, pidFile), Env: runcEnv(), LogPath: logPath,
			Container: &containerRun{ID: id, Runtime: rt, Bundle: b.Dir, PIDFile: pidFile}}
		return spec, func() { _ = oci.RemoveBundle(b.Dir) }, nil
	})
}

// clearStale makes way for container id: runc refuses an ID it knows, so
// a container left by a crash is deleted, but only once its process is
// gone; one that runs is a run of this allocation the agent's state lost,
// and is never started twice.
func (r *Local) clearStale(ctx context.Context, rt oci.Runtime, id string) error {
	ctx, cancel := context.WithTimeout(ctx, runcTimeout)
	defer cancel()
	st, err := rt.State(ctx, id)
	switch {
	case errors.Is(err, oci.ErrNoContainer):
		return nil
	case err != nil:
		return err
	case st.Running():
		return fmt.Errorf("container %s already runs (pid %d): %w", id, st.Pid, ErrAlreadyLaunched)
	}
	return rt.Delete(ctx, id, true)
}

// runcEnv is runc's own environment: it passes none of it to the
// container.
func runcEnv() []string {
	env := []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	if v, ok := os.LookupEnv("XDG_RUNTIME_DIR"); ok {
		env = append(env, "XDG_RUNTIME_DIR="+v)
	}
	return env
}

// signalContainer sends sig to the container's first process (all: to
// every process of it) through runc; where runc cannot (the container is
// not created yet, or runc fails), to runc run itself, which relays what
// it can to the container and dies of SIGKILL.
func signalContainer(c *containerRun, pid int, pidStart uint64, sig syscall.Signal, all bool) {
	ctx, cancel := context.WithTimeout(context.Background(), runcTimeout)
	defer cancel()
	if err := c.Runtime.Kill(ctx, c.ID, sig, all); err != nil {
		if sig == syscall.SIGKILL {
			killGroup(pid, pidStart, sig)
		} else {
			signalLeader(pid, pidStart, sig)
		}
	}
}

// containerCreated waits until runc has created the container (its pid
// file exists), so that a started run is a container that exists and a
// container runc cannot create is a launch failure, as a host command
// that cannot start is. It returns false when runc ended first (waited
// closed). A runc still creating after createWait (a slow hook) is let
// go on: how it ends tells then.
func containerCreated(c *containerRun, waited <-chan struct{}) bool {
	created := func() bool { _, err := os.Stat(c.PIDFile); return err == nil }
	t := time.NewTicker(2 * time.Millisecond)
	defer t.Stop()
	deadline := time.After(createWait)
	for {
		select {
		case <-waited:
			return created()
		case <-deadline:
			return true
		case <-t.C:
			if created() {
				return true
			}
		}
	}
}

// createWait bounds containerCreated, well within the agent's wait for
// its shim's answer (shimStartTimeout).
const createWait = shimStartTimeout - 2*time.Second

// neverStarted turns the exit of a `runc run` that failed before its
// container existed (no pid file: a bad config, a command the image
// lacks, a mount that cannot be made) into the launch failure it is, with
// runc's message, which it wrote to the run's log; NotFound, as a shell's
// 127, when the command is not in the image.
func neverStarted(c *containerRun, logPath string, e runExit) runExit {
	if e.Code == 0 || e.Stopped || e.TimedOut {
		return e
	}
	if _, err := os.Stat(c.PIDFile); !errors.Is(err, fs.ErrNotExist) {
		return e
	}
	msg := lastLine(logPath)
	e.LaunchError = "the container did not start: " + msg
	e.NotFound = strings.Contains(msg, "executable file not found") || strings.Contains(msg, "no such file or directory")
	e.Code = -1
	return e
}

// lastLine is the last non-empty line of a file, cut to 500 bytes.
func lastLine(path string) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	s := strings.TrimSpace(lines[len(lines)-1])
	if len(s) > 500 {
		s = s[:500] + "..."
	}
	if s == "" {
		return "runc said nothing"
	}
	return s
}

// removeContainer deletes what is left of a container that ended, or
// whose supervisor died: the container (killed first; runc run deletes it
// itself when it sees it end) with its cgroup, and the bundle with its
// overlay mount.
func removeContainer(c *containerRun) error {
	ctx, cancel := context.WithTimeout(context.Background(), runcTimeout)
	defer cancel()
	return errors.Join(c.Runtime.Delete(ctx, c.ID, true), oci.RemoveBundle(c.Bundle))
}
