// Package natsserver runs an embedded NATS server with JetStream, for
// `make run` and for tests. Production uses a real NATS cluster instead; the
// services only ever see a URL.
package natsserver

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsauth"
)

// Options configure the embedded server.
type Options struct {
	// Host to listen on; default 127.0.0.1. The embedded server is for one
	// machine and never listens on other interfaces by default.
	Host string
	// Port to listen on; -1 (the default when 0) picks a free port.
	Port int
	// StoreDir holds JetStream data. Empty means a new temporary directory,
	// removed by Shutdown.
	StoreDir string
	// SyncAlways makes JetStream fsync every write (production setting for
	// the log of record; slower).
	SyncAlways bool
	// MaxMemory and MaxStore bound JetStream; 0 means the server default.
	MaxMemory int64
	MaxStore  int64
	// Name of the server; default "gpuplane-embedded".
	Name string
	// HTTPPort enables the NATS monitoring endpoint when > 0 (or -1 for a random port).
	HTTPPort int
	// Trust turns authentication on: the server trusts its operator and
	// resolves the platform and system accounts from memory, so only
	// clients with credentials the trust minted get in, each with its
	// identity's permissions. Nil starts an open server, which only the
	// tests of the auth machinery itself use.
	Trust *natsauth.Trust
	// TLS, when set, makes client connections TLS 1.3 only.
	TLS *tls.Config
	// ClusterName, when set, makes the server a member of that cluster:
	// it listens for routes on Host:ClusterPort and connects to Routes.
	// Every member must share the same Trust (operator and accounts) and
	// have its own Name and StoreDir; JetStream then runs clustered and a
	// stream may have up to as many replicas as there are members.
	ClusterName string
	// ClusterPort is the route listen port; -1 (the default when 0) picks
	// a free one, which a restarted member cannot keep: a cluster whose
	// members come back names its ports.
	ClusterPort int
	// Routes are the route URLs of the members (nats-route://host:port);
	// a member may list its own, which the server ignores.
	Routes []string
	// ClusterAdvertise is the route address the member tells the others
	// to reach it at ("host:port"), instead of its listen address. A test
	// cluster whose routes pass through proxies names one nobody listens
	// on, so that no member learns a way around the proxies.
	ClusterAdvertise string
	// OnViolation, when set, is called with each permissions violation
	// and authorization failure the server reports (tests fail on the
	// ones they did not provoke: a service needing a subject its identity
	// lacks shows up here, not as a silent retry).
	OnViolation func(msg string)
}

// MaxControlLine is the server's max_control_line: deploy/ and the
// Tiltfile set the same.
const MaxControlLine = 32 * 1024

// Server is a running embedded server.
type Server struct {
	*server.Server
	tempDir string
	trust   *natsauth.Trust
	// credsDir is where Creds writes credentials.
	credsDir string
	credsMu  sync.Mutex
	creds    map[contracts.Identity]string
}

// Start starts the server and waits until it accepts connections.
func Start(ctx context.Context, o Options) (*Server, error) {
	if o.Host == "" {
		o.Host = "127.0.0.1"
	}
	if o.Port == 0 {
		o.Port = -1
	}
	if o.Name == "" {
		o.Name = "gpuplane-embedded"
	}
	s := &Server{trust: o.Trust, creds: map[contracts.Identity]string{}}
	if o.StoreDir == "" {
		dir, err := os.MkdirTemp("", "gpuplane-nats-*")
		if err != nil {
			return nil, fmt.Errorf("create jetstream dir: %w", err)
		}
		o.StoreDir, s.tempDir = dir, dir
	}
	opts := &server.Options{
		ServerName:         o.Name,
		Host:               o.Host,
		Port:               o.Port,
		JetStream:          true,
		StoreDir:           o.StoreDir,
		JetStreamMaxMemory: o.MaxMemory,
		JetStreamMaxStore:  o.MaxStore,
		NoSigs:             true,
		NoLog:              true,
		MaxPayload:         1 << 20,
		// A client's CONNECT carries its user JWT, and a service's
		// permission list makes it larger than the 4 KiB default.
		MaxControlLine: MaxControlLine,
	}
	if o.HTTPPort != 0 {
		opts.HTTPHost = o.Host
		opts.HTTPPort = o.HTTPPort
	}
	if o.SyncAlways {
		opts.SyncAlways = true
	}
	if o.ClusterName != "" {
		if err := cluster(opts, o); err != nil {
			s.cleanup()
			return nil, err
		}
	}
	if o.Trust != nil {
		if err := trust(opts, o.Trust); err != nil {
			s.cleanup()
			return nil, err
		}
	}
	if o.TLS != nil {
		c := o.TLS.Clone()
		c.MinVersion = tls.VersionTLS13
		opts.TLSConfig = c
		opts.TLS = true
		opts.TLSTimeout = 5
		// A client that starts with a TLS hello (openssl s_client, a
		// TLS-terminating probe, nats.TLSHandshakeFirst) gets TLS at once;
		// one that waits for INFO first gets it after 300 ms, as usual.
		opts.TLSHandshakeFirst = true
		opts.TLSHandshakeFirstFallback = 300 * time.Millisecond
	}
	ns, err := server.NewServer(opts)
	if err != nil {
		s.cleanup()
		return nil, fmt.Errorf("new nats server: %w", err)
	}
	if o.OnViolation != nil {
		ns.SetLoggerV2(violationLogger{report: o.OnViolation}, false, false, false)
	}
	s.Server = ns
	s.credsDir = filepath.Join(o.StoreDir, "creds")
	go ns.Start()
	deadline := 10 * time.Second
	if d, ok := ctx.Deadline(); ok {
		deadline = time.Until(d)
	}
	if !ns.ReadyForConnections(deadline) {
		ns.Shutdown()
		s.cleanup()
		return nil, errors.New("embedded nats server did not become ready")
	}
	return s, nil
}

