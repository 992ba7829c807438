package gateway

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// The identity endpoints: what a client needs to log in, the LDAP login,
// whoami, API tokens and role bindings. Their documents are in
// contracts/identity.go.

// maxIdentityBody bounds a login, token or binding request.
const maxIdentityBody = 16 << 10

// authConfig answers which login methods this gateway accepts (public).
func (s *server) authConfig(w http.ResponseWriter, r *http.Request) {
	c := contracts.AuthConfig{LDAP: s.auth.ldap != nil}
	if s.auth.oidc != nil {
		c.OIDC = &contracts.OIDCClientConfig{Issuer: s.cfg.OIDCIssuer, ClientID: s.cfg.OIDCClientID,
			Scopes: []string{"openid", "profile", "email"}}
	}
	writeJSON(w, http.StatusOK, c)
}

// login exchanges an LDAP user name and password for a session token. An
// unknown user and a wrong password get the same answer.
func (s *server) login(w http.ResponseWriter, r *http.Request) {
	if s.auth.ldap == nil {
		writeError(w, http.StatusNotFound, contracts.ReasonMethodDisabled, "LDAP login is not configured on this gateway", nil)
		return
	}
	var req contracts.LoginRequest
	if !decodeIdentityBody(w, r, &req) {
		return
	}
	dn, name, err := s.auth.ldap.login(req.Username, req.Password)
	switch {
	case errors.Is(err, errLoginFailed):
		s.recordAudit(r.Context(), auditEvent{Action: "login", Object: "ldap", Outcome: "failure", Reason: string(contracts.ReasonLoginFailed)})
		s.log.Info("login refused", "method", "ldap")
		writeError(w, http.StatusUnauthorized, contracts.ReasonLoginFailed, "user name or password refused", nil)
		return
	case err != nil:
		s.log.Warn("login: directory unavailable", "err", err)
		s.recordAudit(r.Context(), auditEvent{Action: "login", Object: "ldap", Outcome: "failure", Reason: string(contracts.ReasonUnavailable)})
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, "the directory cannot be reached; retry shortly", nil)
		return
	}
	now := s.now().UTC()
	id := newTokenID()
	secret, hash := newSecret(id)
	t := contracts.APIToken{ID: id, Kind: contracts.TokenKindSession, Name: name, Subject: "ldap:" + dn, SHA256: hash,
		Owner: "ldap:" + dn, CreatedAt: now, ExpiresAt: now.Add(s.cfg.SessionTTL)}
	kv := s.kv(w, r, contracts.BucketAPITokens)
	if kv == nil {
		return
	}
	if err := putJSON(r.Context(), kv, id, t); err != nil {
		s.internalError(w, "storing the session", err)
		return
	}
	p := Principal{Subject: t.Subject, Name: name, Method: "ldap", Roles: s.auth.ids.roles(t.Subject)}
	s.recordAudit(withPrincipal(r.Context(), p), auditEvent{Action: "login", Object: "ldap", Outcome: "success", Key: "login:" + id})
	s.log.Info("login", "method", "ldap", "subject", t.Subject, "session", id)
	writeJSON(w, http.StatusOK, contracts.LoginResponse{Token: secret, Subject: t.Subject, ExpiresAt: t.ExpiresAt})
}

// whoami answers who the caller is and its bindings.
func (s *server) whoami(w http.ResponseWriter, r *http.Request) {
	p, _ := principalFrom(r.Context())
	out := contracts.WhoAmI{Subject: p.Subject, Name: p.Name, Method: p.Method, Bindings: []contracts.Binding{}}
	for _, b := range p.Roles {
		out.Bindings = append(out.Bindings, contracts.Binding{Role: b.Role, Tenant: b.Tenant})
	}
	writeJSON(w, http.StatusOK, out)
}

// canGrant reports whether p may hand out binding b: a platform admin any;
// anyone else a tenant role it holds itself (or a greater one).
func (p Principal) canGrant(b contracts.Binding) bool {
	if p.isPlatformAdmin() {
		return true
	}
	return b.Role != RolePlatformAdmin && p.has(b.Role, b.Tenant)
}

