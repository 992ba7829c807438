package runner

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/proctest"
)

// TestMain lets the test binary be a run's shim: commands launched by
// these tests run under it, as they do under the agent.
func TestMain(m *testing.M) {
	MaybeRunShim()
	os.Exit(m.Run())
}

const limit = 10 * time.Second // bound of every wait

// waitExit waits for p with a bound, so a run that never ends fails the
// test instead of hanging it.
func waitExit(t *testing.T, p Process, within time.Duration) Exit {
	t.Helper()
	select {
	case <-p.Done():
		return p.Wait()
	case <-time.After(within):
		p.Stop(0)
		t.Fatalf("run did not end within %s", within)
		return Exit{}
	}
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(limit); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func gpus(uuids ...string) []contracts.DeviceRef {
	var out []contracts.DeviceRef
	for i, u := range uuids {
		out = append(out, contracts.DeviceRef{Index: i, UUID: u, Model: "H100-80GB"})
	}
	return out
}

const allocID = "acme/job-1/1"

func newLaunch(spec contracts.RunSpec, devs []contracts.DeviceRef) Launch {
	return Launch{AllocationID: allocID, Tenant: "acme", JobID: "job-1", Attempt: 1, Spec: spec, Devices: devs, StopGrace: time.Second}
}

// start launches l on r and makes sure the run is gone when the test ends.
func start(t *testing.T, r *Local, l Launch) Process {
	t.Helper()
	p, err := r.Launch(context.Background(), l)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Stop(0); <-p.Done() })
	return p
}

func launch(t *testing.T, spec contracts.RunSpec, uuids ...string) (Process, string) {
	t.Helper()
	r := &Local{LogDir: t.TempDir()}
	return start(t, r, newLaunch(spec, gpus(uuids...))), LogPath(r.LogDir, allocID)
}

// waitLog waits until the run's log reads want.
func waitLog(t *testing.T, path, want string) {
	t.Helper()
	eventually(t, "log "+strconv.Quote(want), func() bool {
		out, _ := os.ReadFile(path)
		return string(out) == want
	})
}

