package gateway

import (
	"maps"
	"net/http"
	"slices"

	"github.com/gpuplane/gpuplane/contracts"
)

// listTenants serves GET /v1/tenants, the console's tenant picker: the
// tenants the caller holds a role on, each with its highest role there. A
// platform admin may see every tenant; its list names those the platform
// knows of (a job event named them, or a role binding does), with All set.
func (s *server) listTenants(w http.ResponseWriter, r *http.Request) {
	p, ok := principalFrom(r.Context())
	if !ok {
		s.unauthorized(w, r, refused(contracts.ReasonUnauthenticated, "no credentials"))
		return
	}
	roles := map[string]string{}
	grant := func(tenant, role string) {
		if tenant != "" && contracts.RoleRank(role) > contracts.RoleRank(roles[tenant]) {
			roles[tenant] = role
		}
	}
	all := p.isPlatformAdmin()
	if all {
		for _, t := range s.fleet.knownTenants() {
			grant(t, RolePlatformAdmin)
		}
		for _, rb := range s.auth.ids.allBindings() {
			for _, b := range rb.Bindings {
				grant(b.Tenant, RolePlatformAdmin)
			}
		}
	} else {
		for _, b := range p.Roles {
			grant(b.Tenant, b.Role)
		}
	}
	out := contracts.TenantList{Tenants: make([]contracts.TenantAccess, 0, len(roles)), All: all}
	for _, t := range slices.Sorted(maps.Keys(roles)) {
		out.Tenants = append(out.Tenants, contracts.TenantAccess{Tenant: t, Role: roles[t]})
	}
	writeJSON(w, http.StatusOK, out)
}
