// Package monitor is gpuplane's monitoring service. It follows telemetry,
// job events, the allocation ledger, the node inventory, heartbeats, node
// holds and the scheduler's demand into a read model, serves it as Prometheus metrics (dcgm-exporter
// names for GPUs, gpuplane_ for the platform), keeps rolling windows of
// telemetry per GPU, machine, pool and tenant, and raises alerts on the bus:
// node_silent when a node stops sending telemetry, and those of the rules
// file (node lost, GPU hot, memory full, XID, ECC, pool busy, trends).
//
//	TELEMETRY (last per node, then new) ─┐
//	JOB_EVENTS (from the start)  ─────────┤
//	ALLOCATIONS ledger (from the start) ──┼─> readmodel ──> metrics.Collector ──> GET /metrics
//	NODES inventory+lifecycle ────────────┤        ^
//	OPS demand (last per pool) ───────────┤        │
//	OPS scale decisions, machine events ──┤        │
//	HEARTBEATS (last per node, then new) ─┤        │
//	KV gp-node-admin (holds) ─────────────┘        │
//	TELEMETRY ──> rules.Engine (windows) ──────────┘
//	           └─> silence.Detector
//	(tick) readmodel pool pressure ──> rules (fragmentation, pending jobs)
//	(tick) readmodel heartbeat ages ──> rules (node_lost), once caught up
//	(tick) silence + rules ──> gp.alerts.<kind> (OPS), firing and resolved
//	(tick) departed nodes forgotten (readmodel, silence), once caught up
//
// The monitor owns no log of record: every read model is rebuilt from the
// streams at start, and alert episodes from the alerts it published.
package monitor

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/lease"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/libs/telemetry"
	"github.com/gpuplane/gpuplane/services/monitor/internal/metrics"
	"github.com/gpuplane/gpuplane/services/monitor/internal/readmodel"
	"github.com/gpuplane/gpuplane/services/monitor/internal/rules"
	"github.com/gpuplane/gpuplane/services/monitor/internal/silence"
	"github.com/gpuplane/gpuplane/services/monitor/internal/wire"
)

// Name is the service name (bus connection name, log and trace attribute).
const Name = "monitor"

// Config configures the monitor.
type Config struct {
	Bus service.BusConfig
	// Addr is the HTTP listen address of /metrics and /healthz
	// (default 127.0.0.1:9400; ":0" or "127.0.0.1:0" picks a free port).
	Addr string
	// SilentAfter is how long a node that sent telemetry may stay quiet
	// before a node_silent alert fires (default 3s). GPU series of a node
	// quiet for that long are no longer exposed.
	SilentAfter time.Duration
	// RulesFile is a YAML or JSON rules file (see internal/rules and
	// deploy/monitoring/rules.yaml); "" uses the built-in rules.
	RulesFile string
	// EvalInterval is how often the rules are evaluated (default 1s).
	EvalInterval time.Duration
	// OnListen, if set, is called with the bound HTTP address once the
	// listener is open. Not a flag.
	OnListen func(addr string)
	// Instance names this replica on the bus (connection name and
	// CloudEvents source of its alerts); default "monitor".
	Instance string
	// LeaseTTL is how long the alerting lease lasts unrenewed (lease.go):
	// every replica serves /metrics, only the lease holder publishes
	// alerts. 0 runs without election (a single instance). Default 3 s.
	LeaseTTL time.Duration
}

// DefaultConfig returns the defaults, with the bus settings from the
// environment.
func DefaultConfig() Config {
	return Config{Bus: service.DefaultBusConfig(), Addr: "127.0.0.1:9400", SilentAfter: 3 * time.Second, EvalInterval: time.Second,
		Instance: Name, LeaseTTL: 3 * time.Second}
}

