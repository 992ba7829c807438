package contracts

import (
	"encoding/base64"
	"fmt"
	"regexp"
	"time"
)

// Identity: who may call the gateway and what each caller may do. The
// gateway authenticates a request (OIDC bearer token, LDAP session token or
// API token), names the caller by a subject, and reads the caller's role
// bindings from BucketRoleBindings. Both buckets are written by the
// gateway's identity endpoints only and watched by every gateway replica,
// so a binding or a revocation takes effect on the next request.
const (
	// BucketRoleBindings holds one RoleBindings document per subject;
	// the key is RoleBindingsKey(subject).
	BucketRoleBindings = "gp-role-bindings"
	// BucketAPITokens holds one APIToken per token (long-lived API tokens
	// and the short-lived session tokens of an LDAP login); the key is the
	// token ID. Only the SHA-256 of a token's secret is stored.
	BucketAPITokens = "gp-api-tokens"
	// BucketQuotaGrants holds, per tenant (the key), the TenantQuota a
	// platform admin last set: the ceiling within which the tenant's own
	// admins may edit its quota.
	BucketQuotaGrants = "gp-quota-grants"
)

// The roles of the API, from most to least powerful. A binding of
// RolePlatformAdmin has no tenant; every other binding names one.
const (
	RolePlatformAdmin = "platform-admin"
	RoleTenantAdmin   = "tenant-admin"
	RoleMember        = "member"
	RoleViewer        = "viewer"
)

// Roles lists every role, from most to least powerful.
var Roles = []string{RolePlatformAdmin, RoleTenantAdmin, RoleMember, RoleViewer}

// RoleRank orders the roles: a role includes every role of lower rank on
// the same tenant. Unknown roles rank 0 (grant nothing).
func RoleRank(role string) int {
	switch role {
	case RolePlatformAdmin:
		return 4
	case RoleTenantAdmin:
		return 3
	case RoleMember:
		return 2
	case RoleViewer:
		return 1
	}
	return 0
}

// Binding grants Role on Tenant ("" for platform-admin).
type Binding struct {
	Role   string `json:"role"`
	Tenant string `json:"tenant,omitempty"`
}

// Validate checks a binding: a known role; platform-admin without a
// tenant, every other role with a valid one.
func (b Binding) Validate() error {
	switch {
	case RoleRank(b.Role) == 0:
		return fmt.Errorf("unknown role %q; want one of %v", b.Role, Roles)
	case b.Role == RolePlatformAdmin && b.Tenant != "":
		return fmt.Errorf("role %s is platform-wide; it takes no tenant", b.Role)
	case b.Role != RolePlatformAdmin:
		if err := ValidateTenant(b.Tenant); err != nil {
			return fmt.Errorf("role %s needs a tenant: %w", b.Role, err)
		}
	}
	return nil
}

// RoleBindings is every binding of one subject, stored in
// BucketRoleBindings under RoleBindingsKey(Subject).
type RoleBindings struct {
	Subject   string    `json:"subject"`
	Bindings  []Binding `json:"bindings"`
	UpdatedAt time.Time `json:"updatedAt,omitzero"`
	// UpdatedBy is the subject that made the last change.
	UpdatedBy string `json:"updatedBy,omitempty"`
}

// RoleBindingsKey is the KV key of subject's bindings. Subjects hold
// characters a key may not ("oidc:https://idp#sub", "ldap:uid=a,dc=b"),
// so the key is the subject in unpadded URL-safe base64.
func RoleBindingsKey(subject string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(subject))
}

// SubjectOfKey reverses RoleBindingsKey.
func SubjectOfKey(key string) (string, error) {
	b, err := base64.RawURLEncoding.DecodeString(key)
	if err != nil {
		return "", fmt.Errorf("role binding key %q: %w", key, err)
	}
	return string(b), nil
}

// ValidateSubject checks a subject named in a role binding request.
func ValidateSubject(s string) error {
	if !subjectRE.MatchString(s) {
		return fmt.Errorf("invalid subject %q: want oidc:<issuer>#<sub>, ldap:<dn> or token:<id>, at most 512 bytes", s)
	}
	return nil
}

