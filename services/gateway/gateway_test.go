package gateway

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// waitFor bounds every wait of these tests.
const waitFor = 10 * time.Second

// harness is a real gateway (Run) on a random port in front of a real
// embedded JetStream, with a bus client of its own playing the scheduler
// and billing.
type harness struct {
	t    *testing.T
	nats *natsserver.Server
	url  string
	bus  *bus.Bus
	// token is a platform admin's API token; hc sends it on every request
	// that names no Authorization of its own.
	token string
	hc    *http.Client
	// logs is everything the gateway logged (secrets must never be there).
	logs syncBuffer
}

// startGateway starts NATS and the gateway and waits until /healthz is 200.
// before, if set, runs against the bus before the gateway starts.
func startGateway(t *testing.T, mutate func(*Config), before func(h *harness)) *harness {
	t.Helper()
	h := &harness{t: t, nats: natstest.Start(t)}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	// The test's own client plays the scheduler, billing and node agents:
	// it connects as the operator, who may publish everything.
	b, err := bus.Connect(ctx, bus.Config{URL: h.nats.URL(), Name: "test-scheduler", CredsFile: natstest.Operator(t, h.nats)})
	if err != nil {
		t.Fatalf("connect test bus: %v", err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	h.bus = b
	h.token = h.issue("test-admin", contracts.Binding{Role: contracts.RolePlatformAdmin})
	h.hc = &http.Client{Transport: bearer{token: h.token}}
	if before != nil {
		before(h)
	}

	cfg := DefaultConfig()
	cfg.Bus.NATSURL = h.nats.URL()
	cfg.Bus.Creds = natstest.Service(t, h.nats, contracts.BusGateway)
	cfg.Bus.OTLPEndpoint = ""
	cfg.Bus.Replicas = 1
	cfg.Addr = "127.0.0.1:0"
	addrs := make(chan string, 1)
	cfg.OnListen = func(a string) { addrs <- a }
	if mutate != nil {
		mutate(&cfg)
	}
	runCtx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	log := slog.New(slog.NewTextHandler(io.MultiWriter(t.Output(), &h.logs), &slog.HandlerOptions{Level: slog.LevelInfo}))
	go func() { done <- Run(runCtx, cfg, log) }()
	t.Cleanup(func() {
		stop()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run returned %v after shutdown, want nil", err)
			}
		case <-time.After(waitFor):
			t.Errorf("Run did not return within %s of shutdown", waitFor)
		}
	})
	select {
	case a := <-addrs:
		h.url = "http://" + a
		if cfg.TLSCert != "" {
			h.url = "https://" + a
			h.hc.Transport = bearer{token: h.token, base: trusting(t, cfg.TLSCert)}
		}
	case err := <-done:
		t.Fatalf("Run returned before listening: %v", err)
	case <-time.After(waitFor):
		t.Fatal("gateway did not listen in time")
	}
	h.hc.Transport = h.checkOpenAPI(h.hc.Transport) // every response is held to the OpenAPI document
	h.eventually("healthz 200", func() bool {
		status, _ := h.do(http.MethodGet, "/healthz", "", nil)
		return status == http.StatusOK
	})
	return h
}

