package autoscaler

import (
	"context"
	"encoding/json"
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

// casAttempts bounds the compare-and-set retries against concurrent
// writers of one hold (an administrator, the scheduler's GPU holds).
const casAttempts = 5

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
	var last error
	for range casAttempts {
		e, err := r.kv.Get(ctx, node)
		var na contracts.NodeAdmin
		switch {
		case errors.Is(err, jetstream.ErrKeyNotFound):
			na = contracts.NodeAdmin{SchemaVersion: contracts.SchemaVersion, NodeID: node, Time: r.now(),
				Reason: holdReasonPrefix + " spot interruption notice; the machine is reclaimed at " + deadline.Format(time.RFC3339)}
		case err != nil:
			return fmt.Errorf("read hold of %s: %w", node, err)
		default:
			if err := json.Unmarshal(e.Value(), &na); err != nil {
				return fmt.Errorf("hold of %s is not a NodeAdmin document: %w", node, err)
			}
			if na.Cordoned && na.Drain && na.Cause == contracts.ReasonSpotInterruption && na.Deadline != nil && na.Deadline.Equal(deadline) {
				return nil // already done
			}
		}
		na.NodeID, na.Cordoned, na.Drain, na.Cause, na.Deadline = node, true, true, contracts.ReasonSpotInterruption, &deadline
		b, err := json.Marshal(na)
		if err != nil {
			return err
		}
		if e == nil {
			_, err = r.kv.Create(ctx, node, b)
		} else {
			_, err = r.kv.Update(ctx, node, b, e.Revision())
		}
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		last = err // someone wrote in between: read again
	}
	return fmt.Errorf("write spot hold of %s: %d attempts lost to concurrent writers: %w", node, casAttempts, last)
}

// release undoes the spot hold of a node whose machine is gone: a hold the
// autoscaler wrote is deleted; an administrator's hold that was given the
// spot cause keeps everything its administrator set (cordon, drain, reason,
// GPU holds) and loses only the cause and deadline, which no longer hold.
// Both are compare-and-set, so a concurrent writer's change is read again,
// never overwritten.
func (r spotReaction) release(ctx context.Context, node string) error {
	var last error
	for range casAttempts {
		e, err := r.kv.Get(ctx, node)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read hold of %s: %w", node, err)
		}
		var na contracts.NodeAdmin
		if err := json.Unmarshal(e.Value(), &na); err != nil {
			return nil // not a document the autoscaler wrote
		}
		switch {
		case strings.HasPrefix(na.Reason, holdReasonPrefix):
			err = r.kv.Delete(ctx, node, jetstream.LastRevision(e.Revision()))
		case na.Cause == contracts.ReasonSpotInterruption:
			na.Cause, na.Deadline = "", nil
			b, merr := json.Marshal(na)
			if merr != nil {
				return merr
			}
			_, err = r.kv.Update(ctx, node, b, e.Revision())
		default:
			return nil
		}
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		last = err
	}
	return fmt.Errorf("release spot hold of %s: %d attempts lost to concurrent writers: %w", node, casAttempts, last)
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
