package telemetry

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

func recorder(t *testing.T) (*sdktrace.TracerProvider, *tracetest.SpanRecorder) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(Sampler(1)), sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp, rec
}

// TestSamplerDropsTelemetry: the spans of per-second telemetry and
// heartbeat traffic are never recorded, under a sampled parent or not;
// job traffic is.
func TestSamplerDropsTelemetry(t *testing.T) {
	tp, _ := recorder(t)
	tr := tp.Tracer("test")
	parent, ps := tr.Start(context.Background(), "parent")
	defer ps.End()
	for _, tc := range []struct {
		name string
		keep bool
	}{
		{"publish gp.telemetry.node-1", false},
		{"process gp.telemetry.node-1", false},
		{"publish gp.heartbeat.node-1", false},
		{"process gp.heartbeat.node-1", false},
		{"process batch TELEMETRY", false},
		{"process batch HEARTBEATS", false},
		{"publish gp.jobs.submit.acme", true},
		{"process gp.alloc.ledger.node-1", true},
		{"process batch ALLOCATIONS", true},
		{"POST /v1/tenants/{tenant}/jobs", true},
		{"telemetry", true},
	} {
		for _, ctx := range []context.Context{context.Background(), parent} {
			_, s := tr.Start(ctx, tc.name)
			if got := s.IsRecording(); got != tc.keep {
				t.Errorf("%q (parent %v): recording %v, want %v", tc.name, ctx != context.Background(), got, tc.keep)
			}
			s.End()
		}
	}
}

// TestTraceParentRoundTrip: a traceparent remembered from a span puts
// later work (other processes, much later) in the same trace, as a child
// of that span, with the job's attributes on the context.
func TestTraceParentRoundTrip(t *testing.T) {
	tp, rec := recorder(t)
	tr := tp.Tracer("test")
	ctx, submit := tr.Start(context.Background(), "submit")
	remembered := TraceParent(ctx)
	submit.End()
	if remembered == "" {
		t.Fatal("no traceparent from a recording span")
	}
	if TraceParent(context.Background()) != "" {
		t.Error("a context without a span has a traceparent")
	}
	later := JobContext(context.Background(), remembered, JobAttrs("acme", "j1")...)
	_, plan := tr.Start(later, "plan", trace.WithAttributes(Attrs(later)...))
	plan.End()
	spans := rec.Ended()
	if len(spans) != 2 {
		t.Fatalf("%d spans, want 2", len(spans))
	}
	got := spans[1]
	if got.SpanContext().TraceID() != submit.SpanContext().TraceID() || got.Parent().SpanID() != submit.SpanContext().SpanID() {
		t.Errorf("plan span %v parent %v, want a child of %v", got.SpanContext(), got.Parent(), submit.SpanContext())
	}
	want := map[attribute.Key]string{AttrTenant: "acme", AttrJobID: "j1"}
	for _, kv := range got.Attributes() {
		if w, ok := want[kv.Key]; ok && kv.Value.AsString() == w {
			delete(want, kv.Key)
		}
	}
	if len(want) > 0 {
		t.Errorf("plan span lacks %v", want)
	}
	for _, bad := range []string{"", "garbage", "00-00000000000000000000000000000000-0000000000000000-01"} {
		if ctx := WithTraceParent(context.Background(), bad); trace.SpanContextFromContext(ctx).IsValid() {
			t.Errorf("WithTraceParent(%q) made a valid span context", bad)
		}
		if LinkTo(bad, "x") != nil {
			t.Errorf("LinkTo(%q) made a link", bad)
		}
	}
}

