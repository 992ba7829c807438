package gateway

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// need is who may use a route in the role matrix, written out here apart
// from accessRules so that the test checks the table, not itself.
type need struct {
	role   string // "public", "self", a role, or "any-viewer" (viewer on any tenant)
	tenant string
}

// matrixRoute is one request of the matrix: a concrete path of pattern.
type matrixRoute struct {
	method, pattern, path, body string
	need                        need
}

var matrix = []matrixRoute{
	{"GET", "/healthz", "/healthz", "", need{"public", ""}},
	{"GET", "/v1/openapi.json", "/v1/openapi.json", "", need{"public", ""}},
	{"GET", "/{$}", "/", "", need{"public", ""}},
	{"GET", "/v1/auth/config", "/v1/auth/config", "", need{"public", ""}},
	{"POST", "/v1/login", "/v1/login", `{}`, need{"public", ""}},
	{"GET", "/v1/whoami", "/v1/whoami", "", need{"self", ""}},
	{"GET", "/v1/tokens", "/v1/tokens", "", need{"self", ""}},
	{"POST", "/v1/tokens", "/v1/tokens", `{}`, need{"self", ""}},
	{"DELETE", "/v1/tokens/{id}", "/v1/tokens/nosuch", "", need{"self", ""}},
	{"GET", "/v1/roles", "/v1/roles", "", need{"self", ""}},
	{"POST", "/v1/roles", "/v1/roles", `{}`, need{"self", ""}},
	{"DELETE", "/v1/roles", "/v1/roles", "", need{"self", ""}},
	{"GET", "/v1/audit", "/v1/audit", "", need{"any-tenant-admin", ""}},
	{"GET", "/v1/audit/verify", "/v1/audit/verify", "", need{RolePlatformAdmin, ""}},

	{"POST", "/v1/tenants/{tenant}/jobs", "/v1/tenants/acme/jobs", `{}`, need{RoleMember, "acme"}},
	{"GET", "/v1/tenants/{tenant}/jobs", "/v1/tenants/acme/jobs", "", need{RoleViewer, "acme"}},
	{"GET", "/v1/tenants/{tenant}/jobs/{id}", "/v1/tenants/acme/jobs/j1", "", need{RoleViewer, "acme"}},
	{"DELETE", "/v1/tenants/{tenant}/jobs/{id}", "/v1/tenants/acme/jobs/j1", "", need{RoleMember, "acme"}},
	{"GET", "/v1/tenants/{tenant}/jobs/{id}/events", "/v1/tenants/acme/jobs/j1/events", "", need{RoleViewer, "acme"}},
	{"GET", "/v1/tenants/{tenant}/events", "/v1/tenants/acme/events", "", need{RoleViewer, "acme"}},
	{"GET", "/v1/tenants/{tenant}/usage", "/v1/tenants/acme/usage", "", need{RoleViewer, "acme"}},
	{"GET", "/v1/tenants/{tenant}/usage/series", "/v1/tenants/acme/usage/series", "", need{RoleViewer, "acme"}},
	{"GET", "/v1/tenants/{tenant}/jobs/{id}/logs", "/v1/tenants/acme/jobs/j1/logs", "", need{RoleMember, "acme"}},
	{"POST", "/v1/tenants/{tenant}/jobs/{id}/checkpoint", "/v1/tenants/acme/jobs/j1/checkpoint", "", need{RoleMember, "acme"}},
	{"GET", "/v1/tenants/{tenant}/jobs/{id}/describe", "/v1/tenants/acme/jobs/j1/describe", "", need{RoleViewer, "acme"}},
	{"GET", "/v1/tenants/{tenant}/budget", "/v1/tenants/acme/budget", "", need{RoleViewer, "acme"}},
	{"PUT", "/v1/tenants/{tenant}/budget", "/v1/tenants/acme/budget", `{}`, need{RoleTenantAdmin, "acme"}},
	{"DELETE", "/v1/tenants/{tenant}/budget", "/v1/tenants/acme/budget?revision=999", "", need{RoleTenantAdmin, "acme"}},
	{"GET", "/v1/tenants/{tenant}/invoice", "/v1/tenants/acme/invoice", "", need{RoleViewer, "acme"}},
	{"GET", "/v1/quotas", "/v1/quotas", "", need{RolePlatformAdmin, ""}},
	{"GET", "/v1/quotas/{tenant}", "/v1/quotas/acme", "", need{RoleViewer, "acme"}},
	{"PUT", "/v1/quotas/{tenant}", "/v1/quotas/acme", `{"pools":"x"}`, need{RoleTenantAdmin, "acme"}},
	{"DELETE", "/v1/quotas/{tenant}", "/v1/quotas/acme?revision=999", "", need{RolePlatformAdmin, ""}},
	{"GET", "/v1/nodes", "/v1/nodes", "", need{"any-viewer", ""}},
	{"GET", "/v1/nodes/{node}", "/v1/nodes/n1", "", need{"any-viewer", ""}},
	{"GET", "/v1/nodes/{node}/telemetry", "/v1/nodes/n1/telemetry", "", need{"any-viewer", ""}},
	{"POST", "/v1/nodes/{node}/faults", "/v1/nodes/n1/faults", `{}`, need{RolePlatformAdmin, ""}},
	{"POST", "/v1/nodes/{node}/cordon", "/v1/nodes/n1/cordon", `{"x":1}`, need{RolePlatformAdmin, ""}},
	{"POST", "/v1/nodes/{node}/drain", "/v1/nodes/n1/drain", `{"x":1}`, need{RolePlatformAdmin, ""}},
	{"POST", "/v1/nodes/{node}/uncordon", "/v1/nodes/n1/uncordon?revision=999", "", need{RolePlatformAdmin, ""}},
	{"POST", "/v1/nodes/{node}/gpus/{uuid}/cordon", "/v1/nodes/n1/gpus/GPU-1/cordon", `{"x":1}`, need{RolePlatformAdmin, ""}},
	{"POST", "/v1/nodes/{node}/gpus/{uuid}/drain", "/v1/nodes/n1/gpus/GPU-1/drain", `{"x":1}`, need{RolePlatformAdmin, ""}},
	{"POST", "/v1/nodes/{node}/gpus/{uuid}/uncordon", "/v1/nodes/n1/gpus/GPU-1/uncordon?revision=999", "", need{RolePlatformAdmin, ""}},
	{"GET", "/v1/pools", "/v1/pools", "", need{"any-viewer", ""}},
	{"GET", "/v1/pools/{pool}", "/v1/pools/h100", "", need{"any-viewer", ""}},
	{"PUT", "/v1/pools/{pool}", "/v1/pools/h100", `{}`, need{RolePlatformAdmin, ""}},
	{"DELETE", "/v1/pools/{pool}", "/v1/pools/h100?revision=999", "", need{RolePlatformAdmin, ""}},
	{"GET", "/v1/pricebook", "/v1/pricebook", "", need{"any-viewer", ""}},
	{"PUT", "/v1/pricebook", "/v1/pricebook", `{}`, need{RolePlatformAdmin, ""}},
	{"GET", "/v1/fleet/events", "/v1/fleet/events", "", need{"any-viewer", ""}},
	{"GET", "/v1/queues", "/v1/queues", "", need{"any-viewer", ""}},
	{"GET", "/v1/queues/events", "/v1/queues/events", "", need{"any-viewer", ""}},
	{"GET", "/v1/ops/events", "/v1/ops/events", "", need{RolePlatformAdmin, ""}},
	{"GET", "/v1/tenants", "/v1/tenants", "", need{"self", ""}},
}

