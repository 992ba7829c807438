// Package scheduler is gpuplane's scheduler service: it validates job
// requests, keeps the queue, places jobs on GPUs, proposes plans to the
// resource manager and publishes every job event (it is the single writer
// of JOB_EVENTS). See contracts/FLOWS.md for the protocol.
//
//	JOBS ──(durable scheduler-requests)──▶ validate ─▶ queued / rejected / cancelled
//	                                              │
//	NODES, ALLOCATIONS, RUNS ──(ordered follow)──▶ state ──▶ job events, stop commands
//	                                              │ dirty
//	                                              ▼
//	                                        cycle (≤ 1 per CycleInterval)
//	                                              │
//	                          plan ─▶ gp.plans.<name>, demand ─▶ gp.sched.demand.<pool>
//
// At start it rebuilds before it decides anything: JOB_EVENTS (every job's
// state and request), the cancels in JOBS, its own plans in PLANS (what is
// still in flight), then NODES, ALLOCATIONS and RUNS from their beginning.
// Only then does it publish what the rebuilt state owes, consume requests
// and run cycles.
package scheduler

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/lease"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

// RequestsConsumer is the durable consumer of JOBS the scheduler reads
// submits and cancels with.
const RequestsConsumer = "scheduler-requests"

// Run runs the scheduler until ctx ends; it returns nil on a clean
// shutdown and an error when it cannot start or a loop fails.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("scheduler: invalid config: %w", err)
	}
	if log == nil {
		log = slog.Default()
	}
	rt, err := service.Start(ctx, cfg.Name, cfg.Bus, log)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("scheduler: %w", err)
	}
	defer rt.Close()
	kv, err := rt.Bus.KeyValue(ctx, contracts.BucketLeases)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("scheduler: %w", err)
	}
	holder := cfg.Name + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	elector, err := lease.New(lease.Config{KV: kv, Key: contracts.LeaseKeyScheduler(cfg.Name),
		Holder: holder, TTL: cfg.LeaseTTL, Log: rt.Log})
	if err != nil {
		return fmt.Errorf("scheduler: %w", err)
	}
	// Only the leader runs: a standby waits for the lease, then rebuilds
	// from the streams like a restart would. Each term is a fresh
	// scheduler, so nothing of a deposed term's state can leak into the
	// next one. A term whose rebuild does not finish in its bound steps
	// down (lease.ErrStepDown): holding the lease without scheduling
	// would keep a standby that might manage from leading (issue 13,
	// finding 5). Each step-down in a row doubles the next bound (up to
	// 64 times), so a large state still gets rebuilt somewhere.
	stepDowns := 0
	err = elector.Run(ctx, func(ctx context.Context, term lease.Term) error {
		s := newScheduler(cfg, rt.Bus, rt.Log.With("epoch", term.Epoch), term)
		s.rebuildBound = cfg.rebuildBound(stepDowns)
		err := s.run(ctx)
		if errors.Is(err, lease.ErrStepDown) {
			stepDowns++
		} else {
			stepDowns = 0
		}
		return err
	})
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// fence is the leadership term a scheduler acts under.
type fence interface {
	Valid() bool
}

type scheduler struct {
	cfg   Config
	term  fence
	epoch uint64
	bus   *bus.Bus
	log   *slog.Logger
	// deferred are the submits started and not decided yet, in stream
	// order (intake.go; under mu). deciding is set while decideDeferred
	// decides the ones it took: a submit started meanwhile (the intake
	// starts the next group while one settles) joins deferred too, so it
	// is never decided before them.
	deferred []*deferredSubmit
	deciding bool
	wake     chan struct{}
	out      *outbox
	demand   *demandPublisher
	budget   *budgetGate
	// rebuildBound is how long this term's rebuild may take before it
	// steps down.
	rebuildBound time.Duration

	mu sync.Mutex // guards st
	st *state.Store
	// traces remembers each live job's trace (traces.go).
	traces *jobTraces
	// snap folds the streams into the next snapshot (snapshot.go); nil
	// without snapshots.
	snap *snapshotter
}

