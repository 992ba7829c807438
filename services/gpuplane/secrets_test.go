package gpuplane_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// lockedBuffer is a log sink shared by every service of the all-in-one.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestSecretsStayOutOfLogsAndData runs the all-in-one at debug level,
// puts a job through it as the demo tenant and a refused connection with
// forged credentials, then greps everything the run wrote (every log line,
// every file of the data directory but the creds and the trust themselves,
// the run output) for each secret: the seeds of every identity and of the
// trust, and the user JWTs.
func TestSecretsStayOutOfLogsAndData(t *testing.T) {
	fl, err := fleet.Parse([]byte(`
machineTypes:
  l4x1: {gpuModel: L4, gpuCount: 1}
pools:
  - {name: l4, machineType: l4x1, count: 1}
`))
	if err != nil {
		t.Fatal(err)
	}
	data := t.TempDir()
	cfg := gpuplane.DefaultConfig()
	cfg.DataDir, cfg.NATSPort, cfg.GatewayAddr, cfg.MetricsAddr = data, -1, "127.0.0.1:0", "127.0.0.1:0"
	cfg.Fleet, cfg.Autoscale = &fl, nil
	logs := &lockedBuffer{}
	log := slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ready := make(chan gpuplane.Endpoints, 1)
	done := make(chan error, 1)
	go func() { done <- gpuplane.Run(ctx, cfg, log, func(ep gpuplane.Endpoints) { ready <- ep }) }()
	var ep gpuplane.Endpoints
	select {
	case ep = <-ready:
	case err := <-done:
		t.Fatalf("Run: %v", err)
	}

	tenant, err := bus.Connect(ctx, bus.Config{URL: ep.NATSURL, Name: "tenant-acme", CredsFile: ep.Creds["tenant-acme"], Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	req := contracts.JobRequest{ID: "secret-probe", Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "any"}},
		Run: contracts.RunSpec{Duration: contracts.Duration(200 * time.Millisecond)}}
	if _, err := tenant.Publish(ctx, contracts.SubjectSubmit("acme"), "submit/acme/secret-probe", req); err != nil {
		t.Fatal(err)
	}
	op, err := bus.Connect(ctx, bus.Config{URL: ep.NATSURL, Name: "observer", CredsFile: ep.Creds["operator"], Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer op.Close(context.Background())
	eventually(t, "the probe job succeeds", func() bool {
		var state string
		_, _ = op.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamJobEvents,
			FilterSubjects: []string{"gp.jobs.events.acme.secret-probe"}}, func(_ context.Context, m *bus.Msg) error {
			var ev struct{ State string }
			_ = json.Unmarshal(m.Data, &ev)
			state = ev.State
			return nil
		})
		return state == string(contracts.StateSucceeded)
	})
	_ = tenant.Close(ctx)
	// A forged creds file (a user key the account never signed for).
	forged := filepath.Join(t.TempDir(), "forged.creds")
	kp, _ := nkeys.CreateUser()
	pub, _ := kp.PublicKey()
	acct, _ := nkeys.CreateAccount()
	uj, _ := jwt.NewUserClaims(pub).Encode(acct)
	seed, _ := kp.Seed()
	fc, _ := jwt.FormatUserConfig(uj, seed)
	if err := os.WriteFile(forged, fc, 0o600); err != nil {
		t.Fatal(err)
	}
	bctx, bcancel := context.WithTimeout(ctx, 2*time.Second)
	if b, err := bus.Connect(bctx, bus.Config{URL: ep.NATSURL, Name: "forger", CredsFile: forged, Logger: log, ConnectTimeout: 2 * time.Second}); err == nil {
		_ = b.Close(ctx)
		t.Error("forged credentials connected")
	}
	bcancel()
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}

	// The secrets: every seed and JWT of the creds, the trust's seeds,
	// and the forged ones.
	var secrets []string
	collect := func(content []byte) {
		for _, line := range strings.Split(string(content), "\n") {
			line = strings.TrimSpace(line)
			if strings.HasPrefix(line, "S") && len(line) > 50 || strings.HasPrefix(line, "eyJ") {
				secrets = append(secrets, line)
			}
		}
	}
	for _, dir := range []string{filepath.Join(data, "creds"), filepath.Join(data, "trust")} {
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			c, err := os.ReadFile(filepath.Join(dir, e.Name()))
			if err != nil {
				t.Fatal(err)
			}
			collect(c)
		}
	}
	collect(fc)
	if len(secrets) < 20 {
		t.Fatalf("found only %d secrets to look for", len(secrets))
	}
	written := map[string]string{"log": logs.String()}
	err = filepath.WalkDir(data, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (path == filepath.Join(data, "creds") || path == filepath.Join(data, "trust")) {
			return filepath.SkipDir
		}
		if !d.IsDir() {
			c, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			written[path] = string(c)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(written["log"]) < 1000 {
		t.Fatalf("the run logged only %d bytes", len(written["log"]))
	}
	for where, text := range written {
		for _, s := range secrets {
			if strings.Contains(text, s) {
				t.Errorf("a secret (%s...) appears in %s", s[:8], where)
			}
			// A seed is also a secret in part: no 20-character piece of it.
			if len(s) > 40 && strings.HasPrefix(s, "S") && strings.Contains(text, s[10:30]) {
				t.Errorf("part of a seed (%s...) appears in %s", s[:4], where)
			}
		}
	}
	t.Logf("looked for %d secrets in %d files and %d bytes of logs", len(secrets), len(written)-1, len(written["log"]))
}
