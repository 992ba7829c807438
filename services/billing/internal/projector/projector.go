// Package projector feeds the usage records of USAGE into billing's
// store, a batch at a time, with a durable consumer per store generation:
//
//	USAGE gp.usage.* ──durable billing-usage-<generation>, batches──▶ Store.Apply ──▶ ack
//
// A store that keeps its content (Redis) resumes where its consumer acked;
// a new or emptied one (the in-memory store at every start, a flushed or
// restarted Redis) opens a new generation, whose new consumer replays
// USAGE from its first record. Up to Config.InFlight batches (default 2) apply
// at once (bus.ConsumeBatchPipelined): the next batch is taken and decoded
// while the store works on the ones before, and each is acked only when
// its Apply succeeded. While the store is unavailable (its
// circuit breaker open) every record is handed back with a delay
// (NakWithDelay) and comes again: metering is late, never lost.
package projector

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"sync/atomic"
	"time"

	"github.com/buger/jsonparser"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// Store is where records go.
type Store interface {
	Open(ctx context.Context) (generation string, err error)
	Apply(ctx context.Context, recs []contracts.UsageRecord) (applied int, err error)
	// Generation is the store's generation now: another than Open named
	// (or the Changed error) means the store lost what the feed put in.
	Generation(ctx context.Context) (string, error)
	// MarkComplete records that generation holds all USAGE held when its
	// replay began.
	MarkComplete(ctx context.Context, generation string) error
}

// ConsumerPrefix starts the name of every generation's durable consumer.
const ConsumerPrefix = "billing-usage-"

// Config configures a projector.
type Config struct {
	Bus   *bus.Bus
	Store Store
	Log   *slog.Logger
	// Unavailable is the error of a store that fails fast (its breaker
	// open), and Changed the error of a store that lost its content.
	Unavailable, Changed error
	// RetryDelay is how long a batch waits when the store is unavailable;
	// default 5 s.
	RetryDelay time.Duration
	// Batch bounds a batch; default 1024.
	Batch int
	// InFlight is how many batches may be applying at once: the next
	// batch is taken and decoded while the store works on the ones before
	// (Redis on its own core). Default 2; 1 applies one batch at a time.
	InFlight int
	// MaxDeliver bounds the deliveries of one record before it is
	// dead-lettered; default 100,000 (at RetryDelay, days of outage).
	MaxDeliver int
	// Applied, if set, hears the tenants of every batch applied.
	Applied func(tenants []string)
	// Complete, if set, hears that the generation was marked complete.
	Complete func()
	// ProbeInterval is how often the feed asks whether its generation has
	// caught up (to mark it complete) and whether the store still holds
	// it; default 1 s.
	ProbeInterval time.Duration
}

// Projector is the feed. Run it once.
type Projector struct {
	cfg      Config
	caughtUp atomic.Bool
	applied  atomic.Int64
	// nudge wakes the probe when a batch applied the last record
	// delivered so far: the generation may have caught up.
	nudge chan struct{}
}

// New returns a projector.
func New(cfg Config) *Projector {
	if cfg.RetryDelay <= 0 {
		cfg.RetryDelay = 5 * time.Second
	}
	if cfg.Batch <= 0 {
		cfg.Batch = 1024
	}
	if cfg.InFlight <= 0 {
		cfg.InFlight = 2
	}
	if cfg.MaxDeliver <= 0 {
		cfg.MaxDeliver = 100_000
	}
	if cfg.ProbeInterval <= 0 {
		cfg.ProbeInterval = time.Second
	}
	return &Projector{cfg: cfg, nudge: make(chan struct{}, 1)}
}

// CaughtUp reports whether the store holds every record USAGE held when
// the current generation's replay began (and more since), as this
// projector marked it in the store (MarkComplete).
func (p *Projector) CaughtUp() bool { return p.caughtUp.Load() }

// Applied counts the records that were new to the store.
func (p *Projector) Applied() int64 { return p.applied.Load() }