func newScheduler(cfg Config, b *bus.Bus, log *slog.Logger, term lease.Term) *scheduler {
	boot := strconv.FormatInt(time.Now().UnixNano(), 36)
	s := &scheduler{cfg: cfg, term: term, epoch: term.Epoch, bus: b, log: log, wake: make(chan struct{}, 1),
		rebuildBound: cfg.rebuildBound(0)}
	s.traces = newJobTraces()
	s.out = newOutbox(b, cfg.Publishers, log)
	s.out.traces = s.traces
	s.demand = newDemandPublisher(b, cfg.DemandInterval, cfg.Name, boot, log)
	s.budget = newBudgetGate(b, log)
	s.st = state.New(state.Config{Scheduler: cfg.Name, Boot: boot, MaxPlanBytes: cfg.MaxPlanBytes, Log: log,
		Wake: s.markDirty, Admit: s.budget.Admit, Policy: cfg.Policy, AllowHostCommands: cfg.AllowHostCommands, PreemptGrace: cfg.PreemptGrace,
		MinRuntime: cfg.MinRuntime, MaxReservations: cfg.MaxReservations, CheckpointTimeout: cfg.CheckpointTimeout,
		RetainTerminal: cfg.RetainEnded, RetainTerminalMax: cfg.RetainEndedMax, RememberEnded: cfg.RememberEnded})
	return s
}

// markDirty asks for a cycle. It never blocks: one pending signal is
// enough, the cycle reads the whole state.
func (s *scheduler) markDirty() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *scheduler) run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return s.out.run(ctx) })
	if err := s.rebuild(ctx, g); err != nil {
		cancel() // the outbox and follows run until their context ends
		return errors.Join(err, g.Wait())
	}
	s.mu.Lock()
	s.out.enqueue(s.st.GoLive(), false)
	queued := s.st.Queued()
	s.mu.Unlock()
	s.log.Info("scheduler live", "queued", queued)
	g.Go(func() error { return s.demand.run(ctx) })
	g.Go(func() error { return s.cycles(ctx) })
	g.Go(func() error { return s.followDefrag(ctx) })
	g.Go(func() error {
		return s.bus.Consume(ctx, bus.ConsumerSpec{Stream: contracts.StreamOps, Durable: AlertsConsumer,
			FilterSubjects: []string{contracts.SubjectAlertsAll}}, s.handleAlert)
	})
	// Intake waits for the budget statuses (budget.go).
	budgetsSynced := make(chan struct{})
	g.Go(func() error { return s.budget.run(ctx, func() { close(budgetsSynced) }) })
	g.Go(func() error {
		select {
		case <-ctx.Done():
			return nil
		case <-budgetsSynced:
		}
		return s.consumeRequests(ctx)
	})
	return g.Wait()
}

// rebuild replays what the scheduler itself wrote, then starts following
// the fact streams and returns once they have delivered what they held.
// The follows run under ctx for the whole term; the replays and the wait
// for the follows to catch up are bounded by s.rebuildBound, past which
// rebuild returns lease.ErrStepDown.
func (s *scheduler) rebuild(ctx context.Context, g *errgroup.Group) error {
	start := time.Now()
	bctx, cancel := context.WithTimeout(ctx, s.rebuildBound)
	defer cancel()
	if err := s.rebuildBounded(ctx, bctx, g); err != nil {
		if ctx.Err() == nil && bctx.Err() != nil {
			s.log.Warn("state not rebuilt in time; giving the lease up", "bound", s.rebuildBound, "err", err)
			return fmt.Errorf("rebuild not done within %s: %w", s.rebuildBound, lease.ErrStepDown)
		}
		return err
	}
	s.log.Info("state rebuilt", "took", time.Since(start))
	return nil
}

