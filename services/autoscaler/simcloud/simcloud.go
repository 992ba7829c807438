// Package simcloud is a simulated cloud provider for tests and the
// simulated fleet: machines take a provisioning delay to come up, machine
// types have capacity limits, the account has a quota, spot machines get
// interruption notices two minutes before they are reclaimed, and faults
// (failures, lost replies) can be injected.
//
// It is deterministic: time comes from an injected clock and nothing
// happens by itself. Advance applies every transition that is due at the
// clock's current time, in time order, and reports it through Hooks, so a
// test (or a fleet simulator driving it with a real clock) decides when the
// world moves. Hooks is where simulated node agents are started and stopped.
package simcloud

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
)

// NoticeAhead is how long before reclaiming a spot machine its
// interruption notice is given, unless Config.NoticeAhead says otherwise.
const NoticeAhead = 2 * time.Minute

// ErrUnavailable is the injected failure of a provider that is down.
var ErrUnavailable = errors.New("simcloud: provider unavailable")

// Hooks receive the simulated world's transitions. Each may be nil. They
// are called without the provider's lock held, in time order, from the
// goroutine calling Advance or Interrupt.
type Hooks struct {
	// Up: a machine finished provisioning; start its node agent.
	Up func(cloud.Machine)
	// Down: a machine was deleted or reclaimed; stop its node agent.
	Down func(cloud.Machine)
	// Notice: a spot machine will be reclaimed at m.Interruption.
	Notice func(cloud.Machine)
}

// Config configures a provider.
type Config struct {
	// Now is the clock (required: determinism is the point).
	Now func() time.Time
	// ProvisionDelay is how long a created machine provisions.
	ProvisionDelay time.Duration
	// PoolProvisionDelay overrides ProvisionDelay for the pools it names.
	PoolProvisionDelay map[string]time.Duration
	// NoticeAhead is how long before its reclaim a spot machine is given
	// notice (default the clouds' two minutes, NoticeAhead); tests and
	// demonstrations shorten it.
	NoticeAhead time.Duration
	// Capacity caps live (not deleted) machines per machine type; a type
	// not named has no cap.
	Capacity map[string]int
	// Quota caps live machines in all; 0 means none.
	Quota int
	Hooks Hooks
}

// Provider is the simulated provider. It is safe for concurrent use.
type Provider struct {
	cfg Config

	mu       sync.Mutex
	seq      int
	machines map[string]*cloud.Machine // by ID
	byToken  map[string]string         // token → machine ID
	failing  error                     // every call fails with it while set
	loseNext int                       // creates applied whose reply is lost
	calls    map[string]int            // method → calls received
	watchers map[int]func(pool string)
	watchSeq int
}

// New returns an empty provider.
func New(cfg Config) (*Provider, error) {
	if cfg.Now == nil {
		return nil, errors.New("simcloud: Config.Now is required")
	}
	var errs []error
	if cfg.ProvisionDelay < 0 {
		errs = append(errs, fmt.Errorf("simcloud: provision delay %s; want >= 0", cfg.ProvisionDelay))
	}
	for _, pool := range slices.Sorted(maps.Keys(cfg.PoolProvisionDelay)) {
		if d := cfg.PoolProvisionDelay[pool]; d < 0 {
			errs = append(errs, fmt.Errorf("simcloud: pool %s: provision delay %s; want >= 0", pool, d))
		}
	}
	if cfg.NoticeAhead < 0 {
		errs = append(errs, fmt.Errorf("simcloud: notice ahead %s; want >= 0", cfg.NoticeAhead))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if cfg.NoticeAhead == 0 {
		cfg.NoticeAhead = NoticeAhead
	}
	return &Provider{cfg: cfg, machines: map[string]*cloud.Machine{}, byToken: map[string]string{}, calls: map[string]int{},
		watchers: map[int]func(string){}}, nil
}

// provisionDelay is how long a machine of pool provisions.
func (p *Provider) provisionDelay(pool string) time.Duration {
	if d, ok := p.cfg.PoolProvisionDelay[pool]; ok {
		return d
	}
	return p.cfg.ProvisionDelay
}

// Watch calls fn with a pool's name whenever one of its machines changes
// on the provider's side (booted, noticed, reclaimed, deleted), after
// Hooks, until the returned cancel is called. It is how a provider with an
// event feed lets the autoscaler list a pool at once instead of at its
// next tick; fn must not block.
func (p *Provider) Watch(fn func(pool string)) (cancel func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.watchSeq++
	id := p.watchSeq
	p.watchers[id] = fn
	return func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		delete(p.watchers, id)
	}
}

