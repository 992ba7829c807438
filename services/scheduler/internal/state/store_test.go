package state

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

const h100 = "H100-80GB"

func TestSubmit(t *testing.T) {
	tests := map[string]submitCase{
		"valid new job is queued": {
			body: job("j1", 1, h100), outcome: "queued", id: "job/acme/j1/queued/1",
		},
		"identical resubmit changes nothing": {
			before: []any{job("j1", 1, h100)}, body: job("j1", 1, h100), outcome: "unchanged",
		},
		"identical after normalization changes nothing": {
			before: []any{job("j1", 1, "")},
			body: func() contracts.JobRequest {
				r := job("j1", 1, contracts.GPUModelAny)
				r.Priority, r.Tenant = contracts.PriorityNormal, "acme"
				return r
			}(),
			outcome: "unchanged",
		},
		"same ID with another body is a duplicate": {
			before: []any{job("j1", 1, h100)}, body: job("j1", 2, h100), outcome: "duplicate",
			id: "job/acme/j1/rejected/0/2", reason: contracts.ReasonDuplicateJobID,
			fields: []contracts.Reason{contracts.ReasonDuplicateJobID},
		},
		"invalid request is rejected with every field error": {
			body: contracts.JobRequest{ID: "bad", Priority: "urgent", Resources: contracts.Resources{
				GPU: contracts.GPURequest{Count: 0, Model: "B300"}}},
			outcome: "rejected", id: "job/acme/bad/rejected/0", reason: contracts.ReasonInvalidRequest,
			fields: []contracts.Reason{contracts.ReasonUnknownPriority, contracts.ReasonOutOfRange,
				contracts.ReasonUnknownGPUModel, contracts.ReasonMissingField},
		},
		"single kind of problem keeps its reason": {
			body:    job("big", contracts.MaxGPUsPerJob+1, h100),
			outcome: "rejected", id: "job/acme/big/rejected/0", reason: contracts.ReasonOutOfRange,
			fields: []contracts.Reason{contracts.ReasonOutOfRange},
		},
		"unusable ID is rejected under its stream sequence": {
			body: job("no/slash", 1, h100), outcome: "rejected", id: "job/acme/rej-1/rejected/0",
			reason: contracts.ReasonInvalidID, fields: []contracts.Reason{contracts.ReasonInvalidID},
		},
		"broken JSON is rejected under its stream sequence": {
			body: `{"id": "j1", "resources": `, outcome: "rejected", id: "job/acme/rej-1/rejected/0",
			reason: contracts.ReasonInvalidJSON, fields: []contracts.Reason{contracts.ReasonInvalidJSON},
		},
		"tenant in the body must match the subject": {
			body: func() contracts.JobRequest {
				r := job("j1", 1, h100)
				r.Tenant = "other"
				return r
			}(),
			outcome: "rejected", id: "job/acme/j1/rejected/0", reason: contracts.ReasonTenantMismatch,
			fields: []contracts.Reason{contracts.ReasonTenantMismatch},
		},
		"the same invalid request again changes nothing": {
			before: []any{job("big", 65, h100)}, body: job("big", 65, h100), outcome: "unchanged",
		},
		"a rejected ID stays taken": {
			before: []any{job("big", 65, h100)}, body: job("big", 1, h100), outcome: "duplicate",
			id: "job/acme/big/rejected/0/2", reason: contracts.ReasonDuplicateJobID,
			fields: []contracts.Reason{contracts.ReasonDuplicateJobID},
		},
		"an invalid subject tenant cannot be answered": {
			tenant: "Not_A_Tenant", body: job("j1", 1, h100), outcome: "invalid",
		},
	}
	// Each case runs twice: submitted whole, and parsed (ParseSubmit)
	// before the earlier requests were decided, as the intake parses
	// outside the scheduler's lock while a cycle or another request may
	// change the store: the decision is the store's at the request's turn.
	for name, tc := range tests {
		for _, early := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/parsed-early=%t", name, early), func(t *testing.T) {
				testSubmitCase(t, tc, early)
			})
		}
	}
}

// submitCase is a case of TestSubmit.
type submitCase struct {
	// earlier requests of acme, submitted first
	before []any
	tenant string
	body   any
	// want is the outcome, and for a published event its ID, reason and
	// field reasons.
	outcome string
	id      string
	reason  contracts.Reason
	fields  []contracts.Reason
}

