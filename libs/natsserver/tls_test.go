package natsserver_test

import (
	"context"
	"crypto/tls"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/tlsgen"
)

// TestTLS13Only: a server given a certificate speaks TLS 1.3 and nothing
// older; a client offering at most TLS 1.2, or no TLS, is refused.
func TestTLS13Only(t *testing.T) {
	ca, err := tlsgen.NewCA("test ca", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	pair, err := ca.Issue("nats", []string{"127.0.0.1", "localhost"}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := pair.ServerConfig()
	if err != nil {
		t.Fatal(err)
	}
	// Refused handshakes are what this test provokes.
	srv := natstest.StartWith(t, natsserver.Options{TLS: cfg, OnViolation: func(string) {}})
	creds, err := natsauth.ClientOptions(natstest.Operator(t, srv))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		opts   []nats.Option
		wantOK bool
	}{
		{"tls 1.3", []nats.Option{nats.Secure(&tls.Config{RootCAs: ca.Pool(), MinVersion: tls.VersionTLS13})}, true},
		{"tls 1.2 at most", []nats.Option{nats.Secure(&tls.Config{RootCAs: ca.Pool(), MaxVersion: tls.VersionTLS12})}, false},
		{"tls 1.1 at most", []nats.Option{nats.Secure(&tls.Config{RootCAs: ca.Pool(), MinVersion: tls.VersionTLS10, MaxVersion: tls.VersionTLS11})}, false},
		{"unknown CA", []nats.Option{nats.Secure(&tls.Config{MinVersion: tls.VersionTLS13})}, false},
		{"plaintext", nil, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			opts := append(append([]nats.Option{nats.MaxReconnects(0), nats.Timeout(3 * time.Second)}, creds...), tc.opts...)
			nc, err := nats.Connect(srv.URL(), opts...)
			if !tc.wantOK {
				if err == nil {
					nc.Close()
					t.Fatal("connected")
				}
				return
			}
			if err != nil {
				t.Fatalf("connect: %v", err)
			}
			defer nc.Close()
			st, err := nc.TLSConnectionState()
			if err != nil {
				t.Fatal(err)
			}
			if st.Version != tls.VersionTLS13 {
				t.Fatalf("TLS version %x, want 1.3", st.Version)
			}
		})
	}
	// openssl, as an outside probe would: TLS 1.3 is spoken, 1.2 and 1.1
	// are refused.
	if _, err := exec.LookPath("openssl"); err != nil {
		if os.Getenv("CI") != "" { // .ci/run installs openssl: never skip there
			t.Fatal("openssl not installed")
		}
		t.Skip("openssl not installed")
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "ca.pem"), ca.CertPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	addr := srv.Addr().String()
	for _, v := range []struct {
		flag string
		ok   bool
	}{{"-tls1_3", true}, {"-tls1_2", false}, {"-tls1_1", false}} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		cmd := exec.CommandContext(ctx, "openssl", "s_client", "-connect", addr, v.flag, "-CAfile", filepath.Join(dir, "ca.pem"), "-verify_return_error")
		cmd.Stdin = strings.NewReader("")
		out, err := cmd.CombinedOutput()
		cancel()
		spoke := err == nil && strings.Contains(string(out), "TLSv1.3")
		if spoke != v.ok {
			t.Errorf("openssl s_client %s: handshake ok=%v, want %v\n%s", v.flag, spoke, v.ok, out)
		}
	}
}
