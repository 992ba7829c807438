package nodeagent_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/mps"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/mps/mpstest"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci/ocitest"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/sim"
)

// mpsConfig is testConfig with a stand-in MPS control program: a
// simulated machine then supervises MPS as a real one does.
func mpsConfig(t *testing.T, node string) (nodeagent.Config, *mpstest.Control) {
	c := mpstest.New(t)
	cfg := testConfig(t, node)
	cfg.MPSControl, cfg.MPSDir, cfg.MPSHostShm = c.Path, mpstest.Root(t), !mpstest.PrivateShm()
	return cfg, c
}

// share is an allocation of a share of one GPU running cmd.
func share(node, job string, gpu int, memMiB int64, percent int, cmd string) contracts.Allocation {
	a := allocation(node, job, contracts.RunSpec{Command: []string{"sh", "-c", cmd}}, gpu)
	a.Devices[0].Share = &contracts.GPUShare{MemoryMiB: memMiB, ComputePercent: percent}
	return a
}

// shareCommand fails unless its MPS daemon is up when it starts (exit 10)
// and its /dev/shm is the daemon's (exit 11), prints its MPS environment,
// then runs until the file gate exists.
func shareCommand(gate string) string {
	return `test -e "$CUDA_MPS_PIPE_DIRECTORY/` + mps.PIDFile + `" || exit 10
test -e "/dev/shm/nvidia-cuda-mps-control-$(cat "$CUDA_MPS_PIPE_DIRECTORY/` + mps.PIDFile + `")" || exit 11
echo "$CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_PINNED_DEVICE_MEM_LIMIT $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
while [ ! -e '` + gate + `' ]; do sleep 0.05; done`
}

func open(t *testing.T, gate string) {
	t.Helper()
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
}

// mpsStates is the MPS state of each GPU in the node's latest inventory.
func mpsStates(inv *recorder[contracts.NodeInventory]) []contracts.MPSState {
	all := inv.all()
	if len(all) == 0 {
		return nil
	}
	var s []contracts.MPSState
	for _, g := range all[len(all)-1].GPUs {
		s = append(s, g.MPS)
	}
	return s
}

func runLog(t *testing.T, cfg nodeagent.Config, id string) string {
	t.Helper()
	b, _ := os.ReadFile(runner.LogPath(cfg.LogDir, id))
	return string(b)
}

func daemonPID(t *testing.T, c *mpstest.Control, pipeDir string) int {
	t.Helper()
	pids := c.Daemons(pipeDir)
	if len(pids) != 1 {
		t.Fatalf("MPS daemons of %s: %v; want exactly one", pipeDir, pids)
	}
	return pids[0]
}

// TestSharesRunOnlyWithTheirGPUsMPSDaemon: the first share of a GPU starts
// the GPU's daemon before it launches, a second share of it uses the same
// one, another GPU's share gets its own, a whole GPU none; the inventory
// shows each GPU's state, and the last share's end stops its GPU's daemon.
func TestSharesRunOnlyWithTheirGPUsMPSDaemon(t *testing.T) {
	b := connect(t)
	const node = "n-mps"
	cfg, c := mpsConfig(t, node)
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	inv := record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(node))
	startAgent(t, b, cfg)
	eventually(t, "the first inventory", func() bool { return len(inv.all()) > 0 })
	if got := mpsStates(inv); got[2] != contracts.MPSNone {
		t.Fatalf("MPS states before any share: %v; want none", got)
	}

	gate := filepath.Join(t.TempDir(), "go")
	s1 := share(node, "s1", 2, 8192, 25, shareCommand(gate))
	s2 := share(node, "s2", 2, 4096, 50, shareCommand(gate))
	s5 := share(node, "s5", 5, 20480, 30, shareCommand(gate))
	whole := allocation(node, "whole", contracts.RunSpec{Command: []string{"sh", "-c",
		`echo "pipe=$CUDA_MPS_PIPE_DIRECTORY"; while [ ! -e '` + gate + `' ]; do sleep 0.05; done`}}, 6)
	all := []contracts.Allocation{s1, s2, s5, whole}
	for _, a := range all {
		ledger(t, b, contracts.LedgerCommitted, a, "")
	}
	for _, a := range all {
		killGroupAtEnd(t, waitStarted(t, runs, a.ID).PID)
	}

	pipe2, pipe5 := mps.PipeDir(cfg.MPSDir, sim.UUID(node, 2)), mps.PipeDir(cfg.MPSDir, sim.UUID(node, 5))
	daemon2 := daemonPID(t, c, pipe2)
	daemonPID(t, c, pipe5)
	if got := c.Attempts(); len(got) != 2 || !slices.Contains(got, sim.UUID(node, 2)) || !slices.Contains(got, sim.UUID(node, 5)) {
		t.Fatalf("daemons started for %v; want one for each shared GPU, %s and %s", got, sim.UUID(node, 2), sim.UUID(node, 5))
	}
	eventually(t, "the inventory to show the daemons up", func() bool {
		s := mpsStates(inv)
		return s[2] == contracts.MPSUp && s[5] == contracts.MPSUp && s[6] == contracts.MPSNone
	})
	for _, c := range []struct {
		a    contracts.Allocation
		want string
	}{
		{s1, pipe2 + " 0=8192M 25\n"},
		{s2, pipe2 + " 0=4096M 50\n"},
		{s5, pipe5 + " 0=20480M 30\n"},
		{whole, "pipe=\n"},
	} {
		eventually(t, "the output of "+c.a.JobID, func() bool { return runLog(t, cfg, c.a.ID) != "" })
		if got := runLog(t, cfg, c.a.ID); got != c.want {
			t.Errorf("%s printed %q; want %q", c.a.JobID, got, c.want)
		}
	}

	open(t, gate)
	for _, a := range all {
		if r := waitEnded(t, runs, a.ID).Result; r.Outcome != contracts.OutcomeSucceeded {
			t.Errorf("%s ended %+v; want succeeded (exit 10: its daemon was not up when it started; 11: not its /dev/shm)", a.JobID, r)
		}
	}
	eventually(t, "no daemon once no GPU holds a share", func() bool { return len(c.Daemons("")) == 0 })
	eventually(t, "the inventory to show no daemon", func() bool {
		s := mpsStates(inv)
		return s[2] == contracts.MPSNone && s[5] == contracts.MPSNone
	})
	log, _ := os.ReadFile(filepath.Join(cfg.MPSDir, sim.UUID(node, 2), "log", "control.log"))
	if !strings.Contains(string(log), "command: quit") || strings.Count(string(log), "started") != 1 {
		t.Errorf("GPU 2's daemon (pid %d) was not started once and told to quit; its log:\n%s", daemon2, log)
	}
}

