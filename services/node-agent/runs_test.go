package nodeagent_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/proctest"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
)

// startHelperAgent runs cfg's agent in another process (this test binary,
// see TestMain) and returns crash, which SIGKILLs it: no shutdown, no
// stopping of its runs, as when an agent crashes or its machine reboots
// it alone.
func startHelperAgent(t *testing.T, b *testBus, cfg nodeagent.Config) (crash func()) {
	t.Helper()
	spec, err := json.Marshal(helperAgent{URL: b.srv.URL(), Creds: natstest.Node(t, b.srv, cfg.NodeID), NodeID: cfg.NodeID,
		LogDir: cfg.LogDir, CheckpointDir: cfg.CheckpointDir, StopGrace: cfg.StopGrace, MPSControl: cfg.MPSControl, MPSDir: cfg.MPSDir, MPSHostShm: cfg.MPSHostShm,
		Runc: cfg.Runc, ImageDir: cfg.ImageDir})
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperAgentEnv+"="+string(spec))
	cmd.Stdout, cmd.Stderr = t.Output(), t.Output()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	crashed := false
	crash = func() {
		if !crashed {
			crashed = true
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}
	t.Cleanup(crash)
	return crash
}

// startAgentAfterCrash starts the next agent of a node whose previous
// agents published inventories, and waits until it has published its own:
// past its recovery, so the test may end at any time after.
func startAgentAfterCrash(t *testing.T, b *testBus, cfg nodeagent.Config, inv *recorder[contracts.NodeInventory], before int) {
	t.Helper()
	startAgent(t, b, cfg)
	eventually(t, "the new agent's inventory", func() bool { return len(inv.all()) > before })
}

// killGroupAtEnd makes sure no process of a test's run outlives the test,
// whatever failed.
func killGroupAtEnd(t *testing.T, pgid int) {
	t.Cleanup(func() {
		if pgid > 1 {
			_ = syscall.Kill(-pgid, syscall.SIGKILL)
		}
	})
}

// stateDir is where the runner keeps a command run's state.
func stateDir(cfg nodeagent.Config, allocID string) string {
	return filepath.Join(cfg.LogDir, "state", strings.ReplaceAll(allocID, "/", "_"))
}

// shippedLog waits for the last chunk of allocID's log, then checks every
// chunk of it (each at most MaxLogChunk bytes, once each, back to back,
// only the last one EOF) and returns them and the output they carry.
func shippedLog(t *testing.T, r *recorder[contracts.LogChunk], allocID string) ([]contracts.LogChunk, string) {
	t.Helper()
	var cs []contracts.LogChunk
	eventually(t, "the last log chunk of "+allocID, func() bool {
		cs = cs[:0]
		for _, c := range r.all() {
			if c.AllocationID == allocID {
				cs = append(cs, c)
			}
		}
		return len(cs) > 0 && cs[len(cs)-1].EOF
	})
	var sb strings.Builder
	next := int64(0) // the offset the next chunk must have; -1 when unknown
	for i, c := range cs {
		if (next >= 0 && c.Offset != next) || len(c.Data) > contracts.MaxLogChunk || c.EOF != (i == len(cs)-1) {
			t.Fatalf("chunk %d of %d: offset %d, want %d; %d bytes, EOF %v", i, len(cs), c.Offset, next, len(c.Data), c.EOF)
		}
		next = c.Offset + int64(len(c.Data))
		if strings.ContainsRune(c.Data, '\uFFFD') {
			next = -1 // replaced invalid bytes: the raw length is unknown
		}
		sb.WriteString(c.Data)
	}
	return cs, sb.String()
}

