package gpuplane

// Authentication: a TokenSource gives the bearer token of each request.
// The credentials gpuctl's login stores are read here, so that a program
// and gpuctl share one login.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Credentials are what `gpuctl login` stores, per gateway, in
// CredentialsFile: a bearer token and how it was obtained. The file is
// written with 0600 permissions in a 0700 directory: it holds secrets.
type Credentials struct {
	// Current is the gateway used when neither --gateway nor
	// GPUPLANE_GATEWAY names one: the last one logged in to.
	Current  string                `json:"current,omitempty"`
	Gateways map[string]Credential `json:"gateways"`
}

// Credential is one gateway's login.
type Credential struct {
	Token string `json:"token"`
	// Method is how the token was obtained: token, ldap or oidc.
	Method  string `json:"method"`
	Subject string `json:"subject,omitempty"`
	// Tenant is the default tenant with this gateway (make run sets it).
	Tenant    string    `json:"tenant,omitempty"`
	ExpiresAt time.Time `json:"expiresAt,omitzero"`
	// CACert is a PEM file of the CA that signed the gateway's TLS
	// certificate, when it is not a public one.
	CACert string `json:"caCert,omitempty"`
}

// ConfigDir is gpuctl's configuration directory: $GPUPLANE_CONFIG_DIR, or
// gpuplane under the user's configuration directory
// (os.UserConfigDir: ~/.config/gpuplane on Linux).
func ConfigDir(getenv func(string) string) (string, error) {
	if d := getenv("GPUPLANE_CONFIG_DIR"); d != "" {
		return d, nil
	}
	base, err := os.UserConfigDir()
	if err != nil {
		return "", fmt.Errorf("no configuration directory: %w (set GPUPLANE_CONFIG_DIR)", err)
	}
	return filepath.Join(base, "gpuplane"), nil
}

// CredentialsFile is the credentials file in dir.
func CredentialsFile(dir string) string { return filepath.Join(dir, "credentials.json") }

// NormalizeGateway is the key of a gateway in the credentials: its URL
// without a trailing slash.
func NormalizeGateway(u string) string { return strings.TrimRight(u, "/") }

// LoadCredentials reads the credentials in dir; a missing file is empty.
func LoadCredentials(dir string) (Credentials, error) {
	c := Credentials{Gateways: map[string]Credential{}}
	data, err := os.ReadFile(CredentialsFile(dir))
	if errors.Is(err, fs.ErrNotExist) {
		return c, nil
	}
	if err != nil {
		return c, fmt.Errorf("credentials: %w", err)
	}
	if err := json.Unmarshal(data, &c); err != nil {
		return c, fmt.Errorf("credentials %s: %w", CredentialsFile(dir), err)
	}
	if c.Gateways == nil {
		c.Gateways = map[string]Credential{}
	}
	return c, nil
}

// SaveCredential stores cred for gateway in dir and makes gateway the
// current one. The file is replaced atomically and is never readable by
// others, not even for a moment.
func SaveCredential(dir, gateway string, cred Credential) error {
	c, err := LoadCredentials(dir)
	if err != nil {
		return err
	}
	gateway = NormalizeGateway(gateway)
	c.Gateways[gateway], c.Current = cred, gateway
	return writeCredentials(dir, c)
}

// RemoveCredential forgets gateway's login.
func RemoveCredential(dir, gateway string) error {
	c, err := LoadCredentials(dir)
	if err != nil {
		return err
	}
	delete(c.Gateways, NormalizeGateway(gateway))
	return writeCredentials(dir, c)
}

func writeCredentials(dir string, c Credentials) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("credentials: %w", err)
	}
	// A directory made earlier (by hand, or by another tool) may be open
	// to others: it holds secrets, so it is the owner's alone.
	if err := os.Chmod(dir, 0o700); err != nil {
		return fmt.Errorf("credentials: %w", err)
	}
	data, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, ".credentials-*")
	if err != nil {
		return fmt.Errorf("credentials: %w", err)
	}
	defer os.Remove(f.Name()) // after the rename, a no-op
	if err := f.Chmod(0o600); err != nil {
		f.Close()
		return fmt.Errorf("credentials: %w", err)
	}
	if _, err := f.Write(append(data, '\n')); err != nil {
		f.Close()
		return fmt.Errorf("credentials: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("credentials: %w", err)
	}
	if err := os.Rename(f.Name(), CredentialsFile(dir)); err != nil {
		return fmt.Errorf("credentials: %w", err)
	}
	return nil
}

// TokenSource gives the bearer token of a request; "" sends none. It is
// asked before every attempt, so a source may refresh or re-read a token.
type TokenSource interface {
	Token(ctx context.Context) (string, error)
}

// StaticToken is a token that does not change: an API token (gpt_...), a
// session token from Login, an OIDC ID token.
type StaticToken string

// Token returns t.
func (t StaticToken) Token(context.Context) (string, error) { return string(t), nil }

// StoredLogin is the token gpuctl's login stored for gateway in the
// credentials under dir (ConfigDir), read at each request, so a new
// login is used at once. No stored login is an error that says how to log
// in.
func StoredLogin(dir, gateway string) TokenSource {
	return storedLogin{dir: dir, gateway: NormalizeGateway(gateway)}
}

type storedLogin struct{ dir, gateway string }

func (s storedLogin) Token(context.Context) (string, error) {
	c, err := LoadCredentials(s.dir)
	if err != nil {
		return "", err
	}
	cred, ok := c.Gateways[s.gateway]
	if !ok || cred.Token == "" {
		return "", fmt.Errorf("no login for %s in %s: log in with gpuctl login (or set GPUPLANE_TOKEN)", s.gateway, CredentialsFile(s.dir))
	}
	return cred.Token, nil
}

// DefaultTokenSource is gpuctl's choice of credentials for gateway: the
// environment's GPUPLANE_TOKEN, else the login stored under ConfigDir.
// Without either, requests go without a token (the open endpoints answer;
// the others 401).
func DefaultTokenSource(gateway string, getenv func(string) string) TokenSource {
	if getenv == nil {
		getenv = os.Getenv
	}
	if t := getenv("GPUPLANE_TOKEN"); t != "" {
		return StaticToken(t)
	}
	dir, err := ConfigDir(getenv)
	if err != nil {
		return StaticToken("")
	}
	c, err := LoadCredentials(dir)
	if err != nil {
		return StaticToken("")
	}
	return StaticToken(c.Gateways[NormalizeGateway(gateway)].Token)
}