// RegisterFlags adds the monitor's flags to fs, defaulting to c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	c.Bus.RegisterFlags(fs)
	fs.StringVar(&c.Addr, "addr", c.Addr, "HTTP listen address for /metrics and /healthz")
	fs.DurationVar(&c.SilentAfter, "silent-after", c.SilentAfter, "raise node_silent when a node sends no telemetry for this long")
	fs.StringVar(&c.RulesFile, "rules", c.RulesFile, "alert rules file (YAML or JSON); empty for the built-in rules")
	fs.DurationVar(&c.EvalInterval, "eval-interval", c.EvalInterval, "how often alert rules are evaluated")
	fs.StringVar(&c.Instance, "name", c.Instance, "this replica's connection name and CloudEvents source")
	fs.DurationVar(&c.LeaseTTL, "lease-ttl", c.LeaseTTL, "alerting lease duration: every replica serves /metrics, one publishes alerts; a standby takes over at most this long after it dies (0: no election)")
}

// Validate reports every problem at once.
func (c Config) Validate() error {
	errs := []error{c.Bus.Validate()}
	if _, _, err := net.SplitHostPort(c.Addr); err != nil {
		errs = append(errs, fmt.Errorf("addr %q: %w", c.Addr, err))
	}
	if c.SilentAfter <= 0 {
		errs = append(errs, fmt.Errorf("silent-after is %s; want > 0", c.SilentAfter))
	}
	if c.LeaseTTL != 0 && (c.LeaseTTL < 30*time.Millisecond || c.LeaseTTL > time.Minute) {
		errs = append(errs, fmt.Errorf("lease ttl is %s; want 0 (no election) or 30ms to 1m", c.LeaseTTL))
	}
	if c.Instance != "" {
		if err := contracts.ValidateID(c.Instance); err != nil {
			errs = append(errs, fmt.Errorf("name: %w", err))
		}
	}
	if c.EvalInterval <= 0 {
		errs = append(errs, fmt.Errorf("eval-interval is %s; want > 0", c.EvalInterval))
	}
	if rc, err := c.rules(); err != nil {
		errs = append(errs, err)
	} else {
		for _, r := range rc.Rules {
			if r.Kind == silence.Kind {
				errs = append(errs, fmt.Errorf("rules: kind %q is the silence detector's", r.Kind))
			}
		}
	}
	return errors.Join(errs...)
}

// rules is the rules configuration: the file's, or the built-in one.
func (c Config) rules() (rules.Config, error) {
	if c.RulesFile == "" {
		return rules.DefaultConfig(), nil
	}
	return rules.Load(c.RulesFile)
}

// Run runs the monitor until ctx ends; it returns nil on a clean shutdown.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("%s: %w", Name, err)
	}
	if log == nil {
		log = slog.Default()
	}
	rt, err := service.Start(ctx, cmp.Or(cfg.Instance, Name), cfg.Bus, log)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer rt.Close()
	rcfg, err := cfg.rules()
	if err != nil {
		return fmt.Errorf("%s: %w", Name, err)
	}
	engine, err := rules.New(rcfg)
	if err != nil {
		return fmt.Errorf("%s: %w", Name, err)
	}
	m := &monitor{cfg: cfg, bus: rt.Bus, log: rt.Log, model: readmodel.New(), silent: silence.New(cfg.SilentAfter), rules: engine}
	if err := m.restoreAlerts(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("%s: %w", Name, err)
	}

	reg := telemetry.NewRegistry()
	reg.MustRegister(metrics.New(m.model, m.rules, cfg.SilentAfter, time.Now))
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", telemetry.MetricsHandler(reg))
	mux.HandleFunc("GET /healthz", m.healthz)
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return fmt.Errorf("%s: listen: %w", Name, err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}

	g, gctx := errgroup.WithContext(ctx)
	m.follow(g, gctx, "telemetry", bus.FollowSpec{Stream: contracts.StreamTelemetry,
		FilterSubjects: []string{contracts.SubjectTelemetryAll}, LastPerSubject: true}, m.onTelemetry)
	m.follow(g, gctx, "job events", bus.FollowSpec{Stream: contracts.StreamJobEvents,
		FilterSubjects: []string{contracts.SubjectJobEventsAll}}, m.onJobEvent)
	m.follow(g, gctx, "ledger", bus.FollowSpec{Stream: contracts.StreamAllocations,
		FilterSubjects: []string{contracts.SubjectLedgerAll}}, m.onLedger)
	m.follow(g, gctx, "nodes", bus.FollowSpec{Stream: contracts.StreamNodes,
		FilterSubjects: []string{contracts.SubjectInventoryAll, contracts.SubjectNodeLifecycleAll}}, m.onNode)
	m.follow(g, gctx, "demand", bus.FollowSpec{Stream: contracts.StreamOps,
		FilterSubjects: []string{contracts.SubjectDemandAll}, LastPerSubject: true}, m.onDemand)
	m.follow(g, gctx, "scale events", bus.FollowSpec{Stream: contracts.StreamOps,
		FilterSubjects: []string{contracts.SubjectScaleAll, contracts.SubjectMachinesAll}}, m.onScale)
	// Only the latest heartbeat of a node says anything about it now.
	m.follow(g, gctx, "heartbeats", bus.FollowSpec{Stream: contracts.StreamHeartbeats,
		FilterSubjects: []string{contracts.SubjectHeartbeatAll}, LastPerSubject: true}, m.onHeartbeat)
	m.watchNodeAdmin(g, gctx)
	if cfg.LeaseTTL > 0 {
		m.follow(g, gctx, "alerts", bus.FollowSpec{Stream: contracts.StreamOps,
			FilterSubjects: m.alertSubjects(), StartSeq: m.alertsSeq + 1}, m.onLeaderAlert)
		g.Go(func() error { return m.contend(gctx) })
	}
	g.Go(func() error { return m.alertLoop(gctx) })
	// Serve only once every follower is counted: /healthz reads the count.
	g.Go(func() error {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("%s: http: %w", Name, err)
		}
		return nil
	})
	g.Go(func() error {
		<-gctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return srv.Shutdown(sctx)
	})

	m.log.Info("monitor listening", "addr", ln.Addr().String())
	if cfg.OnListen != nil {
		cfg.OnListen(ln.Addr().String())
	}
	return g.Wait()
}

