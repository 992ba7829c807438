// Package nvmlgpu is the node agent's backend for a machine's real NVIDIA
// GPUs, read through NVML (github.com/NVIDIA/go-nvml, which opens the
// driver's libnvidia-ml.so.1 at run time, so this package builds and its
// mock-backed tests pass on a machine without a GPU).
//
// What it reads:
//   - Discover: each GPU's index, UUID, product name (mapped to a catalogue
//     model ID when known), framebuffer size, PCI bus ID and compute
//     capability; the driver and CUDA versions; the MIG mode and the MIG
//     devices that exist (UUID, GPU and compute instance IDs, profile name
//     such as "1g.10gb", placement, memory); and the topology between every
//     pair of GPUs: the closest common PCIe ancestor and the number of
//     active NVLink links, direct or through NVSwitches. GPUs joined by
//     NVLink share an NVLinkDomain ("<node>-nvl0").
//   - Sample (once a second): GPU and memory utilisation, framebuffer used
//     and free, temperature, power draw and enforced limit, SM clock,
//     volatile ECC single- and double-bit totals, clocks-event (throttle)
//     reasons, compute processes, the last XID and the GPU's health. A
//     field the GPU does not support reads as zero; it never fails the
//     sample.
//
// Health (WatchHealth, fed by NVML's event set and by Sample):
//   - XID 79, or any call answering ERROR_GPU_IS_LOST: fell_off_bus,
//     unhealthy.
//   - XID 48, 94, 95 (double-bit, contained and uncontained ECC errors):
//     unhealthy. XID 63, 64, 92 (row remapping, page retirement, high
//     single-bit rate) are reported and leave the GPU usable.
//   - XID 13, 31, 43, 45 are faults of the application that ran, not of
//     the GPU: reported, the GPU stays healthy.
//   - Any other critical XID: unhealthy.
//   - A rise of the volatile double-bit ECC count (event, or the count
//     read by Sample where events are not supported): ecc_dbe, unhealthy.
//   - Temperature at or above the GPU's slowdown threshold: thermal, the
//     GPU stays usable; a thermal fact again once it is back below.
//
// Each fact is reported once per transition: a GPU that stays lost, hot
// or unhealthy does not repeat it every second. Nothing here makes an
// unhealthy GPU healthy again: that takes a GPU reset, which an
// administrator does and after which the agent is restarted.
//
// Nothing is ever written to the card: no Set* call, no MIG change, no
// clock or power change, no reset. The agent shares the machine with the
// runs it starts and with whoever administers it; changing a card's
// settings is an administrator's decision, and a read-only agent cannot
// break a machine however wrong its input is.
package nvmlgpu

import (
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpuplane/gpuplane/services/node-agent/internal/catalog"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
)

// Kind is the backend's name in the inventory.
const Kind = "nvml"

// DefaultEventWait bounds one wait for an NVML event, so WatchHealth sees
// ctx end and delivers facts found by Sample within about this long.
const DefaultEventWait = 500 * time.Millisecond

// ErrLibraryNotFound is wrapped by Open's error when the NVIDIA driver's
// library cannot be loaded: the machine has no NVIDIA driver (or GPU).
var ErrLibraryNotFound = errors.New("nvml.Init: ERROR_LIBRARY_NOT_FOUND")

// errLibraryMissing is the message an operator sees when the agent is
// started with the nvml backend on a machine without the driver.
var errLibraryMissing = fmt.Errorf("nvml backend: NVIDIA driver library libnvidia-ml.so.1 not found "+
	"(is the NVIDIA driver installed and this a GPU machine? use backend sim otherwise): %w", ErrLibraryNotFound)

// ErrClosed is returned by calls made after Close.
var ErrClosed = errors.New("nvml backend: closed")

// Config configures Open.
type Config struct {
	// NodeID names the NVLink domains ("<node>-nvl0").
	NodeID string
	// Lib is the NVML library; nil means nvml.New(), the driver's
	// libnvidia-ml.so.1. Tests pass go-nvml's mock.
	Lib nvml.Interface
	// Log receives warnings about fields that cannot be read; nil means
	// slog.Default().
	Log *slog.Logger
	// Now is the clock of the XID repeat window; nil means time.Now.
	Now func() time.Time
	// EventWait bounds one wait for an NVML event; 0 means DefaultEventWait.
	EventWait time.Duration
}