// canManage reports whether p may bind or unbind b for another subject: a
// platform admin any; a tenant admin its tenant's roles.
func (p Principal) canManage(b contracts.Binding) bool {
	if p.isPlatformAdmin() {
		return true
	}
	return b.Role != RolePlatformAdmin && p.has(RoleTenantAdmin, b.Tenant)
}

// createToken issues an API token with bindings the caller may grant.
func (s *server) createToken(w http.ResponseWriter, r *http.Request) {
	p, _ := principalFrom(r.Context())
	var req contracts.TokenRequest
	if !decodeIdentityBody(w, r, &req) {
		return
	}
	var fields []contracts.FieldError
	if req.Name == "" || len(req.Name) > 128 {
		fields = append(fields, contracts.FieldError{Field: "name", Reason: contracts.ReasonInvalidValue, Message: "want 1-128 bytes"})
	}
	if len(req.Bindings) == 0 || len(req.Bindings) > 64 {
		fields = append(fields, contracts.FieldError{Field: "bindings", Reason: contracts.ReasonInvalidValue, Message: "want 1-64 bindings"})
	}
	for i, b := range req.Bindings {
		if err := b.Validate(); err != nil {
			fields = append(fields, contracts.FieldError{Field: fmt.Sprintf("bindings[%d]", i), Reason: contracts.ReasonInvalidValue, Message: err.Error()})
		}
	}
	var ttl time.Duration
	if req.TTL != "" {
		d, err := time.ParseDuration(req.TTL)
		if err != nil || d <= 0 {
			fields = append(fields, contracts.FieldError{Field: "ttl", Reason: contracts.ReasonInvalidDuration, Message: fmt.Sprintf("ttl %q: want a positive Go duration", req.TTL)})
		}
		ttl = d
	}
	if len(fields) > 0 {
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, "invalid token request", fields)
		return
	}
	for _, b := range req.Bindings {
		if !p.canGrant(b) {
			s.forbid(w, r, "token.create", b.Tenant, "", fmt.Sprintf("you cannot grant role %s%s", b.Role, onTenantText(b.Tenant)))
			return
		}
	}
	tokens, roles := s.kv(w, r, contracts.BucketAPITokens), s.kv(w, r, contracts.BucketRoleBindings)
	if tokens == nil || roles == nil {
		return
	}
	now := s.now().UTC()
	id := newTokenID()
	secret, hash := newSecret(id)
	t := contracts.APIToken{ID: id, Kind: contracts.TokenKindAPI, Name: req.Name, Subject: "token:" + id, SHA256: hash,
		Owner: p.Subject, CreatedAt: now}
	if ttl > 0 {
		t.ExpiresAt = now.Add(ttl)
	}
	rb := contracts.RoleBindings{Subject: t.Subject, Bindings: req.Bindings, UpdatedAt: now, UpdatedBy: p.Subject}
	if err := putJSON(r.Context(), roles, contracts.RoleBindingsKey(t.Subject), rb); err != nil {
		s.internalError(w, "storing the token's bindings", err)
		return
	}
	if err := putJSON(r.Context(), tokens, id, t); err != nil {
		s.internalError(w, "storing the token", err)
		return
	}
	s.auth.ids.refresh(r.Context(), contracts.BucketRoleBindings, contracts.RoleBindingsKey(t.Subject))
	s.auth.ids.refresh(r.Context(), contracts.BucketAPITokens, id)
	s.recordAudit(r.Context(), auditEvent{Action: "token.create", Object: id, Outcome: "success", Key: "token:" + id})
	s.log.Info("API token created", "token_id", id, "owner", p.Subject, "bindings", len(req.Bindings))
	t.SHA256 = ""
	writeJSON(w, http.StatusCreated, contracts.TokenCreated{Token: id, Secret: secret, Info: t})
}

