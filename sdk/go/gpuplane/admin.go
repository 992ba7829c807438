package gpuplane

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// The administration calls: billing (price book, budgets, invoices),
// scheduling (quotas, pools), nodes and their holds, faults of the
// simulated fleet, identity (login, tokens, roles) and the audit trail.
// The gateway decides who may make each (403 forbidden otherwise).

// Revision is a precondition of a write: the document's revision as it
// was read (0: only if there is none). A write with one fails with 409
// conflict when someone changed the document meanwhile; a nil *uint64 is
// no precondition.
func Revision(n uint64) *uint64 { return &n }

// revisionQuery is ?revision=N when rev is set.
func revisionQuery(rev *uint64) url.Values {
	if rev == nil {
		return nil
	}
	return url.Values{"revision": {strconv.FormatUint(*rev, 10)}}
}

// put writes a document. Without a precondition a PUT replaces the
// document, so a repeat is harmless; with one, a repeat of a write that
// went through would fail with a conflict of its own making.
func (c *Client) put(ctx context.Context, p string, rev *uint64, doc, out any) error {
	body, err := jsonBody(doc)
	if err != nil {
		return err
	}
	return c.call(ctx, request{method: http.MethodPut, path: p, query: revisionQuery(rev), body: body, idempotent: rev == nil}, out)
}

func (c *Client) get(ctx context.Context, p string, q url.Values, out any) error {
	return c.call(ctx, request{method: http.MethodGet, path: p, query: q, idempotent: true}, out)
}

// PriceBook is the price book and its revision.
func (c *Client) PriceBook(ctx context.Context) (contracts.PriceBookDoc, error) {
	var doc contracts.PriceBookDoc
	err := c.get(ctx, "/v1/pricebook", nil, &doc)
	return doc, err
}

// SetPriceBook replaces the price book (platform admins); rev, when set,
// is the revision it was read at.
func (c *Client) SetPriceBook(ctx context.Context, book contracts.PriceBook, rev *uint64) (contracts.PriceBookDoc, error) {
	var doc contracts.PriceBookDoc
	err := c.put(ctx, "/v1/pricebook", rev, book, &doc)
	return doc, err
}

// Budget is the tenant's budget and billing's status of it (Budget nil:
// none).
func (c *Client) Budget(ctx context.Context, tenant string) (contracts.BudgetDoc, error) {
	var doc contracts.BudgetDoc
	err := c.get(ctx, tenantPath(tenant, "budget"), nil, &doc)
	return doc, err
}

// SetBudget sets the tenant's budget (tenant and platform admins).
func (c *Client) SetBudget(ctx context.Context, tenant string, b contracts.Budget) (contracts.BudgetDoc, error) {
	var doc contracts.BudgetDoc
	err := c.put(ctx, tenantPath(tenant, "budget"), nil, b, &doc)
	return doc, err
}

// DeleteBudget removes the tenant's budget.
func (c *Client) DeleteBudget(ctx context.Context, tenant string) (contracts.BudgetDoc, error) {
	var doc contracts.BudgetDoc
	err := c.call(ctx, request{method: http.MethodDelete, path: tenantPath(tenant, "budget"), idempotent: true}, &doc)
	return doc, err
}

// Invoice is the tenant's invoice for period: YYYY-MM or YYYY-MM-DD (UTC);
// "" is this month.
func (c *Client) Invoice(ctx context.Context, tenant, period string) (contracts.Invoice, error) {
	if period == "" {
		period = time.Now().UTC().Format("2006-01")
	}
	var inv contracts.Invoice
	err := c.get(ctx, tenantPath(tenant, "invoice"), url.Values{"period": {period}}, &inv)
	return inv, err
}

// Quotas are every tenant's quota (platform admins).
func (c *Client) Quotas(ctx context.Context) (contracts.QuotaList, error) {
	var list contracts.QuotaList
	err := c.get(ctx, "/v1/quotas", nil, &list)
	return list, err
}

// Quota is the tenant's GPU quota per pool and fair-share weight (Quota
// nil: none) with its revision.
func (c *Client) Quota(ctx context.Context, tenant string) (contracts.QuotaDoc, error) {
	var doc contracts.QuotaDoc
	err := c.get(ctx, path("v1", "quotas", tenant), nil, &doc)
	return doc, err
}

// SetQuota replaces the tenant's quota (platform admins); rev, when set,
// is the revision it was read at (Quota's), so that an edit of a read
// quota loses nobody else's.
func (c *Client) SetQuota(ctx context.Context, tenant string, q contracts.TenantQuota, rev *uint64) (contracts.QuotaDoc, error) {
	var doc contracts.QuotaDoc
	err := c.put(ctx, path("v1", "quotas", tenant), rev, q, &doc)
	return doc, err
}

// DeleteQuota removes the tenant's quota: no bound, weight 1.
func (c *Client) DeleteQuota(ctx context.Context, tenant string) (contracts.QuotaDoc, error) {
	var doc contracts.QuotaDoc
	err := c.call(ctx, request{method: http.MethodDelete, path: path("v1", "quotas", tenant), idempotent: true}, &doc)
	return doc, err
}