func TestEnv(t *testing.T) {
	mig := contracts.DeviceRef{Index: 1, UUID: "GPU-b", MIG: &contracts.MIGInstance{UUID: "MIG-b1", Profile: "1g.10gb"}}
	share := func(i int, uuid string, mem int64, pct int) contracts.DeviceRef {
		return contracts.DeviceRef{Index: i, UUID: uuid, Share: &contracts.GPUShare{MemoryMiB: mem, ComputePercent: pct}}
	}
	for name, c := range map[string]struct {
		launch Launch
		want   map[string]string // "" means the variable must be absent
	}{
		"whole GPUs in allocation order": {
			Launch{AllocationID: "acme/j/2", Tenant: "acme", JobID: "j", Attempt: 2, Devices: gpus("GPU-b", "GPU-a")},
			map[string]string{EnvCUDAVisible: "GPU-b,GPU-a", EnvNVIDIAVisible: "GPU-b,GPU-a", EnvMPSThreads: "", EnvMPSMemLimit: "",
				EnvAllocationID: "acme/j/2", EnvTenant: "acme", EnvJobID: "j", EnvAttempt: "2", EnvCheckpointDir: "", EnvRestoreFrom: ""},
		},
		"a MIG instance is named by its own UUID": {
			Launch{Devices: []contracts.DeviceRef{mig}},
			map[string]string{EnvCUDAVisible: "MIG-b1", EnvNVIDIAVisible: "MIG-b1"},
		},
		"one share": {
			Launch{Devices: []contracts.DeviceRef{share(3, "GPU-d", 4096, 25)}},
			map[string]string{EnvCUDAVisible: "GPU-d", EnvMPSThreads: "25", EnvMPSMemLimit: "0=4096M"},
		},
		"shares and a whole GPU: limits by position, the smallest compute share": {
			Launch{Devices: []contracts.DeviceRef{share(0, "GPU-a", 8192, 50), gpus("GPU-b")[0], share(2, "GPU-c", 2048, 30)}},
			map[string]string{EnvCUDAVisible: "GPU-a,GPU-b,GPU-c", EnvMPSThreads: "30", EnvMPSMemLimit: "0=8192M,2=2048M"},
		},
		"the run's own env cannot widen its devices or fake a restore": {
			Launch{JobID: "j", Devices: gpus("GPU-a"), Spec: contracts.RunSpec{Env: map[string]string{
				EnvCUDAVisible: "all", EnvNVIDIAVisible: "all", EnvMPSThreads: "100", EnvMPSMemLimit: "0=80G",
				EnvRestoreFrom: "/etc", EnvJobID: "other", "GREETING": "hi"}}},
			map[string]string{EnvCUDAVisible: "GPU-a", EnvNVIDIAVisible: "GPU-a", EnvMPSThreads: "", EnvMPSMemLimit: "",
				EnvRestoreFrom: "", EnvJobID: "j", "GREETING": "hi"},
		},
		"a gang part": {
			Launch{Devices: gpus("GPU-a"), Gang: &contracts.GangPart{Rank: 2, Size: 3, Nodes: []string{"n1", "n2", "n3"}}},
			map[string]string{EnvGangRank: "2", EnvGangSize: "3", EnvGangNodes: "n1,n2,n3"},
		},
		"no gang, and the run's own env cannot fake one": {
			Launch{Devices: gpus("GPU-a"), Spec: contracts.RunSpec{Env: map[string]string{EnvGangRank: "0", EnvGangSize: "2", EnvGangNodes: "x,y"}}},
			map[string]string{EnvGangRank: "", EnvGangSize: "", EnvGangNodes: ""},
		},
		"the agent's gang wins over the run's env": {
			Launch{Devices: gpus("GPU-a"), Gang: &contracts.GangPart{Rank: 1, Size: 2, Nodes: []string{"a", "b"}},
				Spec: contracts.RunSpec{Env: map[string]string{EnvGangRank: "0", EnvGangNodes: "x,y"}}},
			map[string]string{EnvGangRank: "1", EnvGangSize: "2", EnvGangNodes: "a,b"},
		},
		"checkpoint and restore": {
			Launch{Devices: gpus("GPU-a"), CheckpointDir: "/ck/acme/j", RestoreFrom: "/ck/acme/j/ckpt-3"},
			map[string]string{EnvCheckpointDir: "/ck/acme/j", EnvRestoreFrom: "/ck/acme/j/ckpt-3"},
		},
	} {
		t.Run(name, func(t *testing.T) {
			env := Env(c.launch)
			if !slices.IsSorted(env) {
				t.Errorf("env not sorted: %v", env)
			}
			got := map[string]string{}
			for _, kv := range env {
				k, v, _ := strings.Cut(kv, "=")
				got[k] = v
			}
			for k, want := range c.want {
				if v, ok := got[k]; want == "" && ok {
					t.Errorf("%s=%q, want it unset", k, v)
				} else if want != "" && v != want {
					t.Errorf("%s=%q, want %q", k, v, want)
				}
			}
		})
	}
}

func TestEnvDoesNotLeakTheAgentsEnvironment(t *testing.T) {
	t.Setenv("GPUPLANE_NATS_URL", "nats://secret@host")
	env := Env(Launch{AllocationID: "a/b/1", Devices: gpus("GPU-x")})
	if slices.ContainsFunc(env, func(kv string) bool { return strings.HasPrefix(kv, "GPUPLANE_NATS_URL=") }) {
		t.Fatalf("agent variable leaked into the run: %v", env)
	}
	if !slices.Contains(env, "CUDA_VISIBLE_DEVICES=GPU-x") || !slices.ContainsFunc(env, func(kv string) bool { return strings.HasPrefix(kv, "PATH=") }) {
		t.Fatalf("env %v lacks PATH or CUDA_VISIBLE_DEVICES", env)
	}
}

