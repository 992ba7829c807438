package runner

import (
	"fmt"
	"io"
	"path/filepath"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// sigtermExit is the exit code of a process ended by SIGTERM; a stopped
// simulated run reports it too.
const sigtermExit = 128 + 15

// simProc is a simulated run: it waits for its duration and exits with the
// spec's exit code, or ends at once when stopped. It implements the
// checkpoint protocol: Checkpoint saves its progress as the job's next
// checkpoint, and a run that starts with a checkpoint of its job (a later
// attempt) only runs what remains.
type simProc struct {
	done    chan struct{}
	stop    chan struct{}
	once    sync.Once
	timer   *time.Timer
	info    Info
	total   time.Duration
	started time.Time
	// restored is the progress the run started from.
	restored time.Duration
	ckpt     sync.Mutex // one checkpoint at a time: each takes the next name

	mu   sync.Mutex // guards exit, out and the log file
	exit Exit
	// ended is set once the run ended: it writes no more output.
	ended bool
	// out is the run's whole output, kept in memory and nowhere else: a
	// simulated run's output is a few lines, the agent ships it from here
	// (ReadAt, Size: logship.Source) to LOGS, where every reader reads
	// it. A run costs no file at all: creating one per run was most of a
	// burst's start cost in the kernel (~360 µs of CPU per create with a
	// hundred agents creating at once, issue 17), and writing it at the
	// end cost a steady load as much. Nothing is lost that a crash kept
	// before: a simulated run dies with its agent, and its shipping was
	// never resumed (logship.NewVolatile).
	out []byte
}

// startSim starts a simulated run whose output stays in memory (Info has
// no LogPath): a run holds no file and no descriptor while it waits,
// which a fleet of thousands of simulated machines, each with a run per
// GPU, would otherwise pay for at every start.
func startSim(l Launch) (*simProc, error) {
	total := max(l.Spec.Duration.D(), 0)
	p := &simProc{done: make(chan struct{}), stop: make(chan struct{}), total: total,
		info: Info{CheckpointDir: l.CheckpointDir, Simulated: true}}
	out := fmt.Appendf(nil, "simulated run of %s on %v, exit code %d\n", total, visibleUUIDs(l.Devices), l.Spec.ExitCode)
	if l.RestoreFrom != "" {
		p.info.RestoredFrom = filepath.Base(l.RestoreFrom)
		if s, err := readSimCheckpoint(l.RestoreFrom); err != nil {
			out = fmt.Appendf(out, "not restored (%v): starting from the beginning\n", err)
		} else {
			p.restored = min(s.Progress.D(), total)
			out = fmt.Appendf(out, "restored from %s at %s: %s to go\n", p.info.RestoredFrom, p.restored, total-p.restored)
		}
	}
	p.out = out
	p.started = time.Now()
	p.timer = time.NewTimer(total - p.restored)
	go func() {
		var exit Exit
		select {
		case <-p.timer.C:
			exit = Exit{Code: l.Spec.ExitCode}
		case <-p.stop:
			p.timer.Stop()
			exit = Exit{Code: sigtermExit, Stopped: true}
		}
		p.mu.Lock()
		p.exit = exit
		p.ended = true
		p.mu.Unlock()
		close(p.done)
	}()
	return p, nil
}

func visibleUUIDs(devs []contracts.DeviceRef) []string {
	out := make([]string, len(devs))
	for i, d := range devs {
		out[i] = d.VisibleUUID()
	}
	return out
}

// logf appends a line to the run's log while it runs.
func (p *simProc) logf(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ended {
		return
	}
	p.out = fmt.Appendf(p.out, format+"\n", args...)
}

// ReadAt reads the run's output from off, as a file would
// (logship.Source).
func (p *simProc) ReadAt(b []byte, off int64) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if off >= int64(len(p.out)) {
		return 0, io.EOF
	}
	n := copy(b, p.out[off:])
	if n < len(b) {
		return n, io.EOF
	}
	return n, nil
}

// Size is how many bytes of output the run wrote so far (logship.Source).
func (p *simProc) Size() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return int64(len(p.out))
}

func (p *simProc) Wait() Exit {
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exit
}

func (p *simProc) Done() <-chan struct{} { return p.done }

func (p *simProc) Stop(time.Duration) { p.once.Do(func() { close(p.stop) }) }

func (p *simProc) Info() Info { return p.info }

// Checkpoint saves the run's progress at once, as a job answering SIGUSR1
// would.
func (p *simProc) Checkpoint() error {
	select {
	case <-p.done:
		return ErrEnded
	default:
	}
	if p.info.CheckpointDir == "" {
		return fmt.Errorf("simulated run has no checkpoint directory")
	}
	p.ckpt.Lock()
	defer p.ckpt.Unlock()
	progress := min(p.restored+time.Since(p.started), p.total)
	name, err := writeSimCheckpoint(p.info.CheckpointDir, simState{Progress: contracts.Duration(progress), Duration: contracts.Duration(p.total)})
	if err != nil {
		return fmt.Errorf("simulated checkpoint: %w", err)
	}
	p.logf("checkpoint %s at %s of %s", name, progress, p.total)
	return nil
}
