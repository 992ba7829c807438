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
//
// Every Step also reads what the provider says of each machine, so the
// reaction works the same for a real provider as for the simulated one:
// a machine listed with an Interruption time is handed to Interruptions
// once (drain hold, alert), a machine that leaves the list without the
// actuator deleting it was reclaimed (Interruptions.Gone lifts the hold),
// and a pool with fewer machines not under notice than Min is refilled,
// before the reclaim when Max leaves room. A running machine whose node
// agent the resource manager declared lost more than LostGrace ago is dead:
// it is deleted (and so replaced). After a Step that listed every pool, the
// Sweeper lifts what machines gone unwatched (during a restart) left
// behind. Kick makes the next Step run at once, for a provider that pushes
// changes.
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
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
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
	// Drain marks the hold as the autoscaler's (so Lift finds it);
	// reason says why for people.
	Drain(ctx context.Context, nodeID, reason string) error
	Lift(ctx context.Context, nodeID string) error
}

// Interruptions reacts to a provider taking machines back. Both calls
// must be idempotent; an error makes the next Step call again.
type Interruptions interface {
	// Noticed: m is listed with an interruption notice (m.Interruption).
	Noticed(ctx context.Context, m cloud.Machine) error
	// Gone: m, last listed as given, left the provider's list without the
	// actuator deleting it (reclaimed).
	Gone(ctx context.Context, m cloud.Machine) error
}

// Events receives the machine events of the actuator (requested, ready,
// draining, deleted, failed, interrupted, reclaimed). Publishing is the
// sink's business: a lost event must not stop actuation.
type Events interface {
	MachineEvent(ctx context.Context, e contracts.MachineEvent)
}

// Nodes says what the resource manager says of a machine's node agent.
type Nodes interface {
	// Registered: an agent registered under nodeID and is live.
	Registered(nodeID string) bool
	// LostSince: the node's agent was declared lost at the time returned
	// and has not come back (returned, registered) since.
	LostSince(nodeID string) (time.Time, bool)
}

// Sweeper cleans up after machines that left the provider while no actuator
// was watching (a reclaim or a deletion during a restart): the live path,
// Interruptions.Gone, only sees machines it listed before. Sweep gets, for
// every pool, the node IDs the provider lists now; it is called only after
// a Step listed every pool, so a node missing from live[pool] is gone. It
// must be idempotent: it runs on every such Step.
type Sweeper interface {
	Sweep(ctx context.Context, live map[string][]string) error
}

// Pool is the scaling policy of one pool.
type Pool struct {
	Min, Max    int
	MachineType string
	// PriceClass is cloud.OnDemand or cloud.Spot.
	PriceClass string
	// UpCooldown is the least time between two scale-up decisions for
	// the pool; 0 takes the autoscaler's Cooldown.
	UpCooldown time.Duration
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
	if p.DownCooldown < 0 || p.IdleFor < 0 || p.UpCooldown < 0 {
		errs = append(errs, fmt.Errorf("pool %s: negative cooldown or idle time", name))
	}
	return errors.Join(errs...)
}

// Config configures an Actuator.
type Config struct {
	Pools    map[string]Pool
	Provider Provider
	Ledger   Ledger
	Holds    Holds
	// Interruptions, Events and Nodes are optional: nil skips the
	// reaction to notices, the machine events and the ready events.
	Interruptions Interruptions
	Events        Events
	Nodes         Nodes
	// Sweeper is optional: nil leaves holds of machines gone before the
	// first Step in place.
	Sweeper Sweeper
	// LostGrace is how long a running machine's node agent may stay lost
	// before the machine is declared dead, deleted and replaced (default
	// DefaultLostGrace). It needs Nodes.
	LostGrace time.Duration
	Now       func() time.Time
	Log       *slog.Logger
	// BackoffBase and BackoffMax bound the wait after a failed call on a
	// pool: base, 2×base, ... up to max (defaults 1s and 2m).
	BackoffBase, BackoffMax time.Duration
	// Breaker is the circuit breaker's settings; Name, ReadyToTrip and
	// IsSuccessful are set here when empty (trip after 5 consecutive
	// failures; refusals such as quota are successes).
	Breaker gobreaker.Settings
}

