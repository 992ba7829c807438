package image

import (
	"crypto/sha256"
	"encoding/hex"
	"log/slog"

	"github.com/google/go-containerregistry/pkg/authn"
)

// Auth is one tenant's credentials for one registry. The zero Auth pulls
// anonymously. Auth never prints its secrets: fmt and slog show only
// which fields are set.
type Auth struct {
	Username string
	Password string
	// Token is a registry token: with a Username it is sent as the
	// password (personal access tokens), alone as a bearer token.
	Token string
}

// String hides the secrets from fmt's %v and %s.
func (a Auth) String() string {
	s := "image.Auth{"
	if a.Username != "" {
		s += "username set"
	} else {
		s += "anonymous"
	}
	if a.Password != "" {
		s += ", password set"
	}
	if a.Token != "" {
		s += ", token set"
	}
	return s + "}"
}

// GoString hides the secrets from %#v.
func (a Auth) GoString() string { return a.String() }

// LogValue hides the secrets from slog.
func (a Auth) LogValue() slog.Value { return slog.StringValue(a.String()) }

func (a Auth) anonymous() bool { return a == Auth{} }

// authenticator is what go-containerregistry sends.
func (a Auth) authenticator() authn.Authenticator {
	switch {
	case a.anonymous():
		return authn.Anonymous
	case a.Token != "" && a.Username == "":
		return authn.FromConfig(authn.AuthConfig{RegistryToken: a.Token})
	case a.Token != "" && a.Password == "":
		return authn.FromConfig(authn.AuthConfig{Username: a.Username, Password: a.Token})
	default:
		return authn.FromConfig(authn.AuthConfig{Username: a.Username, Password: a.Password})
	}
}

// anonymousGrant is the grant of a reference the registry serves to
// anyone: every Auth may use it from the cache.
const anonymousGrant = "anonymous"

// fingerprint names a set of credentials in the index without keeping
// them: a salted SHA-256, so the index file reveals no secret, and the
// salt is per cache, so the same password gives unrelated fingerprints
// on two machines.
func (a Auth) fingerprint(salt string) string {
	if a.anonymous() {
		return anonymousGrant
	}
	h := sha256.New()
	for _, s := range []string{salt, a.Username, a.Password, a.Token} {
		h.Write([]byte(s))
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}