// Pools are the pools, their nodes and placement policies.
func (c *Client) Pools(ctx context.Context) (contracts.PoolList, error) {
	var list contracts.PoolList
	err := c.get(ctx, "/v1/pools", nil, &list)
	return list, err
}

// Pool is one pool's configuration (Config nil: the scheduler's default).
func (c *Client) Pool(ctx context.Context, pool string) (contracts.PoolDoc, error) {
	var doc contracts.PoolDoc
	err := c.get(ctx, path("v1", "pools", pool), nil, &doc)
	return doc, err
}

// SetPool sets a pool's placement policy (platform admins).
func (c *Client) SetPool(ctx context.Context, pool string, cfg contracts.PoolConfig, rev *uint64) (contracts.PoolDoc, error) {
	var doc contracts.PoolDoc
	err := c.put(ctx, path("v1", "pools", pool), rev, cfg, &doc)
	return doc, err
}

// DeletePool puts a pool back on the scheduler's default policy.
func (c *Client) DeletePool(ctx context.Context, pool string) (contracts.PoolDoc, error) {
	var doc contracts.PoolDoc
	err := c.call(ctx, request{method: http.MethodDelete, path: path("v1", "pools", pool), idempotent: true}, &doc)
	return doc, err
}

// Nodes are the fleet's nodes; pool, when set, keeps one pool's.
func (c *Client) Nodes(ctx context.Context, pool string) (contracts.NodeList, error) {
	var q url.Values
	if pool != "" {
		q = url.Values{"pool": {pool}}
	}
	var list contracts.NodeList
	err := c.get(ctx, "/v1/nodes", q, &list)
	return list, err
}

// Node is one node: its GPUs, MIG instances, health, topology and hold.
func (c *Client) Node(ctx context.Context, node string) (contracts.NodeStatus, error) {
	var st contracts.NodeStatus
	err := c.get(ctx, path("v1", "nodes", node), nil, &st)
	return st, err
}

// Hold is what a node or GPU hold does.
type Hold string

// The holds: Cordon stops new work, Drain also moves the running work
// off, Uncordon lifts either.
const (
	Cordon   Hold = "cordon"
	Drain    Hold = "drain"
	Uncordon Hold = "uncordon"
)

// HoldNode cordons, drains or uncordons a node (platform admins); reason
// is recorded with the hold. It returns the node as it now is. A hold is
// a state, not an action: setting it twice is setting it once.
func (c *Client) HoldNode(ctx context.Context, node string, hold Hold, reason string) (contracts.NodeStatus, error) {
	return c.hold(ctx, path("v1", "nodes", node, string(hold)), reason)
}

// HoldGPU cordons, drains or uncordons one GPU of a node, by UUID; the
// node's own hold is left as it is.
func (c *Client) HoldGPU(ctx context.Context, node, gpuUUID string, hold Hold, reason string) (contracts.NodeStatus, error) {
	return c.hold(ctx, path("v1", "nodes", node, "gpus", gpuUUID, string(hold)), reason)
}

func (c *Client) hold(ctx context.Context, p, reason string) (contracts.NodeStatus, error) {
	var body []byte
	if reason != "" {
		var err error
		if body, err = jsonBody(contracts.NodeAdminRequest{Reason: reason}); err != nil {
			return contracts.NodeStatus{}, err
		}
	}
	var st contracts.NodeStatus
	err := c.call(ctx, request{method: http.MethodPost, path: p, body: body, idempotent: true}, &st)
	return st, err
}

// InjectFault injects a fault into a simulated node (platform admins). It
// is not retried: two faults are not one.
func (c *Client) InjectFault(ctx context.Context, node string, f contracts.FaultRequest) (contracts.FaultResponse, error) {
	body, err := jsonBody(f)
	if err != nil {
		return contracts.FaultResponse{}, err
	}
	var res contracts.FaultResponse
	err = c.call(ctx, request{method: http.MethodPost, path: path("v1", "nodes", node, "faults"), body: body}, &res)
	return res, err
}

// Health is nil when the gateway is ready: connected to the bus, its read
// models caught up; else the 503 that says why.
func (c *Client) Health(ctx context.Context) error {
	return c.call(ctx, request{method: http.MethodGet, path: "/healthz", idempotent: true}, nil)
}

// AuthConfig is how the gateway lets people log in (open).
func (c *Client) AuthConfig(ctx context.Context) (contracts.AuthConfig, error) {
	// Asked before logging in: an old, expired token is not sent.
	anon := *c
	anon.tokens = nil
	var cfg contracts.AuthConfig
	err := anon.get(ctx, "/v1/auth/config", nil, &cfg)
	return cfg, err
}