// caller is one column of the matrix.
type caller struct {
	name     string
	bindings []contracts.Binding // nil with noToken: no credentials at all
	noToken  bool
}

var callers = []caller{
	{name: "platform-admin", bindings: []contracts.Binding{{Role: RolePlatformAdmin}}},
	{name: "tenant-admin", bindings: []contracts.Binding{{Role: RoleTenantAdmin, Tenant: "acme"}}},
	{name: "member", bindings: []contracts.Binding{{Role: RoleMember, Tenant: "acme"}}},
	{name: "viewer", bindings: []contracts.Binding{{Role: RoleViewer, Tenant: "acme"}}},
	{name: "other-tenant-member", bindings: []contracts.Binding{{Role: RoleMember, Tenant: "globex"}, {Role: RoleTenantAdmin, Tenant: "initech"}}},
	{name: "no-roles"},
	{name: "no-token", noToken: true},
}

// allowed says whether c may use a route that needs n.
func (c caller) allowed(n need) bool {
	if n.role == "public" {
		return true
	}
	if c.noToken {
		return false
	}
	if n.role == "self" {
		return true
	}
	rank := map[string]int{RoleViewer: 1, RoleMember: 2, RoleTenantAdmin: 3}
	for _, b := range c.bindings {
		switch {
		case b.Role == RolePlatformAdmin:
			return true
		case n.role == "any-viewer":
			return true
		case n.role == "any-tenant-admin" && b.Role == RoleTenantAdmin:
			return true
		case n.role != RolePlatformAdmin && b.Tenant == n.tenant && rank[b.Role] >= rank[n.role]:
			return true
		}
	}
	return false
}

