// Package fleet describes a simulated fleet of machines in YAML (machine
// types, pools, counts, zones, price classes, purposes, labels, taints)
// and runs one node
// agent per machine, all sharing one bus connection and one durable
// consumer per stream (feed.go). BenchmarkFleet measures what a fleet of
// thousands of 8-GPU machines costs the process and the NATS server.
package fleet

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"

	"golang.org/x/sync/errgroup"
	"gopkg.in/yaml.v3"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/catalog"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/sim"
)

// Fleet is a fleet description: named machine types and pools of them.
type Fleet struct {
	MachineTypes map[string]MachineType `yaml:"machineTypes"`
	Pools        []Pool                 `yaml:"pools"`
}

// MachineType is the shape of one kind of machine.
type MachineType struct {
	GPUModel string `yaml:"gpuModel"` // a contracts.GPUModels identifier
	GPUCount int    `yaml:"gpuCount"`
	// NVLink (yaml nvlink: true) is an SXM board: all GPUs in one NVLink
	// domain. NVLinkBridges (yaml nvlink: pairs) joins PCIe cards in pairs
	// with NVLink bridges (H100 PCIe). See machinetype.go.
	NVLink        bool `yaml:"nvlink"`
	NVLinkBridges bool `yaml:"-"`
	// CPUMilli and MemoryMiB size the host; 0 derives them from the GPUs.
	CPUMilli  int64 `yaml:"cpuMilli,omitempty"`
	MemoryMiB int64 `yaml:"memoryMiB,omitempty"`
	// MIG puts every GPU in MIG mode with the same instances.
	MIG *MIGSpec `yaml:"mig,omitempty"`
}

// Pool is Count machines of one type. Its machines are named
// <name>-01, <name>-02, ... (wider numbers for pools of 100 or more).
type Pool struct {
	Name        string            `yaml:"name"`
	MachineType string            `yaml:"machineType"`
	Count       int               `yaml:"count"`
	Zone        string            `yaml:"zone,omitempty"`
	PriceClass  string            `yaml:"priceClass,omitempty"` // on-demand, spot or reserved
	Purpose     string            `yaml:"purpose,omitempty"`    // training, inference, ...
	Labels      map[string]string `yaml:"labels,omitempty"`
	// Taints are written as the agent's -taint flag takes them,
	// key[=value]:NoSchedule or key[=value]:PreferNoSchedule.
	Taints []string `yaml:"taints,omitempty"`
}

// Machine is one machine of a fleet.
type Machine struct {
	NodeID      string
	Pool        string
	Zone        string
	MachineType string
	PriceClass  string
	Purpose     string
	Labels      map[string]string
	Taints      []contracts.Taint
	// The machine type's shape.
	GPUModel  string
	GPUCount  int
	NVLink    bool
	CPUMilli  int64
	MemoryMiB int64
	// NVLinkBridges, MIGEnabled and MIGLayout as the machine type says.
	NVLinkBridges bool
	MIGEnabled    bool
	MIGLayout     []string
}

// Default is fleet-sim's fleet (deploy/fleet/default.yaml; make run's is
// services/gpuplane/fleet.yaml): two 8×H100 NVLink machines for training
// in zone-a, two 8×A100 in zone-b, four 4×L4 spot machines for inference
// in zone-b, tainted so that work that fits elsewhere stays off spot
// capacity (PreferNoSchedule: a job that only fits an L4 still lands there
// without a toleration).
func Default() Fleet {
	return Fleet{
		MachineTypes: map[string]MachineType{
			"hgx-h100-8": {GPUModel: "H100-80GB", GPUCount: 8, NVLink: true, CPUMilli: 192000, MemoryMiB: 2048 * 1024},
			"hgx-a100-8": {GPUModel: "A100-80GB", GPUCount: 8, NVLink: true, CPUMilli: 96000, MemoryMiB: 1152 * 1024},
			"pcie-l4-4":  {GPUModel: "L4", GPUCount: 4, NVLink: false, CPUMilli: 48000, MemoryMiB: 192 * 1024},
		},
		Pools: []Pool{
			{Name: "h100", MachineType: "hgx-h100-8", Count: 2, Zone: "zone-a", PriceClass: "on-demand",
				Purpose: "training", Labels: map[string]string{"tier": "training"}},
			{Name: "a100", MachineType: "hgx-a100-8", Count: 2, Zone: "zone-b", PriceClass: "on-demand",
				Purpose: "training", Labels: map[string]string{"tier": "training"}},
			{Name: "l4", MachineType: "pcie-l4-4", Count: 4, Zone: "zone-b", PriceClass: "spot",
				Purpose: "inference", Labels: map[string]string{"tier": "inference"},
				Taints: []string{"gpuplane.io/spot=true:PreferNoSchedule"}},
		},
	}
}

