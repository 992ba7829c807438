package scheduler

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

// Config configures the scheduler.
type Config struct {
	// Bus is the NATS connection and tracing shared by every service.
	Bus service.BusConfig
	// Name is the scheduler's ID: its plans go to gp.plans.<Name> and it
	// is the bus connection's name. Default "scheduler".
	Name string
	// CycleInterval is the least time between the starts of two cycles:
	// facts arriving faster are coalesced into one cycle. Default 5 ms.
	CycleInterval time.Duration
	// CycleRest is how long, in multiples of a cycle's own duration, the
	// scheduler waits after it before the next one starts (at most
	// maxCycleRest; CycleInterval still applies): a cycle's work grows
	// with the cluster and with the jobs waiting, and back-to-back cycles
	// that place little took the CPU the facts that free GPUs needed.
	// 0 turns it off. Default 1: cycles take at most half the time.
	CycleRest float64
	// DemandInterval is the least time between two PoolDemand publishes of
	// one pool. Default 1 s.
	DemandInterval time.Duration
	// Publishers is how many job events are published concurrently (events
	// of one job always go out in order). Default 16.
	Publishers int
	// ResyncInterval runs a cycle even when no fact arrived, so what only
	// time makes eligible again (a refused node's backoff) is retried.
	ResyncInterval time.Duration
	// IntakeBatch is how many job requests that have arrived are decided
	// before their answers' acks are waited for (the answers share a
	// round trip); a job's own submit and cancel stay in stream order.
	// Default 1024: a burst of 3,000 submits was queued in 0.28-0.52 s
	// instead of 0.66-0.99 s at 256, for 2,818-4,622 jobs/s scheduled
	// instead of 2,717-3,566 (BenchmarkBurst R1, 2 cores; issue 17);
	// steady load at 1,000 jobs/s was unchanged.
	IntakeBatch int
	// MaxPlanBytes bounds one plan message; a cycle that places more splits
	// its plan. The PLANS stream refuses messages over 128 KiB. Default
	// 96 KiB.
	MaxPlanBytes int
	// LeaseTTL is how long a leader's lease lasts unrenewed (renewed every
	// third of it). Replicas sharing Name elect one leader; a standby takes
	// over at most LeaseTTL after a leader dies. Default 3 s.
	LeaseTTL time.Duration
	// RebuildTimeout bounds a new leader's rebuild: one that has not
	// rebuilt its state from the streams by then steps down (releases the
	// lease, so a standby takes over) and contends again after a lease
	// TTL, with the bound doubled for each step-down in a row (up to 64
	// times), so a state that is merely large still gets rebuilt. 0 means
	// five lease TTLs (15 s with the default TTL).
	RebuildTimeout time.Duration
	// Policy is the placement policy of pools without a PoolConfig in
	// the gp-pools bucket.
	Policy contracts.PlacementPolicy
	// AllowHostCommands lets pools without a runtime policy of their own
	// (PoolConfig.Runtime in gp-pools) run host commands: jobs without
	// an image, run as the node agent's user. Default false: such pools
	// run container images only. `make run`'s all-in-one sets it.
	AllowHostCommands bool
	// PreemptGrace is a preempted or drained job's time to checkpoint
	// and exit before it is killed.
	PreemptGrace time.Duration
	// MinRuntime protects a started job from preemption for this long.
	MinRuntime time.Duration
	// MaxReservations bounds the backfill reservations of one cycle.
	MaxReservations int
	// CheckpointTimeout bounds the wait for the checkpoint a moved job is
	// asked for before it is stopped anyway.
	CheckpointTimeout time.Duration
	// RetainEnded and RetainEndedMax bound how long, and how many, ended
	// jobs stay whole in memory before only a small record of each is
	// kept (state/retention.go): memory does not grow with history.
	RetainEnded    time.Duration
	RetainEndedMax int
	// RememberEnded is how long that record is kept after the job ended
	// (0: for ever). Past it the job is read back from JOB_EVENTS when a
	// submit names it (state/recall.go), so memory is the records of the
	// last RememberEnded, whatever the history. At least 2×PlansMaxAge: a
	// late commit must still find its ended job.
	RememberEnded time.Duration
	// SnapshotInterval is how often the leader writes its snapshot of the
	// log (snapshot.go) when the log moved; 0 writes none (and ignores one
	// at start).
	SnapshotInterval time.Duration

	// retireEvery is how often ended jobs are retired (default 5s; tests
	// make it shorter).
	retireEvery time.Duration
	// shortMemory lets a test forget ended jobs in milliseconds.
	shortMemory bool
	// recalled, when set (tests only), sees each job read back from the
	// log (intake.go's readJob).
	recalled func(key string, r state.Recalled)
	// rebuildHook, when set (tests only), runs at the start of each
	// rebuild with its bounded context, to stand in for a rebuild that
	// does not finish.
	rebuildHook func(ctx context.Context) error
	// snapshotWritten, when set (tests and benchmarks), is called after
	// each snapshot written.
	snapshotWritten func(state.SnapshotMeta)
}

