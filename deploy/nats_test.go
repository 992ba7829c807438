package deploy_test

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// readEnvFile reads a systemd EnvironmentFile (KEY=VALUE lines, # comments).
func readEnvFile(t *testing.T, path string) map[string]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	env := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			t.Fatalf("%s: %q is not KEY=VALUE", path, line)
		}
		env[k] = v
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return env
}

// writeTLS writes a CA and one certificate for 127.0.0.1, good for serving
// and for dialing (routes verify both ways), where the config expects them.
func writeTLS(t *testing.T, dir string) *x509.CertPool {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "nats"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, DNSNames: []string{"localhost"},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	for name, block := range map[string]*pem.Block{
		"ca.pem":       {Type: "CERTIFICATE", Bytes: caDER},
		"nats.pem":     {Type: "CERTIFICATE", Bytes: der},
		"nats-key.pem": {Type: "EC PRIVATE KEY", Bytes: keyDER},
	} {
		if err := os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	return pool
}

// freePorts reserves n loopback ports for the cluster listeners (each
// server's routes must name the others' before any starts).
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	var ports []int
	var ls []net.Listener
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	for _, l := range ls {
		l.Close()
	}
	return ports
}

// TestNATSClusterConfig runs deploy/nats/nats-server.conf as three
// clustered servers, each with its name and the routes from the bare-metal
// environment file (deploy/systemd/nats.env, the same variables the
// Kubernetes StatefulSet sets), moved to loopback ports and a temporary
// store. It checks what the file promises: TLS 1.3 only for clients and
// routes (routes verified both ways), JetStream encrypted at rest with
// ChaCha20-Poly1305 and synced on every write, three routes. Then an R3
// stream takes writes, and keeps taking them after one server is shut
// down: one NATS node's loss stops nothing. The operator-mode accounts
// (the include of auth.conf) are left out here; libs/natsserver's
// TestDeployConfig runs the same file with them.
func TestNATSClusterConfig(t *testing.T) {
	data, err := os.ReadFile("nats/nats-server.conf")
	if err != nil {
		t.Fatal(err)
	}
	env := readEnvFile(t, "systemd/nats.env")
	dir := t.TempDir()
	pool := writeTLS(t, filepath.Join(dir, "etc", "tls"))
	ports := freePorts(t, 3)
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	t.Setenv("GPUPLANE_JS_KEY", hex.EncodeToString(key))

	var servers []*server.Server
	for i := range 3 {
		conf := string(data)
		conf = strings.ReplaceAll(conf, "/etc/gpuplane/", filepath.Join(dir, "etc")+"/")
		conf = strings.ReplaceAll(conf, "/data/jetstream", filepath.Join(dir, fmt.Sprintf("js%d", i)))
		conf = strings.ReplaceAll(conf, "0.0.0.0:4222", "127.0.0.1:-1")
		conf = strings.ReplaceAll(conf, "0.0.0.0:8222", "127.0.0.1:-1")
		conf = strings.ReplaceAll(conf, "0.0.0.0:6222", fmt.Sprintf("127.0.0.1:%d", ports[i]))
		if !strings.Contains(conf, `include "creds/auth.conf"`) {
			t.Fatal("the config no longer includes creds/auth.conf (the operator-mode accounts)")
		}
		conf = strings.ReplaceAll(conf, `include "creds/auth.conf"`, "")
		path := filepath.Join(dir, fmt.Sprintf("nats-%d.conf", i))
		if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
			t.Fatal(err)
		}
		// The environment file's names and routes, on this test's ports.
		t.Setenv("SERVER_NAME", fmt.Sprintf("nats-%d", i))
		for j := range 3 {
			v := fmt.Sprintf("GPUPLANE_NATS_ROUTE_%d", j)
			route, ok := env[v]
			if !ok {
				t.Fatalf("systemd/nats.env lacks %s", v)
			}
			if !strings.HasPrefix(route, "nats-route://") {
				t.Fatalf("%s=%s is not a nats-route:// URL", v, route)
			}
			t.Setenv(v, fmt.Sprintf("nats-route://127.0.0.1:%d", ports[j]))
		}
		opts, err := server.ProcessConfigFile(path)
		if err != nil {
			t.Fatalf("nats-server.conf: %v", err)
		}
		checkServerOptions(t, opts)
		opts.NoLog, opts.NoSigs = true, true
		s, err := server.NewServer(opts)
		if err != nil {
			t.Fatal(err)
		}
		go s.Start()
		t.Cleanup(s.Shutdown)
		servers = append(servers, s)
	}
	for _, s := range servers {
		if !s.ReadyForConnections(20 * time.Second) {
			t.Fatalf("%s not ready", s.Name())
		}
	}
	tlsConf := &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS13}
	urls := make([]string, 0, 3)
	for _, s := range servers {
		urls = append(urls, s.ClientURL())
	}
	nc, err := nats.Connect(strings.Join(urls, ","), nats.Secure(tlsConf), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatalf("TLS 1.3 client: %v", err)
	}
	defer nc.Close()
	if nc2, err := nats.Connect(servers[0].ClientURL(), nats.Secure(&tls.Config{RootCAs: pool, MaxVersion: tls.VersionTLS12}), nats.MaxReconnects(0)); err == nil {
		nc2.Close()
		t.Error("a TLS 1.2 client connected")
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	var stream jetstream.Stream
	// The meta group elects a leader once the routes are up, and a request
	// sent before that is not answered: each try has its own bound, and
	// the tries are bounded by ctx.
	err = retry(ctx, func(ctx context.Context) (err error) {
		stream, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "DEPLOY", Subjects: []string{"deploy.>"}, Replicas: 3})
		return err
	})
	if err != nil {
		t.Fatalf("R3 stream: %v", err)
	}
	if err := retry(ctx, func(ctx context.Context) error {
		_, err := js.Publish(ctx, "deploy.a", []byte("1"), jetstream.WithMsgID("a"))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Cluster == nil || len(info.Cluster.Replicas) != 2 {
		t.Fatalf("stream cluster %+v: want a leader and two replicas", info.Cluster)
	}
	// One server goes (not the one this client talks to, to keep the test
	// about the stream, not about reconnecting): writes go on.
	for _, s := range servers {
		if s.ClientURL() != nc.ConnectedUrl() {
			s.Shutdown()
			break
		}
	}
	// A write the old leader took as it went may go unanswered: it is
	// sent again under the same ID, which the stream keeps once.
	for i := range 10 {
		if err := retry(ctx, func(ctx context.Context) error {
			_, err := js.Publish(ctx, "deploy.b", []byte{byte(i)}, jetstream.WithMsgID(fmt.Sprintf("b%d", i)))
			return err
		}); err != nil {
			t.Fatalf("write %d with one server of three down: %v", i, err)
		}
	}
	info, err = stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 11 {
		t.Fatalf("stream holds %d messages, want 11", info.State.Msgs)
	}
}

// retry calls f with a 5 s bound per try until it succeeds or ctx ends,
// 200 ms apart.
func retry(ctx context.Context, f func(context.Context) error) error {
	for {
		tctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := f(tctx)
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %w)", ctx.Err(), err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// checkServerOptions: what nats-server made of the file.
func checkServerOptions(t *testing.T, o *server.Options) {
	t.Helper()
	if o.TLSConfig == nil || o.TLSConfig.MinVersion != tls.VersionTLS13 {
		t.Error("client TLS is not 1.3 only")
	}
	if o.Cluster.TLSConfig == nil || o.Cluster.TLSConfig.MinVersion != tls.VersionTLS13 {
		t.Error("route TLS is not 1.3 only")
	} else if o.Cluster.TLSConfig.ClientAuth != tls.RequireAndVerifyClientCert {
		t.Error("routes do not verify their peers' certificates")
	}
	if !o.SyncAlways {
		t.Error("JetStream does not sync every write (sync_interval: always)")
	}
	if o.JetStreamCipher != server.ChaCha || o.JetStreamKey == "" {
		t.Error("JetStream is not encrypted at rest")
	}
	if len(o.Routes) != 3 {
		t.Errorf("%d routes, want 3", len(o.Routes))
	}
	if o.Cluster.Name == "" {
		t.Error("no cluster name")
	}
	if o.LameDuckDuration+o.LameDuckGracePeriod != lameDuck {
		t.Errorf("lame duck %v + %v, want %v (the stop timeouts of deploy/ are sized for it)", o.LameDuckDuration, o.LameDuckGracePeriod, lameDuck)
	}
}

// lameDuck is how long a stopping server takes to hand its clients over
// and exit (lame_duck_duration + lame_duck_grace_period); systemd's
// TimeoutStopSec and the pod's termination grace must exceed it.
const lameDuck = 40 * time.Second
