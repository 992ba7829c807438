package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/telemetry"
)

// Paging of GET .../jobs.
const (
	defaultListLimit = 100
	maxListLimit     = 1000
)

// publishTimeout bounds how long a submit or cancel waits for the bus
// (bus.Publish retries transient failures until then).
const publishTimeout = 10 * time.Second

// server holds what the HTTP handlers share.
type server struct {
	cfg   Config
	bus   *bus.Bus
	model readModel
	// nodes is the fleet as the NODES stream tells it (nodes.go).
	nodes *nodeModel
	// buckets opens the KV buckets of the billing and scheduling
	// administration endpoints (billing.go, schedadmin.go).
	buckets *kvBuckets
	// adminReady reports whether the node model has caught up with the
	// node holds of BucketNodeAdmin.
	adminReady func() bool
	// ready reports whether the read model has caught up with its streams.
	ready func() bool
	log   *slog.Logger
	now   func() time.Time
	// streams ends when the server shuts down: event streams never finish
	// on their own, so http.Server.Shutdown alone would wait for them.
	streams context.Context
	// limits bound each tenant's request rate and open streams.
	limits *tenantLimits
	// auth authenticates requests (auth.go); the role checks are rbac.go.
	auth *authenticator
	// audit records operations and denials (principal.go).
	audit auditSink
	// routes is every "METHOD pattern" handler registered, each behind
	// its access rule (rbac.go).
	routes []string
	// fleet and ops are the console's shared views (fleet_events.go,
	// ops_events.go); opsReady reports whether ops has read OPS.
	fleet    *fleetHub
	ops      *opsHub
	opsReady func() bool
	// queues wakes the queue streams (queues_events.go).
	queues *queuesHub
	// tail serves the job event streams (sse.go, tail.go); nil serves
	// each from a consumer of its own.
	tail *eventTail
}

