package gateway

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// auditTrail returns every record now in AUDIT, in stream order, with its
// sequence and hash, read straight from the stream.
func (h *harness) auditTrail() []contracts.AuditEntry {
	h.t.Helper()
	var out []contracts.AuditEntry
	for _, m := range h.messages(contracts.StreamAudit, contracts.SubjectAuditAll) {
		var rec contracts.AuditRecord
		if err := json.Unmarshal(m.Data, &rec); err != nil {
			h.t.Fatalf("audit seq %d is not a record: %v", m.StreamSeq, err)
		}
		if m.Subject != contracts.SubjectAudit(rec.Tenant, rec.ID) {
			h.t.Errorf("record %s of tenant %q on %s", rec.ID, rec.Tenant, m.Subject)
		}
		out = append(out, contracts.AuditEntry{AuditRecord: rec, Seq: m.StreamSeq, Hash: contracts.AuditHash(m.Data)})
	}
	return out
}

// recordsOf keeps the records of one action on one object.
func recordsOf(trail []contracts.AuditEntry, action, object string) []contracts.AuditEntry {
	var out []contracts.AuditEntry
	for _, e := range trail {
		if e.Action == action && e.Object == object {
			out = append(out, e)
		}
	}
	return out
}

// waitRecords waits until the trail holds n records of action on object
// (records are written before the answer, so this only guards against a
// slow read) and returns them.
func (h *harness) waitRecords(action, object string, n int) []contracts.AuditEntry {
	h.t.Helper()
	var got []contracts.AuditEntry
	h.eventually(action+" records of "+object, func() bool {
		got = recordsOf(h.auditTrail(), action, object)
		return len(got) >= n
	})
	if len(got) != n {
		h.t.Fatalf("%d %s records of %s, want %d: %+v", len(got), action, object, n, got)
	}
	return got
}

// TestAuditRecordsARetriedOperationOnce: a submit retried three times, then
// again after JetStream has forgotten its message IDs, is one record; so is
// a retried cancel, and a retried PUT carrying an Idempotency-Key. The
// record names who, from where, under which trace, and the trace travels
// with the submitted request.
func TestAuditRecordsARetriedOperationOnce(t *testing.T) {
	h := startGateway(t, nil, nil)
	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	for range 3 {
		if status, body := h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody("train-1"), nil,
			"traceparent", "00-"+traceID+"-00f067aa0ba902b7-01"); status != http.StatusAccepted {
			t.Fatalf("submit: %d %s", status, body)
		}
	}
	rec := h.waitRecords("job.submit", "train-1", 1)[0]
	if rec.Tenant != "acme" || rec.Outcome != contracts.AuditSuccess || rec.Actor != "token:test-admin" ||
		rec.AuthMethod != "token" || !strings.HasPrefix(rec.Source, "127.0.0.1:") || rec.TraceID != traceID ||
		rec.Request != "POST /v1/tenants/acme/jobs" || rec.Status != http.StatusAccepted || rec.Gateway == "" ||
		!slices.Contains(rec.Roles, contracts.AuditRole{Role: RolePlatformAdmin}) {
		t.Errorf("submit record = %+v", rec)
	}
	jobs := h.messages(contracts.StreamJobs, contracts.SubjectSubmitAll)
	if len(jobs) != 1 || !strings.Contains(jobs[0].Header.Get("traceparent"), traceID) {
		t.Errorf("the submitted request does not carry the audited trace %s: %d messages, traceparent %q",
			traceID, len(jobs), jobs[0].Header.Get("traceparent"))
	}

	// Beyond the duplicate window only the gateway's own look-up by the
	// record's subject keeps the retry from being a second record.
	natstest.ForgetMsgIDs(t, h.bus.JetStream(), contracts.StreamAudit)
	natstest.ForgetMsgIDs(t, h.bus.JetStream(), contracts.StreamJobs)
	if status, body := h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody("train-1"), nil); status != http.StatusAccepted {
		t.Fatalf("late retry: %d %s", status, body)
	}
	// A later operation's record is the witness that the retry's would be
	// in by now.
	if status, body := h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody("train-2"), nil); status != http.StatusAccepted {
		t.Fatalf("submit train-2: %d %s", status, body)
	}
	h.waitRecords("job.submit", "train-2", 1)
	h.waitRecords("job.submit", "train-1", 1)

	h.publishEvent(queued("acme", "train-1", t0))
	h.eventually("train-1 in the read model", func() bool {
		status, _ := h.do(http.MethodGet, "/v1/tenants/acme/jobs/train-1", "", nil)
		return status == http.StatusOK
	})
	for range 2 {
		if status, body := h.do(http.MethodDelete, "/v1/tenants/acme/jobs/train-1", "", nil); status != http.StatusAccepted {
			t.Fatalf("cancel: %d %s", status, body)
		}
	}
	h.waitRecords("job.cancel", "train-1", 1)

	for range 2 {
		if status, body := h.do(http.MethodPut, "/v1/quotas/acme", `{"weight":2}`, nil, "Idempotency-Key", "quota-edit-1"); status != http.StatusOK {
			t.Fatalf("put quota: %d %s", status, body)
		}
	}
	h.waitRecords("quota.put", "acme", 1)
	// Without a key, two PUTs are two operations.
	if status, body := h.do(http.MethodPut, "/v1/quotas/acme", `{"weight":3}`, nil); status != http.StatusOK {
		t.Fatalf("put quota: %d %s", status, body)
	}
	h.waitRecords("quota.put", "acme", 2)
	h.assertNoSecrets(h.token)
}

