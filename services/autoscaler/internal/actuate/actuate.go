// Package actuate turns scale decisions into provider calls and scales idle
// pools down. It is level-triggered: Apply records a pool's target, and
// each Step compares every pool with the provider's list and makes at most
// the calls that close the gap.
//
// Two guards keep a failing provider harmless:
//   - idempotency: the k-th machine a decision asks for is created with the
//     token "<decision ID>#k", so a retried create after a lost reply, a
//     restart or a replayed decision yields the same machine, never a
//     second one;
//   - no retry storm: every call goes through one circuit breaker
//     (sony/gobreaker), and a pool whose call failed is not tried again
//     before an exponential backoff on the injected clock has passed.
//
// Scale down picks only machines idle (no live allocation in the ledger)
// for IdleFor, writes a drain hold for them, waits until the ledger shows no
// live allocation, then deletes them. A pool never goes below Min, and a
// machine that gains work above best effort while draining is given back
// (hold lifted) instead of deleted.
package actuate

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/autoscaler/internal/cloud"
)

// Provider creates and deletes machines. Create must be idempotent on
// req.Token. List returns the pool's machines not deleted.
type Provider interface {
	Create(ctx context.Context, req cloud.CreateRequest) (cloud.Machine, error)
	Delete(ctx context.Context, machineID string) error
	List(ctx context.Context, pool string) ([]cloud.Machine, error)
}

// Ledger says what runs on a node: the priorities of its live allocations
// (nil when idle). It is the allocation ledger's view, not the agent's.
type Ledger interface {
	Live(nodeID string) []contracts.Priority
}

// Holds places and lifts the drain hold of a node (a NodeAdmin in
// contracts.BucketNodeAdmin). Both must be idempotent.
type Holds interface {
	Drain(ctx context.Context, nodeID, reason string) error
	Lift(ctx context.Context, nodeID string) error
}

// Pool is the scaling policy of one pool.
type Pool struct {
	Min, Max    int
	MachineType string
	// PriceClass is cloud.OnDemand or cloud.Spot.
	PriceClass string
	// DownCooldown is the least time between two scale-downs, and between
	// a scale-up and the next scale-down.
	DownCooldown time.Duration
	// IdleFor is how long a machine must be idle before it is drained.
	IdleFor time.Duration
}

// Validate reports every problem of p at once.
func (p Pool) Validate(name string) error {
	var errs []error
	if err := contracts.ValidatePool(name); err != nil {
		errs = append(errs, err)
	}
	if p.Min < 0 || p.Max < p.Min {
		errs = append(errs, fmt.Errorf("pool %s: min %d, max %d; want 0 <= min <= max", name, p.Min, p.Max))
	}
	if p.MachineType == "" {
		errs = append(errs, fmt.Errorf("pool %s: machine type is required", name))
	}
	if p.PriceClass != cloud.OnDemand && p.PriceClass != cloud.Spot {
		errs = append(errs, fmt.Errorf("pool %s: price class %q; want %s or %s", name, p.PriceClass, cloud.OnDemand, cloud.Spot))
	}
	if p.DownCooldown < 0 || p.IdleFor < 0 {
		errs = append(errs, fmt.Errorf("pool %s: negative down cooldown or idle time", name))
	}
	return errors.Join(errs...)
}

// Config configures an Actuator.
type Config struct {
	Pools    map[string]Pool
	Provider Provider
	Ledger   Ledger
	Holds    Holds
	Now      func() time.Time
	Log      *slog.Logger
	// BackoffBase and BackoffMax bound the wait after a failed call on a
	// pool: base, 2×base, ... up to max (defaults 1s and 2m).
	BackoffBase, BackoffMax time.Duration
	// Breaker is the circuit breaker's settings; Name, ReadyToTrip and
	// IsSuccessful are set here when empty (trip after 5 consecutive
	// failures; refusals such as quota are successes).
	Breaker gobreaker.Settings
}

// Actuator acts on decisions. Its methods are safe for concurrent use;
// Step calls are serialized.
type Actuator struct {
	cfg     Config
	breaker *gobreaker.CircuitBreaker[any]

	mu    sync.Mutex
	pools map[string]*poolState
}

type poolState struct {
	// up is the scale-up in progress: its tokens and which are done.
	up *scaleUp
	// failures counts consecutive failed calls; retryAt is when the pool
	// may be tried again.
	failures  int
	retryAt   time.Time
	idleSince map[string]time.Time // machine ID → first seen idle
	draining  map[string]string    // machine ID → node ID, drain hold written
	lastScale time.Time
}

type scaleUp struct {
	decision string
	tokens   []string
	done     map[string]bool
}

