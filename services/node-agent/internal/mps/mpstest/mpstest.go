// Package mpstest provides a stand-in for nvidia-cuda-mps-control, so the
// agent's MPS supervision runs on machines without NVIDIA's driver.
package mpstest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// script behaves like nvidia-cuda-mps-control as far as the agent uses
// it: "-d" starts a daemon that keeps its pid file and a control FIFO in
// $CUDA_MPS_PIPE_DIRECTORY and logs to $CUDA_MPS_LOG_DIRECTORY/control.log;
// without arguments it sends its stdin's commands to the daemon ("quit"
// stops it). The daemon keeps a file "nvidia-cuda-mps-control-<pid>" in
// its /dev/shm, as a real one keeps its shared memory. Next to it, a file "fail" makes -d fail, a file "deaf" makes
// the daemons ignore quit, and every -d
// appends a line to "attempts", every daemon its pid to "starts".
const script = `#!/bin/sh
here=$(dirname "$0")
pipe=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
logs=${CUDA_MPS_LOG_DIRECTORY:-/var/log/nvidia-mps}
pidf=$pipe/nvidia-cuda-mps-control.pid
running() { [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; }
case "$1" in
-d)
	echo "$CUDA_VISIBLE_DEVICES" >>"$here/attempts"
	if [ -e "$here/fail" ]; then echo "stand-in told to fail" >&2; exit 1; fi
	if running; then echo "An instance of this daemon is already running" >&2; exit 1; fi
	mkdir -p "$pipe" "$logs" || exit 1
	rm -f "$pipe/control"; mkfifo "$pipe/control" || exit 1
	setsid "$0" --daemon </dev/null >>"$logs/control.log" 2>&1 &
	exit 0 ;;
--daemon)
	echo $$ >>"$here/starts"
	echo "started: pid $$, devices $CUDA_VISIBLE_DEVICES"
	: >"/dev/shm/$(basename "$0")-$$" # where its clients would meet it
	echo $$ >"$pidf.tmp" && mv "$pidf.tmp" "$pidf"
	while :; do
		read -r line <"$pipe/control" || continue
		echo "command: $line"
		if [ "$line" = quit ] && [ ! -e "$here/deaf" ]; then rm -f "$pidf" "$pipe/control" "/dev/shm/$(basename "$0")-$$"; exit 0; fi
	done ;;
*)
	running || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
	while read -r line; do echo "$line" >"$pipe/control"; done
	exit 0 ;;
esac
`

// Control is a stand-in control program in a directory of its own.
type Control struct {
	// Path is the program, named nvidia-cuda-mps-control.
	Path string
	dir  string
}

// New writes a stand-in control program into a new temporary directory.
// Its daemons are killed when the test ends.
func New(t testing.TB) *Control {
	t.Helper()
	dir := t.TempDir()
	c := &Control{Path: filepath.Join(dir, "nvidia-cuda-mps-control"), dir: dir}
	if err := os.WriteFile(c.Path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, pid := range c.Daemons("") {
			if p, err := os.FindProcess(pid); err == nil {
				_ = p.Kill()
			}
		}
		// What daemons killed in the host's /dev/shm (HostShm) left.
		for _, pid := range c.Starts() {
			if n, err := strconv.Atoi(pid); err == nil {
				_ = os.Remove(filepath.Join("/dev/shm", ShmMarker(n)))
			}
		}
	})
	return c
}

// Fail makes every later "-d" fail (true) or work again (false).
func (c *Control) Fail(t testing.TB, fail bool) { c.flag(t, "fail", fail) }

// Deaf makes the daemons ignore quit (true) or take it again (false).
func (c *Control) Deaf(t testing.TB, deaf bool) { c.flag(t, "deaf", deaf) }

func (c *Control) flag(t testing.TB, name string, on bool) {
	t.Helper()
	p := filepath.Join(c.dir, name)
	var err error
	if on {
		err = os.WriteFile(p, nil, 0o644)
	} else if err = os.Remove(p); os.IsNotExist(err) {
		err = nil
	}
	if err != nil {
		t.Fatal(err)
	}
}

// Attempts is the CUDA_VISIBLE_DEVICES of every "-d" so far, in order.
func (c *Control) Attempts() []string { return c.lines("attempts") }

// Starts is the pid of every daemon started so far, in order.
func (c *Control) Starts() []string { return c.lines("starts") }

func (c *Control) lines(name string) []string {
	b, err := os.ReadFile(filepath.Join(c.dir, name))
	if err != nil {
		return nil
	}
	return strings.Fields(string(b))
}

// Daemons lists the pids of this stand-in's daemons alive now whose pipe
// directory is pipeDir ("" for any), found in /proc: the processes that
// exist, whatever the supervisor believes.
func (c *Control) Daemons(pipeDir string) []int {
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		dir := "/proc/" + e.Name()
		cmdline, err := os.ReadFile(dir + "/cmdline")
		if err != nil {
			continue
		}
		args := strings.Split(string(cmdline), "\x00")
		if !slices.Contains(args, c.Path) || !slices.Contains(args, "--daemon") {
			continue
		}
		stat, err := os.ReadFile(dir + "/stat")
		if i := bytes.LastIndexByte(stat, ')'); err != nil || i < 0 || i+2 >= len(stat) || stat[i+2] == 'Z' {
			continue
		}
		if pipeDir != "" {
			environ, err := os.ReadFile(dir + "/environ")
			if err != nil || !slices.Contains(strings.Split(string(environ), "\x00"), "CUDA_MPS_PIPE_DIRECTORY="+pipeDir) {
				continue
			}
		}
		pids = append(pids, pid)
	}
	return pids
}

// Root is a new directory for a supervisor's daemons, short enough for a
// control socket under it (a test's TempDir is too long for one), removed
// when the test ends.
func Root(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "mps")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

// Environ is the environment of process pid, KEY=value.
func Environ(pid int) []string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
	if err != nil {
		return nil
	}
	return strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
}

// PrivateShm reports whether daemons can run here with a /dev/shm of
// their own (mps.Config.HostShm false): that takes root and unshare(1).
// Tests set HostShm to its opposite.
func PrivateShm() bool {
	_, err := exec.LookPath("unshare")
	return err == nil && os.Geteuid() == 0
}

// ShmMarker is the file daemon pid keeps in its /dev/shm.
func ShmMarker(pid int) string { return "nvidia-cuda-mps-control-" + strconv.Itoa(pid) }