// Run feeds the store until ctx ends.
func (p *Projector) Run(ctx context.Context) error {
	delay := 100 * time.Millisecond
	for ctx.Err() == nil {
		gen, err := p.cfg.Store.Open(ctx)
		if err != nil {
			p.cfg.Log.Warn("billing store cannot be opened; again", "err", err, "delay", delay)
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(delay):
			}
			delay = min(2*delay, p.cfg.RetryDelay)
			continue
		}
		delay = 100 * time.Millisecond
		p.caughtUp.Store(false)
		if err := p.generation(ctx, gen); err != nil {
			return err
		}
	}
	return nil
}

// generation runs one generation's consumer until ctx ends or the store
// loses its content.
func (p *Projector) generation(ctx context.Context, gen string) error {
	gctx, changed := context.WithCancelCause(ctx)
	durable := ConsumerPrefix + gen
	probed := make(chan struct{})
	go func() {
		defer close(probed)
		p.probe(gctx, gen, durable, changed)
	}()
	// The probe ends before the next generation begins: it must not mark
	// this one's state as the next one's.
	defer func() { changed(nil); <-probed }()
	p.cfg.Log.Info("feeding the billing store", "generation", gen, "consumer", durable)
	err := p.cfg.Bus.ConsumeBatchPipelined(gctx, bus.ConsumerSpec{Stream: contracts.StreamUsage, Durable: durable,
		FilterSubjects: []string{contracts.SubjectUsageAll}, Batch: p.cfg.Batch, MaxAckPending: (p.cfg.InFlight + 2) * p.cfg.Batch,
		MaxDeliver: p.cfg.MaxDeliver, InactiveThreshold: time.Hour}, p.cfg.InFlight,
		func(ctx context.Context, msgs []*bus.Msg) func() []error {
			wait := p.StartBatch(ctx, msgs)
			return func() []error {
				errs := wait()
				if slices.ContainsFunc(errs, func(err error) bool { return errors.Is(err, p.cfg.Changed) }) {
					changed(p.cfg.Changed)
				}
				return errs
			}
		})
	if err != nil {
		return fmt.Errorf("usage feed: %w", err)
	}
	if ctx.Err() == nil {
		p.cfg.Log.Warn("the billing store lost its content; rebuilding it from USAGE", "generation", gen)
	}
	return nil
}

// probe runs beside a generation's consumer until ctx ends, every
// ProbeInterval:
//   - until the generation is complete, it compares the consumer's ack
//     floor with USAGE's last record when the probing began, and once
//     the floor reaches it marks the generation complete in the store
//     (budgets are judged only on a complete one). The ack floor, not
//     the pending count of a delivered batch: replicas share the
//     consumer, batches apply several at once, and a generation adopted
//     whole (a restart on a kept Redis) delivers nothing at all;
//   - it asks the store for its generation: another (a Redis flushed or
//     restarted, or refilled by another replica meanwhile) ends this one,
//     and Run opens the store again. Without it a replica fed nothing
//     (no usage coming) would never learn that its store lost its
//     content, and the store would stay empty.
func (p *Projector) probe(ctx context.Context, gen, durable string, changed context.CancelCauseFunc) {
	var target uint64
	targetKnown := false
	began := time.Now()
	warned := false
	tick := time.NewTicker(p.cfg.ProbeInterval)
	defer tick.Stop()
	for probes := 0; ; probes++ {
		if !targetKnown {
			last, err := p.lastSeq(ctx)
			if err == nil {
				target, targetKnown = last, true
			} else if ctx.Err() == nil {
				p.cfg.Log.Info("USAGE's last record not read; the next probe tries again", "generation", gen, "err", err)
			}
		}
		if targetKnown && !p.caughtUp.Load() {
			floor, err := p.markIfCaughtUp(ctx, gen, durable, target)
			switch {
			case errors.Is(err, p.cfg.Changed):
				changed(err)
				return
			case ctx.Err() != nil:
			case errors.Is(err, jetstream.ErrConsumerNotFound) && probes < 3:
				// The consumer is being made beside the first probes.
			case err != nil:
				p.cfg.Log.Info("billing store not yet marked complete; the next probe tries again", "generation", gen, "err", err)
			case !p.caughtUp.Load() && !warned && time.Since(began) > incompleteWarning:
				// Budgets wait for this: say so, once. A record that its
				// Apply refuses again and again holds the floor until it
				// is dead-lettered (MaxDeliver).
				warned = true
				p.cfg.Log.Warn("billing store still incomplete: budgets are not judged until its replay is acknowledged",
					"generation", gen, "consumer", durable, "ack_floor", floor, "target", target, "for", time.Since(began).Round(time.Second))
			}
		}
		if cur, err := p.cfg.Store.Generation(ctx); errors.Is(err, p.cfg.Changed) || (err == nil && cur != gen) {
			p.cfg.Log.Warn("the billing store no longer holds this generation", "generation", gen, "store", cur, "err", err)
			changed(p.cfg.Changed)
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-p.nudge:
			// The batch is acknowledged once its handler returned: give
			// the ack a moment to move the floor.
			select {
			case <-ctx.Done():
				return
			case <-time.After(min(nudgeDelay, p.cfg.ProbeInterval)):
			}
		}
	}
}