// DefaultLostGrace is Config.LostGrace's default: long enough for an agent
// restart or a short network partition, short against a job's wait.
const DefaultLostGrace = 2 * time.Minute

// Actuator acts on decisions. Its methods are safe for concurrent use;
// Step calls are serialized.
type Actuator struct {
	cfg     Config
	breaker *gobreaker.CircuitBreaker[any]

	mu    sync.Mutex
	pools map[string]*poolState
	kick  chan struct{}

	// viewMu guards views, the booting machines of each pool as of the
	// last change, so that Booting never waits for a Step's provider
	// calls.
	viewMu sync.Mutex
	views  map[string]bootView
}

// bootView is what a pool has asked for that may not have registered yet.
type bootView struct {
	listed bool
	// inflight counts the tokens of scale-ups not yet created (or whose
	// create failed and is not seen in the list yet).
	inflight int
	// machines are the listed or just created machines, provisioning or
	// running, not under notice and not deleted by the actuator.
	machines []bootMachine
}

type bootMachine struct {
	nodeID  string
	running bool
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
	// known is the pool's machines as last listed; noticed and ready
	// those whose notice was handled and whose ready event went out;
	// deleted those the actuator deleted (so their leaving the list is
	// no reclaim).
	known   map[string]cloud.Machine
	noticed map[string]bool
	ready   map[string]bool
	deleted map[string]bool
	refills int
	// created is what this Step's creates returned, until the next list
	// (which began after them) says what the provider has: a machine is
	// booting from its create on, not from its first listing.
	created map[string]cloud.Machine
	listed  bool
	// applied is the IDs of the last decisions applied, so that one
	// applied twice (handed over directly, then read back from the bus)
	// asks for its machines once.
	applied []string
}

// appliedKept is how many decision IDs a pool remembers: a decision comes
// back at most once, soon after it was applied.
const appliedKept = 32

// scaleUp is the machines still to create, with the decision that asked
// for each. Tokens of an earlier decision stay when a newer one comes: the
// newer one counted them as booting, so it asks only for more.
type scaleUp struct {
	decision string
	reason   string
	tokens   []string
	origin   map[string]origin // token → decision that asked for it
	done     map[string]bool
	failed   map[string]bool // tokens whose create failed in this process
}

type origin struct{ decision, reason string }

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
	if cfg.LostGrace <= 0 {
		cfg.LostGrace = DefaultLostGrace
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
	a := &Actuator{cfg: cfg, breaker: gobreaker.NewCircuitBreaker[any](st), pools: map[string]*poolState{},
		kick: make(chan struct{}, 1), views: map[string]bootView{}}
	for name := range cfg.Pools {
		a.pools[name] = &poolState{idleSince: map[string]time.Time{}, draining: map[string]string{},
			known: map[string]cloud.Machine{}, noticed: map[string]bool{}, ready: map[string]bool{}, deleted: map[string]bool{},
			created: map[string]cloud.Machine{}}
	}
	return a, nil
}

// Token is the idempotency token of the k-th machine (from 0) a decision
// asks for.
func Token(decisionID string, k int) string { return decisionID + "#" + strconv.Itoa(k) }

// Apply records a scale-up decision. A decision for a pool not configured
// is ignored with an error; a decision already applied is a no-op; a newer
// one adds its machines to the scale-up in progress: a decision counts the
// machines already asked for (Booting) in its current size, so the tokens
// still to create stay and the new ones come on top.
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
	if slices.Contains(ps.applied, d.ID) {
		return nil
	}
	ps.applied = append(ps.applied, d.ID)
	if len(ps.applied) > appliedKept {
		ps.applied = slices.Delete(ps.applied, 0, len(ps.applied)-appliedKept)
	}
	n := d.DesiredNodes - d.CurrentNodes
	if n <= 0 {
		return nil
	}
	up := newScaleUp(d.ID, d.Reason, n)
	if old := ps.up; old != nil {
		up = old.then(up)
	}
	ps.up = up
	a.publishView(d.Pool, ps)
	return nil
}

