package gateway

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/gateway/ldaptest"
	"github.com/gpuplane/gpuplane/services/gateway/oidctest"
)

// bearer sends a token on every request that names no Authorization of
// its own.
type bearer struct {
	token string
	base  http.RoundTripper
}

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Header.Get("Authorization") == "" && b.token != "" {
		r = r.Clone(r.Context())
		r.Header.Set("Authorization", "Bearer "+b.token)
	}
	base := b.base
	if base == nil {
		base = http.DefaultTransport
	}
	return base.RoundTrip(r)
}

// trusting is a transport that trusts the self-signed certificate in
// certFile.
func trusting(t *testing.T, certFile string) http.RoundTripper {
	t.Helper()
	pemData, err := os.ReadFile(certFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pemData) {
		t.Fatal("no certificate in " + certFile)
	}
	return &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}
}

// syncBuffer is a bytes.Buffer safe for the gateway's concurrent logging.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// issue stores an API token with bindings, as make run bootstraps its
// admin, and returns the secret.
func (h *harness) issue(id string, bindings ...contracts.Binding) string {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	secret, err := IssueToken(ctx, h.bus, Grant{ID: id, Name: id, Bindings: bindings})
	if err != nil {
		h.t.Fatalf("issue token %s: %v", id, err)
	}
	if h.url != "" { // the gateway runs: wait until its watch has the token
		h.eventually("token "+id+" known to the gateway", func() bool {
			var who contracts.WhoAmI
			status, _ := h.do(http.MethodGet, "/v1/whoami", "", nil, "Authorization", "Bearer "+secret)
			if status == http.StatusOK {
				h.do(http.MethodGet, "/v1/whoami", "", &who, "Authorization", "Bearer "+secret)
			}
			return status == http.StatusOK && len(who.Bindings) == len(bindings)
		})
	}
	return secret
}

// as sends one request with token ("" for none) and returns the status
// and the error body (zero for a 2xx).
func (h *harness) as(token, method, path, body string, out any) (int, contracts.APIErrorBody) {
	h.t.Helper()
	auth := "Bearer " + token
	if token == "" {
		auth = "-"
	}
	status, data := h.do(method, path, body, out, "Authorization", auth)
	var ae contracts.APIError
	if status/100 != 2 {
		if err := json.Unmarshal(data, &ae); err != nil {
			h.t.Fatalf("%s %s: status %d body %q is not an APIError", method, path, status, data)
		}
	}
	return status, ae.Error
}

// assertNoSecrets fails if any secret appears in what the gateway logged
// or in any message of any stream (KV buckets included) on the bus.
func (h *harness) assertNoSecrets(secrets ...string) {
	h.t.Helper()
	logs := h.logs.String()
	if logs == "" {
		h.t.Fatal("the gateway logged nothing: the log capture is broken")
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	var stored [][]byte
	names := h.bus.JetStream().StreamNames(ctx)
	for name := range names.Name() {
		for _, m := range h.messages(name, ">") {
			stored = append(stored, m.Data)
			for k, vs := range m.Header {
				stored = append(stored, []byte(k+": "+strings.Join(vs, ",")))
			}
		}
	}
	if err := names.Err(); err != nil && !errors.Is(err, jetstream.ErrEndOfData) {
		h.t.Fatalf("list streams: %v", err)
	}
	for _, s := range secrets {
		if s == "" {
			h.t.Fatal("empty secret")
		}
		if strings.Contains(logs, s) {
			h.t.Errorf("the gateway logged a secret (%.8s...)", s)
		}
		for _, data := range stored {
			if bytes.Contains(data, []byte(s)) {
				h.t.Errorf("a secret (%.8s...) was written to the bus: %.200s", s, data)
			}
		}
	}
}

func TestUnauthenticatedRequestsAreRefused(t *testing.T) {
	h := startGateway(t, nil, nil)
	tests := map[string]struct {
		auth, path string
		status     int
		reason     contracts.Reason
	}{
		"no credentials":       {"-", "/v1/tenants/acme/jobs", 401, contracts.ReasonUnauthenticated},
		"basic auth":           {"Basic YWxpY2U6cHc=", "/v1/tenants/acme/jobs", 401, contracts.ReasonUnauthenticated},
		"empty bearer":         {"Bearer ", "/v1/whoami", 401, contracts.ReasonUnauthenticated},
		"unknown gpt token":    {"Bearer gpt_nosuch_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "/v1/whoami", 401, contracts.ReasonInvalidToken},
		"wrong secret":         {"Bearer " + h.token[:len(h.token)-4] + "AAAA", "/v1/whoami", 401, contracts.ReasonInvalidToken},
		"jwt without oidc":     {"Bearer a.b.c", "/v1/whoami", 401, contracts.ReasonInvalidToken},
		"unknown path too":     {"-", "/v2/whatever", 401, contracts.ReasonUnauthenticated},
		"healthz is public":    {"-", "/healthz", 200, ""},
		"console is public":    {"-", "/", 200, ""},
		"auth config public":   {"-", "/v1/auth/config", 200, ""},
		"admin token accepted": {"Bearer " + h.token, "/v1/tenants/acme/jobs", 200, ""},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			status, data := h.do(http.MethodGet, tt.path, "", nil, "Authorization", tt.auth)
			if status != tt.status {
				t.Fatalf("status %d (%s), want %d", status, data, tt.status)
			}
			if tt.reason == "" {
				return
			}
			var ae contracts.APIError
			if err := json.Unmarshal(data, &ae); err != nil || ae.Error.Reason != tt.reason {
				t.Fatalf("body %s, want reason %s", data, tt.reason)
			}
		})
	}
	h.assertNoSecrets(h.token)
}

