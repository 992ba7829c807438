package gateway

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// Authentication. Every request but the public paths (publicPaths) carries
// "Authorization: Bearer <token>", one of:
//
//   - a token the gateway issued, "gpt_<id>_<secret>": a long-lived API
//     token (automation) or the session of an LDAP login. Only the SHA-256
//     of the whole token is stored (BucketAPITokens), and every replica
//     holds the bucket in memory through a watch, so a revocation applies
//     to the next request without a KV read on the hot path;
//   - an OIDC token (a JWT) from the configured issuer, verified with
//     go-oidc against the issuer's JWKS: signature, issuer, audience,
//     expiry and not-before.
//
// The caller's roles are its bindings in BucketRoleBindings, also watched.
// A refused token is answered 401 with a reason that tells what was wrong
// with the token, never whether a user exists.

// tokenPrefix starts every token the gateway issues.
const tokenPrefix = "gpt_"

// publicPaths are served without credentials: the health probe, the console
// page (its API calls need a token), what a client needs to log in, the
// login itself, and the API's description.
var publicPaths = map[string]bool{"/healthz": true, "/": true, "/v1/auth/config": true, "/v1/login": true,
	"/v1/openapi.json": true}

// authError is a refused authentication: 401 with a reason.
type authError struct {
	reason contracts.Reason
	msg    string
}

func (e *authError) Error() string { return string(e.reason) + ": " + e.msg }

func refused(reason contracts.Reason, format string, args ...any) *authError {
	return &authError{reason: reason, msg: fmt.Sprintf(format, args...)}
}

// identities is the gateway's in-memory copy of the identity buckets.
type identities struct {
	mu                         sync.RWMutex
	tokens                     map[string]contracts.APIToken     // by token ID
	bindings                   map[string]contracts.RoleBindings // by subject
	tokensReady, bindingsReady atomic.Bool
	log                        *slog.Logger
	// revs is the KV revision applied per bucket and key: an entry read
	// directly (lookup) may be ahead of the watch, which must not then
	// take the key back to an older value.
	revs map[string]uint64
	// tokensKV and bindingsKV serve lookup; nil until follow opened them.
	tokensKV, bindingsKV atomic.Pointer[jetstream.KeyValue]
}

func newIdentities(log *slog.Logger) *identities {
	return &identities{tokens: map[string]contracts.APIToken{}, bindings: map[string]contracts.RoleBindings{}, log: log,
		revs: map[string]uint64{}}
}

// refresh applies what bucket now holds under key, after this gateway
// wrote it: the next request (a list, a check of the roles just bound)
// sees the write even while the watch is a few ms behind.
func (id *identities) refresh(ctx context.Context, bucket, key string) {
	p := &id.tokensKV
	apply, forget := id.applyToken, func() { delete(id.tokens, key) }
	if bucket == contracts.BucketRoleBindings {
		p, apply = &id.bindingsKV, id.applyBindings
		forget = func() {
			if subject, err := contracts.SubjectOfKey(key); err == nil {
				delete(id.bindings, subject)
			}
		}
	}
	kv := p.Load()
	if kv == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	e, err := (*kv).Get(ctx, key)
	switch {
	case err == nil:
		apply(e)
	case errors.Is(err, jetstream.ErrKeyNotFound):
		// Deleted: the watch's older put (if it comes late) was applied
		// already or is older than the delete it brings next.
		id.mu.Lock()
		forget()
		id.mu.Unlock()
	}
}

// newer records rev for bucket/key and reports whether it is newer than
// what was applied; id.mu is held.
func (id *identities) newer(bucket, key string, rev uint64) bool {
	k := bucket + "/" + key
	if rev <= id.revs[k] {
		return false
	}
	id.revs[k] = rev
	return true
}

