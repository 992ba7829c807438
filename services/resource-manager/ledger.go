package resourcemanager

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/telemetry"
	"github.com/gpuplane/gpuplane/services/resource-manager/internal/ledger"
)

// onLedgerMsg applies one message of a node's ledger subject, read in
// subject order (replay, follow or catch-up). It never fails: a message it
// cannot use still moves the node's sequence, or every later
// compare-and-set on that node would fail.
func (s *server) onLedgerMsg(_ context.Context, m *bus.Msg) error {
	if strings.HasPrefix(m.Subject, "gp.alloc.refused.") {
		// A refusal (ours or another replica's) is final for its plan
		// item: a redelivered plan must not commit what was refused.
		var r struct {
			Time time.Time `json:"time"`
		}
		_ = m.Decode(&r) // undecodable: dated by its stamp
		s.observe(m.Timestamp)
		s.mu.Lock()
		s.addRefusal(refusalHashOf(m.ID()), s.dateOf(r.Time, m.Timestamp))
		s.mu.Unlock()
		return nil
	}
	node := contracts.Token(m.Subject, 3)
	// Only what the ledger applies (kind and allocation): a rebuild
	// decodes every entry, and a release's run result is not needed.
	var le struct {
		Kind       contracts.LedgerKind `json:"kind"`
		Allocation contracts.Allocation `json:"allocation"`
		Time       time.Time            `json:"time"`
	}
	if err := m.Decode(&le); err != nil {
		m.Log(s.log, "node_id", node).Error("undecodable ledger entry skipped", "err", err)
		s.advance(node, m.StreamSeq)
		return nil
	}
	s.observe(m.Timestamp)
	e := contracts.LedgerEntry{Kind: le.Kind, Allocation: le.Allocation, Time: s.dateOf(le.Time, m.Timestamp)}
	if e.Allocation.NodeID != node {
		m.Log(s.log, "node_id", node).Error("ledger entry for another node skipped", "entry_node_id", e.Allocation.NodeID, "alloc_id", e.Allocation.ID)
		s.advance(node, m.StreamSeq)
		return nil
	}
	s.apply(func() *slog.Logger { return m.Log(s.log, "node_id", node) }, e, m.StreamSeq)
	return nil
}

func (s *server) advance(node string, seq uint64) {
	s.mu.Lock()
	s.led.Advance(node, seq)
	s.mu.Unlock()
}

// apply folds an entry stored at seq into the ledger.
func (s *server) apply(log func() *slog.Logger, e contracts.LedgerEntry, seq uint64) {
	s.mu.Lock()
	err := s.led.Apply(e, seq)
	if e.Kind == contracts.LedgerReleased {
		delete(s.started, e.Allocation.ID)
	}
	if errors.Is(err, ledger.ErrInvalidEntry) {
		s.led.Advance(e.Allocation.NodeID, seq)
	}
	s.mu.Unlock()
	switch {
	case errors.Is(err, ledger.ErrConflict):
		// Another writer broke G1. The log is the truth: keep the device
		// held and say it loudly.
		log().Error("ledger holds a device twice", "err", err, "alloc_id", e.Allocation.ID)
	case err != nil:
		log().Error("ledger entry skipped", "err", err)
	}
}

// Dates (ledger.Keep). Every date is NATS time, the clock that stamps
// plans, never a replica's own clock: a replica running an hour behind
// would have its records forgotten while their plans were still young,
// one running a day ahead would expire every plan (both found in review).
// A writer dates its entry or refusal (its Time) with the latest stream
// stamp it has seen (seen: plans, ledger, runs, heartbeats, and a loaded
// snapshot's clocks), and no earlier than the ledger's and refusals'
// clocks, so at least the date of every plan and commit behind the
// record; a reader takes that date within [its stamp - ClockSkew, its
// stamp + ClockSkew] (dateOf), which keeps an honest writer's date as
// written (so writer, replicas and replays agree) and bounds a bad one's:
// an entry dated a day ahead or in 1970 by hand moves nothing far.

