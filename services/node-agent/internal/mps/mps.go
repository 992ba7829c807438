// Package mps runs and supervises NVIDIA's MPS control daemon
// (nvidia-cuda-mps-control) for every GPU that holds shares. The limits
// the agent gives a share's run (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT,
// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) are enforced by the MPS server only:
// without a daemon the CUDA driver ignores them, and a job given 8 GiB of
// an H200 allocated 16 (issue 14).
//
// One daemon per GPU, each with its own directories, so that the shares
// of one GPU never reach another GPU's server:
//
//	<Root>/<gpu uuid>/pipe   CUDA_MPS_PIPE_DIRECTORY: control socket, pid file
//	<Root>/<gpu uuid>/log    CUDA_MPS_LOG_DIRECTORY: control.log, server.log
//	<Root>/<gpu uuid>/shm    the daemon's (and its servers') /dev/shm
//	<Root>/<gpu uuid>/control.out   what the last start or quit printed
//
// and CUDA_VISIBLE_DEVICES=<gpu uuid> in the daemon's environment. MPS
// clients and their server meet in /dev/shm as well as in the pipe
// directory, so the daemon runs in a mount namespace of its own whose
// /dev/shm is the GPU's shm directory (as NVIDIA's Kubernetes device
// plugin does): a share's run has that directory as its /dev/shm, and no
// share sees the host's.
//
// Lifecycle. Acquire (a share about to launch) holds the GPU: the first
// hold starts the daemon (`nvidia-cuda-mps-control -d`), and Acquire
// returns once it is up, or an error wrapping ErrUnavailable when it could
// not start. While a GPU is held, a keeper goroutine looks at its daemon
// every PollInterval and restarts it when it died, with exponential
// backoff; after MaxRestarts failures in a row it gives up (the GPU is
// down until the next Acquire tries again). The last release stops the
// daemon (`echo quit | nvidia-cuda-mps-control`, same environment;
// SIGKILL when it does not go within QuitTimeout).
//
// The daemons outlive the agent, like the runs they serve: Close stops
// supervising and leaves them running. The next agent finds each by its
// pid file: Hold adopts the daemon of a GPU whose shares it re-adopts
// (or starts one where it died meanwhile), Sweep stops those of GPUs no
// share holds any more. A GPU never has two daemons: every start first
// adopts one that runs.
package mps

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// The MPS environment: where a daemon and its clients meet, and where it
// logs.
const (
	EnvPipeDir = "CUDA_MPS_PIPE_DIRECTORY"
	EnvLogDir  = "CUDA_MPS_LOG_DIRECTORY"
	envVisible = "CUDA_VISIBLE_DEVICES"
)

// PIDFile is the file a running control daemon keeps in its pipe
// directory; it removes it when it quits.
const PIDFile = "nvidia-cuda-mps-control.pid"

// DefaultControl is NVIDIA's control program, looked up in PATH.
const DefaultControl = "nvidia-cuda-mps-control"

// maxSocketPath is the longest path of a Unix socket (sun_path less its
// NUL): the daemon's control socket lives in the pipe directory.
const maxSocketPath = 107

// ErrUnavailable wraps every failure to have a GPU's daemon up for a
// share (the run fails with contracts.ReasonMPSUnavailable).
var ErrUnavailable = errors.New("MPS control daemon unavailable")

// Config configures a Supervisor. Zero durations mean their defaults.
type Config struct {
	// Control is the control program, nvidia-cuda-mps-control (a name is
	// looked up in PATH) or a stand-in that behaves like it.
	Control string
	// Root holds one directory per GPU (see the package comment).
	Root string
	// PollInterval between looks at a running daemon; 1 s.
	PollInterval time.Duration
	// ReadyTimeout bounds a start: `-d` returning and the daemon's pid
	// file and control socket appearing; 10 s.
	ReadyTimeout time.Duration
	// QuitTimeout bounds a stop before SIGKILL; 10 s.
	QuitTimeout time.Duration
	// Backoff is the delay before the first restart of a daemon that died
	// or failed to start, doubling with each failure in a row up to
	// MaxBackoff; 200 ms and 10 s.
	Backoff, MaxBackoff time.Duration
	// MaxRestarts is how many failures in a row (deaths and failed
	// starts) the keeper retries before it gives up; 5.
	MaxRestarts int
	// StableAfter is how long a daemon must stay up for its failures to
	// be forgiven; 1 min.
	StableAfter time.Duration
	// Log receives the supervisor's messages; nil means slog.Default().
	Log *slog.Logger
	// HostShm runs the daemons with the host's /dev/shm instead of a
	// private one per GPU: for machines where the agent cannot make mount
	// namespaces (not root, no unshare). Lease.ShmDir is then /dev/shm.
	HostShm bool
	// OnChange is called whenever a GPU's state changes, with the
	// supervisor's lock held: it must return at once and must not call
	// the Supervisor (the agent signals a channel).
	OnChange func(gpuUUID string, state contracts.MPSState)
}

