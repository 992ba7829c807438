// Package billing meters GPU time and prices it. See README.md for the
// pipeline, the rounding rules and the failure modes.
//
//	ALLOCATIONS gp.alloc.ledger.* ──durable billing-ledger──▶ biller ──CAS──▶ gp.usage.<tenant> (USAGE)
//	RUNS gp.runs.* (ended facts) ──durable billing-runs──────┘
//	      price book (KV gp-pricebook), node inventories, job requests ──┘
//	USAGE ──durable billing-usage-<generation>, batches──▶ projector ──▶ Store (memory or Redis)
//	budgets (KV gp-budgets) + Store ──▶ budget watcher ──▶ KV gp-budget-status, gp.alerts.budget
//
// Exactly once per segment, across redeliveries, duplicates and restarts:
// see internal/biller. The store is a view of USAGE, rebuilt from it
// whenever it loses its content: see internal/projector.
package billing

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/billing/internal/biller"
	"github.com/gpuplane/gpuplane/services/billing/internal/budget"
	"github.com/gpuplane/gpuplane/services/billing/internal/catalog"
	"github.com/gpuplane/gpuplane/services/billing/internal/projector"
)

// Name is the service name.
const Name = "billing"

// Consumer is the durable consumer billing reads the ledger with.
const Consumer = biller.LedgerConsumer

// RunsConsumer is the durable consumer billing reads the agents' run facts
// with: an ended fact is the truth of how long a run held its devices,
// and corrects a run billed provisionally to a node_lost release.
const RunsConsumer = biller.RunsConsumer

// maxDeliver is how often a ledger entry that fails for a transient reason
// (bus outage, an inventory not read yet) is tried before it is
// dead-lettered: about 80 minutes at the bus's 5 s backoff ceiling. An
// entry given up on is revenue lost until an operator replays it, so
// billing outwaits outages; malformed entries are permanent failures and
// go to the dead letters at once.
const maxDeliver = 1000

// Config configures billing.
type Config struct {
	Bus service.BusConfig
	// RedisAddr selects the Redis store (host:port); empty keeps the
	// in-memory store. Redis tunes it (its Addr is RedisAddr).
	RedisAddr string
	Redis     RedisConfig
	// Store, when set, is used as is (tests). Not a flag.
	Store Store
	// StoreRetryDelay is how long usage waits while the store is
	// unavailable; default 5 s.
	StoreRetryDelay time.Duration
	// BudgetInterval re-evaluates every budget; default 30 s.
	BudgetInterval time.Duration
	// ForgetInterval is how often the biller forgets the allocations it
	// billed to their end that the store confirms (internal/biller,
	// forget.go); default 1 s, 0 keeps them all (as before issue 17).
	ForgetInterval time.Duration
	// CheckpointInterval is how often the checkpoint a start restores is
	// written (checkpoint.go); default 1 min, 0 writes none and reads
	// none. Only with ForgetInterval: without forgetting, a checkpoint
	// would hold every allocation ever billed.
	CheckpointInterval time.Duration
	// Now is the clock of budget periods; default time.Now. Not a flag.
	Now func() time.Time
}

// DefaultConfig returns the defaults, with the bus settings and
// GPUPLANE_BILLING_REDIS from the environment.
func DefaultConfig() Config {
	return Config{Bus: service.DefaultBusConfig(), RedisAddr: os.Getenv("GPUPLANE_BILLING_REDIS"),
		StoreRetryDelay: 5 * time.Second, BudgetInterval: 30 * time.Second, ForgetInterval: time.Second,
		CheckpointInterval: time.Minute}
}

// RegisterFlags adds billing's flags to fs, defaulting to c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	c.Bus.RegisterFlags(fs)
	fs.StringVar(&c.RedisAddr, "redis", c.RedisAddr, "Redis host:port for the usage totals; empty keeps them in memory (env GPUPLANE_BILLING_REDIS)")
	fs.DurationVar(&c.StoreRetryDelay, "store-retry", c.StoreRetryDelay, "how long usage waits while the store is unavailable")
	fs.DurationVar(&c.BudgetInterval, "budget-interval", c.BudgetInterval, "how often every budget is evaluated again")
	fs.DurationVar(&c.ForgetInterval, "forget-interval", c.ForgetInterval, "how often billed allocations the store confirms are forgotten; 0 keeps them")
	fs.DurationVar(&c.CheckpointInterval, "checkpoint-interval", c.CheckpointInterval, "how often the checkpoint a start restores is written, instead of reading USAGE whole; 0: none (needs -forget-interval)")
}