// TestAuditRecordsEveryStateChange: each state-changing route leaves one
// record with its action, tenant, object and outcome, successful or not.
func TestAuditRecordsEveryStateChange(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.publishInventory(inventory("sim-1", "sim"), 1)
	h.waitNode("sim-1")
	gpu := inventory("sim-1", "sim").GPUs[0].UUID
	cases := []struct {
		name, method, path, body string
		action, tenant, object   string
		outcome                  contracts.AuditOutcome
		reason                   contracts.Reason
	}{
		{"submit", http.MethodPost, "/v1/tenants/acme/jobs", validBody("j1"), "job.submit", "acme", "j1", contracts.AuditSuccess, ""},
		{"invalid submit", http.MethodPost, "/v1/tenants/acme/jobs", `{"id":"j2","resources":7}`, "job.submit", "acme", "acme", contracts.AuditFailure, ""},
		{"cancel unknown", http.MethodDelete, "/v1/tenants/acme/jobs/nope", "", "job.cancel", "acme", "nope", contracts.AuditFailure, contracts.ReasonUnknownJob},
		{"checkpoint unknown", http.MethodPost, "/v1/tenants/acme/jobs/nope/checkpoint", "", "job.checkpoint", "acme", "nope", contracts.AuditFailure, contracts.ReasonUnknownJob},
		{"quota", http.MethodPut, "/v1/quotas/acme", `{"weight":2}`, "quota.put", "acme", "acme", contracts.AuditSuccess, ""},
		{"quota delete", http.MethodDelete, "/v1/quotas/acme", "", "quota.delete", "acme", "acme", contracts.AuditSuccess, ""},
		{"budget", http.MethodPut, "/v1/tenants/acme/budget", `{"period":"daily","limit":"250.5","policy":"reject"}`, "budget.put", "acme", "acme", contracts.AuditSuccess, ""},
		{"bad budget", http.MethodPut, "/v1/tenants/beta/budget", `{"period":"hourly"}`, "budget.put", "beta", "beta", contracts.AuditFailure, ""},
		{"pool", http.MethodPut, "/v1/pools/h100", `{"policy":"spread"}`, "pool.put", "", "h100", contracts.AuditSuccess, ""},
		{"cordon", http.MethodPost, "/v1/nodes/sim-1/cordon", `{"reason":"fan"}`, "node.cordon", "", "sim-1", contracts.AuditSuccess, ""},
		{"drain unknown", http.MethodPost, "/v1/nodes/ghost/drain", "", "node.drain", "", "ghost", contracts.AuditFailure, contracts.ReasonUnknownNode},
		{"uncordon", http.MethodPost, "/v1/nodes/sim-1/uncordon", "", "node.uncordon", "", "sim-1", contracts.AuditSuccess, ""},
		{"gpu cordon", http.MethodPost, "/v1/nodes/sim-1/gpus/" + gpu + "/cordon", "", "gpu.cordon", "", "sim-1/" + gpu, contracts.AuditSuccess, ""},
		{"fault", http.MethodPost, "/v1/nodes/sim-1/faults", `{"kind":"xid","gpu":"3","code":79}`, "node.fault", "", "sim-1", contracts.AuditSuccess, ""},
		{"bad price book", http.MethodPut, "/v1/pricebook", `{"versions":"x"}`, "pricebook.put", "", "", contracts.AuditFailure, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := len(recordsOf(h.auditTrail(), tc.action, tc.object))
			status, body := h.do(tc.method, tc.path, tc.body, nil)
			recs := h.waitRecords(tc.action, tc.object, before+1)
			rec := recs[len(recs)-1]
			if rec.Tenant != tc.tenant || rec.Outcome != tc.outcome || (tc.reason != "" && rec.Reason != tc.reason) ||
				rec.Status != status || (tc.outcome != contracts.AuditSuccess && rec.Reason == "") {
				t.Errorf("answer %d %s; record %+v; want tenant %q outcome %s reason %q", status, body, rec, tc.tenant, tc.outcome, tc.reason)
			}
		})
	}
	// Reads are not recorded.
	n := len(h.auditTrail())
	h.do(http.MethodGet, "/v1/tenants/acme/jobs", "", nil)
	h.do(http.MethodGet, "/v1/quotas/acme", "", nil)
	h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody("witness"), nil)
	h.waitRecords("job.submit", "witness", 1)
	if got := len(h.auditTrail()); got != n+1 {
		t.Errorf("%d records after two reads and a submit, want %d", got, n+1)
	}
}