// TestRoleMatrix runs every route with every role, another tenant's
// member, a token without roles and no token, against the real gateway.
func TestRoleMatrix(t *testing.T) {
	h := startGateway(t, nil, nil)
	tokens := map[string]string{}
	for _, c := range callers {
		if !c.noToken {
			tokens[c.name] = h.issue("matrix-"+c.name, c.bindings...)
		}
	}
	denied := 0
	for _, rt := range matrix {
		for _, c := range callers {
			t.Run(rt.method+" "+rt.path+" as "+c.name, func(t *testing.T) {
				status, reason := h.probe(rt.method, rt.path, rt.body, tokens[c.name])
				switch {
				case c.allowed(rt.need) && (status == 401 || (status == 403 && reason == contracts.ReasonForbidden)):
					t.Fatalf("refused %d %s, want allowed (needs %+v)", status, reason, rt.need)
				case !c.allowed(rt.need) && c.noToken && (status != 401 || reason != contracts.ReasonUnauthenticated):
					t.Fatalf("%d %s, want 401 unauthenticated", status, reason)
				case !c.allowed(rt.need) && !c.noToken && (status != 403 || reason != contracts.ReasonForbidden):
					t.Fatalf("%d %s, want 403 forbidden (needs %+v)", status, reason, rt.need)
				}
				if !c.allowed(rt.need) {
					denied++
				}
			})
		}
	}
	if denied == 0 {
		t.Fatal("no case was denied: the matrix tests nothing")
	}
	t.Logf("%d routes x %d callers, %d denied", len(matrix), len(callers), denied)
}