// testSubmitCase runs tc; early parses its request (ParseSubmit) before
// the earlier requests are decided, and decides it with SubmitParsed.
func testSubmitCase(t *testing.T, tc submitCase, early bool) {
	t.Helper()
	tenant := cmpOr(tc.tenant, "acme")
	h := newHarness(t)
	var parsed ParsedSubmit
	if early {
		parsed = ParseSubmit(contracts.SubjectSubmit(tenant), h.body(tc.body))
	}
	for _, b := range tc.before {
		h.submit("acme", b)
	}
	var sub Submission
	if early {
		sub = h.submitParsed(parsed)
	} else {
		sub = h.submit(tenant, tc.body)
	}
	if sub.Outcome != tc.outcome {
		t.Fatalf("outcome %q, want %q", sub.Outcome, tc.outcome)
	}
	if (sub.Invalid != nil) != (tc.outcome == "invalid") {
		t.Fatalf("Invalid = %v", sub.Invalid)
	}
	if tc.id == "" {
		if sub.Publish != nil {
			t.Fatalf("published %s, want nothing", sub.Publish.ID)
		}
		return
	}
	if sub.Publish == nil || sub.Publish.ID != tc.id {
		t.Fatalf("published %+v, want ID %s", sub.Publish, tc.id)
	}
	ev := sub.Publish.Msg.(contracts.JobEvent)
	if tc.reason != "" && ev.Reason != tc.reason {
		t.Errorf("reason %q, want %q (message %q)", ev.Reason, tc.reason, ev.Message)
	}
	var fields []contracts.Reason
	for _, f := range ev.Errors {
		fields = append(fields, f.Reason)
	}
	slices.Sort(fields)
	want := slices.Clone(tc.fields)
	slices.Sort(want)
	if diff := cmp.Diff(want, fields); diff != "" {
		t.Errorf("field reasons (-want +got):\n%s", diff)
	}
	if ev.Type == contracts.EventQueued {
		if ev.Request == nil || ev.Request.Tenant != "acme" || ev.Request.Priority != contracts.PriorityNormal || ev.Attempt != 1 {
			t.Errorf("queued event does not carry the normalized request: %+v", ev)
		}
	}
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

func TestDuplicateLeavesAcceptedJobAlone(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 8)
	h.submit("acme", job("j1", 1, h100))
	h.submit("acme", job("j1", 4, h100))
	res := h.cycle()
	if res.Placed != 1 || len(res.Plans[0].Items[0].Devices) != 1 {
		t.Fatalf("the accepted request should be placed as submitted: %+v", res.Plans)
	}
	if got := h.status[Key("acme", "j1")].State; got != contracts.StateQueued {
		t.Fatalf("readers see %s, want queued", got)
	}
}

func TestLifecycle(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 8)
	h.submit("acme", job("j1", 2, h100))
	res := h.cycle()
	if len(res.Plans) != 1 || len(res.Plans[0].Items) != 1 {
		t.Fatalf("plans %+v, want one plan with one item", res.Plans)
	}
	a := res.Plans[0].Items[0]
	want := contracts.Allocation{ID: "acme/j1/1", Tenant: "acme", JobID: "j1", Attempt: 1, NodeID: "n1", Pool: "p",
		Devices:  []contracts.DeviceRef{{Index: 0, UUID: "n1-gpu0", Model: h100}, {Index: 1, UUID: "n1-gpu1", Model: h100}},
		Priority: contracts.PriorityNormal, Run: contracts.RunSpec{Duration: contracts.Duration(time.Minute)},
		PlanID: res.Plans[0].ID, Scheduler: "sched"}
	if diff := cmp.Diff(want, a); diff != "" {
		t.Fatalf("plan item (-want +got):\n%s", diff)
	}
	if j, _ := h.st.Job("acme", "j1"); j.Pending.Code != contracts.PendingPlanInFlight {
		t.Errorf("pending %q while the plan is in flight", j.Pending.Code)
	}
	h.commit(a)
	if e := h.last("acme", "j1"); e.Type != contracts.EventScheduled || e.Placement == nil || e.Placement.NodeID != "n1" {
		t.Fatalf("after commit: %+v", e)
	}
	t0 := h.now.Add(time.Second)
	h.started(a, t0)
	if e := h.last("acme", "j1"); e.Type != contracts.EventRunning || !e.StartedAt.Equal(t0) {
		t.Fatalf("after start: %+v", e)
	}
	t1 := t0.Add(time.Minute)
	h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: t0, EndedAt: t1})
	e := h.last("acme", "j1")
	if e.Type != contracts.EventSucceeded || e.ExitCode == nil || *e.ExitCode != 0 || !e.StartedAt.Equal(t0) || !e.EndedAt.Equal(t1) {
		t.Fatalf("after end: %+v", e)
	}
	// Facts repeated (redelivery, replay) publish nothing more.
	h.commit(a)
	h.started(a, t0)
	h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: t0, EndedAt: t1})
	if diff := cmp.Diff([]string{"queued", "scheduled", "running", "succeeded"}, h.types("acme", "j1")); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	h.noDuplicates()
}