func (c Config) withDefaults() Config {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&c.PollInterval, time.Second)
	def(&c.ReadyTimeout, 10*time.Second)
	def(&c.QuitTimeout, 10*time.Second)
	def(&c.Backoff, 200*time.Millisecond)
	def(&c.MaxBackoff, 10*time.Second)
	def(&c.StableAfter, time.Minute)
	if c.MaxRestarts <= 0 {
		c.MaxRestarts = 5
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	return c
}

// Supervisor keeps one control daemon per GPU that holds shares. A nil
// *Supervisor runs no MPS (a simulated machine): Enabled is false,
// Acquire and Hold return nil leases and State is "".
type Supervisor struct {
	cfg  Config
	log  *slog.Logger
	done chan struct{} // closed by Close

	mu      sync.Mutex
	closed  bool
	gpus    map[string]*gpu
	keepers sync.WaitGroup
}

// gpu is one GPU's daemon as the supervisor knows it; the fields below
// the directories are guarded by Supervisor.mu.
type gpu struct {
	uuid, dir, pipeDir, logDir, shmDir string

	holds    int // shares launching or running on the GPU
	state    contracts.MPSState
	pid      int       // the daemon's, 0 when none is known
	upSince  time.Time // when pid was started or adopted
	streak   int       // failures in a row: deaths and failed starts
	attempts uint64    // start attempts finished, failed or not
	lastErr  error
	keeper   bool // a keeper goroutine runs for the GPU
	gaveUp   bool // MaxRestarts reached: no restart until the next hold
	changed  chan struct{}
	wake     chan struct{}
}

// New returns a supervisor of cfg.Control's daemons under cfg.Root. It
// starts and creates nothing: the first start creates the directories, so
// an agent that never runs a share never needs Root.
func New(cfg Config) (*Supervisor, error) {
	cfg = cfg.withDefaults()
	if cfg.Control == "" {
		return nil, errors.New("mps: no control program")
	}
	if cfg.Root == "" {
		return nil, errors.New("mps: no root directory")
	}
	root, err := filepath.Abs(cfg.Root)
	if err != nil {
		return nil, fmt.Errorf("mps: root: %w", err)
	}
	cfg.Root = root
	// A GPU UUID is "GPU-" and 36 characters.
	if n := len(filepath.Join(root, "GPU-00000000-0000-0000-0000-000000000000", "pipe", "control")); n > maxSocketPath {
		return nil, fmt.Errorf("mps: root %s is too long: a control socket under it would have a %d-byte path, over the %d of a Unix socket",
			root, n, maxSocketPath)
	}
	return &Supervisor{cfg: cfg, log: cfg.Log, done: make(chan struct{}), gpus: map[string]*gpu{}}, nil
}

// Enabled reports whether the supervisor runs MPS at all.
func (s *Supervisor) Enabled() bool { return s != nil }

// Lease is a share's hold on its GPU's daemon.
type Lease struct {
	// PipeDir is the daemon's pipe directory: the share's run gets it as
	// CUDA_MPS_PIPE_DIRECTORY, and a container has it mounted at the
	// same path.
	PipeDir string
	// LogDir is the daemon's log directory.
	LogDir string
	// ShmDir is the daemon's /dev/shm, which the share's run must have as
	// its own /dev/shm: the host's, /dev/shm, with HostShm.
	ShmDir  string
	once    sync.Once
	release func()
}

