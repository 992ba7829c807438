// Command resource-manager runs gpuplane's resource manager: the single
// serialization point that commits scheduler plans to the allocation
// ledger, releases allocations and tracks node liveness.
package main

import (
	"context"
	"flag"
	"log/slog"

	"github.com/gpuplane/gpuplane/libs/gctune"
	"github.com/gpuplane/gpuplane/libs/service"
	resourcemanager "github.com/gpuplane/gpuplane/services/resource-manager"
)

func main() {
	// Collect less often than the runtime's default, within a soft memory
	// limit (GOGC and GOMEMLIMIT in the environment still rule).
	gctune.Tune(gctune.DefaultPercent)
	cfg := resourcemanager.DefaultConfig()
	cfg.RegisterFlags(flag.CommandLine)
	flag.Parse()
	service.Main(resourcemanager.ServiceName, func(ctx context.Context, log *slog.Logger) error {
		return resourcemanager.Run(ctx, cfg, log)
	})
}
