// Package biller turns released ledger entries into usage records on the
// USAGE stream, each segment exactly once.
//
// JetStream's de-duplication only covers two minutes, so the biller keeps
// its own record of what it billed: for every allocation, how many
// segments are in USAGE, up to when, and whether the last one is there,
// rebuilt at start by replaying USAGE (its own output); what it billed to
// the end it forgets once the store confirms it, and asks the store about
// when it comes up again (forget.go). Each publish is
// also a compare-and-set on the tenant's usage subject
// (Nats-Expected-Last-Subject-Sequence): if anything landed there since the
// biller last looked (another replica, or an earlier attempt whose ack was
// lost), the publish fails, the biller reads what it missed and meters
// again from there. An allocation billed in part (a crash between two
// segments) is resumed from the end of its last segment, so segments never
// overlap or leave a gap, whatever the price book says by then.
//
// What a run is billed to is the end of the run as its node agent observed
// it. Two inputs carry it: a released ledger entry (the resource manager
// copies the agent's ended fact into it) and the agent's ended fact itself
// on RUNS, which billing also follows. A release for a lost node
// (node_lost) is the one exception: the resource manager wrote its end (the
// time it gave up on the node), not the agent. Billing does not wait for
// the agent, which may never come back: it bills the release at once,
// marked provisional, and when the agent reports the run's end (back after
// the node was declared lost, or reported before the release but read
// after it) it voids the provisional records and bills the agent's end.
// Every decision is a function of what USAGE holds for the allocation, so
// any order of release, ended fact, redeliveries and restarts converges on
// the same net bill:
//
//	USAGE holds          release node_lost      agent's end (fact or other release)
//	nothing              bill provisional       bill it
//	provisional, part    resume provisional     void, bill it
//	provisional, final   nothing                same span: nothing; else void, bill it
//	voids, or a bill     nothing                resume it (nothing when final)
package biller

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"go.opentelemetry.io/otel/codes"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/billing/internal/meter"
)

// Prices gives the price book to meter with.
type Prices interface {
	Get(ctx context.Context) (contracts.PriceBook, error)
}

// Nodes tells what billing knows of a node.
type Nodes interface {
	Node(id string) (meter.Node, bool)
}

// Requests finds a job's CPU and memory request.
type Requests interface {
	Resources(ctx context.Context, tenant, jobID string) (cpuMilli, memoryMiB int64, err error)
}

// Index is what the biller asks about an allocation it forgot (the
// store, fed from USAGE): whether records of it were applied, and in which
// generation of the store's content the answer holds. Within one
// generation an answer never goes from billed to not billed.
type Index interface {
	Billed(ctx context.Context, keys []Key) (generation string, billed []bool, err error)
}

// Watermark hears the end of every metered segment.
type Watermark interface {
	Advance(ctx context.Context, t time.Time)
}

// Config is what a Biller works with.
type Config struct {
	Bus       *bus.Bus
	Prices    Prices
	Nodes     Nodes
	Requests  Requests
	Watermark Watermark
	// Index, if set, lets the biller forget the allocations it billed to
	// their end once the index confirms them (Forget); nil keeps them.
	Index Index
	Log   *slog.Logger
}

// maxAttempts bounds how often one entry re-reads a moving usage subject
// before its message is handed back for redelivery.
const maxAttempts = 5

// allocation is what USAGE holds of one allocation.
type allocation struct {
	next  int       // segments published: the next segment's number
	until time.Time // end of the last segment of the standing bill; zero once a bill is voided
	final bool      // the standing bill is published to its last segment
	// provisional: the standing bill ends at a node_lost release, not at
	// the agent's end of the run; open are its records, kept to void them.
	provisional bool
	open        []contracts.UsageRecord
	// voiding: voids have been published; the agent's end is what stands
	// now, whatever comes later.
	voiding bool
}

