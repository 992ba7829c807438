package gateway

import (
	"cmp"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"github.com/go-ldap/ldap/v3"
)

// ldapAuth checks a user name and password against a directory: it finds
// the user's entry (search with the service account, or anonymously) and
// binds as that entry with the password. Sites without OIDC log in this
// way and get a short-lived session token (POST /v1/login).
type ldapAuth struct {
	url, baseDN, filter string
	bindDN, bindPW      string
	timeout             time.Duration
	tls                 *tls.Config
}

// errLoginFailed is every refused login: unknown user, wrong password, more
// than one entry. The caller says nothing more.
var errLoginFailed = errors.New("login failed")

func newLDAPAuth(cfg Config) (*ldapAuth, error) {
	a := &ldapAuth{url: cfg.LDAPURL, baseDN: cfg.LDAPBaseDN, filter: cfg.LDAPUserFilter, bindDN: cfg.LDAPBindDN,
		timeout: 10 * time.Second, tls: &tls.Config{MinVersion: tls.VersionTLS12}}
	if cfg.LDAPBindPasswordFile != "" {
		b, err := os.ReadFile(cfg.LDAPBindPasswordFile)
		if err != nil {
			return nil, fmt.Errorf("ldap bind password file: %w", err)
		}
		a.bindPW = strings.TrimRight(string(b), "\r\n")
	}
	return a, nil
}

// login returns the DN and uid of the user, or errLoginFailed, or another
// error when the directory cannot be asked (the caller answers 503).
func (a *ldapAuth) login(username, password string) (dn, name string, err error) {
	// An empty password is an unauthenticated bind, which succeeds.
	if username == "" || password == "" || len(username) > 256 || len(password) > 1024 {
		return "", "", errLoginFailed
	}
	conn, err := ldap.DialURL(a.url, ldap.DialWithDialer(&net.Dialer{Timeout: a.timeout}), ldap.DialWithTLSConfig(a.tls))
	if err != nil {
		return "", "", fmt.Errorf("ldap: dial: %w", err)
	}
	defer conn.Close()
	conn.SetTimeout(a.timeout)
	if a.bindDN != "" {
		if err := conn.Bind(a.bindDN, a.bindPW); err != nil {
			return "", "", fmt.Errorf("ldap: service bind as %s: %w", a.bindDN, err)
		}
	}
	filter := strings.ReplaceAll(a.filter, "%s", ldap.EscapeFilter(username))
	res, err := conn.Search(ldap.NewSearchRequest(a.baseDN, ldap.ScopeWholeSubtree, ldap.NeverDerefAliases, 2,
		int(a.timeout.Seconds()), false, filter, []string{"dn", "uid", "cn"}, nil))
	if err != nil {
		return "", "", fmt.Errorf("ldap: search: %w", err)
	}
	if len(res.Entries) != 1 {
		// Bind anyway (to a DN that cannot exist), so an unknown user
		// takes as long to refuse as a wrong password.
		_ = conn.Bind("cn=gpuplane-no-such-user,"+a.baseDN, password)
		return "", "", errLoginFailed
	}
	entry := res.Entries[0]
	if err := conn.Bind(entry.DN, password); err != nil {
		if ldap.IsErrorWithCode(err, ldap.LDAPResultInvalidCredentials) {
			return "", "", errLoginFailed
		}
		return "", "", fmt.Errorf("ldap: user bind: %w", err)
	}
	return entry.DN, cmp.Or(entry.GetAttributeValue("uid"), username), nil
}
