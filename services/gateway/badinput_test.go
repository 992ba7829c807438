package gateway

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestBodyMediaType: a body declared as anything but JSON is refused with
// 415 and an APIError before it is read as JSON; one declared as nothing is
// read as JSON.
func TestBodyMediaType(t *testing.T) {
	h := startGateway(t, nil, nil)
	job := func(id string) string {
		return `{"id":"` + id + `","resources":{"gpu":{"count":1}},"run":{"duration":"5s"}}`
	}
	tests := []struct {
		name, method, path, body, contentType string
		status                                int
	}{
		{"form", http.MethodPost, "/v1/tenants/acme/jobs", job("form"), "application/x-www-form-urlencoded", 415},
		{"text", http.MethodPost, "/v1/tenants/acme/jobs", job("text"), "text/plain", 415},
		{"yaml", http.MethodPut, "/v1/quotas/acme", `{"weight":2}`, "application/yaml", 415},
		{"latin1", http.MethodPost, "/v1/tenants/acme/jobs", job("latin1"), "application/json; charset=iso-8859-1", 415},
		{"garbage type", http.MethodPut, "/v1/pricebook", `{"versions":[]}`, "%%%", 415},
		{"multipart", http.MethodPost, "/v1/nodes/sim-1/cordon", `{"reason":"x"}`, "multipart/form-data; boundary=x", 415},
		{"json", http.MethodPost, "/v1/tenants/acme/jobs", job("json"), "application/json", 202},
		{"json utf-8", http.MethodPost, "/v1/tenants/acme/jobs", job("utf8"), "application/json; charset=UTF-8", 202},
		{"undeclared", http.MethodPost, "/v1/tenants/acme/jobs", job("undeclared"), "", 202},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var headers []string
			if tt.contentType != "" {
				headers = []string{"Content-Type", tt.contentType}
			}
			status, data := h.do(tt.method, tt.path, tt.body, nil, headers...)
			if status != tt.status {
				t.Fatalf("%s %s as %q: %d %s; want %d", tt.method, tt.path, tt.contentType, status, data, tt.status)
			}
			if status != http.StatusUnsupportedMediaType {
				return
			}
			var apiErr contracts.APIError
			if err := json.Unmarshal(data, &apiErr); err != nil || apiErr.Error.Reason != contracts.ReasonUnsupportedMediaType ||
				!strings.Contains(apiErr.Error.Message, "application/json") {
				t.Fatalf("415 body %s (%v); want an APIError unsupported_media_type naming application/json", data, err)
			}
		})
	}
	if n := h.streamMsgs(contracts.StreamJobs); n != 3 {
		t.Fatalf("JOBS holds %d requests, want the 3 accepted ones", n)
	}
}

// TestBodyMustBeAnObject: null, an array or a scalar is refused on every
// body-reading endpoint, saying the body must be an object.
func TestBodyMustBeAnObject(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.publishInventory(inventory("sim-1", "sim"), 1)
	h.waitNode("sim-1")
	paths := []struct{ method, path string }{
		{http.MethodPost, "/v1/tenants/acme/jobs"},
		{http.MethodPut, "/v1/quotas/acme"},
		{http.MethodPut, "/v1/pools/gpu-a"},
		{http.MethodPut, "/v1/pricebook"},
		{http.MethodPut, "/v1/tenants/acme/budget"},
		{http.MethodPost, "/v1/nodes/sim-1/faults"},
		{http.MethodPost, "/v1/nodes/sim-1/cordon"},
	}
	for _, p := range paths {
		for _, body := range []string{`null`, `[]`, `"x"`, `7`} {
			var apiErr contracts.APIError
			status, data := h.do(p.method, p.path, body, &apiErr, "Content-Type", "application/json")
			if status != http.StatusBadRequest || apiErr.Error.Reason != contracts.ReasonInvalidType ||
				!strings.Contains(apiErr.Error.Message, "the body must be a JSON object") {
				t.Errorf("%s %s with %s: %d %s; want 400 invalid_type saying the body must be an object", p.method, p.path, body, status, data)
			}
		}
	}
	if n := h.streamMsgs(contracts.StreamJobs); n != 0 {
		t.Fatalf("JOBS holds %d requests, want none", n)
	}
}

