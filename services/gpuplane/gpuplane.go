// Package gpuplane composes every gpuplane service in one process on an
// embedded NATS JetStream server with a simulated fleet: what `make run`
// starts. It only calls each service's Run; the services still talk to each
// other through JetStream alone, exactly as when they run as separate
// processes.
package gpuplane

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"

	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/autoscaler"
	"github.com/gpuplane/gpuplane/services/billing"
	"github.com/gpuplane/gpuplane/services/gateway"
	"github.com/gpuplane/gpuplane/services/monitor"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
	resourcemanager "github.com/gpuplane/gpuplane/services/resource-manager"
	"github.com/gpuplane/gpuplane/services/scheduler"
)

// Config configures the all-in-one.
type Config struct {
	// DataDir keeps JetStream data (nats/) and run output (runs/); empty
	// means a temporary directory removed at exit.
	DataDir string
	// NATSPort of the embedded server on 127.0.0.1; -1 picks a free port.
	NATSPort int
	// GatewayAddr and MetricsAddr are where the gateway and the monitor
	// listen; port 0 picks a free port.
	GatewayAddr string
	MetricsAddr string
	// FleetFile describes the simulated fleet (YAML); empty means the
	// default fleet.
	FleetFile string
	// Fleet overrides FleetFile when set (tests and benchmarks).
	Fleet *fleet.Fleet
	// OTLPEndpoint receives traces of every service (Jaeger: 127.0.0.1:4318).
	OTLPEndpoint string
	// AgentLogDir keeps the output of runs; empty means DataDir/runs.
	AgentLogDir string
	// Scheduler, when set, adjusts the scheduler's configuration after
	// its defaults (tests shorten -min-runtime and -preempt-grace; the
	// bus settings are Run's own and set after it).
	Scheduler func(*scheduler.Config)
}

// DefaultConfig reads GPUPLANE_DATA_DIR, GPUPLANE_NATS_PORT,
// GPUPLANE_GATEWAY_ADDR, GPUPLANE_METRICS_ADDR, GPUPLANE_FLEET and
// GPUPLANE_OTLP_ENDPOINT, with local defaults.
func DefaultConfig() Config {
	c := Config{
		DataDir:      os.Getenv("GPUPLANE_DATA_DIR"),
		NATSPort:     4222,
		GatewayAddr:  envOr("GPUPLANE_GATEWAY_ADDR", "127.0.0.1:8080"),
		MetricsAddr:  envOr("GPUPLANE_METRICS_ADDR", "127.0.0.1:9400"),
		FleetFile:    os.Getenv("GPUPLANE_FLEET"),
		OTLPEndpoint: os.Getenv("GPUPLANE_OTLP_ENDPOINT"),
	}
	if p, err := strconv.Atoi(os.Getenv("GPUPLANE_NATS_PORT")); err == nil {
		c.NATSPort = p
	}
	return c
}

// RegisterFlags adds the all-in-one's flags to fs.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.DataDir, "data", c.DataDir, "JetStream data directory; empty for a temporary one (env GPUPLANE_DATA_DIR)")
	fs.IntVar(&c.NATSPort, "nats-port", c.NATSPort, "embedded NATS port on 127.0.0.1, -1 for any free port (env GPUPLANE_NATS_PORT)")
	fs.StringVar(&c.GatewayAddr, "gateway-addr", c.GatewayAddr, "gateway listen address (env GPUPLANE_GATEWAY_ADDR)")
	fs.StringVar(&c.MetricsAddr, "metrics-addr", c.MetricsAddr, "monitor /metrics listen address (env GPUPLANE_METRICS_ADDR)")
	fs.StringVar(&c.FleetFile, "fleet", c.FleetFile, "simulated fleet YAML; empty for the default fleet (env GPUPLANE_FLEET)")
	fs.StringVar(&c.OTLPEndpoint, "otlp", c.OTLPEndpoint, "OTLP/HTTP endpoint host:port for traces (env GPUPLANE_OTLP_ENDPOINT)")
	fs.StringVar(&c.AgentLogDir, "run-logs", c.AgentLogDir, "directory for the output of runs; empty for a temporary one")
}

// Validate reports every problem at once.
func (c Config) Validate() error {
	var errs []error
	if c.NATSPort == 0 || c.NATSPort < -1 || c.NATSPort > 65535 {
		errs = append(errs, fmt.Errorf("nats port %d: want 1-65535 or -1", c.NATSPort))
	}
	for name, addr := range map[string]string{"gateway": c.GatewayAddr, "metrics": c.MetricsAddr} {
		if _, _, err := net.SplitHostPort(addr); err != nil {
			errs = append(errs, fmt.Errorf("%s address %q: %w", name, addr, err))
		}
	}
	return errors.Join(errs...)
}

// Endpoints are where a running all-in-one can be reached.
type Endpoints struct {
	NATSURL    string
	DataDir    string
	RunLogDir  string
	GatewayURL string
	MetricsURL string
	Fleet      fleet.Fleet
}

