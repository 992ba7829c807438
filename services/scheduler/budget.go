package scheduler

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// budgetGate is the scheduler's side of billing's budgets (issue 5): it
// follows the budget statuses billing publishes in the KV bucket
// gp-budget-status and, at intake, rejects with budget_exceeded a new job
// that its tenant's policy refuses at 100% of its budget
// (contracts.BudgetStatus.Admit). Services talk only through the bus: the
// scheduler never asks billing anything.
type budgetGate struct {
	bus *bus.Bus
	log *slog.Logger
	now func() time.Time

	mu       sync.RWMutex
	statuses map[string]*contracts.BudgetStatus
}

func newBudgetGate(b *bus.Bus, log *slog.Logger) *budgetGate {
	return &budgetGate{bus: b, log: log, now: time.Now, statuses: map[string]*contracts.BudgetStatus{}}
}

// Admit is state.Config.Admit.
func (g *budgetGate) Admit(tenant string, req contracts.JobRequest) error {
	g.mu.RLock()
	st := g.statuses[tenant]
	g.mu.RUnlock()
	return st.Admit(req, g.now())
}

// run follows the statuses until ctx ends; synced is called once the
// statuses present at start are read, so that intake never starts blind.
func (g *budgetGate) run(ctx context.Context, synced func()) error {
	if err := g.bus.WatchKV(ctx, contracts.BucketBudgetStatus, g.apply, synced); err != nil {
		return fmt.Errorf("budget statuses: %w", err)
	}
	return nil
}

func (g *budgetGate) apply(e jetstream.KeyValueEntry) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if e.Operation() != jetstream.KeyValuePut {
		delete(g.statuses, e.Key())
		return
	}
	var st contracts.BudgetStatus
	if err := json.Unmarshal(e.Value(), &st); err != nil {
		g.log.Warn("ignoring an unreadable budget status", "tenant", e.Key(), "err", err)
		delete(g.statuses, e.Key())
		return
	}
	g.statuses[e.Key()] = &st
}