func (h *harness) eventually(what string, cond func() bool) {
	h.t.Helper()
	deadline := time.Now().Add(waitFor)
	for !cond() {
		if time.Now().After(deadline) {
			h.t.Fatalf("timed out after %s waiting for %s", waitFor, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// do sends one request and returns the status and body; out, if set,
// receives the decoded JSON body.
func (h *harness) do(method, path, body string, out any, headers ...string) (int, []byte) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, h.url+path, rd)
	if err != nil {
		h.t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	res, err := h.hc.Do(req)
	if err != nil {
		h.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer res.Body.Close()
	data, err := io.ReadAll(res.Body)
	if err != nil {
		h.t.Fatalf("%s %s: read body: %v", method, path, err)
	}
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			h.t.Fatalf("%s %s: status %d, body %q: %v", method, path, res.StatusCode, data, err)
		}
	}
	return res.StatusCode, data
}

// publishEvent publishes a JobEvent as the scheduler does and returns its
// stream sequence.
func (h *harness) publishEvent(ev contracts.JobEvent) uint64 {
	h.t.Helper()
	ev.SchemaVersion = contracts.SchemaVersion
	if ev.State == "" {
		ev.State, _ = contracts.Transition(contracts.StateQueued, ev.Type)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	ack, err := h.bus.Publish(ctx, contracts.SubjectJobEvents(ev.Tenant, ev.JobID),
		contracts.JobEventID(ev.Tenant, ev.JobID, ev.Type, ev.Attempt, 0), ev)
	if err != nil {
		h.t.Fatalf("publish %s event: %v", ev.Type, err)
	}
	return ack.Sequence
}

// messages returns every message now in stream on subject filter.
func (h *harness) messages(stream, filter string) []*bus.Msg {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	var got []*bus.Msg
	_, err := h.bus.Replay(ctx, bus.FollowSpec{Stream: stream, FilterSubjects: []string{filter}}, func(_ context.Context, m *bus.Msg) error {
		got = append(got, m)
		return nil
	})
	if err != nil {
		h.t.Fatalf("replay %s: %v", stream, err)
	}
	return got
}

func (h *harness) streamMsgs(stream string) uint64 {
	h.t.Helper()
	info := h.streamInfo(stream)
	return info.State.Msgs
}

func (h *harness) streamInfo(stream string) *jetstream.StreamInfo {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	s, err := h.bus.JetStream().Stream(ctx, stream)
	if err != nil {
		h.t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		h.t.Fatal(err)
	}
	return info
}

var t0 = time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)

func queued(tenant, id string, at time.Time) contracts.JobEvent {
	req, err := contracts.DecodeJobRequest([]byte(validBody(id)), tenant)
	if err != nil {
		panic(err)
	}
	n := req.Normalized(tenant)
	return contracts.JobEvent{Type: contracts.EventQueued, Tenant: tenant, JobID: id, Attempt: 1, State: contracts.StateQueued, Time: at, Request: &n}
}

func validBody(id string) string {
	return `{"id":"` + id + `","name":"resnet","priority":"high","resources":{"gpu":{"count":2,"model":"H100-80GB","memoryMiB":40000}},"run":{"duration":"30s"}}`
}

func TestSubmitPublishesOnceWithItsMsgID(t *testing.T) {
	h := startGateway(t, nil, nil)
	var res contracts.SubmitResponse
	status, body := h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody("train-1"), &res)
	if status != http.StatusAccepted {
		t.Fatalf("POST: status %d, body %s", status, body)
	}
	if res.Tenant != "acme" || res.JobID != "train-1" || res.Stream != contracts.StreamJobs || res.Sequence == 0 || res.Duplicate {
		t.Fatalf("POST answered %+v", res)
	}
	msgs := h.messages(contracts.StreamJobs, contracts.SubjectSubmitAll)
	if len(msgs) != 1 {
		t.Fatalf("JOBS holds %d submits, want 1", len(msgs))
	}
	m := msgs[0]
	if m.Subject != "gp.jobs.submit.acme" || m.ID() != contracts.SubmitMsgID("acme", "train-1") || m.StreamSeq != res.Sequence {
		t.Fatalf("message on %s with Nats-Msg-Id %q at seq %d; want gp.jobs.submit.acme, %q, %d",
			m.Subject, m.ID(), m.StreamSeq, contracts.SubmitMsgID("acme", "train-1"), res.Sequence)
	}
	if m.Header.Get(contracts.HeaderCEType) != "io.gpuplane.job.request.v1" {
		t.Errorf("ce-type = %q", m.Header.Get(contracts.HeaderCEType))
	}
	if _, err := contracts.DecodeJobRequest(m.Data, "acme"); err != nil {
		t.Errorf("published body does not decode for the scheduler: %v", err)
	}

	var again contracts.SubmitResponse
	if status, body := h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody("train-1"), &again); status != http.StatusAccepted {
		t.Fatalf("second POST: status %d, body %s", status, body)
	}
	if !again.Duplicate || again.Sequence != res.Sequence {
		t.Fatalf("second POST answered %+v, want a duplicate of seq %d", again, res.Sequence)
	}
	if n := h.streamMsgs(contracts.StreamJobs); n != 1 {
		t.Fatalf("JOBS holds %d messages after a duplicate, want 1", n)
	}
}

func TestSubmitWithoutIDGetsOne(t *testing.T) {
	h := startGateway(t, nil, nil)
	var res contracts.SubmitResponse
	body := `{"resources":{"gpu":{"count":1}},"run":{"duration":"5s"}}`
	if status, data := h.do(http.MethodPost, "/v1/tenants/acme/jobs", body, &res); status != http.StatusAccepted {
		t.Fatalf("status %d, body %s", status, data)
	}
	if err := contracts.ValidateID(res.JobID); err != nil || len(res.JobID) != 26 {
		t.Fatalf("generated id %q: %v", res.JobID, err)
	}
	msgs := h.messages(contracts.StreamJobs, contracts.SubjectSubmit("acme"))
	if len(msgs) != 1 || msgs[0].ID() != contracts.SubmitMsgID("acme", res.JobID) {
		t.Fatalf("got %d messages, want one with Nats-Msg-Id %s", len(msgs), contracts.SubmitMsgID("acme", res.JobID))
	}
	req, err := contracts.DecodeJobRequest(msgs[0].Data, "acme")
	if err != nil || req.ID != res.JobID || req.Run.Duration.D() != 5*time.Second {
		t.Fatalf("published request %+v (err %v), want id %s and duration 5s", req, err, res.JobID)
	}
}

