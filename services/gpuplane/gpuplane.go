// Package gpuplane composes every gpuplane service in one process on an
// embedded NATS JetStream server with a simulated fleet: what `make run`
// starts. It only calls each service's Run; the services still talk to each
// other through JetStream alone, exactly as when they run as separate
// processes.
package gpuplane

import (
	"context"
	_ "embed"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/autoscaler"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/autoscaler/simcloud"
	"github.com/gpuplane/gpuplane/services/billing"
	"github.com/gpuplane/gpuplane/services/gateway"
	"github.com/gpuplane/gpuplane/services/gpuctl"
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
	// FleetFile describes the simulated fleet (YAML); empty means
	// DefaultFleet.
	FleetFile string
	// Identities are the bus identities to mint creds for (see
	// deploy/identities.yaml); the default is that file's content. It
	// must name operator, fleet and each service.
	Identities natsauth.Description
	// Fleet overrides FleetFile when set (tests and benchmarks).
	Fleet *fleet.Fleet
	// GpuctlConfigDir, when set, receives gpuctl's credentials for the
	// local platform admin (gpuctl.SaveCredential), so gpuctl works at
	// once; the binary's -gpuctl-config defaults to the user's.
	GpuctlConfigDir string
	// OTLPEndpoint receives traces of every service (Jaeger: 127.0.0.1:4318).
	OTLPEndpoint string
	// AgentLogDir keeps the output of runs; empty means DataDir/runs.
	AgentLogDir string
	// Autoscale lists the pools the autoscaler runs on a simulated cloud
	// provider (package simcloud): their machines are created, booted
	// after ProvisionDelay (a node agent starts), interrupted (spot) and
	// reclaimed (the agent dies with its runs) at run time. Each pool's
	// MachineType must be one of the fleet's machine types; a fleet pool
	// of the same name (count 0 makes it a template only), else the first
	// of the same machine type and price class, lends its zone, purpose,
	// labels and taints. Empty: no autoscaled pools (flag -autoscale "").
	Autoscale []AutoscalePool
	// SpotNotice is how long before the reclaim a spot machine is given
	// notice (default 2m, the clouds' figure; tests shorten it).
	SpotNotice time.Duration
	// Autoscaler, when set, adjusts the autoscaler's configuration after
	// its defaults and the pools of Autoscale (tests shorten cooldowns).
	Autoscaler func(*autoscaler.Config)
	// Scheduler, when set, adjusts the scheduler's configuration after
	// its defaults (tests shorten -min-runtime and -preempt-grace; the
	// bus settings are Run's own and set after it).
	Scheduler func(*scheduler.Config)
	// Monitor, when set, adjusts the monitor's configuration after its
	// defaults (tests pass a rules file with short durations).
	Monitor func(*monitor.Config)
	// NATS, when set, is a NATS (cluster) already running to use instead
	// of the embedded server: tests and benchmarks run the platform on
	// natstest.StartCluster with R3 streams, as production does.
	NATS *ExternalNATS
	// Agent, when set, adjusts every simulated agent's configuration after
	// the all-in-one's (tests: a small image cache, another runc).
	Agent func(*nodeagent.Config)
}

// ExternalNATS is a running NATS the platform uses instead of starting
// its own.
type ExternalNATS struct {
	// URL lists the servers' client URLs, comma separated.
	URL string
	// Trust is the operator and accounts the servers trust; the
	// platform's creds are minted from it.
	Trust *natsauth.Trust
	// Replicas of every stream and bucket (1, 3 or 5).
	Replicas int
}

// AutoscalePool is one pool the autoscaler manages on the simulated
// provider.
type AutoscalePool struct {
	Name        string
	MachineType string // a machine type of the fleet
	PriceClass  string // on-demand or spot
	Min, Max    int
	// ProvisionDelay is how long a created machine takes to boot.
	ProvisionDelay time.Duration
	// UpCooldown (0: the autoscaler's -cooldown), DownCooldown and IdleFor
	// as in autoscaler.Pool.
	UpCooldown, DownCooldown, IdleFor time.Duration
}

