package gateway

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/service"
)

// Config configures the gateway. DefaultConfig fills every field; Validate
// reports every problem at once.
type Config struct {
	// Bus is the NATS connection shared by every service.
	Bus service.BusConfig
	// Addr is the HTTP listen address; default 127.0.0.1:8080. Tests use
	// 127.0.0.1:0 and learn the port from OnListen.
	Addr string
	// OnListen, if set, is called with the bound address once the listener
	// is open and before requests are served. Not a flag.
	OnListen func(addr string)
	// onServer, if set, is called with the server once it is built
	// (benchmarks: BenchmarkReadModelRebuild waits for its event tail).
	onServer func(*server)
	// MaxBodyBytes bounds a request body; a larger one is answered 413
	// too_large. Default and maximum: contracts.MaxMessageBytes.
	MaxBodyBytes int64
	// Limits bound what one tenant may take from the gateway.
	Limits LimitsConfig
	// Heartbeat is the interval of the comment lines an event stream sends
	// while idle, so proxies keep it open; default 15 s.
	Heartbeat time.Duration
	// ShutdownTimeout bounds the graceful HTTP shutdown; default 10 s.
	ShutdownTimeout time.Duration
	// SSE sizes the shared tail the job event streams are served from
	// (tail.go).
	SSE SSEConfig
	// Retention says how long the read model keeps ended jobs whole, and
	// how often it snapshots itself (retire.go, readmodel_snapshot.go).
	Retention RetentionConfig
	// Usage bounds the usage read model (usage_agg.go).
	Usage UsageConfig

	// TLSCert and TLSKey (PEM files) make the gateway serve TLS 1.3 only.
	// Without them it serves plaintext, and only on a loopback address.
	TLSCert, TLSKey string
	// OIDCIssuer and OIDCClientID accept OIDC bearer tokens of that issuer
	// whose audience holds the client ID; empty: no OIDC.
	OIDCIssuer, OIDCClientID string
	// LDAPURL (ldap:// or ldaps://) enables POST /v1/login: the user is
	// searched under LDAPBaseDN with LDAPUserFilter (%s is the escaped
	// user name), as LDAPBindDN with the password in LDAPBindPasswordFile
	// (anonymously without), then bound with the given password.
	LDAPURL, LDAPBaseDN, LDAPUserFilter, LDAPBindDN, LDAPBindPasswordFile string
	// SessionTTL is how long an LDAP login's session token lasts; 12 h.
	SessionTTL time.Duration
	// AdminTokenFile bootstraps the first platform admin of an
	// installation: the API token in this file (created, 0600, when
	// missing) is a platform admin's (token ID bootstrap-admin).
	AdminTokenFile string
}

// DefaultConfig returns the defaults, the bus part read from the
// environment (see service.DefaultBusConfig).
func DefaultConfig() Config {
	return Config{
		Bus:             service.DefaultBusConfig(),
		Addr:            "127.0.0.1:8080",
		MaxBodyBytes:    contracts.MaxMessageBytes,
		Limits:          DefaultLimits(),
		Heartbeat:       15 * time.Second,
		ShutdownTimeout: 10 * time.Second,
		SSE:             DefaultSSEConfig(),
		Retention:       DefaultRetentionConfig(),
		Usage:           DefaultUsageConfig(),
		LDAPUserFilter:  "(uid=%s)",
		SessionTTL:      12 * time.Hour,
	}
}