// TestAuditRecordsDenials: a refused token and a forbidden operation are
// each one denied record naming who was refused (or anonymous).
func TestAuditRecordsDenials(t *testing.T) {
	var member string
	h := startGateway(t, nil, func(h *harness) { member = h.issue("member-acme", contracts.Binding{Role: RoleMember, Tenant: "acme"}) })
	if status, _ := h.as(member, http.MethodPost, "/v1/tenants/beta/jobs", validBody("sneak"), nil); status != http.StatusForbidden {
		t.Fatalf("member of acme submitting to beta: %d", status)
	}
	if status, _ := h.as(member, http.MethodPut, "/v1/pricebook", `{}`, nil); status != http.StatusForbidden {
		t.Fatalf("member setting the price book: %d", status)
	}
	if status, _ := h.as("", http.MethodPost, "/v1/nodes/n1/cordon", "", nil); status != http.StatusUnauthorized {
		t.Fatalf("cordon without credentials: %d", status)
	}
	trail := h.auditTrail()
	var denied []contracts.AuditEntry
	for _, e := range trail {
		if e.Outcome == contracts.AuditDenied {
			denied = append(denied, e)
		}
	}
	if len(denied) != 3 {
		t.Fatalf("%d denied records, want 3: %+v", len(denied), denied)
	}
	if d := denied[0]; d.Action != "job.submit" || d.Tenant != "beta" || d.Actor != "token:member-acme" ||
		d.Reason != contracts.ReasonForbidden || d.Source == "" || d.TraceID == "" {
		t.Errorf("forbidden submit recorded as %+v", d)
	}
	if d := denied[1]; d.Action != "pricebook.put" || d.Tenant != "" || d.Actor != "token:member-acme" {
		t.Errorf("forbidden price book recorded as %+v", d)
	}
	if d := denied[2]; d.Actor != "anonymous" || d.Reason != contracts.ReasonUnauthenticated || d.Source == "" {
		t.Errorf("unauthenticated cordon recorded as %+v", d)
	}
	h.assertNoSecrets(h.token, member)
}

