package chaos

import (
	"bufio"
	"cmp"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// proc is one binary run as its own OS process: a service replica, a
// nats-server node, redis-server. It follows e2e's child (crash_test.go)
// with what the suite adds: SIGSTOP/SIGCONT, and a supervisor that starts
// again a process that exited on its own, after a second, as systemd or
// Kubernetes would; those exits are counted and shown in the report
// (finding 1 of issue 13: services that give up at start-up).
type proc struct {
	name string
	kind string // the service (scheduler, billing, nats, ...) for the figures
	bin  string
	args []string
	env  []string
	log  *os.File

	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{}
	stopped bool // SIGSTOPped now
	starts  int
	started time.Time // of the current (or last) incarnation
	exits   []string  // exits on its own
	closing bool      // the suite is tearing down: no restarts
}

func (p *proc) logf(format string, args ...any) {
	fmt.Fprintf(p.log, "=== chaos: %s at %s\n", fmt.Sprintf(format, args...), time.Now().Format(time.RFC3339Nano))
}

func (p *proc) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.startLocked()
}

func (p *proc) startLocked() error {
	if p.cmd != nil {
		return fmt.Errorf("%s already running", p.name)
	}
	p.starts++
	p.started = time.Now()
	p.logf("start #%d", p.starts)
	cmd := exec.Command(p.bin, p.args...)
	cmd.Env = p.env
	cmd.Stdout = p.log
	cmd.Stderr = p.log
	// Its own process group: a SIGSTOP of the process is not a SIGSTOP
	// of the test, and nothing it starts outlives a kill of the group.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	done := make(chan struct{})
	p.cmd, p.done, p.stopped = cmd, done, false
	go func() {
		err := cmd.Wait()
		p.mu.Lock()
		own := p.cmd == cmd // not killed by the suite
		if own {
			p.exits = append(p.exits, fmt.Sprintf("%s (start #%d) exited on its own at %s: %v%s",
				p.name, p.starts, time.Now().Format("15:04:05.000"), err, p.lastError()))
			p.cmd = nil
		}
		closing := p.closing
		p.mu.Unlock()
		close(done)
		if own && !closing {
			// Restarted by the supervisor after a second.
			time.Sleep(time.Second)
			p.mu.Lock()
			if p.cmd == nil && !p.closing {
				_ = p.startLocked()
			}
			p.mu.Unlock()
		}
	}()
	return nil
}

// kill sends SIGKILL to the process group and waits until the process
// is reaped; a no-op when it does not run.
func (p *proc) kill() error {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.cmd = nil
	if cmd != nil {
		p.logf("SIGKILL")
	}
	p.mu.Unlock()
	if cmd == nil {
		return nil
	}
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	select {
	case <-done:
		return nil
	case <-time.After(10 * time.Second):
		return fmt.Errorf("%s (pid %d) still not reaped 10s after SIGKILL", p.name, cmd.Process.Pid)
	}
}

// signal sends sig to the process (not its group: a node agent's runs
// are not frozen with it).
func (p *proc) signal(sig syscall.Signal) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return false
	}
	p.logf("%v", sig)
	switch sig {
	case syscall.SIGSTOP:
		p.stopped = true
	case syscall.SIGCONT:
		p.stopped = false
	}
	return p.cmd.Process.Signal(sig) == nil
}

func (p *proc) running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd != nil
}

// shutdown stops the supervisor and the process.
func (p *proc) shutdown() error {
	p.mu.Lock()
	p.closing = true
	if p.cmd != nil && p.stopped {
		_ = p.cmd.Process.Signal(syscall.SIGCONT)
	}
	p.mu.Unlock()
	return p.kill()
}

func (p *proc) unexpectedExits() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.exits...)
}

// tail returns the last n lines of the process's log.
func (p *proc) tail(n int) string {
	f, err := os.Open(p.log.Name())
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > 2*n {
			lines = lines[len(lines)-n:]
		}
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// lastError is the last error line of the log, which says why a service
// exited, cut to 200 characters; empty when there is none.
func (p *proc) lastError() string {
	lines := strings.Split(p.tail(20), "\n")
	for _, l := range slices.Backward(lines) {
		if strings.Contains(l, "level=ERROR") || strings.Contains(l, "[FTL]") {
			if len(l) > 200 {
				l = l[:200]
			}
			return ": " + l
		}
	}
	return ""
}

// newProc makes a proc logging to dir/<name>.log.
func newProc(t *testing.T, dir, name, kind, bin string, args, env []string) *proc {
	t.Helper()
	lf, err := os.OpenFile(filepath.Join(dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	return &proc{name: name, kind: kind, bin: bin, args: args, env: env, log: lf}
}

// build builds the service binaries and nats-server (from the version
// e2e/go.mod pins) into dir, without -race: the suite measures the
// platform, not the race detector.
func build(t *testing.T, dir string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	start := time.Now()
	cmd := exec.CommandContext(ctx, "go", "build", "-o", dir,
		"./services/scheduler/cmd/scheduler",
		"./services/resource-manager/cmd/resource-manager",
		"./services/billing/cmd/billing",
		"./services/monitor/cmd/monitor",
		"./services/autoscaler/cmd/autoscaler",
		"./services/gateway/cmd/gateway",
		"./services/node-agent/cmd/fleet-sim")
	// CHAOS_SRC builds the services from another checkout (a commit
	// exported with git archive): the same suite and seed before and
	// after a fix.
	cmd.Dir = cmp.Or(os.Getenv("CHAOS_SRC"), "../..") // the repository root, from e2e/chaos
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build of the services: %v\n%s", err, out)
	}
	cmd = exec.CommandContext(ctx, "go", "build", "-o", filepath.Join(dir, "nats-server"), "github.com/nats-io/nats-server/v2")
	cmd.Dir = ".." // e2e: its go.mod pins the server
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build of nats-server: %v\n%s", err, out)
	}
	t.Logf("built the services and nats-server in %.1fs", time.Since(start).Seconds())
}