func TestValidateDevice(t *testing.T) {
	for name, c := range map[string]struct {
		d    contracts.DeviceRef
		want string // "" means valid
	}{
		"whole GPU":           {contracts.DeviceRef{UUID: "GPU-a"}, ""},
		"no UUID":             {contracts.DeviceRef{Index: 2}, "device 2 has no UUID"},
		"MIG without UUID":    {contracts.DeviceRef{UUID: "GPU-a", MIG: &contracts.MIGInstance{Profile: "1g.10gb"}}, "MIG instance 1g.10gb"},
		"share":               {contracts.DeviceRef{UUID: "GPU-a", Share: &contracts.GPUShare{MemoryMiB: 1, ComputePercent: 100}}, ""},
		"share of 0 %":        {contracts.DeviceRef{UUID: "GPU-a", Share: &contracts.GPUShare{MemoryMiB: 1024}}, "0% compute"},
		"share of 101 %":      {contracts.DeviceRef{UUID: "GPU-a", Share: &contracts.GPUShare{MemoryMiB: 1024, ComputePercent: 101}}, "101% compute"},
		"share without bytes": {contracts.DeviceRef{UUID: "GPU-a", Share: &contracts.GPUShare{ComputePercent: 10}}, "0 MiB"},
	} {
		err := ValidateDevice(c.d)
		if (c.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%s: %v, want %q", name, err, c.want)
		}
	}
}

func TestCommandGetsItsDevicesAndExitCode(t *testing.T) {
	p, logPath := launch(t, contracts.RunSpec{
		Command: []string{"sh", "-c", `echo "$CUDA_VISIBLE_DEVICES|$NVIDIA_VISIBLE_DEVICES|$GREETING|$GPUPLANE_ALLOCATION_ID|$GPUPLANE_JOB_ID|$GPUPLANE_ATTEMPT"; echo oops >&2; exit 3`},
		Env:     map[string]string{"GREETING": "hi", "CUDA_VISIBLE_DEVICES": "all"},
	}, "GPU-a", "GPU-b")
	if pid := p.Info().PID; pid <= 0 {
		t.Errorf("pid %d", pid)
	}
	exit := waitExit(t, p, limit)
	if exit.Code != 3 || exit.Stopped || exit.TimedOut || exit.Err != nil || exit.EndedAt.IsZero() {
		t.Fatalf("exit %+v, want code 3", exit)
	}
	out, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	if want := "GPU-a,GPU-b|GPU-a,GPU-b|hi|acme/job-1/1|job-1|1\noops\n"; string(out) != want {
		t.Fatalf("log %q, want %q", out, want)
	}
}

func TestStopReachesTheWholeProcessGroup(t *testing.T) {
	// The shell forks a sleep and waits: SIGTERM must reach the sleep too,
	// or the shell's wait would outlive the stop.
	p, _ := launch(t, contracts.RunSpec{Command: []string{"sh", "-c", "sleep 60 & wait"}})
	p.Stop(time.Minute)
	exit := waitExit(t, p, limit)
	if !exit.Stopped || exit.Code != 128+15 {
		t.Fatalf("exit %+v, want stopped by SIGTERM (143)", exit)
	}
	// The signal reaches the whole group at once, but the sleep may still
	// be on its way out when the shell's exit is seen (a loaded machine):
	// it must be gone well before its own 60 s.
	eventually(t, "the run's group to end with it", func() bool { return !proctest.GroupAlive(t, p.Info().PID) })
}

func TestStopEscalatesToSIGKILLAfterGrace(t *testing.T) {
	// Ignored signals are inherited, so the sleep ignores SIGTERM as well.
	p, logPath := launch(t, contracts.RunSpec{Command: []string{"sh", "-c", `trap "" TERM; echo ready; sleep 60`}})
	waitLog(t, logPath, "ready\n") // the trap is in place
	start := time.Now()
	p.Stop(300 * time.Millisecond)
	p.Stop(time.Hour) // idempotent: the first grace holds
	exit := waitExit(t, p, limit)
	if !exit.Stopped || exit.Code != 128+9 {
		t.Fatalf("exit %+v, want stopped by SIGKILL (137)", exit)
	}
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Fatalf("killed after %s, before the grace", d)
	}
}

func TestCommandTimeLimit(t *testing.T) {
	p, _ := launch(t, contracts.RunSpec{Command: []string{"sleep", "60"}, Duration: contracts.Duration(200 * time.Millisecond)})
	exit := waitExit(t, p, limit)
	if !exit.TimedOut || exit.Stopped || exit.Code != 128+15 {
		t.Fatalf("exit %+v, want timed out by SIGTERM", exit)
	}
}