// TestAuditReadScopesAndFilters: a platform admin reads every record, a
// tenant admin its tenant's only, anyone else nothing; the filters narrow.
func TestAuditReadScopesAndFilters(t *testing.T) {
	var acmeAdmin, member string
	h := startGateway(t, nil, func(h *harness) {
		acmeAdmin = h.issue("admin-acme", contracts.Binding{Role: RoleTenantAdmin, Tenant: "acme"})
		member = h.issue("member-acme", contracts.Binding{Role: RoleMember, Tenant: "acme"})
	})
	h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody("a1"), nil)
	h.do(http.MethodPost, "/v1/tenants/beta/jobs", validBody("b1"), nil)
	h.do(http.MethodPut, "/v1/pools/h100", `{"policy":"spread"}`, nil)
	h.as(member, http.MethodPost, "/v1/tenants/acme/jobs", validBody("a2"), nil)
	h.as(member, http.MethodPost, "/v1/tenants/beta/jobs", validBody("b2"), nil) // denied
	h.waitRecords("job.submit", "a2", 1)

	list := func(token, query string) (int, contracts.AuditList) {
		t.Helper()
		var l contracts.AuditList
		status, _ := h.as(token, http.MethodGet, "/v1/audit?"+query, "", &l)
		return status, l
	}
	objects := func(l contracts.AuditList) []string {
		var out []string
		for _, e := range l.Records {
			if e.Action != "audit.read" {
				out = append(out, e.Tenant+"/"+e.Action+"/"+e.Object)
			}
		}
		return out
	}
	cases := map[string]struct {
		token, query string
		status       int
		want         []string
	}{
		"platform admin, all":    {h.token, "", 200, []string{"acme/job.submit/a1", "beta/job.submit/b1", "/pool.put/h100", "acme/job.submit/a2", "beta/job.submit/beta"}},
		"platform scope":         {h.token, "tenant=_platform", 200, []string{"/pool.put/h100"}},
		"one tenant":             {h.token, "tenant=beta", 200, []string{"beta/job.submit/b1", "beta/job.submit/beta"}},
		"by actor":               {h.token, "actor=token:member-acme", 200, []string{"acme/job.submit/a2", "beta/job.submit/beta"}},
		"by outcome":             {h.token, "outcome=denied", 200, []string{"beta/job.submit/beta"}},
		"by action prefix":       {h.token, "action=pool.*", 200, []string{"/pool.put/h100"}},
		"since an hour":          {h.token, "since=1h&action=job.submit", 200, []string{"acme/job.submit/a1", "beta/job.submit/b1", "acme/job.submit/a2", "beta/job.submit/beta"}},
		"until long ago":         {h.token, "until=2000-01-01T00:00:00Z", 200, nil},
		"tenant admin":           {acmeAdmin, "", 200, []string{"acme/job.submit/a1", "acme/job.submit/a2"}},
		"tenant admin, own":      {acmeAdmin, "tenant=acme&actor=token:member-acme", 200, []string{"acme/job.submit/a2"}},
		"tenant admin, other":    {acmeAdmin, "tenant=beta", 403, nil},
		"tenant admin, platform": {acmeAdmin, "tenant=_platform", 403, nil},
		"member":                 {member, "", 403, nil},
		"bad outcome":            {h.token, "outcome=maybe", 400, nil},
		"bad since":              {h.token, "since=yesterday", 400, nil},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			status, l := list(tc.token, tc.query)
			if status != tc.status || !slices.Equal(objects(l), tc.want) {
				t.Errorf("GET /v1/audit?%s: %d %v, want %d %v", tc.query, status, objects(l), tc.status, tc.want)
			}
			for _, e := range l.Records {
				if e.Seq == 0 || len(e.Hash) != 64 {
					t.Errorf("entry without its place in the chain: %+v", e)
				}
			}
		})
	}
	// A refused read is itself a denial on record.
	if d := recordsOf(h.auditTrail(), "audit.read", "beta"); len(d) == 0 || d[0].Actor != "token:admin-acme" || d[0].Outcome != contracts.AuditDenied {
		t.Errorf("tenant admin's refused read of beta: %+v", d)
	}

	// Paging: limit cuts the list and after continues it.
	status, first := list(h.token, "limit=2&action=job.submit")
	if status != 200 || len(first.Records) != 2 || !first.More {
		t.Fatalf("limit=2: %d %+v", status, first)
	}
	_, rest := list(h.token, "action=job.submit&after="+itoa(first.Records[1].Seq))
	if got := append(objects(first), objects(rest)...); len(got) != 4 || rest.More {
		t.Errorf("two pages hold %v (more %v), want the 4 submits", got, rest.More)
	}
}

