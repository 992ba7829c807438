package gateway

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// Roles. Every route has an access rule (accessRules): the least role it
// needs and where that role must be held. A platform-admin binding holds
// every role everywhere; a tenant binding holds its role and every lesser
// one on its tenant only. A user may hold bindings on several tenants.
//
//	platform-admin  price book, pools, node holds, faults, every tenant
//	tenant-admin    its tenant's quota (within the platform's grant), budget, members
//	member          submit, cancel, logs, checkpoint of its tenant's jobs
//	viewer          read only
//
// Anything refused is 403 forbidden (or above_platform_grant), recorded in
// the audit trail with the action of the rule.

// scope is where a rule's role must be held.
type scope int

const (
	scopePublic   scope = iota // no credentials at all
	scopeSelf                  // any authenticated caller; the handler narrows
	scopeTenant                // the role on the path's {tenant}
	scopeAny                   // the role on any tenant
	scopePlatform              // platform-admin only
)

// access is one route's rule.
type access struct {
	action string // the audit verb of a denial
	scope  scope
	role   string // least role, for scopeTenant and scopeAny
}

var (
	public   = access{scope: scopePublic}
	self     = func(action string) access { return access{action: action, scope: scopeSelf} }
	platform = func(action string) access {
		return access{action: action, scope: scopePlatform, role: RolePlatformAdmin}
	}
	onTenant     = func(action, role string) access { return access{action: action, scope: scopeTenant, role: role} }
	onAnyTenant  = func(action, role string) access { return access{action: action, scope: scopeAny, role: role} }
	denyUnlisted = platform("unlisted")
)

// accessRules is the table of every route ("METHOD pattern", as
// registered in handler) to its rule. TestEveryRouteHasARule keeps it
// complete; a route missing here is platform-admin only.
var accessRules = map[string]access{
	"GET /healthz":           public,
	"GET /v1/openapi.json":   public,
	"GET /{$}":               public,
	"GET /v1/auth/config":    public,
	"POST /v1/login":         public,
	"GET /v1/whoami":         self("whoami"),
	"GET /v1/tokens":         self("token.list"),
	"POST /v1/tokens":        self("token.create"),
	"DELETE /v1/tokens/{id}": self("token.revoke"),
	"GET /v1/roles":          self("role.list"),
	"POST /v1/roles":         self("role.bind"),
	"DELETE /v1/roles":       self("role.unbind"),
	"GET /v1/audit":          onAnyTenant("audit.read", RoleTenantAdmin),
	"GET /v1/audit/verify":   platform("audit.verify"),

	"POST /v1/tenants/{tenant}/jobs":                 onTenant("job.submit", RoleMember),
	"GET /v1/tenants/{tenant}/jobs":                  onTenant("job.list", RoleViewer),
	"GET /v1/tenants/{tenant}/jobs/{id}":             onTenant("job.get", RoleViewer),
	"DELETE /v1/tenants/{tenant}/jobs/{id}":          onTenant("job.cancel", RoleMember),
	"GET /v1/tenants/{tenant}/jobs/{id}/events":      onTenant("job.events", RoleViewer),
	"GET /v1/tenants/{tenant}/events":                onTenant("tenant.events", RoleViewer),
	"GET /v1/tenants/{tenant}/usage":                 onTenant("usage.get", RoleViewer),
	"GET /v1/tenants/{tenant}/usage/series":          onTenant("usage.series", RoleViewer),
	"GET /v1/tenants/{tenant}/jobs/{id}/logs":        onTenant("job.logs", RoleMember),
	"POST /v1/tenants/{tenant}/jobs/{id}/checkpoint": onTenant("job.checkpoint", RoleMember),
	"GET /v1/tenants/{tenant}/jobs/{id}/describe":    onTenant("job.describe", RoleViewer),
	"GET /v1/tenants/{tenant}/budget":                onTenant("budget.get", RoleViewer),
	"PUT /v1/tenants/{tenant}/budget":                onTenant("budget.put", RoleTenantAdmin),
	"DELETE /v1/tenants/{tenant}/budget":             onTenant("budget.delete", RoleTenantAdmin),
	"GET /v1/tenants/{tenant}/invoice":               onTenant("invoice.get", RoleViewer),
	"GET /v1/quotas":                                 platform("quota.list"),
	"GET /v1/quotas/{tenant}":                        onTenant("quota.get", RoleViewer),
	"PUT /v1/quotas/{tenant}":                        onTenant("quota.put", RoleTenantAdmin),
	"DELETE /v1/quotas/{tenant}":                     platform("quota.delete"),
	"GET /v1/nodes":                                  onAnyTenant("node.list", RoleViewer),
	"GET /v1/nodes/{node}":                           onAnyTenant("node.get", RoleViewer),
	"GET /v1/nodes/{node}/telemetry":                 onAnyTenant("node.telemetry", RoleViewer),
	"POST /v1/nodes/{node}/faults":                   platform("node.fault"),
	"POST /v1/nodes/{node}/cordon":                   platform("node.cordon"),
	"POST /v1/nodes/{node}/drain":                    platform("node.drain"),
	"POST /v1/nodes/{node}/uncordon":                 platform("node.uncordon"),
	"POST /v1/nodes/{node}/gpus/{uuid}/cordon":       platform("gpu.cordon"),
	"POST /v1/nodes/{node}/gpus/{uuid}/drain":        platform("gpu.drain"),
	"POST /v1/nodes/{node}/gpus/{uuid}/uncordon":     platform("gpu.uncordon"),
	"GET /v1/pools":                                  onAnyTenant("pool.list", RoleViewer),
	"GET /v1/pools/{pool}":                           onAnyTenant("pool.get", RoleViewer),
	"PUT /v1/pools/{pool}":                           platform("pool.put"),
	"DELETE /v1/pools/{pool}":                        platform("pool.delete"),
	"GET /v1/pricebook":                              onAnyTenant("pricebook.get", RoleViewer),
	"PUT /v1/pricebook":                              platform("pricebook.put"),
	// The console's views (issue 15): the fleet shows other tenants'
	// work as hidden to a tenant's caller (fleet_events.go), the queues
	// only the caller's tenants (queues.go); operations are the
	// platform's.
	"GET /v1/fleet/events":  onAnyTenant("fleet.events", RoleViewer),
	"GET /v1/queues":        onAnyTenant("queue.list", RoleViewer),
	"GET /v1/queues/events": onAnyTenant("queue.events", RoleViewer),
	"GET /v1/ops/events":    platform("ops.events"),
	"GET /v1/tenants":       self("tenant.list"),
}