// TestSubmitRejectsMalformedRequests is the catalogue of bad input at the
// front door: each gets its specific reason, and nothing reaches the bus.
func TestSubmitRejectsMalformedRequests(t *testing.T) {
	h := startGateway(t, nil, nil)
	ok := func(id string) string { return validBody(id) }
	tests := map[string]struct {
		tenant, body string
		status       int
		reason       contracts.Reason
		field        string
	}{
		"empty body":          {"acme", ``, 400, contracts.ReasonEmptyBody, ""},
		"whitespace body":     {"acme", " \n\t", 400, contracts.ReasonEmptyBody, ""},
		"invalid json":        {"acme", `{"id":`, 400, contracts.ReasonInvalidJSON, ""},
		"not json":            {"acme", `hello`, 400, contracts.ReasonInvalidJSON, ""},
		"array":               {"acme", `[1]`, 400, contracts.ReasonInvalidType, ""},
		"trailing garbage":    {"acme", ok("a") + `xyz`, 400, contracts.ReasonInvalidJSON, ""},
		"count as string":     {"acme", `{"id":"a","resources":{"gpu":{"count":"2"}},"run":{"duration":"1s"}}`, 400, contracts.ReasonInvalidType, "resources.gpu.count"},
		"id as number":        {"acme", `{"id":7,"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, 400, contracts.ReasonInvalidType, "id"},
		"unknown field":       {"acme", `{"id":"a","gpus":1,"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, 400, contracts.ReasonUnknownField, "gpus"},
		"too large":           {"acme", `{"id":"a","name":"` + strings.Repeat("x", contracts.MaxMessageBytes) + `"}`, 413, contracts.ReasonTooLarge, ""},
		"tenant mismatch":     {"acme", `{"id":"a","tenant":"other","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, 400, contracts.ReasonTenantMismatch, "tenant"},
		"uppercase tenant":    {"Acme", ok("a"), 400, contracts.ReasonInvalidTenant, "tenant"},
		"tenant with dot":     {"ac.me", ok("a"), 400, contracts.ReasonInvalidTenant, "tenant"},
		"tenant with star":    {"ac%2Ame", ok("a"), 400, contracts.ReasonInvalidTenant, "tenant"},
		"tenant with space":   {"ac%20me", ok("a"), 400, contracts.ReasonInvalidTenant, "tenant"},
		"unknown gpu model":   {"acme", `{"id":"a","resources":{"gpu":{"count":1,"model":"RTX-9090"}},"run":{"duration":"1s"}}`, 400, contracts.ReasonUnknownGPUModel, "resources.gpu.model"},
		"zero gpus":           {"acme", `{"id":"a","resources":{"gpu":{"count":0}},"run":{"duration":"1s"}}`, 400, contracts.ReasonOutOfRange, "resources.gpu.count"},
		"2000 gpus":           {"acme", `{"id":"a","resources":{"gpu":{"count":2000}},"run":{"duration":"1s"}}`, 400, contracts.ReasonOutOfRange, "resources.gpu.count"},
		"negative memory":     {"acme", `{"id":"a","resources":{"gpu":{"count":1,"memoryMiB":-1}},"run":{"duration":"1s"}}`, 400, contracts.ReasonOutOfRange, "resources.gpu.memoryMiB"},
		"bad duration":        {"acme", `{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"soon"}}`, 400, contracts.ReasonInvalidDuration, "run.duration"},
		"negative duration":   {"acme", `{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"-5s"}}`, 400, contracts.ReasonInvalidDuration, "run.duration"},
		"missing run":         {"acme", `{"id":"a","resources":{"gpu":{"count":1}}}`, 400, contracts.ReasonMissingField, "run"},
		"id with dot":         {"acme", ok("a.b"), 400, contracts.ReasonInvalidID, "id"},
		"id with star":        {"acme", ok("a*"), 400, contracts.ReasonInvalidID, "id"},
		"id with gt":          {"acme", ok("a>"), 400, contracts.ReasonInvalidID, "id"},
		"id with space":       {"acme", ok("a b"), 400, contracts.ReasonInvalidID, "id"},
		"unknown priority":    {"acme", `{"id":"a","priority":"urgent","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, 400, contracts.ReasonUnknownPriority, "priority"},
		"schema version 99":   {"acme", `{"schemaVersion":99,"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, 400, contracts.ReasonUnsupportedSchema, "schemaVersion"},
		"env without command": {"acme", `{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"1s","env":{"A":"b"}}}`, 400, contracts.ReasonConflictingRun, "run.env"},
		"bad pool":            {"acme", `{"id":"a","pool":"H100.x","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, 400, contracts.ReasonInvalidValue, "pool"},
		"exit code 300":       {"acme", `{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"1s","exitCode":300}}`, 400, contracts.ReasonOutOfRange, "run.exitCode"},
		"several problems":    {"acme", `{"id":"a.b","priority":"x","resources":{"gpu":{"count":0}}}`, 400, contracts.ReasonInvalidRequest, "priority"},
		"null body, no id":    {"acme", `null`, 400, contracts.ReasonInvalidType, ""},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			h.postRefused(t, "/v1/tenants/"+tt.tenant+"/jobs", tt.body, tt.status, tt.reason, tt.field)
			if n := h.streamMsgs(contracts.StreamJobs); n != 0 {
				t.Fatalf("a rejected request reached the bus: JOBS holds %d messages", n)
			}
		})
	}
	// The same gateway does publish a good request: the zero above is not vacuous.
	if status, body := h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody("good"), nil); status != http.StatusAccepted {
		t.Fatalf("valid POST after the table: status %d, body %s", status, body)
	}
	if n := h.streamMsgs(contracts.StreamJobs); n != 1 {
		t.Fatalf("JOBS holds %d messages, want 1", n)
	}
}