// nudgeDelay is how long the probe waits after a nudge.
const nudgeDelay = 25 * time.Millisecond

// incompleteWarning is how long a generation may stay incomplete before
// the probe warns.
const incompleteWarning = time.Minute

// markIfCaughtUp marks gen complete when its consumer's ack floor has
// reached USAGE's record target; it returns the floor it read.
func (p *Projector) markIfCaughtUp(ctx context.Context, gen, durable string, target uint64) (floor uint64, err error) {
	if target > 0 { // an empty USAGE is caught up at once
		c, err := p.cfg.Bus.JetStream().Consumer(ctx, contracts.StreamUsage, durable)
		if err != nil {
			return 0, fmt.Errorf("usage consumer: %w", err)
		}
		// Consumer read the info just now.
		if floor = c.CachedInfo().AckFloor.Stream; floor < target {
			return floor, nil
		}
	}
	if err := p.cfg.Store.MarkComplete(ctx, gen); err != nil {
		return floor, err
	}
	p.caughtUp.Store(true)
	p.cfg.Log.Info("billing store complete", "generation", gen, "usage_seq", target)
	if p.cfg.Complete != nil {
		p.cfg.Complete()
	}
	return floor, nil
}

// lastSeq is the sequence of USAGE's last record (0 when it has none).
func (p *Projector) lastSeq(ctx context.Context) (uint64, error) {
	s, err := p.cfg.Bus.JetStream().Stream(ctx, contracts.StreamUsage)
	if err != nil {
		return 0, err
	}
	return s.CachedInfo().State.LastSeq, nil // Stream read the info just now
}

// HandleBatch applies one batch of USAGE messages (a bus.BatchHandler):
// StartBatch and its wait.
func (p *Projector) HandleBatch(ctx context.Context, msgs []*bus.Msg) []error {
	return p.StartBatch(ctx, msgs)()
}