func onTenantText(tenant string) string {
	if tenant == "" {
		return ""
	}
	return " on tenant " + tenant
}

// listTokens answers the caller's tokens (a platform admin's: every one),
// without hashes.
func (s *server) listTokens(w http.ResponseWriter, r *http.Request) {
	p, _ := principalFrom(r.Context())
	out := contracts.TokenList{Tokens: []contracts.APIToken{}}
	for _, t := range s.auth.ids.allTokens() {
		if p.isPlatformAdmin() || t.Owner == p.Subject {
			t.SHA256 = ""
			out.Tokens = append(out.Tokens, t)
		}
	}
	slices.SortFunc(out.Tokens, func(a, b contracts.APIToken) int {
		return cmp.Or(a.CreatedAt.Compare(b.CreatedAt), cmp.Compare(a.ID, b.ID))
	})
	writeJSON(w, http.StatusOK, out)
}

// revokeToken deletes a token and its bindings. Someone else's token is
// "no such token", as an unknown one.
func (s *server) revokeToken(w http.ResponseWriter, r *http.Request) {
	p, _ := principalFrom(r.Context())
	id := r.PathValue("id")
	t, ok := s.auth.ids.token(id)
	if !ok || (!p.isPlatformAdmin() && t.Owner != p.Subject && t.Subject != p.Subject) {
		writeError(w, http.StatusNotFound, contracts.ReasonNotFound, fmt.Sprintf("you have no token %q", id), nil)
		return
	}
	tokens, roles := s.kv(w, r, contracts.BucketAPITokens), s.kv(w, r, contracts.BucketRoleBindings)
	if tokens == nil || roles == nil {
		return
	}
	if err := tokens.Delete(r.Context(), id); err != nil {
		s.internalError(w, "revoking the token", err)
		return
	}
	if t.Kind == contracts.TokenKindAPI {
		if err := roles.Delete(r.Context(), contracts.RoleBindingsKey(t.Subject)); err != nil {
			s.log.Warn("revoked token's bindings not removed", "token_id", id, "err", err)
		}
	}
	s.auth.ids.refresh(r.Context(), contracts.BucketAPITokens, id)
	s.auth.ids.refresh(r.Context(), contracts.BucketRoleBindings, contracts.RoleBindingsKey(t.Subject))
	s.recordAudit(r.Context(), auditEvent{Action: "token.revoke", Object: id, Outcome: "success", Key: "revoke:" + id})
	s.log.Info("API token revoked", "token_id", id, "by", p.Subject)
	t.SHA256 = ""
	writeJSON(w, http.StatusOK, t)
}

// listRoles answers the bindings the caller may see: a platform admin
// every one, a tenant admin those on its tenants, anyone its own.
// ?tenant= keeps one tenant's.
func (s *server) listRoles(w http.ResponseWriter, r *http.Request) {
	p, _ := principalFrom(r.Context())
	only := r.URL.Query().Get("tenant")
	out := contracts.BindingList{Subjects: []contracts.RoleBindings{}}
	for _, rb := range s.auth.ids.allBindings() {
		var keep []contracts.Binding
		for _, b := range rb.Bindings {
			visible := rb.Subject == p.Subject || p.canManage(b)
			if visible && (only == "" || b.Tenant == only) {
				keep = append(keep, b)
			}
		}
		if len(keep) > 0 {
			rb.Bindings = keep
			out.Subjects = append(out.Subjects, rb)
		}
	}
	slices.SortFunc(out.Subjects, func(a, b contracts.RoleBindings) int { return cmp.Compare(a.Subject, b.Subject) })
	writeJSON(w, http.StatusOK, out)
}

// bindRole adds a binding (idempotent: an existing one is answered as is).
func (s *server) bindRole(w http.ResponseWriter, r *http.Request) {
	var req contracts.BindingRequest
	if !decodeIdentityBody(w, r, &req) {
		return
	}
	s.editBinding(w, r, req, "role.bind", func(bs []contracts.Binding, b contracts.Binding) []contracts.Binding {
		if slices.Contains(bs, b) {
			return bs
		}
		return append(bs, b)
	})
}

