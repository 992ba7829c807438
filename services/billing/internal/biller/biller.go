// Package biller turns released ledger entries into usage records on the
// USAGE stream, exactly once per allocation.
//
// JetStream's de-duplication only covers two minutes, so the biller keeps
// its own record of what it billed: the set of allocation IDs that have a
// record in USAGE, rebuilt at start by replaying USAGE (its own output).
// Each publish is also a compare-and-set on the tenant's usage subject
// (Nats-Expected-Last-Subject-Sequence): if anything landed there since the
// biller last looked (another replica, or an earlier attempt whose ack was
// lost), the publish fails, the biller reads what it missed and checks
// again. So two records for one allocation need two writers that both
// missed each other's record, which the compare-and-set rules out.
package biller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/billing/internal/meter"
)

// Totals is what the biller feeds every record it sees in USAGE.
type Totals interface {
	// Add counts a record; idempotent on its ID.
	Add(ctx context.Context, rec contracts.UsageRecord) error
}

// maxAttempts bounds how often one entry re-reads a moving usage subject
// before its message is handed back for redelivery.
const maxAttempts = 5

// Biller meters ledger entries. It is not safe for concurrent use: Rebuild
// runs first, then Handle one message at a time (bus.Consume's contract).
type Biller struct {
	bus    *bus.Bus
	totals Totals
	log    *slog.Logger
	billed map[string]struct{} // allocation IDs with a record in USAGE
	last   map[string]uint64   // usage subject → last sequence applied
}

// New returns a biller publishing on b and feeding totals.
func New(b *bus.Bus, totals Totals, log *slog.Logger) *Biller {
	return &Biller{bus: b, totals: totals, log: log, billed: map[string]struct{}{}, last: map[string]uint64{}}
}

// Billed reports how many allocations the biller knows to be billed.
func (b *Biller) Billed() int { return len(b.billed) }

// Rebuild replays every usage record into the billed set and the totals.
func (b *Biller) Rebuild(ctx context.Context) error {
	if _, err := b.bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamUsage,
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
	rec, ok, err := meter.Meter(e)
	if err != nil {
		return bus.Permanent(err)
	}
	if !ok {
		return nil
	}
	subj := contracts.SubjectUsage(rec.Tenant)
	log := b.log.With("tenant", rec.Tenant, "job_id", rec.JobID, "allocation_id", rec.AllocationID, "stream_seq", m.StreamSeq)
	for range maxAttempts {
		if _, done := b.billed[rec.AllocationID]; done {
			log.Debug("already billed")
			return nil
		}
		ack, err := b.bus.Publish(ctx, subj, rec.ID, rec,
			bus.ExpectLastSubjectSeq(b.last[subj]), bus.CESubject(rec.AllocationID))
		switch {
		case errors.Is(err, bus.ErrWrongLastSequence), err == nil && ack.Duplicate:
			// Something landed on the subject that we have not read:
			// read it, then decide again.
			if err := b.catchUp(ctx, subj); err != nil {
				return err
			}
			continue
		case err != nil:
			return err
		}
		// The record is in USAGE. Should the totals fail now, billed and
		// last stay behind, so the redelivery fails its compare-and-set,
		// catches up and counts the record from the stream.
		if err := b.totals.Add(ctx, rec); err != nil {
			return fmt.Errorf("totals: %w", err)
		}
		b.billed[rec.AllocationID] = struct{}{}
		b.last[subj] = ack.Sequence
		log.Info("billed", "gpus", rec.GPUs, "gpu_millis", rec.GPUMillis, "usage_seq", ack.Sequence)
		return nil
	}
	return fmt.Errorf("usage subject %s kept moving over %d attempts", subj, maxAttempts)
}

// catchUp applies the records of one usage subject after the last one seen.
func (b *Biller) catchUp(ctx context.Context, subj string) error {
	if _, err := b.bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamUsage,
		FilterSubjects: []string{subj}, StartSeq: b.last[subj] + 1}, b.apply); err != nil {
		return fmt.Errorf("catch up on %s: %w", subj, err)
	}
	return nil
}

// apply takes one record of USAGE into the billed set and the totals.
func (b *Biller) apply(ctx context.Context, m *bus.Msg) error {
	var rec contracts.UsageRecord
	if err := m.Decode(&rec); err != nil || rec.AllocationID == "" {
		b.log.Warn("skipping unreadable usage record", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
	} else {
		if err := b.totals.Add(ctx, rec); err != nil {
			return fmt.Errorf("totals: %w", err)
		}
		b.billed[rec.AllocationID] = struct{}{}
	}
	b.last[m.Subject] = max(b.last[m.Subject], m.StreamSeq)
	return nil
}