var subjectRE = regexp.MustCompile(`^(oidc|ldap|token):[^\x00-\x1f]{1,505}$`)

// Kinds of APIToken.
const (
	TokenKindAPI     = "api"     // long-lived, for automation; its own subject token:<id>
	TokenKindSession = "session" // an LDAP login's session; acts as its user
)

// APIToken is a bearer token the gateway issued, stored in BucketAPITokens
// under ID. The secret itself is shown once, at creation, and never stored.
type APIToken struct {
	ID   string `json:"id"`
	Kind string `json:"kind"`
	Name string `json:"name"`
	// Subject is who the token authenticates: token:<id> for an API
	// token, the user's ldap:<dn> for a session.
	Subject string `json:"subject"`
	// SHA256 is the hex SHA-256 of the whole secret token.
	SHA256 string `json:"sha256"`
	// Owner is the subject that created the token.
	Owner     string    `json:"owner,omitempty"`
	CreatedAt time.Time `json:"createdAt"`
	// ExpiresAt, if set, ends the token; sessions always have one.
	ExpiresAt time.Time `json:"expiresAt,omitzero"`
}

// ValidateTokenID checks a token ID: the part of a token before its secret.
func ValidateTokenID(s string) error {
	if !tokenIDRE.MatchString(s) {
		return fmt.Errorf("invalid token id %q: want 1-64 of [a-z0-9-], starting with a letter or digit", s)
	}
	return nil
}

var tokenIDRE = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,63}$`)

// The API documents of the identity endpoints.

// TokenRequest creates an API token (POST /v1/tokens) with the given
// bindings, each of which the caller must itself be able to grant.
type TokenRequest struct {
	Name     string    `json:"name"`
	Bindings []Binding `json:"bindings"`
	// TTL, if set, ends the token after this long (Go duration).
	TTL string `json:"ttl,omitempty"`
}

// TokenCreated answers POST /v1/tokens: the secret, shown this once.
type TokenCreated struct {
	Token  string   `json:"token"`
	Secret string   `json:"secret"`
	Info   APIToken `json:"info"`
}

// TokenList answers GET /v1/tokens (no secrets, no hashes).
type TokenList struct {
	Tokens []APIToken `json:"tokens"`
}

// BindingRequest adds or removes one binding (POST /v1/roles, DELETE
// /v1/roles?subject=&role=&tenant=).
type BindingRequest struct {
	Subject string `json:"subject"`
	Role    string `json:"role"`
	Tenant  string `json:"tenant,omitempty"`
}

// BindingList answers GET /v1/roles.
type BindingList struct {
	Subjects []RoleBindings `json:"subjects"`
}

// LoginRequest exchanges an LDAP user and password for a session token
// (POST /v1/login).
type LoginRequest struct {
	Username string `json:"username"`
	Password string `json:"password"`
}

// LoginResponse answers a successful login.
type LoginResponse struct {
	Token     string    `json:"token"`
	Subject   string    `json:"subject"`
	ExpiresAt time.Time `json:"expiresAt"`
}

// WhoAmI answers GET /v1/whoami.
type WhoAmI struct {
	Subject  string    `json:"subject"`
	Name     string    `json:"name"`
	Method   string    `json:"method"`
	Bindings []Binding `json:"bindings"`
}

// AuthConfig answers GET /v1/auth/config (unauthenticated): which login
// methods this gateway accepts, and what a client needs for OIDC's device
// flow.
type AuthConfig struct {
	OIDC *OIDCClientConfig `json:"oidc,omitempty"`
	LDAP bool              `json:"ldap"`
}

// OIDCClientConfig is what gpuctl needs for the device-code flow.
type OIDCClientConfig struct {
	Issuer   string   `json:"issuer"`
	ClientID string   `json:"clientId"`
	Scopes   []string `json:"scopes,omitempty"`
}