// DefaultConfig returns the defaults, with the bus settings from the
// environment (service.DefaultBusConfig).
func DefaultConfig() Config {
	return Config{
		Bus:               service.DefaultBusConfig(),
		Name:              "scheduler",
		CycleInterval:     5 * time.Millisecond,
		CycleRest:         1,
		DemandInterval:    time.Second,
		Publishers:        16,
		IntakeBatch:       1024,
		ResyncInterval:    time.Second,
		MaxPlanBytes:      96 * 1024,
		LeaseTTL:          3 * time.Second,
		Policy:            contracts.PolicyFragAware,
		PreemptGrace:      30 * time.Second,
		MinRuntime:        time.Minute,
		MaxReservations:   4,
		CheckpointTimeout: 30 * time.Second,
		RetainEnded:       10 * time.Minute,
		RetainEndedMax:    20_000,
		RememberEnded:     7 * 24 * time.Hour,
		SnapshotInterval:  time.Minute,
	}
}

// RegisterFlags adds the scheduler's flags to fs, defaulting to c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	c.Bus.RegisterFlags(fs)
	fs.StringVar(&c.Name, "name", c.Name, "scheduler ID: plans go to gp.plans.<name>")
	fs.DurationVar(&c.CycleInterval, "cycle-interval", c.CycleInterval, "least time between two scheduling cycles")
	fs.Float64Var(&c.CycleRest, "cycle-rest", c.CycleRest, "wait after a cycle, in multiples of its duration, before the next (0: none)")
	fs.DurationVar(&c.DemandInterval, "demand-interval", c.DemandInterval, "least time between two demand publishes of one pool")
	fs.IntVar(&c.Publishers, "publishers", c.Publishers, "job events published concurrently (per-job order is kept)")
	fs.DurationVar(&c.ResyncInterval, "resync-interval", c.ResyncInterval, "a cycle at least this often, even with no new fact")
	fs.IntVar(&c.IntakeBatch, "intake-batch", c.IntakeBatch, "job requests decided before their answers are awaited together (per-job order is kept)")
	fs.DurationVar(&c.LeaseTTL, "lease-ttl", c.LeaseTTL, "leader lease duration; a standby takes over at most this long after the leader dies")
	fs.DurationVar(&c.RebuildTimeout, "rebuild-timeout", c.RebuildTimeout,
		"a new leader that has not rebuilt its state within this long gives the lease up and tries again later (0: five lease TTLs)")
	fs.Func("policy", "placement policy of pools without a gp-pools entry: binpack, spread, topology or fragaware (default "+string(c.Policy)+")",
		func(v string) error {
			c.Policy = contracts.PlacementPolicy(v)
			return nil
		})
	fs.BoolVar(&c.AllowHostCommands, "allow-host-commands", c.AllowHostCommands,
		"pools without a runtime policy of their own (gp-pools) run host commands too, not only container images")
	fs.DurationVar(&c.PreemptGrace, "preempt-grace", c.PreemptGrace, "a preempted or drained job's time to checkpoint and exit before it is killed")
	fs.DurationVar(&c.MinRuntime, "min-runtime", c.MinRuntime, "a started job is not preempted before it ran this long")
	fs.DurationVar(&c.CheckpointTimeout, "checkpoint-timeout", c.CheckpointTimeout, "how long a moved job's requested checkpoint is waited for before it is stopped anyway")
	fs.IntVar(&c.MaxReservations, "max-reservations", c.MaxReservations, "backfill reservations per cycle (0: no backfill protection)")
	fs.IntVar(&c.MaxPlanBytes, "max-plan-bytes", c.MaxPlanBytes, "largest plan message; larger cycles split their plan")
	fs.DurationVar(&c.RetainEnded, "retain-ended", c.RetainEnded, "how long an ended job stays whole in memory before only a record of it is kept")
	fs.IntVar(&c.RetainEndedMax, "retain-ended-max", c.RetainEndedMax, "at most this many ended jobs stay whole in memory")
	fs.DurationVar(&c.RememberEnded, "remember-ended", c.RememberEnded,
		"how long the record of an ended job is kept after its end; later, a submit naming it reads it from JOB_EVENTS (0: for ever; at least 48h)")
	fs.DurationVar(&c.SnapshotInterval, "snapshot-interval", c.SnapshotInterval, "how often the leader writes its snapshot of the streams (0: none)")
}