// handler routes the API. Every route is registered per method, and its
// path once more without a method to answer other methods with 405 and an
// APIError body (ServeMux's own 405 is plain text).
func (s *server) handler() http.Handler {
	mux := http.NewServeMux()
	route := func(path string, byMethod map[string]http.HandlerFunc) {
		for method, h := range byMethod {
			mux.HandleFunc(method+" "+path, s.guard(method, path, h))
		}
		allowed := slices.Sorted(maps.Keys(byMethod))
		if slices.Contains(allowed, http.MethodGet) {
			allowed = append(allowed, http.MethodHead)
		}
		allow := strings.Join(allowed, ", ")
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Allow", allow)
			writeError(w, http.StatusMethodNotAllowed, contracts.ReasonMethodNotAllowed,
				fmt.Sprintf("%s is not allowed on %s; allowed: %s", r.Method, r.URL.Path, allow), nil)
		})
	}
	route("/v1/tenants/{tenant}/jobs", map[string]http.HandlerFunc{
		http.MethodPost: s.submitJob,
		http.MethodGet:  s.listJobs,
	})
	route("/v1/tenants/{tenant}/jobs/{id}", map[string]http.HandlerFunc{
		http.MethodGet:    s.getJob,
		http.MethodDelete: s.cancelJob,
	})
	route("/v1/tenants/{tenant}/jobs/{id}/events", map[string]http.HandlerFunc{http.MethodGet: s.jobEvents})
	route("/v1/tenants/{tenant}/events", map[string]http.HandlerFunc{http.MethodGet: s.tenantEvents})
	route("/v1/tenants/{tenant}/usage", map[string]http.HandlerFunc{http.MethodGet: s.usage})
	route("/v1/tenants/{tenant}/usage/series", map[string]http.HandlerFunc{http.MethodGet: s.usageSeries})
	route("/v1/tenants/{tenant}/jobs/{id}/logs", map[string]http.HandlerFunc{http.MethodGet: s.jobLogs})
	route("/v1/tenants/{tenant}/jobs/{id}/checkpoint", map[string]http.HandlerFunc{http.MethodPost: s.checkpointJob})
	route("/v1/tenants/{tenant}/jobs/{id}/describe", map[string]http.HandlerFunc{http.MethodGet: s.describeJob})
	route("/v1/nodes", map[string]http.HandlerFunc{http.MethodGet: s.listNodes})
	route("/v1/nodes/{node}", map[string]http.HandlerFunc{http.MethodGet: s.getNode})
	route("/v1/nodes/{node}/telemetry", map[string]http.HandlerFunc{http.MethodGet: s.nodeTelemetry})
	route("/v1/nodes/{node}/faults", map[string]http.HandlerFunc{http.MethodPost: s.injectFault})
	route("/v1/nodes/{node}/cordon", map[string]http.HandlerFunc{http.MethodPost: s.cordonNode})
	route("/v1/nodes/{node}/drain", map[string]http.HandlerFunc{http.MethodPost: s.drainNode})
	route("/v1/nodes/{node}/uncordon", map[string]http.HandlerFunc{http.MethodPost: s.uncordonNode})
	route("/v1/nodes/{node}/gpus/{uuid}/cordon", map[string]http.HandlerFunc{http.MethodPost: s.cordonGPU})
	route("/v1/nodes/{node}/gpus/{uuid}/drain", map[string]http.HandlerFunc{http.MethodPost: s.drainGPU})
	route("/v1/nodes/{node}/gpus/{uuid}/uncordon", map[string]http.HandlerFunc{http.MethodPost: s.uncordonGPU})
	route("/v1/quotas", map[string]http.HandlerFunc{http.MethodGet: s.listQuotas})
	route("/v1/quotas/{tenant}", map[string]http.HandlerFunc{http.MethodGet: s.getQuota, http.MethodPut: s.putQuota,
		http.MethodDelete: s.deleteQuota})
	route("/v1/pools", map[string]http.HandlerFunc{http.MethodGet: s.listPools})
	route("/v1/pools/{pool}", map[string]http.HandlerFunc{http.MethodGet: s.getPool, http.MethodPut: s.putPool,
		http.MethodDelete: s.deletePool})
	route("/v1/pricebook", map[string]http.HandlerFunc{http.MethodGet: s.getPriceBook, http.MethodPut: s.putPriceBook})
	route("/v1/tenants/{tenant}/budget", map[string]http.HandlerFunc{http.MethodGet: s.getBudget, http.MethodPut: s.putBudget,
		http.MethodDelete: s.deleteBudget})
	route("/v1/tenants/{tenant}/invoice", map[string]http.HandlerFunc{http.MethodGet: s.invoice})
	route("/v1/auth/config", map[string]http.HandlerFunc{http.MethodGet: s.authConfig})
	route("/v1/login", map[string]http.HandlerFunc{http.MethodPost: s.login})
	route("/v1/whoami", map[string]http.HandlerFunc{http.MethodGet: s.whoami})
	route("/v1/tokens", map[string]http.HandlerFunc{http.MethodGet: s.listTokens, http.MethodPost: s.createToken})
	route("/v1/tokens/{id}", map[string]http.HandlerFunc{http.MethodDelete: s.revokeToken})
	route("/v1/roles", map[string]http.HandlerFunc{http.MethodGet: s.listRoles, http.MethodPost: s.bindRole,
		http.MethodDelete: s.unbindRole})
	route("/v1/audit", map[string]http.HandlerFunc{http.MethodGet: s.listAudit})
	route("/v1/audit/verify", map[string]http.HandlerFunc{http.MethodGet: s.verifyAudit})
	route("/v1/fleet/events", map[string]http.HandlerFunc{http.MethodGet: s.fleetEvents})
	route("/v1/queues", map[string]http.HandlerFunc{http.MethodGet: s.listQueues})
	route("/v1/queues/events", map[string]http.HandlerFunc{http.MethodGet: s.queuesEvents})
	route("/v1/ops/events", map[string]http.HandlerFunc{http.MethodGet: s.opsEvents})
	route("/v1/tenants", map[string]http.HandlerFunc{http.MethodGet: s.listTenants})
	route("/healthz", map[string]http.HandlerFunc{http.MethodGet: s.healthz})
	route("/v1/openapi.json", map[string]http.HandlerFunc{http.MethodGet: s.openapiDoc})
	route("/{$}", map[string]http.HandlerFunc{http.MethodGet: s.console})
	s.consoleRoutes(mux)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, contracts.ReasonNotFound, fmt.Sprintf("no such path %s", r.URL.Path), nil)
	})
	// auditRequests is outside authentication, so a refused login or
	// token is recorded with its source and trace; auditPrincipal inside
	// it hands the principal back for the record (audit_http.go).
	// The server span is outermost, so the audit record and every message
	// a request publishes carry its trace (the caller's, from traceparent).
	return telemetry.HTTPServer(s.bus.Tracer(), s.observe(s.auditRequests(mux, s.authenticateMiddleware(auditPrincipal(mux)))), mux)
}