// TestAuditChainDetectsTampering: the chain the gateway writes verifies;
// the stream refuses a delete and a purge; a record removed from what was
// read, or forged onto the stream, breaks the chain where it happened.
func TestAuditChainDetectsTampering(t *testing.T) {
	var acmeAdmin string
	h := startGateway(t, nil, func(h *harness) {
		acmeAdmin = h.issue("admin-acme", contracts.Binding{Role: RoleTenantAdmin, Tenant: "acme"})
	})
	for _, id := range []string{"c1", "c2", "c3", "c4"} {
		h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody(id), nil)
	}
	var v contracts.AuditVerification
	if status, body := h.do(http.MethodGet, "/v1/audit/verify", "", &v); status != 200 || !v.OK || v.Records != 4 || len(v.LastHash) != 64 {
		t.Fatalf("verify of an intact chain: %d %s", status, body)
	}
	if status, _ := h.as(acmeAdmin, http.MethodGet, "/v1/audit/verify", "", nil); status != http.StatusForbidden {
		t.Errorf("a tenant admin verified the platform's chain: %d", status)
	}
	if d := recordsOf(h.auditTrail(), "audit.verify", ""); len(d) != 1 || d[0].Outcome != contracts.AuditDenied || d[0].Actor != "token:admin-acme" {
		t.Errorf("the refused verify is recorded as %+v", d)
	}

	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	stream, err := h.bus.JetStream().Stream(ctx, contracts.StreamAudit)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.DeleteMsg(ctx, 2); err == nil {
		t.Error("the AUDIT stream let a record be deleted")
	}
	if err := stream.Purge(ctx); err == nil {
		t.Error("the AUDIT stream let itself be purged")
	}

	// Removing a record from the stored chain is detected after it.
	msgs := h.messages(contracts.StreamAudit, contracts.SubjectAuditAll)
	var chain contracts.AuditChain
	var breaks []uint64
	for i, m := range msgs {
		if i == 1 {
			continue
		}
		if b := chain.Next(m.StreamSeq, m.Data); b != nil {
			breaks = append(breaks, b.Seq)
		}
	}
	if !slices.Equal(breaks, []uint64{msgs[2].StreamSeq}) {
		t.Errorf("removing seq %d broke the chain at %v, want at %d", msgs[1].StreamSeq, breaks, msgs[2].StreamSeq)
	}

	// A record forged by anyone who can publish on the subjects does not
	// chain; the gateway's next record chains onto it, so the trail shows
	// one break, at the forgery.
	forged, _ := json.Marshal(contracts.AuditRecord{ID: "forged1", Action: "quota.put", Tenant: "acme", Outcome: contracts.AuditSuccess, Prev: "feed"})
	ack, err := h.bus.PublishRaw(ctx, contracts.SubjectAudit("acme", "forged1"), "forged1", forged)
	if err != nil {
		t.Fatal(err)
	}
	h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody("c5"), nil)
	if status, body := h.do(http.MethodGet, "/v1/audit/verify", "", &v); status != 200 || v.OK || v.Records != int(h.streamMsgs(contracts.StreamAudit)) ||
		len(v.Breaks) != 1 || v.Breaks[0].Seq != ack.Sequence {
		t.Errorf("verify after a forgery at seq %d: %d %s", ack.Sequence, status, body)
	}
}