// lookup reads a token the watch has not brought yet (one just issued by
// this or another replica: a client uses a token the moment it gets it)
// and its subject's bindings straight from KV, and applies both. It
// reports whether the token exists.
func (id *identities) lookup(ctx context.Context, tokenID string) bool {
	tkv, bkv := id.tokensKV.Load(), id.bindingsKV.Load()
	if tkv == nil || bkv == nil {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	e, err := (*tkv).Get(ctx, tokenID)
	if err != nil {
		return false
	}
	id.applyToken(e)
	t, ok := id.token(tokenID)
	if !ok {
		return false
	}
	if b, err := (*bkv).Get(ctx, contracts.RoleBindingsKey(t.Subject)); err == nil {
		id.applyBindings(b)
	}
	return true
}

// ready reports whether both buckets were read to their end: until then a
// revoked token could still pass.
func (id *identities) ready() bool { return id.tokensReady.Load() && id.bindingsReady.Load() }

// follow watches both buckets until ctx ends.
func (id *identities) follow(ctx context.Context, b *bus.Bus) error {
	for bucket, p := range map[string]*atomic.Pointer[jetstream.KeyValue]{
		contracts.BucketAPITokens: &id.tokensKV, contracts.BucketRoleBindings: &id.bindingsKV} {
		kv, err := b.KeyValue(ctx, bucket)
		if err != nil {
			return err
		}
		p.Store(&kv)
	}
	errs := make(chan error, 2)
	go func() {
		errs <- b.WatchKV(ctx, contracts.BucketAPITokens, id.applyToken, func() { id.tokensReady.Store(true) })
	}()
	go func() {
		errs <- b.WatchKV(ctx, contracts.BucketRoleBindings, id.applyBindings, func() { id.bindingsReady.Store(true) })
	}()
	return errors.Join(<-errs, <-errs)
}

func (id *identities) applyToken(e jetstream.KeyValueEntry) {
	id.mu.Lock()
	defer id.mu.Unlock()
	if !id.newer(contracts.BucketAPITokens, e.Key(), e.Revision()) {
		return
	}
	if e.Operation() != jetstream.KeyValuePut {
		delete(id.tokens, e.Key())
		return
	}
	var t contracts.APIToken
	if err := json.Unmarshal(e.Value(), &t); err != nil || t.ID != e.Key() {
		// A token that does not decode authenticates nobody.
		id.log.Warn("unreadable API token record; ignored", "token_id", e.Key(), "revision", e.Revision())
		delete(id.tokens, e.Key())
		return
	}
	id.tokens[t.ID] = t
}

func (id *identities) applyBindings(e jetstream.KeyValueEntry) {
	subject, err := contracts.SubjectOfKey(e.Key())
	if err != nil {
		id.log.Warn("role binding key is not a subject; ignored", "key", e.Key())
		return
	}
	id.mu.Lock()
	defer id.mu.Unlock()
	if !id.newer(contracts.BucketRoleBindings, e.Key(), e.Revision()) {
		return
	}
	if e.Operation() != jetstream.KeyValuePut {
		delete(id.bindings, subject)
		return
	}
	var rb contracts.RoleBindings
	if err := json.Unmarshal(e.Value(), &rb); err != nil || rb.Subject != subject {
		id.log.Warn("unreadable role bindings; the subject has no roles", "subject", subject, "revision", e.Revision())
		delete(id.bindings, subject)
		return
	}
	id.bindings[subject] = rb
}

func (id *identities) token(tokenID string) (contracts.APIToken, bool) {
	id.mu.RLock()
	defer id.mu.RUnlock()
	t, ok := id.tokens[tokenID]
	return t, ok
}

// roles returns subject's bindings (a copy).
func (id *identities) roles(subject string) []RoleBinding {
	id.mu.RLock()
	defer id.mu.RUnlock()
	return slices.Clone(id.bindings[subject].Bindings)
}

// allBindings returns every subject's bindings.
func (id *identities) allBindings() []contracts.RoleBindings {
	id.mu.RLock()
	defer id.mu.RUnlock()
	out := make([]contracts.RoleBindings, 0, len(id.bindings))
	for _, rb := range id.bindings {
		out = append(out, rb)
	}
	return out
}

// allTokens returns every token record.
func (id *identities) allTokens() []contracts.APIToken {
	id.mu.RLock()
	defer id.mu.RUnlock()
	out := make([]contracts.APIToken, 0, len(id.tokens))
	for _, t := range id.tokens {
		out = append(out, t)
	}
	return out
}

// authenticator decides who a request is from.
type authenticator struct {
	ids  *identities
	oidc *oidcVerifier // nil without -oidc-issuer
	ldap *ldapAuth     // nil without -ldap-url
	now  func() time.Time
}

// authenticate returns the principal of r's bearer token.
func (a *authenticator) authenticate(r *http.Request) (Principal, *authError) {
	h := r.Header.Get("Authorization")
	if h == "" {
		return Principal{}, refused(contracts.ReasonUnauthenticated, "this endpoint needs credentials: Authorization: Bearer <token> (gpuctl login)")
	}
	scheme, raw, ok := strings.Cut(h, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") || strings.TrimSpace(raw) == "" {
		return Principal{}, refused(contracts.ReasonUnauthenticated, "want Authorization: Bearer <token>")
	}
	raw = strings.TrimSpace(raw)
	var p Principal
	if strings.HasPrefix(raw, tokenPrefix) {
		t, err := a.issuedToken(r.Context(), raw)
		if err != nil {
			return Principal{}, err
		}
		p = Principal{Subject: t.Subject, Name: t.Name, Method: "token"}
		if t.Kind == contracts.TokenKindSession {
			p.Method = "ldap"
		}
	} else {
		if a.oidc == nil {
			return Principal{}, refused(contracts.ReasonInvalidToken, "not a token this gateway issued, and no OIDC issuer is configured")
		}
		var err *authError
		if p, err = a.oidc.verify(r.Context(), raw); err != nil {
			return Principal{}, err
		}
	}
	p.Roles = a.ids.roles(p.Subject)
	return p, nil
}

// issuedToken checks a gpt_ token against its stored hash. Unknown,
// revoked and wrong secrets are all invalid_token.
func (a *authenticator) issuedToken(ctx context.Context, raw string) (contracts.APIToken, *authError) {
	id, _, ok := strings.Cut(strings.TrimPrefix(raw, tokenPrefix), "_")
	invalid := refused(contracts.ReasonInvalidToken, "the token is unknown, revoked or malformed")
	if !ok || contracts.ValidateTokenID(id) != nil {
		return contracts.APIToken{}, invalid
	}
	t, found := a.ids.token(id)
	if !found && a.ids.lookup(ctx, id) {
		t, found = a.ids.token(id)
	}
	sum := sha256.Sum256([]byte(raw))
	want, err := hex.DecodeString(t.SHA256)
	if !found || err != nil || subtle.ConstantTimeCompare(sum[:], want) != 1 {
		return contracts.APIToken{}, invalid
	}
	if !t.ExpiresAt.IsZero() && !a.now().Before(t.ExpiresAt) {
		return contracts.APIToken{}, refused(contracts.ReasonTokenExpired, "the token expired at %s", t.ExpiresAt.UTC().Format(time.RFC3339))
	}
	return t, nil
}

// newSecret returns a token for id: gpt_<id>_<43 characters of 256
// random bits>, and the hex SHA-256 to store.
func newSecret(id string) (secret, hash string) {
	b := make([]byte, 32)
	_, _ = rand.Read(b) // crypto/rand.Read never fails (it panics instead)
	secret = tokenPrefix + id + "_" + base64.RawURLEncoding.EncodeToString(b)
	sum := sha256.Sum256([]byte(secret))
	return secret, hex.EncodeToString(sum[:])
}

// newTokenID returns a random token ID.
func newTokenID() string {
	b := make([]byte, 9)
	_, _ = rand.Read(b)
	return "t" + strings.ToLower(base32NoPad(b))
}

func base32NoPad(b []byte) string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz234567"
	var sb strings.Builder
	var acc uint32
	var bits uint
	for _, c := range b {
		acc = acc<<8 | uint32(c)
		bits += 8
		for bits >= 5 {
			bits -= 5
			sb.WriteByte(alphabet[(acc>>bits)&31])
		}
	}
	if bits > 0 {
		sb.WriteByte(alphabet[(acc<<(5-bits))&31])
	}
	return sb.String()
}