// ruleFor returns the rule of a route; an unlisted route is platform-admin
// only, so a route added without a rule fails closed.
func ruleFor(method, pattern string) (access, bool) {
	a, ok := accessRules[method+" "+pattern]
	if !ok {
		return denyUnlisted, false
	}
	return a, true
}

// isPlatformAdmin reports whether p holds platform-admin.
func (p Principal) isPlatformAdmin() bool {
	return slices.ContainsFunc(p.Roles, func(b RoleBinding) bool { return b.Role == RolePlatformAdmin && b.Tenant == "" })
}

// has reports whether p holds role (or a greater one) on tenant; tenant
// "" means on any tenant.
func (p Principal) has(role, tenant string) bool {
	if p.isPlatformAdmin() {
		return true
	}
	want := contracts.RoleRank(role)
	return slices.ContainsFunc(p.Roles, func(b RoleBinding) bool {
		return b.Role != RolePlatformAdmin && contracts.RoleRank(b.Role) >= want && (tenant == "" || b.Tenant == tenant)
	})
}

// allows reports whether p may use a route under rule a for r.
func (a access) allows(p Principal, r *http.Request) bool {
	switch a.scope {
	case scopePublic, scopeSelf:
		return true
	case scopeTenant:
		return p.has(a.role, r.PathValue("tenant"))
	case scopeAny:
		return p.has(a.role, "")
	}
	return p.isPlatformAdmin()
}

// authenticateMiddleware puts the caller's Principal in the context of
// every request outside publicPaths, or answers 401.
func (s *server) authenticateMiddleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if publicPaths[r.URL.Path] || isConsolePath(r.URL.Path) {
			next.ServeHTTP(w, r)
			return
		}
		if !s.auth.ids.ready() {
			writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable,
				"the gateway is still reading its identity buckets; retry shortly", nil)
			return
		}
		p, aerr := s.auth.authenticate(r)
		if aerr != nil {
			s.unauthorized(w, r, aerr)
			return
		}
		next.ServeHTTP(w, r.WithContext(withPrincipal(r.Context(), p)))
	})
}

// unauthorized answers 401 and records the refusal.
func (s *server) unauthorized(w http.ResponseWriter, r *http.Request, aerr *authError) {
	s.recordAudit(r.Context(), auditEvent{Action: "authenticate", Object: r.Method + " " + r.URL.Path,
		Outcome: "denied", Reason: string(aerr.reason)})
	s.log.Info("request refused: not authenticated", "method", r.Method, "path", r.URL.Path, "reason", aerr.reason)
	w.Header().Set("WWW-Authenticate", fmt.Sprintf(`Bearer realm="gpuplane", error="invalid_token", error_description=%q`, string(aerr.reason)))
	writeError(w, http.StatusUnauthorized, aerr.reason, aerr.msg, nil)
}

