package scheduler

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

// TestForgottenJobsAreReadBackFromTheLog runs the scheduler on a real
// NATS server with ended jobs forgotten a few hundred milliseconds after
// their end (RememberEnded; 48h at least in service). Once they are, every
// request that names one is decided from JOB_EVENTS, read by the scheduler
// itself (direct gets of the job's subject, each event decoded as a
// replay decodes it): an identical resubmit changes nothing, another body
// is a duplicate_job_id, a job depending on a forgotten success runs, one
// depending on a forgotten rejection is rejected, one depending on a
// forgotten cancel is cancelled. A waiting job pins what it depends on,
// across a restart from the snapshot.
func TestForgottenJobsAreReadBackFromTheLog(t *testing.T) {
	e := newEnv(t)
	e.cfg.RetainEnded, e.cfg.RetainEndedMax = time.Nanosecond, 0
	e.cfg.RememberEnded, e.cfg.shortMemory = 300*time.Millisecond, true
	e.cfg.retireEvery = 20 * time.Millisecond
	e.cfg.SnapshotInterval = 20 * time.Millisecond
	var mu sync.Mutex
	recalled := map[string]contracts.JobState{}
	reads := map[string]int{}
	e.cfg.recalled = func(key string, r state.Recalled) {
		mu.Lock()
		recalled[key] = r.State()
		if r.Found {
			reads[key]++ // a new ID is read too, once, and not found
		}
		mu.Unlock()
	}
	readsOf := func(id string) int {
		mu.Lock()
		defer mu.Unlock()
		return reads[state.Key("acme", id)]
	}
	wasRecalled := func(id string) (contracts.JobState, bool) {
		mu.Lock()
		defer mu.Unlock()
		st, ok := recalled[state.Key("acme", id)]
		return st, ok
	}
	e.inventory("n1", "default", h100, 8)
	e.autoCommit()
	e.start()

	done := request("done", 1, h100)
	done.Labels = map[string]string{"team": "vision", "note": "é\u2028<&>"}
	done.Run.Image, done.Run.Env = "registry.example/train:1", map[string]string{"LR": "0.1"}
	e.submit("acme", done)
	a := e.waitItem("acme", "done", 1, "")
	e.runStarted(a, time.Now().UTC())
	res := contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: time.Now().UTC(), EndedAt: time.Now().UTC()}
	e.runEnded(a, res)
	e.release(a, contracts.ReasonRunEnded, &res)
	e.waitEvent("acme", "done", contracts.EventSucceeded)
	bad := request("bad", 1, h100)
	bad.Priority = "urgent"
	e.submit("acme", bad)
	e.waitEvent("acme", "bad", contracts.EventRejected)
	e.submit("acme", request("gone", 64, h100))
	e.waitEvent("acme", "gone", contracts.EventQueued)
	e.cancel("acme", "gone")
	e.waitEvent("acme", "gone", contracts.EventCancelled)

	// Resubmit each unchanged (new message IDs: JOBS would drop the same
	// one as a duplicate) until the scheduler has read all three back.
	n := 0
	resubmit := func(id string, r contracts.JobRequest) {
		n++
		e.publish(contracts.SubjectSubmit("acme"), fmt.Sprintf("again-%s-%d", id, n), r)
	}
	before := map[string]int{}
	for _, id := range []string{"done", "bad", "gone"} {
		before[id] = len(e.jobEvents("acme", id))
	}
	eventually(t, "the three ended jobs forgotten and read back", func() bool {
		resubmit("done", done)
		resubmit("bad", bad)
		resubmit("gone", request("gone", 64, h100))
		e.barrier("acme")
		_, d := wasRecalled("done")
		_, b := wasRecalled("bad")
		_, g := wasRecalled("gone")
		return d && b && g
	})
	for id, want := range map[string]contracts.JobState{"done": contracts.StateSucceeded, "bad": contracts.StateRejected,
		"gone": contracts.StateCancelled} {
		if st, _ := wasRecalled(id); st != want {
			t.Errorf("%s read back from the log as %q, want %q", id, st, want)
		}
		if got := len(e.jobEvents("acme", id)); got != before[id] {
			t.Errorf("%s: identical resubmits of a forgotten job published %d events (%v)", id, got-before[id], e.types("acme", id))
		}
	}

	// Another body under a forgotten ID.
	other := request("done", 2, h100)
	resubmit("done", other)
	dup := e.waitEvent("acme", "done", contracts.EventRejected)
	if dup.Reason != contracts.ReasonDuplicateJobID || !strings.Contains(dup.Message, "state succeeded") {
		t.Errorf("another body under a forgotten ID: %s %q", dup.Reason, dup.Message)
	}
	// New jobs arriving together while the store forgets are decided in
	// arrival order (their reads overlap): one depending on the one
	// before it, both new, is accepted.
	for i := range 20 {
		first, second := request(fmt.Sprintf("first-%d", i), 64, h100), request(fmt.Sprintf("second-%d", i), 64, h100)
		second.DependsOn = []string{first.ID}
		e.submit("acme", first)
		e.submit("acme", second)
	}
	for i := range 20 {
		if ev := e.waitEvent("acme", fmt.Sprintf("second-%d", i), contracts.EventQueued); ev.Type != contracts.EventQueued {
			t.Fatalf("second-%d: %s", i, ev.Type)
		}
		for _, ev := range e.jobEvents("acme", fmt.Sprintf("second-%d", i)) {
			if ev.Type == contracts.EventRejected {
				t.Fatalf("second-%d, submitted right after the job it depends on: rejected %s %q", i, ev.Reason, ev.Message)
			}
		}
	}
	// Dependencies on forgotten jobs.
	after := request("after", 1, h100)
	after.DependsOn = []string{"done"}
	e.submit("acme", after)
	e.waitItem("acme", "after", 1, "")
	onBad := request("on-bad", 1, h100)
	onBad.DependsOn = []string{"bad"}
	e.submit("acme", onBad)
	if ev := e.waitEvent("acme", "on-bad", contracts.EventRejected); ev.Reason != contracts.ReasonDependencyRejected {
		t.Errorf("a job depending on a forgotten rejected job: %s %q", ev.Reason, ev.Message)
	}
	onGone := request("on-gone", 1, h100)
	onGone.DependsOn = []string{"gone"}
	e.submit("acme", onGone)
	if ev := e.waitEvent("acme", "on-gone", contracts.EventCancelled); ev.Reason != contracts.ReasonDependencyFailed {
		t.Errorf("a job depending on a forgotten cancelled job: %s %q", ev.Reason, ev.Message)
	}
	// A job that waits (it never fits) pins what it depends on beyond
	// RememberEnded, and across a restart: "done", read back from the log,
	// and "fresh", which it depends on before it was ever forgotten.
	fresh := request("fresh", 1, h100)
	e.submit("acme", fresh)
	a = e.waitItem("acme", "fresh", 1, "")
	e.runStarted(a, time.Now().UTC())
	e.runEnded(a, res)
	e.release(a, contracts.ReasonRunEnded, &res)
	e.waitEvent("acme", "fresh", contracts.EventSucceeded)
	waiter := request("waiter", 64, h100)
	waiter.DependsOn = []string{"done", "fresh"}
	e.submit("acme", waiter)
	e.waitEvent("acme", "waiter", contracts.EventPending)
	// Long past their time only the pins keep them: an identical
	// resubmit is answered from memory, without reading the log.
	pinned := func(when string) {
		t.Helper()
		was := readsOf("done") + readsOf("fresh")
		time.Sleep(3 * e.cfg.RememberEnded)
		resubmit("done", done)
		resubmit("fresh", fresh)
		e.barrier("acme")
		if got := readsOf("done") + readsOf("fresh"); got != was {
			t.Errorf("%s: the waiting job's dependencies were forgotten (read from the log %d times more)", when, got-was)
		}
	}
	pinned("live")
	e.stop()
	e.start()
	e.barrier("acme")
	// The snapshot's compactor forgot "done" before the waiter was queued
	// (it follows the log, where "done" ended long before): the rebuild
	// reads it back once. "fresh" it kept.
	if n := readsOf("fresh"); n != 0 {
		t.Errorf("a restart forgot the waiting job's dependency fresh: read from the log %d times", n)
	}
	pinned("after a restart")
	late := request("late", 1, h100)
	late.DependsOn = []string{"done"}
	e.submit("acme", late)
	e.waitItem("acme", "late", 1, "")
	e.barrier("acme")
	for _, ev := range e.jobEvents("acme", "waiter") {
		if ev.Type == contracts.EventPending && strings.Contains(ev.Message, "not recorded") {
			t.Errorf("the waiting job lost its dependency: %q", ev.Message)
		}
	}
	if n := len(e.dead.all()); n != 0 {
		t.Errorf("%d requests dead-lettered", n)
	}
}
