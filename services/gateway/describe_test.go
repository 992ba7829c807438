package gateway

import (
	"context"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// publishNth publishes ev with the n-th ID of its type and attempt, as
// the scheduler numbers pending events, and returns its stream sequence.
func (h *harness) publishNth(ev contracts.JobEvent, n int) uint64 {
	h.t.Helper()
	ev.SchemaVersion = contracts.SchemaVersion
	if ev.State == "" {
		ev.State, _ = contracts.Transition(contracts.StateQueued, ev.Type)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	ack, err := h.bus.Publish(ctx, contracts.SubjectJobEvents(ev.Tenant, ev.JobID),
		contracts.JobEventID(ev.Tenant, ev.JobID, ev.Type, ev.Attempt, n), ev)
	if err != nil {
		h.t.Fatalf("publish %s event: %v", ev.Type, err)
	}
	return ack.Sequence
}

func (h *harness) describe(t *testing.T, id string) contracts.JobDescription {
	t.Helper()
	var d contracts.JobDescription
	if status, body := h.do(http.MethodGet, "/v1/tenants/acme/jobs/"+id+"/describe", "", &d); status != http.StatusOK {
		t.Fatalf("describe %s: %d %s", id, status, body)
	}
	return d
}

func gangPart(rank int) contracts.Placement {
	node := "h100-0" + strconv.Itoa(rank+1)
	p := contracts.Placement{AllocationID: contracts.AllocationID("acme", "gang", 1) + "/" + strconv.Itoa(rank), NodeID: node, Pool: "h100"}
	for i := range 8 {
		p.Devices = append(p.Devices, contracts.DeviceRef{Index: i, UUID: "GPU-" + node + "-" + strconv.Itoa(i), Model: "H100-80GB"})
	}
	return p
}

// TestDescribeGang follows a two-machine job through its life: the pending
// reason of the current attempt, both placements by rank, the requeue that
// makes them history, and the events in order.
func TestDescribeGang(t *testing.T) {
	h := startGateway(t, nil, nil)
	body := `{"id":"gang","name":"llm","priority":"high","pool":"h100","resources":{"gpu":{"count":16,"model":"H100-80GB","nodes":2,"topology":"nvlink"},"cpuMilli":96000},` +
		`"run":{"duration":"2h"},"nodeSelector":{"zone":"a"},"tolerations":[{"key":"spot","operator":"Exists"}],"dependsOn":["prep"],` +
		`"placementTimeout":"30m","expectedRunTime":"2h"}`
	req, err := contracts.DecodeJobRequest([]byte(body), "acme")
	if err != nil {
		t.Fatal(err)
	}
	n := req.Normalized("acme")
	ev := func(typ contracts.JobEventType, attempt int, at time.Duration) contracts.JobEvent {
		return contracts.JobEvent{Type: typ, Tenant: "acme", JobID: "gang", Attempt: attempt, Time: t0.Add(at)}
	}
	q := ev(contracts.EventQueued, 1, 0)
	q.Request = &n
	s1 := h.publishNth(q, 0)
	p1 := ev(contracts.EventPending, 1, time.Second)
	p1.Reason, p1.Message = contracts.PendingDependencies, "waiting for prep (running)"
	s2 := h.publishNth(p1, 1)
	p2 := ev(contracts.EventPending, 1, 2*time.Second)
	p2.Reason, p2.Message = contracts.PendingInsufficientGPUs, "needs 2 machines of 8×H100-80GB in one NVLink domain; largest free block is 6 on h100-03"
	s3 := h.publishNth(p2, 2)
	p3 := p2
	p3.Time, p3.Message = t0.Add(3*time.Second), "needs 2 machines of 8×H100-80GB in one NVLink domain; 1 machine free"
	s4 := h.publishNth(p3, 3)
	// A duplicate submit's rejection is not the job's story.
	rej := ev(contracts.EventRejected, 0, 4*time.Second)
	rej.State, rej.Reason = contracts.StateRejected, contracts.ReasonDuplicateJobID
	h.publishNth(rej, 0)

	var d contracts.JobDescription
	h.eventually("gang pending", func() bool {
		status, _ := h.do(http.MethodGet, "/v1/tenants/acme/jobs/gang/describe", "", fresh(&d))
		return status == http.StatusOK && len(d.Events) == 4
	})
	want := contracts.JobDescription{Tenant: "acme", JobID: "gang", Name: "llm", State: contracts.StateQueued, Attempt: 1,
		Pending: &contracts.PendingStatus{Reason: contracts.PendingInsufficientGPUs, Message: p3.Message, Since: p2.Time},
		Reason:  contracts.PendingInsufficientGPUs, Message: p3.Message, Request: &n, DependsOn: []string{"prep"},
		CreatedAt: t0, UpdatedAt: p3.Time,
		Events: []contracts.EventSummary{
			{Seq: s1, Type: contracts.EventQueued, Attempt: 1, Time: t0},
			{Seq: s2, Type: contracts.EventPending, Attempt: 1, Time: p1.Time, Reason: p1.Reason, Message: p1.Message},
			{Seq: s3, Type: contracts.EventPending, Attempt: 1, Time: p2.Time, Reason: p2.Reason, Message: p2.Message},
			{Seq: s4, Type: contracts.EventPending, Attempt: 1, Time: p3.Time, Reason: p3.Reason, Message: p3.Message},
		}}
	if diff := cmp.Diff(want, d, cmpTime); diff != "" {
		t.Fatalf("describe while pending (-want +got):\n%s", diff)
	}

	// Scheduled on two machines: both parts, by rank; pending is over.
	sch := ev(contracts.EventScheduled, 1, 5*time.Second)
	sch.Placement = &contracts.Placement{AllocationID: "first-part-only", NodeID: "h100-01"}
	sch.Placements = []contracts.Placement{gangPart(0), gangPart(1)}
	h.publishNth(sch, 0)
	run := ev(contracts.EventRunning, 1, 6*time.Second)
	run.State = contracts.StateRunning
	h.publishNth(run, 0)
	h.eventually("gang running", func() bool { return h.describe(t, "gang").State == contracts.StateRunning })
	d = h.describe(t, "gang")
	if d.Pending != nil || len(d.Events) != 6 || !cmp.Equal(d.Placements, []contracts.Placement{gangPart(0), gangPart(1)}) {
		t.Fatalf("describe while running: pending %+v, %d events, placements %+v", d.Pending, len(d.Events), d.Placements)
	}

	// Preempted: attempt 2 waits again, with its own reason.
	rq := ev(contracts.EventRequeued, 2, 7*time.Second)
	rq.State, rq.Reason, rq.Message = contracts.StateQueued, contracts.ReasonPreempted, "evicted for acme/critical-1"
	h.publishNth(rq, 0)
	h.eventually("gang requeued", func() bool { return h.describe(t, "gang").Attempt == 2 })
	if d = h.describe(t, "gang"); d.Pending != nil || len(d.Placements) != 0 || d.Reason != contracts.ReasonPreempted {
		t.Fatalf("describe after requeue: pending %+v, placements %+v, reason %s", d.Pending, d.Placements, d.Reason)
	}
	p4 := ev(contracts.EventPending, 2, 8*time.Second)
	p4.Reason, p4.Message = contracts.PendingQuotaExceeded, "quota acme/h100 at 16 of 16 GPUs"
	h.publishNth(p4, 1)
	h.eventually("attempt 2 pending", func() bool { d = h.describe(t, "gang"); return d.Pending != nil })
	if !cmp.Equal(*d.Pending, contracts.PendingStatus{Reason: p4.Reason, Message: p4.Message, Since: p4.Time}, cmpTime) || len(d.Events) != 8 {
		t.Fatalf("attempt 2 pending: %+v, %d events", d.Pending, len(d.Events))
	}

	for name, tt := range map[string]refusal{
		"unknown job": {http.MethodGet, "/v1/tenants/acme/jobs/nope/describe", "", 404, contracts.ReasonUnknownJob, "", "has no job nope"},
		"bad job id":  {http.MethodGet, "/v1/tenants/acme/jobs/a.b/describe", "", 400, contracts.ReasonInvalidID, "id", "invalid id"},
		"bad tenant":  {http.MethodGet, "/v1/tenants/Acme/jobs/gang/describe", "", 400, contracts.ReasonInvalidTenant, "tenant", "invalid tenant"},
		"post":        {http.MethodPost, "/v1/tenants/acme/jobs/gang/describe", "", 405, contracts.ReasonMethodNotAllowed, "", "allowed: GET, HEAD"},
	} {
		t.Run(name, func(t *testing.T) { h.refused(t, tt) })
	}
}

// TestDescribeFoldKeepsTheLatestEvents: a job pending for a long time
// flips between reasons; the description keeps the latest events only.
func TestDescribeFoldKeepsTheLatestEvents(t *testing.T) {
	var f describeFold
	req := contracts.JobRequest{ID: "j", Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}}}
	f.apply(contracts.JobEvent{Type: contracts.EventQueued, State: contracts.StateQueued, Tenant: "acme", JobID: "j", Attempt: 1, Time: t0, Request: &req}, 1)
	reasons := []contracts.Reason{contracts.PendingInsufficientGPUs, contracts.PendingQueuedBehind}
	const extra = 50
	for i := range contracts.MaxDescribeEvents + extra {
		f.apply(contracts.JobEvent{Type: contracts.EventPending, State: contracts.StateQueued, Tenant: "acme", JobID: "j", Attempt: 1,
			Time: t0.Add(time.Duration(i+1) * time.Second), Reason: reasons[i%2], Message: "m" + strconv.Itoa(i)}, uint64(i+2))
	}
	// A replayed event changes nothing.
	f.apply(contracts.JobEvent{Type: contracts.EventPending, State: contracts.StateQueued, Tenant: "acme", JobID: "j", Attempt: 1,
		Reason: contracts.PendingNoNodes}, 7)
	d := f.description(contracts.JobStatus{})
	last := contracts.MaxDescribeEvents + extra + 1 // stream sequence of the last pending event
	if len(d.Events) != contracts.MaxDescribeEvents || d.EventsOmitted != extra+1 || d.Events[0].Seq != uint64(last-contracts.MaxDescribeEvents+1) ||
		d.Events[len(d.Events)-1].Seq != uint64(last) {
		t.Fatalf("%d events from seq %d to %d, %d omitted; want %d to %d, %d omitted", len(d.Events), d.Events[0].Seq,
			d.Events[len(d.Events)-1].Seq, d.EventsOmitted, last-contracts.MaxDescribeEvents+1, last, extra+1)
	}
	wantPending := contracts.PendingStatus{Reason: reasons[(contracts.MaxDescribeEvents+extra-1)%2],
		Message: "m" + strconv.Itoa(contracts.MaxDescribeEvents+extra-1), Since: t0.Add(time.Duration(contracts.MaxDescribeEvents+extra) * time.Second)}
	if d.Pending == nil || !cmp.Equal(*d.Pending, wantPending, cmpTime) {
		t.Fatalf("pending %+v, want %+v", d.Pending, wantPending)
	}
	// With no event left in the stream, the read model's status stands in.
	st := contracts.JobStatus{Tenant: "acme", JobID: "old", State: contracts.StateSucceeded, Attempt: 1,
		Placement: &contracts.Placement{NodeID: "n1"}}
	var empty describeFold
	if d := empty.description(st); d.State != contracts.StateSucceeded || len(d.Placements) != 1 || d.Events == nil || d.Pending != nil {
		t.Fatalf("description from the status: %+v", d)
	}
}