func TestOIDCBearerTokens(t *testing.T) {
	iss := oidctest.Start(t, "gpuplane")
	h := startGateway(t, func(c *Config) { c.OIDCIssuer, c.OIDCClientID = iss.URL, "gpuplane" }, nil)
	subject := "oidc:" + iss.URL + "#alice"
	if status, ae := h.as(h.token, http.MethodPost, "/v1/roles", `{"subject":"`+subject+`","role":"member","tenant":"acme"}`, nil); status != 200 {
		t.Fatalf("bind alice: %d %+v", status, ae)
	}
	other, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	with := func(edit func(map[string]any)) map[string]any {
		c := iss.Claims("alice")
		edit(c)
		return c
	}
	valid := iss.Token(t, iss.Claims("alice"))
	parts := strings.Split(valid, ".")
	forged := iss.Token(t, with(func(c map[string]any) { c["sub"] = "mallory" }))
	tests := map[string]struct {
		token  string
		reason contracts.Reason
	}{
		"expired":               {iss.Token(t, with(func(c map[string]any) { c["exp"], c["nbf"] = now.Add(-time.Hour).Unix(), now.Add(-2*time.Hour).Unix() })), contracts.ReasonTokenExpired},
		"not yet valid":         {iss.Token(t, with(func(c map[string]any) { c["nbf"], c["exp"] = now.Add(time.Hour).Unix(), now.Add(2*time.Hour).Unix() })), contracts.ReasonTokenNotYetValid},
		"wrong audience":        {iss.Token(t, with(func(c map[string]any) { c["aud"] = "another-client" })), contracts.ReasonWrongAudience},
		"wrong issuer":          {iss.Token(t, with(func(c map[string]any) { c["iss"] = "https://idp.example.com" })), contracts.ReasonWrongIssuer},
		"alg none":              {oidctest.Unsigned(t, iss.Claims("alice")), contracts.ReasonUnsupportedAlg},
		"HS256 header":          {b64(`{"alg":"HS256","typ":"JWT"}`) + "." + parts[1] + "." + parts[2], contracts.ReasonUnsupportedAlg},
		"signed by another key": {oidctest.Sign(t, other, "k1", iss.Claims("alice")), contracts.ReasonBadSignature},
		"claims swapped":        {parts[0] + "." + strings.Split(forged, ".")[1] + "." + parts[2], contracts.ReasonBadSignature},
		"not a JWT":             {"not-a-jwt", contracts.ReasonInvalidToken},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			status, ae := h.as(tt.token, http.MethodGet, "/v1/tenants/acme/jobs", "", nil)
			if status != http.StatusUnauthorized || ae.Reason != tt.reason {
				t.Fatalf("%d %s (%s), want 401 %s", status, ae.Reason, ae.Message, tt.reason)
			}
			if strings.Contains(ae.Message, tt.token) {
				t.Errorf("the answer repeats the token")
			}
		})
	}
	t.Run("valid", func(t *testing.T) {
		var who contracts.WhoAmI
		if status, ae := h.as(valid, http.MethodGet, "/v1/whoami", "", &who); status != 200 {
			t.Fatalf("whoami: %d %+v", status, ae)
		}
		want := contracts.WhoAmI{Subject: subject, Name: "alice", Method: "oidc", Bindings: []contracts.Binding{{Role: "member", Tenant: "acme"}}}
		if who.Subject != want.Subject || who.Name != want.Name || who.Method != want.Method || len(who.Bindings) != 1 || who.Bindings[0] != want.Bindings[0] {
			t.Fatalf("whoami %+v, want %+v", who, want)
		}
		if status, ae := h.as(valid, http.MethodGet, "/v1/tenants/acme/jobs", "", nil); status != 200 {
			t.Fatalf("alice lists acme's jobs: %d %+v", status, ae)
		}
		if status, ae := h.as(valid, http.MethodGet, "/v1/tenants/globex/jobs", "", nil); status != 403 || ae.Reason != contracts.ReasonForbidden {
			t.Fatalf("alice lists globex's jobs: %d %+v, want 403 forbidden", status, ae)
		}
	})
	var cfg contracts.AuthConfig
	if status, _ := h.as("", http.MethodGet, "/v1/auth/config", "", &cfg); status != 200 || cfg.OIDC == nil ||
		cfg.OIDC.Issuer != iss.URL || cfg.OIDC.ClientID != "gpuplane" || cfg.LDAP {
		t.Fatalf("auth config %d %+v", status, cfg)
	}
	h.assertNoSecrets(valid, forged)
}

