// Package console tests the gateway's web console (issue 15) in a real
// browser: Debian's headless Chromium, driven from Go with chromedp,
// against the all-in-one platform of `make run` (services/gpuplane: every
// service on an embedded JetStream, the simulated fleet of fleet.yaml, the
// autoscaled spot pool) started on free ports by this package's TestMain.
//
// Without a chromium binary the tests skip (and say so in
// GPUPLANE_SKIP_REPORT); GPUPLANE_REQUIRE_CHROMIUM=1, which .ci/run sets,
// makes that a failure. Screenshots of every page at 1280 px and 390 px go
// to GPUPLANE_CONSOLE_SHOTS when it names a directory. The large fleet
// (2,000 machines × 8 GPUs, 10,000 jobs) is measured by
// BenchmarkFleetPageLarge (make bench), which starts a platform of its own.
package console

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
	platform "github.com/gpuplane/gpuplane/services/gpuplane"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
	"github.com/gpuplane/gpuplane/services/scheduler"
)

const (
	// envRequire makes a missing chromium a failure instead of a skip.
	envRequire = "GPUPLANE_REQUIRE_CHROMIUM"
	// envShots names the directory the screenshots are written to.
	envShots = "GPUPLANE_CONSOLE_SHOTS"
	// envSkipReport is where make test collects the reasons of skips.
	envSkipReport = "GPUPLANE_SKIP_REPORT"
)

// waitFor bounds every wait of these tests: a page, an event, a job.
const waitFor = 60 * time.Second

// The stack and the browser the tests of the small case share, started
// by the first test that needs them (a benchmark run starts none) and
// stopped by TestMain.
var (
	sharedOnce sync.Once
	shared     *stack
	sharedErr  error
	stopShared func()
	// chromium is the browser binary; noBrowser says why there is none.
	chromium, noBrowser string
)

// stack is a running platform and a browser to look at its console.
type stack struct {
	ep      platform.Endpoints
	admin   *gpuplane.Client // the platform admin, through the REST API
	browser context.Context  // the browser; each test opens its own tab
}

func TestMain(m *testing.M) {
	// A node agent supervises each run with a copy of this binary.
	nodeagent.MaybeRunShim()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	chromium, noBrowser = findChromium()
	code := m.Run()
	if stopShared != nil {
		stopShared()
	}
	return code
}

// findChromium is the browser binary: $GPUPLANE_CHROMIUM, else Debian's;
// or why there is none.
func findChromium() (path, why string) {
	if p := os.Getenv("GPUPLANE_CHROMIUM"); p != "" {
		if _, err := exec.LookPath(p); err != nil {
			return "", fmt.Sprintf("GPUPLANE_CHROMIUM=%s: %v", p, err)
		}
		return p, ""
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p, ""
		}
	}
	return "", "no chromium on PATH (apt-get install chromium; or set GPUPLANE_CHROMIUM)"
}

// startStack runs the all-in-one platform with fl on free ports, as make
// run does (the autoscaled spot pool included, booting in a second rather
// than 15), waits until every machine is listed, and starts the browser.
func startStack(ctx context.Context, fl fleet.Fleet, autoscale bool, chromium string) (*stack, func(), error) {
	dir, err := os.MkdirTemp("", "gpuplane-console-*")
	if err != nil {
		return nil, nil, err
	}
	var auto []platform.AutoscalePool
	if autoscale {
		auto = platform.DefaultAutoscale()
		for i := range auto {
			auto[i].ProvisionDelay = time.Second
		}
	}
	cfg := platform.Config{NATSPort: -1, GatewayAddr: "127.0.0.1:0", MetricsAddr: "127.0.0.1:0", Fleet: &fl,
		DataDir: dir, Identities: natsauth.DefaultDescription(), Autoscale: auto,
		// A fault's migration and a preemption within the test's waits.
		Scheduler: func(c *scheduler.Config) { c.MinRuntime, c.PreemptGrace = time.Second, 2*time.Second },
	}
	runCtx, cancel := context.WithCancel(ctx)
	ready := make(chan platform.Endpoints, 1)
	done := make(chan error, 1)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	go func() { done <- platform.Run(runCtx, cfg, log, func(ep platform.Endpoints) { ready <- ep }) }()
	stopPlatform := func() {
		cancel()
		if err := <-done; err != nil {
			fmt.Fprintln(os.Stderr, "platform:", err)
		}
		_ = os.RemoveAll(dir)
	}
	s := &stack{}
	// 120 s: a start under the race detector on a busy 2-core machine.
	select {
	case s.ep = <-ready:
	case err := <-done:
		_ = os.RemoveAll(dir)
		return nil, nil, fmt.Errorf("platform did not start: %w", err)
	case <-time.After(120 * time.Second):
		stopPlatform()
		return nil, nil, errors.New("platform did not start within 120 s")
	}
	s.admin, err = gpuplane.New(s.ep.GatewayURL, gpuplane.WithToken(s.ep.AdminToken))
	if err != nil {
		stopPlatform()
		return nil, nil, err
	}
	// Ready when every machine of the fleet has registered with its GPUs.
	want := len(fl.Machines())
	for deadline := time.Now().Add(120 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		nodes, err := s.admin.Nodes(ctx, "")
		if err == nil && len(nodes.Nodes) >= want {
			break
		}
		if time.Now().After(deadline) {
			stopPlatform()
			return nil, nil, fmt.Errorf("%d machines not listed within 120 s: %v", want, err)
		}
	}
	browser, stopBrowser, err := startBrowser(ctx, chromium)
	if err != nil {
		stopPlatform()
		return nil, nil, err
	}
	s.browser = browser
	return s, func() { stopBrowser(); stopPlatform() }, nil
}

