package runner

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci/ocitest"
)

// containerLocal is a runner of containers on a simulated machine of two
// GPUs (the same path as a real machine's, with no device nodes).
func containerLocal(t testing.TB) (*Local, oci.Runtime, Container) {
	t.Helper()
	rt := ocitest.Runtime(t)
	m := device.Machine{GPUs: []contracts.GPUInfo{{Index: 0, UUID: "GPU-a"}, {Index: 1, UUID: "GPU-b"}}}
	cdi, err := oci.GenerateCDI(m, oci.Host{Simulated: true})
	if err != nil {
		t.Fatal(err)
	}
	r := &Local{LogDir: t.TempDir(), Runc: rt.Path, RuncRoot: rt.Root}
	return r, rt, Container{Image: ocitest.Image(t), GPUs: cdi, MemoryMiB: 128}
}

func containerLaunch(c Container, script string) Launch {
	l := newLaunch(contracts.RunSpec{Command: []string{"/bin/sh", "-c", script}}, gpus("GPU-b"))
	l.Container = &c
	return l
}

// waitLogHas waits until the run's log holds want.
func waitLogHas(t *testing.T, path, want string) {
	t.Helper()
	eventually(t, "log holding "+want, func() bool {
		out, _ := os.ReadFile(path)
		return strings.Contains(string(out), want)
	})
}

// assertCleanedUp checks that nothing of the container is left: runc
// forgot it, its bundle (and overlay mount) is gone.
func assertCleanedUp(t *testing.T, r *Local, rt oci.Runtime) {
	t.Helper()
	if _, err := rt.State(context.Background(), oci.ContainerID(allocID)); !errors.Is(err, oci.ErrNoContainer) {
		t.Errorf("runc still knows the container: %v", err)
	}
	if _, err := os.Stat(filepath.Join(r.runDir(allocID), bundleDir)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("bundle left behind: %v", err)
	}
	mounts, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(mounts), r.runDir(allocID)) {
		t.Error("the container's root is still mounted")
	}
}

func TestContainerRunsItsImage(t *testing.T) {
	r, rt, c := containerLocal(t)
	l := containerLaunch(c, `
echo out; echo err >&2
echo "mps=$CUDA_MPS_PIPE_DIRECTORY"
test -e $CUDA_MPS_PIPE_DIRECTORY/control && echo pipe=seen
echo "uid=$(id -u)"
echo "pid=$$"
echo "gpus=$CUDA_VISIBLE_DEVICES"
echo "ckpt=$GPUPLANE_CHECKPOINT_DIR"
touch $GPUPLANE_CHECKPOINT_DIR/mine && echo ckpt=writable
echo "path=$PATH"
exit 7`)
	// The share's MPS daemon listens in its pipe directory, which the
	// container sees where the host has it.
	l.MPSPipeDir = t.TempDir()
	if err := os.WriteFile(filepath.Join(l.MPSPipeDir, "control"), nil, 0o666); err != nil {
		t.Fatal(err)
	}
	p := start(t, r, l)
	exit := waitExit(t, p, limit)
	if exit.Code != 7 || exit.Err != nil || exit.Stopped {
		t.Fatalf("exit %+v, want the container's code 7", exit)
	}
	out, _ := os.ReadFile(p.Info().LogPath)
	for _, want := range []string{"out\n", "err\n", "uid=65534\n", "pid=1\n", "gpus=GPU-b\n", "ckpt=/gpuplane/checkpoint\n", "ckpt=writable\n", "path=/bin\n",
		"mps=" + l.MPSPipeDir + "\n", "pipe=seen\n"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("log lacks %q:\n%s", want, out)
		}
	}
	// The job's checkpoint directory on the host is what it wrote in.
	if _, err := os.Stat(filepath.Join(p.Info().CheckpointDir, "mine")); err != nil {
		t.Errorf("the container's checkpoint directory is not the job's: %v", err)
	}
	assertCleanedUp(t, r, rt)
}

