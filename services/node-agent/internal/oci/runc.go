package oci

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
)

var (
	// ErrUnavailable is returned where no container runtime (runc) can
	// run: a container run fails with runtime_unavailable, host commands
	// still run.
	ErrUnavailable = errors.New("no container runtime: runc is not installed")
	// ErrNoContainer is returned by State for an ID runc does not know.
	ErrNoContainer = errors.New("no such container")
)

// Runtime is runc with its own state root: the agent's containers are
// the ones under Root, whatever else runs on the machine.
type Runtime struct {
	Path string `json:"path"`
	Root string `json:"root"`
}

// runcDirs are where Debian puts runc, looked at when PATH (an agent
// started by a service manager, without sbin) does not name it.
var runcDirs = []string{"/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin", "/sbin"}

// LookRuntime finds runc: path when set (it must exist), else "runc" in
// PATH or Debian's directories. The error wraps ErrUnavailable, also for
// an agent that is not root.
func LookRuntime(path, root string) (Runtime, error) {
	if path == "" {
		p, err := exec.LookPath("runc")
		for _, d := range runcDirs {
			if err == nil {
				break
			}
			p, err = exec.LookPath(d + "/runc")
		}
		if err != nil {
			return Runtime{}, fmt.Errorf("%w (looked in PATH and %s)", ErrUnavailable, strings.Join(runcDirs, ", "))
		}
		path = p
	} else if _, err := exec.LookPath(path); err != nil {
		return Runtime{}, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	if uid := os.Geteuid(); uid != 0 {
		// runc creates namespaces, cgroups and mounts as root; rootless
		// containers would need a configuration of their own.
		return Runtime{}, fmt.Errorf("%w: runc runs containers as root and the agent runs as uid %d", ErrUnavailable, uid)
	}
	if root == "" {
		return Runtime{}, errors.New("runc needs a state root")
	}
	return Runtime{Path: path, Root: root}, nil
}

// RunArgv is the command the shim runs in the foreground: runc creates
// and starts the container, relays the signals it gets to the container's
// first process, exits with its status (128+n for a signal) and deletes
// the container (its cgroup included) once it ended. runc writes the
// container's pid to pidFile once the container exists: a runc that
// exits without having written it never started the container.
func (r Runtime) RunArgv(bundle, id, pidFile string) []string {
	return []string{r.Path, "--root", r.Root, "run", "--bundle", bundle, "--pid-file", pidFile, id}
}

// Kill sends sig to the container's first process, or with all to every
// process of the container (its cgroup).
func (r Runtime) Kill(ctx context.Context, id string, sig syscall.Signal, all bool) error {
	args := []string{"kill"}
	if all {
		args = append(args, "--all")
	}
	_, err := r.run(ctx, append(args, id, strconv.Itoa(int(sig)))...)
	return err
}

// State is what runc says of a container.
type State struct {
	ID     string `json:"id"`
	Status string `json:"status"` // creating, created, running, paused, stopped
	Pid    int    `json:"pid"`
	Bundle string `json:"bundle"`
}

// Running reports whether the container's first process exists.
func (s State) Running() bool { return s.Status != "stopped" && s.Pid > 0 }

// State asks runc about container id; ErrNoContainer when none.
func (r Runtime) State(ctx context.Context, id string) (State, error) {
	out, err := r.run(ctx, "state", id)
	if err != nil {
		return State{}, err
	}
	var s State
	if err := json.Unmarshal(out, &s); err != nil {
		return State{}, fmt.Errorf("runc state %s: %w", id, err)
	}
	return s, nil
}

// Delete removes container id, killing it first when force; a container
// that does not exist is deleted already.
func (r Runtime) Delete(ctx context.Context, id string, force bool) error {
	args := []string{"delete"}
	if force {
		args = append(args, "--force")
	}
	_, err := r.run(ctx, append(args, id)...)
	if errors.Is(err, ErrNoContainer) {
		return nil
	}
	return err
}

func (r Runtime) run(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, r.Path, append([]string{"--root", r.Root}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		if strings.Contains(msg, "does not exist") || strings.Contains(msg, "not exist") {
			return nil, fmt.Errorf("runc %s: %w: %s", args[0], ErrNoContainer, msg)
		}
		return nil, fmt.Errorf("runc %s: %w: %s", strings.Join(args, " "), err, msg)
	}
	return out, nil
}

// containerIDRE is what runc accepts as an ID.
var containerIDRE = regexp.MustCompile(`[^a-zA-Z0-9_.+-]`)

// ContainerID is the runc ID of an allocation's container: readable (the
// allocation ID with '/' as '_'), and unique by a hash of the allocation
// ID, since a gang part's '#' and any other character runc refuses are
// replaced.
func ContainerID(allocationID string) string {
	sum := sha256.Sum256([]byte(allocationID))
	readable := containerIDRE.ReplaceAllString(strings.ReplaceAll(allocationID, "/", "_"), "-")
	if len(readable) > 64 {
		readable = readable[:64]
	}
	return "gp-" + readable + "-" + hex.EncodeToString(sum[:4])
}
