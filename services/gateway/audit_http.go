package gateway

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/json"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/gpuplane/gpuplane/contracts"
)

// Exactly one record per request. auditRequests wraps the whole API (inside
// observe, outside authentication) and puts an auditRequest in the
// request's context: the source address, the trace ID, the route's action
// and object. Whoever records for the request first (authentication's 401,
// a role check's 403, a login) marks it recorded; when the request ends
// unrecorded, auditRequests records it itself if it was state-changing
// (any method but GET, HEAD and OPTIONS on a route) or a denial (401, 403).
// So each request leaves one record, and a state-changing handler needs no
// audit call of its own: only one that learns its object late (a submit
// reads its job ID from the body) names it with auditOperation.
//
// While the audit trail is known to be down (its last record failed and
// its tail still cannot be read), a state-changing request is refused with
// 503 before its handler runs. Otherwise the response is held until the
// record is written: when the trail cannot take the record, the client gets
// 503 instead of a success, and retries. A retried job operation is keyed
// by its job ID (any other by its Idempotency-Key header), so the retry
// completes the trail without a second record.

// auditRequest is what the audit trail knows of one HTTP request.
type auditRequest struct {
	source, traceID, request string
	// action, tenant and object come from the matched route.
	action, tenant, object string
	stateChanging          bool

	mu        sync.Mutex
	key       string
	status    int
	principal *Principal
	recorded  bool
}

type auditRequestKey struct{}

func withAuditRequest(ctx context.Context, st *auditRequest) context.Context {
	return context.WithValue(ctx, auditRequestKey{}, st)
}

// auditRequestFrom returns the request's audit state, nil outside a
// request (a record made by a background task).
func auditRequestFrom(ctx context.Context) *auditRequest {
	st, _ := ctx.Value(auditRequestKey{}).(*auditRequest)
	return st
}

func (st *auditRequest) markRecorded() {
	st.mu.Lock()
	st.recorded = true
	st.mu.Unlock()
}

func (st *auditRequest) wasRecorded() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.recorded
}

func (st *auditRequest) principalSeen() (Principal, bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.principal == nil {
		return Principal{}, false
	}
	return *st.principal, true
}