// TestDurationOverflowIsRefusedAsSuch: a duration too long for a Duration
// is out_of_range with the largest one named, never a negative duration;
// a number where the schema says a duration string is refused.
func TestDurationOverflowIsRefusedAsSuch(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.publishInventory(inventory("sim-1", "sim"), 1)
	h.waitNode("sim-1")
	tests := []struct {
		name, path, body string
		reason           contracts.Reason
		field, message   string
	}{
		{"run", "/v1/tenants/acme/jobs", `{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":"9999999999h"}}`,
			contracts.ReasonOutOfRange, "run.duration", "largest duration"},
		{"placement timeout", "/v1/tenants/acme/jobs", `{"id":"a","placementTimeout":"99999999999999999999s",` +
			`"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, contracts.ReasonOutOfRange, "placementTimeout", "largest duration"},
		{"seconds", "/v1/tenants/acme/jobs", `{"id":"a","resources":{"gpu":{"count":1}},"run":{"duration":1e300}}`,
			contracts.ReasonInvalidDuration, "run.duration", "want a duration string"},
		{"fault", "/v1/nodes/sim-1/faults", `{"kind":"overheat","duration":"9999999999h"}`,
			contracts.ReasonOutOfRange, "duration", "largest duration"},
		{"fault seconds", "/v1/nodes/sim-1/faults", `{"kind":"overheat","duration":1e300}`,
			contracts.ReasonInvalidDuration, "duration", "want a duration string"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var apiErr contracts.APIError
			status, data := h.do(http.MethodPost, tt.path, tt.body, &apiErr)
			if status != http.StatusBadRequest || apiErr.Error.Reason != tt.reason || len(apiErr.Error.Fields) != 1 ||
				apiErr.Error.Fields[0].Field != tt.field || !strings.Contains(apiErr.Error.Message, tt.message) ||
				strings.Contains(apiErr.Error.Message, "negative") {
				t.Fatalf("%d %s; want 400 %s on %s saying %q", status, data, tt.reason, tt.field, tt.message)
			}
		})
	}
}

// TestUnreadableDocumentsAreReportedAndRepaired: a KV value that does not
// decode (written past the gateway) makes its GET answer 409
// unreadable_document with the revision to replace, not 500; an
// administrator's PUT replaces it, and the GET answers again.
func TestUnreadableDocumentsAreReportedAndRepaired(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.publishInventory(inventory("sim-1", "sim"), 1)
	h.waitNode("sim-1")
	soon := time.Now().Add(time.Hour).UTC().Truncate(time.Second).Format(time.RFC3339)
	tests := []struct {
		name, bucket, key, path, put string
	}{
		{"price book", contracts.BucketPriceBook, contracts.KeyPriceBook, "/v1/pricebook",
			`{"versions":[{"id":"v1","effectiveFrom":"` + soon + `","currency":"USD","gpu":{"*":{"onDemand":"1.00"}}}]}`},
		{"budget", contracts.BucketBudgets, "acme", "/v1/tenants/acme/budget", `{"period":"monthly","limit":"100","policy":"notify"}`},
		{"quota", contracts.BucketQuotas, "acme", "/v1/quotas/acme", `{"weight":2}`},
		{"pool", contracts.BucketPools, "gpu-a", "/v1/pools/gpu-a", `{"policy":"spread"}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for i, garbage := range []string{`{"versions":`, `\x00\xff not json`, `[1,2,3]`} {
				rev := h.kvPut(tt.bucket, tt.key, []byte(garbage))
				var apiErr contracts.APIError
				status, data := h.do(http.MethodGet, tt.path, "", &apiErr)
				if status != http.StatusConflict || apiErr.Error.Reason != contracts.ReasonUnreadableDocument ||
					!strings.Contains(apiErr.Error.Message, fmt.Sprintf("revision %d", rev)) || !strings.Contains(apiErr.Error.Message, "PUT") {
					t.Fatalf("GET over %q: %d %s; want 409 unreadable_document naming revision %d and the PUT that repairs it",
						garbage, status, data, rev)
				}
				put := tt.path
				if i == 0 {
					put += fmt.Sprintf("?revision=%d", rev) // the conditional repair the message names
				}
				if status, data := h.do(http.MethodPut, put, tt.put, nil); status != http.StatusOK {
					t.Fatalf("PUT over %q: %d %s; want 200", garbage, status, data)
				}
				if status, data := h.do(http.MethodGet, tt.path, "", nil); status != http.StatusOK {
					t.Fatalf("GET after the repair: %d %s", status, data)
				}
			}
		})
	}
	t.Run("node hold", func(t *testing.T) {
		h.kvPut(contracts.BucketNodeAdmin, "sim-1", []byte(`{"cordoned":`))
		var st contracts.NodeStatus
		h.eventually("the unreadable hold shown", func() bool {
			st = contracts.NodeStatus{}
			status, _ := h.do(http.MethodGet, "/v1/nodes/sim-1", "", &st)
			return status == http.StatusOK && st.Admin != nil
		})
		if !st.Admin.Cordoned || st.Admin.Cause != contracts.ReasonUnreadableDocument || !strings.Contains(st.Admin.Reason, "unreadable") {
			t.Fatalf("node admin %+v; want cordoned (as the resource manager reads it) with cause unreadable_document", st.Admin)
		}
		if status, data := h.do(http.MethodPost, "/v1/nodes/sim-1/uncordon", "", nil); status != http.StatusOK {
			t.Fatalf("uncordon: %d %s", status, data)
		}
		h.eventually("the hold lifted", func() bool {
			st = contracts.NodeStatus{}
			status, _ := h.do(http.MethodGet, "/v1/nodes/sim-1", "", &st)
			return status == http.StatusOK && st.Admin == nil
		})
	})
	t.Run("metering watermark", func(t *testing.T) {
		rev := h.kvPut(contracts.BucketPriceBook, contracts.KeyMeteredUntil, []byte("yesterday"))
		var apiErr contracts.APIError
		status, data := h.do(http.MethodGet, "/v1/pricebook", "", &apiErr)
		if status != http.StatusConflict || apiErr.Error.Reason != contracts.ReasonUnreadableDocument ||
			!strings.Contains(apiErr.Error.Message, fmt.Sprintf("revision %d", rev)) || !strings.Contains(apiErr.Error.Message, "billing rewrites it") {
			t.Fatalf("GET over a bad watermark: %d %s", status, data)
		}
	})
}

