package runner

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci"
)

const (
	// shimStartTimeout bounds how long Launch waits for the shim's answer.
	shimStartTimeout = 10 * time.Second
	// pollInterval is how often an adopted run's shim is checked.
	pollInterval = 250 * time.Millisecond
	// killBackup is how long after the grace the agent kills a group
	// itself, should the shim not have done it.
	killBackup = 2 * time.Second
)

// shimProc is a command run under a shim: started by this agent (own) or
// by a previous one (adopted).
type shimProc struct {
	dir    string
	spec   runSpec
	state  runState
	done   chan struct{}
	exit   Exit
	mu     sync.Mutex
	asked  bool // Stop was called
	closer sync.Once
}

func (r *Local) stateDir() string { return filepath.Join(r.LogDir, "state") }
func (r *Local) runDir(allocationID string) string {
	return filepath.Join(r.stateDir(), fileKey(allocationID))
}

// startShim starts a run under a new shim and waits for the shim to say
// it started (or why not). prepare fills the run's state directory and
// says what the shim runs; its undo (may be nil) cleans up what it made
// when the shim never starts.
func (r *Local) startShim(l Launch, logPath string, prepare func(dir string) (runSpec, func(), error)) (Process, error) {
	dir := r.runDir(l.AllocationID)
	if err := os.MkdirAll(r.stateDir(), 0o755); err != nil {
		return nil, fmt.Errorf("%w: state dir: %w", ErrLaunch, err)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("%s: %w", l.AllocationID, ErrAlreadyLaunched)
		}
		return nil, fmt.Errorf("%w: state dir: %w", ErrLaunch, err)
	}
	spec, undo, err := prepare(dir)
	var p *shimProc
	if err == nil {
		p, err = r.spawn(dir, spec)
		if err != nil && undo != nil {
			undo()
		}
	}
	if err != nil {
		// Nothing runs: record why, so the directory tells the truth
		// until the agent has reported it and forgets it.
		e := runExit{Code: -1, EndedAt: time.Now(), LaunchError: err.Error()}
		var le *launchError
		if errors.As(err, &le) {
			e = le.exit
		}
		_ = writeJSON(filepath.Join(dir, exitFile), e)
		return nil, fmt.Errorf("%w: %w", ErrLaunch, err)
	}
	return p, nil
}

// hostCommand is the runSpec of l's command run on the host.
func hostCommand(l Launch, logPath string) func(string) (runSpec, func(), error) {
	return func(string) (runSpec, func(), error) {
		return runSpec{Launch: l, Argv: mpsShmArgv(l.Spec.Argv(), l.MPSShmDir), Env: Env(l), LogPath: logPath}, nil, nil
	}
}

// launchError is a command the shim could not start.
type launchError struct{ exit runExit }

func (e *launchError) Error() string { return e.exit.launchErr().Error() }
func (e *launchError) Unwrap() error { return e.exit.launchErr() }

