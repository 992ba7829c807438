package autoscaler

import (
	"errors"
	"flag"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/autoscaler/internal/actuate"
)

// Config configures the autoscaler.
type Config struct {
	Bus service.BusConfig
	// MaxNodes caps the size of named pools (-max-nodes h100=4,a100=4).
	MaxNodes map[string]int
	// DefaultMaxNodes caps every pool not named in MaxNodes (default 8).
	DefaultMaxNodes int
	// Cooldown is the least time between two decisions for one pool
	// (default 30s).
	Cooldown time.Duration
	// Now is the clock decisions are dated and cooled down with (default
	// time.Now). Not a flag.
	Now func() time.Time
	// Provider, when set, makes the autoscaler act on its decisions:
	// create machines for the pools named in Pools, keep them at their
	// minimum, react to spot interruption notices, and scale idle ones
	// down. Nil publishes decisions only. A provider that also has
	// Watch(func(pool string)) (cancel func()) is listed at once when it
	// reports a change. Not a flag.
	Provider Provider
	// Pools is the scaling policy of each pool the autoscaler acts on
	// (min, max, machine type, price class, up and down cooldowns, idle
	// time); a pool's Max here overrides MaxNodes, its UpCooldown
	// Cooldown. Only these pools act on scale_up alerts. Not a flag.
	Pools map[string]Pool
	// BreakerOpenFor is how long the provider's circuit breaker stays
	// open after it trips (5 failed calls in a row) before one call may
	// probe the provider again (default 1m).
	BreakerOpenFor time.Duration
	// NodeLostGrace is how long a machine the provider lists as running
	// may have its node agent lost (the resource manager's `lost` event,
	// with no `returned` or `registered` since) before it is deleted as
	// dead and replaced (default 2m).
	NodeLostGrace time.Duration
	// ActuateEvery is how often the pools are reconciled with the
	// provider when nothing kicks them (default 1s). Not a flag.
	ActuateEvery time.Duration
	// LeaseTTL is how long the leader's lease lasts unrenewed (lease.go):
	// one replica leads, a standby takes over at most this long after it
	// dies or freezes. 0 runs without election (a single instance).
	// Default 3 s.
	LeaseTTL time.Duration
	// Instance names this replica on the bus (connection name and
	// CloudEvents source); default "autoscaler". Replicas may set their
	// own (the pod name) to tell their writes apart.
	Instance string
}

// Pool is the scaling policy of one pool (see actuate.Pool).
type Pool = actuate.Pool

// Provider creates, deletes and lists a cloud's machines (package cloud
// is its vocabulary; package simcloud simulates one).
type Provider = actuate.Provider

// watcher is a provider that pushes changes (simcloud.Provider.Watch).
type watcher interface {
	Watch(fn func(pool string)) (cancel func())
}

// DefaultConfig returns the defaults, with the bus settings from the
// environment.
func DefaultConfig() Config {
	return Config{Bus: service.DefaultBusConfig(), MaxNodes: map[string]int{}, DefaultMaxNodes: 8,
		Cooldown: 30 * time.Second, Now: time.Now, BreakerOpenFor: time.Minute, ActuateEvery: time.Second,
		NodeLostGrace: actuate.DefaultLostGrace, LeaseTTL: 3 * time.Second, Instance: Name}
}

// RegisterFlags adds the autoscaler's flags to fs, defaulting to c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	c.Bus.RegisterFlags(fs)
	fs.Var((*poolLimits)(&c.MaxNodes), "max-nodes", "per-pool node maximum, as pool=n[,pool=n...]")
	fs.IntVar(&c.DefaultMaxNodes, "default-max-nodes", c.DefaultMaxNodes, "node maximum of pools not named in -max-nodes")
	fs.DurationVar(&c.Cooldown, "cooldown", c.Cooldown, "least time between two scale decisions for one pool")
	fs.DurationVar(&c.NodeLostGrace, "node-lost-grace", c.NodeLostGrace, "how long a running machine's node agent may be lost before the machine is deleted as dead and replaced")
	fs.DurationVar(&c.LeaseTTL, "lease-ttl", c.LeaseTTL, "leader lease duration: one replica acts, a standby takes over at most this long after it dies (0: no election)")
	fs.StringVar(&c.Instance, "name", c.Instance, "this replica's connection name and CloudEvents source")
	fs.DurationVar(&c.BreakerOpenFor, "breaker-open-for", c.BreakerOpenFor, "how long a tripped provider circuit breaker refuses calls before probing again")
}

