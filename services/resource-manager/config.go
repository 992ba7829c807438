package resourcemanager

import (
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/resource-manager/internal/ledger"
)

// ServiceName is the default name of the service: its connection name and
// CloudEvents source.
const ServiceName = "resource-manager"

// PlansDurable is the durable consumer every replica shares on PLANS
// (contracts/FLOWS.md); JetStream spreads plans between replicas.
const PlansDurable = "resource-manager-plans"

// Config configures the resource manager.
type Config struct {
	Bus service.BusConfig
	// Name is the connection name and CloudEvents source
	// ("/gpuplane/<name>"); replicas may set their own (e.g. the pod name)
	// to tell their writes apart. Default ServiceName.
	Name string
	// HeartbeatTimeout: a ready node not heard from for this long is
	// declared lost. Default 6 s, three missed 2 s heartbeats.
	HeartbeatTimeout time.Duration
	// LivenessInterval is how often nodes are checked against
	// HeartbeatTimeout and lost nodes swept of live allocations.
	// Default 500 ms; must be below HeartbeatTimeout.
	LivenessInterval time.Duration
	// CommitAttempts bounds the compare-and-set retries of one ledger
	// write that keeps losing to another writer; a plan item that runs
	// out is refused with commit_conflict. Default 8.
	CommitAttempts int
	// CommitParallelism bounds how many nodes of one plan commit at once.
	// Each node's commits wait for their compare-and-set round trip one
	// after the other, so a plan takes about (items / this) round trips
	// when it spans more nodes than this. Default 256: a burst's plans
	// span hundreds of nodes, and a goroutine waiting on an ack is cheap.
	CommitParallelism int
	// ReleaseParallelism bounds how many ended runs the follow of RUNS
	// releases at once (runs_pipeline.go). Each release waits for its
	// compare-and-set round trip; one at a time, in RUNS order, a steady
	// load's releases queued behind one another and held GPUs that had
	// finished. 1 releases one at a time. Default 16: every ledger write
	// waits its turn in ALLOCATIONS' one ingest queue, so 64 releases in
	// flight put up to 64 round trips ahead of each plan item's commit
	// (under BenchmarkSteadyLoad at 1,000 jobs/s plan→committed p99 went
	// from 1.1-1.2 s to 0.4-1.1 s at 16; 16 round trips of a few
	// milliseconds still release thousands of runs a second).
	ReleaseParallelism int
	// PlanWorkers is how many plans are handled at once. A plan's items
	// commit concurrently across its nodes, but one plan at a time made a
	// steady load's plans queue behind one another's compare-and-set round
	// trips. Plans are independent (every item is verified under its
	// node's writer lock against the latest ledger, and the stream drops a
	// second commit of one allocation by its message ID), so their order
	// does not matter. Default 64; 1 handles them one at a time. The bus
	// gives each plan to the worker its stream sequence hashes to, busy or
	// not: with 8, a plan landed behind another's slowest node a third of
	// the time (waits of up to 1.3 s before its handling began under
	// BenchmarkSteadyLoad at 1,000 jobs/s); a worker is a goroutine.
	PlanWorkers int
	// PlanBatch is how many plans a replica pulls at once. Small, so that
	// replicas share a burst rather than one taking it all. Default 32.
	PlanBatch int
	// LeaseTTL is how long the leader's lease (contracts.LeaseKeyResource
	// Manager) lasts unrenewed: only the lease holder consumes plans, writes
	// the ledger and decides node lifecycle; the other replicas wait, then
	// rebuild from the streams and take over at most LeaseTTL after the
	// leader dies or freezes. 0 runs without election: every replica is
	// active and the ledger's compare-and-set alone keeps their writes
	// exclusive. Default 10 s: longer than the election that follows a
	// NATS server's death (4 to 9 s after a SIGKILL), during which the
	// lease cannot be renewed; a 3 s lease made every such death a
	// failover and a rebuild of the whole ledger.
	LeaseTTL time.Duration
	// SnapshotInterval is how often the leader writes its snapshot of
	// ALLOCATIONS and RUNS (snapshot.go), also once a term is ready and
	// after every 200,000 messages read; a term starts from the last one.
	// 0 turns snapshots off (both streams are read whole). Default 1m.
	SnapshotInterval time.Duration
	// PlanMaxAge is the age past which a plan item not yet committed is
	// refused (plan_expired), by the ledger's clock; ended allocations and
	// refusals are remembered that long plus ClockSkew, then forgotten, so
	// memory does not grow with history. Default contracts.PlansMaxAge,
	// the age PLANS keeps a plan: a plan that old is gone from the stream
	// anyway. ClockSkew is the margin for the NATS servers' clocks, which
	// date plans, entries and refusals alike (default
	// ledger.DefaultMargin, an hour).
	PlanMaxAge time.Duration
	ClockSkew  time.Duration
	// Now is the clock liveness and entry times read; default time.Now.
	Now func() time.Time
	// Failpoint arms a crash drill (failpoint.go); DefaultConfig reads it
	// from GPUPLANE_FAILPOINT. "" (the default) arms none.
	Failpoint Failpoint
}