// observe notes a stream stamp seen.
func (s *server) observe(t time.Time) {
	if t.IsZero() {
		return
	}
	ns := t.UnixNano()
	for {
		old := s.stampSeen.Load()
		if ns <= old || s.stampSeen.CompareAndSwap(old, ns) {
			return
		}
	}
}

// seen is the latest stream stamp seen (zero before any).
func (s *server) seen() time.Time {
	if ns := s.stampSeen.Load(); ns != 0 {
		return time.Unix(0, ns).UTC()
	}
	return time.Time{}
}

// dateOf is the date of a message stamped stamp whose writer dated it
// written: written, within [stamp - ClockSkew, stamp + ClockSkew] (stamp
// when either is unknown). Symmetric: the writer's latest stamp seen may
// come from another stream's leader whose clock is ahead of this
// stream's, and within the margin it must be read as written, or the
// writer's own apply and every replica's would disagree (found in
// review).
func (s *server) dateOf(written, stamp time.Time) time.Time {
	switch {
	case stamp.IsZero():
		return written
	case written.IsZero():
		return stamp
	case written.After(stamp.Add(s.cfg.ClockSkew)):
		return stamp.Add(s.cfg.ClockSkew)
	case written.Before(stamp.Add(-s.cfg.ClockSkew)):
		return stamp.Add(-s.cfg.ClockSkew)
	default:
		return written
	}
}

// catchUp reads a node's ledger subject from the last sequence applied, so
// that the ledger holds every entry the subject holds now. It is what a
// lost compare-and-set calls before verifying again.
func (s *server) catchUp(ctx context.Context, node string) error {
	s.mu.Lock()
	last := s.led.LastSeq(node)
	s.mu.Unlock()
	_, err := s.bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamAllocations,
		FilterSubjects: []string{contracts.SubjectLedger(node)}, StartSeq: last + 1}, s.onLedgerMsg)
	if err != nil {
		return fmt.Errorf("catch up ledger of node %s: %w", node, err)
	}
	return nil
}

// errGaveUp: a ledger write kept losing its compare-and-set.
var errGaveUp = errors.New("compare-and-set kept failing")

