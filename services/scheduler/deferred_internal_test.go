package scheduler

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

// TestADeferredDecisionThatPanicsFailsOnlyItself: deferred submits are
// decided together in the wait of the first (decideDeferred). One whose
// decision panics (here: a scheduler without a store, so every one does)
// fails for good by itself, the lock is released each time, and the next
// are decided still, in order. (From a review: the panic failed the
// message whose wait ran the decisions and left the lock held.)
func TestADeferredDecisionThatPanicsFailsOnlyItself(t *testing.T) {
	s := &scheduler{log: testLogger(t)}
	var ds []*deferredSubmit
	for i := range 3 {
		d := &deferredSubmit{m: &bus.Msg{Subject: "gp.jobs.submit.acme", StreamSeq: uint64(i + 1)},
			parsed: state.ParseSubmit("gp.jobs.submit.acme", []byte(`{"id":"j"}`)), read: make(chan struct{}),
			wait: func() error { return errNotDecided }}
		close(d.read)
		ds = append(ds, d)
	}
	s.deferred = ds
	s.decideDeferred()
	if !s.mu.TryLock() {
		t.Fatal("the scheduler's lock is still held after a decision panicked")
	}
	s.mu.Unlock()
	for i, d := range ds {
		if err := d.wait(); !bus.IsPermanent(err) || errors.Is(err, errNotDecided) {
			t.Errorf("submit %d, whose decision panicked: %v, want its own permanent failure", i, err)
		}
	}
	if len(s.deferred) != 0 {
		t.Errorf("%d submits still deferred", len(s.deferred))
	}
}

// TestAFailedReadHoldsBackTheSubmitsAfterIt: a deferred submit whose read
// of the log fails is redelivered, and so is every submit after it,
// undecided: deciding them first could reject a job that depends on it
// as unknown. Those before it are decided.
func TestAFailedReadHoldsBackTheSubmitsAfterIt(t *testing.T) {
	s := &scheduler{log: testLogger(t)}
	boom := errors.New("log unavailable")
	var ds []*deferredSubmit
	for i := range 3 {
		d := &deferredSubmit{m: &bus.Msg{Subject: "gp.jobs.submit.acme", StreamSeq: uint64(i + 1)},
			parsed: state.ParseSubmit("gp.jobs.submit.acme", []byte(`{"id":"j"}`)), read: make(chan struct{}),
			wait: func() error { return errNotDecided }}
		if i == 1 {
			d.readErr = boom
		}
		close(d.read)
		ds = append(ds, d)
	}
	s.deferred = ds
	s.decideDeferred()
	if err := ds[0].wait(); !bus.IsPermanent(err) {
		t.Errorf("the submit before the failed read was not decided: %v", err) // it panics: no store
	}
	for i, d := range ds[1:] {
		if err := d.wait(); !errors.Is(err, boom) || bus.IsPermanent(err) {
			t.Errorf("submit %d: %v, want a retryable %v", i+1, err, boom)
		}
	}
}

// TestASubmitStartedWhileDeferredOnesAreDecidedJoinsThem: the intake
// starts the next group of requests while the last one settles, so a
// submit can start while decideDeferred is deciding the ones it took. It
// must join the deferred ones, not be decided at once: decided first, a
// job depending on one of them would be rejected as unknown.
func TestASubmitStartedWhileDeferredOnesAreDecidedJoinsThem(t *testing.T) {
	s := &scheduler{log: testLogger(t), st: state.New(state.Config{})}
	body := []byte(`{"id":"j"}`)
	d0 := &deferredSubmit{m: &bus.Msg{Subject: "gp.jobs.submit.acme", StreamSeq: 1},
		parsed: state.ParseSubmit("gp.jobs.submit.acme", body), read: make(chan struct{}),
		wait: func() error { return errNotDecided }}
	s.deferred = []*deferredSubmit{d0}
	decided := make(chan struct{})
	go func() {
		defer close(decided)
		s.decideDeferred() // waits for d0's read
	}()
	for deciding := false; !deciding; {
		s.mu.Lock()
		deciding = s.deciding
		s.mu.Unlock()
		time.Sleep(time.Millisecond)
	}
	m1 := &bus.Msg{Subject: "gp.jobs.submit.acme", StreamSeq: 2}
	_, d1, _ := s.startDecision(context.Background(), m1, state.ParseSubmit(m1.Subject, body))
	if d1 == nil {
		t.Fatal("a submit started while earlier ones were being decided was decided at once")
	}
	close(d1.read)
	close(d0.read)
	<-decided
	if err := d0.wait(); errors.Is(err, errNotDecided) {
		t.Errorf("the earlier submit was not decided: %v", err)
	}
	s.decideDeferred() // d1's own wait
	if err := d1.wait(); errors.Is(err, errNotDecided) {
		t.Errorf("the later submit was not decided by its own wait: %v", err)
	}
	if len(s.deferred) != 0 || s.deciding {
		t.Errorf("%d still deferred, deciding %v", len(s.deferred), s.deciding)
	}
}
