package gateway

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// ingester folds JOB_EVENTS and USAGE into the read model, and NODES into
// the node model (nodes.go), with ordered reads from each stream's first
// message. It never fails on a bad message: one it cannot use is logged
// and skipped, so a poison event cannot stop the read model.
type ingester struct {
	bus   *bus.Bus
	model readModel
	nodes *nodeModel
	log   *slog.Logger
	// jobsReady, usageReady and nodesReady are set once the messages
	// present at start have been folded: from then on the models answer.
	jobsReady, usageReady, nodesReady atomic.Bool
	// adminReady is set once the node holds present at start are folded;
	// only the node endpoints wait for it.
	adminReady atomic.Bool
	// observe, when set, is told of every job event applied, with the
	// job's status after it (the console's fleet and operations views).
	observe func(st contracts.JobStatus, ev contracts.JobEvent, seq uint64)
	// loaded, when set, is told of every job a snapshot brought whole
	// (the fleet view learns who holds which GPU), of every tenant it
	// named, and of the ops view's job events it kept.
	loaded       func(st contracts.JobStatus)
	loadedTenant func(tenant string)
	loadedOps    func(ev contracts.JobEvent)
	// opsEvents are the last opsRingSize job events of the ops view
	// (migrations, preemptions), kept for the snapshot: a start from it
	// shows the ops view what a start from the log would.
	opsEvents []contracts.JobEvent
	// tail, when set, is fed every job event the fold reads: the
	// gateway reads JOB_EVENTS once for its read model and its event
	// streams (one JetStream delivery per event, not two; issue 17).
	tail *eventTail
	// snaps, when set, loads the read model's snapshot at start and
	// writes the next ones (readmodel_snapshot.go).
	snaps *modelSnapshotter
	// startSeq is the JOB_EVENTS sequence the fold started from (0: the
	// beginning; after a snapshot: the one after it covers); folded is
	// the last one it handled.
	startSeq, folded atomic.Uint64
	// usageFolded is the last USAGE sequence handled; usageFrom, set
	// before loadDone is closed, the one the usage read starts after (a
	// snapshot's).
	usageFolded atomic.Uint64
	usageFrom   uint64
	loadDone    chan struct{}
}

// ready reports whether every stream has been caught up with.
func (in *ingester) ready() bool {
	return in.jobsReady.Load() && in.usageReady.Load() && in.nodesReady.Load()
}