// changed tells the watchers that pool changed. The caller does not hold
// p.mu.
func (p *Provider) changed(pool string) {
	p.mu.Lock()
	fns := make([]func(string), 0, len(p.watchers))
	for _, id := range slices.Sorted(maps.Keys(p.watchers)) {
		fns = append(fns, p.watchers[id])
	}
	p.mu.Unlock()
	for _, fn := range fns {
		fn(pool)
	}
}

// Create creates a machine, or returns the machine already created with
// req.Token (whatever its state: a token names one machine for ever).
func (p *Provider) Create(ctx context.Context, req cloud.CreateRequest) (cloud.Machine, error) {
	if err := ctx.Err(); err != nil {
		return cloud.Machine{}, err
	}
	if req.Token == "" || req.Pool == "" || req.MachineType == "" {
		return cloud.Machine{}, fmt.Errorf("simcloud: create %+v: token, pool and machine type are required", req)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls["create"]++
	if p.failing != nil {
		return cloud.Machine{}, p.failing
	}
	if id, ok := p.byToken[req.Token]; ok {
		return *p.machines[id], p.lostReply()
	}
	live, ofType := 0, 0
	for _, m := range p.machines {
		if m.State != cloud.Deleted {
			live++
			if m.MachineType == req.MachineType {
				ofType++
			}
		}
	}
	if p.cfg.Quota > 0 && live >= p.cfg.Quota {
		return cloud.Machine{}, fmt.Errorf("simcloud: %d machines live, quota %d: %w", live, p.cfg.Quota, cloud.ErrQuota)
	}
	if c, ok := p.cfg.Capacity[req.MachineType]; ok && ofType >= c {
		return cloud.Machine{}, fmt.Errorf("simcloud: %d %s machines live, capacity %d: %w", ofType, req.MachineType, c, cloud.ErrCapacity)
	}
	p.seq++
	id := req.Pool + "-" + strconv.Itoa(p.seq)
	m := &cloud.Machine{ID: id, NodeID: id, Token: req.Token, Pool: req.Pool, MachineType: req.MachineType,
		PriceClass: req.PriceClass, State: cloud.Provisioning, Created: p.cfg.Now()}
	p.machines[id] = m
	p.byToken[req.Token] = id
	return *m, p.lostReply()
}

// lostReply consumes one injected lost reply: the call took effect but the
// caller sees a failure. The caller holds p.mu.
func (p *Provider) lostReply() error {
	if p.loseNext > 0 {
		p.loseNext--
		return fmt.Errorf("simcloud: reply lost: %w", ErrUnavailable)
	}
	return nil
}

// Delete deletes a machine. Deleting a deleted machine succeeds.
func (p *Provider) Delete(ctx context.Context, id string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	p.mu.Lock()
	p.calls["delete"]++
	if p.failing != nil {
		err := p.failing
		p.mu.Unlock()
		return err
	}
	m, ok := p.machines[id]
	if !ok {
		p.mu.Unlock()
		return fmt.Errorf("simcloud: delete %s: %w", id, cloud.ErrNotFound)
	}
	wasUp := m.State == cloud.Running
	already := m.State == cloud.Deleted
	m.State = cloud.Deleted
	gone := *m
	p.mu.Unlock()
	if wasUp && !already && p.cfg.Hooks.Down != nil {
		p.cfg.Hooks.Down(gone)
	}
	if !already {
		p.changed(gone.Pool)
	}
	return nil
}

// List returns the pool's machines that are not deleted, by ID.
func (p *Provider) List(ctx context.Context, pool string) ([]cloud.Machine, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls["list"]++
	if p.failing != nil {
		return nil, p.failing
	}
	var out []cloud.Machine
	for _, id := range slices.Sorted(maps.Keys(p.machines)) {
		if m := p.machines[id]; m.Pool == pool && m.State != cloud.Deleted {
			out = append(out, *m)
		}
	}
	return out, nil
}

// SetFailing makes every call fail with err (ErrUnavailable when err is
// nil and fail is true) until called again with fail false.
func (p *Provider) SetFailing(fail bool, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case !fail:
		p.failing = nil
	case err == nil:
		p.failing = ErrUnavailable
	default:
		p.failing = err
	}
}

