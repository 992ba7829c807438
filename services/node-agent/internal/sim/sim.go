// Package sim is the simulated GPU backend of the node agent: GPUs built
// from the catalogue with stable UUIDs and PCI bus IDs, the machine's
// NVLink/PCIe topology, MIG devices when the machine type enables MIG, and
// telemetry that looks like what DCGM reports for idle and busy cards.
//
// Dynamics, per GPU and sample: a running allocation drives utilisation
// (85-98 % with slow noise, scaled by the share of MIG slices in use),
// framebuffer use, power between idle and the power limit, and, through
// power, the temperature the die moves towards with thermal inertia.
// Faults (InjectFault) make a GPU fall off the bus, raise XIDs and ECC
// errors, or overheat: the clock then halves and the throttle reasons say
// why. Readings are a pure function of the seed, the sample times, which
// GPUs are busy and the faults injected, so two backends fed the same
// inputs report the same figures.
package sim

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/catalog"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
)

// Kind is the backend name reported in NodeInventory.Backend.
const Kind = "sim"

// MaxGPUs bounds the GPUs of one simulated machine (the largest boards
// have 8; 16 leaves room for DGX-2 and odd test shapes).
const MaxGPUs = 16

// What a simulated machine reports as its driver, unless told otherwise:
// an R550 production driver and the CUDA version it supports.
const (
	DefaultDriverVersion = "550.54.15"
	DefaultCUDAVersion   = "12.4"
)

// Thermal time constants: a card under load approaches its working
// temperature in about two minutes and cools down more slowly; a card
// whose cooling failed heats within seconds, and once it works again the
// fans at full speed bring it below its slowdown temperature quickly.
const (
	heatTau     = 40 * time.Second
	coolTau     = 60 * time.Second
	overheatTau = 10 * time.Second
	recoverTau  = 5 * time.Second
)

// Config describes one simulated machine.
type Config struct {
	NodeID string
	Model  catalog.Model
	Count  int
	// NVLink is an SXM board: every GPU in one NVLink domain named after
	// the node, linked as Topology describes.
	NVLink bool
	// NVLinkBridges joins PCIe cards in pairs (0-1, 2-3, ...) with NVLink
	// bridges; only for models that take them (catalog.Model.NVLinkBridge).
	NVLinkBridges bool
	// MIG, when enabled, puts every GPU in MIG mode with the instances of
	// its layout, placed as nvidia-smi would (contracts.PlaceMIG).
	MIG MIG
	// DriverVersion and CUDAVersion are reported by Discover; "" means
	// DefaultDriverVersion and DefaultCUDAVersion.
	DriverVersion string
	CUDAVersion   string
	// Seed makes the readings reproducible; 0 derives it from NodeID.
	Seed uint64
}

// MIG is a machine type's MIG setting: the same layout on every GPU.
type MIG struct {
	Enabled bool
	// Layout lists the profiles of one GPU's instances ("3g.40gb").
	Layout []string
}

// Validate checks a MIG setting against model's profiles and placement
// rules.
func (m MIG) Validate(model catalog.Model) error {
	if !m.Enabled {
		if len(m.Layout) > 0 {
			return errors.New("mig: a layout is given but MIG is not enabled")
		}
		return nil
	}
	if !model.MIG() {
		return fmt.Errorf("mig: %s has no MIG; MIG-capable models are %v", model.ID, contracts.MIGModels())
	}
	if _, err := contracts.PlaceMIG(model.ID, m.Layout); err != nil {
		return fmt.Errorf("mig: %w", err)
	}
	return nil
}

// Backend is a simulated machine. It is safe for concurrent use.
type Backend struct {
	nodeID   string
	model    catalog.Model
	machine  device.Machine
	maxProcs int // upper bound of processes in one sample

	mu      sync.Mutex
	last    time.Time
	state   []gpuState
	pending []device.Health // facts not yet reported
	notify  chan struct{}   // a fact is pending
}