// StartBatch decodes one batch of USAGE messages and starts applying its
// records to the store in one call (a bus.PipelinedBatchHandler; exported
// for the benchmark). wait returns each message's outcome: nil when its
// record was applied (or had been before), Permanent for a message that is
// not a usage record, a retry for every record of a failed call. Batches
// applying at once may share records (a redelivery while the first
// delivery is still applying): the store's Apply is atomic per record, so
// each is counted once whichever comes first.
func (p *Projector) StartBatch(ctx context.Context, msgs []*bus.Msg) (wait func() []error) {
	errs := make([]error, len(msgs))
	tenants := map[string]struct{}{}
	recs := make([]contracts.UsageRecord, 0, len(msgs))
	for i, m := range msgs {
		rec, err := decode(m.Data)
		switch {
		case err != nil:
			errs[i] = bus.Permanent(err)
			continue
		case rec.ID == "" || m.Subject != contracts.SubjectUsage(rec.Tenant):
			errs[i] = bus.Permanent(fmt.Errorf("usage record %q of tenant %q on %s", rec.ID, rec.Tenant, m.Subject))
			continue
		}
		recs = append(recs, rec)
		tenants[rec.Tenant] = struct{}{}
	}
	var applied int
	var err error
	done := make(chan struct{})
	if len(recs) == 0 {
		close(done)
	} else {
		go func() {
			defer close(done)
			applied, err = p.cfg.Store.Apply(ctx, recs)
		}()
		// On one core (GOMAXPROCS=1) the caller would go on decoding the
		// next batch before Apply has even sent this one: let it send
		// first, so that the store works while we decode.
		runtime.Gosched()
	}
	return func() []error {
		<-done
		p.applied.Add(int64(applied))
		if err == nil && len(msgs) > 0 && msgs[len(msgs)-1].NumPending == 0 && !p.caughtUp.Load() {
			select {
			case p.nudge <- struct{}{}:
			default:
			}
		}
		if err != nil {
			var retry error
			switch {
			case errors.Is(err, p.cfg.Unavailable):
				retry = bus.RetryAfter(err, p.cfg.RetryDelay)
			case errors.Is(err, p.cfg.Changed):
				retry = err
			default:
				retry = bus.RetryAfter(err, p.cfg.RetryDelay/5)
			}
			p.cfg.Log.Info("usage records not applied; they come again", "records", len(recs), "err", err)
			for i := range errs {
				if errs[i] == nil {
					errs[i] = retry
				}
			}
		}
		if p.cfg.Applied != nil && applied > 0 {
			list := make([]string, 0, len(tenants))
			for t := range tenants {
				list = append(list, t)
			}
			p.cfg.Applied(list)
		}
		if slices.ContainsFunc(errs, func(err error) bool { return err != nil }) {
			return errs
		}
		return nil
	}
}

// storeFields are what a store keeps of a usage record.
var storeFields = [][]string{{"id"}, {"tenant"}, {"jobId"}, {"pool"}, {"start"}, {"gpuMillis"}, {"costMicros"}, {"onDemandCostMicros"},
	{"allocationId"}}

// decode reads what the store needs of a usage record (the fields of
// storeFields) with jsonparser, which picks them out without reflection:
// on the feed's hot path encoding/json costs more than the store. A body
// that cannot be read that way is decoded again with encoding/json, whose
// error says what is wrong with it.
func decode(data []byte) (contracts.UsageRecord, error) {
	var r contracts.UsageRecord
	var bad error
	seen := 0
	jsonparser.EachKey(data, func(i int, v []byte, _ jsonparser.ValueType, err error) {
		seen++
		if err == nil {
			switch i {
			case 0:
				r.ID, err = jsonparser.ParseString(v)
			case 1:
				r.Tenant, err = jsonparser.ParseString(v)
			case 2:
				r.JobID, err = jsonparser.ParseString(v)
			case 3:
				r.Pool, err = jsonparser.ParseString(v)
			case 4:
				var s string
				if s, err = jsonparser.ParseString(v); err == nil {
					r.Start, err = time.Parse(time.RFC3339Nano, s)
				}
			case 5:
				r.GPUMillis, err = jsonparser.ParseInt(v)
			case 6:
				r.CostMicros, err = jsonparser.ParseInt(v)
			case 7:
				r.OnDemandCostMicros, err = jsonparser.ParseInt(v)
			case 8:
				r.AllocationID, err = jsonparser.ParseString(v)
			}
		}
		if err != nil && bad == nil {
			bad = err
		}
	}, storeFields...)
	// costMicros and onDemandCostMicros are omitted when zero.
	if bad == nil && seen >= 6 && r.ID != "" && !r.Start.IsZero() {
		return r, nil
	}
	var full contracts.UsageRecord
	if err := json.Unmarshal(data, &full); err != nil {
		return full, fmt.Errorf("usage record: %w", err)
	}
	return full, nil
}