// TestAuditUnavailableIsNotConfirmed: when the trail cannot take a record,
// a state change is answered 503; while it stays down the next change is
// refused before it is made; the client's retry, once the trail is back,
// leaves the one record.
func TestAuditUnavailableIsNotConfirmed(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody("before"), nil)
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	js := h.bus.JetStream()
	if err := js.DeleteStream(ctx, contracts.StreamAudit); err != nil {
		t.Fatal(err)
	}
	status, body := h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody("during"), nil)
	if status != http.StatusServiceUnavailable || !strings.Contains(string(body), "audit") {
		t.Fatalf("submit with no audit trail: %d %s", status, body)
	}
	// Now the gateway knows the trail is down: the next change is refused
	// before it is made.
	status, body = h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody("refused"), nil)
	if status != http.StatusServiceUnavailable || !strings.Contains(string(body), "no change is made") {
		t.Fatalf("submit while the trail is known down: %d %s", status, body)
	}
	for _, m := range h.messages(contracts.StreamJobs, contracts.SubjectSubmitAll) {
		if strings.Contains(string(m.Data), `"refused"`) {
			t.Fatalf("a change refused for want of an audit trail was made: %s", m.Data)
		}
	}
	for _, c := range contracts.Streams(contracts.StreamOptions{}) {
		if c.Name == contracts.StreamAudit {
			if _, err := js.CreateStream(ctx, c); err != nil {
				t.Fatal(err)
			}
		}
	}
	var res contracts.SubmitResponse
	if status, body := h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody("during"), &res); status != http.StatusAccepted || !res.Duplicate {
		t.Fatalf("retry once the trail is back: %d %s (the first try was published: want a duplicate)", status, body)
	}
	if status, body := h.do(http.MethodPost, "/v1/tenants/acme/jobs", validBody("refused"), nil); status != http.StatusAccepted {
		t.Fatalf("the refused submit once the trail is back: %d %s", status, body)
	}
	h.waitRecords("job.submit", "refused", 1)
	rec := h.waitRecords("job.submit", "during", 1)[0]
	if rec.Prev != "" || rec.Seq != 1 {
		t.Errorf("the first record of the new stream is %+v, want seq 1 with no prev", rec)
	}
}

