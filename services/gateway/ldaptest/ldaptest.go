// Package ldaptest runs a real OpenLDAP slapd (Debian's slapd package) for
// tests, on 127.0.0.1 with its configuration and database in a temporary
// directory, and fills it with users. Without slapd installed a test is
// skipped, unless GPUPLANE_REQUIRE_SLAPD=1 (CI) makes that a failure.
package ldaptest

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-ldap/ldap/v3"

	"github.com/gpuplane/gpuplane/libs/freeport"
)

// Directory layout.
const (
	BaseDN   = "dc=example,dc=org"
	PeopleDN = "ou=people," + BaseDN
	// BindDN is a read-only service account the gateway searches as.
	BindDN = "cn=gateway," + BaseDN
)

// Server is a running slapd.
type Server struct {
	URL string
	// BindPassword is BindDN's password.
	BindPassword   string
	rootDN, rootPW string
}

// Start runs slapd until the test ends.
func Start(t testing.TB) *Server {
	t.Helper()
	slapd, err := exec.LookPath("slapd")
	if err != nil {
		for _, p := range []string{"/usr/sbin/slapd", "/usr/local/sbin/slapd"} {
			if _, serr := os.Stat(p); serr == nil {
				slapd, err = p, nil
			}
		}
	}
	if err != nil {
		if os.Getenv("GPUPLANE_REQUIRE_SLAPD") == "1" {
			t.Fatal("slapd is not installed and GPUPLANE_REQUIRE_SLAPD=1: apt-get install slapd ldap-utils")
		}
		t.Skip("slapd is not installed (apt-get install slapd ldap-utils); skipping the LDAP test")
	}
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "db"), 0o700); err != nil {
		t.Fatal(err)
	}
	s := &Server{BindPassword: "svc-" + randText(), rootDN: "cn=admin," + BaseDN, rootPW: "root-" + randText()}
	conf := fmt.Sprintf(`include /etc/ldap/schema/core.schema
include /etc/ldap/schema/cosine.schema
include /etc/ldap/schema/inetorgperson.schema
include /etc/ldap/schema/nis.schema
modulepath /usr/lib/ldap
moduleload back_mdb
pidfile %[1]s/slapd.pid
database mdb
maxsize 16777216
suffix "%[2]s"
rootdn "%[3]s"
rootpw %[4]s
directory %[1]s/db
access to attrs=userPassword by anonymous auth by * none
access to * by dn.exact="%[5]s" read by * none
`, dir, BaseDN, s.rootDN, s.rootPW, BindDN)
	confFile := filepath.Join(dir, "slapd.conf")
	if err := os.WriteFile(confFile, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	port := freeport.Port(t)
	s.URL = fmt.Sprintf("ldap://127.0.0.1:%d", port)
	var out bytes.Buffer
	ctx, cancel := context.WithCancel(context.Background())
	// -d 0: stay in the foreground, so the test owns the process.
	cmd := exec.CommandContext(ctx, slapd, "-f", confFile, "-h", s.URL+"/", "-d", "0")
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatalf("start slapd: %v", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		cancel()
		<-exited
	})
	deadline := time.Now().Add(15 * time.Second)
	for {
		c, err := ldap.DialURL(s.URL)
		if err == nil {
			c.Close()
			break
		}
		select {
		case <-exited:
			t.Fatalf("slapd exited: %s", out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("slapd did not listen on %s: %v\n%s", s.URL, err, out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	s.add(t, BaseDN, map[string][]string{"objectClass": {"dcObject", "organization"}, "dc": {"example"}, "o": {"Example"}})
	s.add(t, PeopleDN, map[string][]string{"objectClass": {"organizationalUnit"}, "ou": {"people"}})
	s.add(t, BindDN, map[string][]string{"objectClass": {"person", "simpleSecurityObject"}, "cn": {"gateway"}, "sn": {"gateway"},
		"userPassword": {s.BindPassword}})
	return s
}

// AddUser adds uid=<uid> under PeopleDN with password and returns its DN.
func (s *Server) AddUser(t testing.TB, uid, password string) string {
	t.Helper()
	dn := "uid=" + ldap.EscapeDN(uid) + "," + PeopleDN
	s.add(t, dn, map[string][]string{"objectClass": {"inetOrgPerson"}, "uid": {uid}, "cn": {uid}, "sn": {uid},
		"userPassword": {password}})
	return dn
}

func (s *Server) add(t testing.TB, dn string, attrs map[string][]string) {
	t.Helper()
	c, err := ldap.DialURL(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Bind(s.rootDN, s.rootPW); err != nil {
		t.Fatalf("bind as %s: %v", s.rootDN, err)
	}
	req := ldap.NewAddRequest(dn, nil)
	for k, v := range attrs {
		req.Attribute(k, v)
	}
	if err := c.Add(req); err != nil {
		t.Fatalf("add %s: %v", dn, err)
	}
}

func randText() string { return strings.ToLower(rand.Text()) }