func newScaleUp(decision, reason string, n int) *scaleUp {
	up := &scaleUp{decision: decision, reason: reason, origin: map[string]origin{}, done: map[string]bool{}, failed: map[string]bool{}}
	for k := range n {
		tok := Token(decision, k)
		up.tokens = append(up.tokens, tok)
		up.origin[tok] = origin{decision, reason}
	}
	return up
}

// then returns next with the tokens of up still to create in front.
func (up *scaleUp) then(next *scaleUp) *scaleUp {
	var toks []string
	for _, tok := range up.tokens {
		if !up.done[tok] {
			toks = append(toks, tok)
			next.origin[tok] = up.origin[tok]
			next.failed[tok] = up.failed[tok]
		}
	}
	next.tokens = append(toks, next.tokens...)
	return next
}

// pending counts the tokens not created yet.
func (up *scaleUp) pending() int {
	if up == nil {
		return 0
	}
	n := 0
	for _, tok := range up.tokens {
		if !up.done[tok] {
			n++
		}
	}
	return n
}

// Booting returns how many machines of pool the actuator asked for that
// counted does not report: creates not done yet, machines provisioning,
// and running machines whose node counted says false (the caller's notion
// of "already in the demand": registered before it was computed). false
// until the pool was listed once (after a restart, the machines booting
// are not known before).  A pool without a policy has none.
func (a *Actuator) Booting(pool string, counted func(nodeID string) bool) (int, bool) {
	if _, ok := a.cfg.Pools[pool]; !ok {
		return 0, true
	}
	a.viewMu.Lock()
	v := a.views[pool]
	a.viewMu.Unlock()
	if !v.listed {
		return 0, false
	}
	n := v.inflight
	for _, m := range v.machines {
		if !m.running || !counted(m.nodeID) {
			n++
		}
	}
	return n, true
}

// publishView records what pool has asked for, for Booting. The caller
// holds a.mu.
func (a *Actuator) publishView(pool string, ps *poolState) {
	v := bootView{listed: ps.listed, inflight: ps.up.pending()}
	seen := map[string]bool{}
	add := func(m cloud.Machine) {
		if seen[m.ID] || ps.deleted[m.ID] || !m.Interruption.IsZero() || m.State == cloud.Deleted {
			return
		}
		seen[m.ID] = true
		v.machines = append(v.machines, bootMachine{nodeID: m.NodeID, running: m.State == cloud.Running})
	}
	for _, id := range slices.Sorted(maps.Keys(ps.created)) {
		add(ps.created[id])
	}
	for _, id := range slices.Sorted(maps.Keys(ps.known)) {
		add(ps.known[id])
	}
	a.viewMu.Lock()
	a.views[pool] = v
	a.viewMu.Unlock()
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
	live := map[string][]string{}
	for _, name := range slices.Sorted(maps.Keys(a.pools)) {
		if err := ctx.Err(); err != nil {
			return err
		}
		if machines, ok := a.stepPool(ctx, name, a.pools[name]); ok {
			nodes := []string{}
			for _, m := range machines {
				nodes = append(nodes, m.NodeID)
			}
			live[name] = nodes
		}
	}
	// Only a complete picture may say a node is gone: a pool backed off or
	// failing to list would make all its nodes look gone.
	if a.cfg.Sweeper != nil && len(live) == len(a.pools) {
		if err := a.cfg.Sweeper.Sweep(ctx, live); err != nil && ctx.Err() == nil {
			a.cfg.Log.Warn("sweep of holds left by gone machines failed; next step tries again", "err", err)
		}
	}
	return nil
}

// stepPool reconciles one pool and returns the machines the provider
// listed; false when it was not listed (backed off, or the call failed).
func (a *Actuator) stepPool(ctx context.Context, name string, ps *poolState) ([]cloud.Machine, bool) {
	now := a.cfg.Now()
	if now.Before(ps.retryAt) {
		return nil, false
	}
	pol := a.cfg.Pools[name]
	v, err := a.call(func() (any, error) { return a.cfg.Provider.List(ctx, name) })
	if err != nil {
		a.failed(name, ps, "list", err)
		return nil, false
	}
	var machines []cloud.Machine
	for _, m := range v.([]cloud.Machine) {
		if m.State != cloud.Deleted { // a provider may list them; they are gone
			machines = append(machines, m)
		}
	}
	// The list began after every create of earlier Steps returned: it is
	// the truth about them now.
	clear(ps.created)
	ps.listed = true
	a.found(ctx, name, ps, machines)
	a.observe(ctx, name, ps, machines)
	defer a.publishView(name, ps)
	machines, ok := a.deleteDead(ctx, name, ps, machines, now)
	if !ok {
		return machines, true
	}
	if a.scaleUp(ctx, name, ps, pol, machines) {
		return machines, true
	}
	a.scaleDown(ctx, name, ps, pol, machines, now)
	return machines, true
}

