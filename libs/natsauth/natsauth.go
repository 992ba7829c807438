// Package natsauth issues the bus identities of gpuplane with NATS's own
// decentralized JWT machinery: one operator, one platform account that
// holds every stream, the system account, and a user JWT per identity whose
// permissions are contracts.Access of that identity. The NATS server checks
// every publish, subscribe and JetStream API call against them; nothing here
// signs messages.
//
// A Trust is the set of keys (seeds) that can mint credentials. Keep it
// where only the operator reads it (make run's data directory, a
// Kubernetes secret); services only ever get their own creds file.
package natsauth

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/gpuplane/gpuplane/contracts"
)

// AccountName is the platform account's name: every stream lives there.
const AccountName = "GPUPLANE"

// Limits bound what one identity of a role may take from the server.
// Tenants get the tightest: they are the identities the platform does not
// run itself.
type Limits struct {
	// Subs is the most subscriptions one connection may hold.
	Subs int64
	// Payload is the largest message one connection may publish.
	Payload int64
}

// TenantLimits are the limits of a tenant identity: a handful of
// subscriptions and messages no larger than a job request may be.
var TenantLimits = Limits{Subs: 64, Payload: 2 * contracts.MaxMessageBytes}

// AccountLimits bound the platform account as a whole.
type AccountLimits struct {
	// Conns is the most client connections; -1 is unlimited.
	Conns int64
}

// Trust holds the keys that sign the operator, the accounts and the users.
type Trust struct {
	operator nkeys.KeyPair
	account  nkeys.KeyPair
	system   nkeys.KeyPair
	// Limits of the platform account.
	Limits AccountLimits
}

// New creates a trust with fresh keys.
func New() (*Trust, error) {
	op, err := nkeys.CreateOperator()
	if err != nil {
		return nil, fmt.Errorf("natsauth: operator key: %w", err)
	}
	acc, err := nkeys.CreateAccount()
	if err != nil {
		return nil, fmt.Errorf("natsauth: account key: %w", err)
	}
	sys, err := nkeys.CreateAccount()
	if err != nil {
		return nil, fmt.Errorf("natsauth: system account key: %w", err)
	}
	return &Trust{operator: op, account: acc, system: sys, Limits: AccountLimits{Conns: -1}}, nil
}

var seedFiles = []string{"operator.nk", "account.nk", "system.nk"}

// LoadOrCreate reads the trust kept in dir, or creates one and keeps it
// there (seeds written 0600 in a 0700 directory), so a restarted `make
// run` keeps the credentials it printed.
func LoadOrCreate(dir string) (*Trust, error) {
	t, err := Load(dir)
	if err == nil {
		return t, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	if t, err = New(); err != nil {
		return nil, err
	}
	if err := t.Save(dir); err != nil {
		return nil, err
	}
	return t, nil
}

// Load reads a trust saved by Save.
func Load(dir string) (*Trust, error) {
	var kps []nkeys.KeyPair
	for _, f := range seedFiles {
		seed, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			return nil, fmt.Errorf("natsauth: read %s: %w", f, err)
		}
		kp, err := nkeys.FromSeed([]byte(strings.TrimSpace(string(seed))))
		if err != nil {
			return nil, fmt.Errorf("natsauth: %s is not a seed: %w", f, err)
		}
		kps = append(kps, kp)
	}
	return &Trust{operator: kps[0], account: kps[1], system: kps[2], Limits: AccountLimits{Conns: -1}}, nil
}

// Save writes the trust's seeds into dir.
func (t *Trust) Save(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("natsauth: %w", err)
	}
	for i, kp := range []nkeys.KeyPair{t.operator, t.account, t.system} {
		seed, err := kp.Seed()
		if err != nil {
			return fmt.Errorf("natsauth: seed: %w", err)
		}
		if err := writePrivate(filepath.Join(dir, seedFiles[i]), seed); err != nil {
			return err
		}
	}
	return nil
}

// OperatorJWT is the operator's self-signed JWT, which the server trusts.
func (t *Trust) OperatorJWT() (string, error) {
	pub, err := t.operator.PublicKey()
	if err != nil {
		return "", err
	}
	oc := jwt.NewOperatorClaims(pub)
	oc.Name = "gpuplane"
	sys, err := t.system.PublicKey()
	if err != nil {
		return "", err
	}
	oc.SystemAccount = sys
	return oc.Encode(t.operator)
}

// AccountPublicKey is the platform account's public key.
func (t *Trust) AccountPublicKey() string {
	pub, _ := t.account.PublicKey()
	return pub
}

// SystemAccountPublicKey is the system account's public key.
func (t *Trust) SystemAccountPublicKey() string {
	pub, _ := t.system.PublicKey()
	return pub
}

