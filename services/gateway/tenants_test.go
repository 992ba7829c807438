package gateway

import (
	"net/http"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestTenantsListsWhatTheCallerMaySee: a tenant's caller gets its tenants
// with its highest role on each; a platform admin every tenant the
// platform knows of (from job events and role bindings), marked all; a
// caller without roles an empty list.
func TestTenantsListsWhatTheCallerMaySee(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.publishEvent(queued("initech", "j1", time.Now().UTC()))
	both := h.issue("both", contracts.Binding{Role: RoleViewer, Tenant: "acme"}, contracts.Binding{Role: RoleTenantAdmin, Tenant: "acme"},
		contracts.Binding{Role: RoleMember, Tenant: "globex"})
	nobody := h.issue("nobody")

	tests := map[string]struct {
		token string
		want  contracts.TenantList
	}{
		"two tenants": {both, contracts.TenantList{Tenants: []contracts.TenantAccess{
			{Tenant: "acme", Role: RoleTenantAdmin}, {Tenant: "globex", Role: RoleMember}}}},
		"no roles": {nobody, contracts.TenantList{Tenants: []contracts.TenantAccess{}}},
		"platform admin": {h.token, contracts.TenantList{All: true, Tenants: []contracts.TenantAccess{
			{Tenant: "acme", Role: RolePlatformAdmin}, {Tenant: "globex", Role: RolePlatformAdmin}, {Tenant: "initech", Role: RolePlatformAdmin}}}},
	}
	// Not subtests: the harness's waits fail the test that started it.
	for name, tt := range tests {
		var got contracts.TenantList
		h.eventually("the tenants of "+name, func() bool {
			got = contracts.TenantList{}
			s, _ := h.as(tt.token, http.MethodGet, "/v1/tenants", "", &got)
			return s == http.StatusOK && cmp.Equal(got, tt.want)
		})
	}
	if s, ae := h.as("", http.MethodGet, "/v1/tenants", "", nil); s != http.StatusUnauthorized {
		t.Fatalf("no token: %d %+v, want 401", s, ae)
	}
}