// cluster sets opts up for membership of o.ClusterName. Routes carry no
// credentials of their own: the members listen on loopback (or a private
// network in deploy/, with TLS), and every member trusts the same
// operator, so the system account that JetStream's meta group talks over
// is the same on each.
func cluster(opts *server.Options, o Options) error {
	if o.Trust == nil {
		return errors.New("nats cluster: members need a shared Trust")
	}
	opts.Cluster.Name = o.ClusterName
	opts.Cluster.Host = o.Host
	opts.Cluster.Port = o.ClusterPort
	if opts.Cluster.Port == 0 {
		opts.Cluster.Port = -1
	}
	opts.Cluster.Advertise = o.ClusterAdvertise
	for _, r := range o.Routes {
		u, err := url.Parse(r)
		if err != nil {
			return fmt.Errorf("nats cluster: route %q: %w", r, err)
		}
		opts.Routes = append(opts.Routes, u)
	}
	return nil
}

// violationLogger passes the server's reports of refused access to report
// and drops the rest.
type violationLogger struct{ report func(string) }

func (l violationLogger) Noticef(string, ...any) {}
func (l violationLogger) Warnf(format string, v ...any) {
	l.maybe(format, v...)
}
func (l violationLogger) Fatalf(format string, v ...any) { l.report(fmt.Sprintf(format, v...)) }
func (l violationLogger) Errorf(format string, v ...any) { l.maybe(format, v...) }
func (l violationLogger) Debugf(string, ...any)          {}
func (l violationLogger) Tracef(string, ...any)          {}

func (l violationLogger) maybe(format string, v ...any) {
	msg := fmt.Sprintf(format, v...)
	if strings.Contains(msg, "Violation") || strings.Contains(msg, "Authorization") || strings.Contains(msg, "authentication") {
		l.report(msg)
	}
}

// trust sets opts up for operator mode: the operator's JWT trusted, every
// account JWT preloaded into a memory resolver, the system account named.
func trust(opts *server.Options, t *natsauth.Trust) error {
	opJWT, err := t.OperatorJWT()
	if err != nil {
		return fmt.Errorf("nats trust: %w", err)
	}
	oc, err := jwt.DecodeOperatorClaims(opJWT)
	if err != nil {
		return fmt.Errorf("nats trust: %w", err)
	}
	accounts, err := t.Accounts()
	if err != nil {
		return fmt.Errorf("nats trust: %w", err)
	}
	res := &server.MemAccResolver{}
	for pub, a := range accounts {
		if err := res.Store(pub, a); err != nil {
			return fmt.Errorf("nats trust: store account: %w", err)
		}
	}
	opts.TrustedOperators = []*jwt.OperatorClaims{oc}
	opts.AccountResolver = res
	opts.SystemAccount = t.SystemAccountPublicKey()
	return nil
}

// Trust is the trust the server was started with (nil for an open server).
func (s *Server) Trust() *natsauth.Trust { return s.trust }

// Creds returns the path of a creds file for id, minting it on first use
// (in a creds folder inside the store directory).
func (s *Server) Creds(id contracts.Identity) (string, error) {
	if s.trust == nil {
		return "", errors.New("nats server runs without authentication")
	}
	s.credsMu.Lock()
	defer s.credsMu.Unlock()
	if p, ok := s.creds[id]; ok {
		return p, nil
	}
	p, err := s.trust.WriteCreds(s.credsDir, id)
	if err != nil {
		return "", err
	}
	s.creds[id] = p
	return p, nil
}

// URL is the client URL of the server.
func (s *Server) URL() string { return s.ClientURL() }

// StoreDir is where JetStream keeps its data.
func (s *Server) StoreDir() string { return s.JetStreamConfig().StoreDir }

// Shutdown stops the server, waits for it, and removes a temporary store.
func (s *Server) Shutdown() {
	if s.Server != nil {
		s.Server.Shutdown()
		s.Server.WaitForShutdown()
	}
	s.cleanup()
}

func (s *Server) cleanup() {
	if s.tempDir != "" {
		_ = os.RemoveAll(s.tempDir)
	}
}
