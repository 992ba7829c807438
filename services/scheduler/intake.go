package scheduler

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/telemetry"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

// consumeRequests runs the intake: the requests that have arrived are
// decided in stream order and their answers sent together, each acked once
// its answer is stored (bus.ConsumePipelined), so a burst of submits costs
// about one publish round trip per batch instead of one per submit. A
// job's own requests (requestKey) never overlap: its cancel is handled
// after its submit's answer is stored.
func (s *scheduler) consumeRequests(ctx context.Context) error {
	return s.bus.ConsumePipelined(ctx, bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: RequestsConsumer,
		FilterSubjects: []string{contracts.SubjectSubmitAll, contracts.SubjectCancelAll},
		Batch:          s.cfg.IntakeBatch, MaxAckPending: max(1000, 4*s.cfg.IntakeBatch), Key: requestKey,
		Prepare: prepareRequest}, s.startRequest)
}

// prepareRequest parses a submit on one of the bus's prepare goroutines
// (bus.ConsumerSpec.Prepare): decoding and validating a request was half
// of the one intake goroutine's CPU in a burst on a 16-core host, where
// that goroutine bounds how fast submits are queued.
func prepareRequest(m *bus.Msg) any {
	if isSubmit(m.Subject) {
		return state.ParseSubmit(m.Subject, m.Data)
	}
	return nil
}

// isSubmit reports whether subject is a job submit's (else a cancel's).
func isSubmit(subject string) bool { return strings.HasPrefix(subject, contracts.SubjectSubmit("")) }

// startRequest starts handling one request; the wait it returns gives
// the request's fate (handleRequest's). Submits are answered with an
// async publish; cancels, rare, are handled before it returns.
func (s *scheduler) startRequest(ctx context.Context, m *bus.Msg) func() error {
	if !isSubmit(m.Subject) {
		err := s.handleRequest(ctx, m)
		return func() error { return err }
	}
	wait := s.startSubmit(ctx, m)
	return func() error {
		err := wait()
		if err == nil && !s.term.Valid() {
			// As handleRequest: the next leader may have rebuilt without
			// this answer; it publishes the same event ID again.
			return fmt.Errorf("leadership lost while handling %s", m.Subject)
		}
		return err
	}
}

// startSubmit decides a submit and sends its answer without waiting for
// the ack; the wait it returns records the answer in the store once it is
// stored (or abandons it, for a redelivery to decide again).
//
// A submit that names a job the store may have forgotten (state/recall.go)
// is deferred: its reads of JOB_EVENTS start at once, beside the next
// messages' starts, and it is decided when the first wait of the batch
// runs (decideDeferred), with every submit started after it, in stream
// order. So a batch's reads overlap instead of costing a round trip each
// in turn, and no submit is decided before one that arrived earlier. (A
// cancel is handled when it starts, so possibly before earlier submits
// of other jobs: it changes nothing they decide. One of the same job
// waits for its submit's answer: requestKey.)
func (s *scheduler) startSubmit(ctx context.Context, m *bus.Msg) func() error {
	// Decoded before the lock (a cycle may hold it meanwhile), mostly
	// already, on a prepare goroutine.
	parsed, ok := m.Prepared.(state.ParsedSubmit)
	if !ok {
		parsed = state.ParseSubmit(m.Subject, m.Data)
	}
	sub, d, need := s.startDecision(ctx, m, parsed)
	if d == nil {
		return s.answerSubmit(ctx, m, sub)
	}
	if len(need) == 0 {
		close(d.read)
	} else {
		go func() {
			defer close(d.read)
			defer func() {
				if r := recover(); r != nil {
					d.readErr = fmt.Errorf("reading %v: panic: %v", need, r)
				}
			}()
			d.readErr = s.recall(ctx, &d.parsed, need)
		}()
	}
	return func() error {
		s.decideDeferred()
		return d.wait()
	}
}

// startDecision decides the submit now, unless submits before it wait
// for the log or it must itself: then it joins them, deferred (d), with
// what it needs read.
func (s *scheduler) startDecision(ctx context.Context, m *bus.Msg, parsed state.ParsedSubmit) (sub state.Submission, d *deferredSubmit, need []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.deferred) == 0 && !s.deciding {
		if sub = s.st.SubmitParsed(parsed, m.StreamSeq); len(sub.Recall) == 0 {
			return sub, nil, nil
		}
		need = sub.Recall
	} else {
		need = s.st.NeedsLog(parsed, m.StreamSeq)
	}
	d = &deferredSubmit{ctx: ctx, m: m, parsed: parsed, read: make(chan struct{}),
		wait: func() error { return errNotDecided }}
	s.deferred = append(s.deferred, d)
	return state.Submission{}, d, need
}

