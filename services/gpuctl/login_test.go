package gpuctl

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/gateway"
	"github.com/gpuplane/gpuplane/services/gateway/ldaptest"
	"github.com/gpuplane/gpuplane/services/gateway/oidctest"
)

// runAsUser runs gpuctl as a user without GPUPLANE_TOKEN or GPUPLANE_TENANT:
// only what login stored in the harness's config directory.
func (h *harness) runAsUser(args ...string) (int, string, string) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*waitFor)
	defer cancel()
	var stdout, stderr syncBuffer
	env := func(k string) string {
		return map[string]string{"GPUPLANE_GATEWAY": h.gateway, "GPUPLANE_CONFIG_DIR": h.configDir}[k]
	}
	code := Run(ctx, args, &stdout, &stderr, env)
	return code, stdout.String(), stderr.String()
}

// storedLogin checks the credentials file's permissions and returns the
// gateway's stored credential.
func (h *harness) storedLogin() Credential {
	h.t.Helper()
	for path, want := range map[string]os.FileMode{h.configDir: 0o700, CredentialsFile(h.configDir): 0o600} {
		st, err := os.Stat(path)
		if err != nil {
			h.t.Fatal(err)
		}
		if got := st.Mode().Perm(); got&0o077 != 0 || (path != h.configDir && got != want) {
			h.t.Errorf("%s has mode %o, want %o", filepath.Base(path), got, want)
		}
	}
	creds, err := LoadCredentials(h.configDir)
	if err != nil {
		h.t.Fatal(err)
	}
	c, ok := creds.Gateways[h.gateway]
	if !ok || creds.Current != h.gateway {
		h.t.Fatalf("credentials %+v lack the gateway %s", creds, h.gateway)
	}
	return c
}

func TestLoginWithTokenAndUseIt(t *testing.T) {
	h := start(t)
	code, out, errOut := h.run("token", "create", "--name", "ci", "--role", "member", "--tenant", "acme", "-o", "json")
	if code != ExitOK {
		t.Fatalf("token create: %d %s", code, errOut)
	}
	var created contracts.TokenCreated
	if err := json.Unmarshal([]byte(out), &created); err != nil || !strings.HasPrefix(created.Secret, "gpt_") {
		t.Fatalf("token create printed %q: %v", out, err)
	}

	// Before login, a user has no credentials: refused.
	if code, _, errOut := h.runAsUser("list"); code != ExitError || !strings.Contains(errOut, "unauthenticated") {
		t.Fatalf("list before login: %d %s", code, errOut)
	}
	h.eventually("the new token is known", func() bool {
		code, _, _ := h.runAsUser("login", "--token", created.Secret)
		return code == ExitOK
	})
	cred := h.storedLogin()
	if cred.Token != created.Secret || cred.Method != "token" || cred.Subject != "token:"+created.Token || cred.Tenant != "acme" {
		t.Fatalf("stored %+v", cred)
	}
	code, out, errOut = h.runAsUser("whoami")
	if code != ExitOK || !strings.Contains(out, "token:"+created.Token) || !strings.Contains(out, "member of acme") {
		t.Fatalf("whoami: %d %q %s", code, out, errOut)
	}
	// The login's tenant is the default: list is acme's.
	if code, _, errOut := h.runAsUser("list"); code != ExitOK {
		t.Fatalf("list as the CI token: %d %s", code, errOut)
	}
	// A member is no admin.
	if code, _, errOut := h.runAsUser("quota", "list"); code != ExitError || !strings.Contains(errOut, "forbidden") {
		t.Fatalf("quota list as a member: %d %s, want forbidden", code, errOut)
	}

	// Revoked, the stored token stops working.
	if code, _, errOut := h.run("token", "revoke", created.Token); code != ExitOK {
		t.Fatalf("revoke: %d %s", code, errOut)
	}
	h.eventually("the revoked token is refused", func() bool {
		code, _, errOut := h.runAsUser("whoami")
		return code == ExitError && strings.Contains(errOut, "invalid_token")
	})
	if code, _, _ := h.runAsUser("logout"); code != ExitOK {
		t.Fatal("logout failed")
	}
	if creds, _ := LoadCredentials(h.configDir); len(creds.Gateways) != 0 {
		t.Fatalf("after logout: %+v", creds)
	}
}