// DefaultAutoscale is the autoscaled pool of `make run`: L4 spot machines
// of the default fleet's type, at least one, at most three.
func DefaultAutoscale() []AutoscalePool {
	return []AutoscalePool{{Name: "l4-spot", MachineType: "pcie-l4-4", PriceClass: cloud.Spot, Min: 1, Max: 3,
		ProvisionDelay: 15 * time.Second, DownCooldown: 2 * time.Minute, IdleFor: 5 * time.Minute}}
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
		Autoscale:    DefaultAutoscale(),
		SpotNotice:   simcloud.NoticeAhead,
		Identities:   natsauth.DefaultDescription(),
	}
	if p, err := strconv.Atoi(os.Getenv("GPUPLANE_NATS_PORT")); err == nil {
		c.NATSPort = p
	}
	return c
}

// RegisterFlags adds the all-in-one's flags to fs.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.Func("identities", "YAML description of the bus identities (default: deploy/identities.yaml's content)", func(path string) error {
		d, err := natsauth.LoadDescription(path)
		if err != nil {
			return err
		}
		c.Identities = d
		return nil
	})
	fs.StringVar(&c.DataDir, "data", c.DataDir, "JetStream data directory; empty for a temporary one (env GPUPLANE_DATA_DIR)")
	fs.IntVar(&c.NATSPort, "nats-port", c.NATSPort, "embedded NATS port on 127.0.0.1, -1 for any free port (env GPUPLANE_NATS_PORT)")
	fs.StringVar(&c.GatewayAddr, "gateway-addr", c.GatewayAddr, "gateway listen address (env GPUPLANE_GATEWAY_ADDR)")
	fs.StringVar(&c.MetricsAddr, "metrics-addr", c.MetricsAddr, "monitor /metrics listen address (env GPUPLANE_METRICS_ADDR)")
	fs.StringVar(&c.FleetFile, "fleet", c.FleetFile, "simulated fleet YAML; empty for the built-in one (services/gpuplane/fleet.yaml; env GPUPLANE_FLEET)")
	fs.StringVar(&c.OTLPEndpoint, "otlp", c.OTLPEndpoint, "OTLP/HTTP endpoint host:port for traces (env GPUPLANE_OTLP_ENDPOINT)")
	fs.StringVar(&c.AgentLogDir, "run-logs", c.AgentLogDir, "directory for the output of runs; empty for a temporary one")
	if c.GpuctlConfigDir == "" {
		c.GpuctlConfigDir, _ = gpuctl.ConfigDir(os.Getenv)
	}
	fs.StringVar(&c.GpuctlConfigDir, "gpuctl-config", c.GpuctlConfigDir,
		"where to store gpuctl's login as the local platform admin; empty to leave gpuctl's config alone")
	fs.Var((*autoscalePools)(&c.Autoscale), "autoscale",
		"autoscaled pools on the simulated cloud, as name:machineType:priceClass:min:max[:provisionDelay][,...]; empty for none")
	fs.DurationVar(&c.SpotNotice, "spot-notice", c.SpotNotice, "how long before its reclaim a simulated spot machine is given notice")
}

// autoscalePools is the flag.Value of -autoscale; setting it replaces the
// list. Cooldowns and idle time take DefaultAutoscale's.
type autoscalePools []AutoscalePool

func (p *autoscalePools) String() string {
	if p == nil {
		return ""
	}
	var parts []string
	for _, a := range *p {
		parts = append(parts, fmt.Sprintf("%s:%s:%s:%d:%d:%s", a.Name, a.MachineType, a.PriceClass, a.Min, a.Max, a.ProvisionDelay))
	}
	return strings.Join(parts, ",")
}

