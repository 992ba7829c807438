// Package budget watches the tenants' budgets against their spend:
//
//	gp-budgets (KV, admins) ──watch──▶ budgets ─┐
//	billing store (spend by tenant and period) ──┼──▶ evaluate ──▶ gp-budget-status (KV, the scheduler reads it)
//	usage applied, a 30 s tick ──────────────────┘            └──▶ gp.alerts.budget (50, 80, 100%, once per period)
//
// Evaluation is level-triggered: any change (a budget edited, usage
// applied for the tenant, time passing into a new period) recomputes the
// tenant's status from the store and publishes what differs.
package budget

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// ErrIncomplete is the error (wrapped) of a Spend that cannot tell all
// that was spent now: its store is being rebuilt. A status judged then
// would understate the spend and let a tenant over its budget spend
// again; the watcher judges nothing until Spend can tell.
var ErrIncomplete = errors.New("spend incomplete")

// Spend reads what a tenant spent in a day or a month; an error wrapping
// ErrIncomplete while that cannot be told in full.
type Spend interface {
	TenantDay(ctx context.Context, tenant string, day time.Time) (costMicros int64, err error)
	TenantMonth(ctx context.Context, tenant string, month time.Time) (costMicros int64, err error)
}

// Config configures a Watcher.
type Config struct {
	Bus      *bus.Bus
	Budgets  jetstream.KeyValue // contracts.BucketBudgets
	Statuses jetstream.KeyValue // contracts.BucketBudgetStatus
	Spend    Spend
	// Currency and SpotPools describe the platform now.
	Currency  func(ctx context.Context) string
	SpotPools func() []string
	Log       *slog.Logger
	Now       func() time.Time
	// Interval re-evaluates every budget; default 30 s.
	Interval time.Duration
}

// Watcher evaluates budgets. Run it once; Touch from any goroutine.
type Watcher struct {
	cfg     Config
	touched chan []string
	// all asks for every tenant's evaluation (TouchAll): its own signal,
	// which a queue full of Touches cannot drop.
	all chan struct{}

	mu       sync.Mutex
	budgets  map[string]contracts.Budget
	statuses map[string]contracts.BudgetStatus
}

// New returns a watcher.
func New(cfg Config) *Watcher {
	if cfg.Interval <= 0 {
		cfg.Interval = 30 * time.Second
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Watcher{cfg: cfg, touched: make(chan []string, 64), all: make(chan struct{}, 1), budgets: map[string]contracts.Budget{},
		statuses: map[string]contracts.BudgetStatus{}}
}

// Touch asks for the evaluation of tenants (usage was applied for them).
// It never blocks: when the queue is full the next tick evaluates all.
func (w *Watcher) Touch(tenants []string) {
	select {
	case w.touched <- tenants:
	default:
	}
}

// TouchAll asks for the evaluation of every tenant (the store became
// complete: the evaluations skipped meanwhile are owed). It never blocks,
// and a request already waiting covers it.
func (w *Watcher) TouchAll() {
	select {
	case w.all <- struct{}{}:
	default:
	}
}

// Run watches until ctx ends.
func (w *Watcher) Run(ctx context.Context) error {
	if err := w.loadStatuses(ctx); err != nil {
		return err
	}
	watch, err := w.cfg.Budgets.WatchAll(ctx)
	if err != nil {
		return fmt.Errorf("watch budgets: %w", err)
	}
	defer func() { _ = watch.Stop() }()
	tick := time.NewTicker(w.cfg.Interval)
	defer tick.Stop()
	// Nothing is evaluated before the budgets present at start are read:
	// a tenant with a status and no budget yet would look like a tenant
	// whose budget was removed.
	synced := false
	for {
		select {
		case <-ctx.Done():
			return nil
		case e, ok := <-watch.Updates():
			if !ok {
				return errors.New("budget watch closed")
			}
			if e == nil { // the initial values are in
				synced = true
				w.evaluate(ctx, w.tenants())
				continue
			}
			w.applyBudget(e)
			if synced {
				w.evaluate(ctx, []string{e.Key()})
			}
		case <-w.all:
			if synced {
				w.evaluate(ctx, w.tenants())
			}
		case tenants := <-w.touched:
			if synced {
				w.evaluate(ctx, tenants)
			}
		case <-tick.C:
			if synced {
				w.evaluate(ctx, w.tenants())
			}
		}
	}
}

func (w *Watcher) loadStatuses(ctx context.Context) error {
	keys, err := w.cfg.Statuses.ListKeys(ctx)
	if err != nil {
		return fmt.Errorf("list budget statuses: %w", err)
	}
	for k := range keys.Keys() {
		e, err := w.cfg.Statuses.Get(ctx, k)
		if err != nil {
			return fmt.Errorf("budget status of %s: %w", k, err)
		}
		var st contracts.BudgetStatus
		if err := json.Unmarshal(e.Value(), &st); err != nil {
			w.cfg.Log.Warn("ignoring an unreadable budget status; it is written again", "tenant", k, "err", err)
			continue
		}
		w.statuses[k] = st
	}
	return nil
}

func (w *Watcher) applyBudget(e jetstream.KeyValueEntry) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if e.Operation() != jetstream.KeyValuePut {
		delete(w.budgets, e.Key())
		return
	}
	b, err := contracts.DecodeBudget(e.Value(), e.Key())
	if err != nil {
		w.cfg.Log.Warn("ignoring an invalid budget", "tenant", e.Key(), "revision", e.Revision(), "err", err)
		delete(w.budgets, e.Key())
		return
	}
	w.budgets[e.Key()] = b
}