// TestAShareIsRefusedWhereMPSCannotStart: a share whose GPU's daemon does
// not start is never launched and fails with mps_unavailable; whole GPUs
// still run, and a later share runs once the daemon can start.
func TestAShareIsRefusedWhereMPSCannotStart(t *testing.T) {
	b := connect(t)
	const node = "n-mps-down"
	cfg, c := mpsConfig(t, node)
	counter := newCountingRunner(t)
	cfg.Runner = counter
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	startAgent(t, b, cfg)

	c.Fail(t, true)
	refused := share(node, "refused", 1, 8192, 25, "exit 0")
	ledger(t, b, contracts.LedgerCommitted, refused, "")
	r := waitEnded(t, runs, refused.ID).Result
	if r.Outcome != contracts.OutcomeFailed || r.Reason != contracts.ReasonMPSUnavailable || r.ExitCode != nodeagent.NoExitCode ||
		!strings.Contains(r.Message, "stand-in told to fail") {
		t.Fatalf("result %+v; want failed, mps_unavailable, no exit code, with the control program's message", r)
	}
	if started, _ := facts(runs, refused.ID); len(started) != 0 || counter.launches(refused.ID) != 0 {
		t.Fatalf("%d started facts, %d launches; want the share never launched", len(started), counter.launches(refused.ID))
	}

	whole := allocation(node, "whole", contracts.RunSpec{Command: []string{"true"}}, 1)
	ledger(t, b, contracts.LedgerCommitted, whole, "")
	if r := waitEnded(t, runs, whole.ID).Result; r.Outcome != contracts.OutcomeSucceeded {
		t.Fatalf("a whole GPU's run ended %+v; want succeeded: MPS gates shares only", r)
	}

	c.Fail(t, false)
	later := share(node, "later", 1, 8192, 25, `test -e "$CUDA_MPS_PIPE_DIRECTORY/`+mps.PIDFile+`"`)
	ledger(t, b, contracts.LedgerCommitted, later, "")
	if r := waitEnded(t, runs, later.ID).Result; r.Outcome != contracts.OutcomeSucceeded {
		t.Fatalf("a share once the daemon can start ended %+v; want succeeded", r)
	}
}