// errNotDecided fails a deferred submit left undecided (none should be):
// it is redelivered, not dead-lettered.
var errNotDecided = errors.New("job request not decided")

// deferredSubmit is a submit started and not decided yet (startSubmit).
type deferredSubmit struct {
	ctx     context.Context
	m       *bus.Msg
	parsed  state.ParsedSubmit
	read    chan struct{} // closed once its reads are done
	readErr error
	wait    func() error // set once decided
}

// decideDeferred decides every deferred submit, in the order started. A
// submit after one whose read failed is not decided (it is redelivered
// with it): deciding it first could answer it from a log that lacks the
// earlier request's job.
func (s *scheduler) decideDeferred() {
	s.mu.Lock()
	ds := s.deferred
	s.deferred = nil
	s.deciding = len(ds) > 0
	s.mu.Unlock()
	if len(ds) == 0 {
		return
	}
	defer func() {
		s.mu.Lock()
		s.deciding = false
		s.mu.Unlock()
	}()
	var failed error
	for _, d := range ds {
		<-d.read
		if failed == nil && d.readErr != nil {
			failed = d.readErr
			s.log.Warn("job request waits for the log", "subject", d.m.Subject, "stream_seq", d.m.StreamSeq, "err", failed)
		}
		if failed != nil {
			err := fmt.Errorf("job request after one whose read of %s failed: %w", contracts.StreamJobEvents, failed)
			d.wait = func() error { return err }
			continue
		}
		if err := s.decideOne(d); err != nil {
			failed = err // a read failed: the rest wait, their order kept
		}
	}
}

// decideOne decides d. A decision that panics fails d for good (as
// bus.ConsumePipelined fails a message whose handler panics), not the
// message whose wait runs the decisions, and the next are decided (the
// lock is released). It returns the error of a read of the log that
// failed: the next wait for it.
func (s *scheduler) decideOne(d *deferredSubmit) (readErr error) {
	defer func() {
		if r := recover(); r != nil {
			err := bus.Permanent(fmt.Errorf("deciding job request: panic: %v", r))
			d.wait, readErr = func() error { return err }, nil
		}
	}()
	d.wait, readErr = s.decideSubmit(d.ctx, d.m, d.parsed)
	return readErr
}

