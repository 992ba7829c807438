// Command gateway runs gpuplane's HTTP gateway. Flags: see -h; the bus
// settings also come from GPUPLANE_NATS_URL, GPUPLANE_STREAM_REPLICAS and
// GPUPLANE_OTLP_ENDPOINT.
package main

import (
	"context"
	"flag"
	"log/slog"

	"github.com/gpuplane/gpuplane/libs/gctune"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/gateway"
)

func main() {
	// Collect less often than the runtime's default, within a soft memory
	// limit (GOGC and GOMEMLIMIT in the environment still rule).
	gctune.Tune(gctune.DefaultPercent)
	cfg := gateway.DefaultConfig()
	cfg.RegisterFlags(flag.CommandLine)
	flag.Parse()
	service.Main(gateway.Name, func(ctx context.Context, log *slog.Logger) error {
		return gateway.Run(ctx, cfg, log)
	})
}