// auditOperation names the object of the request's operation and the key
// that makes a retry of it the same operation (a job ID), when the handler
// learns them after routing.
func auditOperation(ctx context.Context, object, key string) {
	st := auditRequestFrom(ctx)
	if st == nil {
		return
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	st.object = object
	if st.key == "" || key != "" {
		st.key = key
	}
}

// idempotencyKeyHeader lets any client make its retries one operation.
const idempotencyKeyHeader = "Idempotency-Key"

// newAuditRequest reads what the trail records of r from r and the route
// mux would give it. The route is matched here, once more than the mux
// does, because authentication runs before the mux (and refuses requests
// that then never reach it).
func newAuditRequest(r *http.Request, mux *http.ServeMux) *auditRequest {
	st := &auditRequest{source: r.RemoteAddr, request: r.Method + " " + clip(r.URL.EscapedPath(), 256),
		key: clip(r.Header.Get(idempotencyKeyHeader), 128)}
	_, pattern := mux.Handler(r)
	method, path, ok := strings.Cut(pattern, " ")
	if !ok { // a route without a method: 404 or 405, nothing changes
		return st
	}
	vals := pathValues(path, r.URL.EscapedPath())
	st.action = auditActionFor(method, path)
	st.tenant = vals["tenant"]
	st.object = routeObject(vals)
	st.stateChanging = method != http.MethodGet && method != http.MethodHead && method != http.MethodOptions
	return st
}

// pathValues matches the segments of a route pattern ("/v1/nodes/{node}")
// with those of a path the pattern matched. Our patterns have no
// multi-segment wildcards, so segments pair one to one.
func pathValues(pattern, escapedPath string) map[string]string {
	ps, rs := strings.Split(pattern, "/"), strings.Split(escapedPath, "/")
	vals := map[string]string{}
	if len(ps) != len(rs) {
		return vals
	}
	for i, p := range ps {
		if len(p) > 2 && p[0] == '{' && p[len(p)-1] == '}' {
			v, err := url.PathUnescape(rs[i])
			if err != nil {
				v = rs[i]
			}
			vals[strings.TrimSuffix(p[1:len(p)-1], "...")] = clip(v, 128)
		}
	}
	return vals
}

// auditActionFor is the action of a route: the verb of its access rule
// (rbac.go), so denials and outcomes of one route share it; for a route
// whose rule names none (a public one), its path's fixed words.
func auditActionFor(method, pattern string) string {
	if rule, ok := ruleFor(method, pattern); ok && rule.action != "" {
		return rule.action
	}
	var words []string
	for _, seg := range strings.Split(strings.TrimPrefix(pattern, "/v1/"), "/") {
		if seg != "" && !strings.HasPrefix(seg, "{") {
			words = append(words, seg)
		}
	}
	return strings.Join(words, ".")
}

// routeObject names what a route acts on, from its path values.
func routeObject(vals map[string]string) string {
	switch {
	case vals["uuid"] != "":
		return vals["node"] + "/" + vals["uuid"]
	case vals["id"] != "":
		return vals["id"]
	case vals["node"] != "":
		return vals["node"]
	case vals["pool"] != "":
		return vals["pool"]
	}
	return vals["tenant"]
}

// auditRequests is the audit middleware (see the top of this file). mux
// is the API's router, next the handler chain in front of it.
func (s *server) auditRequests(mux *http.ServeMux, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		st := newAuditRequest(r, mux)
		ctx, traceID := requestTrace(r)
		st.traceID = traceID
		ctx = withAuditRequest(ctx, st)
		r = r.WithContext(ctx)
		if !st.stateChanging {
			sw := &statusWriter{ResponseWriter: w}
			next.ServeHTTP(sw, r)
			if (sw.status == http.StatusUnauthorized || sw.status == http.StatusForbidden) && !st.wasRecorded() {
				_ = s.recordOutcome(ctx, st, sw.status, nil) // logged; the denial stands
			}
			return
		}
		if rd, ok := s.audit.(interface{ ready(context.Context) error }); ok {
			if err := rd.ready(ctx); err != nil {
				s.log.Error("state change refused: the audit trail is down", "request", st.request, "err", err)
				writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable,
					"the audit trail is unavailable, so no change is made now; retry shortly", nil)
				return
			}
		}
		held := &heldResponse{ResponseWriter: w, header: http.Header{}}
		defer func() {
			if v := recover(); v != nil {
				// observe answers 500; the attempt is still recorded.
				if !st.wasRecorded() {
					_ = s.recordOutcome(ctx, st, http.StatusInternalServerError, nil)
				}
				panic(v)
			}
		}()
		next.ServeHTTP(held, r)
		if !st.wasRecorded() {
			if err := s.recordOutcome(ctx, st, held.statusCode(), held.body.Bytes()); err != nil && held.statusCode() < 300 {
				writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable,
					"the audit trail could not record this operation, so it is not confirmed; it may have been applied: retry it (a job's submit or cancel, or a request with the same Idempotency-Key, is recorded once)", nil)
				return
			}
		}
		held.send()
	})
}

// recordOutcome records the request's own operation with the outcome its
// status and error body tell. A failure to record is logged and returned.
func (s *server) recordOutcome(ctx context.Context, st *auditRequest, status int, body []byte) error {
	outcome, reason := outcomeOf(status, body)
	st.mu.Lock()
	st.status = status
	e := auditEvent{Action: st.action, Tenant: st.tenant, Object: st.object, Outcome: string(outcome), Reason: string(reason), Key: st.key}
	st.mu.Unlock()
	if s.audit == nil {
		return nil
	}
	if err := s.audit.record(ctx, e); err != nil {
		s.log.Error("audit record failed", "action", e.Action, "tenant", e.Tenant, "object", e.Object, "outcome", e.Outcome, "err", err)
		return err
	}
	return nil
}