// decideSubmit decides a parsed submit, reading what it names from the
// log as long as the store asks, and sends its answer. A read that fails
// is returned too (readErr), besides failing the request.
func (s *scheduler) decideSubmit(ctx context.Context, m *bus.Msg, parsed state.ParsedSubmit) (wait func() error, readErr error) {
	submit := func() state.Submission {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.st.SubmitParsed(parsed, m.StreamSeq)
	}
	sub := submit()
	for tries := 0; len(sub.Recall) > 0; tries++ {
		// It names jobs the store may have forgotten: read them, outside
		// the lock, and decide again. A store that forgets more between
		// the two asks again (rarely).
		err := error(nil)
		if tries == 3 {
			err = fmt.Errorf("jobs %v still unknown after %d reads of %s", sub.Recall, tries, contracts.StreamJobEvents)
		} else {
			err = s.recall(ctx, &parsed, sub.Recall)
		}
		if err != nil {
			s.log.Warn("job request waits for the log", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
			return func() error { return err }, err // redelivered after a backoff
		}
		sub = submit()
	}
	return s.answerSubmit(ctx, m, sub), nil
}

// answerSubmit sends the answer the store decided. Should it panic once
// the store has accepted the answer, the store lets the decision go
// (Abandoned) before the panic goes on: else the request would hold back
// every job after it.
func (s *scheduler) answerSubmit(ctx context.Context, m *bus.Msg, sub state.Submission) (wait func() error) {
	locked := func(f func()) {
		s.mu.Lock()
		defer s.mu.Unlock()
		f()
	}
	handed := false
	defer func() {
		if r := recover(); r != nil {
			if !handed {
				locked(sub.Abandoned)
			}
			panic(r)
		}
	}()
	switch {
	case sub.Invalid != nil:
		// No tenant to answer under: answer on the reserved one, then
		// park it for operators.
		err := s.answerInvalid(ctx, m, sub.Invalid)
		if err == nil {
			s.log.Warn("job request on a subject naming no valid tenant: rejected on "+contracts.RejectedSubject(m.StreamSeq)+
				" and dead-lettered", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", sub.Invalid)
			err = bus.Permanent(sub.Invalid)
		}
		return func() error { return err }
	case sub.Publish == nil:
		s.log.Debug("job request changes nothing", "subject", m.Subject, "stream_seq", m.StreamSeq, "outcome", sub.Outcome)
		return func() error { return nil }
	}
	p := sub.Publish
	// The job's trace is this delivery's: what the scheduler publishes
	// about the job later continues it (traces.go).
	if tenant, job, ok := strings.Cut(p.Key, "/"); ok {
		ctx = telemetry.WithAttrs(ctx, telemetry.JobAttrs(tenant, job)...)
		telemetry.Annotate(ctx, telemetry.JobAttrs(tenant, job)...)
		if ev, isEv := p.Msg.(contracts.JobEvent); !isEv || !ev.State.Terminal() {
			s.traces.remember(p.Key, telemetry.TraceParent(ctx))
		}
	}
	pending, err := s.bus.PublishAsync(ctx, p.Subject, p.ID, p.Msg, bus.CESubject(p.Key))
	handed = true
	return func() error {
		var ack *jetstream.PubAck
		if err == nil {
			ack, err = pending.Wait(ctx)
		}
		if err != nil {
			locked(sub.Abandoned)
			return fmt.Errorf("publish %s: %w", p.ID, err)
		}
		locked(func() { sub.Published(ack.Sequence) })
		s.log.Debug("job request handled", "subject", m.Subject, "stream_seq", m.StreamSeq, "outcome", sub.Outcome, "event", p.ID)
		return nil
	}
}

// recall reads the jobs with store keys keys from the log and hands
// what each says to p.
func (s *scheduler) recall(ctx context.Context, p *state.ParsedSubmit, keys []string) error {
	for _, key := range keys {
		r, err := s.readJob(ctx, key)
		if err != nil {
			return err
		}
		p.Recall(key, r)
	}
	return nil
}

// readJobTimeout bounds one job's read: a log that does not answer fails
// the request (redelivered after a backoff) rather than hold the intake.
const readJobTimeout = 15 * time.Second

// readJob reads the job with store key key from its subject of
// JOB_EVENTS (bus.SubjectMsgs: direct gets, no consumer) until the job
// ended (RecallFold: nothing after an end changes it). A job never
// submitted, the usual answer, costs one get; a job that waited long has
// a pending event a minute and costs that many, but such a read is rare:
// a resubmit of an ID that ended more than -remember-ended ago. A replica
// behind the leader may answer; that is harmless here, since every job
// read either ended long ago or was never submitted.
func (s *scheduler) readJob(ctx context.Context, key string) (state.Recalled, error) {
	ctx, cancel := context.WithTimeout(ctx, readJobTimeout)
	defer cancel()
	tenant, id, _ := strings.Cut(key, "/")
	fold := state.NewRecallFold(tenant, id)
	err := s.bus.SubjectMsgs(ctx, contracts.StreamJobEvents, contracts.SubjectJobEvents(tenant, id), func(m *bus.Msg) bool {
		var ev contracts.JobEvent
		return m.Decode(&ev) == nil && fold.Add(ev) // one a replay skips, skipped
	})
	if err != nil {
		return state.Recalled{}, fmt.Errorf("job %s: %w", key, err)
	}
	r := fold.Recalled()
	if s.cfg.recalled != nil {
		s.cfg.recalled(key, r)
	}
	return r, nil
}

// recallMissing reads back the dependencies of live jobs that the store
// does not hold: after a rebuild every live job's (all:
// state.Store.MissingDependencies), and now and then while live, as a net
// under the pins, those the cycles found missing (state.Store.TakeMissing).
func (s *scheduler) recallMissing(ctx context.Context, all bool) error {
	s.mu.Lock()
	var missing []string
	if all {
		missing = s.st.MissingDependencies()
	} else {
		missing = s.st.TakeMissing()
	}
	s.mu.Unlock()
	for _, key := range missing {
		r, err := s.readJob(ctx, key)
		if err != nil {
			return fmt.Errorf("dependency %s of a live job: %w", key, err)
		}
		s.mu.Lock()
		s.st.Remember(key, r)
		s.mu.Unlock()
	}
	return nil
}