// Login exchanges an LDAP user name and password for a session token; use
// it with WithToken. It sends no other credentials and is not retried.
func (c *Client) Login(ctx context.Context, user, password string) (contracts.LoginResponse, error) {
	body, err := jsonBody(contracts.LoginRequest{Username: user, Password: password})
	if err != nil {
		return contracts.LoginResponse{}, err
	}
	anon := *c
	anon.tokens = nil
	var res contracts.LoginResponse
	err = anon.call(ctx, request{method: http.MethodPost, path: "/v1/login", body: body}, &res)
	return res, err
}

// WhoAmI is who the gateway takes the caller for, and the caller's roles.
func (c *Client) WhoAmI(ctx context.Context) (contracts.WhoAmI, error) {
	var who contracts.WhoAmI
	err := c.get(ctx, "/v1/whoami", nil, &who)
	return who, err
}

// CreateToken creates an API token; its secret is in the answer only.
func (c *Client) CreateToken(ctx context.Context, req contracts.TokenRequest) (contracts.TokenCreated, error) {
	body, err := jsonBody(req)
	if err != nil {
		return contracts.TokenCreated{}, err
	}
	var res contracts.TokenCreated
	err = c.call(ctx, request{method: http.MethodPost, path: "/v1/tokens", body: body}, &res)
	return res, err
}

// Tokens are the API tokens the caller may see.
func (c *Client) Tokens(ctx context.Context) (contracts.TokenList, error) {
	var list contracts.TokenList
	err := c.get(ctx, "/v1/tokens", nil, &list)
	return list, err
}

// RevokeToken revokes an API token by ID.
func (c *Client) RevokeToken(ctx context.Context, id string) (contracts.APIToken, error) {
	var t contracts.APIToken
	err := c.call(ctx, request{method: http.MethodDelete, path: path("v1", "tokens", id), idempotent: true}, &t)
	return t, err
}

// BindRole gives subject a role (on b.Tenant, none for platform-admin).
func (c *Client) BindRole(ctx context.Context, subject string, b contracts.Binding) (contracts.RoleBindings, error) {
	body, err := jsonBody(contracts.BindingRequest{Subject: subject, Role: b.Role, Tenant: b.Tenant})
	if err != nil {
		return contracts.RoleBindings{}, err
	}
	var rb contracts.RoleBindings
	err = c.call(ctx, request{method: http.MethodPost, path: "/v1/roles", body: body, idempotent: true}, &rb)
	return rb, err
}

// UnbindRole takes a role from subject.
func (c *Client) UnbindRole(ctx context.Context, subject string, b contracts.Binding) (contracts.RoleBindings, error) {
	q := url.Values{"subject": {subject}, "role": {b.Role}}
	if b.Tenant != "" {
		q.Set("tenant", b.Tenant)
	}
	var rb contracts.RoleBindings
	err := c.call(ctx, request{method: http.MethodDelete, path: "/v1/roles", query: q, idempotent: true}, &rb)
	return rb, err
}

// Roles are the role bindings of tenant ("": every one the caller may
// see).
func (c *Client) Roles(ctx context.Context, tenant string) (contracts.BindingList, error) {
	var q url.Values
	if tenant != "" {
		q = url.Values{"tenant": {tenant}}
	}
	var list contracts.BindingList
	err := c.get(ctx, "/v1/roles", q, &list)
	return list, err
}

// AuditQuery selects audit records; the zero value is the first page of
// everything the caller may read.
type AuditQuery struct {
	// Tenant keeps one tenant's records (contracts' platform tenant:
	// the platform's own).
	Tenant string
	// Action is one action (job.submit) or a prefix (job.*).
	Action string
	// Actor is a subject (token:ci) or a name.
	Actor string
	// Outcome is success, denied or failure.
	Outcome string
	// Since and Until are RFC 3339 times or durations ago ("1h").
	Since, Until string
	// Limit is the page size, 1 to 1000 (0: the gateway's 100).
	Limit int
	// After is the sequence of the last record of the previous page.
	After uint64
}

// Audit is one page of the audit trail, oldest first; More says whether
// records follow (the next page is After the last Seq).
func (c *Client) Audit(ctx context.Context, q AuditQuery) (contracts.AuditList, error) {
	v := url.Values{}
	for k, s := range map[string]string{"tenant": q.Tenant, "action": q.Action, "actor": q.Actor, "outcome": q.Outcome,
		"since": q.Since, "until": q.Until} {
		if s != "" {
			v.Set(k, s)
		}
	}
	if q.Limit != 0 {
		v.Set("limit", strconv.Itoa(q.Limit))
	}
	if q.After != 0 {
		v.Set("after", strconv.FormatUint(q.After, 10))
	}
	var list contracts.AuditList
	err := c.get(ctx, "/v1/audit", v, &list)
	return list, err
}

// VerifyAudit checks the audit trail's hash chain (platform admins).
func (c *Client) VerifyAudit(ctx context.Context) (contracts.AuditVerification, error) {
	var v contracts.AuditVerification
	err := c.get(ctx, "/v1/audit/verify", nil, &v)
	return v, err
}
