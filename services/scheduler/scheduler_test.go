package scheduler

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

const h100 = "H100-80GB"

func TestJobLifecycle(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.inventory("n1", "east", h100, 8)
	e.start()

	r := request("train-1", 2, h100)
	r.Name, r.Priority = "training", contracts.PriorityHigh
	e.submit("acme", r)
	q := e.waitEvent("acme", "train-1", contracts.EventQueued)
	if q.Attempt != 1 || q.State != contracts.StateQueued || q.Request == nil || q.Request.Tenant != "acme" ||
		q.Request.Priority != contracts.PriorityHigh || q.Request.Name != "training" {
		t.Fatalf("queued event %+v", q)
	}
	a := e.waitItem("acme", "train-1", 1, "")
	if a.ID != contracts.AllocationID("acme", "train-1", 1) || a.NodeID != "n1" || a.Pool != "east" || len(a.Devices) != 2 ||
		a.Scheduler != e.cfg.Name || a.Run.Duration != r.Run.Duration {
		t.Fatalf("plan item %+v", a)
	}
	e.commit(a)
	s := e.waitEvent("acme", "train-1", contracts.EventScheduled)
	if s.Placement == nil || s.Placement.AllocationID != a.ID || s.Placement.NodeID != "n1" || len(s.Placement.Devices) != 2 {
		t.Fatalf("scheduled event %+v", s)
	}
	started := time.Now().UTC().Truncate(time.Millisecond)
	e.runStarted(a, started)
	if ev := e.waitEvent("acme", "train-1", contracts.EventRunning); ev.StartedAt == nil || !ev.StartedAt.Equal(started) {
		t.Fatalf("running event %+v", ev)
	}
	ended := started.Add(30 * time.Second)
	e.runEnded(a, contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: started, EndedAt: ended})
	done := e.waitEvent("acme", "train-1", contracts.EventSucceeded)
	if done.ExitCode == nil || *done.ExitCode != 0 || !done.StartedAt.Equal(started) || !done.EndedAt.Equal(ended) {
		t.Fatalf("succeeded event %+v", done)
	}
	e.release(a, contracts.ReasonRunEnded, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: started, EndedAt: ended})

	// Every event folds for readers, once each.
	var st contracts.JobStatus
	for i, ev := range e.jobEvents("acme", "train-1") {
		if err := st.Apply(ev, uint64(i+1)); err != nil {
			t.Fatalf("readers refuse event %d (%s): %v", i, ev.Type, err)
		}
	}
	if diff := cmp.Diff([]string{"queued", "scheduled", "running", "succeeded"}, e.types("acme", "train-1")); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
}