func TestFactsInAnyOrder(t *testing.T) {
	tests := map[string]struct {
		result contracts.RunResult
		// withStart also reports the started fact (before the commit)
		withStart bool
		want      []string
	}{
		"run started and ended before the commit was seen": {
			withStart: true, result: contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: 3},
			want: []string{"queued", "scheduled", "running", "failed"},
		},
		"cancelled before it started": {
			result: contracts.RunResult{Outcome: contracts.OutcomeCancelled},
			want:   []string{"queued", "scheduled", "cancelled"},
		},
		"launch failed": {
			result: contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: -1, Reason: contracts.ReasonLaunchFailed},
			want:   []string{"queued", "scheduled", "failed"},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			h := newHarness(t)
			h.inventory("n1", "p", h100, 81920, 8)
			h.submit("acme", job("j1", 1, h100))
			a := h.cycle().Plans[0].Items[0]
			tc.result.EndedAt = h.now.Add(time.Minute)
			if tc.withStart {
				tc.result.StartedAt = h.now
				h.started(a, h.now)
			}
			h.ended(a, tc.result)
			if got := h.types("acme", "j1"); len(got) != 1 {
				t.Fatalf("events before the commit: %v", got)
			}
			h.commit(a)
			if diff := cmp.Diff(tc.want, h.types("acme", "j1")); diff != "" {
				t.Fatalf("events (-want +got):\n%s", diff)
			}
			e := h.last("acme", "j1")
			if e.ExitCode == nil || *e.ExitCode != tc.result.ExitCode || e.EndedAt == nil {
				t.Errorf("terminal event lacks the result: %+v", e)
			}
			if tc.result.Reason != "" && e.Reason != tc.result.Reason {
				t.Errorf("reason %q, want %q", e.Reason, tc.result.Reason)
			}
		})
	}
}

func TestAssumedDevicesStayHeldUntilAnswered(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 4)
	h.submit("acme", job("a", 4, h100))
	a := h.cycle().Plans[0].Items[0]
	h.submit("acme", job("b", 1, h100))
	for range 3 { // however many cycles run, nothing frees the devices but an answer
		h.now = h.now.Add(time.Hour)
		if res := h.cycle(); res.Placed != 0 {
			t.Fatalf("b placed on devices held by a plan in flight: %+v", res.Plans)
		}
	}
	h.commit(a)
	if res := h.cycle(); res.Placed != 0 {
		t.Fatal("b placed on devices the ledger holds")
	}
	h.release(a, contracts.ReasonRunEnded, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now, EndedAt: h.now})
	if res := h.cycle(); res.Placed != 1 || h.item("acme", "b").NodeID != "n1" {
		t.Fatalf("b not placed once a's devices were released: %+v", res)
	}
}