// found marks done the tokens of the scale-up in progress that name a
// listed machine. A create whose reply was lost (the provider applied it,
// the call failed) is announced requested here, before its ready event,
// with the ID the reply would have given (MachineEventID of the machine),
// so both paths make one event. A machine already registered whose create
// did not fail in this process (a decision replayed after a restart) was
// announced before and is not again.
func (a *Actuator) found(ctx context.Context, name string, ps *poolState, machines []cloud.Machine) {
	up := ps.up
	if up == nil {
		return
	}
	for _, m := range machines {
		if !slices.Contains(up.tokens, m.Token) || up.done[m.Token] {
			continue
		}
		up.done[m.Token] = true
		registered := m.State == cloud.Running && a.cfg.Nodes != nil && a.cfg.Nodes.Registered(m.NodeID)
		if !up.failed[m.Token] && registered {
			continue
		}
		o := up.origin[m.Token]
		a.event(ctx, name, contracts.MachineEvent{Kind: contracts.MachineRequested, MachineID: m.ID, NodeID: m.NodeID, Token: m.Token,
			DecisionID: o.decision, Message: o.reason})
		a.cfg.Log.Info("machine found by its token: its create was applied", "pool", name, "decision", o.decision,
			"machine", m.ID, "node_id", m.NodeID)
	}
}

// deleteDead deletes the running machines whose node agent has been lost
// for longer than LostGrace: the provider still bills them, but they run
// nothing. Refill-to-min replaces them. A machine under notice is left to its reclaim
// (its alert resolves then); one whose agent came back is never touched,
// as Nodes.LostSince then says false. It returns the machines less those it
// deleted, so that this Step already refills the pool, and false when a
// delete failed (the pool is backed off).
func (a *Actuator) deleteDead(ctx context.Context, name string, ps *poolState, machines []cloud.Machine, now time.Time) ([]cloud.Machine, bool) {
	if a.cfg.Nodes == nil {
		return machines, true
	}
	kept := machines[:0:0]
	for i, m := range machines {
		if ps.deleted[m.ID] {
			continue
		}
		kept = append(kept, m)
		if m.State != cloud.Running || !m.Interruption.IsZero() {
			continue
		}
		since, lost := a.cfg.Nodes.LostSince(m.NodeID)
		if !lost || now.Sub(since) < a.cfg.LostGrace {
			continue
		}
		_, err := a.call(func() (any, error) { return nil, a.cfg.Provider.Delete(ctx, m.ID) })
		if err != nil && !errors.Is(err, cloud.ErrNotFound) {
			a.event(ctx, name, contracts.MachineEvent{Kind: contracts.MachineFailed, MachineID: m.ID, NodeID: m.NodeID,
				Message: "delete dead machine: " + err.Error()})
			a.failed(name, ps, "delete", err)
			return append(kept, machines[i+1:]...), false
		}
		kept = kept[:len(kept)-1]
		ps.deleted[m.ID] = true
		delete(ps.draining, m.ID)
		delete(ps.idleSince, m.ID)
		msg := fmt.Sprintf("dead: the provider lists it running but its node agent has been lost since %s (more than %s)",
			since.UTC().Format(time.RFC3339), a.cfg.LostGrace)
		a.event(ctx, name, contracts.MachineEvent{Kind: contracts.MachineDeleted, MachineID: m.ID, NodeID: m.NodeID, Token: m.Token, Message: msg})
		if err := a.cfg.Holds.Lift(ctx, m.NodeID); err != nil {
			a.cfg.Log.Warn("lift hold of dead machine", "pool", name, "node_id", m.NodeID, "err", err)
		}
		a.cfg.Log.Warn("dead machine deleted", "pool", name, "machine", m.ID, "node_id", m.NodeID, "lost_since", since)
	}
	return kept, true
}

