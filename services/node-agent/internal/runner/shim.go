package runner

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"syscall"
	"time"
)

// The shim is the agent's own binary started again in shim mode: the
// agent sets ShimEnv to the run's state directory and passes the flag
// shimFlag, which makes any program that does not call MaybeRunShim fail
// its flag parsing and exit at once (a test binary without a TestMain that
// calls it runs no tests), so a forgotten call is a launch error, never a
// second agent.
const (
	ShimEnv  = "GPUPLANE_RUNNER_SHIM"
	shimFlag = "-gpuplane-runner-shim"
)

// The descriptors the shim inherits, in exec.Cmd.ExtraFiles order.
const (
	fdLock  = 3 // the run's lock file, flock-ed by the agent before the fork
	fdLog   = 4 // the run's log file
	fdReady = 5 // the write end of a pipe: one shimReady, then closed
)

// shimReady is the shim's answer to the agent that started it: the
// command's pid, or how it failed to start.
type shimReady struct {
	PID  int      `json:"pid,omitempty"`
	Exit *runExit `json:"exit,omitempty"`
}

// MaybeRunShim turns the process into a run's shim when the agent started
// it as one, and never returns then; otherwise it returns at once. Every
// program that runs the node agent calls it first thing in main (test
// binaries that launch commands in TestMain), before any other work.
func MaybeRunShim() {
	dir, ok := os.LookupEnv(ShimEnv)
	if !ok {
		return
	}
	os.Exit(runShim(dir))
}