// Accounts returns the account JWTs the server resolves, by public key.
func (t *Trust) Accounts() (map[string]string, error) {
	out := map[string]string{}
	acc := jwt.NewAccountClaims(t.AccountPublicKey())
	acc.Name = AccountName
	acc.Limits.Conn = t.Limits.Conns
	acc.Limits.LeafNodeConn = 0
	acc.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1,
		MaxAckPending: -1, MemoryMaxStreamBytes: -1, DiskMaxStreamBytes: -1}
	a, err := acc.Encode(t.operator)
	if err != nil {
		return nil, fmt.Errorf("natsauth: platform account: %w", err)
	}
	out[acc.Subject] = a
	sys := jwt.NewAccountClaims(t.SystemAccountPublicKey())
	sys.Name = "SYS"
	s, err := sys.Encode(t.operator)
	if err != nil {
		return nil, fmt.Errorf("natsauth: system account: %w", err)
	}
	out[sys.Subject] = s
	return out, nil
}

// UserJWT mints the user JWT of id (a fresh user key) and returns it with
// the user's seed. expires, when not zero, ends the credentials then.
func (t *Trust) UserJWT(id contracts.Identity, expires time.Time) (userJWT string, seed []byte, err error) {
	perms, err := contracts.Access(id)
	if err != nil {
		return "", nil, err
	}
	user, err := nkeys.CreateUser()
	if err != nil {
		return "", nil, fmt.Errorf("natsauth: user key: %w", err)
	}
	upub, err := user.PublicKey()
	if err != nil {
		return "", nil, err
	}
	uc := jwt.NewUserClaims(upub)
	uc.Name = id.Name
	uc.IssuerAccount = ""
	uc.Tags.Add("role:" + string(id.Role))
	if id.Scope != "" {
		uc.Tags.Add("scope:" + id.Scope)
	}
	uc.Pub.Allow.Add(perms.Publish...)
	uc.Pub.Deny.Add(perms.DenyPublish...)
	uc.Sub.Allow.Add(perms.Subscribe...)
	if id.Role == contracts.BusTenant {
		uc.Limits.Subs = TenantLimits.Subs
		uc.Limits.Payload = TenantLimits.Payload
	}
	if !expires.IsZero() {
		uc.Expires = expires.Unix()
	}
	userJWT, err = uc.Encode(t.account)
	if err != nil {
		return "", nil, fmt.Errorf("natsauth: sign user %s: %w", id.Name, err)
	}
	seed, err = user.Seed()
	if err != nil {
		return "", nil, err
	}
	return userJWT, seed, nil
}

// Creds returns the content of a .creds file for id, as `nats --creds`
// and nats.UserCredentials read it.
func (t *Trust) Creds(id contracts.Identity) ([]byte, error) {
	j, seed, err := t.UserJWT(id, time.Time{})
	if err != nil {
		return nil, err
	}
	return jwt.FormatUserConfig(j, seed)
}

// WriteCreds writes id's creds file as dir/<name>.creds (0600) and
// returns its path.
func (t *Trust) WriteCreds(dir string, id contracts.Identity) (string, error) {
	c, err := t.Creds(id)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("natsauth: %w", err)
	}
	path := filepath.Join(dir, id.Name+".creds")
	if err := writePrivate(path, c); err != nil {
		return "", err
	}
	return path, nil
}

func writePrivate(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return fmt.Errorf("natsauth: write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("natsauth: write %s: %w", path, err)
	}
	return nil
}

// ClientOptions are the nats.Options of a client connecting with the creds
// file at path: the credentials, and the identity's own inbox prefix (the
// only reply subjects its permissions let it subscribe to).
func ClientOptions(path string) ([]nats.Option, error) {
	id, err := IdentityOf(path)
	if err != nil {
		return nil, err
	}
	return IdentityOptions(path, id), nil
}

// IdentityOptions are ClientOptions for a creds file already read as id.
func IdentityOptions(path string, id contracts.Identity) []nats.Option {
	return []nats.Option{nats.UserCredentials(path), nats.CustomInboxPrefix(id.InboxPrefix())}
}

// IdentityOf reads who a creds file speaks for: its name, role and scope
// as the JWT's tags tell.
func IdentityOf(path string) (contracts.Identity, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return contracts.Identity{}, fmt.Errorf("natsauth: read creds: %w", err)
	}
	userJWT, err := jwt.ParseDecoratedJWT(data)
	if err != nil {
		return contracts.Identity{}, fmt.Errorf("natsauth: creds %s: %w", path, err)
	}
	uc, err := jwt.DecodeUserClaims(userJWT)
	if err != nil {
		return contracts.Identity{}, fmt.Errorf("natsauth: creds %s: %w", path, err)
	}
	id := contracts.Identity{Name: uc.Name}
	for _, tag := range uc.Tags {
		if v, ok := strings.CutPrefix(tag, "role:"); ok {
			id.Role = contracts.BusRole(v)
		}
		if v, ok := strings.CutPrefix(tag, "scope:"); ok {
			id.Scope = v
		}
	}
	return id, nil
}