// Run starts the embedded server, every service and the fleet, calls ready
// once the gateway and monitor listen, and blocks until ctx ends. It stops
// the services first and the server last.
func Run(ctx context.Context, cfg Config, log *slog.Logger, ready func(Endpoints)) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	fl, err := loadFleet(cfg)
	if err != nil {
		return err
	}
	// Everything the all-in-one writes lives under one root: JetStream
	// data in nats/, run output in runs/. A temporary root is removed at
	// exit, so Ctrl-C leaves nothing behind.
	root := cfg.DataDir
	if root == "" {
		if root, err = os.MkdirTemp("", "gpuplane-*"); err != nil {
			return fmt.Errorf("create data directory: %w", err)
		}
		defer os.RemoveAll(root)
	}
	if cfg.AgentLogDir == "" {
		cfg.AgentLogDir = filepath.Join(root, "runs")
	}
	if err := os.MkdirAll(cfg.AgentLogDir, 0o755); err != nil {
		return fmt.Errorf("create run log directory: %w", err)
	}
	srv, err := natsserver.Start(ctx, natsserver.Options{Port: cfg.NATSPort, StoreDir: filepath.Join(root, "nats")})
	if err != nil {
		return err
	}
	defer srv.Shutdown()

	busCfg := service.BusConfig{NATSURL: srv.URL(), Replicas: 1, OTLPEndpoint: cfg.OTLPEndpoint}
	ep := Endpoints{NATSURL: srv.URL(), DataDir: root, RunLogDir: cfg.AgentLogDir, Fleet: fl}

	var mu sync.Mutex
	pending := 2
	listened := func(set func(addr string)) func(string) {
		return func(addr string) {
			mu.Lock()
			defer mu.Unlock()
			set(addr)
			if pending--; pending == 0 && ready != nil {
				ready(ep)
			}
		}
	}

	g, ctx := errgroup.WithContext(ctx)
	run := func(name string, fn func(context.Context) error) {
		g.Go(func() error {
			if err := fn(ctx); err != nil && !errors.Is(err, context.Canceled) {
				return fmt.Errorf("%s: %w", name, err)
			}
			return nil
		})
	}

	rm := resourcemanager.DefaultConfig()
	rm.Bus = busCfg
	run("resource-manager", func(ctx context.Context) error { return resourcemanager.Run(ctx, rm, log) })

	sc := scheduler.DefaultConfig()
	if cfg.Scheduler != nil {
		cfg.Scheduler(&sc)
	}
	sc.Bus = busCfg
	run("scheduler", func(ctx context.Context) error { return scheduler.Run(ctx, sc, log) })

	bl := billing.DefaultConfig()
	bl.Bus = busCfg
	run("billing", func(ctx context.Context) error { return billing.Run(ctx, bl, log) })

	as := autoscaler.DefaultConfig()
	as.Bus = busCfg
	run("autoscaler", func(ctx context.Context) error { return autoscaler.Run(ctx, as, log) })

	mo := monitor.DefaultConfig()
	mo.Bus = busCfg
	mo.Addr = cfg.MetricsAddr
	mo.OnListen = listened(func(a string) { ep.MetricsURL = "http://" + a + "/metrics" })
	run("monitor", func(ctx context.Context) error { return monitor.Run(ctx, mo, log) })

	gw := gateway.DefaultConfig()
	gw.Bus = busCfg
	gw.Addr = cfg.GatewayAddr
	gw.OnListen = listened(func(a string) { ep.GatewayURL = "http://" + a })
	run("gateway", func(ctx context.Context) error { return gateway.Run(ctx, gw, log) })

	run("fleet", func(ctx context.Context) error {
		return runFleet(ctx, fl, busCfg, cfg.AgentLogDir, filepath.Join(root, "checkpoints"), log)
	})

	return g.Wait()
}

func loadFleet(cfg Config) (fleet.Fleet, error) {
	if cfg.Fleet != nil {
		return *cfg.Fleet, nil
	}
	if cfg.FleetFile == "" {
		return fleet.Default(), nil
	}
	return fleet.Load(cfg.FleetFile)
}

// runFleet runs the simulated node agents on one shared connection. They
// share one checkpoint root, as machines with shared storage would, so a
// job's later attempt on another machine finds its checkpoints.
func runFleet(ctx context.Context, fl fleet.Fleet, busCfg service.BusConfig, logDir, checkpointDir string, log *slog.Logger) error {
	rt, err := service.Start(ctx, "node-agent-fleet", busCfg, log)
	if err != nil {
		return err
	}
	defer rt.Close()
	agent := nodeagent.DefaultConfig()
	agent.Bus = busCfg
	agent.LogDir = logDir
	agent.CheckpointDir = checkpointDir
	return fleet.Run(ctx, fl, rt.Bus, agent, log)
}

func envOr(k, d string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return d
}
