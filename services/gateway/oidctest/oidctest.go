// Package oidctest is a real, in-process OpenID Connect issuer for tests:
// discovery, a JWKS with a generated RSA key, tokens signed with it, and
// the device-code flow (approved at once), on an httptest server on
// 127.0.0.1. Tests of the gateway and of gpuctl log in through it exactly
// as against a real identity provider.
package oidctest

import (
	"crypto/rand"
	"crypto/rsa"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
)

// Issuer is a running test identity provider.
type Issuer struct {
	URL      string
	ClientID string
	// DeviceSubject is the user a device-code login authenticates as.
	DeviceSubject string
	key           *rsa.PrivateKey

	mu      sync.Mutex
	devices map[string]bool // device codes handed out
}

// Start runs an issuer until the test ends.
func Start(t testing.TB, clientID string) *Issuer {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	i := &Issuer{ClientID: clientID, DeviceSubject: "dev-user", key: key, devices: map[string]bool{}}
	mux := http.NewServeMux()
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	i.URL = srv.URL
	mux.HandleFunc("GET /.well-known/openid-configuration", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, map[string]any{
			"issuer":                                i.URL,
			"jwks_uri":                              i.URL + "/jwks",
			"authorization_endpoint":                i.URL + "/authorize",
			"token_endpoint":                        i.URL + "/token",
			"device_authorization_endpoint":         i.URL + "/device",
			"id_token_signing_alg_values_supported": []string{"RS256"},
			"response_types_supported":              []string{"code"},
			"subject_types_supported":               []string{"public"},
		})
	})
	mux.HandleFunc("GET /jwks", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &key.PublicKey, KeyID: "k1", Algorithm: "RS256", Use: "sig"}}})
	})
	mux.HandleFunc("POST /device", func(w http.ResponseWriter, r *http.Request) {
		if r.FormValue("client_id") != i.ClientID {
			http.Error(w, `{"error":"invalid_client"}`, http.StatusBadRequest)
			return
		}
		code := rand.Text()
		i.mu.Lock()
		i.devices[code] = true
		i.mu.Unlock()
		writeJSON(w, map[string]any{"device_code": code, "user_code": "ABCD-EFGH", "verification_uri": i.URL + "/activate",
			"expires_in": 300, "interval": 1})
	})
	mux.HandleFunc("POST /token", func(w http.ResponseWriter, r *http.Request) {
		i.mu.Lock()
		ok := i.devices[r.FormValue("device_code")]
		delete(i.devices, r.FormValue("device_code"))
		i.mu.Unlock()
		if r.FormValue("grant_type") != "urn:ietf:params:oauth:grant-type:device_code" || !ok {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			_, _ = w.Write([]byte(`{"error":"invalid_grant"}`))
			return
		}
		idt := i.Token(t, i.Claims(i.DeviceSubject))
		writeJSON(w, map[string]any{"access_token": "opaque-access", "token_type": "Bearer", "expires_in": 3600, "id_token": idt})
	})
	return i
}

// Claims are valid claims for sub: this issuer, this client, an hour.
func (i *Issuer) Claims(sub string) map[string]any {
	now := time.Now()
	return map[string]any{"iss": i.URL, "sub": sub, "aud": i.ClientID, "iat": now.Unix(), "nbf": now.Add(-time.Minute).Unix(),
		"exp": now.Add(time.Hour).Unix(), "preferred_username": sub}
}

// Token signs claims with the issuer's key (RS256).
func (i *Issuer) Token(t testing.TB, claims map[string]any) string {
	t.Helper()
	return Sign(t, i.key, "k1", claims)
}

// Sign signs claims with key under kid (RS256): with another key than the
// issuer's, a badly signed token.
func Sign(t testing.TB, key *rsa.PrivateKey, kid string, claims map[string]any) string {
	t.Helper()
	signer, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.RS256, Key: jose.JSONWebKey{Key: key, KeyID: kid}},
		(&jose.SignerOptions{}).WithType("JWT"))
	if err != nil {
		t.Fatal(err)
	}
	payload, err := json.Marshal(claims)
	if err != nil {
		t.Fatal(err)
	}
	jws, err := signer.Sign(payload)
	if err != nil {
		t.Fatal(err)
	}
	out, err := jws.CompactSerialize()
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Unsigned is claims as an "alg: none" token.
func Unsigned(t testing.TB, claims map[string]any) string {
	t.Helper()
	payload, err := json.Marshal(claims)
	if err != nil {
		t.Fatal(err)
	}
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"none","typ":"JWT"}`)) + "." + enc(payload) + "."
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}
