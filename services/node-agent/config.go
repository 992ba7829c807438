package nodeagent

import (
	"errors"
	"flag"
	"fmt"
	"maps"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/catalog"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/sim"
)

// Defaults of Config.
const (
	DefaultHeartbeatInterval = 2 * time.Second
	// DefaultInventoryInterval republishes the inventory well within the
	// NODES stream's 7-day max age.
	DefaultInventoryInterval = time.Hour
	DefaultTelemetryInterval = time.Second
	DefaultStopGrace         = 10 * time.Second
	DefaultPool              = "default"
	DefaultGPUModel          = "H100-80GB"
	DefaultGPUCount          = 8
	// DefaultSimLogDelay: see Config.SimLogDelay.
	DefaultSimLogDelay = time.Minute
)

// Backend kinds (Config.BackendKind).
const (
	// BackendSim simulates GPUModel × GPUCount GPUs.
	BackendSim = "sim"
	// BackendNVML reads this machine's NVIDIA GPUs through NVML; the agent
	// refuses to start where the driver's library is missing.
	BackendNVML = "nvml"
)

// PriceClasses are the values PriceClass may take ("" means unset).
var PriceClasses = []string{"on-demand", "spot", "reserved"}

// Config configures one node agent.
type Config struct {
	// Bus is used by Run only; RunWithBus is given a connected bus.
	Bus service.BusConfig

	// NodeID names the machine on every subject; [A-Za-z0-9_-], unique.
	NodeID      string
	Hostname    string
	Pool        string
	Zone        string
	MachineType string // "" derives one from the GPUs, e.g. "sim-h100-80gb-x8"
	PriceClass  string // on-demand, spot, reserved or ""
	Labels      map[string]string
	// Purpose is what the machine is for ("training", "inference", ...);
	// a node selector or a pool policy may use it. "" means unset.
	Purpose string
	// Taints keep jobs that do not tolerate them off the node (NoSchedule)
	// or off it while another node fits (PreferNoSchedule): spot capacity,
	// machines dedicated to a team, hardware under test.
	Taints []contracts.Taint

	// GPUModel (a contracts.GPUModels identifier), GPUCount and NVLink
	// shape the simulated backend; ignored when Backend is set.
	GPUModel string
	GPUCount int
	NVLink   bool
	// NVLinkBridges joins simulated PCIe cards in pairs with NVLink
	// bridges (models that take them: H100 PCIe).
	NVLinkBridges bool
	// MIGEnabled puts every simulated GPU in MIG mode with the instances
	// of MIGLayout ("3g.40gb", ...), placed by NVIDIA's rules.
	MIGEnabled bool
	MIGLayout  []string

	// CPUMilli and MemoryMiB are the host's size in the inventory; 0
	// derives them from the GPUs (the catalogue's per-GPU share).
	CPUMilli  int64
	MemoryMiB int64

	// HeartbeatInterval between heartbeats; 0 means 2 s.
	HeartbeatInterval time.Duration
	// InventoryInterval between inventory republishes; 0 means 1 h.
	InventoryInterval time.Duration
	// TelemetryInterval between telemetry batches; 0 means 1 s.
	TelemetryInterval time.Duration
	// LogDir keeps each run's stdout and stderr, one file per allocation,
	// and the state of running commands (state/), which a restarted agent
	// uses to re-adopt them; "" means a new temporary directory, kept after
	// the agent exits (a restarted agent then finds nothing to re-adopt).
	LogDir string
	// CheckpointDir holds each job's checkpoint directory,
	// <CheckpointDir>/<tenant>/<job>, kept across attempts: agents of
	// several machines share it where it is shared storage; "" means
	// LogDir/checkpoints.
	CheckpointDir string
	// StopGrace between SIGTERM and SIGKILL when a stop_run command does
	// not carry its own grace period, and at a time limit; 0 means 10 s.
	StopGrace time.Duration
	// SimLogDelay is how long after its start a simulated run's first
	// lines are shipped, unless it ends or checkpoints first (both ship
	// its output at once); 0 means DefaultSimLogDelay. Its output is the
	// agent's own few lines, known at its start: shipping them as its
	// started fact goes out was a log chunk beside each start of a burst,
	// and a run shorter than this ships its whole output as one chunk
	// with its end (issue 17).
	SimLogDelay time.Duration
	// Now is the clock for every timestamp the agent publishes; nil means
	// time.Now.
	Now func() time.Time

	// Backend discovers and samples the GPUs; nil means the one
	// BackendKind names.
	Backend Backend
	// BackendKind is BackendSim ("" too: a machine built from GPUModel,
	// GPUCount and NVLink) or BackendNVML (this machine's GPUs).
	BackendKind string
	// Runner launches runs; nil means local processes and simulated runs
	// with output in LogDir.
	Runner Runner
	// Runc is the runc binary that runs container runs; "" looks for it
	// in PATH and Debian's directories. Without one a container run fails
	// with runtime_unavailable; host commands still run.
	Runc string
	// Feed is where the agent reads its node's history, ledger entries
	// and commands; nil means the bus, with the agent's own durable
	// consumers. A fleet shares one Feed among its agents.
	Feed Feed

	// MPSControl is the MPS control program the agent runs, one daemon
	// per GPU that holds shares, so their limits are enforced
	// (internal/mps): "" means nvidia-cuda-mps-control on an NVML machine
	// and no MPS on a simulated one, where a stand-in makes the same path
	// run. MPSDir holds each GPU's pipe and log directories; "" means
	// DefaultMPSDir.
	MPSControl string
	MPSDir     string
	// MPSHostShm runs the MPS daemons with the host's /dev/shm instead of
	// one per GPU in a mount namespace of their own (which needs root and
	// unshare(1)); a share's container then has the host's /dev/shm.
	MPSHostShm bool

	// ImageDir holds the image cache of container runs (internal/image);
	// "" means LogDir/images. ImageCacheMaxBytes bounds it: past it, the
	// least recently used images no run holds are deleted; 0 means half
	// the file system that holds it.
	ImageDir           string
	ImageCacheMaxBytes int64
	// ImageTransport reaches the image registries; nil means
	// go-containerregistry's default. The all-in-one serves its built-in
	// registry through it, without a socket.
	ImageTransport http.RoundTripper
}

