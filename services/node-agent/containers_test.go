package nodeagent_test

import (
	"context"
	"errors"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci/ocitest"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/sim"
)

// pushBusybox serves the busybox test image from a registry of the test's
// own and returns its reference.
func pushBusybox(t *testing.T) string {
	t.Helper()
	rs := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(rs.Close)
	ref := strings.TrimPrefix(rs.URL, "http://") + "/acme/busybox:1"
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, ocitest.OCIImage(t, ocitest.Image(t))); err != nil {
		t.Fatal(err)
	}
	return ref
}

// TestContainerJobsRunFromTheirImage: a committed allocation whose run
// names an image is pulled, run by runc as a non-root user with its GPU,
// its read-only mount and its limits, and reported with its exit code and
// output like a host command; what its pool does not allow, or what
// cannot be pulled, fails with its reason.
func TestContainerJobsRunFromTheirImage(t *testing.T) {
	rt := ocitest.Runtime(t)
	ref := pushBusybox(t)
	b := connect(t)
	const node = "ctr-01"
	cfg := testConfig(t, node)
	cfg.ImageDir, cfg.Runc = t.TempDir(), rt.Path
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	startAgent(t, b, cfg)

	datasets, elsewhere := t.TempDir(), t.TempDir()
	if err := os.WriteFile(filepath.Join(datasets, "hello.txt"), []byte("dataset-content\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// A link under the root that leads out of it.
	if err := os.Symlink(elsewhere, filepath.Join(datasets, "escape")); err != nil {
		t.Fatal(err)
	}
	pool := &contracts.PoolRuntime{MountRoots: []string{datasets}}
	sh := func(script string) []string { return []string{"/bin/sh", "-c", script} }
	tests := map[string]struct {
		run      contracts.RunSpec
		runtime  *contracts.PoolRuntime
		outcome  contracts.RunOutcome
		reason   contracts.Reason
		exitCode int
		log      []string
	}{
		"runs": {
			run: contracts.RunSpec{Image: ref, Command: sh(`
echo "uid=$(id -u) gpus=$CUDA_VISIBLE_DEVICES pid=$$"
cat /data/hello.txt
touch /data/x 2>/dev/null || echo read-only
cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max
exit 4`), Mounts: []contracts.Mount{{Source: datasets, Target: "/data", ReadOnly: true}}},
			runtime: pool, outcome: contracts.OutcomeFailed, reason: contracts.ReasonExitNonZero, exitCode: 4,
			log: []string{"uid=65534 gpus=" + sim.UUID(node, 1) + " pid=1\n", "dataset-content\n", "read-only\n", "268435456\n"},
		},
		"args replace the image's CMD": {
			run:     contracts.RunSpec{Image: ref, Args: []string{"/bin/echo", "from", "args"}},
			runtime: pool, outcome: contracts.OutcomeSucceeded, log: []string{"from args\n"},
		},
		"mount outside the roots": {
			run:     contracts.RunSpec{Image: ref, Mounts: []contracts.Mount{{Source: elsewhere, Target: "/data"}}},
			runtime: pool, outcome: contracts.OutcomeFailed, reason: contracts.ReasonMountNotAllowed, exitCode: -1,
		},
		"mount through a link out of the roots": {
			run:     contracts.RunSpec{Image: ref, Mounts: []contracts.Mount{{Source: filepath.Join(datasets, "escape"), Target: "/data"}}},
			runtime: pool, outcome: contracts.OutcomeFailed, reason: contracts.ReasonMountNotAllowed, exitCode: -1,
		},
		"host command in an images-only pool": {
			run:     contracts.RunSpec{Command: []string{"true"}},
			runtime: &contracts.PoolRuntime{}, outcome: contracts.OutcomeFailed, reason: contracts.ReasonHostCommandsNotAllowed, exitCode: -1,
		},
		"command not in the image": {
			run:     contracts.RunSpec{Image: ref, Command: []string{"/no/such/program"}},
			runtime: pool, outcome: contracts.OutcomeFailed, reason: contracts.ReasonLaunchFailed, exitCode: 127,
		},
		"missing image": {
			run:     contracts.RunSpec{Image: strings.TrimSuffix(ref, ":1") + ":no-such-tag"},
			runtime: pool, outcome: contracts.OutcomeFailed, reason: contracts.ReasonImageNotFound, exitCode: -1,
		},
	}
	logs := record[contracts.LogChunk](t, b, contracts.StreamLogs, contracts.SubjectLogs("acme", "*", "*"))
	for name, tt := range tests {
		job := "ctr-" + strings.ReplaceAll(name, " ", "-")
		t.Run(name, func(t *testing.T) {
			a := allocation(node, job, tt.run, 1)
			a.Runtime, a.MemoryMiB = tt.runtime, 256
			ledger(t, b, contracts.LedgerCommitted, a, "")
			res := waitEnded(t, runs, a.ID).Result
			if res.Outcome != tt.outcome || res.Reason != tt.reason || res.ExitCode != tt.exitCode {
				t.Fatalf("result %+v, want %s/%s with exit code %d", res, tt.outcome, tt.reason, tt.exitCode)
			}
			if len(tt.log) == 0 {
				return
			}
			_, out := shippedLog(t, logs, a.ID)
			for _, want := range tt.log {
				if !strings.Contains(out, want) {
					t.Errorf("output lacks %q:\n%s", want, out)
				}
			}
		})
	}
}

// TestWithoutRuncContainersFailAndHostCommandsRun: a machine without
// runc fails a container run with runtime_unavailable and still runs host
// commands where the pool allows them.
func TestWithoutRuncContainersFailAndHostCommandsRun(t *testing.T) {
	b := connect(t)
	const node = "ctr-norunc"
	cfg := testConfig(t, node)
	cfg.ImageDir, cfg.Runc = t.TempDir(), filepath.Join(t.TempDir(), "no-runc-here")
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	startAgent(t, b, cfg)

	// The image is on the machine already (no registry): the runtime is
	// what is missing. An image that cannot be pulled would fail first.
	ctr := allocation(node, "ctr", contracts.RunSpec{Image: pushBusybox(t), Command: []string{"/bin/true"}}, 0)
	ctr.Runtime = &contracts.PoolRuntime{AllowHostCommands: true}
	ledger(t, b, contracts.LedgerCommitted, ctr, "")
	if res := waitEnded(t, runs, ctr.ID).Result; res.Outcome != contracts.OutcomeFailed || res.Reason != contracts.ReasonRuntimeUnavailable {
		t.Fatalf("container result %+v, want failed: runtime_unavailable", res)
	}
	host := allocation(node, "host", contracts.RunSpec{Command: []string{"sh", "-c", "exit 0"}}, 1)
	host.Runtime = &contracts.PoolRuntime{AllowHostCommands: true}
	ledger(t, b, contracts.LedgerCommitted, host, "")
	if res := waitEnded(t, runs, host.ID).Result; res.Outcome != contracts.OutcomeSucceeded {
		t.Fatalf("host command result %+v, want succeeded", res)
	}
}

// TestContainerSurvivesAnAgentCrashAndIsReadopted: an agent killed while
// its container runs leaves the container running under its shim; the
// next agent re-adopts it (no second launch) and reports its real exit
// code and its whole output, and nothing of the container is left after.
func TestContainerSurvivesAnAgentCrashAndIsReadopted(t *testing.T) {
	rt := ocitest.Runtime(t)
	ref := pushBusybox(t)
	b := connect(t)
	const node = "ctr-crash"
	cfg := testConfig(t, node)
	cfg.ImageDir, cfg.Runc = t.TempDir(), rt.Path
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	inv := record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(node))
	logs := record[contracts.LogChunk](t, b, contracts.StreamLogs, contracts.SubjectJobLogs("acme", "ctr-survivor"))
	crash := startHelperAgent(t, b, cfg)

	a := allocation(node, "ctr-survivor", contracts.RunSpec{Image: ref,
		Command: []string{"/bin/sh", "-c", "echo start; sleep 2; echo done; exit 3"}}, 0)
	a.Runtime = &contracts.PoolRuntime{}
	ledger(t, b, contracts.LedgerCommitted, a, "")
	started := waitStarted(t, runs, a.ID)
	eventually(t, "the first line shipped", func() bool { return len(logs.all()) > 0 })
	crash()
	// The agent's runc state root (runner.Local's default).
	agentRuntime := oci.Runtime{Path: rt.Path, Root: filepath.Join(cfg.LogDir, "runc")}
	id := oci.ContainerID(a.ID)
	if st, err := agentRuntime.State(context.Background(), id); err != nil || !st.Running() {
		t.Fatalf("container after the agent's crash: %+v, %v; want it running", st, err)
	}

	counter := &countingRunner{Local: &runner.Local{LogDir: cfg.LogDir, Runc: cfg.Runc}, n: map[string]int{}}
	cfg.Runner = counter
	startAgentAfterCrash(t, b, cfg, inv, 1)
	r := waitEnded(t, runs, a.ID).Result
	if r.Outcome != contracts.OutcomeFailed || r.Reason != contracts.ReasonExitNonZero || r.ExitCode != 3 || !r.StartedAt.Equal(started.Time) {
		t.Fatalf("result %+v, want the container's exit code 3, started at %s", r, started.Time)
	}
	if counter.launches(a.ID) != 0 {
		t.Fatal("the new agent launched the run again")
	}
	if _, text := shippedLog(t, logs, a.ID); text != "start\ndone\n" {
		t.Fatalf("shipped %q, want the whole output once", text)
	}
	eventually(t, "the container removed", func() bool {
		_, err := agentRuntime.State(context.Background(), id)
		return errors.Is(err, oci.ErrNoContainer)
	})
	eventually(t, "the run's state (and bundle) forgotten", func() bool {
		_, err := os.Stat(stateDir(cfg, a.ID))
		return os.IsNotExist(err)
	})
}
