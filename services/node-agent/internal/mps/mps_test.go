package mps_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/mps"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/mps/mpstest"
)

const (
	gpuA = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
	gpuB = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
	gpuC = "GPU-cccccccc-0000-0000-0000-000000000000"
)

// newSupervisor supervises the stand-in's daemons under root, with fast
// polls and backoffs (the test's own wait bounds every wait).
func newSupervisor(t *testing.T, c *mpstest.Control, root string) *mps.Supervisor {
	t.Helper()
	s, err := mps.New(mps.Config{Control: c.Path, Root: root, PollInterval: 20 * time.Millisecond,
		Backoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, MaxRestarts: 3, QuitTimeout: 5 * time.Second,
		HostShm: !mpstest.PrivateShm()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func acquire(t *testing.T, s *mps.Supervisor, uuid string) *mps.Lease {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	l, err := s.Acquire(ctx, uuid)
	if err != nil {
		t.Fatalf("acquire %s: %v", uuid, err)
	}
	return l
}

// oneDaemon returns the only daemon of pipeDir, failing unless there is
// exactly one.
func oneDaemon(t *testing.T, c *mpstest.Control, pipeDir string) int {
	t.Helper()
	pids := c.Daemons(pipeDir)
	if len(pids) != 1 {
		t.Fatalf("daemons of %s: %v; want exactly one", pipeDir, pids)
	}
	return pids[0]
}

func TestOneDaemonPerGPUUpBeforeAcquireReturnsAndStoppedAfterTheLastShare(t *testing.T) {
	c := mpstest.New(t)
	root := mpstest.Root(t)
	s := newSupervisor(t, c, root)
	if got := s.State(gpuA); got != contracts.MPSNone {
		t.Fatalf("state before any share: %q; want none", got)
	}

	a1 := acquire(t, s, gpuA)
	// Up when Acquire returns: the share launches after this.
	pidA := oneDaemon(t, c, a1.PipeDir)
	if got := s.State(gpuA); got != contracts.MPSUp || s.PID(gpuA) != pidA {
		t.Fatalf("state %q pid %d; want up, pid %d", got, s.PID(gpuA), pidA)
	}
	env := mpstest.Environ(pidA)
	for _, want := range []string{"CUDA_VISIBLE_DEVICES=" + gpuA, "CUDA_MPS_PIPE_DIRECTORY=" + mps.PipeDir(root, gpuA),
		"CUDA_MPS_LOG_DIRECTORY=" + filepath.Join(root, gpuA, "log")} {
		if !slices.Contains(env, want) {
			t.Errorf("daemon environment %v lacks %s", env, want)
		}
	}
	if b, err := os.ReadFile(filepath.Join(a1.PipeDir, mps.PIDFile)); err != nil || strings.TrimSpace(string(b)) != strconv.Itoa(pidA) {
		t.Errorf("pid file: %q, %v; want %d", b, err, pidA)
	}
	// The daemon's /dev/shm is the GPU's own directory, never the host's
	// (where this test may make mount namespaces).
	if _, err := os.Stat(filepath.Join(a1.ShmDir, mpstest.ShmMarker(pidA))); err != nil {
		t.Errorf("the daemon's shared memory is not in the share's shm directory %q: %v", a1.ShmDir, err)
	}
	if _, err := os.Stat(filepath.Join("/dev/shm", mpstest.ShmMarker(pidA))); mpstest.PrivateShm() && !os.IsNotExist(err) {
		t.Errorf("the daemon's shared memory is in the host's /dev/shm (%v)", err)
	}
	// A container's non-root user reaches the daemon, and its MPS server
	// writes there.
	for _, d := range []string{a1.PipeDir, a1.LogDir} {
		if fi, err := os.Stat(d); err != nil || fi.Mode().Perm() != 0o777 || fi.Mode()&os.ModeSticky == 0 {
			t.Errorf("%s: %v, %v; want drwxrwxrwt", d, fi.Mode(), err)
		}
	}

	a2 := acquire(t, s, gpuA) // a second share of the same GPU
	b1 := acquire(t, s, gpuB)
	if a2.PipeDir != a1.PipeDir || b1.PipeDir == a1.PipeDir {
		t.Fatalf("pipe dirs %s, %s, %s: want one per GPU", a1.PipeDir, a2.PipeDir, b1.PipeDir)
	}
	if got := oneDaemon(t, c, a1.PipeDir); got != pidA {
		t.Fatalf("GPU A's daemon is %d after its second share; want still %d", got, pidA)
	}
	pidB := oneDaemon(t, c, b1.PipeDir)
	if !slices.Contains(mpstest.Environ(pidB), "CUDA_VISIBLE_DEVICES="+gpuB) {
		t.Errorf("GPU B's daemon sees %v; want only %s", mpstest.Environ(pidB), gpuB)
	}
	if got := c.Attempts(); len(got) != 2 {
		t.Fatalf("-d ran %d times (%v); want once per GPU", len(got), got)
	}

	a1.Release()
	a1.Release() // idempotent: one share still holds GPU A
	if got := oneDaemon(t, c, a2.PipeDir); got != pidA || s.State(gpuA) != contracts.MPSUp {
		t.Fatalf("after one of two shares ended: daemon %d, state %s; want %d, up", got, s.State(gpuA), pidA)
	}
	a2.Release()
	eventually(t, "GPU A's daemon to stop", func() bool {
		return s.State(gpuA) == contracts.MPSNone && len(c.Daemons(a2.PipeDir)) == 0
	})
	log, _ := os.ReadFile(filepath.Join(root, gpuA, "log", "control.log"))
	if !strings.Contains(string(log), "command: quit") {
		t.Errorf("GPU A's daemon was not told to quit; its log:\n%s", log)
	}
	if got := oneDaemon(t, c, b1.PipeDir); got != pidB || s.State(gpuB) != contracts.MPSUp {
		t.Fatalf("GPU B: daemon %d, state %s; want %d, up", got, s.State(gpuB), pidB)
	}
	b1.Release()
	eventually(t, "GPU B's daemon to stop", func() bool { return len(c.Daemons(b1.PipeDir)) == 0 })
}

func TestADaemonThatDiesIsRestarted(t *testing.T) {
	c := mpstest.New(t)
	s := newSupervisor(t, c, mpstest.Root(t))
	l := acquire(t, s, gpuA)
	defer l.Release()
	pid := oneDaemon(t, c, l.PipeDir)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a new daemon", func() bool {
		p := c.Daemons(l.PipeDir)
		return len(p) == 1 && p[0] != pid && s.State(gpuA) == contracts.MPSUp && s.PID(gpuA) == p[0]
	})
	if got := c.Starts(); len(got) != 2 {
		t.Fatalf("daemons started: %v; want 2", got)
	}
	// A share that comes while it is down waits for it, and gets it up.
	pid = s.PID(gpuA)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// kill returns before the process is dead.
	eventually(t, "the daemon dead", func() bool { return !slices.Contains(c.Daemons(""), pid) })
	l2 := acquire(t, s, gpuA)
	defer l2.Release()
	if p := oneDaemon(t, c, l2.PipeDir); p != s.PID(gpuA) {
		t.Fatalf("daemon %d, supervisor's %d", p, s.PID(gpuA))
	}
}

func TestAShareIsRefusedWhenTheDaemonCannotStart(t *testing.T) {
	c := mpstest.New(t)
	s := newSupervisor(t, c, mpstest.Root(t))
	c.Fail(t, true)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	l, err := s.Acquire(ctx, gpuA)
	if !errors.Is(err, mps.ErrUnavailable) || l != nil {
		t.Fatalf("Acquire: %v, %v; want ErrUnavailable", l, err)
	}
	if !strings.Contains(err.Error(), "stand-in told to fail") {
		t.Errorf("error %q does not say what the control program said", err)
	}
	// The share's hold was given back: with none left, the GPU is none
	// again once its keeper has stopped.
	eventually(t, "GPU A to hold no share", func() bool { return s.State(gpuA) == contracts.MPSNone })

	// Once the daemon can start, the next share gets it.
	c.Fail(t, false)
	l = acquire(t, s, gpuA)
	oneDaemon(t, c, l.PipeDir)
	l.Release()

	missing, err := mps.New(mps.Config{Control: filepath.Join(t.TempDir(), "nvidia-cuda-mps-control"), Root: mpstest.Root(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer missing.Close()
	if _, err := missing.Acquire(ctx, gpuA); !errors.Is(err, mps.ErrUnavailable) || !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Acquire without a control program: %v; want ErrUnavailable and ErrNotExist", err)
	}
}

func TestRestartsAreBounded(t *testing.T) {
	c := mpstest.New(t)
	s := newSupervisor(t, c, mpstest.Root(t)) // MaxRestarts 3
	l, err := s.Hold(gpuA)                    // a re-adopted share: holds, never waits
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	pid := 0
	eventually(t, "the daemon up", func() bool { pid = s.PID(gpuA); return pid != 0 })
	c.Fail(t, true)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the keeper to give up", func() bool { return s.GaveUp(gpuA) })
	// The death and three failed restarts: 1 + 3 -d in all, then none.
	if got := c.Attempts(); len(got) != 1+3 || s.State(gpuA) != contracts.MPSDown {
		t.Fatalf("-d ran %d times, state %s; want 4, down", len(got), s.State(gpuA))
	}
	// A new share tries again.
	c.Fail(t, false)
	l2 := acquire(t, s, gpuA)
	defer l2.Release()
	oneDaemon(t, c, l2.PipeDir)
}

func TestANewSupervisorAdoptsOrStopsTheDaemonsOfTheLastOne(t *testing.T) {
	c := mpstest.New(t)
	root := mpstest.Root(t)
	s1 := newSupervisor(t, c, root)
	a := acquire(t, s1, gpuA)
	b := acquire(t, s1, gpuB)
	other := acquire(t, s1, gpuC) // another machine's GPU, in a fleet sharing the root
	pidA, pidB, pidC := oneDaemon(t, c, a.PipeDir), oneDaemon(t, c, b.PipeDir), oneDaemon(t, c, other.PipeDir)
	s1.Close() // the agent stops; its shares' runs (and daemons) go on
	if got := c.Daemons(""); len(got) != 3 {
		t.Fatalf("daemons after the supervisor closed: %v; want all three still running", got)
	}

	// The next agent re-adopts GPU A's share; GPU B's ended meanwhile.
	s2 := newSupervisor(t, c, root)
	la, err := s2.Hold(gpuA)
	if err != nil {
		t.Fatal(err)
	}
	if err := s2.Sweep(context.Background(), []string{gpuA, gpuB, "GPU-never-held"}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "GPU A's daemon adopted", func() bool { return s2.PID(gpuA) == pidA })
	if got := oneDaemon(t, c, a.PipeDir); got != pidA {
		t.Fatalf("GPU A's daemon is %d; want the one adopted, %d", got, pidA)
	}
	if got := c.Daemons(b.PipeDir); len(got) != 0 {
		t.Fatalf("GPU B's daemon %v still runs with no share; want it stopped (was %d)", got, pidB)
	}
	if got := c.Daemons(other.PipeDir); len(got) != 1 || got[0] != pidC {
		t.Fatalf("GPU C's daemon: %v; want %d untouched: GPU C is not the sweeping agent's", got, pidC)
	}
	if got := c.Attempts(); len(got) != 3 {
		t.Fatalf("-d ran %d times; want no new start", len(got))
	}

	// A daemon that died while no agent ran is started again.
	s2.Close()
	if err := syscall.Kill(pidA, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	s3 := newSupervisor(t, c, root)
	if _, err := s3.Hold(gpuA); err != nil {
		t.Fatal(err)
	}
	eventually(t, "GPU A's daemon restarted", func() bool {
		p := c.Daemons(a.PipeDir)
		return len(p) == 1 && p[0] != pidA && s3.PID(gpuA) == p[0]
	})
	la.Release() // s2's lease: its supervisor is closed, nothing happens
	if got := s3.State(gpuA); got != contracts.MPSUp {
		t.Fatalf("state after a closed supervisor's release: %s; want up", got)
	}
}

func TestADaemonThatIgnoresQuitIsKilled(t *testing.T) {
	c := mpstest.New(t)
	s, err := mps.New(mps.Config{Control: c.Path, Root: mpstest.Root(t), PollInterval: 20 * time.Millisecond,
		QuitTimeout: 300 * time.Millisecond, HostShm: !mpstest.PrivateShm()})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c.Deaf(t, true)
	l := acquire(t, s, gpuA)
	pid := oneDaemon(t, c, l.PipeDir)
	l.Release()
	eventually(t, "the daemon killed", func() bool {
		return s.State(gpuA) == contracts.MPSNone && !slices.Contains(c.Daemons(""), pid)
	})
	if _, err := os.Stat(filepath.Join(l.PipeDir, mps.PIDFile)); !os.IsNotExist(err) {
		t.Errorf("pid file of the killed daemon: %v; want it removed", err)
	}
	log, _ := os.ReadFile(filepath.Join(l.LogDir, "control.log"))
	if !strings.Contains(string(log), "command: quit") {
		t.Errorf("the daemon was killed without being told to quit first; its log:\n%s", log)
	}
}
