package gateway

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/coreos/go-oidc/v3/oidc"

	"github.com/gpuplane/gpuplane/contracts"
)

// oidcAlgs are the signature algorithms accepted on an OIDC token: the
// asymmetric ones (an HMAC "key" would be the client secret) and never
// "none".
var oidcAlgs = []string{oidc.RS256, oidc.RS384, oidc.RS512, oidc.ES256, oidc.ES384, oidc.ES512, oidc.PS256,
	oidc.PS384, oidc.PS512, oidc.EdDSA}

// oidcVerifier verifies bearer tokens of one issuer for one audience
// (the client ID). The issuer's discovery document is read on first use
// and retried on the next request after a failure, so the gateway starts
// while the identity provider is down.
type oidcVerifier struct {
	issuer, clientID string
	now              func() time.Time

	mu       sync.Mutex
	verifier *oidc.IDTokenVerifier // full checks
	sigOnly  *oidc.IDTokenVerifier // signature only: to name what else was wrong

	// verified caches the principal of a token that passed, by the
	// token's SHA-256, until the token expires (at most verifiedFor): a
	// client sends the same token with every request, and an RSA
	// verification costs ~50 µs. Only the identity is cached; roles are
	// read per request.
	cacheMu  sync.Mutex
	verified map[[32]byte]verifiedToken
}

// verifiedFor bounds how long a verified token is trusted without
// checking it again; maxVerified bounds the cache (it is emptied when
// full: a flood of distinct valid tokens only costs verifications).
const (
	verifiedFor = time.Minute
	maxVerified = 10000
)

type verifiedToken struct {
	p     Principal
	until time.Time
}

func newOIDCVerifier(issuer, clientID string, now func() time.Time) *oidcVerifier {
	return &oidcVerifier{issuer: issuer, clientID: clientID, now: now}
}

func (o *oidcVerifier) verifiers(ctx context.Context) (*oidc.IDTokenVerifier, *oidc.IDTokenVerifier, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.verifier != nil {
		return o.verifier, o.sigOnly, nil
	}
	// The provider's key set outlives this request: its context must not
	// end with it.
	p, err := oidc.NewProvider(oidc.ClientContext(context.WithoutCancel(ctx), nil), o.issuer)
	if err != nil {
		return nil, nil, err
	}
	o.verifier = p.Verifier(&oidc.Config{ClientID: o.clientID, SupportedSigningAlgs: oidcAlgs, Now: o.now})
	o.sigOnly = p.Verifier(&oidc.Config{SupportedSigningAlgs: oidcAlgs, SkipClientIDCheck: true, SkipExpiryCheck: true,
		SkipIssuerCheck: true, Now: o.now})
	return o.verifier, o.sigOnly, nil
}

// verify accepts raw only if go-oidc's full verification does; when it
// does not, the reason is found by checking the pieces one by one.
func (o *oidcVerifier) verify(ctx context.Context, raw string) (Principal, *authError) {
	key := sha256.Sum256([]byte(raw))
	now := o.now()
	o.cacheMu.Lock()
	v, ok := o.verified[key]
	o.cacheMu.Unlock()
	if ok && now.Before(v.until) {
		return v.p, nil
	}
	p, aerr := o.verifyFully(ctx, raw)
	if aerr != nil {
		return p, aerr
	}
	until := now.Add(verifiedFor)
	if _, claims, err := peekJWT(raw); err == nil && claims.Expiry != 0 && time.Unix(int64(claims.Expiry), 0).Before(until) {
		until = time.Unix(int64(claims.Expiry), 0)
	}
	o.cacheMu.Lock()
	if o.verified == nil || len(o.verified) >= maxVerified {
		o.verified = map[[32]byte]verifiedToken{}
	}
	o.verified[key] = verifiedToken{p: p, until: until}
	o.cacheMu.Unlock()
	return p, nil
}