// Load reads and validates a fleet file.
func Load(path string) (Fleet, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Fleet{}, fmt.Errorf("fleet: %w", err)
	}
	f, err := Parse(data)
	if err != nil {
		return Fleet{}, fmt.Errorf("fleet %s: %w", path, err)
	}
	return f, nil
}

// Parse decodes and validates a fleet description. Unknown fields are
// errors, so a misspelt key does not silently fall back to a default.
func Parse(data []byte) (Fleet, error) {
	var f Fleet
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil {
		if errors.Is(err, io.EOF) {
			return Fleet{}, errors.New("empty fleet description")
		}
		return Fleet{}, err
	}
	if err := f.Validate(); err != nil {
		return Fleet{}, err
	}
	return f, nil
}

// Validate reports every problem of the description at once.
func (f Fleet) Validate() error {
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	for _, name := range slices.Sorted(maps.Keys(f.MachineTypes)) {
		t := f.MachineTypes[name]
		if name == "" {
			add("machine type with an empty name")
		}
		m, err := catalog.Get(t.GPUModel)
		if err != nil {
			add("machine type %q: %w", name, err)
		} else {
			if t.NVLink && !m.NVLink {
				add("machine type %q: nvlink: %s is a PCIe card without NVLink", name, m.ID)
			}
			if t.NVLinkBridges && !m.NVLinkBridge {
				add("machine type %q: nvlink: pairs: %s takes no NVLink bridges", name, m.ID)
			}
			if err := t.MIG.sim().Validate(m); err != nil {
				add("machine type %q: %w", name, err)
			}
		}
		if t.GPUCount < 1 || t.GPUCount > sim.MaxGPUs {
			add("machine type %q: gpuCount is %d; want 1 to %d", name, t.GPUCount, sim.MaxGPUs)
		}
		if t.CPUMilli < 0 || t.MemoryMiB < 0 {
			add("machine type %q: cpuMilli and memoryMiB must not be negative", name)
		}
	}
	if len(f.Pools) == 0 {
		add("no pools")
	}
	pools := map[string]bool{}
	for i, p := range f.Pools {
		where := fmt.Sprintf("pool %d (%q)", i, p.Name)
		if err := contracts.ValidatePool(p.Name); err != nil {
			add("%s: %w", where, err)
		} else if pools[p.Name] {
			add("%s: duplicate pool name", where)
		}
		pools[p.Name] = true
		if _, ok := f.MachineTypes[p.MachineType]; !ok {
			add("%s: unknown machine type %q", where, p.MachineType)
		}
		if p.Count < 0 {
			add("%s: count is %d; want >= 0", where, p.Count)
		}
		if p.PriceClass != "" && !slices.Contains(nodeagent.PriceClasses, p.PriceClass) {
			add("%s: price class %q; want one of %v", where, p.PriceClass, nodeagent.PriceClasses)
		}
		for k := range p.Labels {
			if k == "" {
				add("%s: empty label name", where)
			}
		}
		if p.Purpose != "" {
			if err := contracts.ValidateID(p.Purpose); err != nil {
				add("%s: purpose: %w", where, err)
			}
		}
		var taints []contracts.Taint
		for _, ts := range p.Taints {
			t, err := nodeagent.ParseTaint(ts)
			if err != nil {
				add("%s: %w", where, err)
				continue
			}
			taints = append(taints, t)
		}
		if err := nodeagent.ValidateTaints(taints); err != nil {
			add("%s: %w", where, err)
		}
	}
	if len(errs) == 0 {
		// Node IDs are derived, but a long pool name can still make them
		// invalid.
		for _, m := range f.Machines() {
			if err := contracts.ValidateID(m.NodeID); err != nil {
				add("pool %q: node ID: %w", m.Pool, err)
				break
			}
		}
	}
	return errors.Join(errs...)
}

// Machines lists every machine, pool by pool.
func (f Fleet) Machines() []Machine {
	var out []Machine
	for _, p := range f.Pools {
		taints := p.taints()
		width := max(2, len(strconv.Itoa(p.Count)))
		for i := 1; i <= p.Count; i++ {
			out = append(out, f.machine(fmt.Sprintf("%s-%0*d", p.Name, width, i), p, p.MachineType, taints))
		}
	}
	return out
}

// machine is the machine nodeID of type machineType in pool p: the
// pool's zone, price class, purpose, labels and taints (parsed, see
// Pool.taints), and the type's shape. Static machines take the pool's
// type; one created at run time names its own (NewMachine).
func (f Fleet) machine(nodeID string, p Pool, machineType string, taints []contracts.Taint) Machine {
	t := f.MachineTypes[machineType]
	return Machine{
		NodeID:      nodeID,
		Pool:        p.Name,
		Zone:        p.Zone,
		MachineType: machineType,
		PriceClass:  p.PriceClass,
		Purpose:     p.Purpose,
		Labels:      maps.Clone(p.Labels),
		Taints:      slices.Clone(taints),
		GPUModel:    t.GPUModel,
		GPUCount:    t.GPUCount,
		NVLink:      t.NVLink,
		CPUMilli:    t.CPUMilli,
		MemoryMiB:   t.MemoryMiB,

		NVLinkBridges: t.NVLinkBridges,
		MIGEnabled:    t.MIG.sim().Enabled,
		MIGLayout:     slices.Clone(t.MIG.sim().Layout),
	}
}

