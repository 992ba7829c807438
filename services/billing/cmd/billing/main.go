// Command billing meters gpuplane GPU time into usage records.
package main

import (
	"context"
	"flag"
	"log/slog"

	"github.com/gpuplane/gpuplane/libs/gctune"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/billing"
)

func main() {
	// Collect less often than the runtime's default, within a soft memory
	// limit (GOGC and GOMEMLIMIT in the environment still rule).
	gctune.Tune(gctune.DefaultPercent)
	cfg := billing.DefaultConfig()
	cfg.RegisterFlags(flag.CommandLine)
	flag.Parse()
	service.Main(billing.Name, func(ctx context.Context, log *slog.Logger) error {
		return billing.Run(ctx, cfg, log)
	})
}
