package runner

import (
	"errors"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"
)

// execProc is a command run in its own process group, so a stop reaches
// every process it forked.
type execProc struct {
	cmd  *exec.Cmd
	pgid int
	done chan struct{}
	exit Exit

	mu       sync.Mutex
	stopping bool // a SIGTERM was sent
	stopped  bool // Stop was called before the end
	timedOut bool
	limit    *time.Timer
}

func startExec(l Launch, logFile *os.File) (*execProc, error) {
	argv := l.Spec.Command
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = Env(l)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &execProc{cmd: cmd, pgid: cmd.Process.Pid, done: make(chan struct{})}
	if d := l.Spec.Duration.D(); d > 0 {
		p.limit = time.AfterFunc(d, func() {
			p.mu.Lock()
			p.timedOut = true
			p.mu.Unlock()
			p.terminate(l.StopGrace)
		})
	}
	go func() {
		defer close(p.done)
		err := cmd.Wait()
		_ = logFile.Close()
		if p.limit != nil {
			p.limit.Stop()
		}
		// Whatever the leader left behind in its group goes with it.
		_ = syscall.Kill(-p.pgid, syscall.SIGKILL)
		p.mu.Lock()
		defer p.mu.Unlock()
		p.exit = Exit{Code: exitCode(cmd.ProcessState), Stopped: p.stopped, TimedOut: p.timedOut}
		var exitErr *exec.ExitError
		if err != nil && !errors.As(err, &exitErr) {
			p.exit.Err = err
		}
	}()
	return p, nil
}

func (p *execProc) Wait() Exit {
	<-p.done
	return p.exit
}

func (p *execProc) Done() <-chan struct{} { return p.done }

func (p *execProc) Stop(grace time.Duration) {
	select {
	case <-p.done:
		return
	default:
	}
	p.mu.Lock()
	p.stopped = true
	p.mu.Unlock()
	p.terminate(grace)
}

// terminate sends SIGTERM to the group once, and SIGKILL after grace.
func (p *execProc) terminate(grace time.Duration) {
	p.mu.Lock()
	first := !p.stopping
	p.stopping = true
	p.mu.Unlock()
	if !first {
		return
	}
	if grace <= 0 {
		_ = syscall.Kill(-p.pgid, syscall.SIGKILL)
		return
	}
	_ = syscall.Kill(-p.pgid, syscall.SIGTERM)
	go func() {
		t := time.NewTimer(grace)
		defer t.Stop()
		select {
		case <-p.done:
		case <-t.C:
			_ = syscall.Kill(-p.pgid, syscall.SIGKILL)
		}
	}()
}

// exitCode is the shell's view of how a process ended.
func exitCode(ps *os.ProcessState) int {
	if ps == nil {
		return -1
	}
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return ps.ExitCode()
}