// write publishes a ledger entry on its node's subject expecting the last
// sequence the ledger applied there, and applies it. check, run under the
// node's lock against the latest ledger before each attempt, says whether
// the write is still wanted (ok) and, when not, why (a verdict for the
// caller). A lost compare-and-set catches up with the subject and tries
// again, at most CommitAttempts times (then errGaveUp). wrote says whether
// this call stored the entry. An error other than errGaveUp is transient.
func (s *server) write(ctx context.Context, e contracts.LedgerEntry, check func() (ledger.Verdict, bool)) (v ledger.Verdict, wrote bool, err error) {
	node := e.Allocation.NodeID
	// The entry continues its job's trace; the plan or fact that caused it is a link.
	ctx, span := telemetry.StartJobSpan(ctx, s.bus.Tracer(), "ledger "+string(e.Kind)+" "+e.Allocation.JobID, e.Allocation.TraceParent,
		telemetry.AllocAttrs(e.Allocation.Tenant, e.Allocation.JobID, node, e.Allocation.Attempt)...)
	defer span.End()
	unlock := s.lockNode(node, e.Kind == contracts.LedgerCommitted)
	defer unlock()
	// Built only when something is logged: a steady load writes two
	// entries a job, and With formatted its attributes for every one.
	log := func() *slog.Logger {
		return s.log.With("node_id", node, "alloc_id", e.Allocation.ID, "kind", string(e.Kind))
	}
	debug := s.log.Enabled(ctx, slog.LevelDebug)
	id := contracts.LedgerEntryID(e.Kind, e.Allocation.ID)
	subject := contracts.SubjectLedger(node)
	stored := false // some attempt found this entry ID already stored
	for attempt := 1; ; attempt++ {
		s.mu.Lock()
		v, ok := check()
		last := s.led.LastSeq(node)
		// NATS time as last seen (observe), never before what the log
		// holds: after a restart from a snapshot the first stamps seen
		// may be old ones (found in review).
		date := later(s.seen(), later(s.led.Clock(), s.refused.Clock()))
		s.mu.Unlock()
		if !ok {
			return v, false, nil
		}
		if attempt > s.cfg.CommitAttempts {
			if stored {
				// Not errGaveUp: the entry exists, so the caller must not
				// answer as if nothing had been written.
				return v, false, fmt.Errorf("%s on node %s: stored, but not yet readable after %d attempts", id, node, s.cfg.CommitAttempts)
			}
			return v, false, fmt.Errorf("%w: %s on node %s after %d attempts", errGaveUp, id, node, s.cfg.CommitAttempts)
		}
		e.Time = date
		if e.Kind == contracts.LedgerCommitted {
			s.failpoint(FailAfterVerify)
		}
		if !s.leading() {
			// Checked last, right before the publish: a leader frozen
			// past its lease finds it over here when it thaws. What
			// slips between this check and the publish meets the
			// compare-and-set.
			log().Warn("ledger write refused: lease term over", "expected_seq", last)
			return v, false, errDeposed
		}
		ack, err := s.bus.Publish(ctx, subject, id, e, bus.ExpectLastSubjectSeq(last), bus.CESubject(e.Allocation.ID))
		switch {
		case errors.Is(err, bus.ErrWrongLastSequence):
			// Another writer got there first: read what it wrote, check again.
			if debug {
				log().Debug("ledger compare-and-set conflict", "expected_seq", last, "attempt", attempt)
			}
			if err := s.catchUp(ctx, node); err != nil {
				return v, false, err
			}
		case err != nil:
			return v, false, err
		case ack.Duplicate:
			// This very entry ID is stored already (a redelivered plan
			// after a crash, or a replica with the same idea), perhaps on
			// another node's subject: read it in, then check again.
			if debug {
				log().Debug("ledger entry already stored", "stream_seq", ack.Sequence)
			}
			stored = true
			if err := s.catchUpStored(ctx, ack.Sequence, node); err != nil {
				return v, false, err
			}
		default:
			if e.Kind == contracts.LedgerCommitted {
				s.failpoint(FailAfterCommit)
			}
			s.apply(log, e, ack.Sequence)
			if debug {
				log().Debug("ledger entry written", "stream_seq", ack.Sequence)
			}
			return v, true, nil
		}
	}
}

// catchUpStored catches up the subject of the ledger message stored at seq,
// and node's.
func (s *server) catchUpStored(ctx context.Context, seq uint64, node string) error {
	stream, err := s.bus.JetStream().Stream(ctx, contracts.StreamAllocations)
	if err != nil {
		return fmt.Errorf("allocations stream: %w", err)
	}
	msg, err := stream.GetMsg(ctx, seq)
	if err != nil {
		return fmt.Errorf("get ledger message %d: %w", seq, err)
	}
	if other := contracts.Token(msg.Subject, 3); other != node && other != "" {
		if err := s.catchUp(ctx, other); err != nil {
			return err
		}
	}
	return s.catchUp(ctx, node)
}

// commit verifies a plan item against the latest ledger and commits it. The
// verdict is OK when this call committed it, Duplicate when it was already
// committed, a refusal otherwise (commit_conflict when the compare-and-set
// kept failing). An error is transient: the plan is to be redelivered.
func (s *server) commit(ctx context.Context, a contracts.Allocation) (ledger.Verdict, error) {
	return s.commitFenced(ctx, a, 0, time.Time{})
}

