package gpuctl

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// registryCmd stores a tenant's registry logins, which node agents use to
// pull its private images: `registry login HOST`, `registry logout HOST`,
// `registry list`. The logins are secrets in
// contracts.BucketRegistryCredentials, which only a platform administrator
// on the bus writes (the gateway cannot even read them), so the command
// works on the bus with --creds of a BusAdmin identity. A password or token
// is read from stdin, never from a flag (it would stay in the shell's
// history), and never printed.
func (a *app) registryCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var user string
	var token bool
	fs.StringVar(&user, "username", "", "login: the user name; its password is read from stdin")
	fs.BoolVar(&token, "token", false, "login: read a bearer token from stdin instead of a user name and password")
	return func(ctx context.Context, pos, _ []string) int {
		usage := "want login HOST (--username U | --token), logout HOST or list"
		if len(pos) == 0 {
			return a.usageErr("registry", "%s", usage)
		}
		verb, args := pos[0], pos[1:]
		switch {
		case verb == "list" && len(args) == 0:
		case (verb == "login" || verb == "logout") && len(args) == 1:
		default:
			return a.usageErr("registry", "%s", usage)
		}
		if verb == "login" && (user == "") == !token {
			return a.usageErr("registry", "login takes --username U (password on stdin) or --token (token on stdin)")
		}
		cctx, cancel := context.WithTimeout(ctx, busTimeout)
		defer cancel()
		b, err := a.connectBus(cctx)
		if err != nil {
			return a.fail("registry", err)
		}
		defer closeBus(b)
		kv, err := registryBucket(cctx, b.JetStream())
		if err != nil {
			return a.fail("registry", err)
		}
		creds, rev, err := readCredentials(cctx, kv, a.tenant)
		if err != nil {
			return a.fail("registry", err)
		}
		if verb == "list" {
			return a.listRegistries(creds)
		}
		host := args[0]
		switch verb {
		case "login":
			secret, err := readSecret(a.stdin)
			if err == nil && secret == "" {
				err = errors.New("no secret on stdin")
			}
			if err != nil {
				return a.fail("registry", fmt.Errorf("read the secret from stdin: %w", err))
			}
			auth := contracts.RegistryAuth{Token: secret}
			if !token {
				auth = contracts.RegistryAuth{Username: user, Password: secret}
			}
			if creds.Registries == nil {
				creds.Registries = map[string]contracts.RegistryAuth{}
			}
			creds.Registries[host] = auth
		case "logout":
			if _, ok := creds.Registries[host]; !ok {
				return a.fail("registry", fmt.Errorf("tenant %s has no login for %s", a.tenant, host))
			}
			delete(creds.Registries, host)
		}
		creds.SchemaVersion, creds.Tenant, creds.UpdatedAt = contracts.SchemaVersion, a.tenant, time.Now().UTC()
		if err := creds.Validate(a.tenant); err != nil {
			return a.fail("registry", localError(err))
		}
		if err := writeCredentials(cctx, kv, creds, rev); err != nil {
			return a.fail("registry", err)
		}
		fmt.Fprintf(a.stdout, "%s: %s for tenant %s\n", host, map[string]string{"login": "login stored", "logout": "login removed"}[verb], a.tenant)
		return ExitOK
	}
}

// registryBucket opens the credentials bucket, creating it as contracts
// configures it when no agent has yet.
func registryBucket(ctx context.Context, js jetstream.JetStream) (jetstream.KeyValue, error) {
	kv, err := js.KeyValue(ctx, contracts.BucketRegistryCredentials)
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return kv, err
	}
	for _, c := range contracts.KeyValues(contracts.StreamOptions{}) {
		if c.Bucket == contracts.BucketRegistryCredentials {
			return js.CreateKeyValue(ctx, c)
		}
	}
	return nil, fmt.Errorf("contracts configure no bucket %s", contracts.BucketRegistryCredentials)
}

// readCredentials returns tenant's logins and their revision (0: none
// stored).
func readCredentials(ctx context.Context, kv jetstream.KeyValue, tenant string) (contracts.RegistryCredentials, uint64, error) {
	e, err := kv.Get(ctx, tenant)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		return contracts.RegistryCredentials{}, 0, nil
	case err != nil:
		return contracts.RegistryCredentials{}, 0, fmt.Errorf("read the logins of %s: %w", tenant, err)
	}
	var c contracts.RegistryCredentials
	if err := json.Unmarshal(e.Value(), &c); err != nil {
		return c, 0, fmt.Errorf("the stored logins of %s do not decode: %w", tenant, err)
	}
	return c, e.Revision(), nil
}

// writeCredentials stores c if the logins are still at revision rev (a
// concurrent edit makes it fail rather than be lost); no login left
// deletes the key.
func writeCredentials(ctx context.Context, kv jetstream.KeyValue, c contracts.RegistryCredentials, rev uint64) error {
	var err error
	switch {
	case len(c.Registries) == 0:
		err = kv.Delete(ctx, c.Tenant, jetstream.LastRevision(rev))
	case rev == 0:
		var data []byte
		if data, err = json.Marshal(c); err == nil {
			_, err = kv.Create(ctx, c.Tenant, data)
		}
	default:
		var data []byte
		if data, err = json.Marshal(c); err == nil {
			_, err = kv.Update(ctx, c.Tenant, data, rev)
		}
	}
	if err != nil {
		return fmt.Errorf("store the logins of %s (changed meanwhile? run it again): %w", c.Tenant, err)
	}
	return nil
}

// listRegistries prints the registries and user names, never a secret.
func (a *app) listRegistries(c contracts.RegistryCredentials) int {
	type row struct {
		Registry string `json:"registry"`
		Username string `json:"username,omitempty"`
		Kind     string `json:"kind"`
	}
	rows := []row{}
	for _, host := range slices.Sorted(maps.Keys(c.Registries)) {
		auth := c.Registries[host]
		kind := "password"
		if auth.Token != "" {
			kind = "token"
		}
		rows = append(rows, row{host, auth.Username, kind})
	}
	if a.output == "json" {
		return a.printJSON(rows)
	}
	if len(rows) == 0 {
		fmt.Fprintf(a.stdout, "tenant %s has no registry logins\n", a.tenant)
		return ExitOK
	}
	fmt.Fprintf(a.stdout, "%-32s %-20s %s\n", "REGISTRY", "USERNAME", "KIND")
	for _, r := range rows {
		fmt.Fprintf(a.stdout, "%-32s %-20s %s\n", r.Registry, r.Username, r.Kind)
	}
	return ExitOK
}