// Backend reads one machine's GPUs through NVML. It is safe for
// concurrent use: the agent samples and watches health from different
// goroutines.
type Backend struct {
	lib       nvml.Interface
	nodeID    string
	log       *slog.Logger
	now       func() time.Time
	eventWait time.Duration
	// eventReasons is whether the driver has
	// nvmlDeviceGetCurrentClocksEventReasons (R535 and later); older ones
	// only have the throttle-reasons name of the same call.
	eventReasons bool
	gpus         []*gpu

	// life guards the library's lifetime: every section that calls NVML
	// holds it for reading, Close for writing, so no call runs after
	// Shutdown unloaded the library.
	life   sync.RWMutex
	closed bool
	events nvml.EventSet // the event set of a running WatchHealth

	// mu guards the health state of every GPU and the facts not yet
	// delivered.
	mu       sync.Mutex
	pending  []device.Health
	wake     chan struct{}
	watching bool
}

// gpu is one discovered GPU. The fields above the line are fixed at Open;
// the rest is health state guarded by Backend.mu.
type gpu struct {
	index     int
	uuid      string
	name      string // product name, as nvidia-smi prints it
	model     string // catalogue ID, or the product name when unknown
	busID     string // normalised, to match NVLink remote ends
	dev       nvml.Device
	slowdownC uint32 // 0 when the GPU does not report one

	healthy     bool
	fellOff     bool
	hot         bool
	dbeSeen     uint64
	dbeReported bool
	lastXID     int
	xidReported map[int]bool      // unhealthy XIDs already reported
	xidAt       map[int]time.Time // when each healthy XID was last reported
	warned      map[string]bool   // fields whose read failure was logged
}

// Open loads NVML, initialises it and lists the machine's GPUs. It fails
// with an error wrapping ErrLibraryNotFound on a machine without the
// NVIDIA driver. Close releases NVML.
func Open(cfg Config) (*Backend, error) {
	lib := cfg.Lib
	if lib == nil {
		lib = nvml.New()
	}
	switch ret := lib.Init(); ret {
	case nvml.SUCCESS:
	case nvml.ERROR_LIBRARY_NOT_FOUND:
		return nil, errLibraryMissing
	case nvml.ERROR_DRIVER_NOT_LOADED:
		return nil, fmt.Errorf("nvml backend: nvml.Init: %w (libnvidia-ml.so.1 is there but the NVIDIA kernel module is not loaded)", ret)
	default:
		return nil, fmt.Errorf("nvml backend: nvml.Init: %w", ret)
	}
	b := &Backend{
		lib: lib, nodeID: cfg.NodeID, log: cfg.Log, now: cfg.Now, eventWait: cfg.EventWait,
		wake: make(chan struct{}, 1),
	}
	if b.log == nil {
		b.log = slog.Default()
	}
	if b.now == nil {
		b.now = time.Now
	}
	if b.eventWait <= 0 {
		b.eventWait = DefaultEventWait
	}
	b.eventReasons = lib.Extensions().LookupSymbol("nvmlDeviceGetCurrentClocksEventReasons") == nil
	if err := b.list(); err != nil {
		_ = lib.Shutdown()
		return nil, err
	}
	return b, nil
}

// list finds the GPUs. A GPU whose handle or UUID cannot be read (one
// that fell off the bus before the agent started) is left out with a
// warning: the others still serve.
func (b *Backend) list() error {
	n, ret := b.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return fmt.Errorf("nvml backend: count GPUs: %w", ret)
	}
	for i := range n {
		dev, ret := b.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			b.log.Warn("GPU left out: no handle", "gpu_index", i, "err", ret)
			continue
		}
		uuid, ret := dev.GetUUID()
		if ret != nvml.SUCCESS {
			b.log.Warn("GPU left out: no UUID", "gpu_index", i, "err", ret)
			continue
		}
		g := &gpu{index: i, uuid: uuid, dev: dev, healthy: true,
			xidReported: map[int]bool{}, xidAt: map[int]time.Time{}, warned: map[string]bool{}}
		if name, ret := dev.GetName(); ret == nvml.SUCCESS {
			g.name = name
		}
		g.model = g.name
		if m, ok := catalog.ByProductName(g.name); ok {
			g.model = m.ID
		}
		if pci, ret := dev.GetPciInfo(); ret == nvml.SUCCESS {
			g.busID = normalBusID(cString(pci.BusId[:]))
		}
		if t, ret := dev.GetTemperatureThreshold(nvml.TEMPERATURE_THRESHOLD_SLOWDOWN); ret == nvml.SUCCESS {
			g.slowdownC = t
		}
		b.gpus = append(b.gpus, g)
	}
	if len(b.gpus) == 0 {
		return fmt.Errorf("nvml backend: the NVIDIA driver sees no usable GPU (%d listed)", n)
	}
	return nil
}

