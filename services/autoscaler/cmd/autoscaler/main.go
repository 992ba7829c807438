// Command autoscaler decides how big each gpuplane node pool should be.
package main

import (
	"context"
	"flag"
	"log/slog"

	"github.com/gpuplane/gpuplane/libs/gctune"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/autoscaler"
)

func main() {
	// Collect less often than the runtime's default, within a soft memory
	// limit (GOGC and GOMEMLIMIT in the environment still rule).
	gctune.Tune(gctune.DefaultPercent)
	cfg := autoscaler.DefaultConfig()
	cfg.RegisterFlags(flag.CommandLine)
	flag.Parse()
	service.Main(autoscaler.Name, func(ctx context.Context, log *slog.Logger) error {
		return autoscaler.Run(ctx, cfg, log)
	})
}
