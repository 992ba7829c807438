package gateway

import (
	"bytes"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"strings"
	"testing"

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
