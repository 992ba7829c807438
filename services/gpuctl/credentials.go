package gpuctl

import "github.com/gpuplane/gpuplane/sdk/go/gpuplane"

// The credentials `gpuctl login` stores are the Go client's (package
// gpuplane), so that a program using the client and gpuctl share one
// login; these names keep gpuctl's API for its callers (the all-in-one
// stores the local admin's login through them).

// Credentials are the stored logins, per gateway (gpuplane.Credentials).
type Credentials = gpuplane.Credentials

// Credential is one gateway's login (gpuplane.Credential).
type Credential = gpuplane.Credential

// ConfigDir is gpuctl's configuration directory (gpuplane.ConfigDir).
func ConfigDir(getenv func(string) string) (string, error) { return gpuplane.ConfigDir(getenv) }

// CredentialsFile is the credentials file in dir.
func CredentialsFile(dir string) string { return gpuplane.CredentialsFile(dir) }

// LoadCredentials reads the credentials in dir; a missing file is empty.
func LoadCredentials(dir string) (Credentials, error) { return gpuplane.LoadCredentials(dir) }

// SaveCredential stores cred for gateway in dir and makes gateway the
// current one (gpuplane.SaveCredential).
func SaveCredential(dir, gateway string, cred Credential) error {
	return gpuplane.SaveCredential(dir, gateway, cred)
}

// RemoveCredential forgets gateway's login.
func RemoveCredential(dir, gateway string) error { return gpuplane.RemoveCredential(dir, gateway) }

func normalizeGateway(u string) string { return gpuplane.NormalizeGateway(u) }