func TestRunsSurviveAnAgentCrashAndAreReadopted(t *testing.T) {
	for name, endsWhileAway := range map[string]bool{"still running": false, "ended while no agent ran": true} {
		t.Run(name, func(t *testing.T) {
			b := connect(t)
			const node = "n-crash"
			cfg := testConfig(t, node)
			runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
			inv := record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(node))
			logs := record[contracts.LogChunk](t, b, contracts.StreamLogs, contracts.SubjectJobLogs("acme", "survivor"))
			crash := startHelperAgent(t, b, cfg)

			a := allocation(node, "survivor", contracts.RunSpec{Command: []string{"sh", "-c", "echo start; sleep 2; echo done; exit 3"}}, 0, 1)
			ledger(t, b, contracts.LedgerCommitted, a, "")
			started := waitStarted(t, runs, a.ID)
			pid := started.PID
			if pid <= 0 {
				t.Fatalf("started fact %+v has no PID", started)
			}
			killGroupAtEnd(t, pid)
			// The first agent shipped the start of the log.
			eventually(t, "the first line shipped", func() bool { return len(logs.all()) > 0 })
			crash()
			if !proctest.GroupAlive(t, pid) {
				t.Fatal("the run died with its agent")
			}
			if endsWhileAway {
				eventually(t, "the run to end on its own and its shim to record it", func() bool {
					_, err := os.Stat(filepath.Join(stateDir(cfg, a.ID), "exit.json"))
					return err == nil
				})
			}

			// The next agent of the node: it must not launch anything.
			counter := &countingRunner{Local: &runner.Local{LogDir: cfg.LogDir}, n: map[string]int{}}
			cfg.Runner = counter
			restartedAt := time.Now()
			startAgentAfterCrash(t, b, cfg, inv, 1)
			e := waitEnded(t, runs, a.ID)
			r := e.Result
			if r.Outcome != contracts.OutcomeFailed || r.Reason != contracts.ReasonExitNonZero || r.ExitCode != 3 ||
				!r.StartedAt.Equal(started.Time) {
				t.Fatalf("result %+v, want failed with the run's own exit code 3, started at %s", r, started.Time)
			}
			if endsWhileAway && !r.EndedAt.Before(restartedAt) {
				t.Errorf("ended at %s, after the new agent started (%s): want the time the shim recorded", r.EndedAt, restartedAt)
			}
			if s, ended := facts(runs, a.ID); len(s) != 1 || len(ended) != 1 || counter.launches(a.ID) != 0 {
				t.Fatalf("%d started and %d ended facts, %d launches by the new agent; want one fact each, no launch",
					len(s), len(ended), counter.launches(a.ID))
			}

			// The log: shipped once, whole, by both agents together.
			cs, text := shippedLog(t, logs, a.ID)
			file, err := os.ReadFile(runner.LogPath(cfg.LogDir, a.ID))
			if err != nil {
				t.Fatal(err)
			}
			if text != "start\ndone\n" || text != string(file) || cs[len(cs)-1].ExitCode != 3 {
				t.Fatalf("shipped %q (last chunk %+v), file %q; want both start and done once, exit code 3", text, cs[len(cs)-1], file)
			}
			eventually(t, "no process of the run left", func() bool { return !proctest.GroupAlive(t, pid) })
			eventually(t, "the run's state forgotten", func() bool {
				_, err := os.Stat(stateDir(cfg, a.ID))
				return os.IsNotExist(err)
			})
		})
	}
}

