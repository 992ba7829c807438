// Package monitor is gpuplane's monitoring service. It follows telemetry,
// job events, the allocation ledger and the node inventory into a read
// model, serves it as Prometheus metrics (dcgm-exporter names for GPUs,
// gpuplane_ for the platform), and raises node_silent alerts on the bus when
// a node stops sending telemetry.
//
//	TELEMETRY (last per node, then new) ─┐
//	JOB_EVENTS (from the start)  ─────────┼─> readmodel ──> metrics.Collector ──> GET /metrics
//	ALLOCATIONS ledger (from the start) ──┤
//	NODES inventory+lifecycle ────────────┘
//	TELEMETRY ──> silence.Detector ──(tick)──> gp.alerts.node_silent (OPS)
//
// The monitor owns no log of record: every read model is rebuilt from the
// streams at start, and alert episodes from the alerts it published.
package monitor

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/libs/telemetry"
	"github.com/gpuplane/gpuplane/services/monitor/internal/metrics"
	"github.com/gpuplane/gpuplane/services/monitor/internal/readmodel"
	"github.com/gpuplane/gpuplane/services/monitor/internal/silence"
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
	// OnListen, if set, is called with the bound HTTP address once the
	// listener is open. Not a flag.
	OnListen func(addr string)
}

// DefaultConfig returns the defaults, with the bus settings from the
// environment.
func DefaultConfig() Config {
	return Config{Bus: service.DefaultBusConfig(), Addr: "127.0.0.1:9400", SilentAfter: 3 * time.Second}
}

// RegisterFlags adds the monitor's flags to fs, defaulting to c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	c.Bus.RegisterFlags(fs)
	fs.StringVar(&c.Addr, "addr", c.Addr, "HTTP listen address for /metrics and /healthz")
	fs.DurationVar(&c.SilentAfter, "silent-after", c.SilentAfter, "raise node_silent when a node sends no telemetry for this long")
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
	return errors.Join(errs...)
}

// Run runs the monitor until ctx ends; it returns nil on a clean shutdown.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("%s: %w", Name, err)
	}
	if log == nil {
		log = slog.Default()
	}
	rt, err := service.Start(ctx, Name, cfg.Bus, log)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer rt.Close()
	m := &monitor{cfg: cfg, bus: rt.Bus, log: rt.Log, model: readmodel.New(), silent: silence.New(cfg.SilentAfter)}
	if err := m.restoreAlerts(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("%s: %w", Name, err)
	}

	reg := telemetry.NewRegistry()
	reg.MustRegister(metrics.New(m.model, cfg.SilentAfter, time.Now))
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
	// followers and caughtUp count the read models and those that have
	// read what their stream held at start. followers is set before the
	// HTTP server starts and never changes after.
	followers int
	caughtUp  atomic.Int32
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
	var t contracts.Telemetry
	if err := msg.Decode(&t); err != nil {
		return err
	}
	nodeID := contracts.Token(msg.Subject, 2)
	if nodeID == "" {
		return fmt.Errorf("no node in subject %q", msg.Subject)
	}
	at := msg.Timestamp
	if at.IsZero() {
		at = time.Now()
	}
	m.model.ApplyTelemetry(nodeID, t, at)
	m.silent.Seen(nodeID, t.Pool, t.Hostname, at)
	return nil
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
		m.model.ApplyInventory(nodeID, inv)
	case "lifecycle":
		var ev contracts.NodeEvent
		if err := msg.Decode(&ev); err != nil {
			return err
		}
		m.model.ApplyNodeEvent(nodeID, ev)
	}
	return nil
}

// restoreAlerts replays the node_silent alerts already published so that
// episode numbers continue and open episodes are resolved, not re-fired.
func (m *monitor) restoreAlerts(ctx context.Context) error {
	n := 0
	_, err := m.bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamOps,
		FilterSubjects: []string{contracts.SubjectAlert(silence.Kind)}}, func(_ context.Context, msg *bus.Msg) error {
		var a contracts.Alert
		if err := msg.Decode(&a); err != nil {
			m.log.Warn("skipping undecodable alert", "subject", msg.Subject, "stream_seq", msg.StreamSeq, "err", err)
			return nil
		}
		if err := m.silent.Restore(a); err != nil {
			m.log.Warn("skipping alert", "subject", msg.Subject, "stream_seq", msg.StreamSeq, "err", err)
			return nil
		}
		n++
		return nil
	})
	if err != nil {
		return fmt.Errorf("replay alerts: %w", err)
	}
	m.log.Debug("alerts restored", "alerts", n)
	return nil
}

// alertLoop checks for silent nodes a few times per SilentAfter and publishes
// every change. It is the only publisher of alerts, so a firing always goes
// out before its resolution.
func (m *monitor) alertLoop(ctx context.Context) error {
	t := time.NewTicker(checkInterval(m.cfg.SilentAfter))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case now := <-t.C:
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

func checkInterval(silentAfter time.Duration) time.Duration {
	return min(max(silentAfter/4, 10*time.Millisecond), time.Second)
}

// healthz answers 200 once the bus is connected and every read model has
// caught up with its stream, 503 before.
func (m *monitor) healthz(w http.ResponseWriter, _ *http.Request) {
	switch {
	case !m.bus.Conn().IsConnected():
		http.Error(w, "nats disconnected", http.StatusServiceUnavailable)
	case int(m.caughtUp.Load()) < m.followers:
		http.Error(w, "catching up", http.StatusServiceUnavailable)
	default:
		_, _ = w.Write([]byte("ok\n"))
	}
}