type monitor struct {
	cfg    Config
	bus    *bus.Bus
	log    *slog.Logger
	model  *readmodel.Model
	silent *silence.Detector
	rules  *rules.Engine
	// telemetry decodes the telemetry follower's messages (that follower
	// only: a Decoder is not safe for concurrent use).
	telemetry wire.Decoder
	// followers and caughtUp count the read models and those that have
	// read what their stream held at start. followers is set before the
	// HTTP server starts and never changes after.
	followers int
	caughtUp  atomic.Int32
	// term is the alerting lease term held now; nil while standby
	// (lease.go). Unused without election.
	term atomic.Pointer[lease.Term]
	// alertsSeq is the OPS sequence of the last alert restoreAlerts read:
	// a standby follows the leader's alerts from there (lease.go).
	alertsSeq uint64
}

// follow starts one ordered read of a stream into the read model. A message
// that cannot be decoded is logged and skipped: a read model must not stop
// on one bad record.
func (m *monitor) follow(g *errgroup.Group, ctx context.Context, what string, spec bus.FollowSpec, fn func(*bus.Msg) error) {
	m.followers++
	g.Go(func() error {
		err := m.bus.Follow(ctx, spec, func(_ context.Context, msg *bus.Msg) error {
			if err := fn(msg); err != nil {
				m.log.Warn("skipping message", "what", what, "subject", msg.Subject, "stream_seq", msg.StreamSeq, "err", err)
			}
			return nil
		}, func() {
			m.caughtUp.Add(1)
			m.log.Debug("read model caught up", "what", what)
		})
		if err != nil {
			return fmt.Errorf("%s: follow %s: %w", Name, what, err)
		}
		return nil
	})
}

// onTelemetry keeps the latest samples and tells the detector the node is
// alive. The sample time is the stream's timestamp, the same for every
// reader, so a replayed last sample never looks fresher than it is.
func (m *monitor) onTelemetry(msg *bus.Msg) error {
	// The hottest message: wire decodes it several times faster than
	// encoding/json, with the same result.
	t, err := m.telemetry.Decode(msg.Data)
	if err != nil {
		return fmt.Errorf("decode %s seq %d: %w", msg.Subject, msg.StreamSeq, err)
	}
	nodeID := contracts.Token(msg.Subject, 2)
	if nodeID == "" {
		return fmt.Errorf("no node in subject %q", msg.Subject)
	}
	at := msgTime(msg)
	m.model.ApplyTelemetry(nodeID, t, at)
	m.silent.Seen(nodeID, t.Pool, t.Hostname, at)
	host := t.Hostname
	if host == "" {
		host = nodeID
	}
	m.rules.Ingest(rules.Machine{Node: nodeID, Hostname: host, Pool: t.Pool}, at, t.GPUs, m.model.TenantOf)
	return nil
}

