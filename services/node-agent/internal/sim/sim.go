// Package sim is the simulated GPU backend of the node agent: GPUs built
// from the catalogue with stable UUIDs and PCI bus IDs, and telemetry that
// looks like what DCGM reports for idle and busy cards. Readings are a
// pure function of the seed, the sample times and which GPUs are busy, so
// two backends fed the same inputs report the same figures.
package sim

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
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
// have 8; 16 leaves room for odd test shapes).
const MaxGPUs = 16

// Thermal time constants: a card under load approaches its working
// temperature in about two minutes and cools down more slowly.
const (
	heatTau = 40 * time.Second
	coolTau = 60 * time.Second
)

// Config describes one simulated machine.
type Config struct {
	NodeID string
	Model  catalog.Model
	Count  int
	// NVLink puts every GPU in one NVLink domain named after the node.
	NVLink bool
	// Seed makes the readings reproducible; 0 derives it from NodeID.
	Seed uint64
}

// Backend is a simulated machine. It is safe for concurrent use.
type Backend struct {
	model catalog.Model
	gpus  []contracts.GPUInfo

	mu    sync.Mutex
	last  time.Time
	state []gpuState
}

type gpuState struct {
	seed     uint64
	tempC    float64 // current die temperature, unrounded
	idleTemp float64 // where an idle card settles
	busyTemp float64 // where a loaded card settles
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
	if cfg.NVLink && cfg.Model.ID != "" && !cfg.Model.NVLink {
		errs = append(errs, fmt.Errorf("sim: %s is a PCIe card without NVLink", cfg.Model.ID))
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
	b := &Backend{model: cfg.Model}
	for i := range cfg.Count {
		g := contracts.GPUInfo{
			Index:     i,
			UUID:      UUID(cfg.NodeID, i),
			Model:     cfg.Model.ID,
			MemoryMiB: cfg.Model.MemoryMiB,
			PCIBusID:  PCIBusID(i),
			Healthy:   true,
		}
		if cfg.NVLink {
			g.NVLinkDomain = cfg.NodeID
		}
		b.gpus = append(b.gpus, g)
		s := mix(seed, uint64(i)+1)
		idle := 30 + 4*unit(mix(s, 1)) // 30-34 °C
		busy := 72 + 6*unit(mix(s, 2)) // 72-78 °C
		b.state = append(b.state, gpuState{seed: s, tempC: idle, idleTemp: idle, busyTemp: busy})
	}
	return b, nil
}

// Kind is "sim".
func (b *Backend) Kind() string { return Kind }

// Discover returns the machine's GPUs.
func (b *Backend) Discover(context.Context) (device.Machine, error) {
	out := make([]contracts.GPUInfo, len(b.gpus))
	copy(out, b.gpus)
	return device.Machine{GPUs: out}, nil
}

// Sample reads every GPU at now. busy maps the UUID of each GPU held by a
// running allocation to that allocation's ID: those GPUs work (85-98 %
// utilisation, memory in use, power near TDP, warming towards 72-78 °C);
// the others idle (0 %, idle power, cooling towards 30-34 °C).
// Temperatures integrate from the previous sample, so samples are expected
// in time order; an earlier now is treated as no time passing.
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
	m := b.model
	out := make([]contracts.GPUSample, len(b.gpus))
	for i, g := range b.gpus {
		st := &b.state[i]
		alloc, working := busy[g.UUID]
		s := contracts.GPUSample{Index: g.Index, UUID: g.UUID, Model: g.Model, AllocationID: alloc}
		target, tau := st.idleTemp, coolTau
		if working {
			a := hashString(alloc)
			// Each allocation has its own level, wobbling slowly around it.
			level := 89 + 5*unit(mix(a, 1))
			util := level + 4*noise(st.seed^1, t/4) + 1.5*noise(st.seed^2, t*1.3)
			util = clamp(math.Round(util), 85, 98)
			load := (util - 85) / 13 // 0..1 across the band
			s.GPUUtil = util
			s.MemCopyUtil = clamp(math.Round(util*0.45+6*noise(st.seed^3, t/2)), 0, 100)
			frac := 0.55 + 0.35*unit(mix(a, 2)) + 0.005*noise(st.seed^4, t/10)
			s.FBUsedMiB = min(int64(frac*float64(m.MemoryMiB)), m.MemoryMiB)
			power := m.TDPWatts * (0.84 + 0.12*load + 0.015*noise(st.seed^5, t))
			s.PowerW = round2(min(power, m.TDPWatts))
			clock := m.MaxSMClockMHz * (0.97 + 0.03*unit(mix(st.seed, uint64(t/5))))
			s.SMClockMHz = math.Round(clock/15) * 15
			target, tau = st.busyTemp+2*load, heatTau
		} else {
			s.PowerW = round2(m.IdleWatts * (1 + 0.04*noise(st.seed^5, t/3)))
			s.SMClockMHz = m.IdleSMClockMHz
		}
		s.FBFreeMiB = m.MemoryMiB - s.FBUsedMiB
		if dt > 0 {
			st.tempC += (target - st.tempC) * (1 - math.Exp(-dt.Seconds()/tau.Seconds()))
		}
		s.TempC = math.Round(st.tempC + 0.4*noise(st.seed^6, t))
		out[i] = s
	}
	return out, nil
}

// UUID is the stable UUID of a simulated GPU: "GPU-" and a UUID-shaped
// hex string derived from the node ID and index, like nvidia-smi -L
// prints, so restarts and other agents see the same devices.
func UUID(nodeID string, index int) string {
	sum := sha256.Sum256([]byte("gpuplane-sim-gpu/" + nodeID + "/" + strconv.Itoa(index)))
	h := hex.EncodeToString(sum[:16])
	return "GPU-" + h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
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

// mix is splitmix64 of a combined with b: a cheap, well-spread hash.
func mix(a, b uint64) uint64 {
	z := a + b*0x9e3779b97f4a7c15 + 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

func hashString(s string) uint64 {
	var b [8]byte
	sum := sha256.Sum256([]byte(s))
	copy(b[:], sum[:8])
	return binary.LittleEndian.Uint64(b[:])
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