// unbindRole removes a binding named by ?subject=&role=&tenant=.
func (s *server) unbindRole(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	req := contracts.BindingRequest{Subject: q.Get("subject"), Role: q.Get("role"), Tenant: q.Get("tenant")}
	s.editBinding(w, r, req, "role.unbind", func(bs []contracts.Binding, b contracts.Binding) []contracts.Binding {
		return slices.DeleteFunc(bs, func(x contracts.Binding) bool { return x == b })
	})
}

// editBinding changes one subject's bindings with compare-and-set, so two
// admins editing one subject never lose each other's change.
func (s *server) editBinding(w http.ResponseWriter, r *http.Request, req contracts.BindingRequest, action string,
	edit func([]contracts.Binding, contracts.Binding) []contracts.Binding) {
	p, _ := principalFrom(r.Context())
	b := contracts.Binding{Role: req.Role, Tenant: req.Tenant}
	var fields []contracts.FieldError
	if err := contracts.ValidateSubject(req.Subject); err != nil {
		fields = append(fields, contracts.FieldError{Field: "subject", Reason: contracts.ReasonInvalidValue, Message: err.Error()})
	}
	if err := b.Validate(); err != nil {
		fields = append(fields, contracts.FieldError{Field: "role", Reason: contracts.ReasonInvalidValue, Message: err.Error()})
	}
	if len(fields) > 0 {
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, "invalid role binding", fields)
		return
	}
	if !p.canManage(b) {
		s.forbid(w, r, action, b.Tenant, req.Subject, fmt.Sprintf("binding role %s%s needs %s", b.Role, onTenantText(b.Tenant), managerOf(b)))
		return
	}
	kv := s.kv(w, r, contracts.BucketRoleBindings)
	if kv == nil {
		return
	}
	key := contracts.RoleBindingsKey(req.Subject)
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	for {
		var rb contracts.RoleBindings
		rev, err := readDoc(ctx, kv, key, &rb)
		if err != nil {
			s.internalError(w, "reading role bindings", err)
			return
		}
		rb.Subject = req.Subject
		before := len(rb.Bindings)
		rb.Bindings = edit(slices.Clone(rb.Bindings), b)
		if len(rb.Bindings) == before && (action == "role.unbind" || slices.Contains(rb.Bindings, b)) {
			writeJSON(w, http.StatusOK, rb) // nothing to change: a retry, or already so
			return
		}
		rb.UpdatedAt, rb.UpdatedBy = s.now().UTC(), p.Subject
		data, err := json.Marshal(rb)
		if err != nil {
			s.internalError(w, "role bindings", err)
			return
		}
		if rev == 0 {
			_, err = kv.Create(ctx, key, data)
		} else {
			_, err = kv.Update(ctx, key, data, rev)
		}
		if errors.Is(err, jetstream.ErrKeyExists) || isWrongSequence(err) {
			continue // someone else changed it: read again
		}
		if err != nil {
			s.internalError(w, "writing role bindings", err)
			return
		}
		s.auth.ids.refresh(r.Context(), contracts.BucketRoleBindings, key)
		s.recordAudit(r.Context(), auditEvent{Action: action, Tenant: b.Tenant, Object: req.Subject, Outcome: "success"})
		s.log.Info("role bindings changed", "action", action, "subject", req.Subject, "role", b.Role, "tenant", b.Tenant, "by", p.Subject)
		writeJSON(w, http.StatusOK, rb)
		return
	}
}

func isWrongSequence(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence
}

func managerOf(b contracts.Binding) string {
	if b.Role == RolePlatformAdmin {
		return RolePlatformAdmin
	}
	return RoleTenantAdmin + " on " + b.Tenant
}