func (m *monitor) onDemand(msg *bus.Msg) error {
	var d contracts.PoolDemand
	if err := msg.Decode(&d); err != nil {
		return err
	}
	// The subject is the trusted source of the pool.
	d.Pool = contracts.Token(msg.Subject, 3)
	m.model.ApplyDemand(d)
	return nil
}

// onScale counts autoscaler decisions and machine events; the read model
// counts each once by its ID, so a redelivery changes nothing.
func (m *monitor) onScale(msg *bus.Msg) error {
	// The subject is the trusted source of the pool.
	pool := contracts.Token(msg.Subject, 3)
	switch contracts.Token(msg.Subject, 2) {
	case "decisions":
		var d contracts.ScaleDecision
		if err := msg.Decode(&d); err != nil {
			return err
		}
		d.Pool = pool
		m.model.ApplyScaleDecision(d)
	case "machines":
		var e contracts.MachineEvent
		if err := msg.Decode(&e); err != nil {
			return err
		}
		e.Pool = pool
		m.model.ApplyMachineEvent(e)
		// A machine the autoscaler deleted or the provider took back left
		// on purpose: its silence is not a lost node. Stamped with the
		// stream's time, the clock heartbeats are stamped with.
		// Nor is its telemetry's: it resolves any node_silent episode
		// open, and both forget the node once it has been gone a while.
		if (e.Kind == contracts.MachineDeleted || e.Kind == contracts.MachineReclaimed) && e.NodeID != "" {
			m.model.ApplyNodeLeft(e.NodeID, msgTime(msg))
			m.silent.Left(e.NodeID, msgTime(msg))
		}
	}
	return nil
}

// onHeartbeat records that a node's agent is alive, at the stream's time
// (the same for every reader, so a replayed heartbeat never looks fresher
// than it is). The body is decoded only to refuse what is not a heartbeat.
func (m *monitor) onHeartbeat(msg *bus.Msg) error {
	var hb contracts.Heartbeat
	if err := msg.Decode(&hb); err != nil {
		return err
	}
	// The subject is the trusted source of the node.
	nodeID := contracts.Token(msg.Subject, 2)
	if nodeID == "" {
		return fmt.Errorf("no node in subject %q", msg.Subject)
	}
	m.model.ApplyHeartbeat(nodeID, msgTime(msg))
	return nil
}

// msgTime is the stream's timestamp of msg, now when it has none.
func msgTime(msg *bus.Msg) time.Time {
	if msg.Timestamp.IsZero() {
		return time.Now()
	}
	return msg.Timestamp
}

// watchNodeAdmin follows the node holds (BucketNodeAdmin) into the read
// model: held GPUs are not free capacity. It counts as a follower, caught
// up once the holds present at start are applied.
func (m *monitor) watchNodeAdmin(g *errgroup.Group, ctx context.Context) {
	m.followers++
	g.Go(func() error {
		err := m.bus.WatchKV(ctx, contracts.BucketNodeAdmin, m.onNodeAdmin, func() {
			m.caughtUp.Add(1)
			m.log.Debug("read model caught up", "what", "node holds")
		})
		if err != nil {
			return fmt.Errorf("%s: watch %s: %w", Name, contracts.BucketNodeAdmin, err)
		}
		return nil
	})
}

