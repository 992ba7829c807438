// Package runner starts the runs of allocations on the local machine: a
// real command under a small supervisor process (the shim, see shim.go)
// so that it outlives the agent, or a simulated run that only waits. Both
// keep the run's output in a per-allocation log file, implement the
// checkpoint protocol (see contracts.Checkpoint) and end on their own, at
// a time limit, or when stopped.
//
// A command's run leaves a directory under <LogDir>/state/ that the shim
// and the agent share (files and signals only, no sockets):
//
//	spec.json   what to run (the agent writes it before starting the shim)
//	lock        flock-ed by the shim for its whole life: held = shim alive
//	state.json  the shim's and the command's pids and start times
//	stop.json   the grace of a stop (the agent writes it, then SIGTERMs the shim)
//	exit.json   how the command ended, written by the shim as it exits
//	shim.log    the shim's own messages
//	bundle/     a container run's OCI bundle: config.json, and rootfs, an
//	            overlay of its image (oci.CreateBundle); the shim removes it
//	            as it exits, Forget when the shim could not
//
// A container run (Launch.Container) is the same run whose command is
// `runc run` of its bundle (container.go): runc exits with the
// container's status, and the shim signals the container through runc.
//
// The directory is the agent's second guard against starting a run twice
// (the first is the run facts on the bus): Launch never starts a run whose
// directory exists. Recover and Adopt give a restarted agent the runs its
// predecessor left; Forget removes a run's directory once its end is
// reported.
package runner

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// Launch is one allocation's run to start.
type Launch struct {
	AllocationID string            `json:"allocationId"`
	Tenant       string            `json:"tenant"`
	JobID        string            `json:"jobId"`
	Attempt      int               `json:"attempt"`
	Spec         contracts.RunSpec `json:"spec"`
	// Devices are what the run may see, in allocation order: GPUs, MIG
	// instances or shares of a GPU.
	Devices []contracts.DeviceRef `json:"devices"`
	// StopGrace is the SIGTERM-to-SIGKILL grace applied when a command
	// reaches its time limit.
	StopGrace time.Duration `json:"stopGrace"`
	// CheckpointDir is the job's checkpoint directory
	// (GPUPLANE_CHECKPOINT_DIR) and RestoreFrom the last complete
	// checkpoint in it when the run starts (GPUPLANE_RESTORE_FROM, "" when
	// none). Local.Launch sets both.
	CheckpointDir string `json:"checkpointDir,omitempty"`
	RestoreFrom   string `json:"restoreFrom,omitempty"`
	// Gang is set when the run is one part of a job spanning several
	// machines (GPUPLANE_GANG_RANK, _SIZE, _NODES).
	Gang *contracts.GangPart `json:"gang,omitempty"`
	// Container is set for a run of an image (see Container).
	Container *Container `json:"container,omitempty"`
	// MPSPipeDir is the pipe directory of the MPS control daemon of the
	// GPU a share runs on (CUDA_MPS_PIPE_DIRECTORY; a container gets it
	// mounted at the same path), "" for a run without shares
	// or a machine without MPS.
	MPSPipeDir string `json:"mpsPipeDir,omitempty"`
	// MPSShmDir is that daemon's /dev/shm, which the run has as its own
	// (mpsShmArgv for a host command, a bind mount for a container); ""
	// for no share.
	MPSShmDir string `json:"mpsShmDir,omitempty"`
}

// Exit is how a run ended.
type Exit struct {
	// Code is the process exit code, 128+signal when a signal killed it
	// (as shells and container runtimes report it), -1 when unknown.
	Code int
	// Stopped is set when the run was stopped (Stop, or a SIGTERM the
	// shim received) before it ended.
	Stopped bool
	// TimedOut is set when a command was killed at its time limit.
	TimedOut bool
	// Err is a failure other than a non-zero exit: ErrLaunch (wrapped)
	// when the command never started, ErrLost when its shim died without
	// recording the end.
	Err error
	// EndedAt is when the run ended, when a shim recorded it; zero
	// otherwise (the agent then uses its own clock).
	EndedAt time.Time
}

// Info describes a started run.
type Info struct {
	// PID is the command's process, the leader of its process group; 0
	// for a simulated run.
	PID int
	// StartedAt is when the command started, as its shim recorded it (zero
	// for a simulated run, or a command that never started).
	StartedAt time.Time
	// LogPath is the run's output (stdout and stderr).
	LogPath string
	// CheckpointDir is the job's checkpoint directory; RestoredFrom the
	// name of the checkpoint LATEST named at launch ("" when none).
	CheckpointDir string
	RestoredFrom  string
	// Simulated is set for a simulated run: it lives in the agent's
	// process and dies with it, so nothing of it (its log's shipping
	// included) is ever resumed by a later agent.
	Simulated bool
}

// Process is a started run.
type Process interface {
	// Wait blocks until the run has ended and returns how. It may be
	// called any number of times.
	Wait() Exit
	// Done is closed when the run has ended.
	Done() <-chan struct{}
	// Stop ends the run: SIGTERM to its process group, then SIGKILL once
	// grace has passed (at once when grace <= 0). It returns at once and
	// is idempotent: the first grace holds; stopping an ended run does
	// nothing.
	Stop(grace time.Duration)
	// Checkpoint asks the run to write a checkpoint: SIGUSR1 to its
	// command (the group leader, not the processes it forked) (a simulated run writes one itself). It returns once
	// the request is sent; the run reports it through LATEST.
	Checkpoint() error
	// Info describes the run.
	Info() Info
}