// Biller meters ledger entries and run facts. Rebuild runs first; then
// Handle and HandleRun may be called from one goroutine each (the two
// consumers): they take turns on one lock, message by message.
type Biller struct {
	cfg    Config
	mu     sync.Mutex
	allocs map[string]*allocation
	// settled holds the allocations billed to their end, in epochs
	// (settled.go); forgot and hold say what was forgotten of them
	// (forget.go).
	settled []*epoch
	forgot  string
	hold    time.Time
	// forgets counts the changes to what the biller forgot (an epoch
	// dropped, a recall): an index's answer asked outside b.mu stands
	// only while it has not moved (answers).
	forgets uint64
	round   int               // Forget's rounds
	last    map[string]uint64 // usage subject → last sequence applied
	until   time.Time         // end of the latest segment in USAGE
	seq     uint64            // last USAGE sequence replayed or folded (checkpoint.go)
}

// New returns a biller.
func New(cfg Config) *Biller {
	return &Biller{cfg: cfg, allocs: map[string]*allocation{}, settled: []*epoch{newEpoch()}, last: map[string]uint64{}}
}

// Billed reports how many allocations are billed to the end (of those it
// has not forgotten).
func (b *Biller) Billed() int {
	n := b.settledLen()
	for _, a := range b.allocs {
		if a.final {
			n++
		}
	}
	return n
}

// MeteredUntil is the end of the latest segment in USAGE.
func (b *Biller) MeteredUntil() time.Time { return b.until }

// Rebuild replays every usage record into what the biller knows.
func (b *Biller) Rebuild(ctx context.Context) error {
	if _, err := b.cfg.Bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamUsage,
		FilterSubjects: []string{contracts.SubjectUsageAll}}, b.apply); err != nil {
		return fmt.Errorf("replay usage: %w", err)
	}
	return nil
}

// Handle meters ledger messages taken together (a bus.BatchHandler):
// released entries are billed, one after the other in stream order, each
// with its own outcome; other entries are acked, malformed ones are
// permanent failures. What the biller forgot is asked about once for the
// whole batch, outside its lock (ask).
func (b *Biller) Handle(ctx context.Context, msgs []*bus.Msg) []error {
	return b.handle(ctx, msgs, LedgerConsumer, ledgerBasis)
}

// HandleRun meters the agents' run facts taken together (a
// bus.BatchHandler on RUNS) as Handle does ledger entries: an ended fact
// is the truth of what the run held, whatever the ledger said first.
// Other facts are acked.
func (b *Biller) HandleRun(ctx context.Context, msgs []*bus.Msg) []error {
	return b.handle(ctx, msgs, RunsConsumer, runBasis)
}

// The durable consumers Handle and HandleRun are given (billing's).
const (
	LedgerConsumer = "billing-ledger"
	RunsConsumer   = "billing-runs"
)

// handle bills the basis of each message of msgs (basisOf: ok false when
// it bills nothing) and returns each message's outcome.
func (b *Biller) handle(ctx context.Context, msgs []*bus.Msg, durable string, basisOf func(*bus.Msg) (basis, bool, error)) []error {
	errs := make([]error, len(msgs))
	bases := make([]*basis, len(msgs))
	for i, m := range msgs {
		bs, ok, err := basisOf(m)
		if errs[i] = err; ok && err == nil {
			bases[i] = &bs
		}
	}
	ans := b.ask(ctx, bases)
	for i, bs := range bases {
		if bs != nil {
			errs[i] = b.billTraced(ctx, durable, msgs[i], *bs, ans)
		}
	}
	return errs
}

// billTraced is billOne in a span of m's own trace (bus.ProcessSpan), as
// bus.Consume gives each message: billing's work on a job, and the usage
// it publishes, stay in the job's trace, linked to the batch's span.
func (b *Biller) billTraced(ctx context.Context, durable string, m *bus.Msg, bs basis, ans *answers) error {
	mctx, span := b.cfg.Bus.ProcessSpan(ctx, durable, m)
	defer span.End()
	err := b.billOne(mctx, m, bs, ans)
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	return err
}