// TestUnhealthyAndMIGGPUsAreNotPlacedWhole: a GPU the agent reports
// unhealthy, or one in MIG mode (its capacity is its instances), is never
// planned as a whole GPU; the others of the node still are.
func TestUnhealthyAndMIGGPUsAreNotPlacedWhole(t *testing.T) {
	h := newHarness(t)
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: "n1", Pool: "p", Incarnation: "i1", Time: h.now}
	for i := range 4 {
		inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: fmt.Sprintf("n1-gpu%d", i), Model: h100,
			MemoryMiB: 81920, Healthy: i != 1, MIGEnabled: i == 2})
	}
	h.fact(func(s *Store) []Publish { s.ApplyInventory(inv); return nil })
	h.submit("acme", job("two", 2, h100))
	h.submit("acme", job("three", 3, h100))
	res := h.cycle()
	if res.Placed != 1 {
		t.Fatalf("placed %d, want only the 2-GPU job", res.Placed)
	}
	for _, d := range h.item("acme", "two").Devices {
		if d.Index == 1 || d.Index == 2 {
			t.Fatalf("two placed on GPU %d (unhealthy or in MIG mode): %+v", d.Index, h.item("acme", "two").Devices)
		}
	}
}

func TestRefusal(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 2)
	h.inventory("n2", "p", h100, 81920, 2)
	h.submit("acme", job("j1", 2, h100))
	first := h.cycle().Plans[0].Items[0]
	if first.NodeID != "n1" {
		t.Fatalf("placed on %s, want n1", first.NodeID)
	}
	// A refusal for another plan is stale and ignored.
	stale := first
	stale.PlanID = "someone-elses-plan"
	h.refuse(stale, contracts.RefusedDeviceTaken)
	if res := h.cycle(); res.Placed != 0 {
		t.Fatal("a stale refusal released the assumption")
	}
	// The resource manager refuses device_taken only after a ledger entry
	// took the devices, and that entry comes first on ALLOCATIONS.
	other := contracts.Allocation{ID: contracts.AllocationID("globex", "other", 1), Tenant: "globex", JobID: "other",
		Attempt: 1, NodeID: "n1", Pool: "p", Devices: first.Devices}
	h.commit(other)
	h.refuse(first, contracts.RefusedDeviceTaken)
	if diff := cmp.Diff([]string{"queued", "pending:" + string(contracts.PendingCommitRefused)}, h.types("acme", "j1")); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	if !strings.Contains(h.last("acme", "j1").Message, "device_taken") {
		t.Errorf("pending message does not say why: %q", h.last("acme", "j1").Message)
	}
	second := h.cycle().Plans[0].Items[0]
	if second.PlanID == first.PlanID || second.ID != first.ID {
		t.Fatalf("retry item %+v: want a new plan for the same allocation", second)
	}
	if second.NodeID != "n2" {
		t.Errorf("retry went to %s; n1's devices are held by the entry that caused the refusal", second.NodeID)
	}
	h.commit(second)
	if e := h.last("acme", "j1"); e.Type != contracts.EventScheduled || e.Placement.NodeID != "n2" {
		t.Fatalf("after the retry committed: %+v", e)
	}
}

func TestRefusedNodeSitsOutUntilItsNextFact(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 2)
	h.submit("acme", job("j1", 1, h100))
	a := h.cycle().Plans[0].Items[0]
	h.refuse(a, contracts.RefusedNodeNotReady)
	if res := h.cycle(); res.Placed != 0 {
		t.Fatal("placed again on a node the resource manager said is not ready")
	}
	if j, _ := h.st.Job("acme", "j1"); j.Pending.Code != contracts.PendingNoNodes {
		t.Errorf("pending %q, want %q", j.Pending.Code, contracts.PendingNoNodes)
	}
	h.nodeEvent("n1", contracts.NodeRegistered)
	if res := h.cycle(); res.Placed != 1 {
		t.Fatal("not placed once the node registered")
	}
}

// TestRefusedNodeComesBackWhenItsFactCameFirst: NODES and ALLOCATIONS are
// separate streams, so the registration can be read before the refusal it
// would have cleared. No later fact may come; the backoff must then make the
// node eligible again, or its GPUs would be idle forever.
func TestRefusedNodeComesBackWhenItsFactCameFirst(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 1)
	h.submit("acme", job("j1", 1, h100))
	a := h.cycle().Plans[0].Items[0]
	h.nodeEvent("n1", contracts.NodeRegistered) // read first...
	h.refuse(a, contracts.RefusedNodeNotReady)  // ...then the refusal it answers
	if res := h.cycle(); res.Placed != 0 {
		t.Fatal("retried at once on a refused node")
	}
	h.now = h.now.Add(suspectBackoff)
	if res := h.cycle(); res.Placed != 1 {
		t.Fatal("refused node still sitting out after the backoff with no newer fact to wait for")
	}
}