func (w *Watcher) tenants() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for t := range w.budgets {
		out = append(out, t)
	}
	for t := range w.statuses {
		if _, ok := w.budgets[t]; !ok {
			out = append(out, t) // a budget removed: its status goes
		}
	}
	slices.Sort(out)
	return out
}

func (w *Watcher) evaluate(ctx context.Context, tenants []string) {
	incomplete := false
	for _, t := range tenants {
		if incomplete && w.hasBudget(t) {
			continue // its spend cannot be told either
		}
		err := w.evaluateOne(ctx, t)
		switch {
		case errors.Is(err, ErrIncomplete):
			// Every tenant's spend is: the tick comes back once the store
			// is rebuilt, and each status stands meanwhile. The round
			// goes on only to remove the statuses of budgets that are
			// gone (removed while this replica was down), which read no
			// spend: a tenant must not stay held by a budget it no
			// longer has for as long as a rebuild takes.
			w.cfg.Log.Debug("budgets not evaluated while the billing store is rebuilt", "err", err)
			incomplete = true
		case err != nil && ctx.Err() == nil:
			w.cfg.Log.Info("budget not evaluated; the next tick tries again", "tenant", t, "err", err)
		}
	}
}

func (w *Watcher) hasBudget(tenant string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	_, ok := w.budgets[tenant]
	return ok
}

