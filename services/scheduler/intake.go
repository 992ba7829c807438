package scheduler

import (
	"context"
	"fmt"
	"strings"

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
		Batch:          s.cfg.IntakeBatch, MaxAckPending: max(1000, 4*s.cfg.IntakeBatch), Key: requestKey}, s.startRequest)
}

// startRequest starts handling one request; the wait it returns gives
// the request's fate (handleRequest's). Submits are answered with an
// async publish; cancels, rare, are handled before it returns.
func (s *scheduler) startRequest(ctx context.Context, m *bus.Msg) func() error {
	if !strings.HasPrefix(m.Subject, "gp.jobs.submit.") {
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
func (s *scheduler) startSubmit(ctx context.Context, m *bus.Msg) func() error {
	// Decoded before the lock: a cycle may hold it meanwhile.
	parsed := state.ParseSubmit(m.Subject, m.Data)
	s.mu.Lock()
	sub := s.st.SubmitParsed(parsed, m.StreamSeq)
	s.mu.Unlock()
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
	return func() error {
		var ack *jetstream.PubAck
		if err == nil {
			ack, err = pending.Wait(ctx)
		}
		if err != nil {
			s.mu.Lock()
			sub.Abandoned()
			s.mu.Unlock()
			return fmt.Errorf("publish %s: %w", p.ID, err)
		}
		s.mu.Lock()
		sub.Published(ack.Sequence)
		s.mu.Unlock()
		s.log.Debug("job request handled", "subject", m.Subject, "stream_seq", m.StreamSeq, "outcome", sub.Outcome, "event", p.ID)
		return nil
	}
}
