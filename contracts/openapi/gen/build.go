package main

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

type obj = map[string]any

// op is one operation of the gateway: a "METHOD path" the gateway
// registers (services/gateway/server.go handler). What every operation
// of a kind answers (401 and 403 behind authentication, 429 on a tenant's
// routes, 503 for a state change the audit trail cannot record, 500) is
// added by build, so the table lists only what the handler itself says.
type op struct {
	method, path string
	id           string
	tag          string
	summary      string
	description  string
	// public operations need no credentials (the gateway's publicPaths);
	// self ones are open to any authenticated caller and never 403.
	public, self bool
	// query and header parameters; path parameters come from the path.
	params []obj
	// body is the request body's component schema; bodyOptional when
	// an empty body is read as {}.
	body         string
	bodyOptional bool
	// ok is the success status and its answer; responses the handler's
	// other answers (always the APIError body unless content is set).
	ok        int
	okBody    obj // a media type map ("application/json": {...})
	okHeaders obj
	okDesc    string
	errors    map[int]string
}

func jsonBody(component string) obj {
	return obj{"application/json": obj{"schema": obj{"$ref": componentRef(component)}}}
}

func query(name, desc string, schema obj) obj {
	return obj{"name": name, "in": "query", "description": desc, "schema": schema}
}

func str() obj { return obj{"type": "string"} }

// revision is ?revision=N of the administrators' KV documents.
var revision = query("revision", "The KV revision the document was read at: the write applies only if it is still "+
	"at that revision (0: only if there is none); otherwise 409 conflict. Without it the write is unconditional.",
	obj{"type": "integer", "minimum": 0})

// Error descriptions shared by several operations.
const (
	errBadPath   = "A path parameter is not valid (invalid_tenant, invalid_id, invalid_value), with a field error naming it."
	errBody      = "The body is not valid: every field error is listed (reasons of contracts/reasons.go)."
	errTooLarge  = "The body exceeds the gateway's limit (too_large)."
	errMedia     = "The body is declared as something other than application/json (unsupported_media_type)."
	errNotReady  = "The gateway's read model is still catching up with the bus, or the bus cannot be reached (unavailable); retry shortly."
	errNoJob     = "The tenant has no such job (unknown_job); a job appears once the scheduler has queued or rejected it."
	errNoNode    = "No agent has published an inventory of this node (unknown_node)."
	errKVWrite   = "The document is no longer at ?revision=N, or another writer got in between (conflict): read it again."
	errUnread    = "The stored document does not decode (unreadable_document); the message names the revision to replace."
	errBadQuery  = "A query parameter is not valid (invalid_value), with a field error per parameter."
	errKVUnavail = "A KV bucket or the bus cannot be reached (unavailable); retry shortly."
)

func tenantPath(p string) string { return "/v1/tenants/{tenant}" + p }