// runShim supervises one command: it starts it in its own process group,
// records its pids, relays the agent's signals to the group, enforces the
// time limit and the stop grace itself (so both hold while no agent
// runs), and records the exit code before it exits. Its exit status only
// says whether it could do that.
func runShim(dir string) int {
	// The command gets Pdeathsig, which Linux fires when the thread that
	// forked it exits: this goroutine keeps its thread for the shim's life.
	runtime.LockOSThread()
	logf := func(format string, args ...any) {
		fmt.Fprintf(os.Stderr, "%s gpuplane-shim %d: %s\n", time.Now().UTC().Format(time.RFC3339Nano), os.Getpid(), fmt.Sprintf(format, args...))
	}
	for _, fd := range []int{fdLock, fdLog, fdReady} {
		syscall.CloseOnExec(fd) // the command inherits none of them
	}
	// Before anything else: a stop that comes while starting is kept.
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGUSR1, syscall.SIGUSR2)
	signal.Ignore(syscall.SIGHUP)
	ready := os.NewFile(fdReady, "ready")
	logFile := os.NewFile(fdLog, "log")

	var spec runSpec
	if ok, err := readJSON(filepath.Join(dir, specFile), &spec); !ok || err != nil || len(spec.Argv) == 0 {
		logf("no usable run spec in %s: %v", dir, err)
		return 2
	}
	self := runState{ShimPID: os.Getpid(), ShimStart: procStart(os.Getpid())}
	if err := writeJSON(filepath.Join(dir, stateFile), self); err != nil {
		logf("record state: %v", err)
		return 2
	}

	cmd := exec.Command(spec.Argv[0], spec.Argv[1:]...)
	cmd.Env = spec.Env
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = commandAttr()
	if err := cmd.Start(); err != nil {
		e := launchFailure(err)
		if werr := writeJSON(filepath.Join(dir, exitFile), e); werr != nil {
			logf("record launch failure: %v", werr)
		}
		_ = json.NewEncoder(ready).Encode(shimReady{Exit: &e})
		return 0
	}
	_ = logFile.Close() // the command has its own copy
	pid := cmd.Process.Pid
	st := self
	st.PID, st.PIDStart, st.StartedAt = pid, procStart(pid), time.Now()
	if err := writeJSON(filepath.Join(dir, stateFile), st); err != nil {
		// Without its pids on disk no later agent could reach the run.
		logf("record state: %v; killing the command", err)
		_ = syscall.Kill(-pid, syscall.SIGKILL)
		_ = cmd.Wait()
		e := runExit{Code: -1, EndedAt: time.Now(), LaunchError: "record the run's state: " + err.Error()}
		_ = writeJSON(filepath.Join(dir, exitFile), e)
		_ = json.NewEncoder(ready).Encode(shimReady{Exit: &e})
		return 0
	}
	waited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(waited) }()
	if c := spec.Container; c != nil && !containerCreated(c, waited) {
		// runc gave up before the container existed (a command the image
		// lacks, a mount it cannot make): the run never started.
		killGroup(pid, st.PIDStart, syscall.SIGKILL)
		if err := removeContainer(c); err != nil {
			logf("clean up container %s: %v", c.ID, err)
		}
		e := neverStarted(c, spec.LogPath, runExit{Code: exitCode(cmd.ProcessState), EndedAt: time.Now()})
		if e.LaunchError == "" {
			e = runExit{Code: -1, EndedAt: e.EndedAt, LaunchError: "runc ended before the container started: " + lastLine(spec.LogPath)}
		}
		if err := writeJSON(filepath.Join(dir, exitFile), e); err != nil {
			logf("record launch failure: %v", err)
		}
		_ = json.NewEncoder(ready).Encode(shimReady{Exit: &e})
		return 0
	}
	_ = json.NewEncoder(ready).Encode(shimReady{PID: pid})
	_ = ready.Close()
	var limit, kill <-chan time.Time
	if d := spec.Launch.Spec.Duration.D(); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		limit = t.C
	}
	// A host command is signalled as a process group; a container through
	// runc (its first process; all of its processes for SIGKILL), since
	// its processes are not in runc's group and runc must see them end to
	// clean up after them.
	terminate, killAll, relay := func() { killGroup(pid, st.PIDStart, syscall.SIGTERM) },
		func() { killGroup(pid, st.PIDStart, syscall.SIGKILL) },
		func(sig syscall.Signal) { signalLeader(pid, st.PIDStart, sig) }
	if c := spec.Container; c != nil {
		terminate = func() { signalContainer(c, pid, st.PIDStart, syscall.SIGTERM, false) }
		killAll = func() { signalContainer(c, pid, st.PIDStart, syscall.SIGKILL, true) }
		relay = func(sig syscall.Signal) { signalContainer(c, pid, st.PIDStart, sig, false) }
	}
	var stopping, stopped, timedOut bool
	stop := func(grace time.Duration) {
		if stopping {
			return // the first stop's grace holds
		}
		stopping = true
		if grace <= 0 {
			killAll()
			return
		}
		terminate()
		kill = time.After(grace)
	}
	for running := true; running; {
		select {
		case s := <-sigs:
			switch s {
			case syscall.SIGTERM, syscall.SIGINT:
				stopped = true
				grace := spec.Launch.StopGrace
				var rs runStop
				if ok, err := readJSON(filepath.Join(dir, stopFile), &rs); ok && err == nil {
					grace = rs.Grace
				}
				stop(grace)
			default:
				// SIGUSR1 (checkpoint) goes to the command itself, not its
				// group: helpers it forked (a sleep, data-loader workers)
				// would die of a signal they do not handle.
				relay(s.(syscall.Signal))
			}
		case <-limit:
			if !stopping {
				timedOut = true
				stop(spec.Launch.StopGrace)
			}
		case <-kill:
			killAll()
		case <-waited:
			running = false
		}
	}
	// Whatever the leader left behind in its group goes with it.
	killGroup(pid, st.PIDStart, syscall.SIGKILL)
	if c := spec.Container; c != nil {
		if err := removeContainer(c); err != nil {
			logf("clean up container %s: %v", c.ID, err)
		}
	}
	e := runExit{Code: exitCode(cmd.ProcessState), Stopped: stopped, TimedOut: timedOut, EndedAt: time.Now()}
	if c := spec.Container; c != nil {
		e = neverStarted(c, spec.LogPath, e)
	}
	if err := writeJSON(filepath.Join(dir, exitFile), e); err != nil {
		logf("record exit code %d: %v", e.Code, err)
		return 1
	}
	return 0
}

// launchFailure records why a command could not start, keeping the cause
// checkable (exec.ErrNotFound, fs.ErrNotExist, fs.ErrPermission).
func launchFailure(err error) runExit {
	e := runExit{Code: -1, EndedAt: time.Now(), LaunchError: err.Error(), NotFound: errors.Is(err, exec.ErrNotFound)}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		e.Errno = int(errno)
	}
	return e
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