func TestInvalidRequestsAreRejected(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.start()
	big := request("too-big", contracts.MaxGPUsPerJob+1, h100)
	tests := []struct {
		name    string
		subject string
		data    string
		// job is where the rejection is expected ("" when the ID is
		// unusable: rej-<seq>)
		job    string
		reason contracts.Reason
	}{
		{"out of range count", "", mustJSON(t, big), "too-big", contracts.ReasonOutOfRange},
		{"unknown model", "", `{"id":"m1","resources":{"gpu":{"count":1,"model":"B300"}},"run":{"duration":"1s"}}`, "m1", contracts.ReasonUnknownGPUModel},
		{"unknown field", "", `{"id":"u1","resources":{"gpu":{"count":1}},"run":{"duration":"1s"},"color":"red"}`, "u1", contracts.ReasonUnknownField},
		{"tenant mismatch", "", `{"id":"t1","tenant":"beta","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "t1", contracts.ReasonTenantMismatch},
		{"several problems", "", `{"id":"s1","priority":"urgent","resources":{"gpu":{"count":0}}}`, "s1", contracts.ReasonInvalidRequest},
		{"unusable ID", "", `{"id":"has space","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, "", contracts.ReasonInvalidID},
		{"not JSON", "", `this is not json`, "", contracts.ReasonInvalidJSON},
	}
	for i, tc := range tests {
		e.publishRaw(contracts.SubjectSubmit("acme"), fmt.Sprintf("raw-%d", i), []byte(tc.data))
	}
	// A subject whose tenant is invalid is answered on the reserved tenant
	// (TestInvalidTenantSubjectsAreAnswered) and dead-lettered.
	e.publishRaw("gp.jobs.submit.NOT_A_TENANT", "raw-bad-tenant", []byte(mustJSON(t, request("x1", 1, h100))))

	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var ev contracts.JobEvent
			if tc.job != "" {
				ev = e.waitEvent("acme", tc.job, contracts.EventRejected)
			} else {
				eventually(t, "a rejection on a rej-<seq> subject with "+string(tc.reason), func() bool {
					for _, m := range e.events.all() {
						got := decode[contracts.JobEvent](t, m)
						if strings.HasPrefix(got.JobID, "rej-") && got.Reason == tc.reason {
							ev = got
							return m.Subject == contracts.SubjectJobEvents("acme", got.JobID)
						}
					}
					return false
				})
			}
			if ev.Reason != tc.reason || ev.State != contracts.StateRejected || len(ev.Errors) == 0 || ev.Message == "" {
				t.Fatalf("rejection %+v, want reason %s with field errors", ev, tc.reason)
			}
		})
	}
	eventually(t, "the request with an invalid tenant in the dead-letter stream", func() bool {
		for _, m := range e.dead.all() {
			if m.Header.Get(contracts.HeaderDeadLetterSubject) == "gp.jobs.submit.NOT_A_TENANT" {
				return m.Subject == contracts.SubjectDeadLetter(contracts.StreamJobs, RequestsConsumer)
			}
		}
		return false
	})
	if ev := e.jobEvents("acme", "s1"); len(ev) == 1 && len(ev[0].Errors) < 2 {
		t.Errorf("several problems should all be reported: %+v", ev[0].Errors)
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	return string(mustMarshal(t, v))
}

func TestDuplicateSubmit(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.start()
	r := request("j1", 1, h100)
	e.submit("acme", r)
	e.waitEvent("acme", "j1", contracts.EventQueued)
	// The same body again, past JetStream's duplicate window (another
	// message ID): nothing.
	e.publish(contracts.SubjectSubmit("acme"), "resubmit-1", r)
	// Another body under the same ID: rejected, the job unaffected.
	other := request("j1", 4, h100)
	e.publish(contracts.SubjectSubmit("acme"), "resubmit-2", other)
	dup := e.waitEvent("acme", "j1", contracts.EventRejected)
	if dup.Reason != contracts.ReasonDuplicateJobID {
		t.Fatalf("rejection %+v, want duplicate_job_id", dup)
	}
	e.barrier("acme")
	e.waitEvent("acme", "j1", contracts.EventPending) // published by a cycle, not the request handler
	want := map[string]int{"queued/1": 1, "rejected/0": 1, "pending/1/" + string(contracts.PendingNoNodes): 1}
	if diff := cmp.Diff(want, countByKind(e.jobEvents("acme", "j1"))); diff != "" {
		t.Fatalf("events by kind (-want +got):\n%s", diff)
	}
	// The accepted request is the one placed.
	e.inventory("n1", "east", h100, 8)
	if a := e.waitItem("acme", "j1", 1, ""); len(a.Devices) != 1 {
		t.Fatalf("placed %d devices, want the accepted request's 1", len(a.Devices))
	}
}

