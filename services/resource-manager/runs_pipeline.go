package resourcemanager

import (
	"context"

	"github.com/gpuplane/gpuplane/libs/bus"
)

// Releases beside the follow of RUNS (issue 17). Each ended run's release
// is a compare-and-set on its node's ledger subject, one round trip; the
// follow wrote them one at a time in RUNS order, so under a steady load
// (a thousand runs ending a second) the releases queued behind one
// another's round trips and the GPUs of finished runs stayed held while
// jobs waited for them. Now up to ReleaseParallelism releases are written
// at once. Nothing else changes: a release still takes its node's writer
// lock and checks, under it, that the allocation is live (a second
// release of one allocation, from a redelivered fact or the liveness
// check, writes nothing); releases of one node still go one at a time
// through that lock. What a snapshot covers stays exact: RUNS is covered
// to just below the first fact whose release is not stored yet, so a
// term cut off while releases are in flight leaves them to the next
// term's read of RUNS, as a term cut off in a single release did.

// releaseBeside runs release (the release of the ended run of RUNS
// sequence seq) on a goroutine of its own, waiting first while
// ReleaseParallelism releases are in flight, and covers seq once it is
// stored. A release cut off by ctx's end leaves seq uncovered for this
// term.
func (s *server) releaseBeside(ctx context.Context, seq uint64, release func()) {
	select {
	case s.releases <- struct{}{}:
	case <-ctx.Done():
		return // not handed over, so never covered
	}
	if ctx.Err() != nil {
		// Both were ready and the select took the slot: still not handed
		// over. Once ctx has ended no later fact is handed over either, so
		// none can cover this one.
		<-s.releases
		return
	}
	s.mu.Lock()
	s.runsReleasing[seq] = struct{}{}
	s.coverRuns(seq)
	s.sinceSnapshot++
	s.mu.Unlock()
	go func() {
		defer func() { <-s.releases }()
		release()
		if ctx.Err() != nil {
			return // perhaps not stored: stays in runsReleasing
		}
		s.mu.Lock()
		delete(s.runsReleasing, seq)
		s.coverRuns(0)
		s.mu.Unlock()
	}()
}

// coverRuns records that the run fact of RUNS sequence seq was handed
// over (0: none new) and moves runsSeq to the last sequence before which
// every fact is handled and every release stored. Under s.mu.
func (s *server) coverRuns(seq uint64) {
	s.runsHandled = max(s.runsHandled, seq)
	covered := s.runsHandled
	for r := range s.runsReleasing {
		covered = min(covered, r-1)
	}
	s.runsSeq = max(s.runsSeq, covered)
}

// releasesDone waits until no release handed to releaseBeside before it
// is in flight, or ctx ends.
func (s *server) releasesDone(ctx context.Context) {
	held := 0
	defer func() {
		for range held {
			<-s.releases
		}
	}()
	for range cap(s.releases) {
		select {
		case s.releases <- struct{}{}:
			held++
		case <-ctx.Done():
			return
		}
	}
}

// runFactHandler is onRunFact for the follow of RUNS, under the term's
// context rather than the read's: the bus ends a read's context when it
// replaces a consumer that stalled (a NATS server's death), and a release
// handed beside the follow (releaseBeside) would stop retrying with it,
// perhaps before it is stored, while the read goes on past its fact: the
// ended run's GPUs would stay held for the rest of the term. The term's
// context ends only with the term, whose successor reads RUNS again from
// what was covered.
func (s *server) runFactHandler(term context.Context) func(context.Context, *bus.Msg) error {
	return func(_ context.Context, m *bus.Msg) error { return s.onRunFact(term, m) }
}