func TestRunsReleasedOrStoppedWhileTheAgentWasAwayAreKilled(t *testing.T) {
	for name, c := range map[string]struct {
		away     func(t *testing.T, b *testBus, a contracts.Allocation)
		outcome  contracts.RunOutcome
		reason   contracts.Reason
		exitCode int
	}{
		// The node was declared lost and the allocation released: its
		// devices may be someone else's, so no grace.
		"released": {func(t *testing.T, b *testBus, a contracts.Allocation) { ledger(t, b, contracts.LedgerReleased, a, "") },
			contracts.OutcomeFailed, contracts.ReasonNodeLost, 128 + 9},
		"stopped": {func(t *testing.T, b *testBus, a contracts.Allocation) { stopRun(t, b, a, time.Second) },
			contracts.OutcomeCancelled, contracts.ReasonCancelled, 128 + 15},
	} {
		t.Run(name, func(t *testing.T) {
			b := connect(t)
			const node = "n-away"
			cfg := testConfig(t, node)
			runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
			inv := record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(node))
			crash := startHelperAgent(t, b, cfg)
			a := allocation(node, "orphan", contracts.RunSpec{Command: []string{"sh", "-c", "sleep 60 & wait"}}, 3)
			ledger(t, b, contracts.LedgerCommitted, a, "")
			pid := waitStarted(t, runs, a.ID).PID
			killGroupAtEnd(t, pid)
			crash()
			c.away(t, b, a)
			startAgentAfterCrash(t, b, cfg, inv, 1)
			e := waitEnded(t, runs, a.ID)
			if r := e.Result; r.Outcome != c.outcome || r.Reason != c.reason || r.ExitCode != c.exitCode {
				t.Fatalf("result %+v, want %s, %s, exit code %d", r, c.outcome, c.reason, c.exitCode)
			}
			eventually(t, "the run's processes killed", func() bool { return !proctest.GroupAlive(t, pid) })
		})
	}
}

func TestARunWhoseShimWasKilledWhileTheAgentWasAwayIsReportedLost(t *testing.T) {
	b := connect(t)
	const node = "n-shim"
	cfg := testConfig(t, node)
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	inv := record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(node))
	crash := startHelperAgent(t, b, cfg)
	// The shell dies with the shim (Pdeathsig); its sleep does not, until
	// the next agent kills the group.
	a := allocation(node, "lost", contracts.RunSpec{Command: []string{"sh", "-c", "sleep 60 & wait"}}, 0)
	ledger(t, b, contracts.LedgerCommitted, a, "")
	started := waitStarted(t, runs, a.ID)
	killGroupAtEnd(t, started.PID)
	crash()
	var st struct {
		ShimPID int `json:"shimPid"`
	}
	raw, err := os.ReadFile(filepath.Join(stateDir(cfg, a.ID), "state.json"))
	if err != nil || json.Unmarshal(raw, &st) != nil || st.ShimPID <= 0 {
		t.Fatalf("state %s: %v", raw, err)
	}
	if err := syscall.Kill(st.ShimPID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the shell to die with its shim", func() bool { return syscall.Kill(started.PID, 0) != nil })

	startAgentAfterCrash(t, b, cfg, inv, 1)
	e := waitEnded(t, runs, a.ID)
	if r := e.Result; r.Outcome != contracts.OutcomeFailed || r.Reason != contracts.ReasonAgentRestart ||
		r.ExitCode != nodeagent.NoExitCode || !r.StartedAt.Equal(started.Time) {
		t.Fatalf("result %+v, want failed agent_restarted with no exit code", r)
	}
	eventually(t, "what the run forked killed", func() bool { return !proctest.GroupAlive(t, started.PID) })
}