func TestContainerStopsWithGrace(t *testing.T) {
	tests := map[string]struct {
		script string
		grace  time.Duration
		code   int
		log    string
	}{
		// SIGTERM reaches the job, which ends on its own within the grace.
		"handled": {script: `trap 'echo got-term; exit 0' TERM; echo ready; sleep 600 & wait`, grace: 10 * time.Second, code: 0, log: "got-term"},
		// A first process that ignores SIGTERM (as a PID namespace's init
		// does unless it handles it) is killed once the grace has passed.
		"ignored": {script: `echo ready; exec sleep 600`, grace: 200 * time.Millisecond, code: 128 + 9},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			r, rt, c := containerLocal(t)
			p := start(t, r, containerLaunch(c, tt.script))
			waitLogHas(t, p.Info().LogPath, "ready\n")
			p.Stop(tt.grace)
			exit := waitExit(t, p, limit)
			if !exit.Stopped || exit.Code != tt.code {
				t.Fatalf("exit %+v, want stopped with code %d", exit, tt.code)
			}
			if tt.log != "" {
				waitLogHas(t, p.Info().LogPath, tt.log)
			}
			assertCleanedUp(t, r, rt)
		})
	}
}

func TestContainerCheckpointSignalReachesTheJob(t *testing.T) {
	r, _, c := containerLocal(t)
	p := start(t, r, containerLaunch(c, `
trap 'mkdir -p $GPUPLANE_CHECKPOINT_DIR/ckpt-1 && echo ckpt-1 > $GPUPLANE_CHECKPOINT_DIR/LATEST' USR1
echo ready
while true; do sleep 600 & wait; done`))
	waitLogHas(t, p.Info().LogPath, "ready\n")
	if err := p.Checkpoint(); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the job's checkpoint", func() bool {
		name, ok := LatestCheckpoint(p.Info().CheckpointDir)
		return ok && name == "ckpt-1"
	})
	p.Stop(0)
	if exit := waitExit(t, p, limit); !exit.Stopped {
		t.Fatalf("exit %+v", exit)
	}
}

func TestContainerIsAdoptedByANewAgent(t *testing.T) {
	r, rt, c := containerLocal(t)
	p := start(t, r, containerLaunch(c, `trap 'echo bye; exit 5' TERM; echo ready; sleep 600 & wait`))
	waitLogHas(t, p.Info().LogPath, "ready\n")

	second := &Local{LogDir: r.LogDir, Runc: r.Runc, RuncRoot: r.RuncRoot}
	left, err := second.Recover()
	if err != nil || len(left) != 1 {
		t.Fatalf("recover: %v, %d runs", err, len(left))
	}
	if lc := left[0].Launch.Container; lc == nil || lc.Image.RootFS != c.Image.RootFS {
		t.Fatalf("the adopted run's launch lost its container: %+v", lc)
	}
	if st, err := rt.State(context.Background(), oci.ContainerID(allocID)); err != nil || !st.Running() {
		t.Fatalf("container state %+v, %v: want running", st, err)
	}
	// The same ID is never started twice.
	if _, err := second.Launch(context.Background(), containerLaunch(c, "true")); !errors.Is(err, ErrAlreadyLaunched) {
		t.Fatalf("second launch: %v, want ErrAlreadyLaunched", err)
	}
	left[0].Proc.Stop(10 * time.Second)
	exit := waitExit(t, left[0].Proc, limit)
	if !exit.Stopped || exit.Code != 5 {
		t.Fatalf("adopted exit %+v, want stopped, code 5", exit)
	}
	waitLogHas(t, p.Info().LogPath, "bye\n")
	assertCleanedUp(t, r, rt)
	if err := second.Forget(allocID); err != nil {
		t.Fatal(err)
	}
}

