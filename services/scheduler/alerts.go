package scheduler

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// AlertsConsumer is the durable consumer of OPS alerts the scheduler acts
// on: holds on GPUs the monitor reports unhealthy or hot.
const AlertsConsumer = "scheduler-alerts"

// The scheduler reacts to the monitor's alerts by their action label
// (contracts.AlertLabelAction), never by rule name:
//
//   - gpu_unhealthy (an XID or ECC fault): cordon that GPU and move its runs
//     (a GPUHold with Drain and Cause gpu_unhealthy in gp-node-admin). The
//     hold stays until an administrator lifts it: a card that threw an XID
//     is not trusted again because it went quiet.
//   - drain_gpu (overheating): the same with Cause overheating, lifted when
//     the alert resolves.
//   - defragment: consolidation is allowed in the pool while it fires
//     (Store.ApplyDefrag).
//
// Holds go through the bucket rather than straight into the store so that
// the resource manager refuses the GPU too, operators see them (gpuctl
// describe node) and a restarted scheduler finds them: the bucket is the
// one place holds live. The consumer is durable, so each alert is acted on
// once: an administrator's uncordon is not undone by a replayed alert.

// handleAlert applies one alert of the durable consumer.
func (s *scheduler) handleAlert(ctx context.Context, m *bus.Msg) error {
	var a contracts.Alert
	if err := m.Decode(&a); err != nil {
		return bus.Permanent(fmt.Errorf("alert: %w", err))
	}
	switch a.Labels[contracts.AlertLabelAction] {
	case contracts.AlertActionGPUUnhealthy:
		if a.State != contracts.AlertFiring {
			return nil // cleared by an administrator
		}
		return s.holdGPU(ctx, a, contracts.ReasonGPUUnhealthy)
	case contracts.AlertActionDrainGPU:
		if a.State == contracts.AlertFiring {
			return s.holdGPU(ctx, a, contracts.ReasonOverheating)
		}
		return s.liftGPU(ctx, a, contracts.ReasonOverheating)
	}
	return nil
}

// followDefrag folds every defragment alert the OPS stream holds, then
// follows new ones: which pools may be consolidated is state, not an
// action, and must survive a restart.
func (s *scheduler) followDefrag(ctx context.Context) error {
	return s.bus.Follow(ctx, bus.FollowSpec{Stream: contracts.StreamOps, FilterSubjects: []string{contracts.SubjectAlertsAll}},
		func(_ context.Context, m *bus.Msg) error {
			var a contracts.Alert
			if m.Decode(&a) != nil || a.Labels[contracts.AlertLabelAction] != contracts.AlertActionDefragment {
				return nil
			}
			pool := a.Labels[contracts.AlertLabelPool]
			if pool == "" {
				pool = a.Key
			}
			s.mu.Lock()
			defer s.mu.Unlock()
			s.st.ApplyDefrag(pool, a.Key, a.State == contracts.AlertFiring)
			return nil
		}, func() {})
}

// alertGPU reads the node and GPU an alert is about.
func alertGPU(a contracts.Alert) (node, uuid string, err error) {
	node, uuid = a.Labels[contracts.AlertLabelNode], a.Labels[contracts.AlertLabelGPU]
	if contracts.ValidateID(node) != nil || uuid == "" {
		return "", "", fmt.Errorf("alert %s/%s names no valid node and GPU (labels %v)", a.Kind, a.Key, a.Labels)
	}
	return node, uuid, nil
}

// holdGPU cordons and drains the GPU an alert names, for cause. An
// existing hold on the GPU is kept as it is (the first cause stays).
func (s *scheduler) holdGPU(ctx context.Context, a contracts.Alert, cause contracts.Reason) error {
	node, uuid, err := alertGPU(a)
	if err != nil {
		return bus.Permanent(err)
	}
	return s.updateHold(ctx, node, func(h *contracts.NodeAdmin) bool {
		if _, ok := h.GPUs[uuid]; ok {
			return false
		}
		if h.GPUs == nil {
			h.GPUs = map[string]contracts.GPUHold{}
		}
		since := a.Since
		if since.IsZero() {
			since = a.Time
		}
		h.GPUs[uuid] = contracts.GPUHold{Cordoned: true, Drain: true, Cause: cause, Reason: a.Message,
			Alert: a.Kind + "/" + a.Key, Since: since.UTC()}
		return true
	})
}

// liftGPU removes the hold the alert set, and only that one.
func (s *scheduler) liftGPU(ctx context.Context, a contracts.Alert, cause contracts.Reason) error {
	node, uuid, err := alertGPU(a)
	if err != nil {
		return bus.Permanent(err)
	}
	return s.updateHold(ctx, node, func(h *contracts.NodeAdmin) bool {
		g, ok := h.GPUs[uuid]
		if !ok || g.Cause != cause || g.Alert != a.Kind+"/"+a.Key {
			return false
		}
		delete(h.GPUs, uuid)
		return true
	})
}

// updateHold applies change to node's hold document (bus.UpdateNodeAdmin:
// compare-and-set, other writers' holds kept, an empty document deleted).
// An unreadable hold already keeps the node cordoned (fail closed); it is
// left for a person to fix, and the alert dead-lettered.
func (s *scheduler) updateHold(ctx context.Context, node string, change func(*contracts.NodeAdmin) bool) error {
	kv, err := s.bus.KeyValue(ctx, contracts.BucketNodeAdmin)
	if err != nil {
		return err
	}
	err = bus.UpdateNodeAdmin(ctx, kv, node, time.Now(), change)
	if errors.Is(err, bus.ErrUnreadableHold) {
		return bus.Permanent(err)
	}
	if err == nil {
		s.log.Info("node hold updated", "node", node)
	}
	return err
}