// RegisterFlags adds the gateway's flags (and the bus flags) to fs,
// defaulting to the values in c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	c.Bus.RegisterFlags(fs)
	fs.StringVar(&c.Addr, "addr", c.Addr, "HTTP listen address")
	fs.Float64Var(&c.Limits.RequestsPerSecond, "tenant-rps", c.Limits.RequestsPerSecond, "requests per second one tenant may send (0: unlimited)")
	fs.IntVar(&c.Limits.Burst, "tenant-burst", c.Limits.Burst, "requests a quiet tenant may send at once")
	fs.IntVar(&c.Limits.StreamsPerTenant, "tenant-streams", c.Limits.StreamsPerTenant, "event and log streams one tenant may hold open (0: unlimited)")
	fs.Int64Var(&c.MaxBodyBytes, "max-body-bytes", c.MaxBodyBytes, "largest accepted request body in bytes")
	fs.DurationVar(&c.Heartbeat, "sse-heartbeat", c.Heartbeat, "interval of keep-alive comments on idle event streams")
	c.SSE.registerFlags(fs)
	c.Retention.registerFlags(fs)
	c.Usage.registerFlags(fs)
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", c.ShutdownTimeout, "how long a graceful shutdown waits for requests in flight")
	fs.StringVar(&c.TLSCert, "tls-cert", c.TLSCert, "PEM certificate (chain) for TLS 1.3; without it the gateway serves plaintext on loopback only")
	fs.StringVar(&c.TLSKey, "tls-key", c.TLSKey, "PEM private key of -tls-cert")
	fs.StringVar(&c.OIDCIssuer, "oidc-issuer", c.OIDCIssuer, "OIDC issuer URL whose bearer tokens are accepted")
	fs.StringVar(&c.OIDCClientID, "oidc-client-id", c.OIDCClientID, "OIDC client ID: the audience a token must name")
	fs.StringVar(&c.LDAPURL, "ldap-url", c.LDAPURL, "LDAP server (ldap:// or ldaps://) for POST /v1/login")
	fs.StringVar(&c.LDAPBaseDN, "ldap-base-dn", c.LDAPBaseDN, "LDAP base DN of the user search")
	fs.StringVar(&c.LDAPUserFilter, "ldap-user-filter", c.LDAPUserFilter, "LDAP filter finding a user; %s is the escaped user name")
	fs.StringVar(&c.LDAPBindDN, "ldap-bind-dn", c.LDAPBindDN, "LDAP DN the user search binds as; empty for anonymous")
	fs.StringVar(&c.LDAPBindPasswordFile, "ldap-bind-password-file", c.LDAPBindPasswordFile, "file holding the password of -ldap-bind-dn")
	fs.DurationVar(&c.SessionTTL, "session-ttl", c.SessionTTL, "lifetime of an LDAP login's session token")
	fs.StringVar(&c.AdminTokenFile, "admin-token-file", c.AdminTokenFile,
		"file holding a platform admin's API token (written, 0600, when missing): the installation's first admin")
}

// Validate reports every problem at once.
func (c Config) Validate() error {
	errs := []error{c.Bus.Validate()}
	if _, _, err := net.SplitHostPort(c.Addr); err != nil {
		errs = append(errs, fmt.Errorf("addr %q: want host:port: %w", c.Addr, err))
	}
	if c.MaxBodyBytes < 1 || c.MaxBodyBytes > contracts.MaxMessageBytes {
		errs = append(errs, fmt.Errorf("max body bytes is %d; want 1 to %d", c.MaxBodyBytes, contracts.MaxMessageBytes))
	}
	if c.Heartbeat <= 0 {
		errs = append(errs, fmt.Errorf("sse heartbeat is %s; want > 0", c.Heartbeat))
	}
	errs = append(errs, c.SSE.validate(), c.Retention.validate(), c.Usage.validate())
	if c.ShutdownTimeout <= 0 {
		errs = append(errs, fmt.Errorf("shutdown timeout is %s; want > 0", c.ShutdownTimeout))
	}
	if (c.TLSCert == "") != (c.TLSKey == "") {
		errs = append(errs, errors.New("tls: give both -tls-cert and -tls-key, or neither"))
	}
	if c.TLSCert == "" && !loopback(c.Addr) {
		errs = append(errs, fmt.Errorf("addr %q is not a loopback address: plaintext HTTP would carry tokens in the clear; give -tls-cert and -tls-key", c.Addr))
	}
	if (c.OIDCIssuer == "") != (c.OIDCClientID == "") {
		errs = append(errs, errors.New("oidc: give both -oidc-issuer and -oidc-client-id, or neither"))
	}
	if c.LDAPURL != "" {
		if c.LDAPBaseDN == "" {
			errs = append(errs, errors.New("ldap: -ldap-base-dn is empty"))
		}
		if strings.Count(c.LDAPUserFilter, "%s") != 1 {
			errs = append(errs, fmt.Errorf("ldap: user filter %q: want exactly one %%s", c.LDAPUserFilter))
		}
	}
	if c.SessionTTL <= 0 {
		errs = append(errs, fmt.Errorf("session ttl is %s; want > 0", c.SessionTTL))
	}
	return errors.Join(errs...)
}

// loopback reports whether addr's host is a loopback address or
// "localhost": the only place plaintext HTTP is allowed.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
