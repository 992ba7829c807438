// Command node-agent runs gpuplane's node agent for one machine (a
// simulated one until the NVML backend exists).
package main

import (
	"context"
	"flag"
	"log/slog"

	"github.com/gpuplane/gpuplane/libs/service"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
)

func main() {
	cfg := nodeagent.DefaultConfig()
	cfg.RegisterFlags(flag.CommandLine)
	flag.Parse()
	service.Main(nodeagent.ServiceName, func(ctx context.Context, log *slog.Logger) error {
		return nodeagent.Run(ctx, cfg, log)
	})
}