// rebuildBounded is rebuild's work: ctx is the term's, bctx its bounded
// part.
func (s *scheduler) rebuildBounded(ctx, bctx context.Context, g *errgroup.Group) error {
	if s.cfg.rebuildHook != nil {
		if err := s.cfg.rebuildHook(bctx); err != nil {
			return err
		}
	}
	snap, err := s.startSnapshots(ctx, bctx, g.Go)
	if err != nil {
		return err
	}
	// after is the last sequence applied per stream: the snapshot's, then
	// the replays'. The snapshot's own messages are applied first, with
	// the same code (snapshot.go).
	after := map[string]uint64{}
	byStream := map[string][]*bus.Msg{}
	if snap != nil {
		for name, seq := range snap.Meta.Seqs {
			after[name] = seq
		}
		for _, lm := range snap.Msgs {
			byStream[lm.Stream] = append(byStream[lm.Stream], busMsg(lm))
		}
	}
	replays := []struct {
		spec  bus.FollowSpec
		apply func(*bus.Msg) error
	}{
		{bus.FollowSpec{Stream: contracts.StreamJobEvents}, func(m *bus.Msg) error {
			var ev contracts.JobEvent
			if err := m.Decode(&ev); err != nil {
				return err
			}
			s.st.ReplayJobEvent(ev, m.StreamSeq, m.ID())
			s.traces.replayed(m, ev)
			return nil
		}},
		{bus.FollowSpec{Stream: contracts.StreamJobs, FilterSubjects: []string{contracts.SubjectCancelAll}}, func(m *bus.Msg) error {
			s.st.ReplayCancel(m.Subject, m.Data, m.StreamSeq)
			return nil
		}},
		{bus.FollowSpec{Stream: contracts.StreamPlans, FilterSubjects: []string{contracts.SubjectPlan(s.cfg.Name)}}, func(m *bus.Msg) error {
			var p contracts.Plan
			if err := m.Decode(&p); err != nil {
				return err
			}
			s.st.ReplayPlan(p)
			return nil
		}},
	}
	for _, r := range replays {
		n := 0
		apply := func(m *bus.Msg) {
			s.mu.Lock()
			defer s.mu.Unlock()
			n++
			if err := r.apply(m); err != nil {
				s.log.Warn("skipping undecodable message", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
			}
			// A full replay of a long history retires as it goes, so it
			// never holds every job whole (state/retention.go).
			if n%(1<<16) == 0 {
				s.st.RetireTerminal()
			}
		}
		for _, m := range byStream[r.spec.Stream] {
			apply(m)
		}
		if r.spec.Stream == contracts.StreamJobEvents && snap != nil {
			s.mu.Lock()
			s.st.Restore(snap)
			s.mu.Unlock()
		}
		r.spec.StartSeq = after[r.spec.Stream] + 1
		last, err := s.bus.Replay(bctx, r.spec, func(ctx context.Context, m *bus.Msg) error {
			apply(m)
			s.snap.observe(ctx, m)
			after[r.spec.Stream] = m.StreamSeq
			return nil
		})
		if err != nil {
			return fmt.Errorf("replay %s: %w", r.spec.Stream, err)
		}
		// At info: where a new leader's rebuild ended is what tells a job
		// it forgot from one it never had (the chaos suite's failures are
		// read from these logs).
		s.log.Info("replayed", "stream", r.spec.Stream, "messages", n, "from", r.spec.StartSeq, "through", last)
	}
	s.mu.Lock()
	s.st.RetireTerminal()
	s.mu.Unlock()
	// The dependencies of live jobs that the replay forgot (state/recall.go)
	// are read back before the store decides anything.
	if err := s.recallMissing(bctx, true); err != nil {
		return err
	}
	g.Go(func() error { return s.retireEnded(ctx) })
	if s.snap != nil {
		// The streams the scheduler writes, it does not follow once live:
		// the compactor follows them on from where the replays ended.
		for _, r := range replays {
			g.Go(func() error { return s.followForSnapshot(ctx, r.spec, after[r.spec.Stream]) })
		}
	}

	follows := []struct {
		spec   bus.FollowSpec
		decode func(*bus.Msg) (fact, error)
	}{
		{bus.FollowSpec{Stream: contracts.StreamNodes,
			FilterSubjects: []string{contracts.SubjectInventoryAll, contracts.SubjectNodeLifecycleAll}}, s.nodeFact},
		{bus.FollowSpec{Stream: contracts.StreamAllocations}, s.allocationFact},
		{bus.FollowSpec{Stream: contracts.StreamRuns}, s.runFact},
	}
	caught := make(chan struct{}, len(follows)+len(adminBuckets))
	for _, f := range follows {
		name := f.spec.Stream
		for _, m := range byStream[name] {
			if apply, err := f.decode(m); err == nil {
				s.mu.Lock()
				apply()
				s.mu.Unlock()
			}
		}
		var observe func(*bus.Msg)
		if s.snap != nil && (name == contracts.StreamAllocations || name == contracts.StreamRuns) {
			f.spec.StartSeq = after[name] + 1
			observe = func(m *bus.Msg) { s.snap.observe(ctx, m) }
		}
		g.Go(func() error { return s.follow(ctx, f.spec, f.decode, observe, func() { caught <- struct{}{} }) })
	}
	// Quotas, pool policies and cordons are known before the first cycle:
	// a cycle run blind could admit past a quota or place on a cordoned
	// node.
	for _, bucket := range adminBuckets {
		if _, err := s.bus.KeyValue(bctx, bucket); err != nil {
			return fmt.Errorf("bucket %s: %w", bucket, err)
		}
		g.Go(func() error {
			var once sync.Once
			return s.bus.WatchKV(ctx, bucket, func(e jetstream.KeyValueEntry) {
				s.mu.Lock()
				defer s.mu.Unlock()
				s.applyAdmin(bucket, e)
			}, func() { once.Do(func() { caught <- struct{}{} }) })
		})
	}
	for range len(follows) + len(adminBuckets) {
		select {
		case <-bctx.Done():
			return bctx.Err()
		case <-caught:
		}
	}
	if s.snap != nil {
		// A first snapshot once what the rebuild read is folded: the next
		// start replays from here.
		g.Go(func() error {
			select {
			case s.snap.in <- writeNow:
			case <-ctx.Done():
			}
			return nil
		})
	}
	return nil
}

// follow applies every message of spec, in stream order, for as long as
// ctx lives, resuming after the last applied message if the read breaks.
func (s *scheduler) follow(ctx context.Context, spec bus.FollowSpec, decode func(*bus.Msg) (fact, error),
	observe func(*bus.Msg), caughtUp func()) error {
	var once sync.Once
	var last uint64
	delay := 100 * time.Millisecond
	for {
		if last > 0 {
			spec.StartSeq = last + 1
		}
		err := s.bus.Follow(ctx, spec, func(_ context.Context, m *bus.Msg) error {
			// Decoded before the lock, which the cycle, the intake and
			// the other follows wait for.
			apply, err := decode(m)
			s.mu.Lock()
			if err == nil {
				s.out.enqueue(apply(), false)
			}
			if observe != nil {
				observe(m)
			}
			s.mu.Unlock()
			if err != nil {
				s.log.Warn("skipping undecodable message", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
			}
			last = m.StreamSeq
			return nil
		}, func() { once.Do(caughtUp) })
		if ctx.Err() != nil {
			return nil
		}
		s.log.Warn("follow interrupted; resuming", "stream", spec.Stream, "after_seq", last, "err", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

// adminBuckets are the administrators' KV buckets the scheduler follows.
var adminBuckets = []string{contracts.BucketQuotas, contracts.BucketPools, contracts.BucketNodeAdmin}

// applyAdmin applies one entry of an administrators' bucket. A value that
// does not decode or validate is logged and ignored (the gateway refuses
// such writes; only a hand-edited bucket holds one), keeping the last good
// setting rather than dropping a tenant's quota.
func (s *scheduler) applyAdmin(bucket string, e jetstream.KeyValueEntry) {
	key := e.Key()
	deleted := e.Operation() != jetstream.KeyValuePut
	bad := func(err error) {
		s.log.Warn("ignoring an invalid administrator setting", "bucket", bucket, "key", key, "err", err)
	}
	switch bucket {
	case contracts.BucketQuotas:
		if deleted {
			s.st.ApplyQuota(key, nil)
			return
		}
		var q contracts.TenantQuota
		if err := json.Unmarshal(e.Value(), &q); err != nil {
			bad(err)
			return
		}
		if err := q.Validate(key); err != nil {
			bad(err)
			return
		}
		s.st.ApplyQuota(key, &q)
	case contracts.BucketPools:
		if deleted {
			s.st.ApplyPoolConfig(key, nil)
			return
		}
		var c contracts.PoolConfig
		if err := json.Unmarshal(e.Value(), &c); err != nil {
			bad(err)
			return
		}
		if err := c.Validate(key); err != nil {
			bad(err)
			return
		}
		s.st.ApplyPoolConfig(key, &c)
	case contracts.BucketNodeAdmin:
		if deleted {
			s.st.ApplyNodeAdmin(key, nil)
			return
		}
		// Fail closed, as the resource manager does: a hold nobody can
		// read keeps the node cordoned until it is fixed.
		a, err := contracts.DecodeNodeAdmin(key, e.Value())
		if err != nil {
			bad(err)
		}
		s.st.ApplyNodeAdmin(key, &a)
	}
}

// The apply functions run under s.mu.

// fact is a message of a followed stream, decoded: applying it (under
// the scheduler's lock) changes the store and returns what to publish.
type fact func() []state.Publish

// nodeFact decodes a node's inventory or lifecycle event.
func (s *scheduler) nodeFact(m *bus.Msg) (fact, error) {
	switch {
	case strings.HasPrefix(m.Subject, "gp.nodes.inventory."):
		var inv contracts.NodeInventory
		if err := m.Decode(&inv); err != nil {
			return nil, err
		}
		return func() []state.Publish { s.st.ApplyInventory(inv); return nil }, nil
	case strings.HasPrefix(m.Subject, "gp.nodes.lifecycle."):
		var ev contracts.NodeEvent
		if err := m.Decode(&ev); err != nil {
			return nil, err
		}
		return func() []state.Publish { s.st.ApplyNodeEvent(ev); return nil }, nil
	}
	return func() []state.Publish { return nil }, nil
}

// allocationFact decodes a ledger entry or a refusal.
func (s *scheduler) allocationFact(m *bus.Msg) (fact, error) {
	switch {
	case strings.HasPrefix(m.Subject, "gp.alloc.ledger."):
		var e contracts.LedgerEntry
		if err := m.Decode(&e); err != nil {
			return nil, err
		}
		return func() []state.Publish { return s.st.ApplyLedger(e) }, nil
	case strings.HasPrefix(m.Subject, "gp.alloc.refused."):
		var r contracts.Refusal
		if err := m.Decode(&r); err != nil {
			return nil, err
		}
		return func() []state.Publish {
			if s.st.Live() {
				s.log.Info("plan item refused", "tenant", r.Tenant, "job_id", r.JobID, "node_id", r.NodeID,
					"plan", r.PlanID, "reason", r.Reason)
			}
			return s.st.ApplyRefusal(r)
		}, nil
	}
	return func() []state.Publish { return nil }, nil
}

// runFact decodes an agent's run fact.
func (s *scheduler) runFact(m *bus.Msg) (fact, error) {
	var r contracts.RunEvent
	if err := m.Decode(&r); err != nil {
		return nil, err
	}
	return func() []state.Publish { return s.st.ApplyRun(r) }, nil
}

// requestKey is the job a request is about (tenant token and job ID), so
// parallel intake keeps one job's submit and cancel in stream order. A body
// that does not even name a job keys on its subject: its order matters to
// nobody.
func requestKey(m *bus.Msg) string {
	var ids struct {
		ID    string `json:"id"`
		JobID string `json:"jobId"`
	}
	tenant := contracts.Token(m.Subject, 3)
	if json.Unmarshal(m.Data, &ids) != nil {
		return m.Subject
	}
	return tenant + "/" + ids.ID + ids.JobID
}

// handleRequest handles one message of the durable consumer. It returns
// nil (ack) only once what the request owes is published.
func (s *scheduler) handleRequest(ctx context.Context, m *bus.Msg) error {
	var err error
	switch {
	case isSubmit(m.Subject):
		err = s.submit(ctx, m)
	case strings.HasPrefix(m.Subject, "gp.jobs.cancel."):
		err = s.cancel(ctx, m)
	default:
		return bus.Permanent(fmt.Errorf("unexpected subject %s", m.Subject))
	}
	if err == nil && !s.term.Valid() {
		// The lease ran out while this request was handled: the next
		// leader may have rebuilt without what we just published, so
		// leave the request to it. It publishes the same event IDs
		// again, which JetStream drops as duplicates.
		return fmt.Errorf("leadership lost while handling %s", m.Subject)
	}
	return err
}

func (s *scheduler) submit(ctx context.Context, m *bus.Msg) error {
	return s.startSubmit(ctx, m)()
}

// answerInvalid publishes the rejection of a job request whose subject
// names no valid tenant (an upper-case or over-long token, or a literal
// '*' or '>'), so that its publisher, who got a PubAck from JOBS, also
// gets an answer: a rejected event with reason invalid_tenant on
// contracts.RejectedSubject(seq) (FLOWS.md). Its ID is deterministic, so
// a redelivery publishes nothing new.
func (s *scheduler) answerInvalid(ctx context.Context, m *bus.Msg, invalid error) error {
	tenant, id := contracts.InvalidTenantToken, contracts.RejectedJobID(m.StreamSeq)
	msg := fmt.Sprintf("%v; publish on %s with a tenant of 1-32 of [a-z0-9-]", invalid, contracts.SubjectSubmit("<tenant>"))
	ev := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: contracts.EventRejected, Tenant: tenant, JobID: id,
		State: contracts.StateRejected, Time: time.Now().UTC(), Reason: contracts.ReasonInvalidTenant, Message: msg,
		Errors: []contracts.FieldError{{Field: "tenant", Reason: contracts.ReasonInvalidTenant, Message: msg}}}
	evID := contracts.JobEventID(tenant, id, contracts.EventRejected, 0, 0)
	if _, err := s.bus.Publish(ctx, contracts.RejectedSubject(m.StreamSeq), evID, ev, bus.CESubject(tenant+"/"+id)); err != nil {
		return fmt.Errorf("publish %s: %w", evID, err)
	}
	return nil
}

func (s *scheduler) cancel(ctx context.Context, m *bus.Msg) error {
	s.mu.Lock()
	pubs, err := s.st.Cancel(m.Subject, m.Data)
	dones := s.out.enqueue(pubs, true)
	s.mu.Unlock()
	log := s.log.With("subject", m.Subject, "stream_seq", m.StreamSeq)
	switch {
	case errors.Is(err, state.ErrUnknownJob), errors.Is(err, state.ErrTerminalJob):
		log.Info("cancel changes nothing", "err", err)
		return nil
	case err != nil:
		log.Warn("dead-lettering a cancel request", "err", err)
		return bus.Permanent(err)
	}
	for _, done := range dones {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-done:
			if err != nil {
				return fmt.Errorf("cancel: %w", err)
			}
		}
	}
	if len(pubs) == 0 {
		log.Info("cancel remembered until the plan in flight is answered")
	}
	return nil
}

// maxCycleRest bounds the rest CycleRest asks for after a long cycle: a
// job that arrives then waits at most this long more.
const maxCycleRest = 250 * time.Millisecond

// nextCycle is the earliest start of the cycle after one that started at
// start, ended at end and spent took in the cycle itself (not waiting
// for the lock): interval after its start, and rest times took after its
// end (at most maxCycleRest). While the cycles are short (a few jobs
// decided on a small cluster) only the interval counts; when the cycles
// grow (many jobs waiting for GPUs that only releases free, a large
// cluster, a busy machine) they stop taking all the CPU the facts they
// wait for need, and each decides what arrived meanwhile at once.
func nextCycle(start, end time.Time, took, interval time.Duration, rest float64) time.Time {
	next := start.Add(interval)
	if r := min(time.Duration(rest*float64(took)), maxCycleRest); r > 0 && end.Add(r).After(next) {
		next = end.Add(r)
	}
	return next
}

// cycles runs a scheduling cycle whenever something changed, at most once
// per CycleInterval (and resting after a long one, nextCycle), and
// publishes its plans.
func (s *scheduler) cycles(ctx context.Context) error {
	var last, next time.Time
	timer := time.NewTimer(0)
	<-timer.C
	// Cycles are driven by facts; the resync tick is the level-triggered
	// safety net that retries what only time makes eligible again (a
	// refused node's backoff). A cycle that changes nothing publishes
	// nothing.
	resync := time.NewTicker(s.cfg.ResyncInterval)
	defer resync.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.wake:
		case <-resync.C:
		}
		if wait := time.Until(next); wait > 0 {
			timer.Reset(wait)
			select {
			case <-ctx.Done():
				return nil
			case <-timer.C:
			}
		}
		last = time.Now()
		s.mu.Lock()
		began := time.Now()
		res := s.st.Cycle()
		took := time.Since(began)
		s.out.enqueue(res.Publish, false)
		s.mu.Unlock()
		next = nextCycle(last, time.Now(), took, s.cfg.CycleInterval, s.cfg.CycleRest)
		for _, p := range res.Plans {
			if !s.term.Valid() {
				// Our lease ran out: a plan now could race the next
				// leader's. The resource manager would refuse its epoch
				// anyway; this term's scheduler is being torn down.
				s.log.Warn("leadership lost; plans of this cycle not published", "plans", len(res.Plans))
				return nil
			}
			p.Epoch = s.epoch
			pctx, endPlan := s.tracePlan(ctx, &p)
			_, err := s.bus.Publish(pctx, contracts.SubjectPlan(s.cfg.Name), p.ID, p)
			endPlan()
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				// The plan never reached the resource manager: nothing
				// will answer it, so take its assumptions back now and
				// give the bus a moment before the next try.
				s.log.Error("plan publish failed; its jobs go back to the queue", "plan", p.ID, "items", len(p.Items), "err", err)
				s.mu.Lock()
				s.out.enqueue(s.st.PlanFailed(p.ID), false)
				s.mu.Unlock()
				next = time.Now().Add(time.Second)
				continue
			}
			s.log.Debug("plan published", "plan", p.ID, "items", len(p.Items))
		}
		if res.Placed > 0 || res.Waiting > 0 {
			s.log.Debug("cycle", "placed", res.Placed, "waiting", res.Waiting, "took", time.Since(last))
		}
		s.demand.update(res.Demand)
	}
}
