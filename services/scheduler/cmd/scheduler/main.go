// Command scheduler runs gpuplane's scheduler: it validates job requests,
// queues them, places them on GPUs and publishes plans and job events.
package main

import (
	"context"
	"flag"
	"log/slog"

	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/scheduler"
)

func main() {
	cfg := scheduler.DefaultConfig()
	cfg.RegisterFlags(flag.CommandLine)
	flag.Parse()
	service.Main("scheduler", func(ctx context.Context, log *slog.Logger) error {
		return scheduler.Run(ctx, cfg, log)
	})
}