// event sends a machine event of pool, if there is a sink.
func (a *Actuator) event(ctx context.Context, pool string, e contracts.MachineEvent) {
	if a.cfg.Events == nil {
		return
	}
	e.SchemaVersion, e.Pool, e.Time = contracts.SchemaVersion, pool, a.cfg.Now()
	a.cfg.Events.MachineEvent(ctx, e)
}

// observe compares the list with the previous one: notices are handed to
// Interruptions once, machines whose agent registered are announced
// ready, and machines gone without the actuator deleting them were
// reclaimed.
func (a *Actuator) observe(ctx context.Context, name string, ps *poolState, machines []cloud.Machine) {
	listed := map[string]bool{}
	for _, m := range machines {
		listed[m.ID] = true
		if !m.Interruption.IsZero() && !ps.noticed[m.ID] {
			if err := a.noticed(ctx, name, m); err != nil {
				a.cfg.Log.Warn("interruption notice not handled; next step tries again", "pool", name, "machine", m.ID, "node_id", m.NodeID, "err", err)
			} else {
				ps.noticed[m.ID] = true
			}
		}
		if !ps.ready[m.ID] && m.State == cloud.Running && a.cfg.Nodes != nil && a.cfg.Nodes.Registered(m.NodeID) {
			ps.ready[m.ID] = true
			a.event(ctx, name, contracts.MachineEvent{Kind: contracts.MachineReady, MachineID: m.ID, NodeID: m.NodeID, Token: m.Token})
		}
	}
	for _, id := range slices.Sorted(maps.Keys(ps.known)) {
		if listed[id] {
			continue
		}
		m := ps.known[id]
		if !ps.deleted[id] {
			if a.cfg.Interruptions != nil {
				if err := a.cfg.Interruptions.Gone(ctx, m); err != nil {
					a.cfg.Log.Warn("reclaimed machine not cleaned up; next step tries again", "pool", name, "machine", id, "node_id", m.NodeID, "err", err)
					continue
				}
			}
			e := contracts.MachineEvent{Kind: contracts.MachineReclaimed, MachineID: id, NodeID: m.NodeID, Token: m.Token,
				Message: "the provider took the machine back"}
			if !m.Interruption.IsZero() {
				at := m.Interruption
				e.Deadline = &at
			}
			a.event(ctx, name, e)
			a.cfg.Log.Info("machine reclaimed", "pool", name, "machine", id, "node_id", m.NodeID)
		}
		delete(ps.known, id)
		delete(ps.noticed, id)
		delete(ps.ready, id)
		delete(ps.deleted, id)
	}
	for _, m := range machines {
		ps.known[m.ID] = m
	}
}

func (a *Actuator) noticed(ctx context.Context, name string, m cloud.Machine) error {
	if a.cfg.Interruptions != nil {
		if err := a.cfg.Interruptions.Noticed(ctx, m); err != nil {
			return err
		}
	}
	at := m.Interruption
	a.event(ctx, name, contracts.MachineEvent{Kind: contracts.MachineInterrupted, MachineID: m.ID, NodeID: m.NodeID, Token: m.Token,
		Deadline: &at, Message: "spot interruption notice: reclaimed at " + at.UTC().Format(time.RFC3339)})
	a.cfg.Log.Warn("spot interruption notice", "pool", name, "machine", m.ID, "node_id", m.NodeID, "deadline", at)
	return nil
}