// onNodeAdmin applies one key of BucketNodeAdmin; a delete or purge lifts
// the node's holds. The key names the node, whatever the value says. An
// unreadable value is kept as a cordon, as the resource manager keeps it:
// the node takes no work, so its capacity is not free.
func (m *monitor) onNodeAdmin(e jetstream.KeyValueEntry) {
	node := e.Key()
	if err := contracts.ValidateID(node); err != nil {
		m.log.Warn("node admin key is not a node ID; ignored", "node_id", node, "err", err)
		return
	}
	if e.Operation() != jetstream.KeyValuePut {
		m.model.ApplyNodeAdmin(node, nil)
		return
	}
	a, err := contracts.DecodeNodeAdmin(node, e.Value())
	if err != nil {
		m.log.Warn("unreadable node admin record: counted as cordoned", "node_id", node, "kv_revision", e.Revision(), "err", err)
	}
	m.model.ApplyNodeAdmin(node, &a)
}

func (m *monitor) onJobEvent(msg *bus.Msg) error {
	var ev contracts.JobEvent
	if err := msg.Decode(&ev); err != nil {
		return err
	}
	// The subject is the trusted source of tenant and job.
	tenant, job := contracts.Token(msg.Subject, 3), contracts.Token(msg.Subject, 4)
	if err := m.model.ApplyJobEvent(tenant, job, ev); err != nil {
		if errors.Is(err, contracts.ErrTransition) {
			m.log.Debug("ignoring refused job event", "tenant", tenant, "job_id", job, "stream_seq", msg.StreamSeq, "err", err)
			return nil
		}
		return err
	}
	return nil
}

func (m *monitor) onLedger(msg *bus.Msg) error {
	var e contracts.LedgerEntry
	if err := msg.Decode(&e); err != nil {
		return err
	}
	m.model.ApplyLedger(e)
	return nil
}

func (m *monitor) onNode(msg *bus.Msg) error {
	nodeID := contracts.Token(msg.Subject, 3)
	switch contracts.Token(msg.Subject, 2) {
	case "inventory":
		var inv contracts.NodeInventory
		if err := msg.Decode(&inv); err != nil {
			return err
		}
		m.model.ApplyInventory(nodeID, inv, msgTime(msg))
	case "lifecycle":
		var ev contracts.NodeEvent
		if err := msg.Decode(&ev); err != nil {
			return err
		}
		m.model.ApplyNodeEvent(nodeID, ev)
	}
	return nil
}

// restoreAlerts replays the alerts the monitor published (node_silent and
// the rules' kinds) so that episode numbers continue and open episodes are
// resolved, not re-fired. It reads only the subjects of those kinds: the
// autoscaler's spot_interruption and billing's budget alerts share the
// stream (and may be many), and are none of the monitor's episodes.
func (m *monitor) restoreAlerts(ctx context.Context) error {
	n := 0
	last, err := m.bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamOps,
		FilterSubjects: m.alertSubjects()}, func(_ context.Context, msg *bus.Msg) error {
		if m.restoreAlert(msg) {
			n++
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("replay alerts: %w", err)
	}
	m.alertsSeq = last
	m.log.Debug("alerts restored", "alerts", n)
	return nil
}

// alertSubjects are the subjects of the monitor's own alert kinds.
func (m *monitor) alertSubjects() []string {
	subjects := []string{contracts.SubjectAlert(silence.Kind)}
	for _, k := range m.rules.Kinds() {
		subjects = append(subjects, contracts.SubjectAlert(k))
	}
	return subjects
}

// restoreAlert folds one published alert of the monitor's kinds into the
// silence detector or the rules engine; it reports whether it was one.
func (m *monitor) restoreAlert(msg *bus.Msg) bool {
	var a contracts.Alert
	if err := msg.Decode(&a); err != nil {
		m.log.Warn("skipping undecodable alert", "subject", msg.Subject, "stream_seq", msg.StreamSeq, "err", err)
		return false
	}
	// The subject is the trusted source of the kind.
	a.Kind = contracts.Token(msg.Subject, 2)
	var err error
	if a.Kind == silence.Kind {
		err = m.silent.Restore(a)
	} else {
		var ours bool
		ours, err = m.rules.Restore(a)
		if !ours {
			return false
		}
	}
	if err != nil {
		m.log.Warn("skipping alert", "subject", msg.Subject, "stream_seq", msg.StreamSeq, "err", err)
		return false
	}
	return true
}

