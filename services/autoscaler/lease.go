package autoscaler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/lease"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
)

// Replicas are active/standby on the lease contracts.LeaseKeyAutoscaler:
// only the holder follows demand, publishes scale decisions and acts on
// the provider; a standby waits, then rebuilds from the streams (its
// decisions replayed, the fleet and ledger followed) and takes over at
// most LeaseTTL after the leader stops renewing. Two active autoscalers
// would each create the machines a pool lacks. The provider is fenced:
// every Create and Delete is made only while the term is valid on the
// leader's own conservative clock, so a leader frozen past its lease
// creates nothing when it thaws, before its context is cancelled.

// Run runs the autoscaler until ctx ends; it returns nil on a clean shutdown.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("%s: %w", Name, err)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if log == nil {
		log = slog.Default()
	}
	rt, err := service.Start(ctx, cfg.instance(), cfg.Bus, log)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer rt.Close()
	if cfg.LeaseTTL == 0 {
		return serve(ctx, cfg, rt.Bus, rt.Log)
	}
	kv, err := rt.Bus.KeyValue(ctx, contracts.BucketLeases)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("%s: %w", Name, err)
	}
	holder := cfg.instance() + "-" + strconv.Itoa(os.Getpid()) + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	elector, err := lease.New(lease.Config{KV: kv, Key: contracts.LeaseKeyAutoscaler, Holder: holder,
		TTL: cfg.LeaseTTL, Log: rt.Log})
	if err != nil {
		return fmt.Errorf("%s: %w", Name, err)
	}
	rt.Log.Info("standby: contending for the lease", "key", contracts.LeaseKeyAutoscaler, "holder", holder)
	err = elector.Run(ctx, func(ctx context.Context, term lease.Term) error {
		tcfg := cfg
		if cfg.Provider != nil {
			tcfg.Provider = fencedProvider{Provider: cfg.Provider, term: term}
		}
		return serve(ctx, tcfg, rt.Bus, rt.Log.With("epoch", term.Epoch))
	})
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// instance is this replica's connection name and CloudEvents source.
func (c Config) instance() string {
	if c.Instance != "" {
		return c.Instance
	}
	return Name
}

// errNotLeader: the lease term is over; the provider is not called.
var errNotLeader = errors.New("autoscaler: lease term over, the provider is not called")

// term is what fencedProvider asks before each call that changes the fleet.
type term interface{ Valid() bool }

// fencedProvider calls the provider's Create and Delete only while the
// term is valid. List is harmless and goes through.
type fencedProvider struct {
	Provider
	term term
}

func (p fencedProvider) Create(ctx context.Context, req cloud.CreateRequest) (cloud.Machine, error) {
	if !p.term.Valid() {
		return cloud.Machine{}, errNotLeader
	}
	return p.Provider.Create(ctx, req)
}

func (p fencedProvider) Delete(ctx context.Context, machineID string) error {
	if !p.term.Valid() {
		return errNotLeader
	}
	return p.Provider.Delete(ctx, machineID)
}

// Watch keeps the provider's change notices (simcloud's) through the fence.
func (p fencedProvider) Watch(fn func(pool string)) (cancel func()) {
	if w, ok := p.Provider.(watcher); ok {
		return w.Watch(fn)
	}
	return func() {}
}