// TestAuditConcurrentReplicasKeepOneChain: two gateways appending at once
// keep one verifiable chain and one record per operation.
func TestAuditConcurrentReplicasKeepOneChain(t *testing.T) {
	h := startGateway(t, nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	log := slog.New(slog.NewTextHandler(t.Output(), nil))
	a := newAuditLog(h.bus, "replica-a", log, time.Now)
	b := newAuditLog(h.bus, "replica-b", log, time.Now)
	errs := make(chan error, 40)
	for i := range 20 {
		for _, sink := range []*auditLog{a, b} {
			go func() {
				// Both replicas record the same 20 operations: a client
				// retrying on another replica.
				errs <- sink.record(ctx, auditEvent{Action: "job.submit", Tenant: "acme", Object: "j" + itoa(uint64(i)),
					Outcome: "success", Key: "j" + itoa(uint64(i))})
			}()
		}
	}
	for range 40 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	trail := h.auditTrail()
	if len(trail) != 20 {
		t.Errorf("%d records for 20 operations recorded twice each", len(trail))
	}
	var v contracts.AuditVerification
	if status, body := h.do(http.MethodGet, "/v1/audit/verify", "", &v); status != 200 || !v.OK || v.Records != 20 {
		t.Errorf("verify: %d %s", status, body)
	}
}

func TestOutcomeOf(t *testing.T) {
	apiErr := func(r contracts.Reason) []byte {
		b, _ := json.Marshal(contracts.APIError{Error: contracts.APIErrorBody{Reason: r}})
		return b
	}
	cases := map[string]struct {
		status  int
		body    []byte
		outcome contracts.AuditOutcome
		reason  contracts.Reason
	}{
		"accepted":         {202, []byte(`{"jobId":"x"}`), contracts.AuditSuccess, ""},
		"forbidden":        {403, apiErr(contracts.ReasonAboveGrant), contracts.AuditDenied, contracts.ReasonAboveGrant},
		"401 without body": {401, nil, contracts.AuditDenied, contracts.ReasonUnauthenticated},
		"conflict":         {409, apiErr(contracts.ReasonAlreadyTerminal), contracts.AuditFailure, contracts.ReasonAlreadyTerminal},
		"not json":         {400, []byte("oops"), contracts.AuditFailure, contracts.ReasonInvalidRequest},
		"panic":            {500, nil, contracts.AuditFailure, contracts.ReasonInternal},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			o, r := outcomeOf(tc.status, tc.body)
			if o != tc.outcome || r != tc.reason {
				t.Errorf("outcomeOf(%d) = %s %s, want %s %s", tc.status, o, r, tc.outcome, tc.reason)
			}
		})
	}
}

func TestPathValues(t *testing.T) {
	got := pathValues("/v1/nodes/{node}/gpus/{uuid}/cordon", "/v1/nodes/n%2F1/gpus/GPU-1/cordon")
	if got["node"] != "n/1" || got["uuid"] != "GPU-1" || routeObject(got) != "n/1/GPU-1" {
		t.Errorf("pathValues = %v", got)
	}
	if a := auditActionFor(http.MethodPost, "/v1/login"); a != "login" {
		t.Errorf("action of POST /v1/login = %q", a)
	}
	if a := auditActionFor(http.MethodPost, "/v1/tenants/{tenant}/jobs"); a != "job.submit" {
		t.Errorf("action of a submit = %q", a)
	}
}

// BenchmarkAuditRecord measures one replica appending to the chain: each
// record is a look-up of its key and a compare-and-set publish, serialized
// per replica; parallel callers show what the serialization allows.
func BenchmarkAuditRecord(b *testing.B) {
	srv := natstest.Start(b)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	bb, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "gateway", CredsFile: natstest.Service(b, srv, contracts.BusGateway)})
	if err != nil {
		b.Fatal(err)
	}
	defer bb.Close(context.Background())
	a := newAuditLog(bb, "bench", slog.New(slog.DiscardHandler), time.Now)
	for _, mode := range []string{"serial", "parallel"} {
		var n atomic.Int64
		b.Run(mode, func(b *testing.B) {
			record := func() {
				id := "j" + strconv.FormatInt(n.Add(1), 10) + "-" + mode
				if err := a.record(ctx, auditEvent{Action: "job.submit", Tenant: "acme", Object: id, Outcome: "success", Key: id}); err != nil {
					b.Error(err)
				}
			}
			base, start := n.Load(), time.Now()
			if mode == "serial" {
				for b.Loop() {
					record()
				}
			} else {
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						record()
					}
				})
			}
			b.ReportMetric(float64(n.Load()-base)/time.Since(start).Seconds(), "records/s")
		})
	}
	s, err := bb.JetStream().Stream(ctx, contracts.StreamAudit)
	if err != nil {
		b.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		b.Fatal(err)
	}
	// Real work: every record is in the stream, once.
	var chain contracts.AuditChain
	for seq := uint64(1); seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			b.Fatal(err)
		}
		if br := chain.Next(seq, m.Data); br != nil {
			b.Fatalf("the chain broke under load: %+v", br)
		}
	}
}