// probe sends one request and returns its status and error reason,
// without reading a streaming body to its end.
func (h *harness) probe(method, path, body, token string) (int, contracts.Reason) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, h.url+path, rd)
	if err != nil {
		h.t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Authorization", "-")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	res, err := h.hc.Do(req)
	if err != nil {
		h.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer res.Body.Close()
	if res.StatusCode/100 == 2 {
		return res.StatusCode, ""
	}
	var ae contracts.APIError
	_ = json.NewDecoder(io.LimitReader(res.Body, 1<<20)).Decode(&ae)
	return res.StatusCode, ae.Error.Reason
}

// TestEveryRouteHasARule checks that the handler registers exactly the
// routes of accessRules and of the matrix: a route added without a rule
// (it would be platform-admin only) or without a matrix row fails here.
func TestEveryRouteHasARule(t *testing.T) {
	s := &server{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	s.handler()
	var inMatrix []string
	for _, rt := range matrix {
		inMatrix = append(inMatrix, rt.method+" "+rt.pattern)
	}
	for _, r := range s.routes {
		if _, ok := accessRules[r]; !ok {
			t.Errorf("route %s has no access rule", r)
		}
		if !slices.Contains(inMatrix, r) {
			t.Errorf("route %s has no row in the role matrix", r)
		}
	}
	for r := range accessRules {
		if !slices.Contains(inMatrix, r) {
			t.Errorf("rule %s has no row in the role matrix", r)
		}
	}
}

func TestRoleBindingsChangeLive(t *testing.T) {
	h := startGateway(t, nil, nil)
	acmeAdmin := h.issue("acme-admin", contracts.Binding{Role: RoleTenantAdmin, Tenant: "acme"})
	bob := h.issue("bob")
	list := func() int { s, _ := h.as(bob, http.MethodGet, "/v1/tenants/acme/jobs", "", nil); return s }
	if s := list(); s != 403 {
		t.Fatalf("bob without roles lists acme's jobs: %d, want 403", s)
	}
	// A tenant admin makes bob a member of its tenant, not of another,
	// and cannot make anyone platform admin.
	bind := `{"subject":"token:bob","role":"member","tenant":"acme"}`
	if s, ae := h.as(acmeAdmin, http.MethodPost, "/v1/roles", bind, nil); s != 200 {
		t.Fatalf("bind: %d %+v", s, ae)
	}
	if s, ae := h.as(acmeAdmin, http.MethodPost, "/v1/roles", bind, nil); s != 200 {
		t.Fatalf("bind again (idempotent): %d %+v", s, ae)
	}
	for _, body := range []string{`{"subject":"token:bob","role":"member","tenant":"globex"}`, `{"subject":"token:bob","role":"platform-admin"}`} {
		if s, ae := h.as(acmeAdmin, http.MethodPost, "/v1/roles", body, nil); s != 403 || ae.Reason != contracts.ReasonForbidden {
			t.Fatalf("%s: %d %+v, want 403", body, s, ae)
		}
	}
	h.eventually("bob's new role applies", func() bool { return list() == 200 })
	var who contracts.WhoAmI
	h.as(bob, http.MethodGet, "/v1/whoami", "", &who)
	if len(who.Bindings) != 1 || who.Bindings[0] != (contracts.Binding{Role: RoleMember, Tenant: "acme"}) {
		t.Fatalf("whoami %+v", who)
	}
	var roles contracts.BindingList
	h.as(acmeAdmin, http.MethodGet, "/v1/roles?tenant=acme", "", &roles)
	if !slices.ContainsFunc(roles.Subjects, func(rb contracts.RoleBindings) bool { return rb.Subject == "token:bob" }) {
		t.Fatalf("acme's bindings %+v lack bob", roles)
	}
	if s, ae := h.as(acmeAdmin, http.MethodDelete, "/v1/roles?subject=token:bob&role=member&tenant=acme", "", nil); s != 200 {
		t.Fatalf("unbind: %d %+v", s, ae)
	}
	h.eventually("bob's role is gone", func() bool { return list() == 403 })
}

func TestTenantAdminQuotaWithinGrant(t *testing.T) {
	h := startGateway(t, nil, nil)
	acmeAdmin := h.issue("acme-admin", contracts.Binding{Role: RoleTenantAdmin, Tenant: "acme"})
	quota := func(g, m float64) string {
		b, _ := json.Marshal(map[string]any{"weight": 1, "pools": map[string]any{"h100": map[string]any{"guarantee": g, "max": m}}})
		return string(b)
	}
	if s, ae := h.as(acmeAdmin, http.MethodPut, "/v1/quotas/acme", quota(4, 8), nil); s != 403 || ae.Reason != contracts.ReasonAboveGrant {
		t.Fatalf("before any grant: %d %+v, want 403 above_platform_grant", s, ae)
	}
	if s, ae := h.as(h.token, http.MethodPut, "/v1/quotas/acme", quota(8, 16), nil); s != 200 {
		t.Fatalf("platform grant: %d %+v", s, ae)
	}
	tests := map[string]struct {
		body   string
		status int
	}{
		"within":          {quota(4, 8), 200},
		"back to grant":   {quota(8, 16), 200},
		"guarantee above": {quota(9, 16), 403},
		"max above":       {quota(8, 17), 403},
		"pool dropped":    {`{"pools":{"l4":{"guarantee":1,"max":1}}}`, 403},
		"weight above":    {`{"weight":3,"pools":{"h100":{"guarantee":1,"max":1}}}`, 403},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			s, ae := h.as(acmeAdmin, http.MethodPut, "/v1/quotas/acme", tt.body, nil)
			if s != tt.status || (s == 403 && ae.Reason != contracts.ReasonAboveGrant) {
				t.Fatalf("%d %+v, want %d", s, ae, tt.status)
			}
		})
	}
	if s, ae := h.as(acmeAdmin, http.MethodPut, "/v1/quotas/globex", quota(1, 1), nil); s != 403 || ae.Reason != contracts.ReasonForbidden {
		t.Fatalf("another tenant's quota: %d %+v, want 403 forbidden", s, ae)
	}
}