// DefaultConfig returns the defaults, with the bus settings from the
// environment (service.DefaultBusConfig).
func DefaultConfig() Config {
	return Config{
		Bus:                service.DefaultBusConfig(),
		Name:               ServiceName,
		HeartbeatTimeout:   6 * time.Second,
		LivenessInterval:   500 * time.Millisecond,
		CommitAttempts:     8,
		CommitParallelism:  256,
		ReleaseParallelism: 16,
		PlanWorkers:        64,
		PlanBatch:          32,
		LeaseTTL:           10 * time.Second,
		SnapshotInterval:   time.Minute,
		PlanMaxAge:         contracts.PlansMaxAge,
		ClockSkew:          ledger.DefaultMargin,
		Now:                time.Now,
		Failpoint:          failpointFromEnv(),
	}
}

// RegisterFlags adds the resource manager's flags (and the bus flags) to
// fs, defaulting to c's values.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	c.Bus.RegisterFlags(fs)
	fs.StringVar(&c.Name, "name", c.Name, "connection name and CloudEvents source of this replica")
	fs.DurationVar(&c.HeartbeatTimeout, "heartbeat-timeout", c.HeartbeatTimeout, "declare a node lost after this long without a heartbeat")
	fs.DurationVar(&c.LivenessInterval, "liveness-interval", c.LivenessInterval, "how often node liveness is checked")
	fs.IntVar(&c.CommitParallelism, "commit-parallelism", c.CommitParallelism, "nodes of one plan committed concurrently")
	fs.IntVar(&c.PlanWorkers, "plan-workers", c.PlanWorkers, "plans handled at once (1: one at a time)")
	fs.IntVar(&c.ReleaseParallelism, "release-parallelism", c.ReleaseParallelism, "ended runs released concurrently (1: one at a time)")
	fs.IntVar(&c.CommitAttempts, "commit-attempts", c.CommitAttempts, "compare-and-set attempts of one ledger write before giving up")
	fs.IntVar(&c.PlanBatch, "plan-batch", c.PlanBatch, "plans pulled at once by this replica")
	fs.DurationVar(&c.SnapshotInterval, "snapshot-interval", c.SnapshotInterval, "how often the leader snapshots its ledger for a fast restart (0: off, every start reads the streams whole)")
	fs.DurationVar(&c.PlanMaxAge, "plan-max-age", c.PlanMaxAge, "refuse items of older plans (plan_expired); ended allocations are remembered this long plus -clock-skew")
	fs.DurationVar(&c.ClockSkew, "clock-skew", c.ClockSkew, "how far the NATS servers' clocks may disagree: ended allocations are kept this much longer than -plan-max-age")
	fs.DurationVar(&c.LeaseTTL, "lease-ttl", c.LeaseTTL, "leader lease duration: one replica leads, a standby takes over at most this long after it dies (0: no election, every replica active)")
}

// Validate reports every problem of c at once. A nil Now is allowed and
// means time.Now; a zero PlanMaxAge means contracts.PlansMaxAge.
func (c Config) Validate() error {
	var errs []error
	if err := c.Bus.Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := contracts.ValidateID(c.Name); err != nil {
		errs = append(errs, fmt.Errorf("name: %w", err))
	}
	if c.HeartbeatTimeout <= 0 {
		errs = append(errs, fmt.Errorf("heartbeat timeout is %s; want > 0", c.HeartbeatTimeout))
	}
	switch {
	case c.LivenessInterval <= 0:
		errs = append(errs, fmt.Errorf("liveness interval is %s; want > 0", c.LivenessInterval))
	case c.HeartbeatTimeout > 0 && c.LivenessInterval >= c.HeartbeatTimeout:
		errs = append(errs, fmt.Errorf("liveness interval %s is not below the heartbeat timeout %s", c.LivenessInterval, c.HeartbeatTimeout))
	}
	if c.CommitParallelism < 1 {
		errs = append(errs, fmt.Errorf("commit parallelism is %d; want >= 1", c.CommitParallelism))
	}
	if c.PlanWorkers < 1 {
		errs = append(errs, fmt.Errorf("plan workers is %d; want >= 1", c.PlanWorkers))
	}
	if c.ReleaseParallelism < 1 {
		errs = append(errs, fmt.Errorf("release parallelism is %d; want >= 1", c.ReleaseParallelism))
	}
	if c.CommitAttempts < 1 {
		errs = append(errs, fmt.Errorf("commit attempts is %d; want >= 1", c.CommitAttempts))
	}
	if c.LeaseTTL != 0 && (c.LeaseTTL < 30*time.Millisecond || c.LeaseTTL > time.Minute) {
		errs = append(errs, fmt.Errorf("lease ttl is %s; want 0 (no election) or 30ms to 1m", c.LeaseTTL))
	}
	if c.SnapshotInterval < 0 {
		errs = append(errs, fmt.Errorf("snapshot interval is %s; want >= 0", c.SnapshotInterval))
	}
	if c.PlanMaxAge < 0 || (c.PlanMaxAge > 0 && c.PlanMaxAge < time.Second) {
		errs = append(errs, fmt.Errorf("plan max age is %s; want 0 (the default, %s) or >= 1s", c.PlanMaxAge, contracts.PlansMaxAge))
	}
	if c.ClockSkew <= 0 {
		// 0 would read every date as its stamp, and a writer's own date
		// (the latest stamp it saw, a little earlier) would differ from
		// every replica's.
		errs = append(errs, fmt.Errorf("clock skew is %s; want > 0", c.ClockSkew))
	}
	if c.PlanBatch < 1 {
		errs = append(errs, fmt.Errorf("plan batch is %d; want >= 1", c.PlanBatch))
	}
	if err := c.Failpoint.validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
