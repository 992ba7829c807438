package telemetry

import (
	"net/http"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// HTTPServer wraps h in a server span per request, continuing the
// caller's trace when the request carries a W3C traceparent (gpuctl sends
// one), so that what the handler publishes joins that trace. The span is
// named by the route the mux matched ("POST /v1/tenants/{tenant}/jobs"),
// not the raw path, so that span names stay few (routes, when not nil, is
// asked for the pattern: middleware between here and the mux hands the
// mux a copy of the request). A handler adds its own attributes (a job's
// ID and tenant) with trace.SpanFromContext.
func HTTPServer(tracer trace.Tracer, h http.Handler, routes *http.ServeMux) http.Handler {
	prop := propagation.TraceContext{}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/healthz" {
			// Probed every second by Tilt and Kubernetes: a trace each
			// would bury the requests that matter.
			h.ServeHTTP(w, r)
			return
		}
		ctx := prop.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
		name := r.Method
		if routes != nil {
			if _, pattern := routes.Handler(r); pattern != "" {
				name = pattern
			}
		}
		ctx, span := tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindServer),
			trace.WithAttributes(
				attribute.String("http.request.method", r.Method),
				attribute.String("url.path", r.URL.Path),
				attribute.String("user_agent.original", r.UserAgent()),
			))
		defer span.End()
		sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
		r = r.WithContext(ctx)
		h.ServeHTTP(sw, r)
		if name != r.Method {
			span.SetAttributes(attribute.String("http.route", name))
		}
		span.SetAttributes(attribute.Int("http.response.status_code", sw.status))
		if sw.status >= 500 {
			span.SetStatus(codes.Error, http.StatusText(sw.status))
		}
	})
}

// InjectHTTP writes ctx's trace context into an outgoing request's headers
// (traceparent), for clients such as gpuctl.
func InjectHTTP(r *http.Request) {
	propagation.TraceContext{}.Inject(r.Context(), propagation.HeaderCarrier(r.Header))
}

// statusWriter remembers the status a handler wrote. It passes Flush
// through: the gateway streams server-sent events.
type statusWriter struct {
	http.ResponseWriter
	status int
	wrote  bool
}

func (w *statusWriter) WriteHeader(code int) {
	if !w.wrote {
		w.status, w.wrote = code, true
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	w.wrote = true
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Unwrap lets http.ResponseController reach the real writer (deadlines,
// hijacking).
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