func TestLoginLDAP(t *testing.T) {
	dir := ldaptest.Start(t)
	dn := dir.AddUser(t, "carol", "s3cret-pass")
	h := startWith(t, func(c *gateway.Config) {
		c.LDAPURL, c.LDAPBaseDN = dir.URL, ldaptest.BaseDN
		c.LDAPBindDN, c.LDAPBindPasswordFile = ldaptest.BindDN, writeFile(t, "bindpw", dir.BindPassword)
	})
	if code, _, errOut := h.run("role", "bind", "ldap:"+dn, "--role", "tenant-admin", "--tenant", "acme"); code != ExitOK {
		t.Fatalf("role bind: %d %s", code, errOut)
	}
	if code, _, errOut := h.runAsUser("login", "--user", "carol", "--password-file", writeFile(t, "pw", "wrong")); code != ExitError ||
		!strings.Contains(errOut, "login_failed") {
		t.Fatalf("wrong password: %d %s", code, errOut)
	}
	code, out, errOut := h.runAsUser("login", "--user", "carol", "--password-file", writeFile(t, "pw2", "s3cret-pass"))
	if code != ExitOK || !strings.Contains(out, "ldap:"+dn) {
		t.Fatalf("login: %d %q %s", code, out, errOut)
	}
	cred := h.storedLogin()
	if cred.Method != "ldap" || cred.ExpiresAt.IsZero() || cred.Tenant != "acme" {
		t.Fatalf("stored %+v", cred)
	}
	if code, out, errOut := h.runAsUser("role", "list"); code != ExitOK || !strings.Contains(out, "tenant-admin of acme") {
		t.Fatalf("role list as tenant admin: %d %q %s", code, out, errOut)
	}
	data, err := os.ReadFile(CredentialsFile(h.configDir))
	if err != nil || strings.Contains(string(data), "s3cret-pass") {
		t.Fatalf("the credentials file holds the password (%v)", err)
	}
}

func TestLoginOIDCDeviceFlow(t *testing.T) {
	iss := oidctest.Start(t, "gpuctl")
	h := startWith(t, func(c *gateway.Config) { c.OIDCIssuer, c.OIDCClientID = iss.URL, "gpuctl" })
	subject := "oidc:" + iss.URL + "#" + iss.DeviceSubject
	if code, _, errOut := h.run("role", "bind", subject, "--role", "viewer", "--tenant", "acme"); code != ExitOK {
		t.Fatalf("role bind: %d %s", code, errOut)
	}
	code, out, errOut := h.runAsUser("login")
	if code != ExitOK || !strings.Contains(errOut, "ABCD-EFGH") || !strings.Contains(out, subject) {
		t.Fatalf("login: %d %q %q", code, out, errOut)
	}
	cred := h.storedLogin()
	if cred.Method != "oidc" || cred.ExpiresAt.IsZero() || strings.Count(cred.Token, ".") != 2 {
		t.Fatalf("stored %+v", cred)
	}
	if code, out, errOut := h.runAsUser("whoami"); code != ExitOK || !strings.Contains(out, "viewer of acme") || !strings.Contains(out, "oidc") {
		t.Fatalf("whoami: %d %q %s", code, out, errOut)
	}
}

func TestRoleCommands(t *testing.T) {
	h := start(t)
	for _, args := range [][]string{
		{"role", "bind", "token:bob", "--role", "member", "--tenant", "acme"},
		{"role", "bind", "token:bob", "--role", "viewer", "--tenant", "globex"},
	} {
		if code, _, errOut := h.run(args...); code != ExitOK {
			t.Fatalf("%v: %d %s", args, code, errOut)
		}
	}
	code, out, _ := h.run("role", "list", "--all")
	if code != ExitOK || !strings.Contains(out, "member of acme, viewer of globex") {
		t.Fatalf("role list --all: %d %q", code, out)
	}
	if code, _, errOut := h.run("role", "unbind", "token:bob", "--role", "member", "--tenant", "acme"); code != ExitOK {
		t.Fatalf("unbind: %d %s", code, errOut)
	}
	code, out, _ = h.run("role", "list", "--tenant", "acme")
	if code != ExitOK || strings.Contains(out, "token:bob") {
		t.Fatalf("acme's bindings after unbind: %q", out)
	}
	if code, _, errOut := h.run("role", "bind", "bob", "--role", "member"); code != ExitError || !strings.Contains(errOut, "invalid subject") {
		t.Fatalf("bad subject: %d %s", code, errOut)
	}
}

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