// billOne is bill with a panic a permanent failure of its message alone,
// as bus.Consume has it, not of the whole batch (bus.ConsumeBatch's).
func (b *Biller) billOne(ctx context.Context, m *bus.Msg, bs basis, ans *answers) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = bus.Permanent(fmt.Errorf("billing panic: %v", r))
		}
	}()
	return b.bill(ctx, m, bs, ans)
}

// ledgerBasis is what a ledger message bills: a released entry.
func ledgerBasis(m *bus.Msg) (basis, bool, error) {
	var e contracts.LedgerEntry
	if err := m.Decode(&e); err != nil {
		return basis{}, false, bus.Permanent(err)
	}
	if e.Kind != contracts.LedgerReleased {
		return basis{}, false, nil
	}
	if _, _, _, err := meter.Span(e); err != nil {
		return basis{}, false, bus.Permanent(err)
	}
	// A node_lost release ends the run when the resource manager gave up
	// on the node; every other release carries the agent's own end.
	return basis{entry: e, provisional: e.Reason == contracts.ReasonNodeLost}, true, nil
}

// runBasis is what a run fact bills: an ended one, as a release.
func runBasis(m *bus.Msg) (basis, bool, error) {
	var ev contracts.RunEvent
	if err := m.Decode(&ev); err != nil {
		return basis{}, false, bus.Permanent(err)
	}
	if ev.Kind != contracts.RunEnded || ev.Result == nil {
		return basis{}, false, nil
	}
	if node, err := contracts.NodeOfRunsSubject(m.Subject); err != nil || node != ev.NodeID {
		// An agent may only publish on its own node's subject: a fact that
		// names another node bills nothing.
		return basis{}, false, bus.Permanent(fmt.Errorf("run fact for node %q on %s", ev.NodeID, m.Subject))
	}
	e := EntryOfRun(ev)
	if _, _, _, err := meter.Span(e); err != nil {
		return basis{}, false, bus.Permanent(err)
	}
	return basis{entry: e}, true, nil
}

// EntryOfRun is the release an ended fact amounts to for billing: the
// allocation as far as the agent knows it (its pool is the node's), with
// the reason the resource manager gives such a release.
func EntryOfRun(ev contracts.RunEvent) contracts.LedgerEntry {
	reason := contracts.ReasonRunEnded
	if ev.Result.Reason == contracts.ReasonCancelled {
		reason = contracts.ReasonCancelled
	}
	res := *ev.Result
	return contracts.LedgerEntry{SchemaVersion: contracts.SchemaVersion, Kind: contracts.LedgerReleased,
		Allocation: contracts.Allocation{ID: ev.AllocationID, Tenant: ev.Tenant, JobID: ev.JobID, Attempt: ev.Attempt,
			NodeID: ev.NodeID, Devices: ev.Devices},
		Time: ev.Time, Reason: reason, Run: &res}
}

// basis is what to bill an allocation on: a release, or an ended fact as
// one; provisional when its end is the resource manager's, not the agent's.
type basis struct {
	entry       contracts.LedgerEntry
	provisional bool
}