// Validate reports every problem at once.
func (c Config) Validate() error {
	errs := []error{c.Bus.Validate()}
	if c.DefaultMaxNodes < 0 {
		errs = append(errs, fmt.Errorf("default-max-nodes is %d; want >= 0", c.DefaultMaxNodes))
	}
	for _, pool := range slices.Sorted(maps.Keys(c.MaxNodes)) {
		if err := contracts.ValidatePool(pool); err != nil {
			errs = append(errs, fmt.Errorf("max-nodes: %w", err))
		}
		if n := c.MaxNodes[pool]; n < 0 {
			errs = append(errs, fmt.Errorf("max-nodes: pool %s has maximum %d; want >= 0", pool, n))
		}
	}
	for _, pool := range slices.Sorted(maps.Keys(c.Pools)) {
		errs = append(errs, c.Pools[pool].Validate(pool))
	}
	if c.Provider != nil && len(c.Pools) == 0 {
		errs = append(errs, errors.New("a provider is set but no pool has a scaling policy"))
	}
	if c.BreakerOpenFor < 0 || c.ActuateEvery < 0 {
		errs = append(errs, fmt.Errorf("breaker-open-for %s, actuate every %s; want >= 0", c.BreakerOpenFor, c.ActuateEvery))
	}
	if c.NodeLostGrace < 0 {
		errs = append(errs, fmt.Errorf("node-lost-grace is %s; want >= 0 (0 takes the default)", c.NodeLostGrace))
	}
	if c.LeaseTTL != 0 && (c.LeaseTTL < 30*time.Millisecond || c.LeaseTTL > time.Minute) {
		errs = append(errs, fmt.Errorf("lease ttl is %s; want 0 (no election) or 30ms to 1m", c.LeaseTTL))
	}
	if c.Instance != "" {
		if err := contracts.ValidateID(c.Instance); err != nil {
			errs = append(errs, fmt.Errorf("name: %w", err))
		}
	}
	if c.Cooldown < 0 {
		errs = append(errs, fmt.Errorf("cooldown is %s; want >= 0", c.Cooldown))
	}
	return errors.Join(errs...)
}

// decides reports whether demand for pool becomes scale decisions. With a
// provider only the pools with a scaling policy (Pools) do: no one acts on
// a decision for any other, and the monitor would count it as a scale-up
// that never happens. Without one every pool does (decisions are advice).
func (c Config) decides(pool string) bool {
	if c.Provider == nil {
		return true
	}
	_, ok := c.Pools[pool]
	return ok
}

// cooldown is the least time between two scale-up decisions for pool.
func (c Config) cooldown(pool string) time.Duration {
	if p, ok := c.Pools[pool]; ok && p.UpCooldown > 0 {
		return p.UpCooldown
	}
	return c.Cooldown
}

// maxNodes is the cap of one pool.
func (c Config) maxNodes(pool string) int {
	if p, ok := c.Pools[pool]; ok {
		return p.Max
	}
	if n, ok := c.MaxNodes[pool]; ok {
		return n
	}
	return c.DefaultMaxNodes
}

// poolLimits is the flag.Value of -max-nodes: "h100=4,a100=4". Setting it
// replaces the whole map, so a repeated flag means the last one.
type poolLimits map[string]int

func (p *poolLimits) String() string {
	if p == nil {
		return ""
	}
	parts := make([]string, 0, len(*p))
	for _, k := range slices.Sorted(maps.Keys(*p)) {
		parts = append(parts, k+"="+strconv.Itoa((*p)[k]))
	}
	return strings.Join(parts, ",")
}

func (p *poolLimits) Set(s string) error {
	m := map[string]int{}
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		pool, n, ok := strings.Cut(part, "=")
		if !ok {
			return fmt.Errorf("%q: want pool=n", part)
		}
		v, err := strconv.Atoi(strings.TrimSpace(n))
		if err != nil {
			return fmt.Errorf("%q: %w", part, err)
		}
		m[strings.TrimSpace(pool)] = v
	}
	*p = m
	return nil
}
