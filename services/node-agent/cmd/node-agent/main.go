// Command node-agent runs gpuplane's node agent for one machine: a
// simulated one (-backend sim, the default) or this machine's NVIDIA GPUs
// read through NVML (-backend nvml, which needs the NVIDIA driver).
package main

import (
	"context"
	"flag"
	"log/slog"

	"github.com/gpuplane/gpuplane/libs/gctune"
	"github.com/gpuplane/gpuplane/libs/service"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
)

func main() {
	// First: this program is also the supervisor of each command its node
	// agents run (a copy started in shim mode never gets past this line).
	nodeagent.MaybeRunShim()
	// Collect less often than the runtime's default, within a soft memory
	// limit (GOGC and GOMEMLIMIT in the environment still rule).
	gctune.Tune(gctune.DefaultPercent)
	cfg := nodeagent.DefaultConfig()
	cfg.RegisterFlags(flag.CommandLine)
	flag.Parse()
	service.Main(nodeagent.ServiceName, func(ctx context.Context, log *slog.Logger) error {
		return nodeagent.Run(ctx, cfg, log)
	})
}