// TestPendingEventsAreSpaced: a changed code inside PendingEventInterval
// waits; the first cycle after it publishes the reason current then.
func TestPendingEventsAreSpaced(t *testing.T) {
	h := newHarness(t)
	h.submit("acme", job("big", 8, h100))
	h.cycle() // no nodes: first pending event at once
	h.inventory("n1", "p", h100, 81920, 4)
	h.cycle() // too small now, but the last event is fresh
	want := []string{"queued", "pending:" + string(contracts.PendingNoNodes)}
	if diff := cmp.Diff(want, h.types("acme", "big")); diff != "" {
		t.Fatalf("inside the interval (-want +got):\n%s", diff)
	}
	if j, _ := h.st.Job("acme", "big"); j.Pending.Code != contracts.ReasonUnsatisfiable {
		t.Errorf("current reason %q, want %q even while its event waits", j.Pending.Code, contracts.ReasonUnsatisfiable)
	}
	h.now = h.now.Add(PendingEventInterval)
	h.cycle()
	want = append(want, "pending:"+string(contracts.ReasonUnsatisfiable))
	if diff := cmp.Diff(want, h.types("acme", "big")); diff != "" {
		t.Fatalf("after the interval (-want +got):\n%s", diff)
	}
}

// TestAbandonedRequestHoldsNobodyBack: a request whose answer could not be
// published will be redelivered; later arrivals do not wait for it.
func TestAbandonedRequestHoldsNobodyBack(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81559, 1)
	first := h.st.Submit(contracts.SubjectSubmit("acme"), mustJSON(t, job("first", 1, h100)), 10)
	second := h.st.Submit(contracts.SubjectSubmit("acme"), mustJSON(t, job("second", 1, h100)), 11)
	h.collect([]Publish{*second.Publish})
	second.Published(h.seq)
	first.Abandoned()
	res := h.st.Cycle()
	if len(res.Plans) != 1 || res.Plans[0].Items[0].JobID != "second" {
		t.Fatalf("plans %+v; want the second job placed once the first was abandoned", res.Plans)
	}
}

func TestCancel(t *testing.T) {
	end := func(h *harness) contracts.RunResult {
		return contracts.RunResult{Outcome: contracts.OutcomeCancelled, ExitCode: 143, StartedAt: h.now, EndedAt: h.now,
			Reason: contracts.ReasonCancelled}
	}
	tests := map[string]struct {
		run  func(h *harness)
		want []string
		// stops is how many stop commands were sent
		stops int
	}{
		"queued without a plan is cancelled at once": {
			run: func(h *harness) {
				h.submit("acme", job("j1", 16, h100)) // never fits
				h.cycle()
				if err := h.cancel("acme", "j1"); err != nil {
					h.t.Fatal(err)
				}
			},
			want: []string{"queued", "pending:" + string(contracts.ReasonUnsatisfiable), "cancelled"},
		},
		"plan in flight then refused is cancelled": {
			run: func(h *harness) {
				h.submit("acme", job("j1", 1, h100))
				a := h.cycle().Plans[0].Items[0]
				if err := h.cancel("acme", "j1"); err != nil {
					h.t.Fatal(err)
				}
				if len(h.types("acme", "j1")) != 1 {
					h.t.Fatal("cancelled while a plan was in flight")
				}
				h.refuse(a, contracts.RefusedCommitConflict)
			},
			want: []string{"queued", "cancelled"},
		},
		"plan in flight then committed is stopped": {
			run: func(h *harness) {
				h.submit("acme", job("j1", 1, h100))
				a := h.cycle().Plans[0].Items[0]
				if err := h.cancel("acme", "j1"); err != nil {
					h.t.Fatal(err)
				}
				h.commit(a)
				h.ended(a, end(h))
			},
			want: []string{"queued", "scheduled", "running", "cancelled"}, stops: 1,
		},
		"running is stopped and ends cancelled": {
			run: func(h *harness) {
				h.submit("acme", job("j1", 1, h100))
				a := h.cycle().Plans[0].Items[0]
				h.commit(a)
				h.started(a, h.now)
				if err := h.cancel("acme", "j1"); err != nil {
					h.t.Fatal(err)
				}
				h.ended(a, end(h))
			},
			want: []string{"queued", "scheduled", "running", "cancelled"}, stops: 1,
		},
		"running on a node that is lost after the cancel": {
			run: func(h *harness) {
				h.submit("acme", job("j1", 1, h100))
				a := h.cycle().Plans[0].Items[0]
				h.commit(a)
				h.started(a, h.now)
				if err := h.cancel("acme", "j1"); err != nil {
					h.t.Fatal(err)
				}
				h.release(a, contracts.ReasonNodeLost, nil)
			},
			want: []string{"queued", "scheduled", "running", "cancelled"}, stops: 1,
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			h := newHarness(t)
			h.inventory("n1", "p", h100, 81920, 8)
			tc.run(h)
			if diff := cmp.Diff(tc.want, h.types("acme", "j1")); diff != "" {
				t.Fatalf("events (-want +got):\n%s", diff)
			}
			if len(h.commands) != tc.stops {
				t.Fatalf("%d stop commands, want %d: %+v", len(h.commands), tc.stops, h.commands)
			}
			for _, c := range h.commands {
				if c.Kind != contracts.CommandStopRun || c.Reason != contracts.ReasonCancelled || c.AllocationID != "acme/j1/1" {
					t.Errorf("command %+v", c)
				}
			}
			if h.st.Queued() != 0 {
				t.Errorf("%d jobs left in the queue", h.st.Queued())
			}
		})
	}
}