// New validates cfg and returns an Actuator.
func New(cfg Config) (*Actuator, error) {
	var errs []error
	if cfg.Provider == nil || cfg.Ledger == nil || cfg.Holds == nil {
		errs = append(errs, errors.New("actuate: provider, ledger and holds are required"))
	}
	for _, name := range slices.Sorted(maps.Keys(cfg.Pools)) {
		errs = append(errs, cfg.Pools[name].Validate(name))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.BackoffBase <= 0 {
		cfg.BackoffBase = time.Second
	}
	if cfg.BackoffMax < cfg.BackoffBase {
		cfg.BackoffMax = max(2*time.Minute, cfg.BackoffBase)
	}
	st := cfg.Breaker
	if st.Name == "" {
		st.Name = "cloud-provider"
	}
	if st.IsSuccessful == nil {
		// A refusal is a healthy provider's answer; only failures trip.
		st.IsSuccessful = func(err error) bool { return err == nil || cloud.IsRefusal(err) }
	}
	if st.IsExcluded == nil {
		st.IsExcluded = func(err error) bool {
			return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
		}
	}
	a := &Actuator{cfg: cfg, breaker: gobreaker.NewCircuitBreaker[any](st), pools: map[string]*poolState{}}
	for name := range cfg.Pools {
		a.pools[name] = &poolState{idleSince: map[string]time.Time{}, draining: map[string]string{}}
	}
	return a, nil
}

// Token is the idempotency token of the k-th machine (from 0) a decision
// asks for.
func Token(decisionID string, k int) string { return decisionID + "#" + strconv.Itoa(k) }

// Apply records a scale-up decision. A decision for a pool not configured
// is ignored with an error; a decision already applied is a no-op; a newer
// one replaces the scale-up in progress (machines it already created stay,
// and count against the new target through the provider's list).
func (a *Actuator) Apply(d contracts.ScaleDecision) error {
	if d.Direction != contracts.ScaleUp {
		return fmt.Errorf("actuate: decision %s: direction %q not acted on (scale-down is the actuator's own)", d.ID, d.Direction)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	ps, ok := a.pools[d.Pool]
	if !ok {
		return fmt.Errorf("actuate: decision %s: pool %q has no scaling policy", d.ID, d.Pool)
	}
	if ps.up != nil && ps.up.decision == d.ID {
		return nil
	}
	n := d.DesiredNodes - d.CurrentNodes
	if n <= 0 {
		return nil
	}
	up := &scaleUp{decision: d.ID, done: map[string]bool{}}
	for k := range n {
		up.tokens = append(up.tokens, Token(d.ID, k))
	}
	ps.up = up
	return nil
}

// call runs one provider call through the breaker.
func (a *Actuator) call(fn func() (any, error)) (any, error) {
	return a.breaker.Execute(fn)
}

// Step reconciles every pool once. Provider failures are not returned:
// they back the pool off and are logged. It returns ctx's error when ctx
// ends.
func (a *Actuator) Step(ctx context.Context) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, name := range slices.Sorted(maps.Keys(a.pools)) {
		if err := ctx.Err(); err != nil {
			return err
		}
		a.stepPool(ctx, name, a.pools[name])
	}
	return nil
}

func (a *Actuator) stepPool(ctx context.Context, name string, ps *poolState) {
	now := a.cfg.Now()
	if now.Before(ps.retryAt) {
		return
	}
	pol := a.cfg.Pools[name]
	v, err := a.call(func() (any, error) { return a.cfg.Provider.List(ctx, name) })
	if err != nil {
		a.failed(name, ps, "list", err)
		return
	}
	machines, _ := v.([]cloud.Machine)
	if a.scaleUp(ctx, name, ps, pol, machines) {
		return
	}
	a.scaleDown(ctx, name, ps, pol, machines, now)
}

// failed backs a pool off after a failed call: BackoffBase doubled per
// consecutive failure, capped at BackoffMax.
func (a *Actuator) failed(pool string, ps *poolState, op string, err error) {
	ps.failures++
	wait := a.cfg.BackoffMax
	if ps.failures <= 30 {
		wait = min(a.cfg.BackoffBase<<(ps.failures-1), a.cfg.BackoffMax)
	}
	ps.retryAt = a.cfg.Now().Add(wait)
	a.cfg.Log.Warn("provider call failed; backing off", "pool", pool, "op", op, "failures", ps.failures, "retry_in", wait, "err", err)
}

func (a *Actuator) succeeded(ps *poolState) { ps.failures, ps.retryAt = 0, time.Time{} }

// scaleUp creates the machines of the scale-up in progress that the
// provider does not list yet. It reports whether a scale-up is still in
// progress (scale-down waits for it).
func (a *Actuator) scaleUp(ctx context.Context, name string, ps *poolState, pol Pool, machines []cloud.Machine) bool {
	up := ps.up
	if up == nil {
		a.succeeded(ps)
		return false
	}
	byToken := map[string]bool{}
	for _, m := range machines {
		byToken[m.Token] = true
	}
	live := len(machines)
	for _, tok := range up.tokens {
		if up.done[tok] {
			continue
		}
		if byToken[tok] {
			up.done[tok] = true
			continue
		}
		if live >= pol.Max {
			a.cfg.Log.Info("scale-up capped at the pool maximum", "pool", name, "decision", up.decision, "max", pol.Max)
			break
		}
		req := cloud.CreateRequest{Token: tok, Pool: name, MachineType: pol.MachineType, PriceClass: pol.PriceClass}
		v, err := a.call(func() (any, error) { return a.cfg.Provider.Create(ctx, req) })
		if err != nil {
			a.failed(name, ps, "create", err)
			return true
		}
		m, _ := v.(cloud.Machine)
		up.done[tok] = true
		live++
		a.cfg.Log.Info("machine created", "pool", name, "decision", up.decision, "machine", m.ID, "node_id", m.NodeID)
	}
	a.succeeded(ps)
	ps.up = nil
	ps.lastScale = a.cfg.Now()
	return false
}

// scaleDown deletes drained idle machines and drains at most one more.
func (a *Actuator) scaleDown(ctx context.Context, name string, ps *poolState, pol Pool, machines []cloud.Machine, now time.Time) {
	listed := map[string]cloud.Machine{}
	for _, m := range machines {
		listed[m.ID] = m
	}
	// Forget what the provider no longer lists (deleted, reclaimed).
	for id := range ps.draining {
		if _, ok := listed[id]; !ok {
			delete(ps.draining, id)
		}
	}
	for id := range ps.idleSince {
		if _, ok := listed[id]; !ok {
			delete(ps.idleSince, id)
		}
	}

	deleted := map[string]bool{} // this step; machines still lists them
	for _, id := range slices.Sorted(maps.Keys(ps.draining)) {
		node := ps.draining[id]
		live := a.cfg.Ledger.Live(node)
		switch {
		case slices.ContainsFunc(live, func(p contracts.Priority) bool { return p.Rank() > contracts.PriorityBestEffort.Rank() }):
			// Work above best effort landed before the hold was seen:
			// the machine is no longer a candidate.
			if err := a.cfg.Holds.Lift(ctx, node); err != nil {
				a.cfg.Log.Warn("lift drain hold", "pool", name, "node_id", node, "err", err)
				continue
			}
			delete(ps.draining, id)
			delete(ps.idleSince, id)
			a.cfg.Log.Info("scale-down abandoned: non-preemptible work landed", "pool", name, "node_id", node)
		case len(live) > 0:
			// Best-effort work is being moved off by the drain.
		default:
			_, err := a.call(func() (any, error) { return nil, a.cfg.Provider.Delete(ctx, id) })
			if err != nil && !errors.Is(err, cloud.ErrNotFound) {
				a.failed(name, ps, "delete", err)
				return
			}
			delete(ps.draining, id)
			delete(ps.idleSince, id)
			deleted[id] = true
			ps.lastScale = now
			if err := a.cfg.Holds.Lift(ctx, node); err != nil {
				// The node is gone; a stale hold only keeps it cordoned
				// should the same ID come back.
				a.cfg.Log.Warn("lift drain hold of deleted machine", "pool", name, "node_id", node, "err", err)
			}
			a.cfg.Log.Info("machine deleted", "pool", name, "machine", id, "node_id", node)
		}
	}

	var candidates []cloud.Machine
	for _, m := range machines {
		if _, ok := ps.draining[m.ID]; ok || deleted[m.ID] {
			continue
		}
		if m.State != cloud.Running || len(a.cfg.Ledger.Live(m.NodeID)) > 0 {
			delete(ps.idleSince, m.ID)
			continue
		}
		since, ok := ps.idleSince[m.ID]
		if !ok {
			ps.idleSince[m.ID] = now
			since = now
		}
		if now.Sub(since) >= pol.IdleFor {
			candidates = append(candidates, m)
		}
	}
	if len(ps.draining) > 0 || len(candidates) == 0 || len(machines)-len(deleted) <= pol.Min {
		return
	}
	if !ps.lastScale.IsZero() && now.Before(ps.lastScale.Add(pol.DownCooldown)) {
		return
	}
	// The longest idle first; ties by ID, so the choice is deterministic.
	slices.SortFunc(candidates, func(x, y cloud.Machine) int {
		if c := ps.idleSince[x.ID].Compare(ps.idleSince[y.ID]); c != 0 {
			return c
		}
		return strings.Compare(x.ID, y.ID)
	})
	m := candidates[0]
	reason := fmt.Sprintf("autoscaler: idle since %s; scaling pool %s down", ps.idleSince[m.ID].UTC().Format(time.RFC3339), name)
	if err := a.cfg.Holds.Drain(ctx, m.NodeID, reason); err != nil {
		a.cfg.Log.Warn("write drain hold", "pool", name, "node_id", m.NodeID, "err", err)
		return
	}
	ps.draining[m.ID] = m.NodeID
	ps.lastScale = now
	a.cfg.Log.Info("draining idle machine", "pool", name, "machine", m.ID, "node_id", m.NodeID)
}

// Run steps every interval until ctx ends.
func (a *Actuator) Run(ctx context.Context, every time.Duration) error {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		if err := a.Step(ctx); err != nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