// Kind is "nvml".
func (b *Backend) Kind() string { return Kind }

var nonAlnum = regexp.MustCompile(`[^a-z0-9]+`)

// MachineType derives a machine type from the GPUs, such as
// "h100-80gb-x8" ("mixed-x4" when the models differ), for an agent that
// is not told one.
func (b *Backend) MachineType() string {
	model := b.gpus[0].model
	for _, g := range b.gpus[1:] {
		if g.model != model {
			model = "mixed"
		}
	}
	model = strings.Trim(nonAlnum.ReplaceAllString(strings.ToLower(model), "-"), "-")
	return fmt.Sprintf("%s-x%d", model, len(b.gpus))
}

// Close frees the event set of a running WatchHealth and shuts NVML down.
// Calls after Close return ErrClosed; Close is idempotent.
func (b *Backend) Close() error {
	b.life.Lock()
	defer b.life.Unlock()
	if b.closed {
		return nil
	}
	b.closed = true
	if b.events != nil {
		_ = b.events.Free()
		b.events = nil
	}
	if ret := b.lib.Shutdown(); ret != nvml.SUCCESS {
		return fmt.Errorf("nvml backend: nvml.Shutdown: %w", ret)
	}
	return nil
}

// enter starts a section that calls NVML; leave ends it.
func (b *Backend) enter() error {
	b.life.RLock()
	if b.closed {
		b.life.RUnlock()
		return ErrClosed
	}
	return nil
}

func (b *Backend) leave() { b.life.RUnlock() }

// cString is a NUL-terminated C string of a fixed-size NVML array.
func cString(a []uint8) string {
	n := 0
	for n < len(a) && a[n] != 0 {
		n++
	}
	return string(a[:n])
}

// normalBusID writes a PCI bus ID as nvidia-smi does, "00000000:07:00.0":
// NVML gives a GPU's own ID with an 8-digit domain and some NVLink remote
// ends with a 4-digit one.
func normalBusID(id string) string {
	id = strings.ToLower(strings.TrimSpace(id))
	domain, rest, ok := strings.Cut(id, ":")
	if !ok || !strings.Contains(rest, ":") {
		return id
	}
	var d uint64
	if _, err := fmt.Sscanf(domain, "%x", &d); err != nil {
		return id
	}
	return fmt.Sprintf("%08x:%s", d, rest)
}

// read classifies the result of reading field on g: true on success.
// NOT_SUPPORTED is silent (the field stays zero); GPU_IS_LOST marks the
// GPU lost; anything else is logged once per GPU and field.
func (b *Backend) read(g *gpu, field string, ret nvml.Return) bool {
	switch ret {
	case nvml.SUCCESS:
		return true
	case nvml.ERROR_NOT_SUPPORTED:
		return false
	case nvml.ERROR_GPU_IS_LOST:
		b.mu.Lock()
		b.markLost(g, 0, "NVML answers GPU_IS_LOST reading "+field)
		b.mu.Unlock()
		return false
	}
	b.mu.Lock()
	first := !g.warned[field]
	g.warned[field] = true
	b.mu.Unlock()
	if first {
		b.log.Warn("GPU field not readable; reported as zero while it fails (logged once)",
			"gpu_index", g.index, "gpu_uuid", g.uuid, "field", field, "err", ret)
	}
	return false
}

// lost is whether g fell off the bus.
func (b *Backend) lost(g *gpu) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return g.fellOff
}
