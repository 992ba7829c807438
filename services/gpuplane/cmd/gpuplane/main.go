// Command gpuplane runs the whole platform in one process on an embedded
// NATS JetStream server with a simulated GPU fleet: `make run`.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/gctune"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/gpuctl"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
)

func main() {
	// First: this program is also the supervisor of each command its node
	// agents run (a copy started in shim mode never gets past this line).
	nodeagent.MaybeRunShim()
	// One heap holds NATS, every service and every agent: collect less
	// often than the runtime's default (GOGC and GOMEMLIMIT still rule).
	gctune.Tune(gctune.DefaultPercent)
	cfg := gpuplane.DefaultConfig()
	fs := flag.NewFlagSet("gpuplane", flag.ExitOnError)
	cfg.RegisterFlags(fs)
	_ = fs.Parse(os.Args[1:])
	// Ctrl-C (SIGINT) and SIGTERM cancel ctx: Run stops the runs, the
	// services and the NATS server, removes a temporary data directory,
	// and returns nil, so the process exits 0 (service.Main); `make run`
	// runs this binary itself rather than through go run, which exits 1
	// when interrupted whatever its program does.
	service.Main("gpuplane", func(ctx context.Context, log *slog.Logger) error {
		var dataDir string
		var printed sync.WaitGroup
		err := gpuplane.Run(ctx, cfg, log, func(ep gpuplane.Endpoints) {
			dataDir = ep.DataDir
			// The nats CLI reaches the bus as the demo tenant, the admin
			// or the operator with --context gpuplane-acme and so on.
			if dir, err := os.UserConfigDir(); err == nil {
				if _, err := gpuplane.WriteNATSContexts(filepath.Join(dir, "nats", "context"), ep); err != nil {
					log.Warn("nats CLI contexts not written", "err", err)
				}
			}
			// Not in this callback: the gateway serves once it returns.
			printed.Go(func() {
				if waitForFleet(ctx, ep, fleetWait, log) {
					fmt.Print(banner(ep, cfg.GpuctlConfigDir))
				}
			})
		})
		printed.Wait()
		if err == nil && ctx.Err() != nil && dataDir != "" {
			kept := "its data is kept in " + dataDir
			if cfg.DataDir == "" {
				kept = "its temporary data directory is removed"
			}
			fmt.Printf("gpuplane stopped: runs stopped, services drained, NATS shut down; %s\n", kept)
		}
		return err
	})
}

// fleetWait bounds how long the banner waits for the fleet to register.
const fleetWait = 60 * time.Second

