package gpuplane_test

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/services/gpuctl"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// TestMakeRunLogsGpuctlIn checks the two-command start: once the
// all-in-one is up, gpuctl works as the local platform admin with nothing
// but the stored login, and the demo user's token is a member of acme.
func TestMakeRunLogsGpuctlIn(t *testing.T) {
	fl, err := fleet.Parse([]byte(`
machineTypes:
  l4x1: {gpuModel: L4, gpuCount: 1}
pools:
  - {name: static, machineType: l4x1, count: 1}
`))
	if err != nil {
		t.Fatal(err)
	}
	gpuctlDir := filepath.Join(t.TempDir(), "gpuplane")
	cfg := gpuplane.Config{NATSPort: -1, GatewayAddr: "127.0.0.1:0", MetricsAddr: "127.0.0.1:0", Fleet: &fl,
		AgentLogDir: t.TempDir(), DataDir: t.TempDir(), GpuctlConfigDir: gpuctlDir,
		Identities: natsauth.DefaultDescription()}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ready := make(chan gpuplane.Endpoints, 1)
	done := make(chan error, 1)
	go func() {
		done <- gpuplane.Run(ctx, cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), func(ep gpuplane.Endpoints) { ready <- ep })
	}()
	var ep gpuplane.Endpoints
	select {
	case ep = <-ready:
	case err := <-done:
		t.Fatalf("Run returned before it was ready: %v", err)
	}
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	gpuctlRun := func(env map[string]string, args ...string) (int, string, string) {
		var out, errOut bytes.Buffer
		code := gpuctl.Run(ctx, args, &out, &errOut, func(k string) string { return env[k] })
		return code, out.String(), errOut.String()
	}
	// As a user would: only the stored login, no gateway named.
	user := map[string]string{"GPUPLANE_CONFIG_DIR": gpuctlDir}
	var out, errOut string
	var code int
	eventually(t, "gpuctl whoami as the local admin", func() bool {
		code, out, errOut = gpuctlRun(user, "whoami")
		return code == gpuctl.ExitOK
	})
	if !strings.Contains(out, "token:local-admin") || !strings.Contains(out, "platform-admin") {
		t.Fatalf("whoami: %q %s", out, errOut)
	}
	if code, _, errOut := gpuctlRun(user, "quota", "list"); code != gpuctl.ExitOK {
		t.Fatalf("an admin command: %d %s", code, errOut)
	}
	st, err := os.Stat(gpuctl.CredentialsFile(gpuctlDir))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("credentials file: %v %v, want mode 600", st, err)
	}

	data, err := os.ReadFile(filepath.Join(ep.TokensDir, "demo-acme.token"))
	if err != nil || strings.TrimSpace(string(data)) != ep.DemoToken {
		t.Fatalf("demo token file: %q %v", data, err)
	}
	demo := map[string]string{"GPUPLANE_GATEWAY": ep.GatewayURL, "GPUPLANE_TOKEN": ep.DemoToken, "GPUPLANE_TENANT": "acme"}
	code, out, errOut = gpuctlRun(demo, "whoami")
	if code != gpuctl.ExitOK || !strings.Contains(out, "member of acme") {
		t.Fatalf("demo whoami: %d %q %s", code, out, errOut)
	}
	if code, _, errOut := gpuctlRun(demo, "quota", "list"); code != gpuctl.ExitError || !strings.Contains(errOut, "forbidden") {
		t.Fatalf("the demo user lists every quota: %d %s, want forbidden", code, errOut)
	}
}