// commitFenced is commit for an item of a plan made at epoch and stored
// at planned (zero: not a plan's item, never expired): unless it is already committed (Duplicate), it is refused with
// stale_epoch when a newer epoch of its scheduler is known, and with
// plan_expired when the plan is PlanMaxAge old (planExpired), both
// checked under the node lock right before each compare-and-set.
func (s *server) commitFenced(ctx context.Context, a contracts.Allocation, epoch uint64, planned time.Time) (ledger.Verdict, error) {
	s.observe(planned)
	s.mu.Lock()
	v := s.led.Verify(a)
	s.mu.Unlock()
	if v.Reason == contracts.RefusedInvalidPlan {
		// Malformed items never reach a node lock or a subject. Every
		// other verdict is taken again under the node lock below: a write
		// to the node may be stored (and seen by the scheduler) but not yet
		// applied here while another goroutine holds that lock, so a
		// verdict taken outside it can refuse a device just released.
		return v, nil
	}
	if v.Reason == contracts.RefusedAlreadyPlaced {
		// The job's earlier attempt may be released in the stream and not
		// read here yet: the scheduler places the next attempt as soon as
		// it reads the release, and this manager's own writer applies a
		// release only after its publish is acknowledged, on another
		// node's lock (or another replica wrote it, and the follow has not
		// read it). Under load that refused the next attempt for nothing
		// (seen in CI: a drained job's attempt 2, job_already_allocated).
		// Read the nodes of the attempts in the way first; the verdict is
		// taken again under the node lock below.
		s.mu.Lock()
		nodes := s.led.OtherAttemptNodes(a)
		s.mu.Unlock()
		for _, n := range nodes {
			if err := s.catchUp(ctx, n); err != nil {
				return v, err
			}
		}
	}
	if v.Reason == contracts.RefusedUnknownNode || v.Reason == contracts.RefusedNodeNotReady {
		// The node may be in NODES already, only not read yet here. A
		// failed read is transient: the plan comes again.
		if err := s.catchUpNode(ctx, a.NodeID); err != nil {
			return v, err
		}
	}
	e := contracts.LedgerEntry{SchemaVersion: contracts.SchemaVersion, Kind: contracts.LedgerCommitted, Allocation: a}
	v, _, err := s.write(ctx, e, func() (ledger.Verdict, bool) {
		v := s.led.Verify(a)
		// A stale epoch is the answer whatever else the ledger would say,
		// but for a commit already stored (a redelivered plan must get
		// Duplicate, never a contrary refusal): with plans decided at once
		// (PlanWorkers), a deposed leader's plan may be verified after its
		// successor's took the same devices, and its answer must not
		// depend on which came first.
		if !v.Duplicate {
			if fv, ok := s.fenceCheck(a.Scheduler, epoch); !ok {
				return fv, false
			}
		}
		if v.OK() && s.planExpired(planned) {
			return ledger.Verdict{Reason: contracts.RefusedPlanExpired, Message: fmt.Sprintf(
				"plan made at %s is older than %s by the ledger's clock: placing the job again is safe, committing this item may not be",
				planned.UTC().Format(time.RFC3339), s.cfg.PlanMaxAge)}, false
		}
		return v, v.OK()
	})
	if errors.Is(err, errGaveUp) {
		// Every attempt was refused by the compare-and-set, so nothing of
		// ours was stored: a refusal is the truth, and the scheduler
		// retries on its fresher view.
		return ledger.Verdict{Reason: contracts.RefusedCommitConflict, Message: err.Error()}, nil
	}
	return v, err
}

// release writes the released entry of a live allocation; nothing when it
// is not live (never committed, or released already).
func (s *server) release(ctx context.Context, id string, reason contracts.Reason, run *contracts.RunResult) error {
	s.mu.Lock()
	a, live, _ := s.led.Allocation(id)
	s.mu.Unlock()
	if !live {
		return nil
	}
	e := contracts.LedgerEntry{SchemaVersion: contracts.SchemaVersion, Kind: contracts.LedgerReleased,
		Allocation: a, Reason: reason, Run: run}
	_, wrote, err := s.write(ctx, e, func() (ledger.Verdict, bool) {
		_, live, _ := s.led.Allocation(id)
		return ledger.Verdict{}, live
	})
	if err != nil || !wrote {
		return err
	}
	s.log.Info("allocation released", "alloc_id", id, "node_id", a.NodeID, "reason", string(reason))
	return nil
}
