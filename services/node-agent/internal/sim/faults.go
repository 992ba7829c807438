package sim

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
)

// maxPending bounds the health facts kept for a watcher that is not
// there (or slow); the oldest go first.
const maxPending = 256

// InjectFault applies a per-GPU fault (xid, ecc_dbe, overheat, clear) so
// that samples and health facts show it:
//   - xid: LastXID is the code (79 by default). 79 makes the GPU fall off
//     the bus: unhealthy, and its samples carry nothing but the fault. Other
//     codes make it unhealthy unless they are application errors
//     (contracts.XIDUnhealthy).
//   - ecc_dbe: the volatile double-bit count rises, with XID 48; unhealthy.
//   - overheat: the cooling fails; the die is above its slowdown
//     temperature at once and stays there (HW thermal slowdown: clocks
//     halved) for Duration from the next sample, or until cleared.
//   - clear: every fault of the GPU, or of every GPU when Fault.GPU is
//     empty, ends as after a GPU reset (volatile ECC counts back to 0).
//
// Each fault reports a health fact to WatchHealth. Machine death and agent
// pause are the agent's, not the GPUs': they are refused here. It is not
// idempotent: the agent applies each Fault.ID once.
func (b *Backend) InjectFault(f contracts.Fault) error {
	if err := f.Validate(); err != nil {
		return fmt.Errorf("sim: fault: %w", err)
	}
	switch f.Kind {
	case contracts.FaultMachineDeath, contracts.FaultAgentPause:
		return fmt.Errorf("sim: fault %s is the agent's, not the GPUs'", f.Kind)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if f.Kind == contracts.FaultClear && f.GPU == "" {
		for i := range b.state {
			b.clear(i)
		}
		return nil
	}
	i, err := b.gpuIndex(f.GPU)
	if err != nil {
		return fmt.Errorf("sim: fault %s %s: %w", f.Kind, f.ID, err)
	}
	st := &b.state[i]
	uuid := b.machine.GPUs[i].UUID
	switch f.Kind {
	case contracts.FaultXID:
		code := f.XIDCode()
		st.lastXID = code
		if contracts.XIDUnhealthy(code) {
			st.unhealthy = true
		}
		h := device.Health{GPUIndex: i, GPUUUID: uuid, Kind: contracts.HealthXID, Code: code,
			Healthy: !st.unhealthy, Message: contracts.XIDDescription(code)}
		if code == 79 {
			st.offBus = true
			h.Kind = contracts.HealthFellOffBus
		}
		b.emit(h)
	case contracts.FaultECCDBE:
		st.eccDBE++
		st.lastXID, st.unhealthy = 48, true
		b.emit(device.Health{GPUIndex: i, GPUUUID: uuid, Kind: contracts.HealthECCDBE, Code: 48, Healthy: false,
			Message: fmt.Sprintf("%s; volatile double-bit count %d", contracts.XIDDescription(48), st.eccDBE)})
	case contracts.FaultOverheat:
		st.overheat, st.recover = true, false
		st.heatFor, st.heatUntil = f.Duration.D(), time.Time{}
		// The fault is found when the die crosses its slowdown
		// temperature: it is there now.
		st.tempC = max(st.tempC, b.model.SlowdownTempC+0.5)
		b.thermalFacts(i, &b.machine.GPUs[i])
	case contracts.FaultClear:
		b.clear(i)
	}
	return nil
}

// clear ends every fault of GPU i, as a GPU reset does; b.mu is held.
func (b *Backend) clear(i int) {
	st := &b.state[i]
	was := st.unhealthy
	st.offBus, st.unhealthy, st.lastXID, st.eccSBE, st.eccDBE = false, false, 0, 0, 0
	st.endOverheat()
	if was {
		b.emit(device.Health{GPUIndex: i, GPUUUID: b.machine.GPUs[i].UUID, Kind: contracts.HealthRecovered,
			Healthy: true, Message: "faults cleared: GPU reset"})
	}
}

// endOverheat restores cooling; the die cools below its slowdown
// temperature within a few samples, which report it.
func (st *gpuState) endOverheat() {
	if st.overheat {
		st.overheat, st.recover = false, true
	}
	st.heatFor, st.heatUntil = 0, time.Time{}
}

// gpuIndex resolves a fault's GPU: empty (the first GPU), an index, or a
// GPU UUID.
func (b *Backend) gpuIndex(spec string) (int, error) {
	if spec == "" {
		return 0, nil
	}
	if n, err := strconv.Atoi(spec); err == nil {
		if n < 0 || n >= len(b.state) {
			return 0, fmt.Errorf("no GPU %d on node %s; it has GPUs 0 to %d", n, b.nodeID, len(b.state)-1)
		}
		return n, nil
	}
	for i, g := range b.machine.GPUs {
		if g.UUID == spec {
			return i, nil
		}
	}
	return 0, fmt.Errorf("no GPU %q on node %s; want an index 0 to %d or one of its GPU UUIDs", spec, b.nodeID, len(b.state)-1)
}

// emit queues a health fact for WatchHealth; b.mu is held.
func (b *Backend) emit(h device.Health) {
	if len(b.pending) >= maxPending {
		b.pending = b.pending[1:]
	}
	b.pending = append(b.pending, h)
	select {
	case b.notify <- struct{}{}:
	default:
	}
}

// WatchHealth reports every health fact of the machine's GPUs, in order,
// from the calling goroutine, until ctx ends. Facts that happened before
// the call are reported first. One watcher at a time.
func (b *Backend) WatchHealth(ctx context.Context, report func(device.Health)) error {
	for {
		b.mu.Lock()
		facts := b.pending
		b.pending = nil
		b.mu.Unlock()
		for _, h := range facts {
			if ctx.Err() != nil {
				return nil
			}
			report(h)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-b.notify:
		}
	}
}