// waitForFleet waits until the resource manager has registered every
// machine of the static fleet (a lifecycle event on NODES), so that the
// first command typed after the banner finds the whole fleet: a job
// submitted before would land on whichever machines came first, and the
// README's tour names machines. Past within it says which are missing and
// lets the banner out anyway. False when ctx ended first.
func waitForFleet(ctx context.Context, ep gpuplane.Endpoints, within time.Duration, log *slog.Logger) bool {
	want := map[string]bool{}
	for _, m := range ep.Fleet.Machines() {
		want[m.NodeID] = true
	}
	wctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	b, err := bus.Connect(wctx, bus.Config{URL: ep.NATSURL, Name: "gpuplane-banner", CredsFile: ep.Creds["admin"], Logger: log})
	if err != nil {
		log.Warn("not waiting for the fleet to register", "err", err)
		return ctx.Err() == nil
	}
	defer b.Close(context.Background())
	registered := map[string]bool{}
	for {
		_, err := b.Replay(wctx, bus.FollowSpec{Stream: contracts.StreamNodes, FilterSubjects: []string{contracts.SubjectNodeLifecycleAll}},
			func(_ context.Context, m *bus.Msg) error {
				var ev contracts.NodeEvent
				if m.Decode(&ev) == nil && (ev.Kind == contracts.NodeRegistered || ev.Kind == contracts.NodeReturned) {
					registered[ev.NodeID] = true
				}
				return nil
			})
		missing := 0
		for id := range want {
			if !registered[id] {
				missing++
			}
		}
		if err == nil && missing == 0 {
			return true
		}
		select {
		case <-wctx.Done():
			if ctx.Err() != nil {
				return false
			}
			log.Warn("not every machine of the fleet registered in time", "within", within, "missing", missing, "err", err)
			return true
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// banner is what the binary prints once everything listens; the README
// quotes it (TestREADMEBanner keeps the two equal).
func banner(ep gpuplane.Endpoints, gpuctlDir string) string {
	login := "gpuctl login --token $(cat " + ep.TokensDir + "/admin.token)"
	if gpuctlDir != "" {
		login = "gpuctl is logged in as the local platform admin (" + gpuctl.CredentialsFile(gpuctlDir) + ")"
	}
	type pool struct {
		gpus      int
		mig, spot bool
	}
	pools := map[string]*pool{}
	machines, gpus := 0, 0
	for _, m := range ep.Fleet.Machines() {
		machines++
		gpus += m.GPUCount
		p := pools[m.Pool]
		if p == nil {
			p = &pool{}
			pools[m.Pool] = p
		}
		p.gpus += m.GPUCount
		p.mig = p.mig || m.MIGEnabled
		p.spot = p.spot || m.PriceClass == "spot"
	}
	names := make([]string, 0, len(pools))
	for name, p := range pools {
		what := fmt.Sprintf("%d GPUs", p.gpus)
		if p.spot {
			what = fmt.Sprintf("%d spot GPUs", p.gpus)
		}
		if p.mig {
			what += " in MIG mode"
		}
		names = append(names, fmt.Sprintf("%s (%s)", name, what))
	}
	sort.Strings(names)
	var scaled []string
	for _, a := range ep.Autoscale {
		scaled = append(scaled, fmt.Sprintf("%s (%s %s, %d-%d machines)", a.Name, a.MachineType, a.PriceClass, a.Min, a.Max))
	}
	if len(scaled) == 0 {
		scaled = []string{"none (-autoscale)"}
	}
	return fmt.Sprintf(`
gpuplane is up
  NATS      %s   (data in %s)
  gateway   %s   (web console at /, REST API under /v1)
  metrics   %s
  fleet     %d simulated machines, %d GPUs: %s
  autoscale %s
  images    %s   (built-in registry; %s)
  bus creds %s   (NATS authentication is on; plaintext on 127.0.0.1 only)
            operator.creds (streams), admin.creds, tenant-acme.creds, one per service
  API       every request needs a token; %s
            tokens in %s: admin.token (platform admin), demo-acme.token (member of acme)
            as the demo user: GPUPLANE_TOKEN=$(cat %s/demo-acme.token) gpuctl whoami
Try:  gpuctl submit --tenant acme --gpus 2 --model H100-80GB --duration 20s
      nats --context gpuplane-acme sub 'gp.jobs.events.acme.>'    (contexts gpuplane-acme, -admin, -operator)
Press Ctrl-C to stop.

`, ep.NATSURL, ep.DataDir, ep.GatewayURL, ep.MetricsURL, machines, gpus, strings.Join(names, ", "),
		strings.Join(scaled, ", "), imagesLine(ep), containersNote(ep), ep.CredsDir, login, ep.TokensDir, ep.TokensDir)
}

// imagesLine names the images of the built-in registry: `gpuctl submit
// --image gpuplane.localhost/busybox -- ...` runs with no internet.
func imagesLine(ep gpuplane.Endpoints) string {
	if len(ep.Images) == 0 {
		return "none"
	}
	return strings.Join(ep.Images, ", ")
}

// containersNote says whether container runs work here and, if not, why
// (host commands run either way).
func containersNote(ep gpuplane.Endpoints) string {
	if ep.ImagesNote == "" {
		return "containers run with runc as root"
	}
	return "containers run with runc, but here: " + ep.ImagesNote
}
