package natsserver_test

import (
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/libs/tlsgen"
)

// TestDeployConfig loads deploy/nats/nats-server.conf as production does
// (secrets mounted, key and routes from the environment), checks that it
// asks for TLS 1.3 on clients and routes, JetStream encryption at rest and
// operator-mode authentication, and that a service connects with its creds
// over TLS 1.3 while a client without creds is refused.
func TestDeployConfig(t *testing.T) {
	data, err := os.ReadFile("../../deploy/nats/nats-server.conf")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	trust, err := natsauth.New()
	if err != nil {
		t.Fatal(err)
	}
	credsDir := filepath.Join(dir, "etc", "creds")
	if _, err := trust.WriteServerConfig(credsDir); err != nil {
		t.Fatal(err)
	}
	svc, err := trust.WriteCreds(credsDir, contracts.Identity{Name: "scheduler", Role: contracts.BusScheduler})
	if err != nil {
		t.Fatal(err)
	}
	ca, err := tlsgen.NewCA("test", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	pair, err := ca.Issue("nats", []string{"127.0.0.1"}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := ca.Write(filepath.Join(dir, "etc", "tls"), "nats", pair); err != nil {
		t.Fatal(err)
	}
	conf := strings.ReplaceAll(string(data), "/etc/gpuplane/", filepath.Join(dir, "etc")+"/")
	conf = strings.ReplaceAll(conf, "/data/jetstream", filepath.Join(dir, "js"))
	conf = strings.ReplaceAll(conf, "0.0.0.0:4222", "127.0.0.1:-1")
	conf = strings.ReplaceAll(conf, "0.0.0.0:8222", "127.0.0.1:-1")
	conf = strings.ReplaceAll(conf, "0.0.0.0:6222", "127.0.0.1:-1")
	path := filepath.Join(dir, "etc", "nats-server.conf")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	t.Setenv("SERVER_NAME", "nats-0")
	t.Setenv("GPUPLANE_JS_KEY", hex.EncodeToString(key))
	for i := range 3 {
		t.Setenv("GPUPLANE_NATS_ROUTE_"+string(rune('0'+i)), "nats-route://127.0.0.1:1")
	}
	opts, err := server.ProcessConfigFile(path)
	if err != nil {
		t.Fatalf("deploy config: %v", err)
	}
	switch {
	case opts.TLSConfig == nil || opts.TLSConfig.MinVersion != tls.VersionTLS13:
		t.Error("client TLS is not 1.3 only")
	case opts.Cluster.TLSConfig == nil || opts.Cluster.TLSConfig.MinVersion != tls.VersionTLS13:
		t.Error("route TLS is not 1.3 only")
	case opts.JetStreamKey == "" || opts.JetStreamCipher != server.ChaCha:
		t.Error("JetStream is not encrypted at rest")
	case len(opts.TrustedOperators) != 1 || opts.SystemAccount != trust.SystemAccountPublicKey():
		t.Error("the server does not trust the installation's operator")
	case opts.MaxControlLine < 16*1024:
		t.Errorf("max_control_line %d is too small for service JWTs", opts.MaxControlLine)
	}
	// Started alone (its peers absent), it still authenticates clients.
	opts.Cluster.Port = 0
	opts.Routes = nil
	opts.NoLog, opts.NoSigs = true, true
	ns, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	go ns.Start()
	t.Cleanup(ns.Shutdown)
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("server not ready")
	}
	co, err := natsauth.ClientOptions(svc)
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(ns.ClientURL(), append(co, nats.Secure(&tls.Config{RootCAs: ca.Pool(), MinVersion: tls.VersionTLS13}))...)
	if err != nil {
		t.Fatalf("service connect: %v", err)
	}
	nc.Close()
	if nc, err := nats.Connect(ns.ClientURL(), nats.Secure(&tls.Config{RootCAs: ca.Pool()}), nats.MaxReconnects(0)); err == nil {
		nc.Close()
		t.Fatal("a client without creds connected")
	}
}
