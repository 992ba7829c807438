// Package billing meters GPU time. It consumes the allocation ledger with a
// durable consumer and publishes one UsageRecord per allocation whose run
// started, GPUs × (EndedAt − StartedAt) to the millisecond, on
// gp.usage.<tenant>; it keeps totals by tenant and job in a Store.
//
//	USAGE (replayed at start) ──> billed set + Store totals
//	ALLOCATIONS gp.alloc.ledger.* ──durable billing-ledger──> meter ──CAS──> gp.usage.<tenant>
//
// Exactly once per allocation, across redeliveries, duplicates and
// restarts: see internal/biller.
package billing

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"

	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/billing/internal/biller"
)

// Name is the service name.
const Name = "billing"

// Consumer is the durable consumer billing reads the ledger with.
const Consumer = "billing-ledger"

// maxDeliver is how often a ledger entry that fails for a transient reason
// (bus or store outage) is tried before it is dead-lettered: about 80
// minutes at the bus's 5 s backoff ceiling. An entry given up on is revenue
// lost until an operator replays it, so billing outwaits outages; malformed
// entries are permanent failures and go to the dead letters at once.
const maxDeliver = 1000

// Config configures billing.
type Config struct {
	Bus service.BusConfig
	// Store keeps the totals; nil means a new MemoryStore. Not a flag.
	Store Store
}

// DefaultConfig returns the defaults, with the bus settings from the
// environment.
func DefaultConfig() Config { return Config{Bus: service.DefaultBusConfig()} }

// RegisterFlags adds billing's flags to fs, defaulting to c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) { c.Bus.RegisterFlags(fs) }

// Validate reports every problem at once.
func (c Config) Validate() error { return errors.Join(c.Bus.Validate()) }

// Run runs billing until ctx ends; it returns nil on a clean shutdown.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("%s: %w", Name, err)
	}
	if log == nil {
		log = slog.Default()
	}
	store := cfg.Store
	if store == nil {
		store = NewMemoryStore()
	}
	rt, err := service.Start(ctx, Name, cfg.Bus, log)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer rt.Close()
	bl := biller.New(rt.Bus, store, rt.Log)
	if err := bl.Rebuild(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("%s: %w", Name, err)
	}
	rt.Log.Info("billing rebuilt from USAGE", "allocations_billed", bl.Billed())

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		err := rt.Bus.Consume(gctx, bus.ConsumerSpec{Stream: contracts.StreamAllocations, Durable: Consumer,
			FilterSubjects: []string{contracts.SubjectLedgerAll}, MaxDeliver: maxDeliver}, bl.Handle)
		if err != nil {
			return fmt.Errorf("%s: %w", Name, err)
		}
		return nil
	})
	return g.Wait()
}