// TestMPSDaemonsAcrossAnAgentCrash: the daemon of a share that outlives
// its agent is adopted by the next agent, or started again where it died
// meanwhile, never doubled; one no share needs any more is stopped.
func TestMPSDaemonsAcrossAnAgentCrash(t *testing.T) {
	for _, away := range []string{"nothing", "the daemon died", "the share ended"} {
		t.Run(away, func(t *testing.T) {
			b := connect(t)
			const node = "n-mps-crash"
			cfg, c := mpsConfig(t, node)
			runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
			inv := record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(node))
			crash := startHelperAgent(t, b, cfg)

			gate := filepath.Join(t.TempDir(), "go")
			a := share(node, "survivor", 3, 8192, 25, shareCommand(gate))
			ledger(t, b, contracts.LedgerCommitted, a, "")
			started := waitStarted(t, runs, a.ID)
			killGroupAtEnd(t, started.PID)
			pipe := mps.PipeDir(cfg.MPSDir, sim.UUID(node, 3))
			first := daemonPID(t, c, pipe)
			eventually(t, "the first agent's inventory", func() bool { return len(inv.all()) > 0 })
			before := len(inv.all())
			crash()
			if got := daemonPID(t, c, pipe); got != first {
				t.Fatalf("daemon %d after the agent crashed; want %d still running", got, first)
			}
			switch away {
			case "the daemon died":
				if err := syscall.Kill(first, syscall.SIGKILL); err != nil {
					t.Fatal(err)
				}
				eventually(t, "the daemon dead", func() bool { return len(c.Daemons(pipe)) == 0 })
			case "the share ended":
				open(t, gate)
				eventually(t, "the share to end on its own", func() bool {
					_, err := os.Stat(filepath.Join(stateDir(cfg, a.ID), "exit.json"))
					return err == nil
				})
			}

			startAgentAfterCrash(t, b, cfg, inv, before)
			switch away {
			case "nothing":
				eventually(t, "the inventory to show the daemon up", func() bool { return mpsStates(inv)[3] == contracts.MPSUp })
				if got := daemonPID(t, c, pipe); got != first || len(c.Attempts()) != 1 {
					t.Fatalf("daemon %d after %d starts; want %d adopted, started once", got, len(c.Attempts()), first)
				}
			case "the daemon died":
				eventually(t, "a new daemon", func() bool {
					p := c.Daemons(pipe)
					return len(p) == 1 && p[0] != first && mpsStates(inv)[3] == contracts.MPSUp
				})
			case "the share ended":
				eventually(t, "the daemon stopped", func() bool { return len(c.Daemons(pipe)) == 0 })
				if r := waitEnded(t, runs, a.ID).Result; r.Outcome != contracts.OutcomeSucceeded {
					t.Fatalf("the share ended %+v; want succeeded", r)
				}
				return
			}
			open(t, gate)
			if r := waitEnded(t, runs, a.ID).Result; r.Outcome != contracts.OutcomeSucceeded {
				t.Fatalf("the share ended %+v; want succeeded", r)
			}
			eventually(t, "the daemon stopped after the share", func() bool { return len(c.Daemons("")) == 0 })
		})
	}
}

// TestSimulatedMachinesRunNoMPSUnlessTold: without a control program a
// simulated agent runs shares as before, reports no MPS state, and gives
// no pipe directory.
func TestSimulatedMachinesRunNoMPSUnlessTold(t *testing.T) {
	b := connect(t)
	const node = "n-no-mps"
	cfg := testConfig(t, node)
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	inv := record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(node))
	startAgent(t, b, cfg)
	a := share(node, "s", 4, 8192, 25, `echo "pipe=$CUDA_MPS_PIPE_DIRECTORY limit=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"`)
	ledger(t, b, contracts.LedgerCommitted, a, "")
	if r := waitEnded(t, runs, a.ID).Result; r.Outcome != contracts.OutcomeSucceeded {
		t.Fatalf("share ended %+v; want succeeded", r)
	}
	if got := runLog(t, cfg, a.ID); got != "pipe= limit=0=8192M\n" {
		t.Fatalf("share printed %q; want no pipe directory and its limit", got)
	}
	for _, s := range mpsStates(inv) {
		if s != "" {
			t.Fatalf("MPS states %v; want none reported", mpsStates(inv))
		}
	}
}

// TestAShareContainerMeetsItsMPSDaemon: a share run as a container (runc,
// a non-root user) finds its GPU's daemon up at start, through the pipe
// directory CUDA_MPS_PIPE_DIRECTORY names and the daemon's /dev/shm, with
// its limits in its environment.
func TestAShareContainerMeetsItsMPSDaemon(t *testing.T) {
	rt := ocitest.Runtime(t)
	ref := pushBusybox(t)
	b := connect(t)
	const node = "n-mps-ctr"
	cfg, c := mpsConfig(t, node)
	cfg.ImageDir, cfg.Runc = t.TempDir(), rt.Path
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	startAgent(t, b, cfg)

	a := share(node, "ctr-share", 2, 8192, 25, "")
	a.Run = contracts.RunSpec{Image: ref, Command: []string{"/bin/sh", "-c", shareCommand("/") +
		"\necho \"uid=$(id -u)\""}}
	a.Runtime, a.MemoryMiB = &contracts.PoolRuntime{}, 256
	ledger(t, b, contracts.LedgerCommitted, a, "")
	if r := waitEnded(t, runs, a.ID).Result; r.Outcome != contracts.OutcomeSucceeded {
		t.Fatalf("the share's container ended %+v; want succeeded (exit 10: no daemon up at its start; 11: not the daemon's /dev/shm)", r)
	}
	pipe := mps.PipeDir(cfg.MPSDir, sim.UUID(node, 2))
	if got, want := runLog(t, cfg, a.ID), pipe+" 0=8192M 25\nuid=65534\n"; got != want {
		t.Fatalf("the container printed %q; want %q", got, want)
	}
	eventually(t, "the daemon stopped after the share", func() bool { return len(c.Daemons("")) == 0 })
}