// Leftover is a run a previous agent started: running (adopted: watched
// and stopped like a run of this agent) or ended (its Process is done).
type Leftover struct {
	Launch Launch
	Proc   Process
}

// Local starts runs on this machine.
type Local struct {
	// LogDir holds one log file per allocation (LogPath) and the runs'
	// state directories (state/); it is created when missing.
	LogDir string
	// CheckpointDir holds one directory per job, <tenant>/<job>, kept
	// across attempts; "" means LogDir/checkpoints.
	CheckpointDir string

	// Runc is the runc binary of container runs; "" looks it up (PATH,
	// then Debian's directories). RuncRoot is runc's state root, ""
	// meaning LogDir/runc. CgroupParent holds the containers' cgroups, ""
	// meaning oci.DefaultCgroupParent.
	Runc, RuncRoot, CgroupParent string

	// shimProgram is the program started as a run's shim; "" means this
	// one (tests start others to see a launch fail).
	shimProgram string

	// logDirMade is set once LogDir is known to exist: a burst of
	// launches does not look for it again each time.
	logDirMade atomic.Bool
}

var (
	// ErrLaunch wraps every failure to start a run.
	ErrLaunch = errors.New("launch failed")
	// ErrAlreadyLaunched is returned by Launch for an allocation whose
	// state directory exists: a run was started for it already (Adopt
	// tells what became of it).
	ErrAlreadyLaunched = errors.New("a run was already launched for this allocation")
	// ErrLost is the Exit.Err of a run whose shim ended without recording
	// how the command ended (it was killed); the command is killed too.
	ErrLost = errors.New("the run's supervisor died without recording its end")
	// ErrNoRun is returned by Adopt when no run was launched for the
	// allocation.
	ErrNoRun = errors.New("no run was launched for this allocation")
	// ErrEnded is returned by Checkpoint when the run has ended.
	ErrEnded = errors.New("the run has ended")
)

// Launch starts l: a container of l.Container's image when set (an error
// wrapping ErrRuntimeUnavailable where runc is missing), a command when
// l.Spec.Command is set, a simulated run of l.Spec.Duration otherwise.
// A container's launch returns once runc has created the container. It returns once the process exists; ctx
// bounds the launch only, never the run. A command that cannot start
// returns an error wrapping ErrLaunch and the cause (exec.ErrNotFound,
// fs.ErrNotExist, fs.ErrPermission).
func (r *Local) Launch(ctx context.Context, l Launch) (Process, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := r.prepare(&l); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrLaunch, err)
	}
	logPath := LogPath(r.LogDir, l.AllocationID)
	if l.Container != nil {
		return r.startContainer(ctx, l, logPath)
	}
	if simulated(l) {
		p, err := startSim(l)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrLaunch, err)
		}
		return p, nil
	}
	return r.startShim(l, logPath, hostCommand(l, logPath))
}

// simulated reports whether l is a simulated run: no command, no image.
func simulated(l Launch) bool { return l.Container == nil && len(l.Spec.Command) == 0 }

// makeLogDir creates LogDir unless it was made already.
func (r *Local) makeLogDir() error {
	if r.logDirMade.Load() {
		return nil
	}
	if err := os.MkdirAll(r.LogDir, 0o755); err != nil {
		return fmt.Errorf("log dir: %w", err)
	}
	r.logDirMade.Store(true)
	return nil
}

// prepare creates the directories of a launch and fills in its checkpoint
// fields. A simulated run's checkpoint directory is made by its first
// checkpoint (writeSimCheckpoint), not here: most simulated runs never
// checkpoint, and a directory per job was a third of the file work of a
// burst of starts (issue 17).
func (r *Local) prepare(l *Launch) error {
	// A simulated run writes no log (its output stays in memory), so it
	// needs no log directory: each agent's first simulated run made it,
	// and a burst's first starts on a fleet waited on one another's
	// mkdir in a shared parent (issue 17).
	if !simulated(*l) {
		if err := r.makeLogDir(); err != nil {
			return err
		}
	}
	for _, p := range []struct{ what, v string }{{"tenant", l.Tenant}, {"job ID", l.JobID}} {
		// Both become a path component: nothing that could leave the root.
		if p.v == "" || p.v == "." || p.v == ".." || strings.ContainsAny(p.v, `/\`) {
			return fmt.Errorf("%s %q cannot name a checkpoint directory", p.what, p.v)
		}
	}
	l.CheckpointDir = filepath.Join(r.checkpointRoot(), l.Tenant, l.JobID)
	if !simulated(*l) {
		// A command (or container) is told the directory: it must exist.
		if err := os.MkdirAll(l.CheckpointDir, 0o755); err != nil {
			return fmt.Errorf("checkpoint dir: %w", err)
		}
	}
	l.RestoreFrom = ""
	if name, ok := LatestCheckpoint(l.CheckpointDir); ok {
		l.RestoreFrom = filepath.Join(l.CheckpointDir, name)
	}
	return nil
}

func (r *Local) checkpointRoot() string {
	if r.CheckpointDir != "" {
		return r.CheckpointDir
	}
	return filepath.Join(r.LogDir, "checkpoints")
}

// fileKey is an allocation ID as one path component. Allocation IDs are
// tenant/job/attempt; tenants have no '_' and attempts are digits, so
// replacing '/' by '_' keeps names unique.
func fileKey(allocationID string) string { return strings.ReplaceAll(allocationID, "/", "_") }

// LogPath is where the output of allocationID's run is kept under dir.
func LogPath(dir, allocationID string) string {
	return filepath.Join(dir, fileKey(allocationID)+".log")
}