// observe logs each request and turns a panic into a 500 APIError, so a
// bug in one handler never takes the gateway down.
func (s *server) observe(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &recorder{ResponseWriter: w}
		start := time.Now()
		defer func() {
			if v := recover(); v != nil {
				if v == http.ErrAbortHandler {
					panic(v)
				}
				s.log.Error("handler panic", "method", r.Method, "path", r.URL.Path, "panic", v, "stack", string(debug.Stack()))
				if !rec.wrote {
					writeError(rec, http.StatusInternalServerError, contracts.ReasonInternal, "internal error; the gateway logged it", nil)
				}
			}
			level := slog.LevelDebug
			if rec.status >= 500 && rec.status != http.StatusServiceUnavailable {
				level = slog.LevelWarn
			}
			s.log.Log(r.Context(), level, "http request", "method", r.Method, "path", r.URL.Path,
				"status", rec.status, "duration", time.Since(start))
		}()
		next.ServeHTTP(rec, r)
	})
}

// recorder remembers the status of a response. Unwrap lets
// http.ResponseController reach the real writer (Flush, deadlines).
type recorder struct {
	http.ResponseWriter
	status int
	wrote  bool
}

func (r *recorder) WriteHeader(code int) {
	if !r.wrote {
		r.status, r.wrote = code, true
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *recorder) Write(b []byte) (int, error) {
	if !r.wrote {
		r.status, r.wrote = http.StatusOK, true
	}
	return r.ResponseWriter.Write(b)
}

func (r *recorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

// tenantOf is the one place the tenant of a request is decided: the path
// names it, and the route's access rule (rbac.go) has already refused a
// caller without a role on it.
func tenantOf(r *http.Request) (string, error) {
	t := r.PathValue("tenant")
	if err := contracts.ValidateTenant(t); err != nil {
		return "", err
	}
	return t, nil
}

// tenant answers 400 invalid_tenant and returns false for a bad tenant.
func tenant(w http.ResponseWriter, r *http.Request) (string, bool) {
	t, err := tenantOf(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidTenant, err.Error(),
			[]contracts.FieldError{{Field: "tenant", Reason: contracts.ReasonInvalidTenant, Message: err.Error()}})
		return "", false
	}
	return t, true
}

// jobID answers 400 invalid_id and returns false for a bad job ID in the path.
func jobID(w http.ResponseWriter, r *http.Request) (string, bool) {
	id := r.PathValue("id")
	if err := contracts.ValidateID(id); err != nil {
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidID, err.Error(),
			[]contracts.FieldError{{Field: "id", Reason: contracts.ReasonInvalidID, Message: err.Error()}})
		return "", false
	}
	return id, true
}

// tenantJob reads the tenant and job ID of a job route; it answers 400
// for the first bad one and returns false.
func tenantJob(w http.ResponseWriter, r *http.Request) (tenantID, id string, ok bool) {
	if tenantID, ok = tenant(w, r); !ok {
		return "", "", false
	}
	id, ok = jobID(w, r)
	return tenantID, id, ok
}