// bill brings what USAGE holds of bs's allocation in line with bs,
// publishing each record with a compare-and-set on the tenant's subject.
// ans is what the index said of the batch's allocations (nil: nothing).
func (b *Biller) bill(ctx context.Context, m *bus.Msg, bs basis, ans *answers) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	a := bs.entry.Allocation
	subj := contracts.SubjectUsage(a.Tenant)
	log := b.cfg.Log.With("tenant", a.Tenant, "job_id", a.JobID, "allocation_id", a.ID, "subject", m.Subject,
		"stream_seq", m.StreamSeq)
	for range maxAttempts {
		recs, err := b.plan(ctx, bs, ans)
		if err != nil || len(recs) == 0 {
			return err
		}
		moved := false
		for _, rec := range recs {
			ack, err := b.cfg.Bus.Publish(ctx, subj, rec.ID, rec,
				bus.ExpectLastSubjectSeq(b.last[subj]), bus.CESubject(rec.AllocationID))
			switch {
			case errors.Is(err, bus.ErrWrongLastSequence), err == nil && ack.Duplicate:
				// Something landed on the subject that we have not read:
				// read it, then decide again from what is billed.
				if err := b.catchUp(ctx, subj); err != nil {
					return err
				}
				moved = true
			case err != nil:
				return err
			default:
				b.record(rec, subj, ack.Sequence)
				log.Info("billed", "segment", rec.Segment, "final", rec.Final, "provisional", rec.Provisional,
					"voids", rec.Voids, "gpus", rec.GPUs, "seconds", rec.Seconds, "price_version", rec.PriceVersion,
					"cost_micros", rec.CostMicros, "usage_seq", ack.Sequence)
			}
			if moved {
				break
			}
		}
		if !moved {
			b.cfg.Watermark.Advance(ctx, recs[len(recs)-1].End)
			return nil
		}
	}
	return fmt.Errorf("usage subject %s kept moving over %d attempts", subj, maxAttempts)
}

// plan is what to publish for bs given what USAGE holds of its allocation
// (the table in the package comment); nothing when it is billed as it
// should be.
func (b *Biller) plan(ctx context.Context, bs basis, ans *answers) ([]contracts.UsageRecord, error) {
	e := bs.entry
	st, _, err := b.find(ctx, e.Allocation.ID, e.Allocation.Tenant, ans)
	if err != nil {
		return nil, err
	}
	if bs.provisional {
		if st != nil && (!st.provisional || st.final) {
			return nil, nil // billed: provisionally to the end, or on the agent's end
		}
		recs, err := b.meter(ctx, e, st)
		for i := range recs {
			recs[i].Provisional = true
		}
		return recs, err
	}
	if st == nil || len(st.open) == 0 {
		if st != nil && st.final {
			return nil, nil
		}
		return b.meter(ctx, e, st)
	}
	// A provisional bill stands (in part, or being voided).
	if st.provisional && st.final && sameSpan(st.open, e) {
		return nil, nil // the agent's end falls in the same whole second
	}
	voids := make([]contracts.UsageRecord, 0, len(st.open))
	for i, rec := range st.open {
		voids = append(voids, meter.Void(rec, st.next+i, e.Time))
	}
	// The bill that replaces it keeps the release's reason (node_lost) and
	// numbers on after the voids, from the run's start.
	e.Reason = cmp.Or(st.open[0].Reason, e.Reason)
	after := &allocation{next: st.next + len(voids)}
	recs, err := b.meter(ctx, e, after)
	if err != nil {
		return nil, err
	}
	return append(voids, recs...), nil
}

// sameSpan reports whether a provisional bill's records cover exactly the
// whole seconds e's run touched.
func sameSpan(open []contracts.UsageRecord, e contracts.LedgerEntry) bool {
	from, to, ok, err := meter.Span(e)
	if err != nil || !ok {
		return false
	}
	first, last := open[0], open[0]
	for _, r := range open {
		if r.Segment < first.Segment {
			first = r
		}
		if r.Segment > last.Segment {
			last = r
		}
	}
	return first.Start.Equal(from) && last.End.Equal(to) && last.GPUs == len(e.Allocation.Devices)
}

// meter meters e from where st's bill stands (from the run's start when
// st is nil or was voided).
func (b *Biller) meter(ctx context.Context, e contracts.LedgerEntry, st *allocation) ([]contracts.UsageRecord, error) {
	if _, _, ok, err := meter.Span(e); err != nil {
		return nil, bus.Permanent(err)
	} else if !ok {
		return nil, nil // a run that never started bills nothing, whatever is known of its node
	}
	in, err := b.input(ctx, e, st)
	if err != nil {
		return nil, err
	}
	recs, err := meter.Meter(in)
	if err != nil {
		return nil, bus.Permanent(err)
	}
	return recs, nil
}