// DefaultConfig is an agent for a simulated 8×H100 machine named after
// this host, on the default bus (environment variables of
// service.DefaultBusConfig; GPUPLANE_NODE_ID overrides the node ID).
func DefaultConfig() Config {
	host, _ := os.Hostname()
	node := os.Getenv("GPUPLANE_NODE_ID")
	if node == "" {
		node = nodeIDFromHost(host)
	}
	return Config{
		Bus:               service.DefaultBusConfig(),
		NodeID:            node,
		Hostname:          host,
		Pool:              DefaultPool,
		PriceClass:        "on-demand",
		BackendKind:       backendFromEnv(),
		GPUModel:          DefaultGPUModel,
		GPUCount:          DefaultGPUCount,
		NVLink:            true,
		HeartbeatInterval: DefaultHeartbeatInterval,
		InventoryInterval: DefaultInventoryInterval,
		TelemetryInterval: DefaultTelemetryInterval,
		StopGrace:         DefaultStopGrace,
		Now:               time.Now,
	}
}

// backendFromEnv is GPUPLANE_NODE_BACKEND, BackendSim when unset.
func backendFromEnv() string {
	if k := os.Getenv("GPUPLANE_NODE_BACKEND"); k != "" {
		return k
	}
	return BackendSim
}

// nodeIDFromHost is the first label of a hostname when it is a valid ID.
func nodeIDFromHost(host string) string {
	short, _, _ := strings.Cut(host, ".")
	if contracts.ValidateID(short) != nil {
		return ""
	}
	return short
}