func TestCancelUnknownOrTerminal(t *testing.T) {
	h := newHarness(t)
	if err := h.cancel("acme", "nope"); !errors.Is(err, ErrUnknownJob) {
		t.Fatalf("cancel unknown: %v", err)
	}
	h.submit("acme", job("j1", 1, h100))
	if err := h.cancel("acme", "j1"); err != nil {
		t.Fatal(err)
	}
	if err := h.cancel("acme", "j1"); !errors.Is(err, ErrTerminalJob) {
		t.Fatalf("cancel cancelled: %v", err)
	}
	if _, err := h.st.Cancel(contracts.SubjectCancel("acme"), []byte(`{"jobId": ""}`)); err == nil ||
		errors.Is(err, ErrUnknownJob) {
		t.Fatalf("invalid cancel request: %v", err)
	}
}

func TestNodeLostRequeues(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 1)
	h.inventory("n2", "p", h100, 81920, 1)
	h.submit("acme", job("j1", 1, h100))
	a := h.cycle().Plans[0].Items[0]
	h.commit(a)
	h.started(a, h.now)
	h.nodeEvent(a.NodeID, contracts.NodeLost)
	h.release(a, contracts.ReasonNodeLost, nil)
	e := h.last("acme", "j1")
	if e.Type != contracts.EventRequeued || e.Attempt != 2 || e.Reason != contracts.ReasonNodeLost {
		t.Fatalf("after node lost: %+v", e)
	}
	// A late fact of attempt 1 changes nothing.
	h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: 137, EndedAt: h.now})
	b := h.cycle().Plans[0].Items[0]
	if b.Attempt != 2 || b.ID != "acme/j1/2" || b.NodeID != "n2" {
		t.Fatalf("second attempt item %+v", b)
	}
	h.commit(b)
	if diff := cmp.Diff([]string{"queued", "scheduled", "running", "requeued", "scheduled"}, h.types("acme", "j1")); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	if st := h.status[Key("acme", "j1")]; st.Attempt != 2 || st.State != contracts.StateScheduled {
		t.Fatalf("readers see %s attempt %d", st.State, st.Attempt)
	}
}