func TestContainerOfAKilledShimIsCleanedUp(t *testing.T) {
	r, rt, c := containerLocal(t)
	p := start(t, r, containerLaunch(c, `echo ready; exec sleep 600`))
	waitLogHas(t, p.Info().LogPath, "ready\n")
	var st runState
	if _, err := readJSON(filepath.Join(r.runDir(allocID), stateFile), &st); err != nil || st.ShimPID == 0 {
		t.Fatalf("state %+v: %v", st, err)
	}
	if err := syscall.Kill(st.ShimPID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	exit := waitExit(t, p, limit)
	if !errors.Is(exit.Err, ErrLost) {
		t.Fatalf("exit %+v, want ErrLost", exit)
	}
	// runc died with its shim; the container is killed and removed.
	assertCleanedUp(t, r, rt)
	if err := r.Forget(allocID); err != nil {
		t.Fatal(err)
	}
}

func TestContainerStaleFromACrashIsReplaced(t *testing.T) {
	r, rt, c := containerLocal(t)
	// A container of this allocation that runc still lists, stopped: what
	// a machine's crash leaves when the run's state directory was lost.
	stale := filepath.Join(t.TempDir(), "stale")
	sc := oci.Config{ID: oci.ContainerID(allocID), Image: c.Image, Command: []string{"/bin/true"}}
	b, err := oci.CreateBundle(stale, sc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = oci.RemoveBundle(b.Dir) })
	ctx := context.Background()
	// The created container keeps runc's stdio: a file, not a pipe this
	// test would wait on.
	out, err := os.Create(filepath.Join(t.TempDir(), "create.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	create := exec.Command(rt.Path, "--root", rt.Root, "create", "--bundle", b.Dir, sc.ID)
	create.Stdout, create.Stderr = out, out
	if err := create.Run(); err != nil {
		b, _ := os.ReadFile(out.Name())
		t.Fatalf("runc create: %v: %s", err, b)
	}
	t.Cleanup(func() { _ = rt.Delete(context.Background(), sc.ID, true) })
	if err := rt.Kill(ctx, sc.ID, syscall.SIGKILL, true); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the stale container to stop", func() bool {
		st, err := rt.State(ctx, sc.ID)
		return err == nil && !st.Running()
	})
	p := start(t, r, containerLaunch(c, `echo fresh`))
	if exit := waitExit(t, p, limit); exit.Code != 0 || exit.Err != nil {
		t.Fatalf("exit %+v", exit)
	}
	waitLogHas(t, p.Info().LogPath, "fresh\n")
}

func TestContainerWithoutRuncFailsAndHostCommandsRun(t *testing.T) {
	r := &Local{LogDir: t.TempDir(), Runc: "/nonexistent/runc"}
	l := newLaunch(contracts.RunSpec{Command: []string{"/bin/sh", "-c", "true"}}, gpus("GPU-a"))
	l.Container = &Container{Image: oci.Image{RootFS: t.TempDir(), Cmd: []string{"/bin/sh"}}}
	_, err := r.Launch(context.Background(), l)
	if !errors.Is(err, ErrRuntimeUnavailable) || !errors.Is(err, ErrLaunch) {
		t.Fatalf("launch: %v, want ErrLaunch wrapping ErrRuntimeUnavailable", err)
	}
	l.Container = nil
	p := start(t, r, l)
	if exit := waitExit(t, p, limit); exit.Code != 0 || exit.Err != nil {
		t.Fatalf("host command exit %+v", exit)
	}
}

func TestContainerWithoutItsGPUsDescribedNeverStarts(t *testing.T) {
	r, _, c := containerLocal(t)
	l := containerLaunch(c, "true")
	l.Devices = gpus("GPU-of-another-machine")
	if _, err := r.Launch(context.Background(), l); !errors.Is(err, ErrLaunch) {
		t.Fatalf("launch: %v, want ErrLaunch", err)
	}
}

// TestContainerWhoseCommandIsNotInTheImageFailsToLaunch: runc cannot
// create the container; Launch fails with runc's message and the cause a
// shell reports as 127, not a started run that exits 1.
func TestContainerWhoseCommandIsNotInTheImageFailsToLaunch(t *testing.T) {
	r, rt, c := containerLocal(t)
	l := containerLaunch(c, "")
	l.Spec.Command = []string{"/no/such/program"}
	// The run never started: Launch says so, as for a host command.
	_, err := r.Launch(context.Background(), l)
	if !errors.Is(err, ErrLaunch) || !errors.Is(err, exec.ErrNotFound) || !strings.Contains(err.Error(), "/no/such/program") {
		t.Fatalf("error %v, want a launch failure, not found, naming the program", err)
	}
	assertCleanedUp(t, r, rt)
}