// postRefused POSTs body as JSON to path and checks the answer: status
// and reason, a message, and when field is set a field error naming it.
func (h *harness) postRefused(t *testing.T, path, body string, status int, reason contracts.Reason, field string) {
	t.Helper()
	var apiErr contracts.APIError
	got, data := h.do(http.MethodPost, path, body, &apiErr, "Content-Type", "application/json")
	if got != status || apiErr.Error.Reason != reason {
		t.Fatalf("status %d reason %q, want %d %q; body %s", got, apiErr.Error.Reason, status, reason, data)
	}
	if apiErr.Error.Message == "" {
		t.Errorf("error without a message: %s", data)
	}
	if field != "" && !hasField(apiErr.Error.Fields, field) {
		t.Errorf("fields %+v do not name %q", apiErr.Error.Fields, field)
	}
}

func hasField(fields []contracts.FieldError, name string) bool {
	for _, f := range fields {
		if f.Field == name {
			return true
		}
	}
	return false
}

func TestReadModelAnswersFromJobEvents(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.publishEvent(queued("acme", "old", t0))
	h.publishEvent(queued("acme", "mid", t0.Add(time.Second)))
	q := queued("acme", "new", t0.Add(2*time.Second))
	h.publishEvent(q)
	h.publishEvent(queued("other", "theirs", t0))
	pending := contracts.JobEvent{Type: contracts.EventPending, Tenant: "acme", JobID: "mid", Attempt: 1,
		Time: t0.Add(3 * time.Second), Reason: contracts.PendingInsufficientGPUs, Message: "needs 2 free H100-80GB"}
	h.publishEvent(pending)
	placement := &contracts.Placement{AllocationID: "alloc-1", NodeID: "node-1", Pool: "h100",
		Devices: []contracts.DeviceRef{{Index: 0, UUID: "GPU-a", Model: "H100-80GB"}, {Index: 1, UUID: "GPU-b", Model: "H100-80GB"}}}
	h.publishEvent(contracts.JobEvent{Type: contracts.EventScheduled, Tenant: "acme", JobID: "new", Attempt: 1, Time: t0.Add(4 * time.Second), Placement: placement})
	started := t0.Add(5 * time.Second)
	lastSeq := h.publishEvent(contracts.JobEvent{Type: contracts.EventRunning, Tenant: "acme", JobID: "new", Attempt: 1, Time: started, StartedAt: &started})

	var got contracts.JobStatus
	h.eventually("job new running", func() bool {
		status, _ := h.do(http.MethodGet, "/v1/tenants/acme/jobs/new", "", nil)
		if status != http.StatusOK {
			return false
		}
		h.do(http.MethodGet, "/v1/tenants/acme/jobs/new", "", &got)
		return got.State == contracts.StateRunning
	})
	want := contracts.JobStatus{Tenant: "acme", JobID: "new", Name: "resnet", State: contracts.StateRunning, Attempt: 1,
		Request: q.Request, Placement: placement, CreatedAt: t0.Add(2 * time.Second), UpdatedAt: started, StartedAt: &started, LastSeq: lastSeq}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("GET job (-want +got):\n%s", diff)
	}

	var mid contracts.JobStatus
	h.do(http.MethodGet, "/v1/tenants/acme/jobs/mid", "", &mid)
	if mid.State != contracts.StateQueued || mid.Reason != contracts.PendingInsufficientGPUs {
		t.Errorf("pending job: state %s reason %s, want queued with %s", mid.State, mid.Reason, contracts.PendingInsufficientGPUs)
	}

	ids := func(path string) []string {
		var list contracts.JobList
		if status, body := h.do(http.MethodGet, path, "", &list); status != http.StatusOK {
			t.Fatalf("GET %s: %d %s", path, status, body)
		}
		out := []string{}
		for _, j := range list.Jobs {
			out = append(out, j.JobID)
		}
		return out
	}
	for path, want := range map[string][]string{
		"/v1/tenants/acme/jobs":                        {"new", "mid", "old"},
		"/v1/tenants/acme/jobs?limit=2":                {"new", "mid"},
		"/v1/tenants/acme/jobs?state=queued":           {"mid", "old"},
		"/v1/tenants/acme/jobs?state=running&limit=10": {"new"},
		"/v1/tenants/acme/jobs?state=failed":           {},
		"/v1/tenants/nobody/jobs":                      {},
	} {
		if got := ids(path); strings.Join(got, ",") != strings.Join(want, ",") {
			t.Errorf("GET %s = %v, want %v", path, got, want)
		}
	}
	for path, want := range map[string]struct {
		status int
		reason contracts.Reason
	}{
		"/v1/tenants/acme/jobs?state=sleeping": {400, contracts.ReasonInvalidValue},
		"/v1/tenants/acme/jobs?limit=0":        {400, contracts.ReasonInvalidValue},
		"/v1/tenants/acme/jobs?limit=many":     {400, contracts.ReasonInvalidValue},
		"/v1/tenants/acme/jobs/nope":           {404, contracts.ReasonUnknownJob},
		"/v1/tenants/acme/jobs/a.b":            {400, contracts.ReasonInvalidID},
		"/v1/tenants/ACME/jobs/new":            {400, contracts.ReasonInvalidTenant},
		"/v1/tenants/other/jobs/new":           {404, contracts.ReasonUnknownJob},
	} {
		var apiErr contracts.APIError
		if status, body := h.do(http.MethodGet, path, "", &apiErr); status != want.status || apiErr.Error.Reason != want.reason {
			t.Errorf("GET %s: %d %s, want %d %s", path, status, body, want.status, want.reason)
		}
	}
}

