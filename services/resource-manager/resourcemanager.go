// Package resourcemanager is gpuplane's single serialization point for GPU
// placement. It verifies each item of a scheduler's plan against the latest
// allocation ledger and commits it with a compare-and-set on the node's
// ledger subject, releases allocations when their run ends or their node is
// lost, and decides node lifecycle (registered, lost, returned) from
// inventories and heartbeats. See README.md for the pipeline.
//
// Everything it knows is rebuilt from the streams at start (ALLOCATIONS,
// NODES, RUNS). Replicas are active/standby on a lease
// (contracts.LeaseKeyResourceManager): only the holder consumes plans,
// writes the ledger and decides node lifecycle; a standby takes over at
// most LeaseTTL after the leader stops renewing, rebuilding from the
// streams as a restart does. Fencing, so that a frozen ex-leader that
// thaws cannot act on what it knew: every ledger and lifecycle publish is
// made only while the term is valid on the leader's own, conservative
// clock (checked under the node lock right before the publish), and every
// ledger write is a compare-and-set on the node's subject, so a write
// that slipped past that check is refused by JetStream as soon as the new
// leader has written to the node, and otherwise was verified against
// everything the node's subject holds. With LeaseTTL 0 every replica is
// active and the compare-and-set alone keeps their writes exclusive.
package resourcemanager

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/lease"
	"github.com/gpuplane/gpuplane/libs/recset"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/resource-manager/internal/ledger"
	"github.com/gpuplane/gpuplane/services/resource-manager/internal/liveness"
)

// Run runs the resource manager until ctx ends; it returns nil on a clean
// shutdown. It validates cfg, connects the bus (provisioning the streams),
// rebuilds its state from the streams, and only then consumes plans.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("%s: invalid config: %w", ServiceName, err)
	}
	rt, err := service.Start(ctx, cfg.Name, cfg.Bus, log)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer rt.Close()
	if cfg.LeaseTTL == 0 {
		if err := newServer(cfg, rt.Bus, rt.Log).run(ctx); err != nil && ctx.Err() == nil {
			return fmt.Errorf("%s: %w", ServiceName, err)
		}
		return nil
	}
	kv, err := rt.Bus.KeyValue(ctx, contracts.BucketLeases)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("%s: %w", ServiceName, err)
	}
	holder := cfg.Name + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	elector, err := lease.New(lease.Config{KV: kv, Key: contracts.LeaseKeyResourceManager,
		Holder: holder, TTL: cfg.LeaseTTL, Log: rt.Log})
	if err != nil {
		return fmt.Errorf("%s: %w", ServiceName, err)
	}
	rt.Log.Info("standby: contending for the lease", "key", contracts.LeaseKeyResourceManager, "holder", holder)
	// Each term is a fresh server rebuilt from the streams: nothing a
	// deposed term knew leaks into the next.
	err = elector.Run(ctx, func(ctx context.Context, term lease.Term) error {
		s := newServer(cfg, rt.Bus, rt.Log.With("epoch", term.Epoch))
		s.term = term
		return s.run(ctx)
	})
	if err != nil && ctx.Err() == nil {
		return fmt.Errorf("%s: %w", ServiceName, err)
	}
	return nil
}

// fence is the leadership term a server acts under.
type fence interface {
	Valid() bool
}

// errDeposed: this server's lease term is over; it publishes nothing
// more.
var errDeposed = errors.New("lease term over: a deposed leader writes nothing")

// leading reports whether this server may publish now: always without a
// lease, while its term is valid with one.
func (s *server) leading() bool { return s.term == nil || s.term.Valid() }