func TestCancel(t *testing.T) {
	t.Parallel()
	ended := func() contracts.RunResult {
		now := time.Now().UTC()
		return contracts.RunResult{Outcome: contracts.OutcomeCancelled, ExitCode: 143, StartedAt: now, EndedAt: now,
			Reason: contracts.ReasonCancelled}
	}
	tests := map[string]struct {
		run   func(e *env)
		want  []string
		stops int
	}{
		"queued without a plan": {
			run: func(e *env) {
				e.submit("acme", request("j1", 16, h100)) // fits nowhere
				e.waitEvent("acme", "j1", contracts.EventPending)
				e.cancel("acme", "j1")
			},
			want: []string{"queued", "pending", "cancelled"},
		},
		"plan in flight, then refused": {
			run: func(e *env) {
				e.submit("acme", request("j1", 1, h100))
				a := e.waitItem("acme", "j1", 1, "")
				e.cancel("acme", "j1")
				e.barrier("acme")
				if got := e.types("acme", "j1"); len(got) != 1 {
					e.t.Fatalf("cancel with a plan in flight published %v", got)
				}
				e.refuse(a, contracts.RefusedDeviceTaken)
			},
			want: []string{"queued", "cancelled"},
		},
		"plan in flight, then committed": {
			run: func(e *env) {
				e.submit("acme", request("j1", 1, h100))
				a := e.waitItem("acme", "j1", 1, "")
				e.cancel("acme", "j1")
				e.barrier("acme")
				e.commit(a)
				e.waitEvent("acme", "j1", contracts.EventScheduled)
				eventually(e.t, "a stop command", func() bool { return len(e.stopCommands("n1")) == 1 })
				e.runEnded(a, ended())
			},
			want: []string{"queued", "scheduled", "running", "cancelled"}, stops: 1,
		},
		"running": {
			run: func(e *env) {
				e.submit("acme", request("j1", 1, h100))
				a := e.waitItem("acme", "j1", 1, "")
				e.commit(a)
				e.runStarted(a, time.Now().UTC())
				e.waitEvent("acme", "j1", contracts.EventRunning)
				e.cancel("acme", "j1")
				eventually(e.t, "a stop command", func() bool { return len(e.stopCommands("n1")) == 1 })
				e.runEnded(a, ended())
			},
			want: []string{"queued", "scheduled", "running", "cancelled"}, stops: 1,
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.inventory("n1", "east", h100, 8)
			e.start()
			tc.run(e)
			c := e.waitEvent("acme", "j1", contracts.EventCancelled)
			if c.Reason != contracts.ReasonCancelled {
				t.Errorf("cancelled reason %q", c.Reason)
			}
			if diff := cmp.Diff(tc.want, e.types("acme", "j1")); diff != "" {
				t.Fatalf("events (-want +got):\n%s", diff)
			}
			stops := e.stopCommands("n1")
			if len(stops) != tc.stops {
				t.Fatalf("%d stop commands, want %d", len(stops), tc.stops)
			}
			for _, s := range stops {
				if s.Kind != contracts.CommandStopRun || s.Reason != contracts.ReasonCancelled || s.AllocationID != "acme/j1/1" {
					t.Errorf("stop command %+v", s)
				}
			}
		})
	}
}

func TestRefusedItemIsRetried(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.inventory("n1", "east", h100, 8)
	e.start()
	e.submit("acme", request("j1", 1, h100))
	first := e.waitItem("acme", "j1", 1, "")
	e.refuse(first, contracts.RefusedCommitConflict)
	p := e.waitEvent("acme", "j1", contracts.EventPending)
	if p.Reason != contracts.PendingCommitRefused || !strings.Contains(p.Message, string(contracts.RefusedCommitConflict)) {
		t.Fatalf("pending after refusal %+v", p)
	}
	second := e.waitItem("acme", "j1", 1, first.PlanID)
	if second.ID != first.ID {
		t.Fatalf("retry allocation %s, want %s", second.ID, first.ID)
	}
	e.commit(second)
	e.waitEvent("acme", "j1", contracts.EventScheduled)
	if diff := cmp.Diff([]string{"queued", "pending", "scheduled"}, e.types("acme", "j1")); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
}

