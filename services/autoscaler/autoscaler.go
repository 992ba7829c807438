// Package autoscaler decides how big each node pool should be. It follows
// the NODES stream (machine type and live nodes per pool) and the pending
// demand the scheduler publishes per pool, and publishes a ScaleDecision
// when waiting jobs would fit on more machines of the pool's type. With a
// Provider configured it also acts: package actuate creates the decided
// machines and drains, then deletes, idle ones.
//
//	NODES inventory+lifecycle ──> fleet ─┐
//	OPS gp.sched.demand.* (last per pool, then new) ──> decide.Decide ──> gp.autoscale.decisions.<pool>
//	OPS gp.autoscale.decisions.* (replayed at start) ──> last decision per pool (cooldown, no repeats)
//	OPS gp.autoscale.decisions.* (last per pool) ─┐
//	ALLOCATIONS gp.alloc.ledger.* ──> live allocations per node ─┴─> actuate ──> Provider; KV gp-node-admin drain holds
//	OPS gp.alerts.* (action=scale_up, pool managed) ──> one more machine per alert episode ──> gp.autoscale.decisions.<pool>
//	Provider.List (every second, at once on Watch) ──> notices: drain hold (cause spot_interruption),
//	        gp.alerts.spot_interruption firing; gone: alert resolved, hold lifted; below min: refill
//	NODES lifecycle lost (no returned/registered since) > NodeLostGrace, machine still running ──> Provider.Delete, refill
//	every step that listed all pools: holds in gp-node-admin (autoscaler's or spot cause) of managed pools' nodes no
//	        longer listed ──> released, alert resolved, reclaimed (same IDs as the live path: gone while down)
//	actuate ──> gp.autoscale.machines.<pool> (requested, ready, draining, deleted, failed, interrupted, reclaimed)
//
// It is level-triggered: every demand message and a once-a-second tick
// re-evaluate the latest demand of each pool, so a demand held back by the
// cooldown is decided when the cooldown ends even if nothing new arrives.
package autoscaler

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/telemetry"
	"github.com/gpuplane/gpuplane/services/autoscaler/internal/actuate"
	"github.com/gpuplane/gpuplane/services/autoscaler/internal/decide"
	"github.com/gpuplane/gpuplane/services/autoscaler/internal/fleet"
)

// Name is the service name.
const Name = "autoscaler"

// reevaluateEvery is how often every pool's latest demand is decided again.
const reevaluateEvery = time.Second

// serve runs one autoscaler (the leader's, with a lease: see lease.go)
// on b until ctx ends.
func serve(ctx context.Context, cfg Config, b *bus.Bus, log *slog.Logger) error {
	s := newScaler(cfg, b, log)
	if err := s.restoreDecisions(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("%s: %w", Name, err)
	}

	g, gctx := errgroup.WithContext(ctx)
	nodesReady := make(chan struct{})
	g.Go(func() error {
		err := s.bus.Follow(gctx, bus.FollowSpec{Stream: contracts.StreamNodes,
			FilterSubjects: []string{contracts.SubjectInventoryAll, contracts.SubjectNodeLifecycleAll}},
			func(_ context.Context, m *bus.Msg) error {
				s.onNode(m)
				return nil
			}, func() { close(nodesReady) })
		if err != nil {
			return fmt.Errorf("%s: follow nodes: %w", Name, err)
		}
		return nil
	})
	// Demand is sized against machine types, so it waits for the fleet.
	g.Go(func() error {
		select {
		case <-gctx.Done():
			return nil
		case <-nodesReady:
		}
		err := s.bus.Follow(gctx, bus.FollowSpec{Stream: contracts.StreamOps,
			FilterSubjects: []string{contracts.SubjectDemandAll}, LastPerSubject: true}, s.onDemand, nil)
		if err != nil {
			return fmt.Errorf("%s: follow demand: %w", Name, err)
		}
		return nil
	})
	if len(cfg.Pools) > 0 {
		// scale_up alerts of the pools the autoscaler manages; the whole
		// history, so that an alert still firing after a restart counts.
		g.Go(func() error {
			select {
			case <-gctx.Done():
				return nil
			case <-nodesReady:
			}
			err := s.bus.Follow(gctx, bus.FollowSpec{Stream: contracts.StreamOps,
				FilterSubjects: []string{contracts.SubjectAlertsAll}}, s.onAlert, nil)
			if err != nil {
				return fmt.Errorf("%s: follow alerts: %w", Name, err)
			}
			return nil
		})
	}
	if cfg.Provider != nil {
		g.Go(func() error {
			if err := s.runActuation(gctx); err != nil && gctx.Err() == nil {
				return fmt.Errorf("%s: actuation: %w", Name, err)
			}
			return nil
		})
	}
	g.Go(func() error {
		select {
		case <-gctx.Done():
			return nil
		case <-nodesReady:
		}
		t := time.NewTicker(reevaluateEvery)
		defer t.Stop()
		for {
			select {
			case <-gctx.Done():
				return nil
			case <-t.C:
				if err := s.evaluateAll(gctx); err != nil {
					return err
				}
			}
		}
	})
	return g.Wait()
}