// Release gives the hold back; the last one stops the daemon. It is
// idempotent, and nil-safe.
func (l *Lease) Release() {
	if l != nil {
		l.once.Do(l.release)
	}
}

// PipeDir is the pipe directory of the GPU's daemon under root.
func PipeDir(root, gpuUUID string) string { return filepath.Join(root, gpuUUID, "pipe") }

// Acquire holds the GPU for a share about to launch and returns once its
// daemon is up: started now, running already, or adopted from a previous
// agent. It fails, wrapping ErrUnavailable, when the first start attempt
// that ends after the hold fails, or ctx ends first; the hold is then
// given back.
func (s *Supervisor) Acquire(ctx context.Context, gpuUUID string) (*Lease, error) {
	if s == nil {
		return nil, nil
	}
	g, lease, err := s.hold(gpuUUID)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	since := g.attempts
	s.mu.Unlock()
	for {
		s.mu.Lock()
		state, pid, attempts, lastErr, changed := g.state, g.pid, g.attempts, g.lastErr, g.changed
		s.mu.Unlock()
		switch {
		case state == contracts.MPSUp && s.alive(g, pid):
			return lease, nil
		case state == contracts.MPSUp:
			// Died since the keeper last looked: it restarts it now.
			s.mu.Lock()
			s.kick(g)
			s.mu.Unlock()
		case attempts > since && lastErr != nil:
			lease.Release()
			return nil, fmt.Errorf("GPU %s: %w: %w", gpuUUID, ErrUnavailable, lastErr)
		}
		select {
		case <-changed:
		case <-ctx.Done():
			lease.Release()
			return nil, fmt.Errorf("GPU %s: %w: not up in time: %w", gpuUUID, ErrUnavailable, context.Cause(ctx))
		case <-s.done:
			lease.Release()
			return nil, fmt.Errorf("GPU %s: %w: the supervisor is closed", gpuUUID, ErrUnavailable)
		}
	}
}

// Hold holds the GPU for a share that already runs (one a previous agent
// launched): its daemon is adopted, or restarted where it died, and kept
// like any other; Hold never waits for it.
func (s *Supervisor) Hold(gpuUUID string) (*Lease, error) {
	if s == nil {
		return nil, nil
	}
	_, lease, err := s.hold(gpuUUID)
	return lease, err
}