// server is one running resource manager.
//
// Locks, always taken in this order: lifeMu (node lifecycle: decide,
// publish, apply), then a node's lock (one ledger writer per node in this
// process, held across verify, publish and apply), then mu (the in-memory
// state, never held across a network call).
type server struct {
	cfg Config
	bus *bus.Bus
	log *slog.Logger
	// term is the lease term this server leads under; nil without
	// election (LeaseTTL 0).
	term fence

	lifeMu  sync.Mutex
	tracker *liveness.Tracker
	// nodesSeq is, per node, the NODES sequence of its last message read
	// in stream order (rebuild, follow or catch-up): a message at or below
	// it was applied already. Guarded by lifeMu.
	nodesSeq map[string]uint64
	// hbSeq is the HEARTBEATS sequence of the last heartbeat the feed
	// delivered (judgeFeed). Guarded by lifeMu.
	hbSeq uint64
	// hbStart is the HEARTBEATS sequence the feed started after.
	hbStart uint64
	// lagSince is when judgeFeed first found the stream holding
	// heartbeats the feed had not delivered, in the current stretch of
	// such findings (zero: the feed is not behind). Guarded by lifeMu.
	lagSince time.Time
	// refeed asks heartbeatFeed for a new consumer (feed.go).
	refeed chan struct{}

	mu        sync.Mutex
	led       *ledger.Ledger
	started   map[string]time.Time // live allocation ID -> its run's start
	nodeLocks map[string]*nodeLock
	// refused holds the RefusalIDs in ALLOCATIONS, hashed (refusalHash,
	// 16 bytes each), dated by the refusal's time: a plan item refused
	// once stays refused when the plan is redelivered, and a snapshot
	// shares views of its records instead of copying under mu. Like the
	// ledger's retired records, one is forgotten once its plan would be
	// refused as expired anyway (planExpired).
	refused *recset.Window
	// epochs is the highest fencing epoch seen per scheduler (leases.go).
	epochs map[string]uint64
	// allocSeq is the ALLOCATIONS sequence up to which every ledger entry
	// and refusal is applied (the in-order read's position); runsSeq the
	// RUNS sequence of the last run fact fully handled. What a snapshot
	// covers (snapshot.go).
	allocSeq, runsSeq uint64
	// runsHandled is the RUNS sequence of the last run fact the follow
	// handed over; runsReleasing the sequences of ended runs whose
	// release is still being written (runs_pipeline.go): runsSeq stays
	// below the first of them.
	runsHandled   uint64
	runsReleasing map[uint64]struct{}
	// releases bounds the releases written at once (ReleaseParallelism).
	releases chan struct{}
	// planGate keeps plans of one job from being decided at once.
	planGate jobGate
	// sinceSnapshot counts the messages of both read since the last
	// snapshot was written; snapLoaded says this term started from one.
	sinceSnapshot int
	snapLoaded    bool
	// stampSeen is the latest stream stamp seen, unix ns (observe).
	stampSeen atomic.Int64
}

func newServer(cfg Config, b *bus.Bus, log *slog.Logger) *server {
	if cfg.PlanMaxAge <= 0 {
		cfg.PlanMaxAge = contracts.PlansMaxAge
	}
	if cfg.ClockSkew <= 0 {
		cfg.ClockSkew = ledger.DefaultMargin
	}
	keep := ledger.Keep(cfg.PlanMaxAge, cfg.ClockSkew)
	return &server{
		cfg: cfg, bus: b, log: log,
		tracker:   liveness.New(cfg.HeartbeatTimeout),
		nodesSeq:  map[string]uint64{},
		led:       ledger.New(keep),
		started:   map[string]time.Time{},
		nodeLocks: map[string]*nodeLock{},
		refused:   recset.NewWindow(refusalKeySize, keep),
		epochs:    map[string]uint64{},
		refeed:    make(chan struct{}, 1),

		runsReleasing: map[uint64]struct{}{},
		releases:      make(chan struct{}, max(cfg.ReleaseParallelism, 1)),
	}
}

// lockNode takes the node's writer lock and returns its unlock; urgent (a
// commit) goes before the releases waiting for it (nodelock.go).
func (s *server) lockNode(node string, urgent bool) func() {
	s.mu.Lock()
	l, ok := s.nodeLocks[node]
	if !ok {
		l = newNodeLock()
		s.nodeLocks[node] = l
	}
	s.mu.Unlock()
	l.lock(urgent)
	return l.unlock
}

// run rebuilds, then runs the follows, the liveness loop and the plan
// consumer until ctx ends.
// allocSubjects filter what the resource manager reads of ALLOCATIONS:
// nothing, since the stream (gp.alloc.>) holds only the ledger and the
// refusals (final answers a redelivered plan must respect), and
// onAllocMsg skips any other subject. Filtering on those two families made
// the server match every stored message's subject against both for each
// message delivered (most of a full rebuild's CPU at 100k jobs, more per
// job the more nodes the ledger spans).
var allocSubjects []string

