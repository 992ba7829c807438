package runner

import (
	"context"
	"errors"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

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

func launch(t *testing.T, spec contracts.RunSpec, uuids ...string) (Process, string) {
	t.Helper()
	dir := t.TempDir()
	r := &Local{LogDir: dir}
	p, err := r.Launch(context.Background(), Launch{AllocationID: "acme/job-1/1", Spec: spec, DeviceUUIDs: uuids, StopGrace: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return p, LogPath(dir, "acme/job-1/1")
}

func TestCommandGetsItsDevicesAndExitCode(t *testing.T) {
	p, logPath := launch(t, contracts.RunSpec{
		Command: []string{"sh", "-c", `echo "$CUDA_VISIBLE_DEVICES|$NVIDIA_VISIBLE_DEVICES|$GREETING|$GPUPLANE_ALLOCATION_ID"; echo oops >&2; exit 3`},
		Env:     map[string]string{"GREETING": "hi", "CUDA_VISIBLE_DEVICES": "all"},
	}, "GPU-a", "GPU-b")
	exit := waitExit(t, p, 10*time.Second)
	if exit.Code != 3 || exit.Stopped || exit.TimedOut || exit.Err != nil {
		t.Fatalf("exit %+v, want code 3", exit)
	}
	out, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	// The run's own env cannot widen its devices.
	if want := "GPU-a,GPU-b|GPU-a,GPU-b|hi|acme/job-1/1\noops\n"; string(out) != want {
		t.Fatalf("log %q, want %q", out, want)
	}
}

func TestEnvDoesNotLeakTheAgentsEnvironment(t *testing.T) {
	t.Setenv("GPUPLANE_NATS_URL", "nats://secret@host")
	env := Env(Launch{AllocationID: "a/b/1", DeviceUUIDs: []string{"GPU-x"}})
	if slices.ContainsFunc(env, func(kv string) bool { return strings.HasPrefix(kv, "GPUPLANE_NATS_URL=") }) {
		t.Fatalf("agent variable leaked into the run: %v", env)
	}
	if !slices.Contains(env, "CUDA_VISIBLE_DEVICES=GPU-x") || !slices.ContainsFunc(env, func(kv string) bool { return strings.HasPrefix(kv, "PATH=") }) {
		t.Fatalf("env %v lacks PATH or CUDA_VISIBLE_DEVICES", env)
	}
}

func TestStopReachesTheWholeProcessGroup(t *testing.T) {
	// The shell forks a sleep and waits: SIGTERM must reach the sleep too,
	// or the shell's wait would outlive the stop.
	p, _ := launch(t, contracts.RunSpec{Command: []string{"sh", "-c", "sleep 60 & wait"}})
	start := time.Now()
	p.Stop(5 * time.Second)
	exit := waitExit(t, p, 5*time.Second)
	if !exit.Stopped || exit.Code != 128+15 {
		t.Fatalf("exit %+v, want stopped by SIGTERM (143)", exit)
	}
	if d := time.Since(start); d > 4*time.Second {
		t.Fatalf("SIGTERM took %s: the group did not get it", d)
	}
}

func TestStopEscalatesToSIGKILLAfterGrace(t *testing.T) {
	// Ignored signals are inherited, so the sleep ignores SIGTERM as well.
	p, logPath := launch(t, contracts.RunSpec{Command: []string{"sh", "-c", `trap "" TERM; echo ready; sleep 60`}})
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if out, _ := os.ReadFile(logPath); string(out) == "ready\n" {
			break // the trap is in place
		}
		if time.Now().After(deadline) {
			p.Stop(0)
			t.Fatal("the shell never said it was ready")
		}
	}
	start := time.Now()
	p.Stop(300 * time.Millisecond)
	p.Stop(time.Hour) // idempotent: the first grace holds
	exit := waitExit(t, p, 5*time.Second)
	if !exit.Stopped || exit.Code != 128+9 {
		t.Fatalf("exit %+v, want stopped by SIGKILL (137)", exit)
	}
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Fatalf("killed after %s, before the grace", d)
	}
}

func TestCommandTimeLimit(t *testing.T) {
	p, _ := launch(t, contracts.RunSpec{Command: []string{"sleep", "60"}, Duration: contracts.Duration(200 * time.Millisecond)})
	exit := waitExit(t, p, 5*time.Second)
	if !exit.TimedOut || exit.Stopped || exit.Code != 128+15 {
		t.Fatalf("exit %+v, want timed out by SIGTERM", exit)
	}
}

func TestSimulatedRun(t *testing.T) {
	p, logPath := launch(t, contracts.RunSpec{Duration: contracts.Duration(50 * time.Millisecond), ExitCode: 4})
	if exit := waitExit(t, p, 5*time.Second); exit.Code != 4 || exit.Stopped {
		t.Fatalf("exit %+v, want code 4", exit)
	}
	if _, err := os.Stat(logPath); err != nil {
		t.Fatalf("simulated run has no log: %v", err)
	}
	p, _ = launch(t, contracts.RunSpec{Duration: contracts.Duration(time.Hour)})
	p.Stop(time.Second)
	p.Stop(time.Second)
	if exit := waitExit(t, p, 5*time.Second); !exit.Stopped || exit.Code != 128+15 {
		t.Fatalf("exit %+v, want stopped", exit)
	}
}

func TestLaunchFailure(t *testing.T) {
	r := &Local{LogDir: t.TempDir()}
	_, err := r.Launch(context.Background(), Launch{AllocationID: "a/b/1",
		Spec: contracts.RunSpec{Command: []string{"/nonexistent/program"}}})
	if !errors.Is(err, ErrLaunch) || !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("err %v, want ErrLaunch wrapping not-exist", err)
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