// maxPlanLimit leaves room under the PLANS stream's message limit for
// headers and the plan's own fields.
const maxPlanLimit = 2*contracts.MaxMessageBytes - 8*1024

// Validate reports every problem at once.
func (c Config) Validate() error {
	errs := []error{c.Bus.Validate()}
	if err := contracts.ValidateID(c.Name); err != nil {
		errs = append(errs, fmt.Errorf("name: %w", err))
	}
	if c.CycleInterval <= 0 || c.CycleInterval > time.Minute {
		errs = append(errs, fmt.Errorf("cycle interval is %s; want more than 0 and at most 1m", c.CycleInterval))
	}
	if !(c.CycleRest >= 0 && c.CycleRest <= 100) {
		errs = append(errs, fmt.Errorf("cycle rest is %g; want 0 to 100 times a cycle's duration", c.CycleRest))
	}
	if c.DemandInterval <= 0 {
		errs = append(errs, fmt.Errorf("demand interval is %s; want more than 0", c.DemandInterval))
	}
	if c.ResyncInterval <= 0 {
		errs = append(errs, fmt.Errorf("resync interval is %s; want > 0", c.ResyncInterval))
	}
	if c.IntakeBatch < 1 || c.IntakeBatch > 1024 {
		errs = append(errs, fmt.Errorf("intake batch is %d; want 1 to 1024", c.IntakeBatch))
	}
	if c.Publishers < 1 || c.Publishers > 1024 {
		errs = append(errs, fmt.Errorf("publishers is %d; want 1 to 1024", c.Publishers))
	}
	if c.MaxPlanBytes < 4*1024 || c.MaxPlanBytes > maxPlanLimit {
		errs = append(errs, fmt.Errorf("max plan bytes is %d; want 4096 to %d", c.MaxPlanBytes, maxPlanLimit))
	}
	if !c.Policy.Valid() {
		errs = append(errs, fmt.Errorf("policy is %q; want one of %v", c.Policy, contracts.PlacementPolicies))
	}
	if c.PreemptGrace < 0 || c.MinRuntime < 0 || c.MaxReservations < 0 || c.CheckpointTimeout < 0 {
		errs = append(errs, fmt.Errorf("preempt grace, min runtime, max reservations and checkpoint timeout must not be negative"))
	}
	if c.RememberEnded < 0 || (c.RememberEnded != 0 && c.RememberEnded < 2*contracts.PlansMaxAge && !c.shortMemory) {
		errs = append(errs, fmt.Errorf("remember ended is %s; want 0 (for ever) or at least %s (twice the plans' life: a late commit must find its job)",
			c.RememberEnded, 2*contracts.PlansMaxAge))
	}
	if c.RebuildTimeout < 0 {
		errs = append(errs, fmt.Errorf("rebuild timeout is %s; want 0 (five lease TTLs) or more", c.RebuildTimeout))
	}
	if c.LeaseTTL < 30*time.Millisecond || c.LeaseTTL > time.Minute {
		errs = append(errs, fmt.Errorf("lease ttl is %s; want 30ms to 1m", c.LeaseTTL))
	}
	return errors.Join(errs...)
}

// rebuildBound is the rebuild bound of a term that follows stepDowns
// step-downs in a row: RebuildTimeout (or five lease TTLs), doubled for
// each, at most 64 times.
func (c Config) rebuildBound(stepDowns int) time.Duration {
	base := c.RebuildTimeout
	if base <= 0 {
		base = 5 * c.LeaseTTL
	}
	return base << min(max(stepDowns, 0), 6)
}
