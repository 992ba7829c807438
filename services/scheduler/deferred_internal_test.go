package scheduler

import (
	"errors"
	"testing"

	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

// TestADeferredDecisionThatPanicsFailsOnlyItself: deferred submits are
// decided together in the wait of the first (decideDeferred). One whose
// decision panics (here: a scheduler without a store) fails for good by
// itself, the lock is released, and those after it are left undecided,
// to be redelivered in order, not dead-lettered. (From a review: the
// panic failed the message whose wait ran the decisions and left the
// lock held.)
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
	if err := ds[0].wait(); !bus.IsPermanent(err) {
		t.Errorf("the submit whose decision panicked: %v, want a permanent failure", err)
	}
	for _, d := range ds[1:] {
		if err := d.wait(); !errors.Is(err, errNotDecided) || bus.IsPermanent(err) {
			t.Errorf("a submit after it: %v, want %v (redelivered)", err, errNotDecided)
		}
	}
	if len(s.deferred) != 0 {
		t.Errorf("%d submits still deferred", len(s.deferred))
	}
}