func TestNodeLostRequeues(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.inventory("n1", "east", h100, 8)
	e.inventory("n2", "east", h100, 8)
	e.start()
	e.submit("acme", request("j1", 8, h100))
	a := e.waitItem("acme", "j1", 1, "")
	e.commit(a)
	e.runStarted(a, time.Now().UTC())
	e.waitEvent("acme", "j1", contracts.EventRunning)
	e.nodeEvent(a.NodeID, contracts.NodeLost, 1)
	e.release(a, contracts.ReasonNodeLost, nil)
	rq := e.waitEvent("acme", "j1", contracts.EventRequeued)
	if rq.Attempt != 2 || rq.Reason != contracts.ReasonNodeLost {
		t.Fatalf("requeued event %+v", rq)
	}
	b := e.waitItem("acme", "j1", 2, "")
	if b.NodeID == a.NodeID {
		// NODES and ALLOCATIONS are separate streams: the release may be
		// seen before the node's loss. The resource manager then refuses
		// the item, and the node sits out until its next fact.
		e.refuse(b, contracts.RefusedNodeNotReady)
		b = e.waitItem("acme", "j1", 2, b.PlanID)
	}
	if b.ID != contracts.AllocationID("acme", "j1", 2) || b.NodeID == a.NodeID {
		t.Fatalf("second attempt %+v: want attempt 2 away from the lost node %s", b, a.NodeID)
	}
	e.commit(b)
	if ev := e.waitEvent("acme", "j1", contracts.EventScheduled); ev.Attempt != 1 {
		// waitEvent returns the first; check the second one below
		t.Fatalf("first scheduled event attempt %d", ev.Attempt)
	}
	eventually(t, "scheduled for attempt 2", func() bool {
		return countByKind(e.jobEvents("acme", "j1"))["scheduled/2"] == 1
	})
}

func TestPendingReasonAndDemand(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.inventory("h100-01", "east", h100, 8)
	e.start()
	e.submit("acme", request("small", 6, h100))
	a := e.waitItem("acme", "small", 1, "")
	e.commit(a)
	e.submit("acme", request("big", 8, h100))
	p := e.waitEvent("acme", "big", contracts.EventPending)
	if p.Reason != contracts.PendingInsufficientGPUs || !strings.Contains(p.Message, "needs 8×H100-80GB on one machine") ||
		!strings.Contains(p.Message, "largest free block is 2 on h100-01") {
		t.Fatalf("pending %+v", p)
	}
	eventually(t, "demand for pool east with the waiting shape", func() bool {
		for _, m := range e.demand.all() {
			d := decode[contracts.PoolDemand](t, m)
			if m.Subject == contracts.SubjectDemand("east") && d.PendingJobs == 1 && d.PendingGPUs == 8 &&
				d.Nodes == 1 && d.TotalGPUs == 8 && d.FreeGPUs == 2 &&
				cmp.Equal(d.Waiting, []contracts.Shape{{Model: h100, GPUs: 8, Count: 1}}) {
				return true
			}
		}
		return false
	})
	// More cycles with the same reason publish no new pending event.
	// Short enough to end before big's reservation starts (when small
	// ends): backfill lets them use the free GPUs.
	for i := range 3 {
		tiny := request(fmt.Sprintf("tiny-%d", i), 1, h100)
		tiny.Run.Duration = contracts.Duration(time.Second)
		e.submit("acme", tiny)
	}
	e.barrier("acme")
	eventually(t, "the tiny jobs placed", func() bool {
		return e.items("acme", "tiny-0") == 1 && e.items("acme", "tiny-1") == 1
	})
	if got := countByKind(e.jobEvents("acme", "big")); got["pending/1/"+string(contracts.PendingInsufficientGPUs)] != 1 {
		t.Fatalf("big's events %v: want one pending event", got)
	}
}

