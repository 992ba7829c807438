package nodeagent_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
)

// TestSimulatedRunsShipTheirOutputWithoutStateFiles: a simulated run's
// output is shipped whole (its first lines while it runs, the rest and
// its end when it ends) from memory, and the run leaves nothing on disk:
// no log file (a run costs no file), no record of what was shipped (it
// dies with its agent, nothing resumes its shipping) and no checkpoint
// directory while it never checkpoints.
func TestSimulatedRunsShipTheirOutputWithoutStateFiles(t *testing.T) {
	b := connect(t)
	const node = "n-simlog"
	cfg := testConfig(t, node)
	cfg.CheckpointDir = t.TempDir()
	cfg.SimLogDelay = 200 * time.Millisecond
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	long := record[contracts.LogChunk](t, b, contracts.StreamLogs, contracts.SubjectJobLogs("acme", "long"))
	short := record[contracts.LogChunk](t, b, contracts.StreamLogs, contracts.SubjectJobLogs("acme", "short"))
	startAgent(t, b, cfg)

	l := allocation(node, "long", contracts.RunSpec{Duration: contracts.Duration(time.Hour)}, 0)
	s := allocation(node, "short", contracts.RunSpec{Duration: contracts.Duration(10 * time.Millisecond), ExitCode: 4}, 1)
	ledger(t, b, contracts.LedgerCommitted, l, "")
	ledger(t, b, contracts.LedgerCommitted, s, "")
	waitStarted(t, runs, l.ID)
	waitEnded(t, runs, s.ID)

	// The short run: its whole output in order, the last chunk EOF with
	// its exit code.
	cs, text := shippedLog(t, short, s.ID)
	if !strings.HasPrefix(text, "simulated run of 10ms") || cs[len(cs)-1].ExitCode != 4 {
		t.Fatalf("short run shipped %q (last chunk %+v), want its first line and exit code 4", text, cs[len(cs)-1])
	}
	// The long one ships its first lines while it runs.
	eventually(t, "the long run's first line shipped", func() bool {
		for _, c := range long.all() {
			if c.AllocationID == l.ID && strings.HasPrefix(c.Data, "simulated run of 1h0m0s") && !c.EOF {
				return true
			}
		}
		return false
	})
	var files []string
	for _, dir := range []string{cfg.LogDir, cfg.CheckpointDir} {
		err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if err == nil && p != dir {
				files = append(files, strings.TrimPrefix(p, dir))
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(files) != 0 {
		t.Fatalf("simulated runs left %q on disk, want nothing", files)
	}
}

// TestABurstOfStartsSurvivesAnAgentCrash: an agent SIGKILLed right after
// a burst of starts (simulated runs and commands committed together, the
// agent killed as soon as the last started fact is out) loses none of
// them: the next agent reports each simulated run lost (it died with its
// agent) and re-adopts each command, every run reaches exactly one ended
// fact, none is launched again, and each command's output is shipped
// whole.
func TestABurstOfStartsSurvivesAnAgentCrash(t *testing.T) {
	b := connect(t)
	const node = "n-burst"
	cfg := testConfig(t, node)
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	inv := record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(node))
	crash := startHelperAgent(t, b, cfg)

	const sims, cmds = 24, 4
	var all, commands []contracts.Allocation
	logs := map[string]*recorder[contracts.LogChunk]{}
	for i := range sims {
		all = append(all, allocation(node, fmt.Sprintf("sim-%02d", i), contracts.RunSpec{Duration: contracts.Duration(time.Hour)}, i%8))
	}
	for i := range cmds {
		// Still running when its agent dies: each ends by itself after.
		a := allocation(node, fmt.Sprintf("cmd-%d", i), contracts.RunSpec{Command: []string{"sh", "-c",
			fmt.Sprintf("echo start %d; sleep 2; echo done %d", i, i)}}, i)
		all = append(all, a)
		commands = append(commands, a)
		logs[a.ID] = record[contracts.LogChunk](t, b, contracts.StreamLogs, contracts.SubjectJobLogs("acme", a.JobID))
	}
	for _, a := range all {
		ledger(t, b, contracts.LedgerCommitted, a, "")
	}
	started := map[string]contracts.RunEvent{}
	for _, a := range all {
		started[a.ID] = waitStarted(t, runs, a.ID)
	}
	crash()
	for _, a := range commands {
		killGroupAtEnd(t, started[a.ID].PID)
	}

	counter := &countingRunner{Local: &runner.Local{LogDir: cfg.LogDir}, n: map[string]int{}}
	cfg.Runner = counter
	startAgentAfterCrash(t, b, cfg, inv, 1)
	for _, a := range all {
		e := waitEnded(t, runs, a.ID)
		r := e.Result
		if strings.HasPrefix(a.JobID, "sim-") {
			if r.Outcome != contracts.OutcomeFailed || r.Reason != contracts.ReasonAgentRestart || !r.StartedAt.Equal(started[a.ID].Time) {
				t.Errorf("%s: result %+v, want failed agent_restarted from %s", a.ID, r, started[a.ID].Time)
			}
		} else if r.Outcome != contracts.OutcomeSucceeded || r.ExitCode != 0 || !r.StartedAt.Equal(started[a.ID].Time) {
			t.Errorf("%s: result %+v, want the re-adopted command to succeed, started at %s", a.ID, r, started[a.ID].Time)
		}
	}
	for _, a := range all {
		if s, e := facts(runs, a.ID); len(s) != 1 || len(e) != 1 || counter.launches(a.ID) != 0 {
			t.Errorf("%s: %d started and %d ended facts, %d launches by the new agent; want one fact each, no launch",
				a.ID, len(s), len(e), counter.launches(a.ID))
		}
	}
	for i, a := range commands {
		cs, text := shippedLog(t, logs[a.ID], a.ID)
		if want := fmt.Sprintf("start %d\ndone %d\n", i, i); text != want || cs[len(cs)-1].ExitCode != 0 {
			t.Errorf("%s shipped %q (last chunk %+v), want %q and exit code 0", a.ID, text, cs[len(cs)-1], want)
		}
	}
}
