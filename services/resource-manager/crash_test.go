//go:build unix

package resourcemanager_test

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/service"
	resourcemanager "github.com/gpuplane/gpuplane/services/resource-manager"
)

// childEnv makes the test binary run the resource manager's main instead
// of the tests: a real process that a failpoint can SIGKILL without taking
// the tests with it.
const childEnv = "GPUPLANE_RM_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		runChild()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runChild is cmd/resource-manager's main: flags, GPUPLANE_* environment
// (GPUPLANE_FAILPOINT included), signals.
func runChild() {
	cfg := resourcemanager.DefaultConfig()
	fs := flag.NewFlagSet(resourcemanager.ServiceName, flag.ExitOnError)
	cfg.RegisterFlags(fs)
	_ = fs.Parse(os.Args[1:])
	service.Main(resourcemanager.ServiceName, func(ctx context.Context, log *slog.Logger) error {
		return resourcemanager.Run(ctx, cfg, log)
	})
}

// lockedBuffer collects a child's output.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// child is a resource manager running as a process of its own.
type child struct {
	cmd   *exec.Cmd
	out   *lockedBuffer
	done  chan struct{}
	state *os.ProcessState // set when done is closed
}

// startChild runs the resource manager in a new process on the harness's
// server, with failpoint armed ("" for none). Nodes are never lost during
// the test (an hour without heartbeats).
func (h *harness) startChild(name string, failpoint resourcemanager.Failpoint) *child {
	h.t.Helper()
	exe, err := os.Executable()
	if err != nil {
		h.t.Fatal(err)
	}
	c := &child{out: &lockedBuffer{}, done: make(chan struct{})}
	c.cmd = exec.Command(exe, "-nats", h.srv.URL(), "-creds", natstest.Service(h.t, h.srv, contracts.BusResourceManager), "-name", name, "-heartbeat-timeout", "1h", "-liveness-interval", "100ms")
	c.cmd.Env = append(os.Environ(), childEnv+"=1", resourcemanager.EnvFailpoint+"="+string(failpoint), "GPUPLANE_LOG_LEVEL=debug")
	c.cmd.Stdout, c.cmd.Stderr = c.out, c.out
	if err := c.cmd.Start(); err != nil {
		h.t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		_ = c.cmd.Wait()
		c.state = c.cmd.ProcessState
		close(c.done)
	}()
	h.t.Cleanup(func() {
		_ = c.cmd.Process.Kill()
		<-c.done
		if h.t.Failed() || os.Getenv("RM_TEST_LOG") != "" {
			h.t.Logf("%s output:\n%s", name, c.out.String())
		}
	})
	return c
}

// wait waits, bounded, for the child to exit.
func (c *child) wait(t *testing.T, what string) *os.ProcessState {
	t.Helper()
	select {
	case <-c.done:
		return c.state
	case <-time.After(60 * time.Second):
		t.Fatalf("%s: still running after 60 s", what)
		return nil
	}
}

// crashPlan is one plan of 20 items over four nodes of four GPUs. On each
// node, items are verified in plan order, so the answers do not depend on
// how many lives the resource manager needed: the first item to ask for a
// GPU gets it, later ones are refused device_taken.
func crashPlan() ([]contracts.Allocation, map[string]contracts.Reason) {
	shapes := []struct {
		gpus []int
		want contracts.Reason
	}{
		{[]int{0}, ""},
		{[]int{1, 2}, ""},
		{[]int{2}, contracts.RefusedDeviceTaken},
		{[]int{3}, ""},
		{[]int{0, 3}, contracts.RefusedDeviceTaken},
	}
	var items []contracts.Allocation
	want := map[string]contracts.Reason{}
	for _, node := range []string{"n0", "n1", "n2", "n3"} {
		for k, s := range shapes {
			a := item(fmt.Sprintf("%s-j%d", node, k), 1, node, h100, s.gpus...)
			items = append(items, a)
			want[a.ID] = s.want
		}
	}
	return items, want
}