// startBrowser starts headless chromium; each test opens a tab of it.
func startBrowser(ctx context.Context, chromium string) (context.Context, func(), error) {
	dir, err := os.MkdirTemp("", "gpuplane-chromium-*")
	if err != nil {
		return nil, nil, err
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromium),
		chromedp.UserDataDir(dir),
		chromedp.DisableGPU,
		chromedp.WindowSize(1280, 900),
	)
	if os.Geteuid() == 0 {
		// Chromium's sandbox refuses to run as root (CI runs as root).
		opts = append(opts, chromedp.NoSandbox)
	}
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(ctx, opts...)
	browser, cancelBrowser := chromedp.NewContext(allocCtx)
	// The first run starts the browser, with no timeout of its own: it
	// lives as long as browser.
	if err := chromedp.Do(browser); err != nil {
		cancelBrowser()
		cancelAlloc()
		_ = os.RemoveAll(dir)
		return nil, nil, fmt.Errorf("start %s: %w", chromium, err)
	}
	return browser, func() {
		cancelBrowser()
		cancelAlloc()
		// Chromium's children may still write there for a moment.
		for range 50 {
			if os.RemoveAll(dir) == nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	}, nil
}

// needStack skips t where there is no browser (fails where one is
// required) and answers the shared stack of the make-run fleet.
func needStack(t *testing.T) *stack {
	t.Helper()
	if noBrowser != "" {
		skipFor(t, noBrowser)
	}
	sharedOnce.Do(func() {
		fl, err := platform.DefaultFleet()
		if err != nil {
			sharedErr = err
			return
		}
		shared, stopShared, sharedErr = startStack(context.Background(), fl, true, chromium)
	})
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	if why := shared.noConsole(); why != "" {
		t.Skip(why)
	}
	return shared
}

// noConsole says why the gateway serves no single-page console (the app
// at /ui/...), empty when it does.
func (s *stack) noConsole() string {
	res, err := http.Get(s.ep.GatewayURL + "/ui/fleet")
	if err != nil {
		return err.Error()
	}
	defer res.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	if res.StatusCode != http.StatusOK || !bytes.Contains(body, []byte(`id="app"`)) {
		return fmt.Sprintf("the gateway does not serve the console app at /ui/fleet yet (%s): services/gateway/console (issue 15) has not landed", res.Status)
	}
	return ""
}

// skipFor skips t for why (appending it to GPUPLANE_SKIP_REPORT, which
// make test prints), or fails it where chromium is required.
func skipFor(t *testing.T, why string) {
	t.Helper()
	if os.Getenv(envRequire) == "1" {
		t.Fatalf("%s=1: %s", envRequire, why)
	}
	if path := os.Getenv(envSkipReport); path != "" {
		f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err == nil {
			_, err = fmt.Fprintf(f, "SKIP e2e/console %s: %s\n", t.Name(), why)
			err = errors.Join(err, f.Close())
		}
		if err != nil {
			t.Logf("%s: %v", envSkipReport, err)
		}
	}
	t.Skip(why)
}