// TestHTTPServerSpan: a request carrying a traceparent gets a server span
// in the caller's trace, named by its route, and the handler's publishes
// (here: the context it sees) continue that span.
func TestHTTPServerSpan(t *testing.T) {
	tp, rec := recorder(t)
	mux := http.NewServeMux()
	var inHandler trace.SpanContext
	mux.HandleFunc("POST /v1/tenants/{tenant}/jobs", func(w http.ResponseWriter, r *http.Request) {
		inHandler = trace.SpanContextFromContext(r.Context())
		w.WriteHeader(http.StatusAccepted)
	})
	// A middleware that hands the mux a copy of the request, as the
	// gateway's do.
	copying := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mux.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), attrsKey{}, nil)))
	})
	srv := httptest.NewServer(HTTPServer(tp.Tracer("http"), copying, mux))
	defer srv.Close()

	const caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/tenants/acme/jobs", nil)
	req.Header.Set("traceparent", caller)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	spans := rec.Ended()
	if len(spans) != 1 {
		t.Fatalf("%d spans, want 1", len(spans))
	}
	s := spans[0]
	if s.Name() != "POST /v1/tenants/{tenant}/jobs" || s.SpanKind() != trace.SpanKindServer {
		t.Errorf("span %q kind %v, want the route as a server span", s.Name(), s.SpanKind())
	}
	if s.SpanContext().TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || s.Parent().SpanID().String() != "00f067aa0ba902b7" {
		t.Errorf("span %v parent %v: not in the caller's trace", s.SpanContext(), s.Parent())
	}
	if inHandler.SpanID() != s.SpanContext().SpanID() {
		t.Errorf("handler saw span %v, want the server span %v", inHandler, s.SpanContext())
	}
	var status int64
	for _, kv := range s.Attributes() {
		if kv.Key == "http.response.status_code" {
			status = kv.Value.AsInt64()
		}
	}
	if status != http.StatusAccepted {
		t.Errorf("status attribute %d, want 202", status)
	}

	// Health probes are not traced.
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {})
	if resp, err := http.Get(srv.URL + "/healthz"); err != nil {
		t.Fatal(err)
	} else {
		_ = resp.Body.Close()
	}
	if n := len(rec.Ended()); n != 1 {
		t.Errorf("%d spans after a health probe, want still 1", n)
	}

	// InjectHTTP is what a client (gpuctl) sends.
	ctx := trace.ContextWithSpanContext(context.Background(), s.SpanContext())
	out, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL, nil)
	InjectHTTP(out)
	if got := ParseTraceParent(out.Header.Get("traceparent")); got.TraceID() != s.SpanContext().TraceID() {
		t.Errorf("InjectHTTP wrote %q", out.Header.Get("traceparent"))
	}
}

// TestStartJobSpan: work done for a job because of something else (a
// plan's delivery) is a child of the job's trace and links to its cause;
// with no job trace known it is a plain child of its cause.
func TestStartJobSpan(t *testing.T) {
	tp, rec := recorder(t)
	tr := tp.Tracer("test")
	jctx, job := tr.Start(context.Background(), "submit")
	remembered := TraceParent(jctx)
	job.End()
	cctx, cause := tr.Start(context.Background(), "process plan")
	_, s := StartJobSpan(cctx, tr, "ledger committed", remembered, JobAttrs("acme", "j1")...)
	s.End()
	_, orphan := StartJobSpan(cctx, tr, "ledger released", "", JobAttrs("acme", "j2")...)
	orphan.End()
	cause.End()
	byName := map[string]sdktrace.ReadOnlySpan{}
	for _, sp := range rec.Ended() {
		byName[sp.Name()] = sp
	}
	got := byName["ledger committed"]
	if got.Parent().SpanID() != job.SpanContext().SpanID() || got.SpanContext().TraceID() != job.SpanContext().TraceID() {
		t.Errorf("ledger span parent %v, want the job's span %v", got.Parent(), job.SpanContext())
	}
	if l := got.Links(); len(l) != 1 || l[0].SpanContext.SpanID() != cause.SpanContext().SpanID() {
		t.Errorf("ledger span links %v, want one to its cause %v", l, cause.SpanContext())
	}
	if o := byName["ledger released"]; o.Parent().SpanID() != cause.SpanContext().SpanID() || len(o.Links()) != 0 {
		t.Errorf("span without a job trace: parent %v links %v, want a plain child of its cause", o.Parent(), o.Links())
	}
}
