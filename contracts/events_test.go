package contracts

import (
	"errors"
	"testing"
	"time"
)

func TestTransition(t *testing.T) {
	tests := []struct {
		from JobState
		ev   JobEventType
		to   JobState
		ok   bool
	}{
		{StateNew, EventQueued, StateQueued, true},
		{StateNew, EventRejected, StateRejected, true},
		{StateNew, EventRunning, StateNew, false},
		{StateQueued, EventPending, StateQueued, true},
		{StateQueued, EventScheduled, StateScheduled, true},
		{StateQueued, EventRunning, StateQueued, false},
		{StateQueued, EventRejected, StateQueued, false},
		{StateScheduled, EventRunning, StateRunning, true},
		{StateScheduled, EventRequeued, StateQueued, true},
		{StateScheduled, EventPulling, StateScheduled, true},
		{StateQueued, EventPulling, StateQueued, false},
		{StateRunning, EventPulling, StateRunning, false},
		{StateRunning, EventSucceeded, StateSucceeded, true},
		{StateRunning, EventRequeued, StateQueued, true},
		{StateRunning, EventQueued, StateRunning, false},
		{StateSucceeded, EventFailed, StateSucceeded, false},
		{StateCancelled, EventRunning, StateCancelled, false},
		{StateRejected, EventQueued, StateRejected, false},
	}
	for _, tt := range tests {
		to, err := Transition(tt.from, tt.ev)
		if tt.ok != (err == nil) || to != tt.to {
			t.Errorf("Transition(%q, %s) = %q, %v; want %q ok=%v", tt.from, tt.ev, to, err, tt.to, tt.ok)
		}
		if err != nil && !errors.Is(err, ErrTransition) {
			t.Errorf("error %v does not wrap ErrTransition", err)
		}
	}
	// No event leaves a terminal state.
	for _, s := range []JobState{StateSucceeded, StateFailed, StateCancelled, StateRejected} {
		if !s.Terminal() {
			t.Errorf("%s not terminal", s)
		}
		for _, ev := range JobEventTypes {
			if _, err := Transition(s, ev); err == nil {
				t.Errorf("terminal %s accepts %s", s, ev)
			}
		}
	}
}

func TestJobStatusApplyIsIdempotent(t *testing.T) {
	now := time.Unix(1000, 0)
	req := &JobRequest{ID: "j", Name: "n"}
	var s JobStatus
	steps := []struct {
		ev  JobEvent
		seq uint64
	}{
		{JobEvent{Type: EventQueued, Tenant: "t", JobID: "j", Attempt: 1, Time: now, Request: req}, 1},
		{JobEvent{Type: EventScheduled, Attempt: 1, Time: now, Placement: &Placement{NodeID: "n1"}}, 3},
		{JobEvent{Type: EventRunning, Attempt: 1, Time: now}, 5},
	}
	for _, st := range steps {
		if err := s.Apply(st.ev, st.seq); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Apply(steps[1].ev, 3); !errors.Is(err, ErrStaleEvent) {
		t.Fatalf("re-applying seq 3: %v, want ErrStaleEvent", err)
	}
	if err := s.Apply(JobEvent{Type: EventQueued}, 9); !errors.Is(err, ErrTransition) {
		t.Fatalf("queued while running: %v, want ErrTransition", err)
	}
	if s.State != StateRunning || s.Placement.NodeID != "n1" || s.Name != "n" || s.LastSeq != 5 {
		t.Fatalf("status = %+v", s)
	}
}

// A move keeps the job running for readers: migrating and migrated change
// no state, the status keeps the latest move and counts the completed ones,
// and a redelivered migrated is not counted twice.
func TestJobStatusFollowsAMigration(t *testing.T) {
	var st JobStatus
	evs := []JobEvent{
		{Type: EventQueued, Attempt: 1},
		{Type: EventScheduled, Attempt: 1},
		{Type: EventRunning, Attempt: 1},
		{Type: EventMigrating, Attempt: 1, Reason: ReasonSpotInterruption, Migration: &Migration{Reason: ReasonSpotInterruption, FromAttempt: 1, Checkpoint: true}},
		{Type: EventRequeued, Attempt: 2, Reason: ReasonSpotInterruption},
		{Type: EventScheduled, Attempt: 2},
		{Type: EventRunning, Attempt: 2},
		{Type: EventMigrated, Attempt: 2, Reason: ReasonSpotInterruption, Migration: &Migration{Reason: ReasonSpotInterruption, FromAttempt: 1, RestoredFrom: "ckpt-3"}},
	}
	for i, ev := range evs {
		if err := st.Apply(ev, uint64(i+1)); err != nil {
			t.Fatalf("event %d (%s): %v", i, ev.Type, err)
		}
		if ev.Type == EventMigrating && st.State != StateRunning {
			t.Fatalf("migrating moved the job to %s", st.State)
		}
	}
	if err := st.Apply(evs[len(evs)-1], uint64(len(evs))); err == nil {
		t.Fatal("a redelivered migrated event was applied")
	}
	if st.State != StateRunning || st.Attempt != 2 || st.Migrations != 1 || st.Migration == nil || st.Migration.RestoredFrom != "ckpt-3" {
		t.Fatalf("status %+v", st)
	}
	if _, err := Transition(StateQueued, EventMigrated); err == nil {
		t.Fatal("migrated accepted for a queued job")
	}
}

// TestJobStatusShowsThePull: a pulling event's progress is the status's
// until the run starts.
func TestJobStatusShowsThePull(t *testing.T) {
	var s JobStatus
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	events := []JobEvent{
		{Type: EventQueued, Attempt: 1},
		{Type: EventScheduled, Attempt: 1},
		{Type: EventPulling, Attempt: 1, Pull: &PullProgress{Image: "busybox", Done: 1, Total: 4}},
		{Type: EventPulling, Attempt: 1, Pull: &PullProgress{Image: "busybox", Done: 3, Total: 4}},
	}
	for i, ev := range events {
		ev.Time = at
		if err := s.Apply(ev, uint64(i+1)); err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
	}
	if s.State != StateScheduled || s.Pull == nil || s.Pull.Done != 3 {
		t.Fatalf("status %+v: want scheduled with the last pull's progress", s)
	}
	if err := s.Apply(JobEvent{Type: EventRunning, Attempt: 1, Time: at}, 5); err != nil {
		t.Fatal(err)
	}
	if s.Pull != nil {
		t.Fatalf("a running job still shows a pull: %+v", s.Pull)
	}
}