func b64(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }

func TestAPITokenLifecycle(t *testing.T) {
	h := startGateway(t, nil, nil)
	acmeAdmin := h.issue("acme-admin", contracts.Binding{Role: contracts.RoleTenantAdmin, Tenant: "acme"})

	// A tenant admin hands its tenant's member role to a CI token.
	var created contracts.TokenCreated
	if status, ae := h.as(acmeAdmin, http.MethodPost, "/v1/tokens",
		`{"name":"ci","bindings":[{"role":"member","tenant":"acme"}]}`, &created); status != http.StatusCreated {
		t.Fatalf("create: %d %+v", status, ae)
	}
	ci := created.Secret
	if !strings.HasPrefix(ci, "gpt_"+created.Token+"_") || len(ci) < 40 || created.Info.SHA256 != "" {
		t.Fatalf("created %+v", created)
	}
	h.eventually("the new token works", func() bool {
		status, _ := h.as(ci, http.MethodGet, "/v1/whoami", "", nil)
		return status == 200
	})
	var who contracts.WhoAmI
	h.as(ci, http.MethodGet, "/v1/whoami", "", &who)
	if who.Subject != "token:"+created.Token || who.Method != "token" || len(who.Bindings) != 1 || who.Bindings[0].Role != "member" {
		t.Fatalf("whoami %+v", who)
	}

	// Only the hash is stored.
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	kv, err := h.bus.KeyValue(ctx, contracts.BucketAPITokens)
	if err != nil {
		t.Fatal(err)
	}
	e, err := kv.Get(ctx, created.Token)
	if err != nil {
		t.Fatal(err)
	}
	var stored contracts.APIToken
	if err := json.Unmarshal(e.Value(), &stored); err != nil || len(stored.SHA256) != 64 || bytes.Contains(e.Value(), []byte(ci[len(ci)-20:])) {
		t.Fatalf("stored token %s (%v): want a SHA-256 and no secret", e.Value(), err)
	}

	// Nobody grants what it does not hold.
	for name, body := range map[string]string{
		"another tenant":   `{"name":"x","bindings":[{"role":"member","tenant":"globex"}]}`,
		"platform admin":   `{"name":"x","bindings":[{"role":"platform-admin"}]}`,
		"more than member": `{"name":"x","bindings":[{"role":"tenant-admin","tenant":"acme"}]}`,
	} {
		if status, ae := h.as(ci, http.MethodPost, "/v1/tokens", body, nil); status != 403 || ae.Reason != contracts.ReasonForbidden {
			t.Errorf("%s: %d %+v, want 403 forbidden", name, status, ae)
		}
	}

	// The owner lists it (no hashes); the CI token sees none of its own.
	var list contracts.TokenList
	h.as(acmeAdmin, http.MethodGet, "/v1/tokens", "", &list)
	if len(list.Tokens) != 1 || list.Tokens[0].ID != created.Token || list.Tokens[0].SHA256 != "" {
		t.Fatalf("owner's list %+v", list)
	}
	var all contracts.TokenList
	h.as(h.token, http.MethodGet, "/v1/tokens", "", &all)
	if len(all.Tokens) != 3 {
		t.Fatalf("platform admin lists %d tokens, want 3 (test-admin, acme-admin, ci)", len(all.Tokens))
	}

	// Someone else's token is unknown to a tenant admin; the owner revokes.
	if status, _ := h.as(acmeAdmin, http.MethodDelete, "/v1/tokens/test-admin", "", nil); status != 404 {
		t.Fatalf("revoke another's token: %d, want 404", status)
	}
	if status, ae := h.as(acmeAdmin, http.MethodDelete, "/v1/tokens/"+created.Token, "", nil); status != 200 {
		t.Fatalf("revoke: %d %+v", status, ae)
	}
	h.eventually("the revoked token is refused", func() bool {
		status, ae := h.as(ci, http.MethodGet, "/v1/whoami", "", nil)
		return status == 401 && ae.Reason == contracts.ReasonInvalidToken
	})

	// A token with a TTL expires.
	var short contracts.TokenCreated
	if status, ae := h.as(h.token, http.MethodPost, "/v1/tokens", `{"name":"short","ttl":"300ms","bindings":[{"role":"viewer","tenant":"acme"}]}`, &short); status != 201 {
		t.Fatalf("create short: %d %+v", status, ae)
	}
	h.eventually("the short token expires", func() bool {
		status, ae := h.as(short.Secret, http.MethodGet, "/v1/whoami", "", nil)
		return status == 401 && ae.Reason == contracts.ReasonTokenExpired
	})
	h.assertNoSecrets(h.token, acmeAdmin, ci, short.Secret)
}