func (o *oidcVerifier) verifyFully(ctx context.Context, raw string) (Principal, *authError) {
	hdr, claims, perr := peekJWT(raw)
	if perr != nil {
		return Principal{}, refused(contracts.ReasonInvalidToken, "not a JWT: %v", perr)
	}
	if !slices.Contains(oidcAlgs, hdr.Alg) {
		return Principal{}, refused(contracts.ReasonUnsupportedAlg, "token algorithm %q is not accepted; want one of %v", hdr.Alg, oidcAlgs)
	}
	full, sigOnly, err := o.verifiers(ctx)
	if err != nil {
		// Not the client's fault, but nothing was verified: still 401.
		return Principal{}, refused(contracts.ReasonInvalidToken, "the identity provider cannot be reached to verify the token; retry shortly")
	}
	tok, err := full.Verify(ctx, raw)
	if err != nil {
		return Principal{}, o.why(ctx, sigOnly, raw, claims, err)
	}
	var c jwtClaims
	if err := tok.Claims(&c); err != nil {
		return Principal{}, refused(contracts.ReasonInvalidToken, "token claims: %v", err)
	}
	if c.Subject == "" {
		return Principal{}, refused(contracts.ReasonInvalidToken, "the token has no sub claim")
	}
	name := cmp.Or(c.PreferredUsername, c.Email, c.Subject)
	return Principal{Subject: "oidc:" + tok.Issuer + "#" + c.Subject, Name: name, Method: "oidc"}, nil
}

// why names what was wrong with a token go-oidc refused. The signature is
// checked first: the claims of a token that does not verify are not
// trusted to explain anything.
func (o *oidcVerifier) why(ctx context.Context, sigOnly *oidc.IDTokenVerifier, raw string, c jwtClaims, err error) *authError {
	if _, serr := sigOnly.Verify(ctx, raw); serr != nil {
		return refused(contracts.ReasonBadSignature, "the token's signature does not verify against the issuer's keys")
	}
	now := o.now()
	switch {
	case c.Issuer != o.issuer:
		return refused(contracts.ReasonWrongIssuer, "the token was issued by %q, not by %q", c.Issuer, o.issuer)
	case !slices.Contains(c.Audience, o.clientID):
		return refused(contracts.ReasonWrongAudience, "the token is not for this gateway's client %q", o.clientID)
	case errors.As(err, new(*oidc.TokenExpiredError)):
		return refused(contracts.ReasonTokenExpired, "the token expired")
	case c.NotBefore != 0 && now.Before(time.Unix(int64(c.NotBefore), 0).Add(-5*time.Minute)):
		return refused(contracts.ReasonTokenNotYetValid, "the token is not valid before %s", time.Unix(int64(c.NotBefore), 0).UTC().Format(time.RFC3339))
	}
	return refused(contracts.ReasonInvalidToken, "the token was refused")
}

// jwtHeader and jwtClaims are what peekJWT reads without verifying.
type jwtHeader struct {
	Alg string `json:"alg"`
}

type jwtClaims struct {
	Issuer   string   `json:"iss"`
	Subject  string   `json:"sub"`
	Audience audience `json:"aud"`
	// NumericDates may be fractional (RFC 7519).
	NotBefore         float64 `json:"nbf"`
	Expiry            float64 `json:"exp"`
	PreferredUsername string  `json:"preferred_username"`
	Email             string  `json:"email"`
}

// audience is aud: a string or an array of strings.
type audience []string

func (a *audience) UnmarshalJSON(b []byte) error {
	var one string
	if err := json.Unmarshal(b, &one); err == nil {
		*a = audience{one}
		return nil
	}
	var many []string
	if err := json.Unmarshal(b, &many); err != nil {
		return err
	}
	*a = many
	return nil
}

// peekJWT decodes a compact JWT's header and claims without verifying
// anything: only to choose a reason, or refuse early.
func peekJWT(raw string) (jwtHeader, jwtClaims, error) {
	var h jwtHeader
	var c jwtClaims
	parts := strings.Split(raw, ".")
	if len(parts) != 3 {
		return h, c, fmt.Errorf("%d parts, want 3", len(parts))
	}
	hb, err := base64.RawURLEncoding.DecodeString(parts[0])
	if err != nil {
		return h, c, fmt.Errorf("header: %w", err)
	}
	if err := json.Unmarshal(hb, &h); err != nil {
		return h, c, fmt.Errorf("header: %w", err)
	}
	cb, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return h, c, fmt.Errorf("claims: %w", err)
	}
	if err := json.Unmarshal(cb, &c); err != nil {
		return h, c, fmt.Errorf("claims: %w", err)
	}
	return h, c, nil
}