// evaluateOne recomputes tenant's status; it publishes the alerts of
// thresholds newly crossed, then the status when it changed.
func (w *Watcher) evaluateOne(ctx context.Context, tenant string) error {
	w.mu.Lock()
	b, hasBudget := w.budgets[tenant]
	prev, hasPrev := w.statuses[tenant]
	w.mu.Unlock()
	if !hasBudget {
		if hasPrev {
			if err := w.cfg.Statuses.Delete(ctx, tenant); err != nil {
				return fmt.Errorf("delete status: %w", err)
			}
			w.mu.Lock()
			delete(w.statuses, tenant)
			w.mu.Unlock()
		}
		return nil
	}
	now := w.cfg.Now()
	name, start, end := contracts.PeriodOf(b.Period, now)
	var spent int64
	var err error
	if b.Period == contracts.BudgetDaily {
		spent, err = w.cfg.Spend.TenantDay(ctx, tenant, start)
	} else {
		spent, err = w.cfg.Spend.TenantMonth(ctx, tenant, start)
	}
	if err != nil {
		return fmt.Errorf("spend: %w", err)
	}
	st := contracts.BudgetStatus{SchemaVersion: contracts.SchemaVersion, Tenant: tenant, Period: b.Period, PeriodName: name,
		PeriodStart: start, PeriodEnd: end, Currency: w.cfg.Currency(ctx), LimitMicros: int64(b.Limit), SpentMicros: spent,
		Policy: b.Policy, SpotPools: w.cfg.SpotPools(), Time: now.UTC()}
	for _, th := range contracts.BudgetThresholds {
		if reached(spent, int64(b.Limit), th) {
			st.Crossed = append(st.Crossed, th)
		}
	}
	st.Exceeded = slices.Contains(st.Crossed, 100)
	if hasPrev && prev.PeriodName == name && prev.Period == b.Period {
		st.Alerted = slices.Clone(prev.Alerted)
	}
	for _, th := range st.Crossed {
		if slices.Contains(st.Alerted, th) {
			continue
		}
		if err := w.alert(ctx, st, th); err != nil {
			return err
		}
		st.Alerted = append(st.Alerted, th)
	}
	slices.Sort(st.Alerted)
	if hasPrev && same(prev, st) {
		return nil
	}
	data, err := json.Marshal(st)
	if err != nil {
		return err
	}
	if _, err := w.cfg.Statuses.Put(ctx, tenant, data); err != nil {
		return fmt.Errorf("publish status: %w", err)
	}
	w.mu.Lock()
	w.statuses[tenant] = st
	w.mu.Unlock()
	w.cfg.Log.Info("budget status", "tenant", tenant, "period", name, "spent_micros", spent, "limit_micros", int64(b.Limit),
		"exceeded", st.Exceeded, "policy", st.Policy)
	return nil
}

// reached reports spent ≥ threshold% of limit, exactly.
func reached(spent, limit int64, threshold int) bool {
	l := new(big.Int).Mul(big.NewInt(limit), big.NewInt(int64(threshold)))
	s := new(big.Int).Mul(big.NewInt(spent), big.NewInt(100))
	return s.Cmp(l) >= 0
}

// same compares two statuses but for their time.
func same(a, b contracts.BudgetStatus) bool {
	a.Time, b.Time = time.Time{}, time.Time{}
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return string(ja) == string(jb)
}

func (w *Watcher) alert(ctx context.Context, st contracts.BudgetStatus, threshold int) error {
	severity := map[int]string{50: "info", 80: "warning", 100: "critical"}[threshold]
	msg := fmt.Sprintf("tenant %s reached %d%% of its %s budget for %s: %s of %s %s", st.Tenant, threshold, st.Period,
		st.PeriodName, contracts.Money(st.SpentMicros).CentString(), contracts.Money(st.LimitMicros).CentString(), st.Currency)
	if threshold == 100 {
		msg += fmt.Sprintf("; policy %s", st.Policy)
	}
	a := contracts.Alert{SchemaVersion: contracts.SchemaVersion, Kind: contracts.AlertKindBudget,
		Key: st.Tenant + "/" + st.PeriodName + "/" + strconv.Itoa(threshold), State: contracts.AlertFiring, Severity: severity,
		Labels: map[string]string{"tenant": st.Tenant, "period": st.PeriodName, "threshold": strconv.Itoa(threshold),
			"policy": string(st.Policy)},
		Value: st.Percent(), Message: msg, Since: st.Time, Time: st.Time}
	if _, err := w.cfg.Bus.Publish(ctx, contracts.SubjectAlert(contracts.AlertKindBudget),
		contracts.BudgetAlertID(st.Tenant, st.PeriodName, threshold), a, bus.CESubject(st.Tenant)); err != nil {
		return fmt.Errorf("publish alert: %w", err)
	}
	w.cfg.Log.Warn("budget alert", "tenant", st.Tenant, "period", st.PeriodName, "threshold", threshold, "policy", st.Policy)
	return nil
}
