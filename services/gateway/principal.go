package gateway

import (
	"context"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// Principal is who made a request, as authentication established it. It is
// the seam between authentication and roles (auth*.go, rbac*.go) and the
// audit trail (audit*.go): authentication puts it in the request's context,
// the role checks and the audit recorder read it from there.
type Principal struct {
	// Subject is the stable identity: "oidc:<issuer>#<sub>",
	// "ldap:<dn>" or "token:<token id>". Audit records name it as the actor.
	Subject string
	// Name is what a person reads (preferred username, uid, token name).
	Name string
	// Method is how the request was authenticated: "oidc", "ldap", "token".
	Method string
	// Roles are the role bindings in force for this request, read from KV
	// when the request was authenticated.
	Roles []RoleBinding
}

// RoleBinding grants a role, on one tenant or (Tenant "") on the platform:
// the binding stored in contracts.BucketRoleBindings.
type RoleBinding = contracts.Binding

// The roles of the API, from most to least powerful (contracts.Roles).
const (
	RolePlatformAdmin = contracts.RolePlatformAdmin
	RoleTenantAdmin   = contracts.RoleTenantAdmin
	RoleMember        = contracts.RoleMember
	RoleViewer        = contracts.RoleViewer
)

type principalKey struct{}

// withPrincipal returns ctx carrying p.
func withPrincipal(ctx context.Context, p Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

// principalFrom returns the principal authentication put in ctx, and false
// for a request that was not authenticated (only /healthz).
func principalFrom(ctx context.Context) (Principal, bool) {
	p, ok := ctx.Value(principalKey{}).(Principal)
	return p, ok
}

// auditEvent is one operation or denial to record. The audit recorder adds
// what the request itself tells (source address, trace ID, time) and the
// principal from ctx.
type auditEvent struct {
	// Action is a stable verb: "job.submit", "job.cancel", "quota.put",
	// "pricebook.put", "node.cordon", "login", "role.put", ...
	Action string
	// Tenant the object belongs to, "" for platform objects.
	Tenant string
	// Object names what was acted on (a job ID, a node, a pool).
	Object string
	// Outcome is "success", "denied" or "failure".
	Outcome string
	// Reason is the stable reason code of a denial or failure.
	Reason string
	// Key makes a retried operation one record: the same Key (a job ID, an
	// idempotency key) is recorded once.
	Key string
	// At is when it happened; zero means now.
	At time.Time
}

// auditSink records audit events. The gateway's sink appends them to the
// AUDIT stream; record must not block a request for long and reports a
// failure to write (a state change that cannot be audited is refused).
type auditSink interface {
	record(ctx context.Context, e auditEvent) error
}