// LoseReplies makes the next n creates take effect but answer with an
// error, as a timeout after the provider acted does.
func (p *Provider) LoseReplies(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.loseNext = n
}

// Calls returns how many calls each method received ("create", "delete",
// "list"), failed ones included.
func (p *Provider) Calls() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.calls)
}

// Machines returns every machine ever created, deleted ones included, by ID.
func (p *Provider) Machines() []cloud.Machine {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]cloud.Machine, 0, len(p.machines))
	for _, id := range slices.Sorted(maps.Keys(p.machines)) {
		out = append(out, *p.machines[id])
	}
	return out
}

// Interrupt gives a spot machine its interruption notice: it is reclaimed
// Config.NoticeAhead from now (by the Advance that reaches that time).
func (p *Provider) Interrupt(id string) error {
	p.mu.Lock()
	m, ok := p.machines[id]
	switch {
	case !ok || m.State == cloud.Deleted:
		p.mu.Unlock()
		return fmt.Errorf("simcloud: interrupt %s: %w", id, cloud.ErrNotFound)
	case m.PriceClass != cloud.Spot:
		p.mu.Unlock()
		return fmt.Errorf("simcloud: interrupt %s: a %s machine is not interruptible", id, m.PriceClass)
	case !m.Interruption.IsZero():
		p.mu.Unlock()
		return nil
	}
	m.Interruption = p.cfg.Now().Add(p.cfg.NoticeAhead)
	noticed := *m
	p.mu.Unlock()
	if p.cfg.Hooks.Notice != nil {
		p.cfg.Hooks.Notice(noticed)
	}
	p.changed(noticed.Pool)
	return nil
}

// Advance applies every transition due by now: provisioned machines come
// up, interrupted machines are reclaimed. It returns how many it applied.
func (p *Provider) Advance() int {
	type event struct {
		at    time.Time
		m     cloud.Machine
		up    bool
		wasUp bool // a reclaimed machine had booted (an agent to stop)
	}
	now := p.cfg.Now()
	var events []event
	p.mu.Lock()
	for _, m := range p.machines {
		switch {
		case m.State == cloud.Deleted:
		case !m.Interruption.IsZero() && !now.Before(m.Interruption):
			wasUp := m.State == cloud.Running
			m.State = cloud.Deleted
			events = append(events, event{at: m.Interruption, m: *m, wasUp: wasUp})
		case m.State == cloud.Provisioning && !now.Before(m.Created.Add(p.provisionDelay(m.Pool))):
			m.State = cloud.Running
			events = append(events, event{at: m.Created.Add(p.provisionDelay(m.Pool)), m: *m, up: true})
		}
	}
	p.mu.Unlock()
	slices.SortFunc(events, func(a, b event) int {
		return cmp.Or(a.at.Compare(b.at), cmp.Compare(a.m.ID, b.m.ID))
	})
	for _, e := range events {
		if e.up && p.cfg.Hooks.Up != nil {
			p.cfg.Hooks.Up(e.m)
		} else if !e.up && e.wasUp && p.cfg.Hooks.Down != nil {
			p.cfg.Hooks.Down(e.m)
		}
	}
	pools := map[string]bool{}
	for _, e := range events {
		pools[e.m.Pool] = true
	}
	for _, pool := range slices.Sorted(maps.Keys(pools)) {
		p.changed(pool)
	}
	return len(events)
}