// Grant is a token to issue outside the API: the first platform admin of
// a new installation (gpuplane's make run, deploy's bootstrap job) and
// test callers.
type Grant struct {
	// ID is the token ID; issuing again under the same ID replaces the
	// secret (the old one stops working) and the bindings.
	ID       string
	Name     string
	Bindings []contracts.Binding
	TTL      time.Duration // 0: no expiry
}

// IssueToken stores an API token for g and its role bindings on b, and
// returns the secret token, which is shown nowhere else.
func IssueToken(ctx context.Context, b *bus.Bus, g Grant) (string, error) {
	if err := contracts.ValidateTokenID(g.ID); err != nil {
		return "", err
	}
	for _, bd := range g.Bindings {
		if err := bd.Validate(); err != nil {
			return "", err
		}
	}
	tokens, err := b.KeyValue(ctx, contracts.BucketAPITokens)
	if err != nil {
		return "", err
	}
	roles, err := b.KeyValue(ctx, contracts.BucketRoleBindings)
	if err != nil {
		return "", err
	}
	return issueToken(ctx, tokens, roles, g)
}

// IssueTokenJS is IssueToken for a caller with a plain JetStream client
// (an e2e test driving separate processes); the buckets are created when
// missing.
func IssueTokenJS(ctx context.Context, js jetstream.JetStream, g Grant) (string, error) {
	if err := contracts.ValidateTokenID(g.ID); err != nil {
		return "", err
	}
	buckets := map[string]jetstream.KeyValue{}
	for _, cfg := range contracts.KeyValues(contracts.StreamOptions{}) {
		if cfg.Bucket != contracts.BucketAPITokens && cfg.Bucket != contracts.BucketRoleBindings {
			continue
		}
		kv, err := js.KeyValue(ctx, cfg.Bucket)
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			kv, err = js.CreateKeyValue(ctx, cfg)
		}
		if err != nil {
			return "", fmt.Errorf("kv bucket %s: %w", cfg.Bucket, err)
		}
		buckets[cfg.Bucket] = kv
	}
	return issueToken(ctx, buckets[contracts.BucketAPITokens], buckets[contracts.BucketRoleBindings], g)
}

