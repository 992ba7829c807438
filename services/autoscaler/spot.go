package autoscaler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/autoscaler/internal/actuate"
)

// spotReaction is the platform's answer to a spot interruption notice:
// a drain hold with the reclaim deadline in BucketNodeAdmin (the scheduler
// checkpoints and moves the node's jobs on it) and a spot_interruption
// alert; when the machine is gone, the alert resolves and the hold the
// autoscaler wrote is lifted.
type spotReaction struct {
	kv  jetstream.KeyValue
	bus *bus.Bus
	now func() time.Time
	log *slog.Logger
}

var _ actuate.Interruptions = spotReaction{}

// spotAlertID is the Nats-Msg-Id of a spot alert: the monitor's shape,
// with the reclaim time (Unix seconds) as the episode, so a notice is one
// episode whoever sees it and however often.
func spotAlertID(node, episode string, st contracts.AlertState) string {
	return "alert/" + contracts.AlertKindSpotInterruption + "/" + node + "/" + episode + "/" + string(st)
}

func spotEpisode(m cloud.Machine) string { return strconv.FormatInt(m.Interruption.Unix(), 10) }

func (r spotReaction) Noticed(ctx context.Context, m cloud.Machine) error {
	deadline := m.Interruption.UTC()
	if err := r.hold(ctx, m.NodeID, deadline); err != nil {
		return err
	}
	return r.alert(ctx, m, contracts.AlertFiring,
		fmt.Sprintf("the provider reclaims spot machine %s (node %s) at %s; its jobs are checkpointed and moved",
			m.ID, m.NodeID, deadline.Format(time.RFC3339)))
}

func (r spotReaction) Gone(ctx context.Context, m cloud.Machine) error {
	if err := r.release(ctx, m.NodeID); err != nil {
		return err
	}
	if m.Interruption.IsZero() {
		return nil // no notice, no alert to resolve
	}
	return r.alert(ctx, m, contracts.AlertResolved, fmt.Sprintf("spot machine %s (node %s) was reclaimed", m.ID, m.NodeID))
}

func (r spotReaction) alert(ctx context.Context, m cloud.Machine, st contracts.AlertState, msg string) error {
	ep := spotEpisode(m)
	now := r.now()
	a := contracts.Alert{SchemaVersion: contracts.SchemaVersion, Kind: contracts.AlertKindSpotInterruption, Key: m.NodeID,
		State: st, Severity: "warning", Message: msg, Time: now,
		Labels: map[string]string{
			contracts.AlertLabelScope: "node", contracts.AlertLabelNode: m.NodeID, contracts.AlertLabelPool: m.Pool,
			contracts.AlertLabelMachine: m.ID, contracts.AlertLabelDeadline: m.Interruption.UTC().Format(time.RFC3339),
			contracts.AlertLabelEpisode: ep,
		}}
	// Since is when the episode began: the notice, which is the reclaim
	// time less the notice the provider gave, unknown here; the firing
	// alert's own time stands for it.
	a.Since = now
	if _, err := r.bus.Publish(ctx, contracts.SubjectAlert(a.Kind), spotAlertID(m.NodeID, ep, st), a, bus.CESubject(m.NodeID)); err != nil {
		return fmt.Errorf("publish %s alert of %s: %w", st, m.NodeID, err)
	}
	return nil
}

// hold drains node with Cause spot_interruption and the deadline. An
// existing hold (an administrator's, or the autoscaler's idle drain) is
// kept and given the cause and deadline, with a compare-and-set so that a
// concurrent writer is never overwritten.
func (r spotReaction) hold(ctx context.Context, node string, deadline time.Time) error {
	return bus.UpdateNodeAdmin(ctx, r.kv, node, r.now(), func(na *contracts.NodeAdmin) bool {
		if na.Cordoned && na.Drain && na.Cause == contracts.ReasonSpotInterruption && na.Deadline != nil && na.Deadline.Equal(deadline) {
			return false // already done
		}
		if !na.Cordoned && !na.Drain {
			na.Reason = holdReasonPrefix + " spot interruption notice; the machine is reclaimed at " + deadline.Format(time.RFC3339)
		}
		na.Cordoned, na.Drain, na.Cause, na.Deadline = true, true, contracts.ReasonSpotInterruption, &deadline
		return true
	})
}

// release undoes the spot hold of a node whose machine is gone: the
// node-level hold the autoscaler wrote is lifted; an administrator's hold
// that was given the spot cause keeps everything its administrator set
// (cordon, drain, reason) and loses only the cause and deadline, which no
// longer hold. Holds on single GPUs stay either way.
func (r spotReaction) release(ctx context.Context, node string) error {
	err := bus.UpdateNodeAdmin(ctx, r.kv, node, r.now(), func(na *contracts.NodeAdmin) bool {
		switch {
		case strings.HasPrefix(na.Reason, holdReasonPrefix):
			na.Cordoned, na.Drain, na.Reason = false, false, ""
		case na.Cause != contracts.ReasonSpotInterruption:
			return false
		}
		na.Cause, na.Deadline = "", nil
		return true
	})
	if errors.Is(err, bus.ErrUnreadableHold) {
		return nil // not a document the autoscaler wrote
	}
	return err
}

// busEvents publishes machine events on SubjectMachines(pool) with
// Nats-Msg-Id MachineEventID.
type busEvents struct {
	bus *bus.Bus
	log *slog.Logger
}

var _ actuate.Events = busEvents{}

func (b busEvents) MachineEvent(ctx context.Context, e contracts.MachineEvent) {
	key := e.MachineID
	if key == "" {
		key = e.Token
	}
	if _, err := b.bus.Publish(ctx, contracts.SubjectMachines(e.Pool), contracts.MachineEventID(e.Kind, key), e, bus.CESubject(key)); err != nil {
		b.log.Warn("machine event not published", "pool", e.Pool, "kind", e.Kind, "machine", key, "err", err)
	}
}
