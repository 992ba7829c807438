package gpuplane

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/gpuplane/gpuplane/contracts"
)

// natsContext is the nats CLI's context file (natscli's natscontext): the
// URL, the creds and the inbox prefix an identity must use.
type natsContext struct {
	Description string `json:"description"`
	URL         string `json:"url"`
	Creds       string `json:"creds"`
	InboxPrefix string `json:"inbox_prefix"`
}

// NATSContexts are the nats CLI contexts WriteNATSContexts writes: the
// demo tenant's, the admin's and the operator's identity.
var NATSContexts = map[string]string{
	"gpuplane-acme":     "tenant-acme",
	"gpuplane-admin":    "admin",
	"gpuplane-operator": "operator",
}

// WriteNATSContexts writes a nats CLI context per NATSContexts entry into
// dir (the CLI's $XDG_CONFIG_HOME/nats/context), so `nats --context
// gpuplane-acme ...` (or NATS_CONTEXT=gpuplane-acme) reaches the running
// all-in-one as that identity. It returns the contexts it wrote.
func WriteNATSContexts(dir string, ep Endpoints) ([]string, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("nats contexts: %w", err)
	}
	var wrote []string
	for _, name := range []string{"gpuplane-acme", "gpuplane-admin", "gpuplane-operator"} {
		identity := NATSContexts[name]
		creds, ok := ep.Creds[identity]
		if !ok {
			continue
		}
		c := natsContext{Description: "gpuplane make run as " + identity, URL: ep.NATSURL, Creds: creds,
			InboxPrefix: contracts.Identity{Name: identity}.InboxPrefix()}
		data, err := json.MarshalIndent(c, "", "  ")
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(filepath.Join(dir, name+".json"), data, 0o600); err != nil {
			return nil, fmt.Errorf("nats contexts: %w", err)
		}
		wrote = append(wrote, name)
	}
	return wrote, nil
}