// TestNodeLostRequeuesWithTheReleaseAsWritten: the resource manager's
// node_lost release carries a RunResult (outcome failed, reason node_lost),
// and the agent, if it still runs, reports its stopped run with the same
// reason. Neither is the job's end: whichever comes first, the job is
// requeued, never failed.
func TestNodeLostRequeuesWithTheReleaseAsWritten(t *testing.T) {
	for _, agentFirst := range []bool{false, true} {
		t.Run(fmt.Sprintf("agent fact first=%v", agentFirst), func(t *testing.T) {
			h := newHarness(t)
			h.inventory("n1", "p", h100, 81920, 1)
			h.submit("acme", job("j1", 1, h100))
			a := h.cycle().Plans[0].Items[0]
			h.commit(a)
			started := h.now
			h.started(a, started)
			lost := contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: -1, StartedAt: started,
				EndedAt: h.now, Reason: contracts.ReasonNodeLost, Message: "node n1 lost"}
			if agentFirst {
				h.ended(a, lost)
			}
			h.release(a, contracts.ReasonNodeLost, &lost)
			if !agentFirst {
				h.ended(a, lost)
			}
			e := h.last("acme", "j1")
			if e.Type != contracts.EventRequeued || e.Attempt != 2 || e.Reason != contracts.ReasonNodeLost {
				t.Fatalf("after node lost: %s attempt %d reason %s; want requeued attempt 2 (events %v)",
					e.Type, e.Attempt, e.Reason, h.types("acme", "j1"))
			}
		})
	}
}

// TestEarlyCancelStaysHarmlessAfterRestart: a cancel that arrived before
// its job's submit found no job and changed nothing; a restart replaying
// JOBS must not let it cancel the job after all.
func TestEarlyCancelStaysHarmlessAfterRestart(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 1)
	if err := h.cancel("acme", "j1"); err == nil {
		t.Fatal("cancel of an unknown job accepted")
	}
	h.submit("acme", job("j1", 1, h100))
	a := h.cycle().Plans[0].Items[0]
	h.commit(a)
	h.started(a, h.now)
	h.restart()
	if len(h.commands) != 0 {
		t.Fatalf("restart sent %+v for a job nobody cancelled after submitting it", h.commands)
	}
	if e := h.last("acme", "j1"); e.Type != contracts.EventRunning {
		t.Fatalf("after restart: %s", e.Type)
	}
}

func TestReleaseWaitsForTheRunFact(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 1)
	h.submit("acme", job("j1", 1, h100))
	a := h.cycle().Plans[0].Items[0]
	h.commit(a)
	h.started(a, h.now)
	h.release(a, contracts.ReasonRunEnded, nil) // RUNS lags behind ALLOCATIONS
	if e := h.last("acme", "j1"); e.Type != contracts.EventRunning {
		t.Fatalf("a run_ended release without its run fact moved the job: %+v", e)
	}
	h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: 2, StartedAt: h.now, EndedAt: h.now})
	if e := h.last("acme", "j1"); e.Type != contracts.EventFailed || e.Reason != contracts.ReasonExitNonZero {
		t.Fatalf("after the run fact: %+v", e)
	}
}

func TestPendingEventOnlyWhenTheReasonChanges(t *testing.T) {
	h := newHarness(t)
	h.submit("acme", job("big", 8, h100))
	h.cycle() // no nodes at all
	h.inventory("n1", "p", h100, 81920, 4)
	h.now = h.now.Add(PendingEventInterval)
	h.cycle() // the machine is too small
	for i := range 5 {
		h.submit("acme", job(fmt.Sprintf("s%d", i), 1, h100))
		h.cycle() // the message changes (free block), the code does not
	}
	h.inventory("n2", "p", h100, 81920, 8)
	h.inventory("n1", "p", h100, 81920, 4)
	h.cycle()
	// Too small for any machine is unsatisfiable (until a bigger machine
	// joins), not merely short of free GPUs.
	want := []string{"queued", "pending:" + string(contracts.PendingNoNodes), "pending:" + string(contracts.ReasonUnsatisfiable)}
	if diff := cmp.Diff(want, h.types("acme", "big")[:3]); diff != "" {
		t.Fatalf("events (-want +got):\n%s", diff)
	}
	if got := h.types("acme", "big"); len(got) != 3 {
		t.Fatalf("events %v: want no pending event while the code stays the same", got)
	}
	for _, p := range h.events {
		if p.ev.JobID == "big" && p.ev.Type == contracts.EventPending {
			if !strings.HasPrefix(p.id, "job/acme/big/pending/1/") {
				t.Errorf("pending event ID %s", p.id)
			}
		}
	}
	if ids := []string{"job/acme/big/pending/1/1", "job/acme/big/pending/1/2"}; h.ids[ids[0]] != 1 || h.ids[ids[1]] != 1 {
		t.Errorf("pending IDs %v, want sequence 1 and 2", h.ids)
	}
	if j, _ := h.st.Job("acme", "big"); j.Pending.Code != contracts.PendingPlanInFlight {
		t.Errorf("big should be placed on n2 now, pending %+v", j.Pending)
	}
}