func TestCancel(t *testing.T) {
	h := startGateway(t, nil, nil)
	var apiErr contracts.APIError
	if status, body := h.do(http.MethodDelete, "/v1/tenants/acme/jobs/ghost", "", &apiErr); status != 404 || apiErr.Error.Reason != contracts.ReasonUnknownJob {
		t.Fatalf("DELETE unknown job: %d %s, want 404 unknown_job", status, body)
	}
	h.publishEvent(queued("acme", "j1", t0))
	h.eventually("job j1 known", func() bool {
		status, _ := h.do(http.MethodGet, "/v1/tenants/acme/jobs/j1", "", nil)
		return status == http.StatusOK
	})
	var res contracts.SubmitResponse
	if status, body := h.do(http.MethodDelete, "/v1/tenants/acme/jobs/j1?reason=changed+my+mind", "", &res); status != http.StatusAccepted {
		t.Fatalf("DELETE queued job: %d %s", status, body)
	}
	msgs := h.messages(contracts.StreamJobs, contracts.SubjectCancel("acme"))
	if len(msgs) != 1 || msgs[0].ID() != contracts.CancelMsgID("acme", "j1") || msgs[0].StreamSeq != res.Sequence {
		t.Fatalf("cancel messages %d (want 1 with Nats-Msg-Id %s at seq %d)", len(msgs), contracts.CancelMsgID("acme", "j1"), res.Sequence)
	}
	cr, err := contracts.DecodeCancelRequest(msgs[0].Data)
	if err != nil || cr.JobID != "j1" || cr.Reason != "changed my mind" {
		t.Fatalf("cancel request %+v, err %v", cr, err)
	}

	h.publishEvent(contracts.JobEvent{Type: contracts.EventCancelled, Tenant: "acme", JobID: "j1", Attempt: 1, Time: t0.Add(time.Second), Reason: contracts.ReasonCancelled})
	h.eventually("job j1 cancelled", func() bool {
		var st contracts.JobStatus
		h.do(http.MethodGet, "/v1/tenants/acme/jobs/j1", "", &st)
		return st.State == contracts.StateCancelled
	})
	if status, body := h.do(http.MethodDelete, "/v1/tenants/acme/jobs/j1", "", &apiErr); status != 409 || apiErr.Error.Reason != contracts.ReasonAlreadyTerminal {
		t.Fatalf("DELETE terminal job: %d %s, want 409 already_terminal", status, body)
	}
	if status, body := h.do(http.MethodDelete, "/v1/tenants/acme/jobs/a*b", "", &apiErr); status != 400 || apiErr.Error.Reason != contracts.ReasonInvalidID {
		t.Fatalf("DELETE bad id: %d %s, want 400 invalid_id", status, body)
	}
}