func TestLDAPLogin(t *testing.T) {
	dir := ldaptest.Start(t)
	aliceDN := dir.AddUser(t, "alice", "correct horse battery")
	pwFile := filepath.Join(t.TempDir(), "bindpw")
	if err := os.WriteFile(pwFile, []byte(dir.BindPassword+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	h := startGateway(t, func(c *Config) {
		c.LDAPURL, c.LDAPBaseDN, c.LDAPBindDN, c.LDAPBindPasswordFile = dir.URL, ldaptest.BaseDN, ldaptest.BindDN, pwFile
	}, nil)
	if status, ae := h.as(h.token, http.MethodPost, "/v1/roles", `{"subject":"ldap:`+aliceDN+`","role":"viewer","tenant":"acme"}`, nil); status != 200 {
		t.Fatalf("bind alice: %d %+v", status, ae)
	}

	var refusals []string
	for name, body := range map[string]string{
		"wrong password":    `{"username":"alice","password":"wrong"}`,
		"unknown user":      `{"username":"bob","password":"wrong"}`,
		"empty password":    `{"username":"alice","password":""}`,
		"filter injection":  `{"username":"*","password":"correct horse battery"}`,
		"filter injection2": `{"username":"alice)(uid=*","password":"correct horse battery"}`,
	} {
		status, data := h.do(http.MethodPost, "/v1/login", body, nil, "Authorization", "-")
		var ae contracts.APIError
		_ = json.Unmarshal(data, &ae)
		if status != 401 || ae.Error.Reason != contracts.ReasonLoginFailed {
			t.Errorf("%s: %d %s, want 401 login_failed", name, status, data)
		}
		refusals = append(refusals, string(data))
	}
	for _, r := range refusals[1:] {
		if r != refusals[0] {
			t.Errorf("refusals differ, telling whether the user exists: %q vs %q", r, refusals[0])
		}
	}

	var res contracts.LoginResponse
	status, data := h.do(http.MethodPost, "/v1/login", `{"username":"alice","password":"correct horse battery"}`, &res, "Authorization", "-")
	if status != 200 || res.Subject != "ldap:"+aliceDN || !res.ExpiresAt.After(time.Now().Add(11*time.Hour)) {
		t.Fatalf("login: %d %s", status, data)
	}
	var who contracts.WhoAmI
	h.eventually("the session works", func() bool {
		status, _ := h.as(res.Token, http.MethodGet, "/v1/whoami", "", &who)
		return status == 200
	})
	if who.Subject != "ldap:"+aliceDN || who.Name != "alice" || who.Method != "ldap" || len(who.Bindings) != 1 {
		t.Fatalf("whoami %+v", who)
	}
	if status, ae := h.as(res.Token, http.MethodPost, "/v1/tenants/acme/jobs", validBody("j1"), nil); status != 403 || ae.Reason != contracts.ReasonForbidden {
		t.Fatalf("a viewer submits: %d %+v, want 403", status, ae)
	}
	h.assertNoSecrets("correct horse battery", dir.BindPassword, res.Token)
}

func TestLDAPLoginWithoutDirectory(t *testing.T) {
	h := startGateway(t, nil, nil)
	status, data := h.do(http.MethodPost, "/v1/login", `{"username":"alice","password":"pw"}`, nil, "Authorization", "-")
	if status != 404 || !strings.Contains(string(data), string(contracts.ReasonMethodDisabled)) {
		t.Fatalf("%d %s, want 404 login_method_disabled", status, data)
	}
}

// selfSigned writes a certificate for 127.0.0.1 and its key; it returns
// the two file names.
func selfSigned(t *testing.T) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "gateway"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile
}

func TestTLS13Only(t *testing.T) {
	certFile, keyFile := selfSigned(t)
	h := startGateway(t, func(c *Config) { c.TLSCert, c.TLSKey = certFile, keyFile }, nil)
	addr := strings.TrimPrefix(h.url, "https://")
	pool := x509.NewCertPool()
	pemData, _ := os.ReadFile(certFile)
	pool.AppendCertsFromPEM(pemData)

	for name, tt := range map[string]struct {
		max uint16
		ok  bool
	}{
		"TLS 1.3": {tls.VersionTLS13, true},
		"TLS 1.2": {tls.VersionTLS12, false},
		"TLS 1.1": {tls.VersionTLS11, false},
		"TLS 1.0": {tls.VersionTLS10, false},
	} {
		t.Run("go "+name, func(t *testing.T) {
			d := tls.Dialer{Config: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS10, MaxVersion: tt.max}}
			ctx, cancel := context.WithTimeout(context.Background(), waitFor)
			defer cancel()
			c, err := d.DialContext(ctx, "tcp", addr)
			if tt.ok {
				if err != nil {
					t.Fatalf("handshake: %v", err)
				}
				if v := c.(*tls.Conn).ConnectionState().Version; v != tls.VersionTLS13 {
					t.Fatalf("negotiated %x, want TLS 1.3", v)
				}
				c.Close()
				return
			}
			if err == nil {
				c.Close()
				t.Fatalf("a client offering at most %s was accepted", name)
			}
			if !strings.Contains(err.Error(), "protocol version") {
				t.Fatalf("refused with %v, want a protocol version alert", err)
			}
		})
	}
	// The authenticated API over TLS.
	if status, _ := h.do(http.MethodGet, "/v1/tenants/acme/jobs", "", nil); status != 200 {
		t.Fatalf("list over TLS: %d", status)
	}

	openssl, err := exec.LookPath("openssl")
	if err != nil {
		if os.Getenv("CI") != "" { // .ci/run installs openssl: never skip there
			t.Fatal("openssl not installed")
		}
		t.Skip("openssl not installed; the crypto/tls cases above ran")
	}
	for name, tt := range map[string]struct {
		flag string
		ok   bool
	}{"openssl -tls1_2": {"-tls1_2", false}, "openssl -tls1_1": {"-tls1_1", false}, "openssl -tls1_3": {"-tls1_3", true}} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), waitFor)
			defer cancel()
			cmd := exec.CommandContext(ctx, openssl, "s_client", tt.flag, "-connect", addr, "-CAfile", certFile, "-brief")
			cmd.Stdin = strings.NewReader("")
			out, err := cmd.CombinedOutput()
			if tt.ok {
				if err != nil || !strings.Contains(string(out), "TLSv1.3") {
					t.Fatalf("openssl %s: %v\n%s", tt.flag, err, out)
				}
				return
			}
			if err == nil || strings.Contains(string(out), "Protocol version: TLSv1.2") {
				t.Fatalf("openssl %s was not refused: %v\n%s", tt.flag, err, out)
			}
		})
	}
}