func TestARunLaunchedButNeverAnnouncedIsAdoptedNotStartedAgain(t *testing.T) {
	b := connect(t)
	const node = "n-launch"
	cfg := testConfig(t, node)
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	a := allocation(node, "unannounced", contracts.RunSpec{Command: []string{"sh", "-c", "sleep 0.5; exit 4"}}, 1)
	// A previous agent launched it and died before publishing its started
	// fact; its commit is still to be delivered.
	prev, err := (&runner.Local{LogDir: cfg.LogDir}).Launch(context.Background(), runner.Launch{AllocationID: a.ID,
		Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, Spec: a.Run, Devices: a.Devices, StopGrace: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	killGroupAtEnd(t, prev.Info().PID)
	committed := ledger(t, b, contracts.LedgerCommitted, a, "")
	counter := &countingRunner{Local: &runner.Local{LogDir: cfg.LogDir}, n: map[string]int{}}
	cfg.Runner = counter
	startAgent(t, b, cfg)

	s := waitStarted(t, runs, a.ID)
	if s.PID != prev.Info().PID || !s.Time.Equal(prev.Info().StartedAt) {
		t.Fatalf("started fact %+v; want the launched run's PID %d and start %s", s, prev.Info().PID, prev.Info().StartedAt)
	}
	if e := waitEnded(t, runs, a.ID); e.Result.ExitCode != 4 {
		t.Fatalf("result %+v, want exit code 4", e.Result)
	}
	waitAcked(t, b, contracts.StreamAllocations, node, committed)
	if started, _ := facts(runs, a.ID); len(started) != 1 || counter.launches(a.ID) != 0 {
		t.Fatalf("%d started facts, %d launches; want the one run, adopted", len(started), counter.launches(a.ID))
	}
}

// checkpointScript follows the checkpoint protocol (FLOWS.md): on SIGUSR1
// it saves its step in a new directory, then points LATEST at it; it
// resumes from GPUPLANE_RESTORE_FROM.
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
while :; do step=$((step+1)); sleep 0.01; done
`

func checkpointRun(t *testing.T, b *testBus, a contracts.Allocation, seq int) {
	t.Helper()
	c := contracts.NodeCommand{SchemaVersion: contracts.SchemaVersion, Kind: contracts.CommandCheckpointRun, AllocationID: a.ID,
		Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, Reason: "migration", Time: time.Now()}
	if _, err := b.Publish(context.Background(), contracts.SubjectNodeCommands(a.NodeID), contracts.CheckpointCommandID(a.ID, seq), c); err != nil {
		t.Fatal(err)
	}
}

func TestCheckpointRoundTrip(t *testing.T) {
	for name, c := range map[string]struct {
		spec contracts.RunSpec
		// ready: the log says so once the run handles SIGUSR1; "" for
		// a simulated run, which handles it once started and writes its
		// log file only when it ends.
		ready    string
		restored func(ckpt string) string
	}{
		"command": {contracts.RunSpec{Command: []string{"sh", "-c", checkpointScript}, Checkpoint: true}, "resumed at 0\n",
			func(ckpt string) string { return "resumed at " + strings.TrimPrefix(ckpt, "step-") + "\n" }},
		"simulated": {contracts.RunSpec{Duration: contracts.Duration(time.Hour), Checkpoint: true}, "",
			func(ckpt string) string { return "restored from " + ckpt + " at " }},
	} {
		t.Run(name, func(t *testing.T) {
			b := connect(t)
			const node = "n-ckpt"
			cfg := testConfig(t, node)
			cfg.CheckpointDir = t.TempDir()
			runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
			logs := record[contracts.LogChunk](t, b, contracts.StreamLogs, contracts.SubjectJobLogs("acme", "trainer"))
			startAgent(t, b, cfg)
			a := allocation(node, "trainer", c.spec, 4)
			ledger(t, b, contracts.LedgerCommitted, a, "")
			killGroupAtEnd(t, waitStarted(t, runs, a.ID).PID)
			eventually(t, "the run to be ready", func() bool {
				out, _ := os.ReadFile(runner.LogPath(cfg.LogDir, a.ID))
				return strings.Contains(string(out), c.ready)
			})
			checkpointRun(t, b, a, 1)
			var ck *contracts.Checkpoint
			eventually(t, "a checkpointed fact", func() bool {
				for _, ev := range runs.all() {
					if ev.Kind == contracts.RunCheckpointed && ev.AllocationID == a.ID {
						ck = ev.Checkpoint
						return true
					}
				}
				return false
			})
			if want := filepath.Join(cfg.CheckpointDir, "acme", "trainer", ck.Name); ck.Dir != want || !ck.Requested || ck.Time.IsZero() {
				t.Fatalf("checkpoint %+v, want a requested one in %s", ck, want)
			}
			if fi, err := os.Stat(ck.Dir); err != nil || !fi.IsDir() {
				t.Fatalf("checkpoint directory: %v", err)
			}
			stopRun(t, b, a, time.Second)
			waitEnded(t, runs, a.ID)
			n := 0
			for _, ev := range runs.all() {
				if ev.Kind == contracts.RunCheckpointed && ev.AllocationID == a.ID {
					n++
				}
			}
			if n != 1 {
				t.Fatalf("%d checkpointed facts, want 1", n)
			}

			// The next attempt (a migration) starts from the checkpoint.
			a2 := a
			a2.Attempt, a2.ID = 2, contracts.AllocationID(a.Tenant, a.JobID, 2)
			ledger(t, b, contracts.LedgerCommitted, a2, "")
			killGroupAtEnd(t, waitStarted(t, runs, a2.ID).PID)
			if c.ready == "" {
				// A simulated run's output is in memory only: read what
				// was shipped of it once it ended.
				stopRun(t, b, a2, time.Second)
				waitEnded(t, runs, a2.ID)
				if _, text := shippedLog(t, logs, a2.ID); !strings.Contains(text, c.restored(ck.Name)) {
					t.Fatalf("the next attempt shipped %q, want it restored from %s", text, ck.Name)
				}
			} else {
				eventually(t, "the next attempt to restore", func() bool {
					out, _ := os.ReadFile(runner.LogPath(cfg.LogDir, a2.ID))
					return strings.Contains(string(out), c.restored(ck.Name))
				})
			}
			stopRun(t, b, a2, time.Second)
			waitEnded(t, runs, a2.ID)
		})
	}
}

// TestCheckpointNeedsTheJobsConsent: a job that does not declare
// run.checkpoint is never sent SIGUSR1, which would end it.
func TestCheckpointNeedsTheJobsConsent(t *testing.T) {
	b := connect(t)
	const node = "n-nockpt"
	cfg := testConfig(t, node)
	cfg.CheckpointDir = t.TempDir()
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	startAgent(t, b, cfg)
	a := allocation(node, "plain", contracts.RunSpec{Command: []string{"sh", "-c", "echo up; sleep 1; exit 0"}}, 1)
	ledger(t, b, contracts.LedgerCommitted, a, "")
	waitStarted(t, runs, a.ID)
	eventually(t, "the run to be up", func() bool {
		out, _ := os.ReadFile(runner.LogPath(cfg.LogDir, a.ID))
		return strings.Contains(string(out), "up")
	})
	checkpointRun(t, b, a, 1)
	if e := waitEnded(t, runs, a.ID); e.Result.ExitCode != 0 || e.Result.Outcome != contracts.OutcomeSucceeded {
		t.Fatalf("result %+v: the checkpoint request reached a job that did not ask for it", e.Result)
	}
	for _, ev := range runs.all() {
		if ev.Kind == contracts.RunCheckpointed {
			t.Fatalf("checkpointed fact %+v for a job without run.checkpoint", ev)
		}
	}
}

func TestLargeOutputIsShippedWhole(t *testing.T) {
	b := connect(t)
	const node = "n-logs"
	cfg := testConfig(t, node)
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	logs := record[contracts.LogChunk](t, b, contracts.StreamLogs, contracts.SubjectJobLogs("acme", "chatty"))
	startAgent(t, b, cfg)
	// 10 MB at once: the run writes its file and never waits for the bus.
	a := allocation(node, "chatty", contracts.RunSpec{Command: []string{"sh", "-c",
		"yes 'the quick brown fox jumps over the lazy dog' | head -c 10000000; printf 'bad \\377 byte\\n' >&2"}}, 5)
	ledger(t, b, contracts.LedgerCommitted, a, "")
	if e := waitEnded(t, runs, a.ID); e.Result.Outcome != contracts.OutcomeSucceeded {
		t.Fatalf("result %+v", e.Result)
	}
	cs, text := shippedLog(t, logs, a.ID)
	file, err := os.ReadFile(runner.LogPath(cfg.LogDir, a.ID))
	if err != nil {
		t.Fatal(err)
	}
	want := strings.ToValidUTF8(string(file), "\uFFFD")
	if len(file) != 10000000+len("bad \377 byte\n") || text != want {
		t.Fatalf("shipped %d bytes in %d chunks; the log has %d: they differ", len(text), len(cs), len(file))
	}
}
