// Package biller turns released ledger entries into usage records on the
// USAGE stream, each segment exactly once.
//
// JetStream's de-duplication only covers two minutes, so the biller keeps
// its own record of what it billed: for every allocation, how many
// segments are in USAGE, up to when, and whether the last one is there,
// rebuilt at start by replaying USAGE (its own output). Each publish is
// also a compare-and-set on the tenant's usage subject
// (Nats-Expected-Last-Subject-Sequence): if anything landed there since the
// biller last looked (another replica, or an earlier attempt whose ack was
// lost), the publish fails, the biller reads what it missed and meters
// again from there. An allocation billed in part (a crash between two
// segments) is resumed from the end of its last segment, so segments never
// overlap or leave a gap, whatever the price book says by then.
package biller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

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
	Log       *slog.Logger
}

// maxAttempts bounds how often one entry re-reads a moving usage subject
// before its message is handed back for redelivery.
const maxAttempts = 5

// allocation is what USAGE holds of one allocation.
type allocation struct {
	next  int       // segments published: the next segment's number
	until time.Time // end of the last published segment
	final bool      // the last segment is published
}

// Biller meters ledger entries. It is not safe for concurrent use: Rebuild
// runs first, then Handle one message at a time (bus.Consume's contract).
type Biller struct {
	cfg    Config
	allocs map[string]*allocation
	last   map[string]uint64 // usage subject → last sequence applied
	until  time.Time         // end of the latest segment in USAGE
}

// New returns a biller.
func New(cfg Config) *Biller {
	return &Biller{cfg: cfg, allocs: map[string]*allocation{}, last: map[string]uint64{}}
}

// Billed reports how many allocations are billed to the end.
func (b *Biller) Billed() int {
	n := 0
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

// Handle meters one ledger message (a bus.Handler). Entries that bill
// nothing are acked; malformed ones are permanent failures.
func (b *Biller) Handle(ctx context.Context, m *bus.Msg) error {
	var e contracts.LedgerEntry
	if err := m.Decode(&e); err != nil {
		return bus.Permanent(err)
	}
	_, _, ok, err := meter.Span(e)
	if err != nil {
		return bus.Permanent(err)
	}
	if !ok {
		return nil
	}
	a := e.Allocation
	subj := contracts.SubjectUsage(a.Tenant)
	log := b.cfg.Log.With("tenant", a.Tenant, "job_id", a.JobID, "allocation_id", a.ID, "stream_seq", m.StreamSeq)
	for range maxAttempts {
		in, done, err := b.input(ctx, e)
		if err != nil || done {
			return err
		}
		recs, err := meter.Meter(in)
		if err != nil {
			return bus.Permanent(err)
		}
		if len(recs) == 0 {
			return nil
		}
		moved := false
		for _, rec := range recs {
			ack, err := b.cfg.Bus.Publish(ctx, subj, rec.ID, rec,
				bus.ExpectLastSubjectSeq(b.last[subj]), bus.CESubject(rec.AllocationID))
			switch {
			case errors.Is(err, bus.ErrWrongLastSequence), err == nil && ack.Duplicate:
				// Something landed on the subject that we have not read:
				// read it, then meter again from what is billed.
				if err := b.catchUp(ctx, subj); err != nil {
					return err
				}
				moved = true
			case err != nil:
				return err
			default:
				b.record(rec, subj, ack.Sequence)
				log.Info("billed", "segment", rec.Segment, "final", rec.Final, "gpus", rec.GPUs, "seconds", rec.Seconds,
					"price_version", rec.PriceVersion, "cost_micros", rec.CostMicros, "usage_seq", ack.Sequence)
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

// input is what to meter of e now; done when its allocation is billed.
func (b *Biller) input(ctx context.Context, e contracts.LedgerEntry) (meter.Input, bool, error) {
	a := e.Allocation
	in := meter.Input{Entry: e}
	if st := b.allocs[a.ID]; st != nil {
		if st.final {
			return in, true, nil
		}
		in.From, in.Segment = st.until, st.next
	}
	node, ok := b.cfg.Nodes.Node(a.NodeID)
	if !ok {
		// Agents publish their inventory before anything is placed on
		// them: billing has not read it yet. Wait for it rather than
		// guess a price class.
		return in, false, fmt.Errorf("node %s: no inventory seen yet, its price class is unknown", a.NodeID)
	}
	in.Node = node
	book, err := b.cfg.Prices.Get(ctx)
	if err != nil {
		return in, false, err
	}
	in.Book = book
	if hasResourceRates(book) {
		if in.CPUMilli, in.MemoryMiB, err = b.cfg.Requests.Resources(ctx, a.Tenant, a.JobID); err != nil {
			return in, false, err
		}
	}
	return in, false, nil
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
	st := b.allocs[rec.AllocationID]
	if st == nil {
		st = &allocation{}
		b.allocs[rec.AllocationID] = st
	}
	st.next = max(st.next, rec.Segment+1)
	if rec.End.After(st.until) {
		st.until = rec.End
	}
	// A record from before segments existed bills its allocation whole.
	st.final = st.final || rec.Final || rec.ID == contracts.UsageID(rec.AllocationID)
	if rec.End.After(b.until) {
		b.until = rec.End
	}
	b.last[subj] = max(b.last[subj], seq)
}