// knownJob reads a job route and the job's status from the read model; it
// answers 400, 503, 404 or 500 and returns false when it cannot.
func (s *server) knownJob(w http.ResponseWriter, r *http.Request) (tenantID, id string, st contracts.JobStatus, ok bool) {
	tenantID, id, ok = tenantJob(w, r)
	if !ok || !s.modelReady(w) {
		return "", "", st, false
	}
	st, err := s.model.Job(r.Context(), tenantID, id)
	if !s.jobFound(w, tenantID, id, err) {
		return "", "", st, false
	}
	return tenantID, id, st, true
}

// modelReady answers 503 and returns false while the read model is still
// catching up: until then "unknown job" could be a lie.
func (s *server) modelReady(w http.ResponseWriter) bool {
	if !s.ready() {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, "the read model is still catching up with the bus; retry shortly", nil)
		return false
	}
	return true
}

// submitJob validates a JobRequest exactly as the scheduler will
// (contracts.DecodeJobRequest) and publishes it on SubjectSubmit(tenant)
// with Nats-Msg-Id SubmitMsgID(tenant, id): a retried POST is a duplicate,
// reported as such. A request without an ID gets a generated one.
func (s *server) submitJob(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenant(w, r)
	if !ok {
		return
	}
	data, ok := readBody(w, r, s.cfg.MaxBodyBytes)
	if !ok {
		return
	}
	req, err := contracts.DecodeJobRequest(data, tenant)
	if ve, ok := errors.AsType[*contracts.ValidationError](err); ok && req.ID == "" && missingID(ve) {
		// The body lacks an ID: give it one and decode it again, as
		// strictly; the body with the ID added is what gets published.
		if withID, ok := contracts.WithJobID(data, contracts.NewJobID()); ok {
			data = withID
			req, err = contracts.DecodeJobRequest(data, tenant)
		}
	}
	if err != nil {
		writeValidationError(w, err)
		return
	}
	// A retried submit (same job ID) is one operation in the audit trail.
	auditOperation(r.Context(), req.ID, req.ID)
	telemetry.Annotate(r.Context(), telemetry.JobAttrs(tenant, req.ID)...)
	ctx, cancel := context.WithTimeout(telemetry.WithAttrs(r.Context(), telemetry.JobAttrs(tenant, req.ID)...), publishTimeout)
	defer cancel()
	ack, err := s.bus.PublishRaw(ctx, contracts.SubjectSubmit(tenant), contracts.SubmitMsgID(tenant, req.ID), data,
		bus.CEType(contracts.CEType(req)), bus.CESubject(req.ID))
	if err != nil {
		s.log.Warn("submit publish failed", "tenant", tenant, "job_id", req.ID, "err", err)
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("publishing the request: %v", err), nil)
		return
	}
	s.log.Info("job submitted", "tenant", tenant, "job_id", req.ID, "stream_seq", ack.Sequence, "duplicate", ack.Duplicate)
	writeJSON(w, http.StatusAccepted, contracts.SubmitResponse{Tenant: tenant, JobID: req.ID, Stream: ack.Stream,
		Sequence: ack.Sequence, Duplicate: ack.Duplicate})
}

func missingID(ve *contracts.ValidationError) bool {
	return slices.ContainsFunc(ve.Fields, func(f contracts.FieldError) bool {
		return f.Field == "id" && f.Reason == contracts.ReasonMissingField
	})
}