// decodeIdentityBody reads a small JSON object into v, refusing unknown
// fields; it answers 400 or 413 and returns false when it cannot.
func decodeIdentityBody(w http.ResponseWriter, r *http.Request, v any) bool {
	data, ok := readBody(w, r, maxIdentityBody)
	if !ok {
		return false
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidJSON, fmt.Sprintf("the body is not the expected JSON object: %v", err), nil)
		return false
	}
	if _, err := dec.Token(); err != io.EOF {
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidJSON, "the body holds more than one JSON value", nil)
		return false
	}
	return true
}

// withinGrant wraps PUT /v1/quotas/{tenant}: a platform admin's quota
// becomes the tenant's grant; a tenant admin's must stay within it.
func (s *server) withinGrant(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		p, _ := principalFrom(r.Context())
		tenant := r.PathValue("tenant")
		data, ok := readBody(w, r, s.cfg.MaxBodyBytes)
		if !ok {
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(data))
		q, decErr := contracts.DecodeTenantQuota(data, tenant)
		grants := s.kv(w, r, contracts.BucketQuotaGrants)
		if grants == nil {
			return
		}
		if p.isPlatformAdmin() {
			rec := &recorder{ResponseWriter: w}
			next(rec, r)
			if rec.status == http.StatusOK && decErr == nil {
				if err := putJSON(context.WithoutCancel(r.Context()), grants, tenant, q); err != nil {
					s.log.Error("quota grant not recorded; tenant admins keep the previous one", "tenant", tenant, "err", err)
				}
			}
			return
		}
		if decErr != nil {
			next(w, r) // it answers 400 with the field errors
			return
		}
		var grant contracts.TenantQuota
		rev, err := readDoc(r.Context(), grants, tenant, &grant)
		if err != nil {
			s.internalError(w, "reading the quota grant", err)
			return
		}
		if rev == 0 {
			s.forbidWith(w, r, contracts.ReasonAboveGrant, "quota.put", tenant, tenant,
				fmt.Sprintf("the platform has granted tenant %s no quota yet; a platform admin sets it first", tenant))
			return
		}
		if msg := exceedsGrant(q, grant); msg != "" {
			s.forbidWith(w, r, contracts.ReasonAboveGrant, "quota.put", tenant, tenant, msg)
			return
		}
		next(w, r)
	}
}

// exceedsGrant says how q goes beyond grant, or "".
func exceedsGrant(q, grant contracts.TenantQuota) string {
	if q.EffectiveWeight() > grant.EffectiveWeight() {
		return fmt.Sprintf("weight %g exceeds the granted %g", q.EffectiveWeight(), grant.EffectiveWeight())
	}
	// A pool without an entry is not bounded by the quota: every pool the
	// grant bounds stays bounded.
	for pool := range grant.Pools {
		if _, ok := q.For(pool); !ok {
			return fmt.Sprintf("pool %s: the granted quota there cannot be removed", pool)
		}
	}
	for pool, pq := range q.Pools {
		g, ok := grant.For(pool)
		if !ok {
			return fmt.Sprintf("pool %s: no quota was granted there", pool)
		}
		if pq.Guarantee > g.Guarantee {
			return fmt.Sprintf("pool %s: guarantee %g exceeds the granted %g", pool, pq.Guarantee, g.Guarantee)
		}
		if g.Max != nil && (pq.Max == nil || *pq.Max > *g.Max) {
			return fmt.Sprintf("pool %s: max must be at most the granted %g", pool, *g.Max)
		}
	}
	return ""
}

// dropGrant wraps DELETE /v1/quotas/{tenant} (platform admins only): the
// tenant no longer has a grant either.
func (s *server) dropGrant(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		rec := &recorder{ResponseWriter: w}
		next(rec, r)
		if rec.status != http.StatusOK {
			return
		}
		grants, err := s.buckets.get(r.Context(), contracts.BucketQuotaGrants)
		if err == nil {
			err = grants.Delete(context.WithoutCancel(r.Context()), r.PathValue("tenant"))
		}
		if err != nil {
			s.log.Warn("quota grant not removed", "tenant", r.PathValue("tenant"), "err", err)
		}
	}
}
