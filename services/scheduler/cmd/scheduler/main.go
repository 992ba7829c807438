// Command scheduler runs gpuplane's scheduler: it validates job requests,
// queues them, places them on GPUs and publishes plans and job events.
package main

import (
	"context"
	"flag"
	"log/slog"

	"github.com/gpuplane/gpuplane/libs/gctune"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/scheduler"
)

func main() {
	// Collect less often than the runtime's default, within a soft memory
	// limit (GOGC and GOMEMLIMIT in the environment still rule).
	gctune.Tune(gctune.DefaultPercent)
	cfg := scheduler.DefaultConfig()
	cfg.RegisterFlags(flag.CommandLine)
	flag.Parse()
	service.Main("scheduler", func(ctx context.Context, log *slog.Logger) error {
		return scheduler.Run(ctx, cfg, log)
	})
}