// spawn writes the spec, starts the shim with the run's lock held (the
// shim inherits the lock, so it is never free while the shim lives) and
// reads its answer.
func (r *Local) spawn(dir string, spec runSpec) (*shimProc, error) {
	if err := writeJSON(filepath.Join(dir, specFile), spec); err != nil {
		return nil, fmt.Errorf("write run spec: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, lockFile), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return nil, fmt.Errorf("lock %s: %w", lock.Name(), err)
	}
	logFile, err := os.OpenFile(spec.LogPath, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, fmt.Errorf("log file: %w", err)
	}
	defer logFile.Close()
	shimOut, err := os.OpenFile(filepath.Join(dir, shimLog), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer shimOut.Close()
	readyR, readyW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer readyR.Close()
	cmd := &exec.Cmd{
		Path:       cmp.Or(r.shimProgram, shimExecutable()),
		Args:       []string{"gpuplane-shim", shimFlag},
		Env:        shimEnviron(dir),
		Stdout:     shimOut,
		Stderr:     shimOut,
		ExtraFiles: []*os.File{lock, logFile, readyW}, // fds 3, 4, 5
		// Its own session: signals to the agent's process group (a
		// terminal's Ctrl-C) never reach it, and it outlives the agent.
		SysProcAttr: &syscall.SysProcAttr{Setsid: true},
	}
	err = cmd.Start()
	_ = readyW.Close()
	if err != nil {
		return nil, fmt.Errorf("start the run's shim: %w", err)
	}
	reaped := make(chan struct{})
	go func() { _ = cmd.Wait(); close(reaped) }() // reap it, whenever it ends

	_ = readyR.SetReadDeadline(time.Now().Add(shimStartTimeout))
	var ready shimReady
	if err := json.NewDecoder(readyR).Decode(&ready); err != nil || (ready.PID == 0 && ready.Exit == nil) {
		// No answer: the program did not turn into a shim, or hangs.
		_ = cmd.Process.Kill()
		<-reaped
		var st runState
		if ok, _ := readJSON(filepath.Join(dir, stateFile), &st); ok && st.PID > 0 {
			killGroup(st.PID, st.PIDStart, syscall.SIGKILL)
		}
		return nil, fmt.Errorf("the run's shim did not start (%v): %s; does the program call MaybeRunShim first thing in main?",
			err, tail(filepath.Join(dir, shimLog)))
	}
	if ready.Exit != nil {
		<-reaped
		return nil, &launchError{exit: *ready.Exit}
	}
	p := &shimProc{dir: dir, spec: spec, done: make(chan struct{})}
	if _, err := readJSON(filepath.Join(dir, stateFile), &p.state); err != nil || p.state.PID != ready.PID {
		// The shim wrote its state before answering: this cannot happen
		// unless someone else writes the directory.
		p.state = runState{ShimPID: cmd.Process.Pid, PID: ready.PID}
	}
	go func() { <-reaped; p.finish() }()
	return p, nil
}

// shimExecutable is this program: /proc/self/exe still starts it when the
// file was replaced on disk (an upgrade) since the agent started.
func shimExecutable() string {
	if _, err := os.Stat("/proc/self/exe"); err == nil {
		return "/proc/self/exe"
	}
	exe, _ := os.Executable()
	return exe
}

// shimEnviron is what the shim needs of the agent's environment, no more:
// the command gets its own (Env).
func shimEnviron(dir string) []string {
	env := []string{ShimEnv + "=" + dir}
	for _, k := range []string{"PATH", "HOME", "TMPDIR", "GOTRACEBACK", "GOCOVERDIR"} {
		if v, ok := os.LookupEnv(k); ok {
			env = append(env, k+"="+v)
		}
	}
	// A binary built with -race sleeps 1 s at exit by default, which would
	// delay every run's end by as much; other binaries ignore GORACE.
	race := os.Getenv("GORACE")
	if !strings.Contains(race, "atexit_sleep_ms") {
		race = strings.TrimSpace(race + " atexit_sleep_ms=0")
	}
	return append(env, "GORACE="+race)
}

// tail is the end of a small file, for error messages.
func tail(path string) string {
	b, _ := os.ReadFile(path)
	s := strings.TrimSpace(string(b))
	if len(s) > 500 {
		s = "..." + s[len(s)-500:]
	}
	if s == "" {
		return "no output"
	}
	return s
}

// poll watches an adopted shim, which is not this process's child: the run
// has ended when its exit file exists, or when its lock is free (the shim
// died without writing one).
func (p *shimProc) poll() {
	t := time.NewTicker(pollInterval)
	defer t.Stop()
	for range t.C {
		if _, err := os.Stat(filepath.Join(p.dir, exitFile)); err == nil {
			p.finish()
			return
		}
		if alive, err := shimAlive(p.dir); err == nil && !alive {
			p.finish()
			return
		}
	}
}

// finish reads how the run ended, once the shim is gone. A shim that died
// without recording the end (SIGKILL) leaves the command killed by
// Pdeathsig, but not what the command forked: its group is killed here.
func (p *shimProc) finish() {
	p.closer.Do(func() {
		var e runExit
		ok, err := readJSON(filepath.Join(p.dir, exitFile), &e)
		p.mu.Lock()
		defer p.mu.Unlock()
		switch {
		case ok:
			p.exit = e.exit()
		default:
			killGroup(p.state.PID, p.state.PIDStart, syscall.SIGKILL)
			if c := p.spec.Container; c != nil {
				// runc died with its shim; the container did not.
				_ = removeContainer(c)
			}
			p.exit = Exit{Code: -1, Err: ErrLost}
			if err != nil {
				p.exit.Err = fmt.Errorf("%w: %w", ErrLost, err)
			}
		}
		p.exit.Stopped = p.exit.Stopped || p.asked
		close(p.done)
	})
}

func (p *shimProc) Wait() Exit {
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exit
}

func (p *shimProc) Done() <-chan struct{} { return p.done }

// Stop writes the grace where the shim reads it and SIGTERMs the shim,
// which relays SIGTERM to the group and SIGKILLs it once grace has passed,
// with or without an agent. Should the shim not do it, the agent kills the
// group a little later itself.
func (p *shimProc) Stop(grace time.Duration) {
	p.mu.Lock()
	first := !p.asked
	p.asked = true
	p.mu.Unlock()
	if !first {
		return
	}
	select {
	case <-p.done:
		return
	default:
	}
	_ = writeJSON(filepath.Join(p.dir, stopFile), runStop{Grace: grace})
	if sameProcess(p.state.ShimPID, p.state.ShimStart) {
		_ = syscall.Kill(p.state.ShimPID, syscall.SIGTERM)
	}
	go func() {
		t := time.NewTimer(max(grace, 0) + killBackup)
		defer t.Stop()
		select {
		case <-p.done:
		case <-t.C:
			if c := p.spec.Container; c != nil {
				signalContainer(c, p.state.PID, p.state.PIDStart, syscall.SIGKILL, true)
			}
			killGroup(p.state.PID, p.state.PIDStart, syscall.SIGKILL)
		}
	}()
}

// Checkpoint sends SIGUSR1 to the shim, which relays it to the group.
func (p *shimProc) Checkpoint() error {
	select {
	case <-p.done:
		return ErrEnded
	default:
	}
	if !sameProcess(p.state.ShimPID, p.state.ShimStart) {
		return ErrEnded
	}
	if err := syscall.Kill(p.state.ShimPID, syscall.SIGUSR1); err != nil {
		return fmt.Errorf("signal the run's shim: %w", err)
	}
	return nil
}

func (p *shimProc) Info() Info {
	i := Info{PID: p.state.PID, StartedAt: p.state.StartedAt, LogPath: p.spec.LogPath, CheckpointDir: p.spec.Launch.CheckpointDir}
	if p.spec.Launch.RestoreFrom != "" {
		i.RestoredFrom = filepath.Base(p.spec.Launch.RestoreFrom)
	}
	return i
}

// Recover returns every run a previous agent launched here and has not
// forgotten: running ones adopted, ended ones with how they ended. A
// directory that holds no spec (the agent died before writing it, so no
// shim ever started) is removed.
func (r *Local) Recover() ([]Leftover, error) {
	entries, err := os.ReadDir(r.stateDir())
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read run state: %w", err)
	}
	var out []Leftover
	var errs []error
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		l, err := r.adopt(filepath.Join(r.stateDir(), e.Name()))
		switch {
		case errors.Is(err, ErrNoRun):
		case err != nil:
			errs = append(errs, err)
		default:
			out = append(out, l)
		}
	}
	return out, errors.Join(errs...)
}