// input is what to meter of e, resuming st's bill.
func (b *Biller) input(ctx context.Context, e contracts.LedgerEntry, st *allocation) (meter.Input, error) {
	a := e.Allocation
	in := meter.Input{Entry: e}
	if st != nil {
		in.From, in.Segment = st.until, st.next
	}
	node, ok := b.cfg.Nodes.Node(a.NodeID)
	if !ok {
		// Agents publish their inventory before anything is placed on
		// them: billing has not read it yet. Wait for it rather than
		// guess a price class.
		return in, fmt.Errorf("node %s: no inventory seen yet, its price class is unknown", a.NodeID)
	}
	in.Node = node
	book, err := b.cfg.Prices.Get(ctx)
	if err != nil {
		return in, err
	}
	in.Book = book
	if hasResourceRates(book) {
		if in.CPUMilli, in.MemoryMiB, err = b.cfg.Requests.Resources(ctx, a.Tenant, a.JobID); err != nil {
			return in, err
		}
	}
	return in, nil
}

func hasResourceRates(b contracts.PriceBook) bool {
	for _, v := range b.Versions {
		if v.CPUCoreHour > 0 || v.MemoryGiBHour > 0 {
			return true
		}
	}
	return false
}

// catchUp applies the records of one usage subject after the last one seen.
func (b *Biller) catchUp(ctx context.Context, subj string) error {
	if _, err := b.cfg.Bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamUsage,
		FilterSubjects: []string{subj}, StartSeq: b.last[subj] + 1}, b.apply); err != nil {
		return fmt.Errorf("catch up on %s: %w", subj, err)
	}
	return nil
}

// apply takes one record of USAGE into what the biller knows.
func (b *Biller) apply(_ context.Context, m *bus.Msg) error {
	if m.StreamSeq <= b.seq {
		// Read already: a fold's recall read USAGE to its end while its
		// follow waited (a provisional record applied twice would be
		// voided twice).
		return nil
	}
	b.seq = m.StreamSeq
	var rec contracts.UsageRecord
	if err := m.Decode(&rec); err != nil || rec.AllocationID == "" {
		b.cfg.Log.Warn("skipping unreadable usage record", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
		b.last[m.Subject] = max(b.last[m.Subject], m.StreamSeq)
		return nil
	}
	b.record(rec, m.Subject, m.StreamSeq)
	return nil
}

// record notes rec, stored at seq on subj.
func (b *Biller) record(rec contracts.UsageRecord, subj string, seq uint64) {
	st, settled := b.lookup(rec.AllocationID)
	if st == nil || settled {
		if st == nil {
			st = &allocation{}
		}
		b.unsettle(rec.AllocationID)
		b.allocs[rec.AllocationID] = st
	}
	defer b.settle(rec.AllocationID, st)
	st.next = max(st.next, rec.Segment+1)
	b.last[subj] = max(b.last[subj], seq)
	if rec.Voids != "" {
		st.voiding, st.provisional = true, false
		st.open = slices.DeleteFunc(st.open, func(r contracts.UsageRecord) bool { return r.ID == rec.Voids })
		if len(st.open) == 0 {
			st.until, st.final = time.Time{}, false
		}
		return
	}
	if rec.Provisional {
		if st.voiding {
			return // a provisional record after voids: never written, ignore
		}
		st.provisional = true
		st.open = append(st.open, rec)
	} else {
		st.provisional, st.open = false, nil
	}
	if rec.End.After(st.until) {
		st.until = rec.End
	}
	// A record from before segments existed bills its allocation whole.
	st.final = st.final || rec.Final || rec.ID == contracts.UsageID(rec.AllocationID)
	if rec.End.After(b.until) {
		b.until = rec.End
	}
}
