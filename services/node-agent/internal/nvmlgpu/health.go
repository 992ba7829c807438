package nvmlgpu

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
)

// Health tuning.
const (
	// ThermalHysteresisC is how far below the slowdown threshold a hot GPU
	// must cool before it is reported back to normal, so a GPU hovering
	// at the threshold does not flap once a second.
	ThermalHysteresisC = 3
	// XIDRepeatWindow: an XID that leaves the GPU usable (an application
	// fault) is a fact, not a state; a faulting job can raise the same one
	// many times a second, so the same XID on the same GPU is reported at
	// most once per window.
	XIDRepeatWindow = time.Minute
	// maxPending bounds the facts kept for a WatchHealth that is not
	// running; the oldest are dropped beyond it.
	maxPending = 1024
)

// healthEvents are the NVML events WatchHealth registers for. Single-bit
// ECC events are left out on purpose: the hardware corrected those
// errors, they are no health fact, and Sample reports their count.
const healthEvents = nvml.EventTypeXidCriticalError | nvml.EventTypeDoubleBitEccError

// XIDClass is what an XID means for the GPU that raised it.
type XIDClass struct {
	Kind    contracts.HealthKind
	Healthy bool // whether the GPU may still be given to new work
	What    string
}

// ClassifyXID classifies an XID error (NVIDIA's XID catalogue).
func ClassifyXID(xid int) XIDClass {
	switch xid {
	case 79:
		return XIDClass{contracts.HealthFellOffBus, false, "GPU has fallen off the bus"}
	case 48:
		return XIDClass{contracts.HealthXID, false, "double-bit ECC error"}
	case 94:
		return XIDClass{contracts.HealthXID, false, "contained ECC error"}
	case 95:
		return XIDClass{contracts.HealthXID, false, "uncontained ECC error"}
	case 63:
		return XIDClass{contracts.HealthXID, true, "ECC page retirement or row remapping recorded"}
	case 64:
		return XIDClass{contracts.HealthXID, true, "ECC page retirement or row remapping failure"}
	case 92:
		return XIDClass{contracts.HealthXID, true, "high single-bit ECC error rate"}
	case 13:
		return XIDClass{contracts.HealthXID, true, "graphics engine exception (application fault)"}
	case 31:
		return XIDClass{contracts.HealthXID, true, "GPU memory page fault (application fault)"}
	case 43:
		return XIDClass{contracts.HealthXID, true, "GPU stopped processing (application fault)"}
	case 45:
		return XIDClass{contracts.HealthXID, true, "preemptive cleanup after an application fault"}
	}
	return XIDClass{contracts.HealthXID, false, "critical XID error"}
}

// WatchHealth reports health facts until ctx ends, then returns nil: XID
// and double-bit ECC events from NVML's event set, and the facts Sample
// found (a lost GPU, a rising double-bit count, a GPU at its slowdown
// temperature). report is called from this goroutine only. One
// WatchHealth runs at a time.
func (b *Backend) WatchHealth(ctx context.Context, report func(device.Health)) error {
	b.mu.Lock()
	if b.watching {
		b.mu.Unlock()
		return errors.New("nvml backend: WatchHealth is already running")
	}
	b.watching = true
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		b.watching = false
		b.mu.Unlock()
	}()
	set, err := b.openEvents()
	if err != nil {
		return err
	}
	defer b.closeEvents(set)
	for {
		b.deliver(report)
		if ctx.Err() != nil {
			return nil
		}
		if set == nil {
			// No GPU delivers events: Sample's facts are all there is.
			select {
			case <-ctx.Done():
			case <-b.wake:
			}
			continue
		}
		if err := b.waitEvent(ctx, set); err != nil {
			return err
		}
	}
}

// openEvents creates the event set and registers every GPU for the health
// events it supports. It returns a nil set when no GPU supports any.
func (b *Backend) openEvents() (nvml.EventSet, error) {
	b.life.Lock()
	defer b.life.Unlock()
	if b.closed {
		return nil, ErrClosed
	}
	set, ret := b.lib.EventSetCreate()
	if ret != nvml.SUCCESS {
		b.log.Warn("NVML event set not created; health comes from samples only", "err", ret)
		return nil, nil
	}
	registered := 0
	for _, g := range b.gpus {
		supported, ret := g.dev.GetSupportedEventTypes()
		if ret != nvml.SUCCESS {
			b.log.Warn("GPU reports no event support; its XIDs are not seen, ECC comes from samples",
				"gpu_index", g.index, "gpu_uuid", g.uuid, "err", ret)
			continue
		}
		mask := supported & healthEvents
		if mask == 0 {
			continue
		}
		if ret := g.dev.RegisterEvents(mask, set); ret != nvml.SUCCESS {
			b.log.Warn("GPU health events not registered; its XIDs are not seen, ECC comes from samples",
				"gpu_index", g.index, "gpu_uuid", g.uuid, "err", ret)
			continue
		}
		registered++
	}
	if registered == 0 {
		_ = set.Free()
		return nil, nil
	}
	b.events = set
	return set, nil
}

// closeEvents frees set unless Close already did.
func (b *Backend) closeEvents(set nvml.EventSet) {
	b.life.Lock()
	defer b.life.Unlock()
	if set != nil && b.events == set {
		_ = set.Free()
		b.events = nil
	}
}