func TestSimulatedRun(t *testing.T) {
	p, logPath := launch(t, contracts.RunSpec{Duration: contracts.Duration(50 * time.Millisecond), ExitCode: 4})
	if exit := waitExit(t, p, limit); exit.Code != 4 || exit.Stopped || p.Info().PID != 0 {
		t.Fatalf("exit %+v, pid %d, want code 4 and no process", exit, p.Info().PID)
	}
	if _, err := os.Stat(logPath); !os.IsNotExist(err) || p.Info().LogPath != "" {
		t.Fatalf("a simulated run has a log file (%v) or names one (%q): its output is in memory only", err, p.Info().LogPath)
	}
	if out := simOutput(p); !strings.HasPrefix(out, "simulated run of 50ms") {
		t.Fatalf("output %q, want its first line", out)
	}
	p, _ = launch(t, contracts.RunSpec{Duration: contracts.Duration(time.Hour)})
	p.Stop(time.Second)
	p.Stop(time.Second)
	if exit := waitExit(t, p, limit); !exit.Stopped || exit.Code != 128+15 {
		t.Fatalf("exit %+v, want stopped", exit)
	}
}

func TestLaunchFailure(t *testing.T) {
	notExecutable := filepath.Join(t.TempDir(), "script")
	if err := os.WriteFile(notExecutable, []byte("echo hi\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]struct {
		command []string
		is      error
	}{
		"no such file":   {[]string{"/nonexistent/program"}, os.ErrNotExist},
		"not in PATH":    {[]string{"no-such-program-gpuplane"}, exec.ErrNotFound},
		"not executable": {[]string{notExecutable}, os.ErrPermission},
	} {
		t.Run(name, func(t *testing.T) {
			r := &Local{LogDir: t.TempDir()}
			_, err := r.Launch(context.Background(), newLaunch(contracts.RunSpec{Command: c.command}, gpus("GPU-a")))
			if !errors.Is(err, ErrLaunch) || !errors.Is(err, c.is) {
				t.Fatalf("err %v, want ErrLaunch wrapping %v", err, c.is)
			}
			// The failure is recorded: the allocation is never launched
			// again, and adopting it tells why.
			if _, err := r.Launch(context.Background(), newLaunch(contracts.RunSpec{Command: []string{"true"}}, nil)); !errors.Is(err, ErrAlreadyLaunched) {
				t.Fatalf("second launch: %v, want ErrAlreadyLaunched", err)
			}
			l, err := r.Adopt(allocID)
			if err != nil {
				t.Fatal(err)
			}
			if exit := waitExit(t, l.Proc, limit); !errors.Is(exit.Err, ErrLaunch) || !errors.Is(exit.Err, c.is) || !l.Proc.Info().StartedAt.IsZero() {
				t.Fatalf("adopted exit %+v, want the launch failure and no start", exit)
			}
			if err := r.Forget(allocID); err != nil {
				t.Fatal(err)
			}
			if _, err := r.Adopt(allocID); !errors.Is(err, ErrNoRun) {
				t.Fatalf("adopt after forget: %v, want ErrNoRun", err)
			}
		})
	}
}

func TestLaunchRefusesPathsOutsideTheCheckpointRoot(t *testing.T) {
	r := &Local{LogDir: t.TempDir()}
	for _, job := range []string{"", "..", "a/b"} {
		l := newLaunch(contracts.RunSpec{Duration: contracts.Duration(time.Millisecond)}, gpus("GPU-a"))
		l.JobID = job
		if _, err := r.Launch(context.Background(), l); !errors.Is(err, ErrLaunch) || !strings.Contains(err.Error(), "checkpoint directory") {
			t.Errorf("job %q: %v, want a launch error naming the checkpoint directory", job, err)
		}
	}
}

func TestAProgramThatIsNoShimFailsTheLaunch(t *testing.T) {
	// A program that does not call MaybeRunShim exits (here at once, a Go
	// program on the unknown flag): Launch fails and says why.
	r := &Local{LogDir: t.TempDir(), shimProgram: "/bin/true"}
	_, err := r.Launch(context.Background(), newLaunch(contracts.RunSpec{Command: []string{"sleep", "60"}}, nil))
	if !errors.Is(err, ErrLaunch) || !strings.Contains(err.Error(), "MaybeRunShim") {
		t.Fatalf("err %v, want a launch error that names MaybeRunShim", err)
	}
	l, err := r.Adopt(allocID)
	if err != nil {
		t.Fatal(err)
	}
	if exit := waitExit(t, l.Proc, limit); !errors.Is(exit.Err, ErrLaunch) {
		t.Fatalf("adopted exit %+v, want the launch failure", exit)
	}
}

func TestRunsSurviveTheirLauncherAndAreAdopted(t *testing.T) {
	dir := t.TempDir()
	first := &Local{LogDir: dir}
	p := start(t, first, newLaunch(contracts.RunSpec{Command: []string{"sh", "-c", `echo started; sleep 1; echo done; exit 3`}}, gpus("GPU-a")))
	waitLog(t, LogPath(dir, allocID), "started\n")

	// A new agent (another Local on the same directory) finds it running.
	second := &Local{LogDir: dir}
	left, err := second.Recover()
	if err != nil || len(left) != 1 {
		t.Fatalf("recover: %v, %d runs; want the one running", err, len(left))
	}
	l := left[0]
	if l.Launch.AllocationID != allocID || l.Launch.Tenant != "acme" || len(l.Launch.Devices) != 1 ||
		l.Proc.Info().PID != p.Info().PID || l.Proc.Info().StartedAt.IsZero() {
		t.Fatalf("leftover %+v, info %+v", l.Launch, l.Proc.Info())
	}
	select {
	case <-l.Proc.Done():
		t.Fatal("adopted run reported ended while running")
	default:
	}
	if err := second.Forget(allocID); err == nil {
		t.Fatal("forgot a running run")
	}
	exit := waitExit(t, l.Proc, limit)
	if exit.Code != 3 || exit.Err != nil || exit.Stopped {
		t.Fatalf("adopted exit %+v, want code 3", exit)
	}
	if e := waitExit(t, p, limit); e.Code != 3 {
		t.Fatalf("launcher's exit %+v", e)
	}
	waitLog(t, LogPath(dir, allocID), "started\ndone\n")

	// Ended, not forgotten: still reported, with the real exit code.
	left, err = (&Local{LogDir: dir}).Recover()
	if err != nil || len(left) != 1 {
		t.Fatalf("recover an ended run: %v, %d runs", err, len(left))
	}
	if e := waitExit(t, left[0].Proc, limit); e.Code != 3 || e.EndedAt.IsZero() {
		t.Fatalf("recovered exit %+v", e)
	}
	if err := second.Forget(allocID); err != nil {
		t.Fatal(err)
	}
	if left, err := second.Recover(); err != nil || len(left) != 0 {
		t.Fatalf("recover after forget: %v, %v", left, err)
	}
}

func TestAdoptedRunsStopThroughTheirShim(t *testing.T) {
	dir := t.TempDir()
	p := start(t, &Local{LogDir: dir}, newLaunch(contracts.RunSpec{Command: []string{"sh", "-c", `trap "" TERM; echo ready; sleep 60 & wait`}}, nil))
	waitLog(t, LogPath(dir, allocID), "ready\n")
	l, err := (&Local{LogDir: dir}).Adopt(allocID)
	if err != nil {
		t.Fatal(err)
	}
	l.Proc.Stop(200 * time.Millisecond)
	exit := waitExit(t, l.Proc, limit)
	if !exit.Stopped || exit.Code != 128+9 {
		t.Fatalf("exit %+v, want stopped by SIGKILL after the grace", exit)
	}
	// The launcher's view agrees: the shim recorded the stop.
	if e := waitExit(t, p, limit); !e.Stopped || e.Code != 128+9 {
		t.Fatalf("launcher's exit %+v", e)
	}
	eventually(t, "the run's group to end with the stop", func() bool { return !proctest.GroupAlive(t, p.Info().PID) })
}

func TestKilledShimTakesItsCommandAlong(t *testing.T) {
	dir := t.TempDir()
	p := start(t, &Local{LogDir: dir}, newLaunch(contracts.RunSpec{Command: []string{"sh", "-c", `echo ready; sleep 60 & wait`}}, nil))
	waitLog(t, LogPath(dir, allocID), "ready\n")
	var st runState
	if _, err := readJSON(filepath.Join(dir, "state", fileKey(allocID), stateFile), &st); err != nil || st.ShimPID == 0 {
		t.Fatalf("state %+v: %v", st, err)
	}
	if err := syscall.Kill(st.ShimPID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	exit := waitExit(t, p, limit)
	if !errors.Is(exit.Err, ErrLost) || exit.Code != -1 {
		t.Fatalf("exit %+v, want ErrLost", exit)
	}
	eventually(t, "the command's group to die", func() bool { return !proctest.GroupAlive(t, st.PID) })

	// A later agent finds it lost too.
	l, err := (&Local{LogDir: dir}).Adopt(allocID)
	if err != nil {
		t.Fatal(err)
	}
	if e := waitExit(t, l.Proc, limit); !errors.Is(e.Err, ErrLost) || l.Proc.Info().StartedAt.IsZero() {
		t.Fatalf("adopted exit %+v, want ErrLost with the start time", e)
	}
}

func TestLatestCheckpoint(t *testing.T) {
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "ckpt-1"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "file"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for latest, want := range map[string]string{
		"ckpt-1\n": "ckpt-1",
		"ckpt-1":   "ckpt-1",
		"ckpt-2":   "", // not written (yet): not complete
		"file":     "", // not a directory
		"":         "",
		"..":       "",
		"/tmp":     "",
		"../x":     "",
	} {
		if err := os.WriteFile(filepath.Join(dir, LatestFile), []byte(latest), 0o644); err != nil {
			t.Fatal(err)
		}
		if name, ok := LatestCheckpoint(dir); name != want || ok != (want != "") {
			t.Errorf("LATEST %q: %q %v, want %q", latest, name, ok, want)
		}
	}
	if _, ok := LatestCheckpoint(filepath.Join(dir, "none")); ok {
		t.Error("a directory without LATEST has a checkpoint")
	}
}

// checkpointScript is the example of the protocol in FLOWS.md: on SIGUSR1
// it writes a new directory, then points LATEST at it; at start it resumes
// from GPUPLANE_RESTORE_FROM.
const checkpointScript = `
step=0
[ -n "$GPUPLANE_RESTORE_FROM" ] && step=$(cat "$GPUPLANE_RESTORE_FROM/step")
echo "resumed at $step"
checkpoint() {
  d="$GPUPLANE_CHECKPOINT_DIR/step-$step"
  mkdir -p "$d" && echo "$step" > "$d/step"
  echo "step-$step" > "$GPUPLANE_CHECKPOINT_DIR/LATEST.tmp"
  mv "$GPUPLANE_CHECKPOINT_DIR/LATEST.tmp" "$GPUPLANE_CHECKPOINT_DIR/LATEST"
}
trap checkpoint USR1
while [ "$step" -lt 1000 ]; do step=$((step+1)); sleep 0.01; done
`

func TestCheckpointOfACommand(t *testing.T) {
	r := &Local{LogDir: t.TempDir(), CheckpointDir: t.TempDir()}
	l := newLaunch(contracts.RunSpec{Command: []string{"sh", "-c", checkpointScript}}, nil)
	p := start(t, r, l)
	ckdir := p.Info().CheckpointDir
	if want := filepath.Join(r.CheckpointDir, "acme", "job-1"); ckdir != want || p.Info().RestoredFrom != "" {
		t.Fatalf("checkpoint dir %q restored from %q; want %q and nothing", ckdir, p.Info().RestoredFrom, want)
	}
	waitLog(t, LogPath(r.LogDir, allocID), "resumed at 0\n")
	if err := p.Checkpoint(); err != nil {
		t.Fatal(err)
	}
	var name string
	eventually(t, "a complete checkpoint", func() bool { var ok bool; name, ok = LatestCheckpoint(ckdir); return ok })
	p.Stop(0)
	waitExit(t, p, limit)
	if err := p.Checkpoint(); !errors.Is(err, ErrEnded) {
		t.Fatalf("checkpoint of an ended run: %v", err)
	}
	saved, err := os.ReadFile(filepath.Join(ckdir, name, "step"))
	if err != nil {
		t.Fatal(err)
	}

	// The next attempt restores from it.
	l2 := l
	l2.AllocationID, l2.Attempt = "acme/job-1/2", 2
	p2 := start(t, r, l2)
	if p2.Info().RestoredFrom != name {
		t.Fatalf("restored from %q, want %q", p2.Info().RestoredFrom, name)
	}
	waitLog(t, LogPath(r.LogDir, l2.AllocationID), "resumed at "+string(saved))
}

func TestSimulatedRunCheckpointsAndRestores(t *testing.T) {
	r := &Local{LogDir: t.TempDir()}
	l := newLaunch(contracts.RunSpec{Duration: contracts.Duration(time.Hour)}, gpus("GPU-a"))
	p := start(t, r, l)
	time.Sleep(50 * time.Millisecond) // some progress to save
	for range 2 {
		if err := p.Checkpoint(); err != nil {
			t.Fatal(err)
		}
	}
	ckdir := p.Info().CheckpointDir
	name, ok := LatestCheckpoint(ckdir)
	if !ok || name != "ckpt-2" {
		t.Fatalf("LATEST %q %v, want ckpt-2", name, ok)
	}
	s, err := readSimCheckpoint(filepath.Join(ckdir, name))
	if err != nil || s.Progress.D() < 50*time.Millisecond || s.Duration.D() != time.Hour {
		t.Fatalf("saved %+v: %v; want at least 50ms of 1h", s, err)
	}
	p.Stop(0)
	waitExit(t, p, limit)

	// A later attempt of 1h + a bit runs only what remains: pretend the
	// saved progress was nearly all of it.
	if err := writeJSON(filepath.Join(ckdir, name, simStateFile), simState{Progress: contracts.Duration(time.Hour - 100*time.Millisecond), Duration: contracts.Duration(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	l2 := l
	l2.AllocationID, l2.Attempt, l2.Spec.ExitCode = "acme/job-1/2", 2, 5
	p2 := start(t, r, l2)
	if exit := waitExit(t, p2, limit); exit.Code != 5 || p2.Info().RestoredFrom != "ckpt-2" {
		t.Fatalf("restored run: exit %+v, restored from %q; want it to end on its own with code 5", exit, p2.Info().RestoredFrom)
	}
	if out := simOutput(p2); !strings.Contains(out, "restored from ckpt-2 at 59m59.9s: 100ms to go") {
		t.Fatalf("log %q does not say it restored", out)
	}
	// Attempts share the directory: the next checkpoint does not reuse a name.
	if name, err := writeSimCheckpoint(ckdir, simState{}); err != nil || name != "ckpt-3" {
		t.Fatalf("next checkpoint %q: %v", name, err)
	}
}

func TestLogPathsAreDistinctPerAllocation(t *testing.T) {
	ids := []string{"acme/job_1/1", "acme/job/11", "acme/job-1/1", "acme2/job/1"}
	seen := map[string]string{}
	for _, id := range ids {
		p := LogPath("/logs", id)
		if prev, dup := seen[p]; dup {
			t.Fatalf("%s and %s share log %s", prev, id, p)
		}
		seen[p] = id
	}
}

// BenchmarkLaunchCommand is the cost the shim adds to a run: launch `true`
// under it and wait for its recorded end.
func BenchmarkLaunchCommand(b *testing.B) {
	r := &Local{LogDir: b.TempDir()}
	for i := range b.N {
		l := newLaunch(contracts.RunSpec{Command: []string{"true"}}, nil)
		l.AllocationID = "acme/job-1/" + strconv.Itoa(i+1)
		p, err := r.Launch(context.Background(), l)
		if err != nil {
			b.Fatal(err)
		}
		if exit := p.Wait(); exit.Code != 0 {
			b.Fatalf("exit %+v", exit)
		}
	}
}

// simOutput is what a simulated run wrote, read as its shipper reads it.
func simOutput(p Process) string {
	src := p.(*simProc)
	b := make([]byte, src.Size())
	n, _ := src.ReadAt(b, 0)
	return string(b[:n])
}