// RegisterFlags adds the agent's flags (and the bus flags) to fs,
// defaulting to c's values.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	c.Bus.RegisterFlags(fs)
	fs.StringVar(&c.NodeID, "node-id", c.NodeID, "node ID, unique in the cluster (env GPUPLANE_NODE_ID; default the short hostname)")
	fs.StringVar(&c.Hostname, "hostname", c.Hostname, "hostname reported in the inventory")
	fs.StringVar(&c.Pool, "pool", c.Pool, "node pool")
	fs.StringVar(&c.Zone, "zone", c.Zone, "availability zone")
	fs.StringVar(&c.MachineType, "machine-type", c.MachineType, "machine type; empty derives one from the GPUs")
	fs.StringVar(&c.PriceClass, "price-class", c.PriceClass, "price class: on-demand, spot or reserved")
	fs.Var((*labelsFlag)(&c.Labels), "labels", "node labels, k=v[,k=v...] (replaces the labels set before it)")
	fs.Func("label", "a node label k=v, added to the others (repeatable)", func(v string) error {
		k, val, ok := strings.Cut(v, "=")
		if !ok || k == "" {
			return fmt.Errorf("label %q: want key=value", v)
		}
		if c.Labels == nil {
			c.Labels = map[string]string{}
		}
		c.Labels[k] = val
		return nil
	})
	fs.StringVar(&c.Purpose, "purpose", c.Purpose, "what the machine is for, e.g. training or inference")
	fs.Func("taint", "a node taint key[=value]:NoSchedule|PreferNoSchedule (repeatable)", func(v string) error {
		t, err := ParseTaint(v)
		if err != nil {
			return err
		}
		c.Taints = append(c.Taints, t)
		return nil
	})
	fs.StringVar(&c.BackendKind, "backend", c.BackendKind, "GPU backend: sim (simulated GPUs) or nvml (this machine's NVIDIA GPUs, needs the driver) (env GPUPLANE_NODE_BACKEND)")
	fs.StringVar(&c.GPUModel, "gpu-model", c.GPUModel, "simulated GPU model, one of "+strings.Join(contracts.GPUModels, ", "))
	fs.IntVar(&c.GPUCount, "gpu-count", c.GPUCount, "simulated GPU count")
	fs.BoolVar(&c.NVLink, "nvlink", c.NVLink, "simulated GPUs share one NVLink domain (SXM models only)")
	fs.BoolVar(&c.NVLinkBridges, "nvlink-bridges", c.NVLinkBridges, "simulated PCIe GPUs are joined in pairs by NVLink bridges (H100 PCIe)")
	fs.BoolVar(&c.MIGEnabled, "mig", c.MIGEnabled, "simulated GPUs are in MIG mode (A100, H100, H200)")
	fs.Func("mig-layout", "MIG instances of every simulated GPU, e.g. 3g.40gb,3g.40gb (implies -mig)", func(v string) error {
		c.MIGLayout = nil
		for p := range strings.SplitSeq(v, ",") {
			if p = strings.TrimSpace(p); p != "" {
				c.MIGLayout = append(c.MIGLayout, p)
			}
		}
		c.MIGEnabled = c.MIGEnabled || len(c.MIGLayout) > 0
		return nil
	})
	fs.Int64Var(&c.CPUMilli, "cpu-milli", c.CPUMilli, "host CPU in milli-CPUs; 0 derives it from the GPUs")
	fs.Int64Var(&c.MemoryMiB, "memory-mib", c.MemoryMiB, "host memory in MiB; 0 derives it from the GPUs")
	fs.DurationVar(&c.HeartbeatInterval, "heartbeat-interval", c.HeartbeatInterval, "interval between heartbeats")
	fs.DurationVar(&c.InventoryInterval, "inventory-interval", c.InventoryInterval, "interval between inventory republishes (must stay well under the NODES max age of 7 days)")
	fs.DurationVar(&c.TelemetryInterval, "telemetry-interval", c.TelemetryInterval, "interval between telemetry batches")
	fs.StringVar(&c.LogDir, "log-dir", c.LogDir, "directory for run logs and run state; empty means a new temporary directory")
	fs.StringVar(&c.CheckpointDir, "checkpoint-dir", c.CheckpointDir, "root of the jobs' checkpoint directories; empty means <log-dir>/checkpoints")
	fs.DurationVar(&c.StopGrace, "stop-grace", c.StopGrace, "grace between SIGTERM and SIGKILL when stopping a run")
	fs.StringVar(&c.MPSControl, "mps-control", c.MPSControl, "MPS control program run for every GPU that holds shares; empty means nvidia-cuda-mps-control with -backend nvml, none with sim")
	fs.StringVar(&c.Runc, "runc", c.Runc, "runc binary of container runs; empty looks in PATH, /usr/sbin and /usr/bin")
	fs.StringVar(&c.ImageDir, "image-dir", c.ImageDir, "directory of the container image cache; empty means <log-dir>/images")
	fs.Int64Var(&c.ImageCacheMaxBytes, "image-cache-bytes", c.ImageCacheMaxBytes, "size limit of the image cache (the least recently used images no run holds go first); 0 means half its file system")
	fs.StringVar(&c.MPSDir, "mps-dir", c.MPSDir, "directory of the GPUs' MPS pipe and log directories; empty means "+DefaultMPSDir)
	fs.BoolVar(&c.MPSHostShm, "mps-host-shm", c.MPSHostShm, "MPS daemons use the host's /dev/shm, not one per GPU in a mount namespace of their own (where the agent cannot make one)")
}