// Validate reports every problem at once.
func (c Config) Validate() error {
	errs := []error{c.Bus.Validate()}
	if c.StoreRetryDelay < 0 {
		errs = append(errs, fmt.Errorf("store retry delay is %s; want ≥ 0", c.StoreRetryDelay))
	}
	if c.BudgetInterval < 0 {
		errs = append(errs, fmt.Errorf("budget interval is %s; want ≥ 0", c.BudgetInterval))
	}
	if c.CheckpointInterval < 0 {
		errs = append(errs, fmt.Errorf("checkpoint interval is %s; want ≥ 0", c.CheckpointInterval))
	}
	if c.ForgetInterval < 0 {
		errs = append(errs, fmt.Errorf("forget interval is %s; want ≥ 0", c.ForgetInterval))
	}
	return errors.Join(errs...)
}

// Run runs billing until ctx ends; it returns nil on a clean shutdown.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("%s: %w", Name, err)
	}
	if log == nil {
		log = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	store := cfg.Store
	switch {
	case store != nil:
	case cfg.RedisAddr != "":
		rc := cfg.Redis
		rc.Addr = cfg.RedisAddr
		rc.OnBreakerChange = func(from, to string) { log.Warn("redis circuit breaker", "from", from, "to", to) }
		// go-redis logs its connection pool's troubles to stderr through a
		// package-level logger: send them to this service's log instead.
		redis.SetLogger(redisLog{log.With("component", "redis")})
		rs, err := NewRedisStore(rc)
		if err != nil {
			return fmt.Errorf("%s: %w", Name, err)
		}
		defer rs.Close()
		store = rs
	default:
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
	err = run(ctx, cfg, rt, store)
	if ctx.Err() != nil {
		return nil
	}
	return err
}

func run(ctx context.Context, cfg Config, rt *service.Runtime, store Store) error {
	log, b := rt.Log, rt.Bus
	buckets := map[string]jetstream.KeyValue{}
	for _, name := range []string{contracts.BucketPriceBook, contracts.BucketBudgets, contracts.BucketBudgetStatus,
		contracts.BucketSnapshots} {
		kv, err := b.KeyValue(ctx, name)
		if err != nil {
			return fmt.Errorf("%s: %w", Name, err)
		}
		buckets[name] = kv
	}
	g, gctx := errgroup.WithContext(ctx)
	nodes := catalog.NewNodes(b, log)
	g.Go(func() error { return nodes.Run(gctx) })
	select {
	case <-gctx.Done():
		return g.Wait()
	case <-nodes.Ready():
	}
	book := catalog.NewBook(buckets[contracts.BucketPriceBook])
	mark := catalog.NewWatermark(buckets[contracts.BucketPriceBook], log)
	bcfg := biller.Config{Bus: b, Prices: book, Nodes: nodes, Requests: catalog.NewRequests(b.JetStream()),
		Watermark: mark, Log: log}
	if cfg.ForgetInterval > 0 {
		bcfg.Index = store
	}
	var (
		bl   *biller.Biller
		from *checkpointFile // the checkpoint the start used
		err  error
	)
	if checkpointing := cfg.ForgetInterval > 0 && cfg.CheckpointInterval > 0; checkpointing {
		bl, from, err = startBiller(gctx, b, buckets[contracts.BucketSnapshots], bcfg, store, log)
	} else {
		bl = biller.New(bcfg)
		err = bl.Rebuild(gctx)
	}
	if err != nil {
		return errors.Join(fmt.Errorf("%s: %w", Name, err), g.Wait())
	}
	if err := mark.Init(gctx, bl.MeteredUntil()); err != nil {
		return errors.Join(fmt.Errorf("%s: %w", Name, err), g.Wait())
	}
	log.Info("billing rebuilt from USAGE", "allocations_billed", bl.Billed(), "metered_until", bl.MeteredUntil())

	budgets := budget.New(budget.Config{Bus: b, Budgets: buckets[contracts.BucketBudgets],
		Statuses: buckets[contracts.BucketBudgetStatus], Spend: spend{store},
		Currency: func(ctx context.Context) string {
			bk, err := book.Get(ctx)
			if err != nil {
				return ""
			}
			return bk.Currency()
		},
		SpotPools: nodes.SpotPools, Log: log, Now: cfg.Now, Interval: cfg.BudgetInterval})
	// The feed probes its generation as often as budgets are judged on
	// it, at least every second.
	proj := projector.New(projector.Config{Bus: b, Store: store, Log: log, Unavailable: ErrStoreUnavailable,
		Changed: ErrGenerationChanged, RetryDelay: cfg.StoreRetryDelay, Applied: budgets.Touch, Complete: budgets.TouchAll,
		ProbeInterval: min(cfg.BudgetInterval, time.Second)})

	// The biller takes each consumer's messages in batches: what it asks
	// the store about the allocations it forgot is asked once per batch,
	// outside its lock (internal/biller, forget.go).
	g.Go(func() error {
		err := b.ConsumeBatch(gctx, bus.ConsumerSpec{Stream: contracts.StreamAllocations, Durable: Consumer,
			FilterSubjects: []string{contracts.SubjectLedgerAll}, MaxDeliver: maxDeliver}, bl.Handle)
		if err != nil {
			return fmt.Errorf("%s: %w", Name, err)
		}
		return nil
	})
	g.Go(func() error {
		err := b.ConsumeBatch(gctx, bus.ConsumerSpec{Stream: contracts.StreamRuns, Durable: RunsConsumer,
			FilterSubjects: []string{contracts.SubjectRunsAll}, MaxDeliver: maxDeliver}, bl.HandleRun)
		if err != nil {
			return fmt.Errorf("%s: %w", Name, err)
		}
		return nil
	})
	g.Go(func() error { return proj.Run(gctx) })
	if cfg.ForgetInterval > 0 {
		g.Go(func() error { forget(gctx, bl, cfg.ForgetInterval, log); return nil })
		if cfg.CheckpointInterval > 0 {
			g.Go(func() error {
				checkpoints(gctx, b, buckets[contracts.BucketSnapshots], bcfg, from, cfg.CheckpointInterval,
					cfg.ForgetInterval, log)
				return nil
			})
		}
	}
	g.Go(func() error { return budgets.Run(gctx) })
	return g.Wait()
}

// forget has the biller forget, every interval, the allocations it billed
// to their end that the store confirms, until ctx ends. A failure is
// logged: what is not forgotten now is the next round's. (The checkpoint
// fold's rounds log at debug level only, under their own message.)
func forget(ctx context.Context, bl *biller.Biller, interval time.Duration, log *slog.Logger) {
	forgetLogged(ctx, bl, interval, log, "forgot billed allocations the store holds")
}

func forgetLogged(ctx context.Context, bl *biller.Biller, interval time.Duration, log *slog.Logger, forgot string) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := bl.Forget(ctx)
		if err != nil && ctx.Err() == nil {
			log.Warn("billed allocations not forgotten this round", "forgotten", n, "err", err)
		} else if n > 0 {
			log.Debug(forgot, "forgotten", n)
		}
	}
}

// spend reads a tenant's spend from the store.
type spend struct{ s Store }

func (sp spend) TenantDay(ctx context.Context, tenant string, day time.Time) (int64, error) {
	t, err := sp.s.CompleteTenantDay(ctx, tenant, day)
	return t.CostMicros, spendErr(err)
}

func (sp spend) TenantMonth(ctx context.Context, tenant string, month time.Time) (int64, error) {
	t, err := sp.s.CompleteTenantMonth(ctx, tenant, month)
	return t.CostMicros, spendErr(err)
}

// spendErr says an incomplete store's error in the budget watcher's terms.
func spendErr(err error) error {
	if errors.Is(err, ErrIncomplete) {
		return fmt.Errorf("%w: %w", budget.ErrIncomplete, err)
	}
	return err
}

// redisLog adapts slog to go-redis's logger.
type redisLog struct{ log *slog.Logger }

func (l redisLog) Printf(ctx context.Context, format string, v ...any) {
	l.log.WarnContext(ctx, fmt.Sprintf(format, v...))
}