// guard wraps a route's handler with its access rule.
func (s *server) guard(method, pattern string, h http.HandlerFunc) http.HandlerFunc {
	s.routes = append(s.routes, method+" "+pattern)
	rule, listed := ruleFor(method, pattern)
	if !listed {
		s.log.Error("route has no access rule; platform-admin only", "method", method, "pattern", pattern)
	}
	if rule.scope == scopePublic {
		return h
	}
	if pattern == "/v1/quotas/{tenant}" && method == http.MethodPut {
		h = s.withinGrant(h)
	}
	if pattern == "/v1/quotas/{tenant}" && method == http.MethodDelete {
		h = s.dropGrant(h)
	}
	return func(w http.ResponseWriter, r *http.Request) {
		p, ok := principalFrom(r.Context())
		if !ok { // the middleware let a non-public path through: a bug, fail closed
			s.unauthorized(w, r, refused(contracts.ReasonUnauthenticated, "no credentials"))
			return
		}
		if !rule.allows(p, r) {
			s.forbid(w, r, rule.action, r.PathValue("tenant"), r.PathValue("tenant"), forbiddenMsg(rule, r))
			return
		}
		if tenant := r.PathValue("tenant"); tenant != "" {
			release, ok := s.admit(w, r, tenant, streaming(pattern, r))
			if !ok {
				return
			}
			defer release()
		}
		h(w, r)
	}
}

// streaming reports whether a request holds its response open: the event
// streams, and a log read that follows the run.
func streaming(pattern string, r *http.Request) bool {
	switch pattern {
	case "/v1/tenants/{tenant}/jobs/{id}/events", "/v1/tenants/{tenant}/events":
		return true
	case "/v1/tenants/{tenant}/jobs/{id}/logs":
		return r.URL.Query().Get("follow") == "true"
	}
	return false
}

// admit applies tenant's limits to a request (429 with a reason and
// Retry-After when over them) and returns what to call when it is done.
func (s *server) admit(w http.ResponseWriter, r *http.Request, tenant string, stream bool) (release func(), ok bool) {
	if ok, wait := s.limits.allow(tenant); !ok {
		w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds(wait)))
		writeError(w, http.StatusTooManyRequests, contracts.ReasonRateLimited,
			fmt.Sprintf("tenant %s sent more than %g requests/s (burst %d); retry after %s", tenant,
				s.limits.cfg.RequestsPerSecond, s.limits.cfg.Burst, wait.Round(time.Millisecond)), nil)
		return nil, false
	}
	if !stream {
		return func() {}, true
	}
	release, ok = s.limits.openStream(tenant)
	if !ok {
		w.Header().Set("Retry-After", "5")
		writeError(w, http.StatusTooManyRequests, contracts.ReasonTooManyStreams,
			fmt.Sprintf("tenant %s has %d event or log streams open, the most it may", tenant, s.limits.cfg.StreamsPerTenant), nil)
		return nil, false
	}
	return release, true
}

func forbiddenMsg(a access, r *http.Request) string {
	switch a.scope {
	case scopeTenant:
		return fmt.Sprintf("%s needs role %s on tenant %s", a.action, a.role, r.PathValue("tenant"))
	case scopeAny:
		return fmt.Sprintf("%s needs role %s on some tenant", a.action, a.role)
	}
	return fmt.Sprintf("%s needs role %s", a.action, RolePlatformAdmin)
}

// forbid answers 403 forbidden and records the denial.
func (s *server) forbid(w http.ResponseWriter, r *http.Request, action, tenant, object, msg string) {
	s.forbidWith(w, r, contracts.ReasonForbidden, action, tenant, object, msg)
}

func (s *server) forbidWith(w http.ResponseWriter, r *http.Request, reason contracts.Reason, action, tenant, object, msg string) {
	p, _ := principalFrom(r.Context())
	s.recordAudit(r.Context(), auditEvent{Action: action, Tenant: tenant, Object: object, Outcome: "denied", Reason: string(reason)})
	s.log.Info("request refused: forbidden", "method", r.Method, "path", r.URL.Path, "subject", p.Subject, "action", action, "reason", reason)
	writeError(w, http.StatusForbidden, reason, msg, nil)
}

// recordAudit records e; a denial that cannot be recorded is still a
// denial, so a failure is only logged.
func (s *server) recordAudit(ctx context.Context, e auditEvent) {
	if s.audit == nil {
		return
	}
	if err := s.audit.record(ctx, e); err != nil {
		s.log.Warn("audit record failed", "action", e.Action, "outcome", e.Outcome, "err", err)
	}
}