func (p *autoscalePools) Set(s string) error {
	var out []AutoscalePool
	def := DefaultAutoscale()[0]
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		f := strings.Split(part, ":")
		if len(f) != 5 && len(f) != 6 {
			return fmt.Errorf("%q: want name:machineType:priceClass:min:max[:provisionDelay]", part)
		}
		a := AutoscalePool{Name: f[0], MachineType: f[1], PriceClass: f[2], ProvisionDelay: def.ProvisionDelay,
			DownCooldown: def.DownCooldown, IdleFor: def.IdleFor}
		var err1, err2, err3 error
		a.Min, err1 = strconv.Atoi(f[3])
		a.Max, err2 = strconv.Atoi(f[4])
		if len(f) == 6 {
			a.ProvisionDelay, err3 = time.ParseDuration(f[5])
		}
		if err := errors.Join(err1, err2, err3); err != nil {
			return fmt.Errorf("%q: %w", part, err)
		}
		out = append(out, a)
	}
	*p = out
	return nil
}

// Validate reports every problem at once.
func (c Config) Validate() error {
	var errs []error
	if c.NATS != nil && (c.NATS.URL == "" || c.NATS.Trust == nil) {
		errs = append(errs, errors.New("external nats: want a URL and its trust"))
	}
	if c.NATSPort == 0 || c.NATSPort < -1 || c.NATSPort > 65535 {
		errs = append(errs, fmt.Errorf("nats port %d: want 1-65535 or -1", c.NATSPort))
	}
	for name, addr := range map[string]string{"gateway": c.GatewayAddr, "metrics": c.MetricsAddr} {
		if _, _, err := net.SplitHostPort(addr); err != nil {
			errs = append(errs, fmt.Errorf("%s address %q: %w", name, addr, err))
		}
	}
	seen := map[string]bool{}
	for _, a := range c.Autoscale {
		if seen[a.Name] {
			errs = append(errs, fmt.Errorf("autoscale: pool %s named twice", a.Name))
		}
		seen[a.Name] = true
		if err := a.policy().Validate(a.Name); err != nil {
			errs = append(errs, fmt.Errorf("autoscale: %w", err))
		}
		if a.ProvisionDelay < 0 {
			errs = append(errs, fmt.Errorf("autoscale: pool %s: provision delay %s; want >= 0", a.Name, a.ProvisionDelay))
		}
	}
	if err := c.Identities.Validate(); err != nil {
		errs = append(errs, err)
	}
	for _, name := range []string{"operator", "fleet", "scheduler", "resource-manager", "billing", "autoscaler", "monitor", "gateway"} {
		if _, ok := c.Identities.Find(name); !ok {
			errs = append(errs, fmt.Errorf("identities: no identity named %q", name))
		}
	}
	if c.SpotNotice < 0 {
		errs = append(errs, fmt.Errorf("spot notice %s; want >= 0", c.SpotNotice))
	}
	return errors.Join(errs...)
}

func (a AutoscalePool) policy() autoscaler.Pool {
	return autoscaler.Pool{Min: a.Min, Max: a.Max, MachineType: a.MachineType, PriceClass: a.PriceClass,
		UpCooldown: a.UpCooldown, DownCooldown: a.DownCooldown, IdleFor: a.IdleFor}
}