// waitEvent waits up to eventWait for one event and applies it.
func (b *Backend) waitEvent(ctx context.Context, set nvml.EventSet) error {
	if err := b.enter(); err != nil {
		return err
	}
	data, ret := set.Wait(uint32(b.eventWait.Milliseconds()))
	if ret == nvml.SUCCESS {
		b.onEvent(data)
	}
	b.leave()
	switch ret {
	case nvml.SUCCESS, nvml.ERROR_TIMEOUT:
		return nil
	}
	// A lost GPU makes the wait fail (Sample names which one); do not
	// spin on it.
	b.log.Debug("NVML event wait failed", "err", ret)
	select {
	case <-ctx.Done():
	case <-b.wake:
	case <-time.After(b.eventWait):
	}
	return nil
}

// onEvent applies one NVML event.
func (b *Backend) onEvent(e nvml.EventData) {
	g := b.gpuOf(e.Device)
	if g == nil {
		b.log.Warn("NVML event for an unknown GPU", "event_type", e.EventType, "data", e.EventData)
		return
	}
	switch {
	case e.EventType&nvml.EventTypeXidCriticalError != 0:
		b.mu.Lock()
		b.noteXID(g, int(e.EventData))
		b.mu.Unlock()
	case e.EventType&nvml.EventTypeDoubleBitEccError != 0:
		n, ret := g.dev.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC)
		b.noteDBE(g, n, ret != nvml.SUCCESS)
	}
}

// gpuOf finds the GPU of an event's device: by handle, else by UUID.
func (b *Backend) gpuOf(dev nvml.Device) *gpu {
	if dev == nil {
		return nil
	}
	for _, g := range b.gpus {
		if g.dev == dev {
			return g
		}
	}
	uuid, ret := dev.GetUUID()
	if ret != nvml.SUCCESS {
		return nil
	}
	for _, g := range b.gpus {
		if g.uuid == uuid {
			return g
		}
	}
	return nil
}

// deliver reports the facts found so far, outside the lock.
func (b *Backend) deliver(report func(device.Health)) {
	b.mu.Lock()
	facts := b.pending
	b.pending = nil
	b.mu.Unlock()
	for _, f := range facts {
		report(f)
	}
}

// emit queues a fact for WatchHealth. b.mu is held.
func (b *Backend) emit(g *gpu, kind contracts.HealthKind, code int, healthy bool, msg string) {
	if len(b.pending) >= maxPending {
		b.log.Warn("health fact dropped: WatchHealth is not running", "gpu_uuid", b.pending[0].GPUUUID, "kind", b.pending[0].Kind)
		b.pending = b.pending[1:]
	}
	b.pending = append(b.pending, device.Health{
		GPUIndex: g.index, GPUUUID: g.uuid, Kind: kind, Code: code, Healthy: healthy, Message: msg,
	})
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

// markLost records that g fell off the bus, once. b.mu is held.
func (b *Backend) markLost(g *gpu, xid int, why string) {
	if g.fellOff {
		return
	}
	g.fellOff, g.healthy = true, false
	b.emit(g, contracts.HealthFellOffBus, xid, false, why)
}

// noteXID applies an XID. Unhealthy XIDs are reported once each per GPU
// (the GPU stays unhealthy until reset); the others at most once per
// XIDRepeatWindow. b.mu is held.
func (b *Backend) noteXID(g *gpu, xid int) {
	g.lastXID = xid
	c := ClassifyXID(xid)
	msg := fmt.Sprintf("XID %d: %s", xid, c.What)
	if c.Kind == contracts.HealthFellOffBus {
		b.markLost(g, xid, msg)
		return
	}
	if !c.Healthy {
		if g.xidReported[xid] {
			return
		}
		g.xidReported[xid], g.healthy = true, false
		b.emit(g, c.Kind, xid, false, msg)
		return
	}
	now := b.now()
	if at, ok := g.xidAt[xid]; ok && now.Sub(at) < XIDRepeatWindow {
		return
	}
	g.xidAt[xid] = now
	b.emit(g, c.Kind, xid, g.healthy, msg)
}

// noteDBE applies a reading of the volatile double-bit ECC count (force:
// an event said one happened but the count could not be read). The first
// rise makes the GPU unhealthy; a count already above zero when the agent
// starts counts as a rise, since the GPU has not been reset since.
func (b *Backend) noteDBE(g *gpu, count uint64, force bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if count <= g.dbeSeen && !force {
		return
	}
	g.dbeSeen = max(g.dbeSeen, count)
	if g.dbeReported {
		return
	}
	g.dbeReported, g.healthy = true, false
	msg := fmt.Sprintf("%d double-bit ECC errors since the driver loaded", count)
	if force {
		msg = "double-bit ECC error event"
	}
	b.emit(g, contracts.HealthECCDBE, 0, false, msg)
}

// noteTemperature reports g reaching its slowdown temperature, and coming
// back ThermalHysteresisC below it.
func (b *Backend) noteTemperature(g *gpu, t uint32) {
	if g.slowdownC == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case !g.hot && t >= g.slowdownC:
		g.hot = true
		b.emit(g, contracts.HealthThermal, 0, g.healthy,
			fmt.Sprintf("temperature %d °C at or above the slowdown threshold %d °C", t, g.slowdownC))
	case g.hot && t+ThermalHysteresisC <= g.slowdownC:
		g.hot = false
		b.emit(g, contracts.HealthThermal, 0, g.healthy,
			fmt.Sprintf("temperature %d °C back below the slowdown threshold %d °C: recovered", t, g.slowdownC))
	}
}