// Adopt returns the run launched for allocationID: running (adopted) or
// ended. It returns ErrNoRun when none was launched.
func (r *Local) Adopt(allocationID string) (Leftover, error) {
	return r.adopt(r.runDir(allocationID))
}

func (r *Local) adopt(dir string) (Leftover, error) {
	var spec runSpec
	ok, err := readJSON(filepath.Join(dir, specFile), &spec)
	if err != nil {
		return Leftover{}, fmt.Errorf("run state %s: %w", dir, err)
	}
	if !ok {
		if _, err := os.Stat(dir); err == nil {
			_ = os.RemoveAll(dir) // no spec: no shim ever ran for it
		}
		return Leftover{}, ErrNoRun
	}
	p := &shimProc{dir: dir, spec: spec, done: make(chan struct{})}
	readState := func() { _, _ = readJSON(filepath.Join(dir, stateFile), &p.state) }
	readState()
	alive, err := shimAlive(dir)
	if err != nil {
		return Leftover{}, err
	}
	if alive && p.state.PID == 0 {
		// The shim is starting the command: give it a moment.
		for deadline := time.Now().Add(shimStartTimeout); p.state.PID == 0 && time.Now().Before(deadline); {
			time.Sleep(50 * time.Millisecond)
			readState()
			if alive, _ = shimAlive(dir); !alive {
				break
			}
		}
		if alive && p.state.PID == 0 && sameProcess(p.state.ShimPID, p.state.ShimStart) {
			_ = syscall.Kill(p.state.ShimPID, syscall.SIGKILL) // hung: its command (if any) dies with it
		}
	}
	if _, err := os.Stat(filepath.Join(dir, exitFile)); err == nil || !alive || p.state.PID == 0 {
		if _, err := os.Stat(filepath.Join(dir, exitFile)); err != nil && p.state.PID == 0 {
			// The command never started and nothing recorded why.
			e := runExit{Code: -1, EndedAt: time.Now(), LaunchError: "the run's shim ended before starting the command"}
			_ = writeJSON(filepath.Join(dir, exitFile), e)
		}
		p.finish()
	} else {
		go p.poll()
	}
	return Leftover{Launch: spec.Launch, Proc: p}, nil
}

// Forget removes the state of allocationID's run, once its end has been
// reported; a run still running is never forgotten. The log stays.
func (r *Local) Forget(allocationID string) error {
	dir := r.runDir(allocationID)
	if alive, err := shimAlive(dir); err != nil || alive {
		return errors.Join(fmt.Errorf("run %s is still running", allocationID), err)
	}
	// A container's bundle may still hold its overlay mount (its shim was
	// killed): removing through it would reach the image.
	if err := oci.RemoveBundle(filepath.Join(dir, bundleDir)); err != nil {
		return fmt.Errorf("forget run %s: %w", allocationID, err)
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("forget run %s: %w", allocationID, err)
	}
	return nil
}