// outcomeOf reads an answer: 2xx success, 401 and 403 denied, anything else
// a failure, with the reason of its APIError body when there is one.
func outcomeOf(status int, body []byte) (contracts.AuditOutcome, contracts.Reason) {
	var reason contracts.Reason
	if status >= 300 && len(body) > 0 {
		var e contracts.APIError
		if json.Unmarshal(body, &e) == nil {
			reason = e.Error.Reason
		}
	}
	switch {
	case status >= 200 && status < 300:
		return contracts.AuditSuccess, ""
	case status == http.StatusUnauthorized:
		return contracts.AuditDenied, cmp.Or(reason, contracts.ReasonUnauthenticated)
	case status == http.StatusForbidden:
		return contracts.AuditDenied, cmp.Or(reason, contracts.ReasonForbidden)
	case status >= 500:
		return contracts.AuditFailure, cmp.Or(reason, contracts.ReasonInternal)
	}
	return contracts.AuditFailure, cmp.Or(reason, contracts.ReasonInvalidRequest)
}

// auditPrincipal sits behind authentication and hands the principal it
// established to the request's audit state, for the record auditRequests
// makes after the handler (its own context never sees the principal).
func auditPrincipal(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if st := auditRequestFrom(r.Context()); st != nil {
			if p, ok := principalFrom(r.Context()); ok {
				st.mu.Lock()
				st.principal = &p
				st.mu.Unlock()
			}
		}
		next.ServeHTTP(w, r)
	})
}

// requestTrace returns r's context with a trace and the trace's ID: the
// span already in the context, else the caller's W3C traceparent, else a
// new trace ID. The trace travels on in the context, so the messages the
// request publishes carry the ID its audit record names.
func requestTrace(r *http.Request) (context.Context, string) {
	ctx := r.Context()
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		return ctx, sc.TraceID().String()
	}
	ctx = propagation.TraceContext{}.Extract(ctx, propagation.HeaderCarrier(r.Header))
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		return ctx, sc.TraceID().String()
	}
	var tid trace.TraceID
	var sid trace.SpanID
	_, _ = rand.Read(tid[:])
	_, _ = rand.Read(sid[:])
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true})
	return trace.ContextWithRemoteSpanContext(ctx, sc), tid.String()
}

// statusWriter remembers the status of a response it passes through.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// heldResponse keeps a state-changing handler's answer (small JSON) until
// its audit record is written. Unwrap reaches the real writer for
// deadlines (readBody sets one).
type heldResponse struct {
	http.ResponseWriter
	header http.Header
	status int
	body   bytes.Buffer
}

func (h *heldResponse) Header() http.Header { return h.header }

func (h *heldResponse) WriteHeader(code int) {
	if h.status == 0 {
		h.status = code
	}
}

func (h *heldResponse) Write(b []byte) (int, error) {
	if h.status == 0 {
		h.status = http.StatusOK
	}
	return h.body.Write(b)
}

func (h *heldResponse) Unwrap() http.ResponseWriter { return h.ResponseWriter }

func (h *heldResponse) statusCode() int {
	if h.status == 0 {
		return http.StatusOK
	}
	return h.status
}

// send writes the held answer.
func (h *heldResponse) send() {
	dst := h.ResponseWriter.Header()
	for k, v := range h.header {
		dst[k] = v
	}
	h.ResponseWriter.WriteHeader(h.statusCode())
	_, _ = h.ResponseWriter.Write(h.body.Bytes()) // the client may be gone
}

// auditReadScope is what p may read of the trail: everything (platform
// admin), or the records of the tenants it administers.
func auditReadScope(p Principal) (all bool, tenants []string) {
	for _, b := range p.Roles {
		switch {
		case b.Role == RolePlatformAdmin && b.Tenant == "":
			return true, nil
		case b.Role == RoleTenantAdmin && b.Tenant != "" && !slices.Contains(tenants, b.Tenant):
			tenants = append(tenants, b.Tenant)
		}
	}
	slices.Sort(tenants)
	return false, tenants
}