type gpuState struct {
	seed     uint64
	weak     bool    // a card that collects the odd single-bit ECC error
	tempC    float64 // current die temperature, unrounded
	idleTemp float64 // where an idle card settles
	busyTemp float64 // where a card drawing 90 % of its TDP settles
	mig      []migSlice

	// Faults.
	offBus    bool // XID 79: readings are gone until cleared
	unhealthy bool
	lastXID   int
	eccSBE    int64
	eccDBE    int64
	overheat  bool          // cooling failed
	heatFor   time.Duration // how long the overheat lasts (0: until cleared)
	heatUntil time.Time     // set by the first sample after the injection
	recover   bool          // cooling works again, fans at full speed
	hot       bool          // at or above slowdown, reported
}

type migSlice struct {
	uuid    string
	compute int
	memMiB  int64
}

// New builds a simulated machine.
func New(cfg Config) (*Backend, error) {
	var errs []error
	if cfg.NodeID == "" {
		errs = append(errs, errors.New("sim: node ID is empty"))
	}
	if cfg.Model.ID == "" {
		errs = append(errs, errors.New("sim: GPU model is not set"))
	}
	if cfg.Count < 1 || cfg.Count > MaxGPUs {
		errs = append(errs, fmt.Errorf("sim: GPU count %d; want 1 to %d", cfg.Count, MaxGPUs))
	}
	if cfg.Model.ID != "" {
		if cfg.NVLink && !cfg.Model.NVLink {
			errs = append(errs, fmt.Errorf("sim: %s is a PCIe card without an NVLink board", cfg.Model.ID))
		}
		if cfg.NVLinkBridges && !cfg.Model.NVLinkBridge {
			errs = append(errs, fmt.Errorf("sim: %s takes no NVLink bridges", cfg.Model.ID))
		}
		if err := cfg.MIG.Validate(cfg.Model); err != nil {
			errs = append(errs, fmt.Errorf("sim: %w", err))
		}
	}
	if cfg.NVLink && cfg.NVLinkBridges {
		errs = append(errs, errors.New("sim: NVLink board and NVLink bridges exclude each other"))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	seed := cfg.Seed
	if seed == 0 {
		h := fnv.New64a()
		h.Write([]byte(cfg.NodeID))
		seed = h.Sum64()
	}
	var placements []contracts.MIGPlacement
	if cfg.MIG.Enabled {
		placements, _ = contracts.PlaceMIG(cfg.Model.ID, cfg.MIG.Layout) // validated above
	}
	b := &Backend{nodeID: cfg.NodeID, model: cfg.Model, notify: make(chan struct{}, 1)}
	b.machine = device.Machine{
		DriverVersion: cmpOr(cfg.DriverVersion, DefaultDriverVersion),
		CUDAVersion:   cmpOr(cfg.CUDAVersion, DefaultCUDAVersion),
		Topology:      Topology(cfg.Model, cfg.Count, cfg.NVLink, cfg.NVLinkBridges),
	}
	for i := range cfg.Count {
		g := contracts.GPUInfo{
			Index:             i,
			UUID:              UUID(cfg.NodeID, i),
			Model:             cfg.Model.ID,
			MemoryMiB:         cfg.Model.MemoryMiB,
			PCIBusID:          PCIBusID(i),
			NVLinkDomain:      nvlinkDomain(cfg.NodeID, cfg.Count, i, cfg.NVLink, cfg.NVLinkBridges),
			Healthy:           true,
			ComputeCapability: cfg.Model.ComputeCapability,
			MIGEnabled:        cfg.MIG.Enabled,
		}
		s := mix(seed, uint64(i)+1)
		idle := 30 + 4*unit(mix(s, 1)) // 30-34 °C
		busy := 70 + 6*unit(mix(s, 2)) // 70-76 °C
		st := gpuState{seed: s, weak: unit(mix(s, 3)) < 0.125, tempC: idle, idleTemp: idle, busyTemp: busy}
		if cfg.MIG.Enabled {
			g.MIGInstances = migInstances(cfg.NodeID, i, cfg.Model.ID, placements)
			for _, m := range g.MIGInstances {
				p, _ := contracts.LookupMIGProfile(cfg.Model.ID, m.Profile)
				st.mig = append(st.mig, migSlice{uuid: m.UUID, compute: p.ComputeSlices, memMiB: m.MemoryMiB})
			}
		}
		b.maxProcs += max(1, len(st.mig))
		b.machine.GPUs = append(b.machine.GPUs, g)
		b.state = append(b.state, st)
	}
	return b, nil
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// Kind is "sim".
func (b *Backend) Kind() string { return Kind }

// Discover returns the machine: its GPUs (with their health now), driver,
// CUDA version and topology.
func (b *Backend) Discover(context.Context) (device.Machine, error) {
	m := b.machine
	m.GPUs = make([]contracts.GPUInfo, len(b.machine.GPUs))
	copy(m.GPUs, b.machine.GPUs)
	m.Topology = append([]contracts.GPULink(nil), b.machine.Topology...)
	b.mu.Lock()
	for i := range m.GPUs {
		m.GPUs[i].Healthy = !b.state[i].unhealthy
		m.GPUs[i].MIGInstances = append([]contracts.MIGInstance(nil), m.GPUs[i].MIGInstances...)
	}
	b.mu.Unlock()
	return m, nil
}

// Sample reads every GPU at now. busy maps the UUID of each GPU (or MIG
// device) held by a running allocation to that allocation's ID: those
// GPUs work, the others idle. Temperatures integrate from the previous
// sample, so samples are expected in time order; an earlier now is
// treated as no time passing.
//
// It allocates the result and, when some GPU is busy, one array for all
// the processes: the fleet simulator calls it for thousands of machines a
// second.
func (b *Backend) Sample(_ context.Context, now time.Time, busy map[string]string) ([]contracts.GPUSample, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	var dt time.Duration
	if !b.last.IsZero() && now.After(b.last) {
		dt = min(now.Sub(b.last), 10*time.Minute)
	}
	if b.last.IsZero() || now.After(b.last) {
		b.last = now
	}
	t := float64(now.UnixNano()) / 1e9
	out := make([]contracts.GPUSample, len(b.state))
	var procs []contracts.GPUProcess
	if len(busy) > 0 {
		procs = make([]contracts.GPUProcess, 0, b.maxProcs)
	}
	for i := range b.state {
		g := &b.machine.GPUs[i]
		out[i] = b.sampleGPU(i, g, now, t, dt, busy, &procs)
	}
	return out, nil
}

// sampleGPU computes one GPU's reading and advances its state; b.mu is
// held. Processes are appended to *procs, whose capacity never grows.
func (b *Backend) sampleGPU(i int, g *contracts.GPUInfo, now time.Time, t float64, dt time.Duration,
	busy map[string]string, procs *[]contracts.GPUProcess) contracts.GPUSample {
	m := &b.model
	st := &b.state[i]
	s := contracts.GPUSample{Index: g.Index, UUID: g.UUID, Model: g.Model, Healthy: !st.unhealthy,
		LastXID: st.lastXID, ECCSBE: st.eccSBE, ECCDBE: st.eccDBE}
	if st.offBus {
		// NVML answers GPU_IS_LOST for every reading: nothing but the
		// fault itself is known.
		return s
	}
	s.PowerLimitW = m.TDPWatts

	// Which share of the GPU works, and for whom: the whole GPU, or the
	// compute slices of its busy MIG devices.
	share, memMiB, alloc := 0.0, int64(0), ""
	procStart := len(*procs)
	if a, ok := busy[g.UUID]; ok {
		share, memMiB, alloc = 1, m.MemoryMiB, a
		s.AllocationID = a
		*procs = append(*procs, contracts.GPUProcess{PID: fakePID(a)})
	} else {
		for _, ms := range st.mig {
			if a, ok := busy[ms.uuid]; ok {
				share += float64(ms.compute) / contracts.MIGComputeSlices
				memMiB += ms.memMiB
				alloc = a
				*procs = append(*procs, contracts.GPUProcess{PID: fakePID(a), UsedMiB: ms.memMiB})
			}
		}
	}

	throttled := st.tempC >= m.SlowdownTempC
	target, tau := st.idleTemp, coolTau
	if share > 0 {
		a := hashString(alloc)
		// Each allocation has its own level, wobbling slowly around it.
		level := 89 + 5*unit(mix(a, 1))
		util := level + 4*noise(st.seed^1, t/4) + 1.5*noise(st.seed^2, t*1.3)
		util = clamp(math.Round(util), 85, 98)
		load := (util - 85) / 13 // 0..1 across the band
		s.GPUUtil = math.Round(util * share)
		s.MemCopyUtil = clamp(math.Round((util*0.45+6*noise(st.seed^3, t/2))*share), 0, 100)
		frac := 0.55 + 0.35*unit(mix(a, 2)) + 0.005*noise(st.seed^4, t/10)
		s.FBUsedMiB = min(int64(frac*float64(memMiB)), memMiB)
		full := m.TDPWatts * (0.84 + 0.12*load + 0.015*noise(st.seed^5, t))
		power := m.IdleWatts + (full-m.IdleWatts)*share
		clock := m.MaxSMClockMHz * (0.97 + 0.03*unit(mix(st.seed, uint64(t/5))))
		if throttled {
			// HW slowdown cuts the clocks by half or more, and the power
			// with them.
			clock *= 0.5
			power = m.IdleWatts + (power-m.IdleWatts)*0.55
		}
		if power >= m.TDPWatts {
			power = m.TDPWatts
			s.ThrottleReasons |= contracts.ThrottleSWPowerCap
		}
		s.PowerW = round2(power)
		s.SMClockMHz = math.Round(clock/15) * 15
		// The die settles where cooling carries its power away.
		heat := (power - m.IdleWatts) / (0.9*m.TDPWatts - m.IdleWatts)
		target, tau = st.idleTemp+(st.busyTemp-st.idleTemp)*heat, heatTau
		if st.weak && unit(mix(st.seed^8, uint64(t*10))) < 0.002 {
			st.eccSBE++
			s.ECCSBE = st.eccSBE
		}
		// The processes of this GPU share the memory in use.
		if ps := (*procs)[procStart:]; len(ps) == 1 {
			ps[0].UsedMiB = s.FBUsedMiB
		} else {
			for k := range ps {
				ps[k].UsedMiB = int64(frac * float64(ps[k].UsedMiB))
			}
		}
		s.Processes = (*procs)[procStart:len(*procs):len(*procs)]
	} else {
		s.PowerW = round2(m.IdleWatts * (1 + 0.04*noise(st.seed^5, t/3)))
		s.SMClockMHz = m.IdleSMClockMHz
		s.ThrottleReasons |= contracts.ThrottleGPUIdle
	}
	if throttled {
		s.ThrottleReasons |= contracts.ThrottleHWSlowdown | contracts.ThrottleHWThermal
	}
	s.FBFreeMiB = m.MemoryMiB - s.FBUsedMiB

	// An overheat lasts its duration from the first sample that sees it.
	if st.overheat && st.heatFor > 0 {
		if st.heatUntil.IsZero() {
			st.heatUntil = now.Add(st.heatFor)
		} else if !now.Before(st.heatUntil) {
			st.endOverheat()
		}
	}
	switch {
	case st.overheat:
		// Between slowdown and shutdown: the hardware slowdown holds it.
		target, tau = (m.SlowdownTempC+m.ShutdownTempC)/2, overheatTau
	case st.recover:
		tau = recoverTau
	}
	if dt > 0 {
		st.tempC += (target - st.tempC) * (1 - math.Exp(-dt.Seconds()/tau.Seconds()))
	}
	s.TempC = math.Round(st.tempC + 0.4*noise(st.seed^6, t))
	b.thermalFacts(i, g)
	return s
}

// thermalFacts reports a GPU crossing its slowdown temperature, up or (a
// degree below it, so noise does not chatter) down; b.mu is held.
func (b *Backend) thermalFacts(i int, g *contracts.GPUInfo) {
	st := &b.state[i]
	slow := b.model.SlowdownTempC
	switch {
	case !st.hot && st.tempC >= slow:
		st.hot = true
		b.emit(device.Health{GPUIndex: i, GPUUUID: g.UUID, Kind: contracts.HealthThermal, Code: int(st.tempC),
			Healthy: !st.unhealthy, Message: fmt.Sprintf("GPU at %.0f °C, at or above its slowdown temperature %.0f °C: clocks throttled", st.tempC, slow)})
	case st.hot && !st.overheat && st.tempC < slow-1:
		st.hot, st.recover = false, false
		b.emit(device.Health{GPUIndex: i, GPUUUID: g.UUID, Kind: contracts.HealthThermal, Code: int(st.tempC),
			Healthy: !st.unhealthy, Message: fmt.Sprintf("GPU back at %.0f °C, below its slowdown temperature %.0f °C", st.tempC, slow)})
	}
}

// UUID is the stable UUID of a simulated GPU: "GPU-" and a UUID-shaped
// hex string derived from the node ID and index, like nvidia-smi -L
// prints, so restarts and other agents see the same devices.
func UUID(nodeID string, index int) string {
	sum := sha256.Sum256([]byte("gpuplane-sim-gpu/" + nodeID + "/" + strconv.Itoa(index)))
	return "GPU-" + uuidShape(sum[:16])
}

// hgxBuses are the PCI buses of the eight GPUs of an HGX H100 board (DGX
// H100 order), used for the first eight simulated GPUs.
var hgxBuses = []int{0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb}

// PCIBusID is the PCI bus ID of simulated GPU index, in nvidia-smi's
// domain:bus:device.function form.
func PCIBusID(index int) string {
	bus := 0xc0 + index
	if index >= 0 && index < len(hgxBuses) {
		bus = hgxBuses[index]
	}
	return fmt.Sprintf("00000000:%02X:00.0", bus&0xff)
}

// fakePID is the process ID a simulated allocation's run shows on its
// GPUs: stable per allocation, in the range Linux gives.
func fakePID(alloc string) int { return 1000 + int(hashString(alloc)%4_000_000) }

// mix is splitmix64 of a combined with b: a cheap, well-spread hash.
func mix(a, b uint64) uint64 {
	z := a + b*0x9e3779b97f4a7c15 + 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// hashString is FNV-1a of s, spread by mix; it does not allocate.
func hashString(s string) uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= 1099511628211
	}
	return mix(h, 0)
}

// unit maps a hash to [0, 1).
func unit(h uint64) float64 { return float64(h>>11) / (1 << 53) }

// noise is smooth value noise in [-1, 1]: random values at integer x,
// eased in between, so successive samples drift rather than jump.
func noise(seed uint64, x float64) float64 {
	i := math.Floor(x)
	f := x - i
	a := 2*unit(mix(seed, uint64(int64(i)))) - 1
	b := 2*unit(mix(seed, uint64(int64(i)+1))) - 1
	u := f * f * (3 - 2*f)
	return a + (b-a)*u
}

func clamp(v, lo, hi float64) float64 { return math.Max(lo, math.Min(hi, v)) }

func round2(v float64) float64 { return math.Round(v*100) / 100 }