func (s *server) run(ctx context.Context) error {
	// 0. The snapshot, when there is a usable one: ALLOCATIONS and RUNS
	// are then read only after what it covers.
	snaps := s.startSnapshots(ctx)
	s.mu.Lock()
	allocStart, runsStart := s.allocSeq, s.runsSeq
	s.mu.Unlock()
	// 1. The ledger, recording each node's last subject sequence.
	allocSeq, err := s.bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamAllocations,
		FilterSubjects: allocSubjects, StartSeq: allocStart + 1}, s.onAllocMsg)
	if err != nil {
		return fmt.Errorf("rebuild ledger: %w", err)
	}
	allocSeq = max(allocSeq, allocStart)
	// 2. Inventories and lifecycle events: replayed, nothing published.
	nodesSeq, err := s.bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamNodes,
		FilterSubjects: nodeSubjects}, func(ctx context.Context, m *bus.Msg) error {
		s.onNodesMsg(ctx, m, false)
		return nil
	})
	if err != nil {
		return fmt.Errorf("rebuild nodes: %w", err)
	}
	s.mu.Lock()
	live := 0
	for _, n := range s.led.Nodes() {
		live += s.led.LiveCount(n)
	}
	s.mu.Unlock()
	s.log.Info("ledger and nodes rebuilt", "ledger_seq", allocSeq, "nodes_seq", nodesSeq,
		"nodes", len(s.tracker.Nodes()), "live_allocations", live, "from_snapshot", s.snapLoaded)

	g, gctx := errgroup.WithContext(ctx)
	// Entries other replicas write, and our own seen again (no-ops).
	g.Go(func() error {
		return s.bus.Follow(gctx, bus.FollowSpec{Stream: contracts.StreamAllocations,
			FilterSubjects: allocSubjects, StartSeq: allocSeq + 1}, s.onAllocMsg, nil)
	})
	g.Go(func() error {
		return s.bus.Follow(gctx, bus.FollowSpec{Stream: contracts.StreamNodes,
			FilterSubjects: nodeSubjects, StartSeq: nodesSeq + 1}, func(ctx context.Context, m *bus.Msg) error {
			s.onNodesMsg(ctx, m, true)
			return nil
		}, nil)
	})
	// Only heartbeats from now on: a restarted manager gives every node a
	// fresh grace period instead of judging it by old heartbeats. The feed
	// starts right after the stream's last heartbeat now, so that every
	// heartbeat stored later is either delivered or seen missing by
	// judgeFeed.
	hbStart, err := s.heartbeatsLastSeq(ctx)
	if err != nil {
		return err
	}
	s.lifeMu.Lock()
	s.hbSeq, s.hbStart = hbStart, hbStart
	s.lifeMu.Unlock()
	g.Go(func() error { return s.heartbeatFeed(gctx, hbStart+1) })
	// 3. Run facts from the start: an ended run whose release a previous
	// life did not write is released now, before any plan is handled.
	// WatchKV calls ready once, even when a broken watch is resumed.
	leasesKnown := make(chan struct{})
	g.Go(func() error { return s.watchLeases(gctx, func() { close(leasesKnown) }) })
	adminKnown := make(chan struct{})
	g.Go(func() error { return s.watchNodeAdmin(gctx, func() { close(adminKnown) }) })
	runsCaughtUp := make(chan struct{})
	g.Go(func() error {
		return s.bus.Follow(gctx, bus.FollowSpec{Stream: contracts.StreamRuns,
			StartSeq: runsStart + 1}, s.runFactHandler(gctx), func() { close(runsCaughtUp) })
	})
	g.Go(func() error {
		for _, c := range []chan struct{}{runsCaughtUp, leasesKnown, adminKnown} {
			select {
			case <-c:
			case <-gctx.Done():
				return nil
			}
		}
		// The releases of the runs that ended before are stored before
		// the first plan, as when the follow wrote them one at a time.
		s.releasesDone(gctx)
		s.lifeMu.Lock()
		s.tracker.Grace(s.cfg.Now())
		s.lifeMu.Unlock()
		// Owed registrations and lost nodes still holding allocations are
		// settled before the first plan.
		s.checkLiveness(gctx)
		s.log.Info("ready: consuming plans")
		lg, lctx := errgroup.WithContext(gctx)
		lg.Go(func() error { return s.runSnapshots(lctx, snaps) })
		lg.Go(func() error { return s.livenessLoop(lctx) })
		lg.Go(func() error {
			return s.bus.Consume(lctx, bus.ConsumerSpec{
				Stream: contracts.StreamPlans, Durable: PlansDurable,
				FilterSubjects: []string{contracts.SubjectPlansAll},
				Batch:          s.cfg.PlanBatch,
				// Plans are handled PlanWorkers at once, each its own key
				// (config.go: their order does not matter).
				Workers: s.cfg.PlanWorkers,
				Key:     planKey,
				// A plan dead-lettered is a scheduler waiting forever for
				// an answer: retry transient failures for a long time.
				MaxDeliver: 1000,
			}, s.onPlanMsg)
		})
		return lg.Wait()
	})
	return g.Wait()
}

// heartbeatsLastSeq is the HEARTBEATS stream's last sequence, retried
// until ctx ends while the stream has no leader.
func (s *server) heartbeatsLastSeq(ctx context.Context) (uint64, error) {
	delay := 50 * time.Millisecond
	for {
		// Each try has its own bound: a request that went to a server
		// dying with it is never answered.
		sctx, cancel := context.WithTimeout(ctx, probeTimeout)
		stream, err := s.bus.JetStream().Stream(sctx, contracts.StreamHeartbeats)
		cancel()
		if err == nil {
			return stream.CachedInfo().State.LastSeq, nil
		}
		s.log.Warn("heartbeats stream unreadable; retrying", "err", err, "delay", delay)
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("heartbeats stream: %w", err)
		case <-time.After(delay):
		}
		delay = min(delay*2, 2*time.Second)
	}
}

var nodeSubjects = []string{contracts.SubjectInventoryAll, contracts.SubjectNodeLifecycleAll}

// planKey spreads plans over the plan workers: by stream sequence, so a
// redelivered plan goes to the worker its first delivery went to.
func planKey(m *bus.Msg) string { return strconv.FormatUint(m.StreamSeq, 10) }
