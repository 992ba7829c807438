package gpuctl

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// withStdin runs f with os.Stdin reading s.
func withStdin(t *testing.T, s string, f func()) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	old := os.Stdin
	os.Stdin = r
	defer func() { os.Stdin = old; r.Close() }()
	if _, err := w.WriteString(s); err != nil {
		t.Fatal(err)
	}
	w.Close()
	f()
}

// TestRegistryLogins: a bus admin stores a tenant's registry logins, node
// agents read them, and nobody else may (the gateway and the tenant are
// refused by the bus); no output ever shows a secret.
func TestRegistryLogins(t *testing.T) {
	var mu sync.Mutex
	var refused []string
	srv := natstest.StartWith(t, natsserver.Options{OnViolation: func(msg string) {
		mu.Lock()
		defer mu.Unlock()
		refused = append(refused, msg)
	}})
	refusals := func() int { mu.Lock(); defer mu.Unlock(); return len(refused) }
	admin := natstest.Creds(t, srv, contracts.Identity{Name: "admin", Role: contracts.BusAdmin})
	tenant := natstest.Tenant(t, srv, "acme")
	gpuctl := func(creds, stdin string, args ...string) (int, string, string) {
		var out, errOut syncBuffer
		var code int
		env := func(k string) string {
			return map[string]string{"GPUPLANE_TENANT": "acme", "GPUPLANE_NATS_URL": srv.URL(), "GPUPLANE_NATS_CREDS": creds,
				"GPUPLANE_CONFIG_DIR": t.TempDir()}[k]
		}
		withStdin(t, stdin, func() {
			ctx, cancel := context.WithTimeout(context.Background(), waitFor)
			defer cancel()
			code = Run(ctx, args, &out, &errOut, env)
		})
		if s := out.String() + errOut.String(); strings.Contains(s, "hunter2") || strings.Contains(s, "s3cr3t") {
			t.Fatalf("gpuctl %v printed a secret: %s", args, s)
		}
		return code, out.String(), errOut.String()
	}
	if code, out, errOut := gpuctl(admin, "hunter2\n", "registry", "login", "ghcr.io", "--username", "deploy"); code != ExitOK ||
		!strings.Contains(out, "ghcr.io: login stored for tenant acme") {
		t.Fatalf("login: %d %q %q", code, out, errOut)
	}
	if code, _, errOut := gpuctl(admin, "s3cr3t\n", "registry", "login", "registry.example:5000", "--token"); code != ExitOK {
		t.Fatalf("token login: %d %q", code, errOut)
	}
	code, out, _ := gpuctl(admin, "", "registry", "list")
	if code != ExitOK || !strings.Contains(out, "ghcr.io") || !strings.Contains(out, "deploy") || !strings.Contains(out, "token") {
		t.Fatalf("list: %d %q", code, out)
	}

	// A node agent reads them, with its own identity.
	read := func(creds string, limit time.Duration) (contracts.RegistryCredentials, error) {
		ctx, cancel := context.WithTimeout(context.Background(), limit)
		defer cancel()
		b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "reader", CredsFile: creds, SkipProvision: true})
		if err != nil {
			return contracts.RegistryCredentials{}, err
		}
		defer b.Close(context.Background())
		kv, err := b.JetStream().KeyValue(ctx, contracts.BucketRegistryCredentials)
		if err != nil {
			return contracts.RegistryCredentials{}, err
		}
		e, err := kv.Get(ctx, "acme")
		if err != nil {
			return contracts.RegistryCredentials{}, err
		}
		var c contracts.RegistryCredentials
		return c, json.Unmarshal(e.Value(), &c)
	}
	c, err := read(natstest.Node(t, srv, "n1"), waitFor)
	if err != nil {
		t.Fatalf("a node agent cannot read the logins: %v", err)
	}
	if c.Registries["ghcr.io"].Password != "hunter2" || c.Registries["registry.example:5000"].Token != "s3cr3t" {
		t.Fatalf("stored logins %v", c)
	}

	if n := refusals(); n != 0 {
		t.Fatalf("the admin's and the node's work was refused by the bus: %v", refused)
	}

	// Nobody else reads them: not the gateway, not the tenant itself.
	for name, creds := range map[string]string{"gateway": natstest.Service(t, srv, contracts.BusGateway), "tenant": tenant,
		"scheduler": natstest.Service(t, srv, contracts.BusScheduler)} {
		// A refused request is never answered: a short wait says enough.
		if _, err := read(creds, time.Second); err == nil {
			t.Errorf("the %s read the registry logins", name)
		}
	}
	if refusals() == 0 {
		t.Fatal("the bus refused nothing to the gateway, the scheduler and the tenant")
	}

	// Refused before anything is stored.
	for _, args := range [][]string{{"registry", "login", "ghcr.io/acme", "--token"}, {"registry", "login", "ghcr.io", "--token", "--username", "u"},
		{"registry", "login", "ghcr.io"}, {"registry", "logout", "quay.io"}} {
		if code, _, _ := gpuctl(admin, "t\n", args...); code == ExitOK {
			t.Errorf("gpuctl %v succeeded", args)
		}
	}
	if code, _, errOut := gpuctl(admin, "", "registry", "login", "quay.io", "--token"); code == ExitOK || !strings.Contains(errOut, "no secret") {
		t.Errorf("an empty stdin: %d %q", code, errOut)
	}

	// Logout of both: the key is gone.
	for _, host := range []string{"ghcr.io", "registry.example:5000"} {
		if code, _, errOut := gpuctl(admin, "", "registry", "logout", host); code != ExitOK {
			t.Fatalf("logout %s: %d %q", host, code, errOut)
		}
	}
	if _, err := read(natstest.Node(t, srv, "n1"), waitFor); err == nil || !strings.Contains(err.Error(), jetstream.ErrKeyNotFound.Error()) {
		t.Fatalf("after logout the node still reads logins (err %v)", err)
	}
}