// cancelJob publishes a CancelRequest for a job the read model knows and
// that is not terminal yet. An optional ?reason= travels with it.
func (s *server) cancelJob(w http.ResponseWriter, r *http.Request) {
	tenant, id, ok := tenantJob(w, r)
	if !ok || !s.modelReady(w) {
		return
	}
	auditOperation(r.Context(), id, id) // a retried cancel is one operation
	reason := r.URL.Query().Get("reason")
	if len(reason) > contracts.MaxCancelReasonSz {
		msg := fmt.Sprintf("reason is %d bytes, limit is %d", len(reason), contracts.MaxCancelReasonSz)
		writeError(w, http.StatusBadRequest, contracts.ReasonOutOfRange, msg,
			[]contracts.FieldError{{Field: "reason", Reason: contracts.ReasonOutOfRange, Message: msg}})
		return
	}
	st, err := s.model.Job(r.Context(), tenant, id)
	if !s.jobFound(w, tenant, id, err) {
		return
	}
	if st.State.Terminal() {
		writeError(w, http.StatusConflict, contracts.ReasonAlreadyTerminal,
			fmt.Sprintf("job %s is already %s", id, st.State), nil)
		return
	}
	telemetry.Annotate(r.Context(), telemetry.JobAttrs(tenant, id)...)
	ctx, cancel := context.WithTimeout(telemetry.WithAttrs(r.Context(), telemetry.JobAttrs(tenant, id)...), publishTimeout)
	defer cancel()
	ack, err := s.bus.Publish(ctx, contracts.SubjectCancel(tenant), contracts.CancelMsgID(tenant, id),
		contracts.CancelRequest{SchemaVersion: contracts.SchemaVersion, JobID: id, Reason: reason}, bus.CESubject(id))
	if err != nil {
		s.log.Warn("cancel publish failed", "tenant", tenant, "job_id", id, "err", err)
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("publishing the cancel request: %v", err), nil)
		return
	}
	s.log.Info("cancel requested", "tenant", tenant, "job_id", id, "stream_seq", ack.Sequence, "duplicate", ack.Duplicate)
	writeJSON(w, http.StatusAccepted, contracts.SubmitResponse{Tenant: tenant, JobID: id, Stream: ack.Stream,
		Sequence: ack.Sequence, Duplicate: ack.Duplicate})
}

// jobFound answers 404 unknown_job (or 500) and returns false when err is set.
func (s *server) jobFound(w http.ResponseWriter, tenant, id string, err error) bool {
	switch {
	case err == nil:
		return true
	case errors.Is(err, errUnknownJob):
		writeError(w, http.StatusNotFound, contracts.ReasonUnknownJob,
			fmt.Sprintf("tenant %s has no job %s (a job appears once the scheduler has queued or rejected it)", tenant, id), nil)
	case errors.Is(err, errLogUnavailable):
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, err.Error()+"; retry shortly", nil)
	default:
		s.internalError(w, "read model", err)
	}
	return false
}

func (s *server) getJob(w http.ResponseWriter, r *http.Request) {
	_, _, st, ok := s.knownJob(w, r)
	if !ok {
		return
	}
	writeJSON(w, http.StatusOK, st)
}

// listJobs answers a tenant's jobs, newest first: ?state= keeps one state,
// ?limit= (1 to 1000, default 100) bounds the page, ?after=ID (the last job
// of the previous page) starts it after that job: a page shorter than its
// limit is the last.
func (s *server) listJobs(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenant(w, r)
	if !ok {
		return
	}
	q := jobQuery{Limit: defaultListLimit}
	var fields []contracts.FieldError
	if v := r.URL.Query().Get("state"); v != "" {
		q.State = contracts.JobState(v)
		if !slices.Contains(jobStates, q.State) {
			fields = append(fields, contracts.FieldError{Field: "state", Reason: contracts.ReasonInvalidValue,
				Message: fmt.Sprintf("unknown state %q; want one of %v", v, jobStates)})
		}
	}
	if v := r.URL.Query().Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxListLimit {
			fields = append(fields, contracts.FieldError{Field: "limit", Reason: contracts.ReasonInvalidValue,
				Message: fmt.Sprintf("limit %q; want 1 to %d", v, maxListLimit)})
		}
		q.Limit = n
	}
	// ?after= is the last job of the previous page (paging).
	if v := r.URL.Query().Get("after"); v != "" {
		if err := contracts.ValidateID(v); err != nil {
			fields = append(fields, contracts.FieldError{Field: "after", Reason: contracts.ReasonInvalidID, Message: err.Error()})
		}
		q.After = v
	}
	if len(fields) > 0 {
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, "invalid query parameters", fields)
		return
	}
	if !s.modelReady(w) {
		return
	}
	jobs, err := s.model.Jobs(r.Context(), tenant, q)
	if errors.Is(err, errUnknownJob) {
		msg := fmt.Sprintf("after %q: tenant %s has no such job", q.After, tenant)
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, msg,
			[]contracts.FieldError{{Field: "after", Reason: contracts.ReasonUnknownJob, Message: msg}})
		return
	}
	if errors.Is(err, errLogUnavailable) {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, err.Error()+"; retry shortly", nil)
		return
	}
	if err != nil {
		s.internalError(w, "read model", err)
		return
	}
	writeJSON(w, http.StatusOK, contracts.JobList{Jobs: jobs})
}

