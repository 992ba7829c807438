package gateway

import (
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/contracts/openapi"
)

// TestRoutesDocumented walks every route the gateway registers (handler)
// and fails when one is missing from the OpenAPI document, or when the
// document names a route or method the gateway does not have.
func TestRoutesDocumented(t *testing.T) {
	ix, err := apiSpec()
	if err != nil {
		t.Fatal(err)
	}
	s := &server{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	s.handler()
	registered := map[string]bool{}
	for _, r := range s.routes {
		method, pattern, _ := strings.Cut(r, " ")
		if pattern == "/{$}" {
			pattern = "/"
		}
		registered[method+" "+pattern] = true
	}
	if len(registered) < 40 {
		t.Fatalf("only %d routes registered: the walk sees too little", len(registered))
	}
	for _, r := range slices.Sorted(maps.Keys(registered)) {
		if _, ok := ix.ops[r]; !ok {
			t.Errorf("route %s is not in contracts/openapi/gateway.openapi.json (add it to contracts/openapi/gen/build.go and go generate)", r)
		}
	}
	for _, r := range slices.Sorted(maps.Keys(ix.ops)) {
		if !registered[r] {
			t.Errorf("the OpenAPI document names %s, which the gateway does not route", r)
		}
	}
}

// TestOpenAPIDocumentIsServed reads GET /v1/openapi.json without
// credentials: the committed document, as JSON.
func TestOpenAPIDocumentIsServed(t *testing.T) {
	h := startGateway(t, nil, nil)
	res, err := h.hc.Do(mustGet(t, h.url+"/v1/openapi.json", "Authorization", "-"))
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	body, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK || res.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("GET /v1/openapi.json without a token: %d %s", res.StatusCode, res.Header.Get("Content-Type"))
	}
	if !bytes.Equal(body, openapi.Gateway) {
		t.Fatalf("served %d bytes, not the %d of contracts/openapi", len(body), len(openapi.Gateway))
	}
	if !bytes.Contains(body, []byte(`"openapi": "3.1.0"`)) {
		t.Fatal("the served document is not OpenAPI 3.1")
	}
}

func mustGet(t *testing.T, url string, headers ...string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	return req
}