// TestBuildAuditRecord: what a record takes from the event, the principal
// and the request, and what it refuses to put in a subject token.
func TestBuildAuditRecord(t *testing.T) {
	now := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	alice := Principal{Subject: "oidc:https://idp#alice", Name: "alice", Method: "oidc",
		Roles: []RoleBinding{{Role: RoleTenantAdmin, Tenant: "acme"}}}
	st := &auditRequest{source: "10.0.0.1:5555", traceID: "t1", request: "PUT /v1/quotas/acme", action: "quota.put", key: "k1", status: 200}
	cases := map[string]struct {
		ctx   context.Context
		event auditEvent
		check func(t *testing.T, rec contracts.AuditRecord, keyed bool)
	}{
		"principal and request": {
			ctx:   withAuditRequest(withPrincipal(context.Background(), alice), st),
			event: auditEvent{Tenant: "acme", Object: "acme", Outcome: "success"},
			check: func(t *testing.T, rec contracts.AuditRecord, keyed bool) {
				want := contracts.AuditRecord{SchemaVersion: contracts.SchemaVersion, Time: now, Actor: alice.Subject, ActorName: "alice",
					AuthMethod: "oidc", Roles: []contracts.AuditRole{{Role: RoleTenantAdmin, Tenant: "acme"}}, Tenant: "acme",
					Action: "quota.put", Object: "acme", Outcome: contracts.AuditSuccess, Request: "PUT /v1/quotas/acme", Status: 200,
					Source: "10.0.0.1:5555", TraceID: "t1",
					ID: contracts.AuditRecordID("quota.put", "acme", "acme", contracts.AuditSuccess, "k1")}
				if diff := cmp.Diff(want, rec); !keyed || diff != "" {
					t.Errorf("keyed %v, record (-want +got):\n%s", keyed, diff)
				}
			},
		},
		"no principal, no request": {
			ctx:   context.Background(),
			event: auditEvent{Action: "login", Outcome: "failure", Reason: "login_failed"},
			check: func(t *testing.T, rec contracts.AuditRecord, keyed bool) {
				if rec.Actor != "anonymous" || keyed || contracts.ValidateID(rec.ID) != nil || rec.Source != "" {
					t.Errorf("keyed %v, record %+v", keyed, rec)
				}
			},
		},
		"malformed tenant stays out of the subject": {
			ctx:   context.Background(),
			event: auditEvent{Action: "job.submit", Tenant: "a.b.>", Object: "j1", Outcome: "denied"},
			check: func(t *testing.T, rec contracts.AuditRecord, _ bool) {
				if rec.Tenant != "" || !strings.Contains(rec.Object, `"a.b.>"`) {
					t.Errorf("record %+v", rec)
				}
			},
		},
		"unknown outcome and action": {
			ctx:   context.Background(),
			event: auditEvent{Action: "Job Submit!", Outcome: "maybe"},
			check: func(t *testing.T, rec contracts.AuditRecord, _ bool) {
				if rec.Action != "request" || rec.Outcome != contracts.AuditFailure {
					t.Errorf("record %+v", rec)
				}
			},
		},
		"another action of the request is not keyed by it": {
			ctx:   withAuditRequest(context.Background(), st),
			event: auditEvent{Action: "login", Outcome: "success"},
			check: func(t *testing.T, rec contracts.AuditRecord, keyed bool) {
				if keyed {
					t.Errorf("a login inside a quota request took the quota's key: %+v", rec)
				}
			},
		},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			rec, keyed := buildAuditRecord(tc.ctx, tc.event, now)
			if contracts.SubjectAudit(rec.Tenant, rec.ID) != "gp.audit."+contracts.AuditScope(rec.Tenant)+"."+rec.ID ||
				strings.ContainsAny(rec.ID, ".*> ") {
				t.Errorf("record ID %q is not one subject token", rec.ID)
			}
			tc.check(t, rec, keyed)
		})
	}
}