func TestUsageIsIdempotentByRecordID(t *testing.T) {
	h := startGateway(t, nil, nil)
	rec := func(alloc string, millis int64) contracts.UsageRecord {
		return contracts.UsageRecord{SchemaVersion: 1, ID: contracts.UsageID(alloc), AllocationID: alloc, Tenant: "acme",
			JobID: "j-" + alloc, Attempt: 1, GPUs: 2, Start: t0, End: t0.Add(time.Duration(millis/2) * time.Millisecond),
			GPUMillis: millis, GPUSeconds: float64(millis) / 1000, Time: t0}
	}
	ctx := context.Background()
	for i, r := range []contracts.UsageRecord{rec("a1", 3000), rec("a2", 500), rec("a1", 3000)} {
		// Distinct Nats-Msg-Ids so the stream keeps the repeat: the read
		// model must drop it by record ID.
		if _, err := h.bus.Publish(ctx, contracts.SubjectUsage("acme"), r.ID+"/"+string(rune('a'+i)), r); err != nil {
			t.Fatal(err)
		}
	}
	var sum contracts.UsageSummary
	h.eventually("usage of two records", func() bool {
		h.do(http.MethodGet, "/v1/tenants/acme/usage", "", &sum)
		return sum.Records == 2
	})
	if sum.Tenant != "acme" || sum.GPUMillis != 3500 || sum.GPUSeconds != 3.5 || len(sum.ByJob) != 2 {
		t.Fatalf("usage %+v, want 2 records, 3500 ms", sum)
	}
	var none contracts.UsageSummary
	if status, _ := h.do(http.MethodGet, "/v1/tenants/nobody/usage", "", &none); status != 200 || none.Tenant != "nobody" || none.Records != 0 {
		t.Fatalf("usage of an unknown tenant: %d %+v", status, none)
	}
}

// TestReadyMeansCaughtUp publishes history before the gateway starts: once
// /healthz says 200, the history must be answered without waiting.
func TestReadyMeansCaughtUp(t *testing.T) {
	h := startGateway(t, nil, func(h *harness) {
		for i := range 50 {
			h.publishEvent(queued("acme", "hist-"+string(rune('a'+i%26))+string(rune('a'+i/26)), t0.Add(time.Duration(i)*time.Second)))
		}
		if _, err := h.bus.Publish(context.Background(), contracts.SubjectUsage("acme"), "usage/x",
			contracts.UsageRecord{SchemaVersion: 1, ID: "usage/x", Tenant: "acme", GPUMillis: 42}); err != nil {
			t.Fatal(err)
		}
	})
	var list contracts.JobList
	h.do(http.MethodGet, "/v1/tenants/acme/jobs", "", &list)
	if len(list.Jobs) != 50 {
		t.Fatalf("right after healthz 200 the list has %d jobs, want all 50", len(list.Jobs))
	}
	var sum contracts.UsageSummary
	if h.do(http.MethodGet, "/v1/tenants/acme/usage", "", &sum); sum.GPUMillis != 42 {
		t.Fatalf("right after healthz 200 usage is %+v, want 42 ms", sum)
	}
}

func TestConsoleAndProtocolErrors(t *testing.T) {
	h := startGateway(t, nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, h.url+"/", nil)
	res, err := h.hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 200 || !strings.HasPrefix(res.Header.Get("Content-Type"), "text/html") {
		t.Fatalf("GET /: %d %s", res.StatusCode, res.Header.Get("Content-Type"))
	}
	for _, want := range []string{`<script type="module" src="/ui/assets/app-`, `id="app"`} {
		if !bytes.Contains(page, []byte(want)) {
			t.Errorf("console page lacks %q", want)
		}
	}
	for _, external := range []string{"http://", "https://", "//cdn"} {
		if bytes.Contains(page, []byte(external)) {
			t.Errorf("console page refers to an external asset (%q)", external)
		}
	}

	tests := map[string]struct {
		method, path string
		status       int
		reason       contracts.Reason
		allow        string
	}{
		"unknown path":      {http.MethodGet, "/v2/whatever", 404, contracts.ReasonNotFound, ""},
		"trailing slash":    {http.MethodGet, "/v1/tenants/acme/jobs/", 404, contracts.ReasonNotFound, ""},
		"PUT jobs":          {http.MethodPut, "/v1/tenants/acme/jobs", 405, contracts.ReasonMethodNotAllowed, "GET, POST, HEAD"},
		"POST job":          {http.MethodPost, "/v1/tenants/acme/jobs/j1", 405, contracts.ReasonMethodNotAllowed, "DELETE, GET, HEAD"},
		"DELETE healthz":    {http.MethodDelete, "/healthz", 405, contracts.ReasonMethodNotAllowed, "GET, HEAD"},
		"POST console":      {http.MethodPost, "/", 405, contracts.ReasonMethodNotAllowed, "GET, HEAD"},
		"bad Last-Event-ID": {http.MethodGet, "/v1/tenants/acme/events?lastEventId=x", 400, contracts.ReasonInvalidValue, ""},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			req, _ := http.NewRequestWithContext(ctx, tt.method, h.url+tt.path, nil)
			res, err := h.hc.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer res.Body.Close()
			var apiErr contracts.APIError
			if err := json.NewDecoder(res.Body).Decode(&apiErr); err != nil {
				t.Fatalf("body is not an APIError: %v", err)
			}
			if res.StatusCode != tt.status || apiErr.Error.Reason != tt.reason || res.Header.Get("Content-Type") != "application/json" {
				t.Fatalf("%d %s (%s), want %d %s", res.StatusCode, apiErr.Error.Reason, res.Header.Get("Content-Type"), tt.status, tt.reason)
			}
			if got := res.Header.Get("Allow"); got != tt.allow {
				t.Errorf("Allow = %q, want %q", got, tt.allow)
			}
		})
	}
}