// TestRestartLosesNothing stops the scheduler with jobs in every state,
// lets the platform go on while it is down, and starts a new one: it must
// finish every job, publish what it owes once, and nothing twice.
func TestRestartLosesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.inventory("n1", "east", h100, 8)
	e.start()
	for _, id := range []string{"done", "run", "flight", "refused"} {
		e.submit("acme", request(id, 1, h100))
	}
	e.submit("acme", request("big", 16, h100))
	done, run := e.waitItem("acme", "done", 1, ""), e.waitItem("acme", "run", 1, "")
	flight, refused := e.waitItem("acme", "flight", 1, ""), e.waitItem("acme", "refused", 1, "")
	e.waitEvent("acme", "big", contracts.EventPending)
	e.commit(done)
	e.commit(run)
	t0 := time.Now().UTC().Truncate(time.Millisecond)
	e.runStarted(done, t0)
	e.waitEvent("acme", "done", contracts.EventRunning)
	e.waitEvent("acme", "run", contracts.EventScheduled)
	e.cancel("acme", "flight") // remembered: its plan is in flight
	e.barrier("acme")
	e.stop()

	// While it is down: a run ends, another starts, the cancelled job's
	// plan commits, another plan item is refused, a job is submitted.
	e.runEnded(done, contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: t0, EndedAt: t0.Add(time.Second)})
	e.runStarted(run, t0)
	e.commit(flight)
	e.refuse(refused, contracts.RefusedCommitConflict)
	e.submit("acme", request("later", 1, h100))

	e.start()
	e.waitEvent("acme", "done", contracts.EventSucceeded)
	e.waitEvent("acme", "run", contracts.EventRunning)
	e.waitEvent("acme", "flight", contracts.EventScheduled)
	eventually(t, "a stop for the cancelled job's allocation", func() bool {
		s := e.stopCommands("n1")
		return len(s) == 1 && s[0].AllocationID == flight.ID
	})
	retry := e.waitItem("acme", "refused", 1, refused.PlanID)
	e.commit(retry)
	e.waitEvent("acme", "refused", contracts.EventScheduled)
	later := e.waitItem("acme", "later", 1, "")
	e.commit(later)
	e.waitEvent("acme", "later", contracts.EventScheduled)
	e.runEnded(flight, contracts.RunResult{Outcome: contracts.OutcomeCancelled, EndedAt: time.Now().UTC(), Reason: contracts.ReasonCancelled})
	e.waitEvent("acme", "flight", contracts.EventCancelled)
	e.barrier("acme")

	want := map[string]map[string]int{
		"done":    {"queued/1": 1, "scheduled/1": 1, "running/1": 1, "succeeded/1": 1},
		"run":     {"queued/1": 1, "scheduled/1": 1, "running/1": 1},
		"flight":  {"queued/1": 1, "scheduled/1": 1, "cancelled/1": 1},
		"refused": {"queued/1": 1, "scheduled/1": 1},
		"big":     {"queued/1": 1, "pending/1/" + string(contracts.ReasonUnsatisfiable): 1}, // larger than any machine
		"later":   {"queued/1": 1, "scheduled/1": 1},
	}
	for job, w := range want {
		if diff := cmp.Diff(w, countByKind(e.jobEvents("acme", job))); diff != "" {
			t.Errorf("%s: events by kind (-want +got):\n%s", job, diff)
		}
	}
	if n := e.items("acme", "done"); n != 1 {
		t.Errorf("done proposed %d times, want once", n)
	}
}

// TestBurst submits a burst of jobs of several tenants against a resource
// manager that commits everything: every job is scheduled exactly once,
// no device is given twice, and cycles batch jobs into plans.
func TestBurst(t *testing.T) {
	t.Parallel()
	const jobs, nodes = 200, 50
	e := newEnv(t)
	for i := range nodes {
		e.inventory(fmt.Sprintf("n%03d", i), "east", h100, 8)
	}
	e.autoCommit()
	e.start()
	start := time.Now()
	e.submitMany(jobs, func(i int) (string, contracts.JobRequest) {
		return fmt.Sprintf("t%d", i%4), request(fmt.Sprintf("b%04d", i), 1+i%2, h100)
	})
	scheduled := e.waitScheduled(jobs)
	t.Logf("%d jobs submit→scheduled in %s, %d plans", jobs, time.Since(start).Round(time.Millisecond), len(e.plans.all()))

	items, devices := map[string]int{}, map[string]string{}
	for _, m := range e.plans.all() {
		for _, it := range decode[contracts.Plan](t, m).Items {
			items[it.ID]++
			for _, d := range it.Devices {
				if other, taken := devices[d.UUID]; taken {
					t.Fatalf("device %s given to %s and %s", d.UUID, other, it.ID)
				}
				devices[d.UUID] = it.ID
			}
		}
	}
	if len(items) != jobs || scheduled != jobs {
		t.Fatalf("%d jobs proposed, %d scheduled; want %d", len(items), scheduled, jobs)
	}
	for id, n := range items {
		if n != 1 {
			t.Errorf("%s proposed %d times", id, n)
		}
	}
}