func (s *Supervisor) hold(uuid string) (*gpu, *Lease, error) {
	if uuid == "" || uuid == "." || uuid == ".." || strings.ContainsAny(uuid, `/\`) {
		return nil, nil, fmt.Errorf("%w: GPU UUID %q cannot name a directory", ErrUnavailable, uuid)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, nil, fmt.Errorf("GPU %s: %w: the supervisor is closed", uuid, ErrUnavailable)
	}
	g := s.gpuLocked(uuid)
	g.holds++
	if g.gaveUp {
		// A new share is worth new tries.
		g.gaveUp, g.streak = false, 0
	}
	s.kick(g)
	if !g.keeper {
		g.keeper = true
		s.keepers.Add(1)
		go s.keep(g)
	}
	l := &Lease{PipeDir: g.pipeDir, LogDir: g.logDir, ShmDir: g.shmDir}
	if s.cfg.HostShm {
		l.ShmDir = "/dev/shm"
	}
	l.release = func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		g.holds--
		s.kick(g)
	}
	return g, l, nil
}

// gpuLocked is uuid's entry, made on first use; s.mu must be held.
func (s *Supervisor) gpuLocked(uuid string) *gpu {
	g := s.gpus[uuid]
	if g == nil {
		dir := filepath.Join(s.cfg.Root, uuid)
		g = &gpu{uuid: uuid, dir: dir, pipeDir: PipeDir(s.cfg.Root, uuid), logDir: filepath.Join(dir, "log"), shmDir: filepath.Join(dir, "shm"),
			state: contracts.MPSNone, changed: make(chan struct{}), wake: make(chan struct{}, 1)}
		s.gpus[uuid] = g
	}
	return g
}

// kick makes g's keeper look again now.
func (s *Supervisor) kick(g *gpu) {
	select {
	case g.wake <- struct{}{}:
	default:
	}
}

// State is the GPU's daemon state: "" without MPS, MPSNone for a GPU
// the supervisor has never held.
func (s *Supervisor) State(gpuUUID string) contracts.MPSState {
	if s == nil {
		return ""
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if g := s.gpus[gpuUUID]; g != nil {
		return g.state
	}
	return contracts.MPSNone
}

// PID is the process ID of the GPU's daemon, 0 when none is up.
func (s *Supervisor) PID(gpuUUID string) int {
	if s == nil {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if g := s.gpus[gpuUUID]; g != nil && g.state == contracts.MPSUp {
		return g.pid
	}
	return 0
}

// setState records g's state; s.mu must be held.
func (s *Supervisor) setState(g *gpu, st contracts.MPSState) {
	if g.state == st {
		return
	}
	g.state = st
	close(g.changed)
	g.changed = make(chan struct{})
	if s.cfg.OnChange != nil {
		s.cfg.OnChange(g.uuid, st)
	}
}

// Sweep stops the daemons of gpuUUIDs (the machine's GPUs: agents of a
// simulated fleet may share Root) that no hold needs: those a previous
// agent left on GPUs whose shares ended while no agent ran. Call it once
// the shares that still run are held (Hold).
func (s *Supervisor) Sweep(ctx context.Context, gpuUUIDs []string) error {
	if s == nil {
		return nil
	}
	for _, uuid := range gpuUUIDs {
		if ctx.Err() != nil {
			break
		}
		if _, err := os.Stat(filepath.Join(s.cfg.Root, uuid)); err != nil {
			continue // never had a daemon (or cannot name a directory)
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return nil
		}
		g := s.gpuLocked(uuid)
		busy := g.holds > 0 || g.keeper
		s.mu.Unlock()
		if busy {
			continue
		}
		if pid, ok := s.running(g); ok {
			s.log.Info("stopping an MPS control daemon no share needs any more", "gpu_uuid", g.uuid, "pid", pid)
			s.stop(g)
		}
	}
	return ctx.Err()
}

// Close stops supervising; the daemons go on for the runs that outlive
// the agent (the next agent adopts them). It waits for the keepers.
func (s *Supervisor) Close() {
	if s == nil {
		return
	}
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.done)
	}
	s.mu.Unlock()
	s.keepers.Wait()
}

// keep runs while g is held or its daemon is being stopped: it starts
// the daemon, restarts it when it dies, and stops it after the last
// release.
func (s *Supervisor) keep(g *gpu) {
	defer s.keepers.Done()
	log := s.log.With("gpu_uuid", g.uuid)
	for {
		s.mu.Lock()
		if s.closed {
			g.keeper = false
			s.mu.Unlock()
			return
		}
		if g.holds == 0 {
			s.mu.Unlock()
			s.stop(g)
			s.mu.Lock()
			if g.holds == 0 || s.closed {
				g.pid, g.keeper, g.streak, g.gaveUp, g.lastErr = 0, false, 0, false, nil
				s.setState(g, contracts.MPSNone)
				s.mu.Unlock()
				return
			}
			s.mu.Unlock()
			continue // held again while it stopped
		}
		if g.gaveUp {
			s.mu.Unlock()
			s.waitWake(g, 0)
			continue
		}
		pid, upSince := g.pid, g.upSince
		s.mu.Unlock()

		if pid != 0 {
			if s.alive(g, pid) {
				if time.Since(upSince) >= s.cfg.StableAfter {
					s.mu.Lock()
					g.streak = 0
					s.mu.Unlock()
				}
				s.waitWake(g, s.cfg.PollInterval)
				continue
			}
			log.Warn("MPS control daemon died; restarting it", "pid", pid)
			s.mu.Lock()
			g.pid, g.lastErr = 0, fmt.Errorf("the daemon (pid %d) died", pid)
			g.streak++
			s.setState(g, contracts.MPSDown)
			s.mu.Unlock()
		}

		s.mu.Lock()
		streak := g.streak
		if streak > s.cfg.MaxRestarts {
			g.gaveUp = true
			s.setState(g, contracts.MPSDown)
			s.mu.Unlock()
			log.Error("MPS control daemon keeps failing; not restarting it until a new share needs it",
				"failures", streak, "err", g.lastErr)
			continue
		}
		s.mu.Unlock()
		if streak > 0 && !s.waitWake(g, s.backoff(streak)) {
			continue // woken: a hold came or went, look again
		}

		newPID, err := s.start(g)
		s.mu.Lock()
		g.attempts++
		if err != nil {
			g.streak++
			g.lastErr = err
			s.setState(g, contracts.MPSDown)
			s.mu.Unlock()
			log.Error("MPS control daemon did not start", "failures", streak+1, "err", err)
			continue
		}
		g.pid, g.upSince, g.lastErr = newPID, time.Now(), nil
		s.setState(g, contracts.MPSUp)
		s.mu.Unlock()
		log.Info("MPS control daemon up", "pid", newPID, "pipe_dir", g.pipeDir)
	}
}

// waitWake waits d (forever when d is 0) or until g is kicked or the
// supervisor closes; it reports whether d passed.
func (s *Supervisor) waitWake(g *gpu, d time.Duration) bool {
	var tick <-chan time.Time
	if d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		tick = t.C
	}
	select {
	case <-tick:
		return true
	case <-g.wake:
	case <-s.done:
	}
	return false
}

func (s *Supervisor) backoff(streak int) time.Duration {
	d := s.cfg.Backoff
	for i := 1; i < streak && d < s.cfg.MaxBackoff; i++ {
		d *= 2
	}
	return min(d, s.cfg.MaxBackoff)
}

// env is the environment of the daemon and of its control client: the
// GPU's own directories and device, and nothing of the agent's but where
// programs and libraries are (never its credentials).
func (s *Supervisor) env(g *gpu) []string {
	env := []string{EnvPipeDir + "=" + g.pipeDir, EnvLogDir + "=" + g.logDir, envVisible + "=" + g.uuid}
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	if v, ok := os.LookupEnv("PATH"); ok {
		path = v
	}
	env = append(env, "PATH="+path)
	if v, ok := os.LookupEnv("LD_LIBRARY_PATH"); ok {
		env = append(env, "LD_LIBRARY_PATH="+v)
	}
	return env
}

// start brings g's daemon up: it adopts one that runs already, or starts
// one and waits for its pid file and control socket.
func (s *Supervisor) start(g *gpu) (int, error) {
	if pid, ok := s.running(g); ok {
		s.log.Info("adopted a running MPS control daemon", "gpu_uuid", g.uuid, "pid", pid)
		return pid, nil
	}
	for _, d := range []string{g.pipeDir, g.logDir, g.shmDir} {
		// Open to every user, like /tmp: the daemon starts an MPS server
		// as the user of its first client (a container's non-root user),
		// and that server makes its own files in both directories.
		if err := os.MkdirAll(d, 0o755); err != nil {
			return 0, fmt.Errorf("MPS directory: %w", err)
		}
		if err := os.Chmod(d, 0o777|os.ModeSticky); err != nil {
			return 0, fmt.Errorf("MPS directory: %w", err)
		}
	}
	// A pid file left by a daemon that died would read as a daemon
	// already running (to the real one too).
	_ = os.Remove(filepath.Join(g.pipeDir, PIDFile))
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.ReadyTimeout)
	defer cancel()
	control, err := exec.LookPath(s.cfg.Control)
	if err != nil {
		return 0, fmt.Errorf("control program: %w", err)
	}
	argv := []string{control, "-d"}
	if !s.cfg.HostShm {
		// The daemon forks and its server is its child: both keep the
		// namespace, and with it the GPU's shm directory as /dev/shm.
		argv = []string{"unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
			`mount --bind "$0" /dev/shm && exec "$1" -d`, g.shmDir, control}
	}
	if err := s.run(ctx, g, nil, argv); err != nil {
		return 0, err
	}
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		if pid, ok := s.running(g); ok {
			if _, err := os.Stat(filepath.Join(g.pipeDir, "control")); err == nil {
				return pid, nil
			}
		}
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("%s -d returned, and no daemon was up %s later (see %s)",
				s.cfg.Control, s.cfg.ReadyTimeout, filepath.Join(g.logDir, "control.log"))
		case <-t.C:
		}
	}
}

// control runs the control program with g's environment and args, stdin
// written to it, its output in g's control.out.
func (s *Supervisor) control(ctx context.Context, g *gpu, stdin []byte, args ...string) error {
	return s.run(ctx, g, stdin, append([]string{s.cfg.Control}, args...))
}

// run runs argv as control does.
func (s *Supervisor) run(ctx context.Context, g *gpu, stdin []byte, argv []string) error {
	outPath := filepath.Join(g.dir, "control.out")
	out, err := os.Create(outPath)
	if err != nil {
		return fmt.Errorf("MPS control output: %w", err)
	}
	defer out.Close()
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env = s.env(g)
	cmd.Dir = g.dir
	// A file, not a pipe: the daemon `-d` forks may keep the descriptors,
	// and a pipe would hold Wait until the daemon ends.
	cmd.Stdout, cmd.Stderr = out, out
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	// Its own session: a signal to the agent's process group (a ^C) must
	// not reach the daemon, which serves runs that outlive the agent.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Run(); err != nil {
		b, _ := os.ReadFile(outPath)
		msg := strings.TrimSpace(string(b))
		if len(msg) > 512 {
			msg = msg[len(msg)-512:]
		}
		if msg != "" {
			return fmt.Errorf("%s: %w: %s", strings.Join(argv, " "), err, msg)
		}
		return fmt.Errorf("%s: %w", strings.Join(argv, " "), err)
	}
	return nil
}

// stop quits g's daemon, if one runs, and kills it when it does not go.
func (s *Supervisor) stop(g *gpu) {
	pid, ok := s.running(g)
	if !ok {
		_ = os.Remove(filepath.Join(g.pipeDir, PIDFile))
		return
	}
	log := s.log.With("gpu_uuid", g.uuid, "pid", pid)
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.QuitTimeout)
	defer cancel()
	if err := s.control(ctx, g, []byte("quit\n")); err != nil {
		log.Warn("MPS control daemon did not take quit", "err", err)
	}
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for s.alive(g, pid) {
		select {
		case <-ctx.Done():
			log.Warn("MPS control daemon did not quit in time; killing it", "timeout", s.cfg.QuitTimeout)
			_ = syscall.Kill(pid, syscall.SIGKILL)
			_ = os.Remove(filepath.Join(g.pipeDir, PIDFile))
			return
		case <-t.C:
		}
	}
	log.Info("MPS control daemon stopped: the GPU holds no share")
}

// running is the daemon g's pid file names, when it is alive and g's.
func (s *Supervisor) running(g *gpu) (int, bool) {
	b, err := os.ReadFile(filepath.Join(g.pipeDir, PIDFile))
	if err != nil {
		return 0, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, false
	}
	return pid, s.alive(g, pid)
}

// alive reports whether pid is g's daemon and not dead: not a zombie
// (nobody may reap a daemon reparented to a PID 1 that does not), run
// from the control program, with g's pipe directory in its environment.
// The checks keep a reused pid from passing for the daemon.
func (s *Supervisor) alive(g *gpu, pid int) bool {
	proc := "/proc/" + strconv.Itoa(pid)
	stat, err := os.ReadFile(proc + "/stat")
	if err != nil {
		return false
	}
	// The state follows the command name in parentheses, which may hold
	// anything: look after the last ')'.
	if i := bytes.LastIndexByte(stat, ')'); i < 0 || i+2 >= len(stat) || stat[i+2] == 'Z' || stat[i+2] == 'X' {
		return false
	}
	cmdline, err := os.ReadFile(proc + "/cmdline")
	if err != nil {
		return false
	}
	base := filepath.Base(s.cfg.Control)
	if !slices.ContainsFunc(bytes.Split(cmdline, []byte{0}), func(arg []byte) bool {
		return filepath.Base(string(arg)) == base
	}) {
		return false
	}
	environ, err := os.ReadFile(proc + "/environ")
	if err != nil {
		return true // not ours to read: the pid file and program name vouch
	}
	want := EnvPipeDir + "=" + g.pipeDir
	return slices.ContainsFunc(bytes.Split(environ, []byte{0}), func(kv []byte) bool { return string(kv) == want })
}