func TestRecoverTurnsPanicInto500(t *testing.T) {
	s := &server{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	h := s.observe(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { panic("boom") }))
	rec := newTestWriter()
	h.ServeHTTP(rec, mustRequest(t, http.MethodGet, "/x"))
	var apiErr contracts.APIError
	if err := json.Unmarshal(rec.body.Bytes(), &apiErr); err != nil || rec.status != 500 || apiErr.Error.Reason != contracts.ReasonInternal {
		t.Fatalf("status %d body %q (%v), want 500 internal_error", rec.status, rec.body.String(), err)
	}
}

type testWriter struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func newTestWriter() *testWriter                  { return &testWriter{header: http.Header{}} }
func (w *testWriter) Header() http.Header         { return w.header }
func (w *testWriter) WriteHeader(code int)        { w.status = code }
func (w *testWriter) Write(b []byte) (int, error) { return w.body.Write(b) }
func mustRequest(t *testing.T, m, p string) *http.Request {
	r, err := http.NewRequest(m, "http://gw"+p, nil)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestConfigValidateReportsEveryProblem(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatalf("default config: %v", err)
	}
	bad := DefaultConfig()
	bad.Bus.NATSURL = ""
	bad.Addr = "nowhere"
	bad.MaxBodyBytes = contracts.MaxMessageBytes + 1
	bad.Heartbeat = 0
	bad.ShutdownTimeout = -1
	err := bad.Validate()
	for _, want := range []string{"nats URL", "addr", "max body bytes", "heartbeat", "shutdown timeout"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate() = %v; want it to mention %q", err, want)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if err := Run(ctx, bad, nil); err == nil {
		t.Fatal("Run accepted an invalid config")
	}
}

// sseFrame is one server-sent event, or a comment when Comment is set.
type sseFrame struct {
	Event, ID, Data, Comment string
}

// openStream opens an event stream and returns its frames, closed at EOF,
// and a func that disconnects.
func (h *harness) openStream(path string, headers ...string) (<-chan sseFrame, func()) {
	h.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.url+path, nil)
	if err != nil {
		h.t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	res, err := h.hc.Do(req)
	if err != nil {
		h.t.Fatal(err)
	}
	if res.StatusCode != 200 || res.Header.Get("Content-Type") != "text/event-stream" {
		h.t.Fatalf("GET %s: %d %s", path, res.StatusCode, res.Header.Get("Content-Type"))
	}
	frames := make(chan sseFrame, 64)
	go func() {
		defer close(frames)
		defer res.Body.Close()
		sc := bufio.NewScanner(res.Body)
		var f sseFrame
		for sc.Scan() {
			line := sc.Text()
			switch {
			case line == "":
				frames <- f
				f = sseFrame{}
			case strings.HasPrefix(line, ":"):
				f.Comment = strings.TrimSpace(line[1:])
			case strings.HasPrefix(line, "event: "):
				f.Event = line[len("event: "):]
			case strings.HasPrefix(line, "id: "):
				f.ID = line[len("id: "):]
			case strings.HasPrefix(line, "data: "):
				f.Data = line[len("data: "):]
			}
		}
	}()
	h.t.Cleanup(cancel)
	return frames, cancel
}

// nextEvent returns the next event (skipping comments), or ok false at the
// end of the stream; it fails the test after waitFor.
func nextEvent(t *testing.T, frames <-chan sseFrame) (sseFrame, bool) {
	t.Helper()
	timeout := time.After(waitFor)
	for {
		select {
		case f, ok := <-frames:
			if !ok {
				return f, false
			}
			if f.Comment == "" {
				return f, true
			}
		case <-timeout:
			t.Fatalf("no event within %s", waitFor)
		}
	}
}