// alertLoop checks for silent nodes a few times per SilentAfter, evaluates
// the rules every EvalInterval and whenever a sample meets an instant rule,
// and publishes every change. It is the only
// publisher of alerts, so a firing always goes out before its resolution.
func (m *monitor) alertLoop(ctx context.Context) error {
	t := time.NewTicker(checkInterval(m.cfg.SilentAfter))
	defer t.Stop()
	ev := time.NewTicker(m.cfg.EvalInterval)
	defer ev.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case now := <-ev.C:
			if err := m.evaluate(ctx, now); err != nil {
				return err
			}
		case <-m.rules.Urgent():
			// A sample met an instant rule (a hot GPU, an XID): evaluate
			// now rather than at the next tick.
			if err := m.evaluate(ctx, time.Now()); err != nil {
				return err
			}
		case now := <-t.C:
			// Only once every read model caught up: until the departures
			// are read, a replayed last sample of a machine deleted long
			// ago would fire node_silent, and a node forgotten before its
			// inventory, telemetry or heartbeat replays would come back
			// with no departure left to forget it by.
			if !m.caughtUpAll() {
				continue
			}
			m.model.Forget(now.Add(-m.cfg.SilentAfter))
			if !m.alerting() {
				continue // the leader checks and publishes; see lease.go
			}
			for _, c := range m.silent.Check(now) {
				a := c.Alert()
				if _, err := m.bus.Publish(ctx, contracts.SubjectAlert(silence.Kind), c.ID(), a, bus.CESubject(c.Node)); err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return fmt.Errorf("%s: publish alert %s: %w", Name, c.ID(), err)
				}
				m.log.Info("alert", "kind", silence.Kind, "state", c.State, "node_id", c.Node, "episode", c.Episode,
					"silence", c.Silence.Round(time.Millisecond))
			}
		}
	}
}

// evaluate samples the read model for the platform rules, evaluates every
// rule at now and publishes each transition.
func (m *monitor) evaluate(ctx context.Context, now time.Time) error {
	// Pool rules (fragmentation while jobs wait) read the read model, not
	// telemetry: sample it for them at each evaluation.
	for _, p := range m.model.Pressure() {
		m.rules.IngestPool(p.Pool, now, rules.PoolValues{FragmentationPct: p.Fragmentation * 100,
			PendingJobs: float64(p.PendingJobs)})
	}
	// Heartbeat ages only once every read model caught up: a replayed last
	// heartbeat of a machine deleted long ago must not count before its
	// departure has been read.
	if m.caughtUpAll() {
		for _, h := range m.model.Heartbeats() {
			m.rules.IngestNode(h.Node, h.Pool, now, rules.NodeValues{HeartbeatAge: h.Age(now)})
		}
	}
	if !m.alerting() {
		return nil // the windows are fed; the leader evaluates (lease.go)
	}
	for _, tr := range m.rules.Evaluate(now) {
		if _, err := m.bus.Publish(ctx, contracts.SubjectAlert(tr.Kind), tr.ID(), tr.Alert(), bus.CESubject(tr.Key)); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("%s: publish alert %s: %w", Name, tr.ID(), err)
		}
		m.log.Info("alert", "kind", tr.Kind, "state", tr.State, "key", tr.Key, "episode", tr.Episode,
			"value", tr.Value, "action", tr.Action)
	}
	return nil
}

// caughtUpAll reports whether every read model has read what its stream
// held at start.
func (m *monitor) caughtUpAll() bool { return int(m.caughtUp.Load()) >= m.followers }

func checkInterval(silentAfter time.Duration) time.Duration {
	return min(max(silentAfter/4, 10*time.Millisecond), time.Second)
}

// healthz answers 200 once the bus is connected and every read model has
// caught up with its stream, 503 before.
func (m *monitor) healthz(w http.ResponseWriter, _ *http.Request) {
	switch {
	case !m.bus.Conn().IsConnected():
		http.Error(w, "nats disconnected", http.StatusServiceUnavailable)
	case !m.caughtUpAll():
		http.Error(w, "catching up", http.StatusServiceUnavailable)
	default:
		_, _ = w.Write([]byte("ok\n"))
	}
}