// followJobEvents runs until ctx ends. With snapshots it starts from the
// last usable one (readmodel_snapshot.go) and takes the next ones.
func (in *ingester) followJobEvents(ctx context.Context) error {
	start := time.Now()
	spec := bus.FollowSpec{Stream: contracts.StreamJobEvents}
	if in.loadDone != nil {
		defer func() {
			select {
			case <-in.loadDone:
			default:
				close(in.loadDone)
			}
		}()
	}
	if in.snaps != nil {
		if mm, ok := in.model.(*memoryModel); ok {
			s, err := loadModelSnapshot(ctx, in.bus)
			if err != nil {
				in.log.Info("reading job events from the stream's beginning", "why", err)
			} else {
				mm.install(s)
				spec.StartSeq = s.seq + 1
				in.startSeq.Store(spec.StartSeq)
				in.opsEvents = s.ops
				in.usageFrom = s.usageSeq
				in.usageFolded.Store(s.usageSeq)
				in.tellLoaded(s)
				retired := 0
				for _, recs := range s.retired {
					retired += len(recs)
				}
				in.log.Info("read model snapshot loaded", "seq", s.seq, "usage_seq", s.usageSeq, "live_jobs", len(s.live), "retired_jobs", retired,
					"took", time.Since(start))
			}
		}
	}
	if in.loadDone != nil {
		close(in.loadDone) // the usage read may start
	}
	// The fold needs the events after its snapshot, the tail the last
	// RingEvents of the stream (its ring, the history a new stream
	// replays from memory): one read from the earlier of the two feeds
	// both, each taking the events from its own start on.
	foldFrom := max(spec.StartSeq, 1)
	next := foldFrom
	if in.tail != nil {
		tailFrom, err := in.tail.startSeq(ctx)
		if err != nil {
			return nil // ctx ended
		}
		in.tail.startAt(tailFrom)
		next = min(foldFrom, tailFrom)
	}
	handle := func(ctx context.Context, m *bus.Msg) error {
		next = m.StreamSeq + 1
		var err error
		if m.StreamSeq >= foldFrom {
			err = in.foldJobEvent(ctx, m)
		} else if in.tail != nil && in.tail.wants(m.StreamSeq) {
			// Before the snapshot: the tail's alone.
			e, perr := parseTailEvent(m.Subject, m.StreamSeq, m.Data)
			in.tail.add(m.Subject, m.StreamSeq, e, perr)
		}
		return err
	}
	caughtUp := func() {
		in.jobsReady.Store(true)
		if in.tail != nil {
			in.tail.caughtUp()
		}
		in.log.Info("job events caught up", "stream", contracts.StreamJobEvents, "took", time.Since(start))
	}
	for {
		spec.StartSeq = next
		err := in.bus.Follow(ctx, spec, handle, caughtUp)
		if ctx.Err() != nil {
			return nil
		}
		// bus.Follow replaces a consumer that stalls by itself; an
		// error is one it could not get past (the stream unreadable):
		// read again after the last event handled, so neither the read
		// model nor the event streams ever see a gap.
		in.log.Warn("job event read stopped; reading again", "stream", contracts.StreamJobEvents, "stream_seq", next, "err", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
	}
}

// foldJobEvent folds one job event into the read model (and, with a tail,
// hands it to the event streams after), then takes a snapshot when one
// is due.
func (in *ingester) foldJobEvent(ctx context.Context, m *bus.Msg) error {
	err := in.applyJobEvent(ctx, m)
	in.folded.Store(m.StreamSeq)
	if now := time.Now(); in.snaps.due(now) {
		if mm, ok := in.model.(*memoryModel); ok {
			// Taken here, between two events: the copy is the fold
			// of the stream up to this message exactly.
			// USAGE's position is read before the copy: every
			// record up to it is in the copy.
			s := mm.snapshotWithUsage(m.StreamSeq, in.usageFolded.Load())
			s.ops = slices.Clone(in.opsEvents)
			in.snaps.offer(s, now)
		}
	}
	return err
}

// followUsage runs until ctx ends; with snapshots, from after the USAGE
// sequence the loaded one covers (it waits for the load).
func (in *ingester) followUsage(ctx context.Context) error {
	spec := bus.FollowSpec{Stream: contracts.StreamUsage}
	if in.loadDone != nil {
		select {
		case <-in.loadDone:
		case <-ctx.Done():
			return nil
		}
		if in.usageFrom > 0 {
			spec.StartSeq = in.usageFrom + 1
		}
	}
	apply := func(ctx context.Context, m *bus.Msg) error {
		err := in.applyUsage(ctx, m)
		if mm, ok := in.model.(*memoryModel); ok {
			mm.usageSeq.Store(m.StreamSeq)
		}
		in.usageFolded.Store(m.StreamSeq)
		return err
	}
	return in.bus.Follow(ctx, spec, apply, func() {
		in.usageReady.Store(true)
		in.log.Info("usage caught up", "stream", contracts.StreamUsage)
	})
}

func (in *ingester) applyJobEvent(ctx context.Context, m *bus.Msg) error {
	log := func() *slog.Logger { return m.Log(in.log) }
	var ev contracts.JobEvent
	derr := m.Decode(&ev)
	if in.tail != nil && in.tail.wants(m.StreamSeq) {
		// After the model, so that a stream's client that reads an
		// event finds the job as it left it. The tail takes what the
		// body says whatever the subject (its filters match subjects).
		var e *tailEvent
		var perr error
		if derr == nil {
			e, perr = buildTailEvent(m.Subject, m.StreamSeq, m.Data, ev.Type, ev.Tenant)
		} else {
			perr = fmt.Errorf("decode: %w", derr)
		}
		defer in.tail.add(m.Subject, m.StreamSeq, e, perr)
	}
	// The subject names the job; the body must agree with it.
	tenant, job := jobEventSubject(m.Subject)
	if contracts.ValidateTenant(tenant) != nil || contracts.ValidateID(job) != nil {
		log().Warn("skipping job event on a malformed subject")
		return nil
	}
	if derr != nil {
		log().Warn("skipping undecodable job event", "err", derr)
		return nil
	}
	if ev.Tenant != tenant || ev.JobID != job {
		log().Warn("skipping job event whose body names another job", "tenant", ev.Tenant, "job_id", ev.JobID)
		return nil
	}
	err := in.model.ApplyJobEvent(ctx, tenant, job, ev, m.StreamSeq)
	switch {
	case err == nil:
		if _, _, ok := opsKind(ev); ok && in.snaps != nil {
			if len(in.opsEvents) == opsRingSize {
				in.opsEvents = slices.Delete(in.opsEvents, 0, 1)
			}
			in.opsEvents = append(in.opsEvents, ev)
		}
		if in.observe != nil {
			if st, err := in.model.Job(ctx, tenant, job); err == nil {
				in.observe(st, ev, m.StreamSeq)
			}
		}
	case errors.Is(err, contracts.ErrStaleEvent), errors.Is(err, contracts.ErrTransition):
		// A redelivery or a fact the state machine refuses (a rejected
		// duplicate ID on an accepted job): harmless by design.
		log().Debug("job event ignored", "tenant", tenant, "job_id", job, "err", err)
	default:
		log().Warn("job event not applied", "tenant", tenant, "job_id", job, "err", err)
	}
	return nil
}

func (in *ingester) applyUsage(ctx context.Context, m *bus.Msg) error {
	tenant, rec, why := usageRecordOf(m)
	if why != "" {
		m.Log(in.log).Warn(why)
		return nil
	}
	if _, err := in.model.ApplyUsage(ctx, tenant, rec, m.Timestamp); err != nil {
		m.Log(in.log).Warn("usage record not applied", "tenant", tenant, "err", err)
	}
	return nil
}

// tellLoaded tells the views fed by the job events what a snapshot holds,
// as a fold of the same events would have.
func (in *ingester) tellLoaded(s *modelSnap) {
	if in.loaded != nil {
		for _, st := range s.live {
			in.loaded(*st)
		}
	}
	if in.loadedTenant != nil {
		for t := range s.retired {
			in.loadedTenant(t)
		}
	}
	if in.loadedOps != nil {
		for _, ev := range s.ops {
			in.loadedOps(ev)
		}
	}
}

// jobEventSubject returns the tenant and job tokens of a job event
// subject (gp.jobs.events.<tenant>.<job>: contracts.Token 3 and 4)
// without splitting it into a slice for every event.
func jobEventSubject(subject string) (tenant, job string) {
	tenant, plain := subjectTenant(subject)
	if tenant == "" {
		return "", ""
	}
	rest := subject[strings.LastIndexByte(subject, '.')+1:]
	if !plain {
		// More or fewer than five tokens: Token's answer for the fifth.
		return tenant, contracts.Token(subject, 4)
	}
	return tenant, rest
}