// jobStates are the states a list may be filtered on.
var jobStates = []contracts.JobState{contracts.StateQueued, contracts.StateScheduled, contracts.StateRunning,
	contracts.StateSucceeded, contracts.StateFailed, contracts.StateCancelled, contracts.StateRejected}

func (s *server) usage(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenant(w, r)
	if !ok || !s.modelReady(w) {
		return
	}
	sum, err := s.model.Usage(r.Context(), tenant)
	if err != nil {
		s.internalError(w, "read model", err)
		return
	}
	writeJSON(w, http.StatusOK, sum)
}

// healthz is 200 only when the bus is connected and the read models have
// caught up with JOB_EVENTS, USAGE, NODES and the node holds.
func (s *server) healthz(w http.ResponseWriter, r *http.Request) {
	var problems []string
	if !s.bus.Conn().IsConnected() {
		problems = append(problems, "not connected to NATS")
	}
	if !s.ready() {
		problems = append(problems, "read model catching up")
	}
	if s.adminReady != nil && !s.adminReady() {
		problems = append(problems, "node holds catching up")
	}
	if s.auth != nil && !s.auth.ids.ready() {
		problems = append(problems, "identities catching up")
	}
	if len(problems) > 0 {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, strings.Join(problems, "; "), nil)
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

func (s *server) internalError(w http.ResponseWriter, what string, err error) {
	s.log.Error("internal error", "what", what, "err", err)
	writeError(w, http.StatusInternalServerError, contracts.ReasonInternal, what+": "+err.Error(), nil)
}

// writeValidationError answers a job request's decode or validation
// failure (writeInvalid).
func writeValidationError(w http.ResponseWriter, err error) {
	writeInvalid(w, "invalid job request", err)
}

// writeInvalid answers a decode or validation failure of a document
// (what: "invalid budget"): 400 with the summary reason and every field
// error (413 for too_large).
func writeInvalid(w http.ResponseWriter, what string, err error) {
	ve, ok := errors.AsType[*contracts.ValidationError](err)
	if !ok {
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidRequest, what+": "+err.Error(), nil)
		return
	}
	status := http.StatusBadRequest
	if ve.Reason == contracts.ReasonTooLarge {
		status = http.StatusRequestEntityTooLarge
	}
	msgs := make([]string, 0, len(ve.Fields))
	for _, f := range ve.Fields {
		if f.Field != "" {
			msgs = append(msgs, f.Field+": "+f.Message)
		} else {
			msgs = append(msgs, f.Message)
		}
	}
	writeError(w, status, ve.Reason, what+": "+strings.Join(msgs, "; "), ve.Fields)
}

func writeError(w http.ResponseWriter, status int, reason contracts.Reason, msg string, fields []contracts.FieldError) {
	writeJSON(w, status, contracts.APIError{Error: contracts.APIErrorBody{Reason: reason, Message: msg, Fields: fields}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v) // the client may be gone; nothing to do about it
}