func TestJobEventStream(t *testing.T) {
	h := startGateway(t, nil, nil)
	seqQueued := h.publishEvent(queued("acme", "j1", t0))
	h.publishEvent(queued("acme", "other-job", t0))

	frames, _ := h.openStream("/v1/tenants/acme/jobs/j1/events")
	f, ok := nextEvent(t, frames)
	if !ok || f.Event != "queued" || f.ID != itoa(seqQueued) {
		t.Fatalf("history: got %+v, want queued with id %d", f, seqQueued)
	}
	var ev contracts.JobEvent
	if err := json.Unmarshal([]byte(f.Data), &ev); err != nil || ev.JobID != "j1" || ev.Type != contracts.EventQueued {
		t.Fatalf("data %q: %+v %v", f.Data, ev, err)
	}
	// Live: a refused duplicate rejection (skipped), then the job's life.
	h.publishEvent(contracts.JobEvent{Type: contracts.EventRejected, State: contracts.StateRejected, Tenant: "acme", JobID: "j1", Time: t0, Reason: contracts.ReasonDuplicateJobID})
	seqScheduled := h.publishEvent(contracts.JobEvent{Type: contracts.EventScheduled, Tenant: "acme", JobID: "j1", Attempt: 1, Time: t0.Add(time.Second)})
	seqRunning := h.publishEvent(contracts.JobEvent{Type: contracts.EventRunning, Tenant: "acme", JobID: "j1", Attempt: 1, Time: t0.Add(2 * time.Second)})
	zero := 0
	seqDone := h.publishEvent(contracts.JobEvent{Type: contracts.EventSucceeded, Tenant: "acme", JobID: "j1", Attempt: 1, Time: t0.Add(3 * time.Second), ExitCode: &zero})
	for _, want := range []struct {
		event string
		seq   uint64
	}{{"scheduled", seqScheduled}, {"running", seqRunning}, {"succeeded", seqDone}} {
		f, ok := nextEvent(t, frames)
		if !ok || f.Event != want.event || f.ID != itoa(want.seq) {
			t.Fatalf("live: got %+v (open %v), want %s with id %d", f, ok, want.event, want.seq)
		}
	}
	if f, ok := nextEvent(t, frames); ok {
		t.Fatalf("stream went on after the terminal event: %+v", f)
	}

	// Every consumer now is the gateway's own (read model, shared tail).
	baseline := h.streamInfo(contracts.StreamJobEvents).State.Consumers

	// Resume after scheduled: running and succeeded again, then the end.
	resumed, _ := h.openStream("/v1/tenants/acme/jobs/j1/events", "Last-Event-ID", itoa(seqScheduled))
	for _, want := range []string{"running", "succeeded"} {
		if f, ok := nextEvent(t, resumed); !ok || f.Event != want {
			t.Fatalf("resumed: got %+v (open %v), want %s", f, ok, want)
		}
	}
	if f, ok := nextEvent(t, resumed); ok {
		t.Fatalf("resumed stream went on after the terminal event: %+v", f)
	}
	// Resuming after the terminal event ends at once.
	after, _ := h.openStream("/v1/tenants/acme/jobs/j1/events?lastEventId=" + itoa(seqDone))
	if f, ok := nextEvent(t, after); ok {
		t.Fatalf("stream resumed after the end sent %+v", f)
	}

	// A stream holds no consumer of its own (the gateway's shared tail
	// serves it), and a client that goes away mid-stream leaves none
	// behind.
	other, disconnect := h.openStream("/v1/tenants/acme/jobs/other-job/events")
	if f, ok := nextEvent(t, other); !ok || f.Event != "queued" {
		t.Fatalf("other job: got %+v (open %v), want queued", f, ok)
	}
	if n := h.streamInfo(contracts.StreamJobEvents).State.Consumers; n != baseline {
		t.Fatalf("%d consumers on %s with a stream open, want the %d of before", n, contracts.StreamJobEvents, baseline)
	}
	disconnect()
	h.eventually("consumers back to the baseline", func() bool {
		return h.streamInfo(contracts.StreamJobEvents).State.Consumers == baseline
	})
}

func TestTenantEventStreamWithHeartbeats(t *testing.T) {
	h := startGateway(t, func(c *Config) { c.Heartbeat = 20 * time.Millisecond }, nil)
	s1 := h.publishEvent(queued("acme", "a", t0))
	h.publishEvent(queued("other", "x", t0))
	frames, _ := h.openStream("/v1/tenants/acme/events")
	if f, ok := nextEvent(t, frames); !ok || f.ID != itoa(s1) || f.Event != "queued" {
		t.Fatalf("history: %+v", f)
	}
	// Idle: heartbeats keep coming.
	deadline := time.After(waitFor)
	for beats := 0; beats < 2; {
		select {
		case f := <-frames:
			if f.Comment == "heartbeat" {
				beats++
			} else if f.Comment == "" {
				t.Fatalf("unexpected event while idle: %+v", f)
			}
		case <-deadline:
			t.Fatal("no heartbeats")
		}
	}
	h.publishEvent(queued("other", "y", t0))
	s2 := h.publishEvent(queued("acme", "b", t0))
	if f, ok := nextEvent(t, frames); !ok || f.ID != itoa(s2) {
		t.Fatalf("live: %+v, want acme/b at %d (not another tenant's)", f, s2)
	}
	resumed, _ := h.openStream("/v1/tenants/acme/events", "Last-Event-ID", itoa(s1))
	if f, ok := nextEvent(t, resumed); !ok || f.ID != itoa(s2) {
		t.Fatalf("resumed after %d: %+v, want %d", s1, f, s2)
	}
}

func itoa(n uint64) string {
	b, _ := json.Marshal(n)
	return string(b)
}