type scaler struct {
	cfg   Config
	bus   *bus.Bus
	log   *slog.Logger
	fleet *fleet.Fleet

	// mu serializes decisions: evaluation and publish happen under it, so
	// the demand follower and the tick never decide for a pool at once.
	mu     sync.Mutex
	demand map[string]demandAt        // pool → latest demand
	last   map[string]decide.Previous // pool → last decision published
	why    map[string]string          // pool → last reason for no decision, logged once
	// scaleUpAlerts is the firing scale_up alert of each managed pool;
	// decided the IDs of the alert decisions published (or replayed at
	// start) whose episode has not resolved yet. An alert decision is keyed
	// by episode, so an episode seen again (redelivered, republished,
	// replayed after a restart) is acted on once. Demand decisions are not
	// kept: decide.Decide's Last already refuses to repeat them. See
	// forgetDecided for why an entry may go when its episode resolves.
	scaleUpAlerts map[string]scaleUpAlert
	decided       map[string]bool

	act atomic.Pointer[actuate.Actuator] // set once actuation runs
}

// newScaler returns a scaler with no state yet; cfg is validated, with Now set.
func newScaler(cfg Config, b *bus.Bus, log *slog.Logger) *scaler {
	return &scaler{cfg: cfg, bus: b, log: log, fleet: fleet.New(),
		demand: map[string]demandAt{}, last: map[string]decide.Previous{}, why: map[string]string{},
		scaleUpAlerts: map[string]scaleUpAlert{}, decided: map[string]bool{}}
}

type demandAt struct {
	d   contracts.PoolDemand
	seq uint64
	// tp is the demand's trace: a decision taken on it, at once or on a
	// later tick, is a span in that trace.
	tp string
}