// Validate reports every problem of the agent's own settings at once. The
// bus settings are checked by Run (RunWithBus does not use them). Zero
// intervals, grace and clock mean their defaults.
func (c Config) Validate() error {
	var errs []error
	if err := contracts.ValidateID(c.NodeID); err != nil {
		errs = append(errs, fmt.Errorf("node ID: %w", err))
	}
	if err := contracts.ValidatePool(c.Pool); err != nil {
		errs = append(errs, fmt.Errorf("pool: %w", err))
	}
	if c.PriceClass != "" && !slices.Contains(PriceClasses, c.PriceClass) {
		errs = append(errs, fmt.Errorf("price class %q; want one of %v", c.PriceClass, PriceClasses))
	}
	for k, v := range c.Labels {
		if k == "" || strings.ContainsAny(k, "=,") {
			errs = append(errs, fmt.Errorf("label name %q is empty or contains '=' or ','", k))
		}
		if len(k)+len(v) > contracts.MaxLabelBytes {
			errs = append(errs, fmt.Errorf("label %q is longer than %d bytes with its value", k, contracts.MaxLabelBytes))
		}
	}
	if c.Purpose != "" {
		if err := contracts.ValidateID(c.Purpose); err != nil {
			errs = append(errs, fmt.Errorf("purpose: %w", err))
		}
	}
	if err := ValidateTaints(c.Taints); err != nil {
		errs = append(errs, err)
	}
	if c.BackendKind != "" && c.BackendKind != BackendSim && c.BackendKind != BackendNVML {
		errs = append(errs, fmt.Errorf("backend %q; want %s or %s", c.BackendKind, BackendSim, BackendNVML))
	}
	if c.Backend == nil && c.BackendKind != BackendNVML {
		m, err := catalog.Get(c.GPUModel)
		if err != nil {
			errs = append(errs, fmt.Errorf("gpu model: %w", err))
		} else {
			if c.NVLink && !m.NVLink {
				errs = append(errs, fmt.Errorf("nvlink: %s is a PCIe card without NVLink (set -nvlink=false)", m.ID))
			}
			if c.NVLinkBridges && !m.NVLinkBridge {
				errs = append(errs, fmt.Errorf("nvlink bridges: %s takes no NVLink bridges", m.ID))
			}
			if err := (sim.MIG{Enabled: c.MIGEnabled, Layout: c.MIGLayout}).Validate(m); err != nil {
				errs = append(errs, err)
			}
		}
		if c.GPUCount < 1 || c.GPUCount > sim.MaxGPUs {
			errs = append(errs, fmt.Errorf("gpu count is %d; want 1 to %d", c.GPUCount, sim.MaxGPUs))
		}
	}
	if c.CPUMilli < 0 {
		errs = append(errs, fmt.Errorf("cpu is %d milli-CPUs; want >= 0", c.CPUMilli))
	}
	if c.MemoryMiB < 0 {
		errs = append(errs, fmt.Errorf("memory is %d MiB; want >= 0", c.MemoryMiB))
	}
	if c.InventoryInterval < 0 || c.InventoryInterval > 24*time.Hour {
		errs = append(errs, fmt.Errorf("inventory interval is %s; want up to 24h (NODES keeps 7 days)", c.InventoryInterval))
	}
	if c.HeartbeatInterval < 0 {
		errs = append(errs, fmt.Errorf("heartbeat interval is %s; want > 0", c.HeartbeatInterval))
	}
	if c.TelemetryInterval < 0 {
		errs = append(errs, fmt.Errorf("telemetry interval is %s; want > 0", c.TelemetryInterval))
	}
	if c.StopGrace < 0 {
		errs = append(errs, fmt.Errorf("stop grace is %s; want >= 0", c.StopGrace))
	}
	if c.ImageCacheMaxBytes < 0 {
		errs = append(errs, fmt.Errorf("image cache limit is %d bytes; want >= 0 (0: half its file system)", c.ImageCacheMaxBytes))
	}
	return errors.Join(errs...)
}