func issueToken(ctx context.Context, tokens, roles jetstream.KeyValue, g Grant) (string, error) {
	for _, bd := range g.Bindings {
		if err := bd.Validate(); err != nil {
			return "", err
		}
	}
	now := time.Now().UTC()
	secret, hash := newSecret(g.ID)
	t := contracts.APIToken{ID: g.ID, Kind: contracts.TokenKindAPI, Name: g.Name, Subject: "token:" + g.ID,
		SHA256: hash, Owner: "bootstrap", CreatedAt: now}
	if g.TTL > 0 {
		t.ExpiresAt = now.Add(g.TTL)
	}
	// Bindings first: the token never exists without them.
	rb := contracts.RoleBindings{Subject: t.Subject, Bindings: g.Bindings, UpdatedAt: now, UpdatedBy: "bootstrap"}
	if err := putJSON(ctx, roles, contracts.RoleBindingsKey(t.Subject), rb); err != nil {
		return "", fmt.Errorf("role bindings of %s: %w", t.Subject, err)
	}
	if err := putJSON(ctx, tokens, t.ID, t); err != nil {
		return "", fmt.Errorf("token %s: %w", t.ID, err)
	}
	return secret, nil
}

func putJSON(ctx context.Context, kv jetstream.KeyValue, key string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = kv.Put(ctx, key, data)
	return err
}

// bootstrapTokenID is the ID of the -admin-token-file token.
const bootstrapTokenID = "bootstrap-admin"

// bootstrapAdmin makes the token in file a platform admin's, writing a new
// token there first when the file does not exist (a deployment may
// instead provide it from a secret). Only the hash goes to KV; running it
// again with the same file changes nothing.
func bootstrapAdmin(ctx context.Context, b *bus.Bus, file string) error {
	data, err := os.ReadFile(file)
	if errors.Is(err, fs.ErrNotExist) {
		secret, _ := newSecret(bootstrapTokenID)
		f, cerr := os.OpenFile(file, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if cerr != nil {
			return fmt.Errorf("admin token file: %w", cerr)
		}
		_, werr := f.WriteString(secret + "\n")
		if err := errors.Join(werr, f.Close()); err != nil {
			return fmt.Errorf("admin token file: %w", err)
		}
		data, err = []byte(secret), nil
	}
	if err != nil {
		return fmt.Errorf("admin token file: %w", err)
	}
	secret := strings.TrimSpace(string(data))
	if !strings.HasPrefix(secret, tokenPrefix+bootstrapTokenID+"_") || len(secret) < len(tokenPrefix+bootstrapTokenID)+33 {
		return fmt.Errorf("admin token file %s: want %s%s_ followed by at least 32 random characters", file, tokenPrefix, bootstrapTokenID)
	}
	tokens, err := b.KeyValue(ctx, contracts.BucketAPITokens)
	if err != nil {
		return err
	}
	roles, err := b.KeyValue(ctx, contracts.BucketRoleBindings)
	if err != nil {
		return err
	}
	sum := sha256.Sum256([]byte(secret))
	now := time.Now().UTC()
	t := contracts.APIToken{ID: bootstrapTokenID, Kind: contracts.TokenKindAPI, Name: "bootstrap platform admin",
		Subject: "token:" + bootstrapTokenID, SHA256: hex.EncodeToString(sum[:]), Owner: "bootstrap", CreatedAt: now}
	rb := contracts.RoleBindings{Subject: t.Subject, Bindings: []contracts.Binding{{Role: RolePlatformAdmin}},
		UpdatedAt: now, UpdatedBy: "bootstrap"}
	var cur contracts.APIToken
	if e, err := tokens.Get(ctx, t.ID); err == nil && json.Unmarshal(e.Value(), &cur) == nil && cur.SHA256 == t.SHA256 {
		return nil // already in place: every replica starts with the same file
	}
	if err := putJSON(ctx, roles, contracts.RoleBindingsKey(t.Subject), rb); err != nil {
		return fmt.Errorf("bootstrap admin bindings: %w", err)
	}
	if err := putJSON(ctx, tokens, t.ID, t); err != nil {
		return fmt.Errorf("bootstrap admin token: %w", err)
	}
	return nil
}
