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

	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/gpuctl"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
)

func main() {
	// First: this program is also the supervisor of each command its node
	// agents run (a copy started in shim mode never gets past this line).
	nodeagent.MaybeRunShim()
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
		err := gpuplane.Run(ctx, cfg, log, func(ep gpuplane.Endpoints) {
			dataDir = ep.DataDir
			fmt.Print(banner(ep, cfg.GpuctlConfigDir))
			// The nats CLI reaches the bus as the demo tenant, the admin
			// or the operator with --context gpuplane-acme and so on.
			if dir, err := os.UserConfigDir(); err == nil {
				if _, err := gpuplane.WriteNATSContexts(filepath.Join(dir, "nats", "context"), ep); err != nil {
					log.Warn("nats CLI contexts not written", "err", err)
				}
			}
		})
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
  bus creds %s   (NATS authentication is on; plaintext on 127.0.0.1 only)
            operator.creds (streams), admin.creds, tenant-acme.creds, one per service
  API       every request needs a token; %s
            tokens in %s: admin.token (platform admin), demo-acme.token (member of acme)
            as the demo user: GPUPLANE_TOKEN=$(cat %s/demo-acme.token) gpuctl whoami
Try:  gpuctl submit --tenant acme --gpus 2 --model H100-80GB --duration 20s
      nats --context gpuplane-acme sub 'gp.jobs.events.acme.>'    (contexts gpuplane-acme, -admin, -operator)
Press Ctrl-C to stop.

`, ep.NATSURL, ep.DataDir, ep.GatewayURL, ep.MetricsURL, machines, gpus, strings.Join(names, ", "),
		strings.Join(scaled, ", "), ep.CredsDir, login, ep.TokensDir, ep.TokensDir)
}