// roundTripFunc answers a request with a canned response.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// TestOpenAPICheckCatchesMismatches feeds the validating transport
// responses that break the document in each way it checks, and ones that
// keep it, so a checker that let everything through fails here.
func TestOpenAPICheckCatchesMismatches(t *testing.T) {
	ix, err := apiSpec()
	if err != nil {
		t.Fatal(err)
	}
	ev, err := json.Marshal(contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: contracts.EventQueued,
		Tenant: "acme", JobID: "j1", State: contracts.StateQueued, Time: time.Date(2026, 11, 3, 10, 0, 0, 0, time.UTC)})
	if err != nil {
		t.Fatal(err)
	}
	const (
		apiErr    = `{"error":{"reason":"not_found","message":"no"}}`
		submitted = `{"tenant":"acme","jobId":"j1","stream":"JOBS","sequence":1,"duplicate":false}`
	)
	tests := map[string]struct {
		method, path string
		status       int
		header       []string // name, value pairs
		body         string
		want         string // "" when the response keeps the document
	}{
		"healthz ok":           {"GET", "/healthz", 200, []string{"Content-Type", "application/json"}, `{"status":"ok"}`, ""},
		"undeclared status":    {"GET", "/healthz", 418, []string{"Content-Type", "application/json"}, apiErr, "status 418 is not declared"},
		"body off its schema":  {"GET", "/v1/tenants/acme/jobs/j1", 200, []string{"Content-Type", "application/json"}, `{"jobId":5}`, "doesn't match its schema"},
		"error body off":       {"GET", "/v1/tenants/acme/jobs/j1", 404, []string{"Content-Type", "application/json"}, `{"reason":"x"}`, "doesn't match its schema"},
		"undeclared type":      {"GET", "/v1/tenants/acme/jobs/j1", 200, []string{"Content-Type", "text/plain"}, `hi`, `Content-Type "text/plain" is not declared`},
		"405 with its Allow":   {"PUT", "/healthz", 405, []string{"Content-Type", "application/json", "Allow", "GET, HEAD"}, apiErr, ""},
		"405 with wrong Allow": {"PUT", "/healthz", 405, []string{"Content-Type", "application/json", "Allow", "GET"}, apiErr, `make "GET, HEAD"`},
		"listed method, 405":   {"GET", "/healthz", 405, []string{"Content-Type", "application/json"}, apiErr, "status 405 is not declared"},
		"no route, 404":        {"GET", "/v2/x", 404, []string{"Content-Type", "application/json"}, apiErr, ""},
		"no route, 200":        {"GET", "/v2/x", 200, []string{"Content-Type", "application/json"}, apiErr, "must answer 404"},
		"no route, no token": {"GET", "/v2/x", 401, []string{"Content-Type", "application/json",
			"WWW-Authenticate", `Bearer realm="gpuplane"`}, apiErr, ""},
		"unclean path redirected": {"POST", "/v1/nodes/n1/gpus//cordon", 307, []string{"Location", "/v1/nodes/n1/gpus/cordon"}, "", ""},
		"unclean path answered":   {"POST", "/v1/nodes/n1/gpus//cordon", 200, []string{"Content-Type", "application/json"}, "{}", "must be redirected"},
		"401 without WWW-Authenticate": {"GET", "/v1/nodes", 401, []string{"Content-Type", "application/json"}, apiErr,
			`header "WWW-Authenticate"`},
		"401 with WWW-Authenticate": {"GET", "/v1/nodes", 401, []string{"Content-Type", "application/json",
			"WWW-Authenticate", `Bearer realm="gpuplane"`}, apiErr, ""},
		"head of a GET": {"HEAD", "/v1/nodes", 200, []string{"Content-Type", "application/json"}, "", ""},
		"events ok": {"GET", "/v1/tenants/acme/events", 200, []string{"Content-Type", "text/event-stream"},
			": stream open\n\nevent: queued\nid: 7\ndata: " + string(ev) + "\n\n", ""},
		"event id not a sequence": {"GET", "/v1/tenants/acme/events", 200, []string{"Content-Type", "text/event-stream"},
			"event: queued\nid: x\ndata: " + string(ev) + "\n\n", "not a stream sequence"},
		"event data off its schema": {"GET", "/v1/tenants/acme/jobs/j1/events", 200, []string{"Content-Type", "text/event-stream"},
			"event: queued\nid: 7\ndata: {\"type\":\"queued\"}\n\n", "does not match its schema"},
		"event named after another type": {"GET", "/v1/tenants/acme/events", 200, []string{"Content-Type", "text/event-stream"},
			"event: running\nid: 7\ndata: " + string(ev) + "\n\n", "carries a JobEvent of type queued"},
		"accepted body the document refuses": {"POST", "/v1/tenants/acme/jobs", 202, []string{"Content-Type", "application/json"},
			submitted, "accepted a request the document refuses"},
		"accepted query the document refuses": {"GET", "/v1/tenants/acme/jobs?limit=0", 200, []string{"Content-Type", "application/json"},
			`{"jobs":[]}`, "accepted a request the document refuses"},
		"refused body": {"POST", "/v1/tenants/acme/jobs", 400, []string{"Content-Type", "application/json"}, apiErr, ""},
		"logs as text": {"GET", "/v1/tenants/acme/jobs/j1/logs?follow=true", 200, []string{"Content-Type", "text/plain; charset=utf-8"}, "out\n", ""},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			c := &openapiCheck{ix: ix, canned: true, base: roundTripFunc(func(r *http.Request) (*http.Response, error) {
				res := &http.Response{StatusCode: tt.status, Header: http.Header{}, Request: r,
					Body: io.NopCloser(strings.NewReader(tt.body))}
				for i := 0; i+1 < len(tt.header); i += 2 {
					res.Header.Set(tt.header[i], tt.header[i+1])
				}
				return res, nil
			})}
			var sent io.Reader
			if tt.method == http.MethodPost {
				sent = strings.NewReader(`{"resources":"all of them"}`) // no run, resources not an object
			}
			req, err := http.NewRequestWithContext(t.Context(), tt.method, "http://gw"+tt.path, sent)
			if err != nil {
				t.Fatal(err)
			}
			res, err := c.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(res.Body) // the stream's frames are checked as they are read
			if string(body) != tt.body {
				t.Fatalf("the test read %q, not the body sent %q", body, tt.body)
			}
			got := strings.Join(c.report(), "\n")
			switch {
			case tt.want == "" && got != "":
				t.Fatalf("a response that keeps the document was refused: %s", got)
			case tt.want != "" && !strings.Contains(got, tt.want):
				t.Fatalf("failures %q, want one saying %q", got, tt.want)
			}
		})
	}
}
