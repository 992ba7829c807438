package gpuctl

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

// TestRequestsCarryTraceParent: every request gpuctl sends carries a W3C
// traceparent; the requests of one command share one trace (a new span
// each), and TRACEPARENT puts them in the caller's trace.
func TestRequestsCarryTraceParent(t *testing.T) {
	var mu sync.Mutex
	var got []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Header.Get("traceparent"))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"jobs":[]}`))
	}))
	defer srv.Close()
	const caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	for _, tc := range []struct {
		name, inherited, wantTrace string
	}{
		{name: "new trace"},
		{name: "caller's trace", inherited: caller, wantTrace: "4bf92f3577b34da6a3ce929d0e0e4736"},
		{name: "malformed caller's trace", inherited: "00-zz-00f067aa0ba902b7-01"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mu.Lock()
			got = nil
			mu.Unlock()
			env := map[string]string{"GPUPLANE_GATEWAY": srv.URL, "GPUPLANE_CONFIG_DIR": t.TempDir(),
				"GPUPLANE_TOKEN": "t", "GPUPLANE_TENANT": "acme", EnvTraceParent: tc.inherited}
			a := &app{common: defaults(func(k string) string { return env[k] })}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			// Two clients of one command, as login makes: one trace.
			for range 2 {
				c, err := a.api()
				if err != nil {
					t.Fatal(err)
				}
				if _, err := c.ListJobs(ctx, "acme", gpuplane.ListOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if len(got) != 2 {
				t.Fatalf("%d requests seen, want 2", len(got))
			}
			trace0, trace1 := traceIDOf(got[0]), traceIDOf(got[1])
			if trace0 == "" || trace0 != trace1 {
				t.Fatalf("traceparents %q: want one valid trace", got)
			}
			if tc.wantTrace != "" && trace0 != tc.wantTrace {
				t.Errorf("trace %s, want the caller's %s", trace0, tc.wantTrace)
			}
			if got[0] == got[1] {
				t.Errorf("both requests sent %q: want a span each", got[0])
			}
			if strings.Contains(got[0], "00f067aa0ba902b7") {
				t.Errorf("request reused the caller's span ID: %q", got[0])
			}
		})
	}
}