// TestKilledBetweenVerifyAndCommit is the crash drill the resource manager
// exists to pass. A resource manager, a real process, is SIGKILLed by a
// failpoint in the middle of a plan: right after verifying an item, before
// its committed entry is published (rm-after-verify), or right after it is
// published, before the plan is acknowledged (rm-after-commit). A new
// process (no failpoint) rebuilds from the streams and gets the plan
// again. Every item must end answered exactly once (committed once, or
// refused, never both), with the answers a crash-free run gives; the plan
// acknowledged; and the ledger, replayed by an independent reader, must
// never hold a device twice.
func TestKilledBetweenVerifyAndCommit(t *testing.T) {
	for _, fp := range resourcemanager.Failpoints {
		t.Run(string(fp), func(t *testing.T) {
			h := newHarness(t)
			for _, n := range []string{"n0", "n1", "n2", "n3"} {
				h.inventory(n, "i1", 4, h100)
			}
			first := h.startChild("rm-first", fp)
			for _, n := range []string{"n0", "n1", "n2", "n3"} {
				h.eventually("registered "+n, func() bool { return h.hasNodeEvent(n, contracts.NodeRegistered, "i1") })
			}
			items, want := crashPlan()
			h.plan("crash", items...)

			st := first.wait(t, "resource manager with failpoint "+string(fp))
			ws, ok := st.Sys().(syscall.WaitStatus)
			if !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
				t.Fatalf("first resource manager ended with %v; want killed by SIGKILL", st)
			}
			if !strings.Contains(first.out.String(), "failpoint reached") {
				t.Fatalf("first resource manager died without reaching its failpoint")
			}
			// What the dead process left: nothing acknowledged, and for
			// rm-after-commit at least the entry it died after.
			_, before := checkLedger(t, h.srv.URL(), natstest.Operator(t, h.srv))
			if fp == resourcemanager.FailAfterCommit && before.committed == 0 {
				t.Errorf("killed after a commit, yet the ledger holds no commit")
			}
			if before.committed == 3*4 {
				t.Errorf("every commit was stored before the kill: the failpoint fired too late to test anything")
			}
			t.Logf("at the kill: %d of %d items committed", before.committed, len(items))

			second := h.startChild("rm-second", "")
			deadline := time.Now().Add(45 * time.Second) // a redelivery waits out the dead consumer's AckWait
			for {
				var answered int
				h.locked(func() {
					for _, a := range items {
						if _, refused := h.refusal("crash", a.ID); refused || h.has(a.ID, contracts.LedgerCommitted) {
							answered++
						}
					}
				})
				if answered == len(items) && planAcked(t, h) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("after the restart: %d of %d items answered (plan acknowledged: %v)", answered, len(items), planAcked(t, h))
				}
				time.Sleep(20 * time.Millisecond)
			}

			got := map[string]contracts.Reason{}
			h.locked(func() {
				for _, a := range items {
					r, refused := h.refusal("crash", a.ID)
					commits := len(h.entriesFor(a.ID, contracts.LedgerCommitted))
					switch {
					case refused && commits > 0:
						t.Errorf("%s both committed and refused (%s)", a.ID, r.Reason)
					case commits > 1:
						t.Errorf("%s committed %d times", a.ID, commits)
					}
					got[a.ID] = r.Reason
				}
			})
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("answers (-crash-free +after the crash):\n%s", diff)
			}
			violations, after := checkLedger(t, h.srv.URL(), natstest.Operator(t, h.srv))
			for _, v := range violations {
				t.Error(v)
			}
			if after.committed != 3*4 || after.released != 0 {
				t.Errorf("ledger holds %d commits and %d releases; want 12 and 0", after.committed, after.released)
			}

			if err := second.cmd.Process.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			if st := second.wait(t, "resource manager after SIGTERM"); !st.Success() {
				t.Errorf("second resource manager exited with %v on SIGTERM; want 0", st)
			}
		})
	}
}

// planAcked reports whether the plans consumer has nothing pending: every
// plan delivered and acknowledged, none waiting for redelivery.
func planAcked(t *testing.T, h *harness) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	cons, err := h.bus.JetStream().Consumer(ctx, contracts.StreamPlans, resourcemanager.PlansDurable)
	if err != nil {
		return false
	}
	info, err := cons.Info(ctx)
	if err != nil {
		return false
	}
	return info.NumAckPending == 0 && info.NumPending == 0 && info.NumRedelivered == 0
}