// taints parses p's taints, skipping those that do not parse: Validate
// reports them.
func (p Pool) taints() []contracts.Taint {
	var out []contracts.Taint
	for _, ts := range p.Taints {
		if tn, err := nodeagent.ParseTaint(ts); err == nil {
			out = append(out, tn)
		}
	}
	return out
}

// Configs is the agent configuration of every machine: the template's
// shared settings (intervals, stop grace, clock, runner) with the
// machine's own identity and shape. Labels merge, the pool's winning; so
// do taints (one per key and effect); a pool's purpose replaces the
// template's when set; a template LogDir gets one subdirectory per
// machine; a template Backend is dropped, since every machine simulates
// its own GPUs.
func (f Fleet) Configs(template nodeagent.Config) []nodeagent.Config {
	machines := f.Machines()
	cfgs := make([]nodeagent.Config, 0, len(machines))
	for _, m := range machines {
		cfgs = append(cfgs, machineConfig(template, m))
	}
	return cfgs
}

// machineConfig is the agent configuration of one machine (see Configs).
func machineConfig(template nodeagent.Config, m Machine) nodeagent.Config {
	c := template
	c.NodeID, c.Hostname = m.NodeID, m.NodeID
	c.Pool, c.Zone, c.MachineType, c.PriceClass = m.Pool, m.Zone, m.MachineType, m.PriceClass
	c.GPUModel, c.GPUCount, c.NVLink = m.GPUModel, m.GPUCount, m.NVLink
	c.CPUMilli, c.MemoryMiB = m.CPUMilli, m.MemoryMiB
	c.NVLinkBridges, c.MIGEnabled, c.MIGLayout = m.NVLinkBridges, m.MIGEnabled, slices.Clone(m.MIGLayout)
	c.Backend = nil
	c.Labels = maps.Clone(template.Labels)
	if c.Labels == nil && len(m.Labels) > 0 {
		c.Labels = map[string]string{}
	}
	maps.Copy(c.Labels, m.Labels)
	if m.Purpose != "" {
		c.Purpose = m.Purpose
	}
	c.Taints = mergeTaints(template.Taints, m.Taints)
	if template.LogDir != "" {
		c.LogDir = filepath.Join(template.LogDir, m.NodeID)
	}
	return c
}

// mergeTaints is base with over added, a taint of over replacing base's
// of the same key and effect; nil when both are empty.
func mergeTaints(base, over []contracts.Taint) []contracts.Taint {
	var out []contracts.Taint
	for _, t := range base {
		if !slices.ContainsFunc(over, func(o contracts.Taint) bool { return o.Key == t.Key && o.Effect == t.Effect }) {
			out = append(out, t)
		}
	}
	return append(out, over...)
}

// Run validates f and runs one agent per machine on b, configured by
// Configs(template), until ctx ends or an agent fails (which stops them
// all). nodeagent.DefaultConfig() is a fine template; zero settings take
// the agent's defaults.
func Run(ctx context.Context, f Fleet, b *bus.Bus, template nodeagent.Config, log *slog.Logger) error {
	if err := f.Validate(); err != nil {
		return fmt.Errorf("fleet: %w", err)
	}
	if log == nil {
		log = slog.Default()
	}
	cfgs := f.Configs(template)
	log.Info("starting simulated fleet", "machines", len(cfgs), "pools", len(f.Pools))
	// The agents share one replay and one consumer per stream (feed.go).
	feed := newSharedFeed(b, log, nodeIDs(cfgs))
	if err := feed.loadHistory(ctx); err != nil {
		return err
	}
	g, gctx := errgroup.WithContext(ctx)
	feedCtx, stopFeed := context.WithCancel(gctx)
	defer stopFeed()
	g.Go(func() error { return feed.run(feedCtx) })
	var agents sync.WaitGroup
	for _, c := range cfgs {
		c.Feed = feed
		agents.Add(1)
		g.Go(func() error {
			defer agents.Done()
			defer feed.stopped(c.NodeID)
			err := nodeagent.RunWithBus(gctx, c, b, log)
			if errors.Is(err, nodeagent.ErrMachineDied) {
				// A dead machine stays dead; the others go on.
				log.Warn("simulated machine died; it is not restarted", "node_id", c.NodeID)
				return nil
			}
			return err
		})
	}
	g.Go(func() error {
		agents.Wait()
		stopFeed() // no agent left to hand messages to
		return nil
	})
	return g.Wait()
}