// Endpoints are where a running all-in-one can be reached.
type Endpoints struct {
	NATSURL    string
	DataDir    string
	RunLogDir  string
	GatewayURL string
	MetricsURL string
	Fleet      fleet.Fleet
	// Autoscale is the autoscaled pools (Config.Autoscale).
	Autoscale []AutoscalePool
	// CredsDir holds a NATS creds file per identity of Config.Identities
	// (operator.creds, admin.creds, tenant-acme.creds, ...); Creds maps
	// each identity's name to its file.
	CredsDir string
	Creds    map[string]string
	// AdminToken is an API token of a local platform admin and DemoToken
	// one of a member of the demo tenant acme; both are also in
	// TokensDir (admin.token, demo-acme.token) and change at each start.
	AdminToken, DemoToken string
	TokensDir             string
	// Cloud is the simulated provider of the autoscaled pools, nil when
	// there are none. Tests drive faults through it: Interrupt(machineID)
	// gives a spot notice (reclaimed SpotNotice later), SetFailing(true,
	// nil) takes the provider down until SetFailing(false, nil),
	// LoseReplies(n) makes the next n creates act but answer with an
	// error, Machines() lists every machine (node ID = machine ID), Calls()
	// counts calls.
	Cloud *simcloud.Provider
	// Images are the references of the built-in registry
	// (LocalRegistryHost), which the agents reach in-process: BusyboxRef
	// where this machine has a static busybox. ImagesNote says why there
	// are none, or what container runs need here that is missing (runc,
	// root); "" when they can run.
	Images     []string
	ImagesNote string
	// Registry is the built-in registry: tests push images to it.
	Registry *LocalRegistry
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
	// Authentication is on here too: the trust (the keys that mint
	// credentials) is kept in the data directory, every service connects
	// as its own identity, and the operator's, an admin's and the demo
	// tenant's creds are left in creds/ for people and the nats CLI.
	var trust *natsauth.Trust
	if cfg.NATS != nil {
		trust = cfg.NATS.Trust
	} else if trust, err = natsauth.LoadOrCreate(filepath.Join(root, "trust")); err != nil {
		return err
	}
	creds, err := trust.WriteAll(filepath.Join(root, "creds"), cfg.Identities)
	if err != nil {
		return err
	}
	natsURL, streams := "", contracts.StreamOptions{Replicas: 1}
	if cfg.NATS != nil {
		natsURL, streams.Replicas = cfg.NATS.URL, max(cfg.NATS.Replicas, 1)
	} else {
		srv, err := natsserver.Start(ctx, natsserver.Options{Port: cfg.NATSPort, StoreDir: filepath.Join(root, "nats"), Trust: trust})
		if err != nil {
			return err
		}
		defer srv.Shutdown()
		natsURL = srv.URL()
	}
	if err := provision(ctx, natsURL, creds["operator"], streams, log); err != nil {
		return err
	}
	admin, demo, err := localLogins(ctx, natsURL, creds["operator"], streams, filepath.Join(root, "tokens"), log)
	if err != nil {
		return err
	}

	busCfg := service.BusConfig{NATSURL: natsURL, Replicas: streams.Replicas, OTLPEndpoint: cfg.OTLPEndpoint}
	as := func(name string) service.BusConfig {
		c := busCfg
		c.Creds = creds[name]
		return c
	}
	ep := Endpoints{NATSURL: natsURL, DataDir: root, RunLogDir: cfg.AgentLogDir, Fleet: fl, Autoscale: cfg.Autoscale,
		Creds: creds, CredsDir: filepath.Join(root, "creds"), AdminToken: admin, DemoToken: demo, TokensDir: filepath.Join(root, "tokens")}
	ep.Registry, ep.Images, ep.ImagesNote = builtinImages(log)
	tuneAgent := func(a *nodeagent.Config) {
		a.ImageTransport = ep.Registry.Transport(nil)
		if cfg.Agent != nil {
			cfg.Agent(a)
		}
	}
	var machines *simMachines
	if len(cfg.Autoscale) > 0 {
		if machines, err = newSimMachines(cfg, fl, log); err != nil {
			return err
		}
		ep.Cloud = machines.cloud
	}

	var mu sync.Mutex
	pending := 2
	listened := func(set func(addr string)) func(string) {
		return func(addr string) {
			mu.Lock()
			defer mu.Unlock()
			set(addr)
			if pending--; pending == 0 {
				saveGpuctlLogin(cfg.GpuctlConfigDir, ep, log)
				if ready != nil {
					ready(ep)
				}
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
	rm.Bus = as("resource-manager")
	run("resource-manager", func(ctx context.Context) error { return resourcemanager.Run(ctx, rm, log) })

	sc := scheduler.DefaultConfig()
	// The all-in-one runs host commands as well as images (the README
	// tour's jobs are commands); a production pool runs images only unless
	// its runtime policy says otherwise (issue 14).
	sc.AllowHostCommands = true
	// Every service shares this process's cores: a cycle over a backlog
	// rests four times its own length (not once, as a scheduler on cores
	// of its own does), leaving the rest to the agents, the resource
	// manager and the bus, whose work is what frees GPUs. Under a steady
	// 1,000 jobs/s on 2 cores (BenchmarkSteadyLoad, beyond what they keep
	// up with) that served 13 % more jobs/s with 12 % less CPU per job; a
	// short cycle's rest stays a few milliseconds.
	sc.CycleRest = sharedCoresCycleRest
	if cfg.Scheduler != nil {
		cfg.Scheduler(&sc)
	}
	sc.Bus = as("scheduler")
	run("scheduler", func(ctx context.Context) error { return scheduler.Run(ctx, sc, log) })

	bl := billing.DefaultConfig()
	bl.Bus = as("billing")
	run("billing", func(ctx context.Context) error { return billing.Run(ctx, bl, log) })

	asc := autoscaler.DefaultConfig()
	if machines != nil {
		asc.Provider = machines.cloud
		asc.Pools = map[string]autoscaler.Pool{}
		for _, a := range cfg.Autoscale {
			asc.Pools[a.Name] = a.policy()
		}
	}
	if cfg.Autoscaler != nil {
		cfg.Autoscaler(&asc)
	}
	asc.Bus = as("autoscaler")
	run("autoscaler", func(ctx context.Context) error { return autoscaler.Run(ctx, asc, log) })

	mo := monitor.DefaultConfig()
	if cfg.Monitor != nil {
		cfg.Monitor(&mo)
	}
	mo.Bus = as("monitor")
	mo.Addr = cfg.MetricsAddr
	mo.OnListen = listened(func(a string) { ep.MetricsURL = "http://" + a + "/metrics" })
	run("monitor", func(ctx context.Context) error { return monitor.Run(ctx, mo, log) })

	gw := gateway.DefaultConfig()
	gw.Bus = as("gateway")
	gw.Addr = cfg.GatewayAddr
	gw.OnListen = listened(func(a string) { ep.GatewayURL = "http://" + a })
	run("gateway", func(ctx context.Context) error { return gateway.Run(ctx, gw, log) })

	run("fleet", func(ctx context.Context) error {
		return runFleet(ctx, fl, as("fleet"), cfg.AgentLogDir, filepath.Join(root, "checkpoints"), tuneAgent, log)
	})
	if machines != nil {
		run("simulated-cloud", func(ctx context.Context) error {
			return machines.run(ctx, as("fleet"), cfg.AgentLogDir, filepath.Join(root, "checkpoints"), tuneAgent)
		})
	}

	return g.Wait()
}

// sharedCoresCycleRest is the all-in-one scheduler's CycleRest.
const sharedCoresCycleRest = 4

// provision creates or updates every stream and KV bucket as the
// operator, before any service starts: services may only create what is
// missing, so a changed stream config (a new DenyPurge, say) reaches an
// existing data directory only through here.
func provision(ctx context.Context, url, creds string, streams contracts.StreamOptions, log *slog.Logger) error {
	b, err := bus.Connect(ctx, bus.Config{URL: url, Name: "provision", CredsFile: creds, Logger: log, Streams: streams})
	if err != nil {
		return fmt.Errorf("provision: %w", err)
	}
	defer b.Close(ctx)
	for _, kv := range contracts.KeyValues(streams) {
		if _, err := b.KeyValue(ctx, kv.Bucket); err != nil {
			return fmt.Errorf("provision: %w", err)
		}
	}
	return nil
}

func loadFleet(cfg Config) (fleet.Fleet, error) {
	if cfg.Fleet != nil {
		return *cfg.Fleet, nil
	}
	if cfg.FleetFile == "" {
		return DefaultFleet()
	}
	return fleet.Load(cfg.FleetFile)
}

//go:embed fleet.yaml
var defaultFleet []byte

// DefaultFleet is the simulated fleet of `make run` (fleet.yaml, compiled
// in): shaped so that every step of the README's tour finds what it asks
// for, a MIG machine and spot capacity included.
func DefaultFleet() (fleet.Fleet, error) {
	f, err := fleet.Parse(defaultFleet)
	if err != nil {
		return fleet.Fleet{}, fmt.Errorf("default fleet: %w", err)
	}
	return f, nil
}

// runFleet runs the simulated node agents on one shared connection. They
// share one checkpoint root, as machines with shared storage would, so a
// job's later attempt on another machine finds its checkpoints.
func runFleet(ctx context.Context, fl fleet.Fleet, busCfg service.BusConfig, logDir, checkpointDir string, tune func(*nodeagent.Config), log *slog.Logger) error {
	rt, err := service.Start(ctx, "node-agent-fleet", busCfg, log)
	if err != nil {
		return err
	}
	defer rt.Close()
	return fleet.Run(ctx, fl, rt.Bus, agentConfig(busCfg, logDir, checkpointDir, tune), log)
}

// agentConfig is the configuration of every simulated agent, static or
// autoscaled: one log root and one checkpoint root for all, then tune's
// changes (nil: none).
func agentConfig(busCfg service.BusConfig, logDir, checkpointDir string, tune func(*nodeagent.Config)) nodeagent.Config {
	agent := nodeagent.DefaultConfig()
	agent.Bus = busCfg
	agent.LogDir = logDir
	agent.CheckpointDir = checkpointDir
	if tune != nil {
		tune(&agent)
	}
	return agent
}

func envOr(k, d string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return d
}

// localLogins issues the API tokens of make run's two users: a local
// platform admin and a member of the demo tenant acme. Their IDs are
// fixed, so each start replaces the secrets of the last one. The secrets
// are written to dir (0600) for people and scripts.
func localLogins(ctx context.Context, url, creds string, streams contracts.StreamOptions, dir string, log *slog.Logger) (admin, demo string, err error) {
	// The operator's connect updates each stream that differs from
	// streams: it needs the same replicas as provision, or it would scale
	// R3 down.
	b, err := bus.Connect(ctx, bus.Config{URL: url, Name: "logins", CredsFile: creds, Logger: log, Streams: streams})
	if err != nil {
		return "", "", fmt.Errorf("local logins: %w", err)
	}
	defer b.Close(ctx)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", "", fmt.Errorf("local logins: %w", err)
	}
	for _, u := range []struct {
		grant gateway.Grant
		out   *string
		file  string
	}{
		{gateway.Grant{ID: "local-admin", Name: "local platform admin", Bindings: []contracts.Binding{{Role: contracts.RolePlatformAdmin}}}, &admin, "admin.token"},
		{gateway.Grant{ID: "demo-acme", Name: "demo user of tenant acme", Bindings: []contracts.Binding{{Role: contracts.RoleMember, Tenant: "acme"}}}, &demo, "demo-acme.token"},
	} {
		if *u.out, err = gateway.IssueToken(ctx, b, u.grant); err != nil {
			return "", "", fmt.Errorf("local logins: %w", err)
		}
		if err := os.WriteFile(filepath.Join(dir, u.file), []byte(*u.out+"\n"), 0o600); err != nil {
			return "", "", fmt.Errorf("local logins: %w", err)
		}
	}
	return admin, demo, nil
}

// saveGpuctlLogin stores the local admin's token as gpuctl's login for
// this gateway, so gpuctl works right away.
func saveGpuctlLogin(dir string, ep Endpoints, log *slog.Logger) {
	if dir == "" {
		return
	}
	err := gpuctl.SaveCredential(dir, ep.GatewayURL, gpuctl.Credential{Token: ep.AdminToken, Method: "token",
		Subject: "token:local-admin"})
	if err != nil {
		log.Warn("gpuctl login not stored; use gpuctl login --token", "dir", dir, "err", err)
	}
}