func TestPlanSplitsWhenLarge(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MaxPlanBytes = 4096 })
	for i := range 10 {
		h.inventory(fmt.Sprintf("n%02d", i), "p", h100, 81920, 8)
	}
	for i := range 80 {
		h.submit("acme", job(fmt.Sprintf("j%02d", i), 1, h100))
	}
	res := h.cycle()
	if res.Placed != 80 || len(res.Plans) < 2 {
		t.Fatalf("placed %d in %d plans, want 80 in several", res.Placed, len(res.Plans))
	}
	seen := map[string]bool{}
	for _, p := range res.Plans {
		if len(p.Items) == 0 {
			t.Fatalf("empty plan %s", p.ID)
		}
		for _, it := range p.Items {
			if it.PlanID != p.ID || seen[it.ID] {
				t.Fatalf("item %s in plan %s (planId %s)", it.ID, p.ID, it.PlanID)
			}
			seen[it.ID] = true
		}
	}
	// A plan that could not be published gives its devices and jobs back;
	// a job whose cancel waited on it is cancelled.
	cancelled := res.Plans[0].Items[0].JobID
	if err := h.cancel("acme", cancelled); err != nil {
		t.Fatal(err)
	}
	h.collect(h.st.PlanFailed(res.Plans[0].ID))
	if e := h.last("acme", cancelled); e.Type != contracts.EventCancelled {
		t.Fatalf("%s after its plan failed: %+v", cancelled, e)
	}
	if again := h.cycle(); again.Placed != len(res.Plans[0].Items)-1 {
		t.Fatalf("after a failed plan %d placed, want %d", again.Placed, len(res.Plans[0].Items)-1)
	}
}

func TestFairnessAcrossCycles(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 1)
	for _, tenant := range []string{"acme", "beta"} {
		for i := range 3 {
			h.submit(tenant, job(fmt.Sprintf("j%d", i), 1, h100))
		}
	}
	var order []string
	for range 4 {
		a := h.cycle().Plans[0].Items[0]
		order = append(order, a.Tenant+"/"+a.JobID)
		h.commit(a)
		h.release(a, contracts.ReasonNodeLost, nil) // frees the GPU, requeues the job
		h.cancel(a.Tenant, a.JobID)
	}
	if diff := cmp.Diff([]string{"acme/j0", "beta/j0", "acme/j1", "beta/j1"}, order); diff != "" {
		t.Fatalf("one GPU should alternate between tenants (-want +got):\n%s", diff)
	}
}

// TestFIFOFollowsArrivalNotAnswerOrder: requests are answered in parallel,
// so a later request's queued event can be stored first. The queue still
// serves them in the order they arrived on JOBS, before and after a restart.
func TestFIFOFollowsArrivalNotAnswerOrder(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", "H100-80GB", 81559, 1)
	data := func(id string) []byte { return mustJSON(t, job(id, 1, "H100-80GB")) }
	first := h.st.Submit(contracts.SubjectSubmit("acme"), data("first"), 10)
	second := h.st.Submit(contracts.SubjectSubmit("acme"), data("second"), 11)
	// The second request's queued event is stored first.
	h.collect([]Publish{*second.Publish})
	second.Published(h.seq)
	// While the first is still being accepted, the later arrival waits:
	// the one GPU is owed to the first.
	if res := h.st.Cycle(); len(res.Plans) != 0 {
		t.Fatalf("placed %+v while an earlier request was still being accepted", res.Plans)
	}
	h.collect([]Publish{*first.Publish})
	first.Published(h.seq)
	if ev := h.last("acme", "first"); ev.SubmitSeq != 10 {
		t.Fatalf("queued event carries submitSeq %d, want the request's JOBS sequence 10", ev.SubmitSeq)
	}
	check := func(when string) {
		t.Helper()
		res := h.st.Cycle()
		if len(res.Plans) != 1 || len(res.Plans[0].Items) != 1 || res.Plans[0].Items[0].JobID != "first" {
			t.Fatalf("%s: plans %+v; want the one GPU for the job that arrived first", when, res.Plans)
		}
	}
	check("live")
	h.restart()
	check("after a restart")
}
