package autoscaler

import (
	"context"
	"fmt"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/telemetry"
)

// scaleUpAlert is a firing alert asking a pool for more machines.
type scaleUpAlert struct {
	decisionID string // one per alert episode
	kind       string
	episode    string
	message    string
}

// alertDecisionID is the ID of the decision a scale_up alert episode
// causes. It names the episode, not the sizes, so the machine it creates
// (token "<ID>#0") is the same however often the alert is seen again.
func alertDecisionID(pool string, a contracts.Alert) string {
	return alertDecisionPrefix(pool) + a.Kind + "/" + a.Key + "/" + a.Labels[contracts.AlertLabelEpisode]
}

// alertDecisionPrefix starts the ID of every alert decision of pool; a
// demand decision's ID has the demand's stream sequence there instead.
func alertDecisionPrefix(pool string) string { return "scale/" + pool + "/alert/" }

// noteDecided records a decision published (or replayed) for pool when it
// answers a scale_up alert episode of a managed pool: only those are
// looked up (evaluateAlert), so only those are kept. The caller holds s.mu
// or runs before the followers start.
func (s *scaler) noteDecided(pool, id string) {
	if _, managed := s.cfg.Pools[pool]; managed && strings.HasPrefix(id, alertDecisionPrefix(pool)) {
		s.decided[id] = true
	}
}

// forgetDecided drops the decision of an episode that resolved, so decided
// holds only episodes still firing and does not grow with the service's
// age. Nothing can ask for that episode again: the alerts are read in
// stream order, the monitor never publishes a firing alert of an episode
// after its resolution (episode numbers only go up, and a republished
// transition has the same message ID, which JetStream drops), and at a
// restart the replay meets the resolution after the firing alert, as it
// did live. Age-based retention drops the oldest messages first, so a
// decision still replayed at start has its episode's resolution, which
// came after it, replayed too. The caller holds s.mu.
func (s *scaler) forgetDecided(id string) { delete(s.decided, id) }

// onAlert keeps the firing scale_up alert of each pool the autoscaler
// manages and decides at once. Other alerts, and pools it does not
// manage, are ignored.
func (s *scaler) onAlert(ctx context.Context, m *bus.Msg) error {
	var a contracts.Alert
	if err := m.Decode(&a); err != nil {
		s.log.Warn("skipping alert", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
		return nil
	}
	pool := a.Labels[contracts.AlertLabelPool]
	if a.Labels[contracts.AlertLabelAction] != contracts.AlertActionScaleUp {
		return nil
	}
	if _, ok := s.cfg.Pools[pool]; !ok {
		s.log.Debug("scale_up alert for a pool without a scaling policy", "pool", pool, "kind", a.Kind)
		return nil
	}
	id := alertDecisionID(pool, a)
	s.mu.Lock()
	defer s.mu.Unlock()
	switch a.State {
	case contracts.AlertFiring:
		s.scaleUpAlerts[pool] = scaleUpAlert{decisionID: id, kind: a.Kind,
			episode: a.Labels[contracts.AlertLabelEpisode], message: a.Message}
	case contracts.AlertResolved:
		if s.scaleUpAlerts[pool].decisionID == id {
			delete(s.scaleUpAlerts, pool)
		}
		s.forgetDecided(id)
		return nil
	default:
		return nil
	}
	return s.evaluate(ctx, pool)
}

// evaluateAlert asks for one more machine for pool's firing scale_up
// alert, once per episode, when the pool's cooldown has passed and it is
// below its maximum; until then the alert waits (the tick evaluates it
// again). The caller holds s.mu.
func (s *scaler) evaluateAlert(ctx context.Context, pool string) error {
	al, ok := s.scaleUpAlerts[pool]
	if !ok || s.decided[al.decisionID] {
		return nil
	}
	now := s.cfg.Now()
	current := 0
	if p, ok := s.fleet.Pool(pool); ok {
		current = p.LiveNodes
	}
	// Machines already asked for count against the maximum.
	booting, _ := s.booting(pool, contracts.PoolDemand{})
	current += booting
	why := ""
	if l, ok := s.last[pool]; ok && now.Before(l.Time.Add(s.cfg.cooldown(pool))) {
		why = fmt.Sprintf("alert %s waits for the cooldown after %s (until %s)", al.kind, l.ID, l.Time.Add(s.cfg.cooldown(pool)).Format("15:04:05"))
	} else if mx := s.cfg.maxNodes(pool); current >= mx {
		why = fmt.Sprintf("alert %s: pool %s has %d nodes, at or above its maximum of %d", al.kind, pool, current, mx)
	}
	if why != "" {
		if s.why[pool] != why {
			s.why[pool] = why
			s.log.Info("no scale decision", "pool", pool, "why", why)
		}
		return nil
	}
	d := contracts.ScaleDecision{SchemaVersion: contracts.SchemaVersion, ID: al.decisionID, Pool: pool, Direction: contracts.ScaleUp,
		CurrentNodes: current, DesiredNodes: current + 1, Time: now,
		Reason: fmt.Sprintf("alert %s (episode %s) asks for one more machine: %s", al.kind, al.episode, al.message)}
	return s.publishDecision(ctx, d)
}

// publishDecision publishes d under its ID and records it as the pool's
// last decision. The caller holds s.mu.
func (s *scaler) publishDecision(ctx context.Context, d contracts.ScaleDecision) error {
	// The decision's span, a child of what prompted it (a demand or an
	// alert); its publish is the span's child.
	ctx, span := s.bus.Tracer().Start(ctx, "scale "+string(d.Direction)+" "+d.Pool, trace.WithAttributes(
		attribute.String(telemetry.AttrPool, d.Pool), attribute.String("gpuplane.decision_id", d.ID),
		attribute.String("gpuplane.direction", string(d.Direction)), attribute.Int("gpuplane.current_nodes", d.CurrentNodes),
		attribute.Int("gpuplane.desired_nodes", d.DesiredNodes), attribute.String("gpuplane.why", d.Reason)))
	defer span.End()
	if _, err := s.bus.Publish(ctx, contracts.SubjectScale(d.Pool), d.ID, d, bus.CESubject(d.Pool)); err != nil {
		span.SetStatus(codes.Error, err.Error())
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("%s: publish decision %s: %w", Name, d.ID, err)
	}
	s.last[d.Pool] = decideAt(d)
	s.noteDecided(d.Pool, d.ID)
	// The actuator takes the decision now, not when it comes back from
	// the bus: until then its machines would not count as booting, and a
	// demand evaluated meanwhile would ask for them again. Apply is
	// idempotent on the ID, so the copy from the bus is a no-op.
	if _, managed := s.cfg.Pools[d.Pool]; managed && s.act.Load() != nil {
		act := s.act.Load()
		if err := act.Apply(d); err != nil {
			s.log.Warn("decision not acted on", "pool", d.Pool, "id", d.ID, "err", err)
		}
	}
	delete(s.why, d.Pool)
	s.log.Info("scale decision", "pool", d.Pool, "id", d.ID, "current", d.CurrentNodes, "desired", d.DesiredNodes, "reason", d.Reason)
	return nil
}