// alive counts the machines not under an interruption notice: those that
// will still be there.
func alive(machines []cloud.Machine) int {
	n := 0
	for _, m := range machines {
		if m.Interruption.IsZero() {
			n++
		}
	}
	return n
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
	if ps.up == nil {
		// Keep the pool at Min: a machine reclaimed, or noticed and about
		// to be, is replaced. The tokens live in ps.up until every one is
		// done, so retries after failures or lost replies reuse them; after
		// a restart the list already shows what they created.
		if n := min(pol.Min-alive(machines), pol.Max-len(machines)); n > 0 {
			ps.refills++
			up := newScaleUp(fmt.Sprintf("min/%s/%d-%d", name, a.cfg.Now().UnixMilli(), ps.refills),
				fmt.Sprintf("pool %s has %d machines not under notice; its minimum is %d", name, alive(machines), pol.Min), n)
			ps.up = up
			a.cfg.Log.Info("refilling pool to its minimum", "pool", name, "decision", up.decision, "machines", n, "reason", up.reason)
		}
	}
	up := ps.up
	if up == nil {
		a.succeeded(ps)
		return false
	}
	live := len(machines)
	for _, tok := range up.tokens {
		// found already marked done the tokens the list shows.
		if up.done[tok] {
			continue
		}
		o := up.origin[tok]
		if live >= pol.Max {
			a.cfg.Log.Info("scale-up capped at the pool maximum", "pool", name, "decision", o.decision, "max", pol.Max)
			break
		}
		req := cloud.CreateRequest{Token: tok, Pool: name, MachineType: pol.MachineType, PriceClass: pol.PriceClass}
		v, err := a.call(func() (any, error) { return a.cfg.Provider.Create(ctx, req) })
		if err != nil {
			up.failed[tok] = true
			a.event(ctx, name, contracts.MachineEvent{Kind: contracts.MachineFailed, Token: tok, DecisionID: o.decision,
				Message: "create: " + err.Error()})
			a.failed(name, ps, "create", err)
			return true
		}
		m, _ := v.(cloud.Machine)
		up.done[tok] = true
		ps.created[m.ID] = m
		a.publishView(name, ps)
		if m.State == cloud.Deleted {
			// The token already named a machine, now gone: the next step
			// sees the pool as it is and asks again with a new token.
			a.cfg.Log.Info("token names a machine already gone", "pool", name, "token", tok, "machine", m.ID)
			continue
		}
		live++
		a.event(ctx, name, contracts.MachineEvent{Kind: contracts.MachineRequested, MachineID: m.ID, NodeID: m.NodeID, Token: tok,
			DecisionID: o.decision, Message: o.reason})
		a.cfg.Log.Info("machine created", "pool", name, "decision", o.decision, "machine", m.ID, "node_id", m.NodeID)
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
				a.event(ctx, name, contracts.MachineEvent{Kind: contracts.MachineFailed, MachineID: id, NodeID: node,
					Message: "delete: " + err.Error()})
				a.failed(name, ps, "delete", err)
				return
			}
			delete(ps.draining, id)
			delete(ps.idleSince, id)
			deleted[id] = true
			ps.deleted[id] = true
			a.event(ctx, name, contracts.MachineEvent{Kind: contracts.MachineDeleted, MachineID: id, NodeID: node,
				Message: "idle, drained and deleted"})
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
		if m.State != cloud.Running || !m.Interruption.IsZero() || len(a.cfg.Ledger.Live(m.NodeID)) > 0 {
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
	// Machines under notice do not count: they are going anyway.
	if len(ps.draining) > 0 || len(candidates) == 0 || alive(machines)-len(deleted) <= pol.Min {
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
	reason := fmt.Sprintf("idle since %s; scaling pool %s down", ps.idleSince[m.ID].UTC().Format(time.RFC3339), name)
	if err := a.cfg.Holds.Drain(ctx, m.NodeID, reason); err != nil {
		a.cfg.Log.Warn("write drain hold", "pool", name, "node_id", m.NodeID, "err", err)
		return
	}
	ps.draining[m.ID] = m.NodeID
	ps.lastScale = now
	a.event(ctx, name, contracts.MachineEvent{Kind: contracts.MachineDraining, MachineID: m.ID, NodeID: m.NodeID, Message: reason})
	a.cfg.Log.Info("draining idle machine", "pool", name, "machine", m.ID, "node_id", m.NodeID)
}

// Kick makes Run step at once (a provider pushed a change, a node agent
// registered). It never blocks; kicks while a step is due merge.
func (a *Actuator) Kick() {
	select {
	case a.kick <- struct{}{}:
	default:
	}
}

// Run steps every interval, and on Kick, until ctx ends.
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
		case <-a.kick:
		}
	}
}
