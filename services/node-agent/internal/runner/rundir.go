package runner

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// The files of a run's state directory (see the package comment).
const (
	specFile  = "spec.json"
	lockFile  = "lock"
	stateFile = "state.json"
	stopFile  = "stop.json"
	exitFile  = "exit.json"
	shimLog   = "shim.log"
)

// runSpec is what the shim runs; the agent writes it before starting the
// shim.
type runSpec struct {
	Launch  Launch   `json:"launch"`
	Argv    []string `json:"argv"`
	Env     []string `json:"env"`
	LogPath string   `json:"logPath"`
	// Container is set when Argv is `runc run` of the run's container.
	Container *containerRun `json:"container,omitempty"`
}

// runState is what the shim records once the command started. Start times
// are in clock ticks since boot (/proc/<pid>/stat field 22): a pid with
// another start time is another process, so a reused pid is never
// signalled.
type runState struct {
	ShimPID   int       `json:"shimPid"`
	ShimStart uint64    `json:"shimStart"`
	PID       int       `json:"pid"` // the command, leader of its process group
	PIDStart  uint64    `json:"pidStart"`
	StartedAt time.Time `json:"startedAt"`
}

// runStop is a stop the agent asked for.
type runStop struct {
	Grace time.Duration `json:"grace"`
}

// runExit is how the command ended, or why it never started.
type runExit struct {
	Code     int       `json:"code"`
	Stopped  bool      `json:"stopped,omitempty"`
	TimedOut bool      `json:"timedOut,omitempty"`
	EndedAt  time.Time `json:"endedAt"`
	// LaunchError is set when the command never started; Errno and
	// NotFound keep its cause checkable with errors.Is.
	LaunchError string `json:"launchError,omitempty"`
	Errno       int    `json:"errno,omitempty"`
	NotFound    bool   `json:"notFound,omitempty"`
}

func (e runExit) exit() Exit {
	x := Exit{Code: e.Code, Stopped: e.Stopped, TimedOut: e.TimedOut, EndedAt: e.EndedAt}
	if e.LaunchError != "" {
		x.Err = fmt.Errorf("%w: %w", ErrLaunch, e.launchErr())
	}
	return x
}

// launchErr rebuilds a start failure the shim recorded.
func (e runExit) launchErr() error {
	switch {
	case e.NotFound:
		return fmt.Errorf("%s: %w", e.LaunchError, exec.ErrNotFound)
	case e.Errno != 0:
		return fmt.Errorf("%s: %w", e.LaunchError, syscall.Errno(e.Errno))
	}
	return errors.New(e.LaunchError)
}

// writeJSON writes v to path atomically: a reader sees the old file or the
// whole new one, never a part.
func writeJSON(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return writeAtomic(path, b)
}

func writeAtomic(path string, b []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // a no-op once renamed
	if _, err := tmp.Write(b); err != nil {
		_ = tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// readJSON reads path into v; ok is false when the file does not exist.
func readJSON(path string, v any) (ok bool, err error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return false, fmt.Errorf("%s: %w", path, err)
	}
	return true, nil
}

// shimAlive reports whether the shim of dir holds its lock. It never
// blocks: the lock is tried, and released at once when it was free.
func shimAlive(dir string) (bool, error) {
	f, err := os.OpenFile(filepath.Join(dir, lockFile), os.O_RDWR, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer f.Close()
	err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	if errors.Is(err, syscall.EWOULDBLOCK) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("lock %s: %w", f.Name(), err)
	}
	_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	return false, nil
}

// procStart is the start time of pid in clock ticks since boot, 0 when
// the process does not exist (or /proc cannot tell).
func procStart(pid int) uint64 {
	if pid <= 0 {
		return 0
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	// The command name (field 2) may hold spaces and parentheses: the
	// fields that follow start after its last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0
	}
	fields := strings.Fields(s[i+1:])
	// fields[0] is field 3 (state); starttime is field 22.
	if len(fields) < 20 {
		return 0
	}
	v, _ := strconv.ParseUint(fields[19], 10, 64)
	return v
}

// sameProcess reports whether pid is still the process that had start
// time start. With start unknown (0) it trusts the pid.
func sameProcess(pid int, start uint64) bool {
	if pid <= 0 {
		return false
	}
	now := procStart(pid)
	if start == 0 {
		return syscall.Kill(pid, 0) == nil
	}
	return now == start
}

// killGroup sends sig to the process group led by pid, unless pid is now
// another process: the group of a leader that has exited is still ours
// (Linux never reuses a pid that is still a process group ID), but a
// leader pid with another start time is a reused pid.
// signalLeader sends sig to the process pid only, unless pid was reused.
func signalLeader(pid int, start uint64, sig syscall.Signal) {
	if pid <= 1 {
		return
	}
	if now := procStart(pid); now != 0 && start != 0 && now != start {
		return
	}
	_ = syscall.Kill(pid, sig)
}

func killGroup(pid int, start uint64, sig syscall.Signal) {
	if pid <= 1 {
		return
	}
	if now := procStart(pid); now != 0 && start != 0 && now != start {
		return
	}
	_ = syscall.Kill(-pid, sig)
}