func (s *scaler) onNode(m *bus.Msg) {
	nodeID := contracts.Token(m.Subject, 3)
	var err error
	switch contracts.Token(m.Subject, 2) {
	case "inventory":
		var inv contracts.NodeInventory
		if err = m.Decode(&inv); err == nil {
			s.fleet.ApplyInventory(nodeID, inv)
			if a := s.act.Load(); a != nil {
				a.Kick() // a machine's agent may have registered: ready
			}
		}
	case "lifecycle":
		var ev contracts.NodeEvent
		if err = m.Decode(&ev); err == nil {
			s.fleet.ApplyNodeEvent(nodeID, ev)
		}
	}
	if err != nil {
		s.log.Warn("skipping node message", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
	}
}

// onDemand keeps the latest demand of a pool and decides at once. The pool
// is taken from the subject, never from the body.
func (s *scaler) onDemand(ctx context.Context, m *bus.Msg) error {
	var d contracts.PoolDemand
	if err := m.Decode(&d); err != nil {
		s.log.Warn("skipping demand", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
		return nil
	}
	pool := contracts.Token(m.Subject, 3)
	if err := contracts.ValidatePool(pool); err != nil {
		s.log.Warn("skipping demand", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
		return nil
	}
	d.Pool = pool
	s.mu.Lock()
	defer s.mu.Unlock()
	s.demand[pool] = demandAt{d: d, seq: m.StreamSeq, tp: telemetry.TraceParent(ctx)}
	return s.evaluate(ctx, pool)
}

func (s *scaler) evaluateAll(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	pools := maps.Clone(s.demand)
	for pool := range s.scaleUpAlerts {
		pools[pool] = demandAt{}
	}
	for _, pool := range slices.Sorted(maps.Keys(pools)) {
		if err := s.evaluate(ctx, pool); err != nil {
			return err
		}
	}
	return nil
}

// evaluate decides for one pool and publishes the decision, if any. The
// caller holds s.mu.
func (s *scaler) evaluate(ctx context.Context, pool string) error {
	if err := s.evaluateAlert(ctx, pool); err != nil {
		return err
	}
	da, ok := s.demand[pool]
	if !ok {
		return nil
	}
	if !s.cfg.decides(pool) {
		// A pool without a scaling policy is a fleet as configured, not
		// a fault: said once, and again only after the pool's reason
		// changed, like any other "no".
		why := fmt.Sprintf("pool %s has no scaling policy: its demand is left to the machines it has", pool)
		if s.why[pool] != why {
			s.why[pool] = why
			s.log.Info("no scale decision", "pool", pool, "why", why)
		}
		return nil
	}
	ctx = telemetry.WithTraceParent(ctx, da.tp)
	in := decide.Input{Demand: da.d, DemandSeq: da.seq, Max: s.cfg.maxNodes(pool), Cooldown: s.cfg.cooldown(pool), Now: s.cfg.Now()}
	if p, ok := s.fleet.Pool(pool); ok {
		in.Machine = decide.Machine{Type: p.MachineType, GPUs: p.GPUs, Model: p.Model,
			MemoryMiB: p.MemoryMiB, MIGGPUs: p.MIGGPUs, MIG: p.MIG}
		in.LiveNodes = p.LiveNodes
	}
	if l, ok := s.last[pool]; ok {
		in.Last = &l
	}
	if booting, ok := s.booting(pool, da.d); ok {
		in.Booting = booting
	} else {
		why := fmt.Sprintf("pool %s: waiting for the provider's list to know which machines are booting", pool)
		if s.why[pool] != why {
			s.why[pool] = why
			s.log.Info("no scale decision", "pool", pool, "why", why)
		}
		return nil
	}
	out := decide.Decide(in)
	if out.Decision == nil {
		if s.why[pool] != out.Why {
			s.why[pool] = out.Why
			s.log.Info("no scale decision", "pool", pool, "why", out.Why)
			// A change of mind is worth a span; the same "no" every tick is not.
			_, span := s.bus.Tracer().Start(ctx, "no scale decision "+pool, trace.WithAttributes(
				attribute.String(telemetry.AttrPool, pool), attribute.String("gpuplane.why", out.Why),
				attribute.Int64("gpuplane.demand_seq", int64(da.seq))))
			span.End()
		}
		return nil
	}
	return s.publishDecision(ctx, *out.Decision)
}

// booting is how many machines the actuator asked for in pool that demand
// does not count; false while the actuator has not listed the pool yet
// (so a restart does not ask again for machines booting before it). A
// machine whose node registered after demand was computed counts as
// booting: the demand's waiting shapes were sized without it. Without a
// demand time (or node count), the fleet's registration is taken as is.
func (s *scaler) booting(pool string, demand contracts.PoolDemand) (int, bool) {
	act := s.act.Load()
	if act == nil {
		if s.cfg.Provider != nil {
			if _, managed := s.cfg.Pools[pool]; managed {
				return 0, false
			}
		}
		return 0, true
	}
	return act.Booting(pool, func(nodeID string) bool {
		at, ok := s.fleet.RegisteredAt(nodeID)
		if !ok {
			return false
		}
		if demand.Nodes <= 0 || demand.Time.IsZero() || at.IsZero() {
			return true
		}
		return at.Before(demand.Time)
	})
}

func decideAt(d contracts.ScaleDecision) decide.Previous {
	return decide.Previous{ID: d.ID, Current: d.CurrentNodes, Desired: d.DesiredNodes, Time: d.Time}
}

// restoreDecisions replays the decisions already published: the last one of
// each pool starts its cooldown and is not repeated.
func (s *scaler) restoreDecisions(ctx context.Context) error {
	_, err := s.bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamOps,
		FilterSubjects: []string{contracts.SubjectScaleAll}}, func(_ context.Context, m *bus.Msg) error {
		var d contracts.ScaleDecision
		if err := m.Decode(&d); err != nil {
			s.log.Warn("skipping decision", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
			return nil
		}
		pool := contracts.Token(m.Subject, 3)
		s.last[pool] = decideAt(d)
		s.noteDecided(pool, d.ID)
		return nil
	})
	if err != nil {
		return fmt.Errorf("replay decisions: %w", err)
	}
	return nil
}