// withDefaults fills the zero values that have a default.
func (c Config) withDefaults() Config {
	if c.InventoryInterval == 0 {
		c.InventoryInterval = DefaultInventoryInterval
	}
	if c.HeartbeatInterval == 0 {
		c.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if c.TelemetryInterval == 0 {
		c.TelemetryInterval = DefaultTelemetryInterval
	}
	if c.StopGrace == 0 {
		c.StopGrace = DefaultStopGrace
	}
	if c.SimLogDelay <= 0 {
		c.SimLogDelay = DefaultSimLogDelay
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Hostname == "" {
		c.Hostname = c.NodeID
	}
	// An NVML agent names its machine type after the GPUs it finds.
	if c.MachineType == "" && (c.Backend != nil || c.BackendKind != BackendNVML) {
		c.MachineType = "sim-" + strings.ToLower(c.GPUModel) + "-x" + fmt.Sprint(c.GPUCount)
	}
	c.Labels = maps.Clone(c.Labels)
	c.Taints = slices.Clone(c.Taints)
	c.MIGLayout = slices.Clone(c.MIGLayout)
	return c
}

// ParseTaint reads a taint written as kubectl writes them,
// key[=value]:Effect, e.g. "gpuplane.io/spot=true:NoSchedule".
func ParseTaint(s string) (contracts.Taint, error) {
	kv, effect, ok := strings.Cut(s, ":")
	if !ok {
		return contracts.Taint{}, fmt.Errorf("taint %q: want key[=value]:%s or key[=value]:%s", s, contracts.TaintNoSchedule, contracts.TaintPreferNoSchedule)
	}
	k, v, _ := strings.Cut(kv, "=")
	t := contracts.Taint{Key: k, Value: v, Effect: contracts.TaintEffect(effect)}
	if err := validateTaint(t); err != nil {
		return contracts.Taint{}, err
	}
	return t, nil
}

// FormatTaint writes t as ParseTaint reads it.
func FormatTaint(t contracts.Taint) string {
	if t.Value == "" {
		return t.Key + ":" + string(t.Effect)
	}
	return t.Key + "=" + t.Value + ":" + string(t.Effect)
}

// ValidateTaints reports every invalid taint, and any key given twice with
// one effect (which of the two values holds would be a guess).
func ValidateTaints(ts []contracts.Taint) error {
	var errs []error
	seen := map[string]bool{}
	for _, t := range ts {
		if err := validateTaint(t); err != nil {
			errs = append(errs, err)
			continue
		}
		k := t.Key + ":" + string(t.Effect)
		if seen[k] {
			errs = append(errs, fmt.Errorf("taint %s: key %q with effect %s given twice", FormatTaint(t), t.Key, t.Effect))
		}
		seen[k] = true
	}
	return errors.Join(errs...)
}

// validateTaint checks one taint: a key and a value that ParseTaint can
// read back, within a label's size, and an effect the scheduler knows.
func validateTaint(t contracts.Taint) error {
	switch {
	case t.Key == "" || strings.ContainsAny(t.Key, "=:, \t\n"):
		return fmt.Errorf("taint %s: key %q is empty or contains '=', ':', ',' or blanks", FormatTaint(t), t.Key)
	case strings.ContainsAny(t.Value, "=:, \t\n"):
		return fmt.Errorf("taint %s: value %q contains '=', ':', ',' or blanks", FormatTaint(t), t.Value)
	case len(t.Key)+len(t.Value) > contracts.MaxLabelBytes:
		return fmt.Errorf("taint %s: longer than %d bytes", FormatTaint(t), contracts.MaxLabelBytes)
	case t.Effect != contracts.TaintNoSchedule && t.Effect != contracts.TaintPreferNoSchedule:
		return fmt.Errorf("taint %s: effect %q; want %s or %s", FormatTaint(t), t.Effect, contracts.TaintNoSchedule, contracts.TaintPreferNoSchedule)
	}
	return nil
}

// labelsFlag parses k=v[,k=v...] into a map.
type labelsFlag map[string]string

func (l *labelsFlag) String() string {
	if l == nil || len(*l) == 0 {
		return ""
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(*l)) {
		parts = append(parts, k+"="+(*l)[k])
	}
	return strings.Join(parts, ",")
}

func (l *labelsFlag) Set(s string) error {
	m := map[string]string{}
	for part := range strings.SplitSeq(s, ",") {
		if part == "" {
			continue
		}
		k, v, ok := strings.Cut(part, "=")
		if !ok || k == "" {
			return fmt.Errorf("label %q: want key=value", part)
		}
		m[k] = v
	}
	*l = m
	return nil
}