func TestPlaintextOnlyOnLoopback(t *testing.T) {
	for addr, ok := range map[string]bool{"127.0.0.1:8080": true, "[::1]:8080": true, "localhost:8080": true,
		"0.0.0.0:8080": false, ":8080": false, "10.0.0.5:8080": false} {
		c := DefaultConfig()
		c.Addr = addr
		err := c.Validate()
		if got := err == nil || !strings.Contains(err.Error(), "loopback"); got != ok {
			t.Errorf("plaintext on %s: err %v, want allowed=%v", addr, err, ok)
		}
	}
	c := DefaultConfig()
	c.Addr, c.TLSCert, c.TLSKey = "0.0.0.0:8443", "c.pem", "k.pem"
	if err := c.Validate(); err != nil && strings.Contains(err.Error(), "loopback") {
		t.Errorf("TLS on 0.0.0.0 refused: %v", err)
	}
}

// BenchmarkAuthenticate measures what authentication adds to a request on
// the hot path: an API token (SHA-256 and a map lookup) and an OIDC JWT
// (RS256 verification against the cached JWKS).
func BenchmarkAuthenticate(b *testing.B) {
	ids := newIdentities(slog.New(slog.NewTextHandler(io.Discard, nil)))
	secret, hash := newSecret("bench")
	ids.tokens["bench"] = contracts.APIToken{ID: "bench", Kind: contracts.TokenKindAPI, Subject: "token:bench", SHA256: hash}
	ids.bindings["token:bench"] = contracts.RoleBindings{Subject: "token:bench", Bindings: []contracts.Binding{{Role: RoleMember, Tenant: "acme"}}}
	ids.tokensReady.Store(true)
	ids.bindingsReady.Store(true)
	iss := oidctest.Start(b, "gpuplane")
	a := &authenticator{ids: ids, now: time.Now, oidc: newOIDCVerifier(iss.URL, "gpuplane", time.Now)}
	jwt := iss.Token(b, iss.Claims("alice"))
	for name, token := range map[string]string{"api-token": secret, "oidc-jwt": jwt} {
		b.Run(name, func(b *testing.B) {
			r, _ := http.NewRequest(http.MethodGet, "http://gw/v1/whoami", nil)
			r.Header.Set("Authorization", "Bearer "+token)
			if _, err := a.authenticate(r); err != nil { // also warms the JWKS cache
				b.Fatal(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				if _, err := a.authenticate(r); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestOIDCCacheHonoursExpiry: a verified token is remembered, but never
// past its exp.
func TestOIDCCacheHonoursExpiry(t *testing.T) {
	iss := oidctest.Start(t, "gpuplane")
	start := time.Now()
	clock := start
	o := newOIDCVerifier(iss.URL, "gpuplane", func() time.Time { return clock })
	claims := iss.Claims("alice")
	claims["exp"] = start.Add(30 * time.Second).Unix()
	tok := iss.Token(t, claims)
	ctx := context.Background()
	if p, err := o.verify(ctx, tok); err != nil || p.Subject != "oidc:"+iss.URL+"#alice" {
		t.Fatalf("fresh token: %+v %v", p, err)
	}
	clock = start.Add(10 * time.Second)
	if _, err := o.verify(ctx, tok); err != nil {
		t.Fatalf("cached token within its life: %v", err)
	}
	clock = start.Add(31 * time.Second)
	if _, err := o.verify(ctx, tok); err == nil || err.reason != contracts.ReasonTokenExpired {
		t.Fatalf("expired token: %v, want token_expired", err)
	}
}

// TestAdminTokenFile: -admin-token-file writes a platform admin's token
// when the file is missing, and that token works.
func TestAdminTokenFile(t *testing.T) {
	file := filepath.Join(t.TempDir(), "admin.token")
	h := startGateway(t, func(c *Config) { c.AdminTokenFile = file }, nil)
	st, err := os.Stat(file)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("token file: %v %v, want mode 600", st, err)
	}
	data, _ := os.ReadFile(file)
	secret := strings.TrimSpace(string(data))
	var who contracts.WhoAmI
	h.eventually("the bootstrap token works", func() bool {
		status, _ := h.as(secret, http.MethodGet, "/v1/whoami", "", &who)
		return status == 200 && len(who.Bindings) == 1
	})
	if who.Subject != "token:bootstrap-admin" || who.Bindings[0].Role != RolePlatformAdmin {
		t.Fatalf("whoami %+v", who)
	}
	h.assertNoSecrets(secret)
}

// TestSecretsNeverWritten logs in every way a test can without slapd,
// uses and refuses tokens, submits a job, and then greps everything the
// run wrote - the gateway's log, every stream and bucket on the bus, and
// every span exported over OTLP - for the secrets.
func TestSecretsNeverWritten(t *testing.T) {
	var spansMu sync.Mutex
	var spans [][]byte
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var rd io.Reader = r.Body
		if r.Header.Get("Content-Encoding") == "gzip" {
			zr, err := gzip.NewReader(r.Body)
			if err != nil {
				http.Error(w, err.Error(), 400)
				return
			}
			rd = zr
		}
		body, _ := io.ReadAll(rd)
		spansMu.Lock()
		spans = append(spans, body)
		spansMu.Unlock()
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(collector.Close)
	var secrets []string
	// Registered before the gateway starts, so it runs after the gateway
	// stopped and flushed its spans.
	t.Cleanup(func() {
		spansMu.Lock()
		defer spansMu.Unlock()
		if len(spans) == 0 {
			t.Error("no spans were exported: the span check checked nothing")
		}
		for _, s := range secrets {
			for _, body := range spans {
				if bytes.Contains(body, []byte(s)) {
					t.Errorf("a secret (%.8s...) is in an exported span", s)
				}
			}
		}
	})
	iss := oidctest.Start(t, "gpuplane")
	h := startGateway(t, func(c *Config) {
		c.Bus.OTLPEndpoint = strings.TrimPrefix(collector.URL, "http://")
		c.OIDCIssuer, c.OIDCClientID = iss.URL, "gpuplane"
	}, nil)
	member := h.issue("member", contracts.Binding{Role: RoleMember, Tenant: "acme"})
	jwt := iss.Token(t, iss.Claims("alice"))
	expired := iss.Token(t, func() map[string]any {
		c := iss.Claims("alice")
		c["exp"] = time.Now().Add(-time.Hour).Unix()
		return c
	}())
	wrongSecret := member[:len(member)-6] + "zzzzzz"
	var created contracts.TokenCreated
	if status, ae := h.as(h.token, http.MethodPost, "/v1/tokens", `{"name":"ci","bindings":[{"role":"viewer","tenant":"acme"}]}`, &created); status != 201 {
		t.Fatalf("create: %d %+v", status, ae)
	}
	secrets = []string{h.token, member, jwt, expired, wrongSecret, created.Secret, "hunter2-password"}
	for _, tok := range []string{member, jwt, expired, wrongSecret} {
		h.as(tok, http.MethodGet, "/v1/whoami", "", nil)
		h.as(tok, http.MethodPost, "/v1/tenants/acme/jobs", validBody("s1"), nil)
	}
	h.do(http.MethodPost, "/v1/login", `{"username":"alice","password":"hunter2-password"}`, nil, "Authorization", "-")
	if status, ae := h.as(member, http.MethodPost, "/v1/tenants/acme/jobs", validBody("s2"), nil); status != 202 {
		t.Fatalf("submit: %d %+v", status, ae)
	}
	h.assertNoSecrets(secrets...)
}