// TestSubmitWithoutIDIsAsStrict: the gateway names a job its client did
// not, and the body is then decoded as strictly as any: naming the job
// lets nothing through that the schema refuses.
func TestSubmitWithoutIDIsAsStrict(t *testing.T) {
	h := startGateway(t, nil, nil)
	tests := map[string]struct {
		body   string
		reason contracts.Reason
		field  string
	}{
		"empty priority":  {`{"priority":"","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`, contracts.ReasonUnknownPriority, "priority"},
		"count twice":     {`{"resources":{"gpu":{"count":1,"count":1000}},"run":{"duration":"1s"}}`, contracts.ReasonDuplicateField, "resources.gpu.count"},
		"Count for count": {`{"resources":{"gpu":{"Count":2}},"run":{"duration":"1s"}}`, contracts.ReasonInvalidRequest, "resources.gpu.Count"},
		"empty object":    {`{}`, contracts.ReasonInvalidRequest, "run"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			h.postRefused(t, "/v1/tenants/acme/jobs", tt.body, http.StatusBadRequest, tt.reason, tt.field)
		})
	}
	if n := h.streamMsgs(contracts.StreamJobs); n != 0 {
		t.Fatalf("JOBS holds %d requests, want none", n)
	}
	var res contracts.SubmitResponse
	body := `{ "name":"x", "resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`
	if status, data := h.do(http.MethodPost, "/v1/tenants/acme/jobs", body, &res); status != http.StatusAccepted {
		t.Fatalf("valid body without an id: %d %s", status, data)
	}
	msgs := h.messages(contracts.StreamJobs, contracts.SubjectSubmit("acme"))
	if len(msgs) != 1 || string(msgs[0].Data) != `{"id":"`+res.JobID+`","name":"x", "resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}` {
		t.Fatalf("published %d messages, the last %s; want the body with id %s added", len(msgs), msgs[len(msgs)-1].Data, res.JobID)
	}
}