// operations is every route of the gateway. TestRoutesDocumented
// (services/gateway) fails when this and the gateway's routes differ.
func operations(s *schemaSet) []op {
	states := []any{}
	for _, st := range []contracts.JobState{contracts.StateQueued, contracts.StateScheduled, contracts.StateRunning,
		contracts.StateSucceeded, contracts.StateFailed, contracts.StateCancelled, contracts.StateRejected} {
		states = append(states, string(st))
	}
	outcomes := []any{}
	for _, o := range contracts.AuditOutcomes {
		outcomes = append(outcomes, string(o))
	}
	lastEventID := []obj{
		{"name": "Last-Event-ID", "in": "header", "description": "Resume after this event: the id (a JOB_EVENTS stream " +
			"sequence) of the last event received. EventSource sends it when it reconnects.",
			"schema": obj{"type": "string", "pattern": "^ *[0-9]+ *$"}},
		query("lastEventId", "Last-Event-ID for clients that cannot set the header; the header wins when both are given.",
			obj{"type": "string", "pattern": "^ *[0-9]+ *$"}),
	}
	sse := func(desc string) obj {
		return obj{"text/event-stream": obj{
			"schema": obj{"type": "string", "description": desc},
			// What each event of the stream is; OpenAPI 3.1 has no
			// keyword for the items of a stream (3.2's itemSchema).
			"x-sse": obj{
				"event":      "the JobEvent's type (queued, scheduled, running, succeeded, ...)",
				"id":         "the event's JOB_EVENTS stream sequence: send it back as Last-Event-ID to resume",
				"data":       "the JobEvent as one line of JSON",
				"dataSchema": componentRef("JobEvent"),
				"comments":   "': stream open' first, then ': heartbeat' every heartbeat interval while idle",
			},
		}}
	}
	tenantQuery := query("tenant", "Keep one tenant's bindings.", s.property("JobRequest", "tenant"))
	return []op{
		{method: http.MethodPost, path: tenantPath("/jobs"), id: "submitJob", tag: "jobs",
			summary: "Submit a job",
			description: "Validates the JobRequest exactly as the scheduler will and publishes it on the bus. " +
				"The job ID makes the submit idempotent: a retried POST with the same ID is reported as a duplicate " +
				"(duplicate: true), not a second job. A request without an ID gets a generated one. " +
				"202 means the request is on the bus; what became of it arrives as job events.",
			body: "JobSubmission", ok: http.StatusAccepted, okBody: jsonBody("SubmitResponse"), okDesc: "The request is on the bus.",
			errors: map[int]string{400: errBody, 413: errTooLarge, 415: errMedia, 503: "The bus did not take the request (unavailable); retry with the same job ID."}},
		{method: http.MethodGet, path: tenantPath("/jobs"), id: "listJobs", tag: "jobs",
			summary: "List a tenant's jobs, newest first",
			description: "Open jobs, and jobs that ended within the gateway's list window (-list-retention, " +
				"7 days by default). A job that ended before it is no longer listed but still answers by ID (getJob), from its events.",
			params: []obj{
				query("state", "Keep the jobs in this state.", obj{"type": "string", "enum": states}),
				query("limit", "The most jobs to answer; a page shorter than its limit is the last.",
					obj{"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}),
				query("after", "The last job ID of the previous page: this page starts after it. A cursor rather "+
					"than an offset, so jobs submitted between two pages shift nothing.", s.property("JobRequest", "id")),
			},
			ok: http.StatusOK, okBody: jsonBody("JobList"),
			errors: map[int]string{400: errBadQuery + " Or ?after= names no job of the tenant (a field error on after).", 503: errNotReady}},
		{method: http.MethodGet, path: tenantPath("/jobs/{id}"), id: "getJob", tag: "jobs",
			summary: "A job's status, folded from its events",
			ok:      http.StatusOK, okBody: jsonBody("JobStatus"),
			errors: map[int]string{400: errBadPath, 404: errNoJob, 503: errNotReady}},
		{method: http.MethodDelete, path: tenantPath("/jobs/{id}"), id: "cancelJob", tag: "jobs",
			summary:     "Cancel a job",
			description: "Publishes a cancel request for a job that is not terminal yet; idempotent per job (a retried cancel is a duplicate).",
			params: []obj{query("reason", "Why, recorded with the cancel.",
				s.property("CancelRequest", "reason"))},
			ok: http.StatusAccepted, okBody: jsonBody("SubmitResponse"), okDesc: "The cancel request is on the bus.",
			errors: map[int]string{400: errBadPath + " Or ?reason= is too long (out_of_range).", 404: errNoJob,
				409: "The job is already terminal (already_terminal).", 503: errNotReady}},
		{method: http.MethodGet, path: tenantPath("/jobs/{id}/events"), id: "watchJob", tag: "events",
			summary: "Stream a job's events (server-sent events)",
			description: "The job's history, then live events; the stream ends after the event that makes the job terminal. " +
				"With Last-Event-ID the events up to that sequence are skipped (the stream ends at once when the client " +
				"already saw the terminal event).",
			params: lastEventID, ok: http.StatusOK,
			okBody:    sse("server-sent events: one JobEvent per event, comments while idle"),
			okHeaders: obj{"Cache-Control": obj{"schema": str(), "description": "no-cache"}},
			errors: map[int]string{400: errBadPath + " Or Last-Event-ID is not a stream sequence (invalid_value).",
				503: "The events cannot be read from the bus (unavailable)."}},
		{method: http.MethodGet, path: tenantPath("/events"), id: "watchTenant", tag: "events",
			summary:     "Stream every job event of a tenant (server-sent events)",
			description: "History first, then live, without end. Last-Event-ID resumes after that stream sequence.",
			params:      lastEventID, ok: http.StatusOK,
			okBody:    sse("server-sent events: one JobEvent per event, comments while idle"),
			okHeaders: obj{"Cache-Control": obj{"schema": str(), "description": "no-cache"}},
			errors: map[int]string{400: errBadPath + " Or Last-Event-ID is not a stream sequence (invalid_value).",
				503: "The events cannot be read from the bus (unavailable)."}},
		{method: http.MethodGet, path: tenantPath("/usage"), id: "getUsage", tag: "billing",
			summary: "A tenant's metered usage",
			ok:      http.StatusOK, okBody: jsonBody("UsageSummary"),
			errors: map[int]string{400: errBadPath, 503: errNotReady}},
		{method: http.MethodGet, path: tenantPath("/usage/series"), id: "getUsageSeries", tag: "billing",
			summary: "A tenant's usage and cost over time, per pool and price class (the console's cost charts)",
			description: "The usage records of GET .../usage spread over UTC hours or days: a record that spans several steps " +
				"is shared among them in proportion to its time in each (its sums stay exact). savedMicros is what spot or " +
				"reserved capacity saved against on-demand rates.",
			params: []obj{
				query("step", "The width of a point.", obj{"type": "string", "enum": []any{"hour", "day"}, "default": "day"}),
				query("pool", "Keep one pool.", s.property("PoolConfig", "pool")),
				query("from", "Keep the steps that end after this time (RFC 3339).", obj{"type": "string", "format": "date-time"}),
				query("to", "Keep the steps that start before this time (RFC 3339).", obj{"type": "string", "format": "date-time"}),
			},
			ok: http.StatusOK, okBody: jsonBody("UsageSeries"),
			errors: map[int]string{400: errBadPath + " " + errBadQuery + " Or to is not after from, or the range has more than 8,784 steps.", 503: errNotReady}},
		{method: http.MethodGet, path: tenantPath("/jobs/{id}/logs"), id: "jobLogs", tag: "jobs",
			summary: "A job's run output (text), optionally followed",
			description: "The output of the latest attempt (?attempt=N another, ?attempt=all every one in order), of the " +
				"machine of rank ?rank=N for a job that spans several. With ?follow=true the answer goes on as output is " +
				"written and ends at the attempt's end of output. A job that has not started answers an empty body " +
				"(following, it waits). What is known only at the end travels in HTTP trailers: " +
				contracts.TrailerLogComplete + " (true when the body ends with the run's end of output), " +
				contracts.TrailerExitCode + " (the exit code, when known) and " + contracts.TrailerLogGaps +
				" (byte ranges never received, \"attempt 1: 100-200\"; absent when none).",
			params: []obj{
				query("attempt", "A number from 1, latest (the default) or all.", obj{"type": "string", "pattern": "^([1-9][0-9]*|latest|all)$"}),
				query("rank", "The machine of a multi-machine job, from 0.", obj{"type": "integer", "minimum": 0, "maximum": contracts.MaxNodesPerJob - 1}),
				query("follow", "Follow the output as it is written.", obj{"type": "boolean"}),
			},
			ok: http.StatusOK,
			okBody: obj{"text/plain": obj{"schema": obj{"type": "string"},
				"x-trailers": []any{contracts.TrailerLogComplete, contracts.TrailerExitCode, contracts.TrailerLogGaps}}},
			okHeaders: obj{
				contracts.HeaderLogAttempt: obj{"schema": obj{"type": "string", "pattern": "^([1-9][0-9]*|all)$"},
					"description": "The attempt whose output the body holds, or all."},
				"Trailer": obj{"schema": str(), "description": "The trailers that follow the body."},
			},
			errors: map[int]string{400: errBadQuery + " Or the attempt or rank is beyond the job's (out_of_range).",
				404: errNoJob, 503: errNotReady + " Or the output cannot be read from the bus."}},
		{method: http.MethodPost, path: tenantPath("/jobs/{id}/checkpoint"), id: "checkpointJob", tag: "jobs",
			summary:     "Ask the node running a job to checkpoint it",
			description: "Publishes a checkpoint_run command; the checkpoint itself is reported as a checkpointed run fact.",
			ok:          http.StatusAccepted, okBody: jsonBody("CheckpointResponse"), okDesc: "The command is on the bus.",
			errors: map[int]string{400: errBadPath, 404: errNoJob,
				409: "The job is not running (not_running), or its run cannot be checkpointed (not_checkpointable).",
				503: errNotReady + " Or the command could not be published."}},
		{method: http.MethodGet, path: tenantPath("/jobs/{id}/describe"), id: "describeJob", tag: "jobs",
			summary: "Everything known about a job: its request, placement, why it waits, its history",
			ok:      http.StatusOK, okBody: jsonBody("JobDescription"),
			errors: map[int]string{400: errBadPath, 404: errNoJob, 503: errNotReady + " Or its events cannot be read."}},
		{method: http.MethodGet, path: "/v1/nodes", id: "listNodes", tag: "nodes",
			summary: "Every node the gateway knows, ordered by ID",
			params:  []obj{query("pool", "Keep one pool's nodes.", s.property("PoolConfig", "pool"))},
			ok:      http.StatusOK, okBody: jsonBody("NodeList"),
			errors: map[int]string{400: errBadQuery, 503: errNotReady}},
		{method: http.MethodGet, path: "/v1/nodes/{node}", id: "getNode", tag: "nodes",
			summary: "One node: its inventory, lifecycle and holds",
			ok:      http.StatusOK, okBody: jsonBody("NodeStatus"),
			errors: map[int]string{400: errBadPath, 404: errNoNode, 503: errNotReady}},
		{method: http.MethodGet, path: "/v1/nodes/{node}/telemetry", id: "getNodeTelemetry", tag: "nodes",
			summary: "A machine's recent telemetry, oldest first (the console's sparklines)",
			description: "The machine's telemetry batches on the TELEMETRY stream since ?since= ago (the stream keeps what its " +
				"max age allows), thinned evenly to at most ?points=, the latest always kept.",
			params: []obj{
				query("since", "A duration back from now, up to 1h.", obj{"type": "string", "default": "10m"}),
				query("points", "The most samples to answer.", obj{"type": "integer", "minimum": 1, "maximum": 600, "default": 120}),
			},
			ok: http.StatusOK, okBody: jsonBody("NodeTelemetry"),
			errors: map[int]string{400: errBadPath + " " + errBadQuery, 404: errNoNode, 503: errNotReady + " Or the stream cannot be read."}},
		{method: http.MethodPost, path: "/v1/nodes/{node}/faults", id: "injectFault", tag: "nodes",
			summary: "Inject a fault into a simulated node (drills)",
			description: "Each accepted request is a new fault (a retried POST injects twice). Real (nvml) nodes " +
				"take no faults.",
			body: "FaultRequest", ok: http.StatusAccepted, okBody: jsonBody("FaultResponse"), okDesc: "The inject_fault command is on the bus.",
			errors: map[int]string{400: errBody, 404: errNoNode, 409: "The node runs on real GPUs (not_simulated).",
				413: errTooLarge, 415: errMedia, 503: errNotReady + " Or the command could not be published."}},
		nodeHold("/v1/nodes/{node}/cordon", "cordonNode", "Cordon a node: no new work lands on it",
			"A hold already so is left as it is (its time and reason kept) unless a new reason is given; GPU holds in the document are kept."),
		nodeHold("/v1/nodes/{node}/drain", "drainNode", "Drain a node: no new work, and its jobs are moved off",
			"Cordoning a draining node stops the drain; draining a cordoned one starts it."),
		nodeHold("/v1/nodes/{node}/uncordon", "uncordonNode", "Lift every hold of a node (its own and its GPUs')",
			"A node without a hold is answered as it is; a hold on a node no agent announces any more can still be lifted."),
		gpuHold("/v1/nodes/{node}/gpus/{uuid}/cordon", "cordonGPU", "Cordon one GPU of a node",
			"A hold the platform wrote (overheating, XID) becomes the administrator's and stays until uncordoned."),
		gpuHold("/v1/nodes/{node}/gpus/{uuid}/drain", "drainGPU", "Drain one GPU of a node", ""),
		gpuHold("/v1/nodes/{node}/gpus/{uuid}/uncordon", "uncordonGPU", "Lift one GPU's hold, whoever set it",
			"A GPU without a hold is answered as it is."),
		{method: http.MethodGet, path: "/v1/quotas", id: "listQuotas", tag: "scheduling",
			summary: "Every stored tenant quota, ordered by tenant",
			ok:      http.StatusOK, okBody: jsonBody("QuotaList"),
			errors: map[int]string{503: errKVUnavail}},
		{method: http.MethodGet, path: "/v1/quotas/{tenant}", id: "getQuota", tag: "scheduling",
			summary: "A tenant's quota (quota absent: no bound, weight 1)",
			ok:      http.StatusOK, okBody: jsonBody("QuotaDoc"),
			errors: map[int]string{400: errBadPath, 409: errUnread, 503: errKVUnavail}},
		{method: http.MethodPut, path: "/v1/quotas/{tenant}", id: "putQuota", tag: "scheduling",
			summary: "Set a tenant's quota",
			description: "A platform admin sets the grant; a tenant admin may set its tenant's quota within that grant " +
				"(403 above_platform_grant otherwise).",
			params: []obj{revision}, body: "TenantQuota", ok: http.StatusOK, okBody: jsonBody("QuotaDoc"),
			errors: map[int]string{400: errBadPath + " " + errBody, 409: errKVWrite, 413: errTooLarge, 415: errMedia, 503: errKVUnavail}},
		{method: http.MethodDelete, path: "/v1/quotas/{tenant}", id: "deleteQuota", tag: "scheduling",
			summary: "Remove a tenant's quota (and its grant)",
			params:  []obj{revision}, ok: http.StatusOK, okBody: jsonBody("QuotaDoc"),
			errors: map[int]string{400: errBadPath + " Or ?revision= is not a number.", 409: errKVWrite, 503: errKVUnavail}},
		{method: http.MethodGet, path: "/v1/pools", id: "listPools", tag: "scheduling",
			summary: "Every configured pool and every pool of a known node, ordered by name",
			ok:      http.StatusOK, okBody: jsonBody("PoolList"),
			errors: map[int]string{503: errNotReady}},
		{method: http.MethodGet, path: "/v1/pools/{pool}", id: "getPool", tag: "scheduling",
			summary: "A pool's settings (config absent: the scheduler's defaults) and its node count",
			ok:      http.StatusOK, okBody: jsonBody("PoolDoc"),
			errors: map[int]string{400: errBadPath, 409: errUnread, 503: errNotReady}},
		{method: http.MethodPut, path: "/v1/pools/{pool}", id: "putPool", tag: "scheduling",
			summary: "Configure a pool (placement policy, preemption, ...)",
			params:  []obj{revision}, body: "PoolConfig", ok: http.StatusOK, okBody: jsonBody("PoolDoc"),
			errors: map[int]string{400: errBadPath + " " + errBody, 409: errKVWrite, 413: errTooLarge, 415: errMedia, 503: errKVUnavail}},
		{method: http.MethodDelete, path: "/v1/pools/{pool}", id: "deletePool", tag: "scheduling",
			summary: "Return a pool to the scheduler's defaults",
			params:  []obj{revision}, ok: http.StatusOK, okBody: jsonBody("PoolDoc"),
			errors: map[int]string{400: errBadPath + " Or ?revision= is not a number.", 409: errKVWrite, 503: errKVUnavail}},
		{method: http.MethodGet, path: "/v1/pricebook", id: "getPriceBook", tag: "billing",
			summary: "The price book and how far billing has metered",
			ok:      http.StatusOK, okBody: jsonBody("PriceBookDoc"),
			errors: map[int]string{409: errUnread, 503: errKVUnavail}},
		{method: http.MethodPut, path: "/v1/pricebook", id: "putPriceBook", tag: "billing",
			summary:     "Replace the price book",
			description: "A change may not alter prices billing has already metered (400 with the field errors).",
			params: []obj{query("revision", "The revision the book was read at: 409 conflict when it has moved since.",
				obj{"type": "integer", "minimum": 0})},
			body: "PriceBook", ok: http.StatusOK, okBody: jsonBody("PriceBookDoc"),
			errors: map[int]string{400: errBody, 409: errKVWrite + " " + errUnread, 413: errTooLarge, 415: errMedia, 503: errKVUnavail}},
		{method: http.MethodGet, path: tenantPath("/budget"), id: "getBudget", tag: "billing",
			summary: "A tenant's budget and its status",
			ok:      http.StatusOK, okBody: jsonBody("BudgetDoc"),
			errors: map[int]string{400: errBadPath, 409: errUnread, 503: errKVUnavail}},
		{method: http.MethodPut, path: tenantPath("/budget"), id: "putBudget", tag: "billing",
			summary: "Set a tenant's budget",
			body:    "Budget", ok: http.StatusOK, okBody: jsonBody("BudgetDoc"),
			errors: map[int]string{400: errBadPath + " " + errBody, 409: errUnread, 413: errTooLarge, 415: errMedia, 503: errKVUnavail}},
		{method: http.MethodDelete, path: tenantPath("/budget"), id: "deleteBudget", tag: "billing",
			summary: "Remove a tenant's budget",
			ok:      http.StatusOK, okBody: jsonBody("BudgetDoc"),
			errors: map[int]string{400: errBadPath, 503: errKVUnavail}},
		{method: http.MethodGet, path: tenantPath("/invoice"), id: "getInvoice", tag: "billing",
			summary: "A tenant's invoice for a month or a day",
			params: []obj{query("period", "A month (2026-11) or a day (2026-11-03), UTC; the current month by default.",
				obj{"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}(-[0-9]{2})?$"})},
			ok: http.StatusOK, okBody: jsonBody("Invoice"),
			errors: map[int]string{400: errBadPath + " Or the period is not valid (invalid_period).", 503: errNotReady}},
		{method: http.MethodGet, path: "/v1/auth/config", id: "authConfig", tag: "identity", public: true,
			summary: "Which login methods this gateway accepts (OIDC issuer and client, LDAP)",
			ok:      http.StatusOK, okBody: jsonBody("AuthConfig")},
		{method: http.MethodPost, path: "/v1/login", id: "login", tag: "identity", public: true,
			summary:     "Exchange an LDAP user name and password for a session token",
			description: "An unknown user and a wrong password get the same answer.",
			body:        "LoginRequest", ok: http.StatusOK, okBody: jsonBody("LoginResponse"),
			errors: map[int]string{400: "The body is not the expected JSON object (invalid_json).",
				401: "User name or password refused (login_failed).", 404: "LDAP login is not configured (method_disabled).",
				413: errTooLarge, 415: errMedia, 503: "The directory cannot be reached, or the audit trail is down (unavailable)."}},
		{method: http.MethodGet, path: "/v1/whoami", id: "whoami", tag: "identity", self: true,
			summary: "Who the caller is, and its role bindings",
			ok:      http.StatusOK, okBody: jsonBody("WhoAmI")},
		{method: http.MethodGet, path: "/v1/tokens", id: "listTokens", tag: "identity", self: true,
			summary: "The caller's API tokens and sessions (a platform admin's: every one), without hashes",
			ok:      http.StatusOK, okBody: jsonBody("TokenList")},
		{method: http.MethodPost, path: "/v1/tokens", id: "createToken", tag: "identity",
			summary:     "Issue an API token with bindings the caller may grant",
			description: "The secret is in the answer only: the gateway keeps its SHA-256.",
			body:        "TokenRequest", ok: http.StatusCreated, okBody: jsonBody("TokenCreated"),
			errors: map[int]string{400: "The body is not the expected JSON object (invalid_json), or a field is not valid (invalid_value, invalid_duration).",
				413: errTooLarge, 415: errMedia}},
		{method: http.MethodDelete, path: "/v1/tokens/{id}", id: "revokeToken", tag: "identity", self: true,
			summary: "Revoke a token (and its bindings)",
			ok:      http.StatusOK, okBody: jsonBody("APIToken"),
			errors: map[int]string{404: "The caller has no such token (someone else's is not found either) (not_found).", 503: errKVUnavail}},
		{method: http.MethodGet, path: "/v1/roles", id: "listRoles", tag: "identity", self: true,
			summary: "The role bindings the caller may see",
			params:  []obj{tenantQuery},
			ok:      http.StatusOK, okBody: jsonBody("BindingList")},
		{method: http.MethodPost, path: "/v1/roles", id: "bindRole", tag: "identity",
			summary:     "Bind a role to a subject (idempotent)",
			description: "A tenant admin binds roles on its tenants; only a platform admin binds platform-admin.",
			body:        "BindingRequest", ok: http.StatusOK, okBody: jsonBody("RoleBindings"),
			errors: map[int]string{400: "The body is not the expected JSON object (invalid_json), or the binding is not valid (invalid_value).",
				413: errTooLarge, 415: errMedia, 503: errKVUnavail}},
		{method: http.MethodDelete, path: "/v1/roles", id: "unbindRole", tag: "identity",
			summary: "Remove a role binding (idempotent)",
			params: []obj{query("subject", "The subject (oidc:..., ldap:..., token:...).", str()),
				query("role", "The role.", str()), query("tenant", "The tenant of the binding; none for platform-admin.", str())},
			ok: http.StatusOK, okBody: jsonBody("RoleBindings"),
			errors: map[int]string{400: "The binding is not valid (invalid_value).", 503: errKVUnavail}},
		{method: http.MethodGet, path: "/v1/audit", id: "listAudit", tag: "audit",
			summary: "Read the audit trail, oldest first",
			description: "A platform admin reads every record, a tenant admin the records of its tenants. Page with " +
				"?after= the last sequence of the previous page.",
			params: []obj{
				query("tenant", "Keep one tenant's records (_platform: the platform's own).", str()),
				query("actor", "Keep one actor's records (subject or name).", str()),
				query("action", "Keep one action (job.submit), or a prefix (job.*).", str()),
				query("outcome", "Keep one outcome.", obj{"type": "string", "enum": outcomes}),
				query("since", "An RFC 3339 time, or a duration back from now (1h).", str()),
				query("until", "An RFC 3339 time, or a duration back from now (1h).", str()),
				query("after", "A stream sequence: the records after it (the next page).", obj{"type": "integer", "minimum": 0}),
				query("limit", "The most records to answer.", obj{"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}),
			},
			ok: http.StatusOK, okBody: jsonBody("AuditList"),
			errors: map[int]string{400: errBadQuery, 503: errKVUnavail}},
		{method: http.MethodGet, path: "/v1/audit/verify", id: "verifyAudit", tag: "audit",
			summary: "Walk the audit trail's hash chain from the first record to the last",
			ok:      http.StatusOK, okBody: jsonBody("AuditVerification")},
		{method: http.MethodGet, path: "/v1/fleet/events", id: "watchFleet", tag: "console",
			summary: "Stream the fleet (server-sent events): a snapshot of every node, then each node that changes",
			description: "The first event (snapshot) carries every node with its GPUs: owners (tenant, job, allocation), MIG " +
				"slices and shares, health, holds (cordon, drain, spot notice and its deadline) and utilisation. Then one node " +
				"event per node that changed, with the node as it now is (or removed: its machine went away); changes are " +
				"coalesced, so a slow reader gets fewer events, never a backlog. Telemetry moves a GPU only by steps (5 points " +
				"of use, 3 °C). A platform admin sees every owner; any other caller (a role on some tenant) sees the same " +
				"machines with other tenants' work as hidden owners (redacted: true). Last-Event-ID resumes with the nodes " +
				"changed since (a few seconds of margin: a node may come twice); an id this gateway cannot answer from " +
				"(older than its start, or ahead of it) gets a new snapshot.",
			params: []obj{
				{"name": "Last-Event-ID", "in": "header", "description": "Resume after this event: the id of the last event received " +
					"(microseconds since the epoch at which the fleet was as sent).", "schema": obj{"type": "string", "pattern": "^ *[0-9]+ *$"}},
				query("lastEventId", "Last-Event-ID for clients that cannot set the header; the header wins when both are given.",
					obj{"type": "string", "pattern": "^ *[0-9]+ *$"}),
			},
			ok: http.StatusOK,
			okBody: obj{"text/event-stream": obj{
				"schema": obj{"type": "string", "description": "server-sent events: snapshot, then node events; comments while idle"},
				"x-sse": obj{
					"event":      "snapshot or node",
					"id":         "the fleet's version (microseconds): send it back as Last-Event-ID to resume",
					"data":       "a FleetEvent as one line of JSON",
					"dataSchema": componentRef("FleetEvent"),
					"comments":   "': stream open' first, then ': heartbeat' every heartbeat interval while idle",
				},
			}},
			okHeaders: obj{"Cache-Control": obj{"schema": str(), "description": "no-cache"}},
			errors: map[int]string{400: "Last-Event-ID is not a number (invalid_value).",
				429: "A caller who is not a platform admin has as many fleet streams open as a tenant may have streams (too_many_streams); Retry-After says when to retry.",
				503: errNotReady + " Or the node holds are not read yet."}},
		{method: http.MethodGet, path: "/v1/queues", id: "listQueues", tag: "console",
			summary: "Per pool and tenant: what waits and why, quota use, fair-share order",
			description: "Queued jobs with the scheduler's last pending reason (and the backfill reservation it holds for a job), " +
				"the GPUs each tenant's scheduled and running jobs hold against its quota's guarantee and max, its place in " +
				"fair-share order (weighted GPU share, lowest first) and its waiting jobs per priority class. Pool * holds the " +
				"jobs that name no pool. A caller who is not a platform admin sees only the tenants it holds a role on.",
			params: []obj{query("pool", "Keep one pool (* for the jobs that name none).", str())},
			ok:     http.StatusOK, okBody: jsonBody("QueueList"),
			errors: map[int]string{400: errBadQuery, 503: errNotReady + " Or the quotas cannot be read."}},
		{method: http.MethodGet, path: "/v1/queues/events", id: "watchQueues", tag: "console",
			summary: "Stream the queues (server-sent events): the whole QueueList, then again whenever it changed",
			description: "The first event (queues) is what GET /v1/queues answers, with the same pool filter and the same view " +
				"(a caller who is not a platform admin sees only the tenants it holds a role on). Then another queues event, " +
				"the whole list again, each time what the caller sees changed: a job event (queued, pending with a new " +
				"reason, scheduled, ...) or a quota written or deleted. Changes are debounced (at most one event per half " +
				"second) and a list that hashes as the last one sent (its time left out) is not sent. An event's id is the " +
				"list's time; Last-Event-ID is not read: a reconnect starts with the list as it is then.",
			params: []obj{query("pool", "Keep one pool (* for the jobs that name none).", str())},
			ok:     http.StatusOK,
			okBody: obj{"text/event-stream": obj{
				"schema": obj{"type": "string", "description": "server-sent events: queues events; comments while idle"},
				"x-sse": obj{
					"event":      "queues",
					"id":         "the list's time in microseconds (a reconnect gets the whole list again)",
					"data":       "a QueueList as one line of JSON",
					"dataSchema": componentRef("QueueList"),
					"comments":   "': stream open' first, then ': heartbeat' every heartbeat interval while idle",
				},
			}},
			okHeaders: obj{"Cache-Control": obj{"schema": str(), "description": "no-cache"}},
			errors: map[int]string{400: errBadQuery,
				429: "A caller who is not a platform admin has as many queue streams open as a tenant may have streams (too_many_streams); Retry-After says when to retry.",
				503: errNotReady + " Or the quotas cannot be read."}},
		{method: http.MethodGet, path: "/v1/ops/events", id: "watchOps", tag: "console",
			summary: "Stream operations (server-sent events): alerts, scale decisions, machine events, migrations, preemptions",
			description: "The latest events the gateway holds (after Last-Event-ID when given), then each new one, with links to " +
				"the jobs and nodes involved. A reader that falls too far behind gets a last event, dropped, and the stream " +
				"ends: reconnect with its id. Platform admins only.",
			params: []obj{
				{"name": "Last-Event-ID", "in": "header", "description": "Resume after this event: the id of the last event received.",
					"schema": obj{"type": "string", "pattern": "^ *[0-9]+ *$"}},
				query("lastEventId", "Last-Event-ID for clients that cannot set the header; the header wins when both are given.",
					obj{"type": "string", "pattern": "^ *[0-9]+ *$"}),
			},
			ok: http.StatusOK,
			okBody: obj{"text/event-stream": obj{
				"schema": obj{"type": "string", "description": "server-sent events: one OpsEvent per event; comments while idle"},
				"x-sse": obj{
					"event":      "alert, scale, machine, migration, preemption, or dropped (the last)",
					"id":         "the event's time in microseconds, strictly increasing: send it back as Last-Event-ID to resume",
					"data":       "an OpsEvent as one line of JSON",
					"dataSchema": componentRef("OpsEvent"),
					"comments":   "': stream open' first, then ': heartbeat' every heartbeat interval while idle",
				},
			}},
			okHeaders: obj{"Cache-Control": obj{"schema": str(), "description": "no-cache"}},
			errors:    map[int]string{400: "Last-Event-ID is not a number (invalid_value).", 503: errNotReady + " Or the OPS stream is still being read."}},
		{method: http.MethodGet, path: "/v1/tenants", id: "listTenants", tag: "console", self: true,
			summary: "The tenants the caller may see, with its role on each (the console's tenant picker)",
			description: "A platform admin may see every tenant (all: true); the list names those the platform knows of " +
				"(a job or a role binding names them).",
			ok: http.StatusOK, okBody: jsonBody("TenantList")},
		{method: http.MethodGet, path: "/healthz", id: "healthz", tag: "meta", public: true,
			summary: "200 when the bus is connected and every read model has caught up",
			ok:      http.StatusOK,
			okBody: obj{"application/json": obj{"schema": obj{"type": "object", "additionalProperties": false,
				"required": []any{"status"}, "properties": obj{"status": obj{"const": "ok"}}}}},
			errors: map[int]string{503: "Not connected to NATS, or a read model is catching up: the message lists what (unavailable)."}},
		{method: http.MethodGet, path: "/", id: "console", tag: "meta", public: true,
			summary: "The web console: one self-contained page (its API calls need a token)",
			ok:      http.StatusOK, okBody: obj{"text/html": obj{"schema": obj{"type": "string"}}}},
		{method: http.MethodGet, path: "/v1/openapi.json", id: "openapi", tag: "meta", public: true,
			summary: "This document",
			ok:      http.StatusOK, okBody: obj{"application/json": obj{"schema": obj{"type": "object", "required": []any{"openapi", "paths"}}}}},
	}
}

// nodeHold is a node's cordon, drain or uncordon.
func nodeHold(path, id, summary, desc string) op {
	return op{method: http.MethodPost, path: path, id: id, tag: "nodes", summary: summary, description: desc,
		body: "NodeAdminRequest", bodyOptional: true, ok: http.StatusOK, okBody: jsonBody("NodeStatus"),
		okDesc: "The node with its hold as it now is.",
		errors: map[int]string{400: errBadPath + " " + errBody, 404: errNoNode,
			409: "Another writer changed the node's hold meanwhile (conflict): retry.",
			413: errTooLarge, 415: errMedia, 503: errNotReady}}
}

// gpuHold is a GPU's cordon, drain or uncordon.
func gpuHold(path, id, summary, desc string) op {
	o := nodeHold(path, id, summary, desc)
	o.errors[400] = errBadPath + " Or the UUID is a MIG instance's (a hold is on a whole GPU). " + errBody
	o.errors[404] = errNoNode + " Or the node has no such GPU (unknown_device)."
	o.errors[409] = "The node's hold does not decode (replace it through the node routes first), or kept changing (conflict): retry."
	return o
}

// build assembles the document.
func build() ([]byte, error) {
	set, err := buildSchemas()
	if err != nil {
		return nil, err
	}
	if err := set.derive("JobSubmission", "JobRequest", "id",
		"A JobRequest as POST .../jobs takes it: the id may be left out, and the gateway generates one (a ULID)."); err != nil {
		return nil, err
	}
	ops := operations(set)
	paths := obj{}
	ids := map[string]bool{}
	for _, o := range ops {
		if ids[o.id] {
			return nil, fmt.Errorf("operationId %s twice", o.id)
		}
		ids[o.id] = true
		item, _ := paths[o.path].(obj)
		if item == nil {
			item = obj{}
			paths[o.path] = item
		}
		op, err := o.operation(set)
		if err != nil {
			return nil, fmt.Errorf("%s %s: %w", o.method, o.path, err)
		}
		item[strings.ToLower(o.method)] = op
	}
	doc := obj{
		"openapi":           "3.1.0",
		"jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
		"info": obj{
			"title":   "gpuplane gateway",
			"version": "v1",
			"summary": "The REST API of gpuplane, an event-driven GPU cloud control plane.",
			"description": "Every body is JSON, held to its published JSON Schema (contracts/schema) as strictly as the bus " +
				"holds it: a body declared as anything but application/json is 415, a body that is not a JSON object 400. " +
				"Every error is an APIError body with a stable reason code (contracts/reasons.go). " +
				"A 202 means a request is on the bus; what became of it arrives as job events.\n\n" +
				"Beyond each operation's own answers: a method a path does not list is 405 method_not_allowed with an " +
				"Allow header naming the methods it does (a GET route answers HEAD too); a path that is no route is " +
				"404 not_found; a path with // or /./ is redirected (301, 307) to its clean form. Outside the open " +
				"paths a request without valid credentials is 401 before any of these. A W3C traceparent header joins the caller's trace. A state-changing request (any method " +
				"but GET) may carry an Idempotency-Key header: a retry with the same key (or, for a job's submit and " +
				"cancel, the same job ID) is recorded once in the audit trail.",
			"license": obj{"name": "Apache-2.0", "identifier": "Apache-2.0"},
		},
		"servers": []any{obj{"url": "/", "description": "the gateway (make run: http://127.0.0.1:8080)"}},
		"tags": []any{
			obj{"name": "jobs", "description": "Submit, read, cancel, describe and checkpoint jobs; their output."},
			obj{"name": "events", "description": "Job events as server-sent events."},
			obj{"name": "nodes", "description": "The fleet, node and GPU holds, fault drills."},
			obj{"name": "scheduling", "description": "Tenant quotas and pool settings (KV documents the scheduler applies)."},
			obj{"name": "billing", "description": "Usage, price book, budgets, invoices."},
			obj{"name": "identity", "description": "Login, tokens, role bindings."},
			obj{"name": "audit", "description": "The audit trail."},
			obj{"name": "console", "description": "The console's live views: the fleet, queues, operations, tenants."},
			obj{"name": "meta", "description": "Health, the console, this document."},
		},
		"security": []any{obj{"bearer": []any{}}},
		"paths":    paths,
		"components": obj{
			"schemas": set.defs,
			// Answers outside every operation, which the info
			// describes; named here for clients and readers.
			"responses": obj{
				"MethodNotAllowed": obj{"description": "The path exists, the method does not (method_not_allowed).",
					"headers": obj{"Allow": obj{"required": true, "schema": str(),
						"description": "The path's methods, sorted, HEAD after them when GET is one: \"GET, POST, HEAD\"."}},
					"content": jsonBody("APIError")},
				"NotFound": obj{"description": "No route has this path (not_found).", "content": jsonBody("APIError")},
			},
			"securitySchemes": obj{"bearer": obj{"type": "http", "scheme": "bearer",
				"description": "Authorization: Bearer <token>: an API token or LDAP session the gateway issued " +
					"(gpt_<id>_<secret>; POST /v1/tokens, POST /v1/login), or an ID token (JWT) of the configured OIDC " +
					"issuer (GET /v1/auth/config). Operations with an empty security list are open to everyone."}},
		},
	}
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// operation is the OpenAPI operation object of o.
func (o op) operation(set *schemaSet) (obj, error) {
	out := obj{"operationId": o.id, "tags": []any{o.tag}, "summary": o.summary}
	if o.description != "" {
		out["description"] = o.description
	}
	var params []any
	for _, name := range pathParams(o.path) {
		p := obj{"name": name, "in": "path", "required": true}
		switch name {
		case "tenant":
			p["schema"] = set.property("JobRequest", "tenant")
			p["description"] = "The tenant."
		case "id":
			p["schema"] = set.property("JobRequest", "id")
			p["description"] = "A job's ID, or a token's ID on /v1/tokens/{id}."
		case "node":
			p["schema"] = set.property("NodeInventory", "nodeId")
			p["description"] = "A node's ID, as its agent announces it."
		case "pool":
			p["schema"] = set.property("PoolConfig", "pool")
			p["description"] = "A node pool."
		case "uuid":
			p["schema"] = obj{"type": "string"}
			p["description"] = "A GPU's UUID (GPU-...), as GET /v1/nodes/{node} lists it."
		default:
			return nil, fmt.Errorf("path parameter %s has no schema", name)
		}
		params = append(params, p)
	}
	for _, p := range o.params {
		params = append(params, p)
	}
	if o.method != http.MethodGet {
		params = append(params, obj{"name": "Idempotency-Key", "in": "header",
			"description": "A retry with the same key is recorded once in the audit trail.", "schema": str()})
	}
	if len(params) > 0 {
		out["parameters"] = params
	}
	if o.body != "" {
		if _, ok := set.defs[o.body]; !ok {
			return nil, fmt.Errorf("body schema %s is no component", o.body)
		}
		rb := obj{"required": !o.bodyOptional, "content": jsonBody(o.body)}
		if o.bodyOptional {
			rb["description"] = "Optional: an empty body is read as {}."
		}
		out["requestBody"] = rb
	}
	if o.public {
		out["security"] = []any{}
	}

	errs := maps.Clone(o.errors)
	if errs == nil {
		errs = map[int]string{}
	}
	or := func(code int, desc string) {
		if _, ok := errs[code]; !ok {
			errs[code] = desc
		}
	}
	tenantScoped := strings.Contains(o.path, "{tenant}")
	stateChanging := o.method != http.MethodGet
	if !o.public {
		or(http.StatusUnauthorized, "No credentials, or a token that is malformed, unknown, revoked or expired "+
			"(unauthenticated, invalid_token, token_expired).")
		if !o.self {
			or(http.StatusForbidden, "The caller's roles do not allow this (forbidden).")
		}
		or(http.StatusServiceUnavailable, "The gateway is still reading its identity buckets (unavailable); retry shortly.")
	}
	if tenantScoped {
		or(http.StatusBadRequest, errBadPath)
		or(http.StatusTooManyRequests, "The tenant is over its request rate (rate_limited) or holds its most streams "+
			"open (too_many_streams).")
	}
	if stateChanging {
		or(http.StatusServiceUnavailable, "The audit trail cannot record the change, so none is made or confirmed (unavailable); retry.")
	}
	or(http.StatusInternalServerError, "A bug or an unexpected failure; the gateway logged it (internal_error).")

	responses := obj{}
	okDesc := o.okDesc
	if okDesc == "" {
		okDesc = "OK"
	}
	okResp := obj{"description": okDesc, "content": o.okBody}
	if o.okHeaders != nil {
		okResp["headers"] = o.okHeaders
	}
	responses[strconv.Itoa(o.ok)] = okResp
	for _, code := range slices.Sorted(maps.Keys(errs)) {
		r := obj{"description": errs[code], "content": jsonBody("APIError")}
		switch code {
		case http.StatusUnauthorized:
			if !o.public {
				r["headers"] = obj{"WWW-Authenticate": obj{"schema": str(), "required": true, "description": `Bearer realm="gpuplane", error="invalid_token", ...`}}
			}
		case http.StatusTooManyRequests:
			r["headers"] = obj{"Retry-After": obj{"schema": obj{"type": "integer", "minimum": 0}, "required": true, "description": "Seconds to wait."}}
		}
		responses[strconv.Itoa(code)] = r
	}
	out["responses"] = responses
	return out, nil
}

// pathParams returns the {names} of a path, in order.
func pathParams(path string) []string {
	var out []string
	for seg := range strings.SplitSeq(path, "/") {
		if name, ok := strings.CutPrefix(seg, "{"); ok {
			out = append(out, strings.TrimSuffix(name, "}"))
		}
	}
	return out
}
