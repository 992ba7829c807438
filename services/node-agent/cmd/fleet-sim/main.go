// Command fleet-sim runs a simulated fleet: one node agent per machine of
// a fleet description, all on one bus connection.
package main

import (
	"context"
	"flag"
	"log/slog"

	"github.com/gpuplane/gpuplane/libs/gctune"
	"github.com/gpuplane/gpuplane/libs/service"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

func main() {
	// First: this program is also the supervisor of each command its node
	// agents run (a copy started in shim mode never gets past this line).
	nodeagent.MaybeRunShim()
	// Collect less often than the runtime's default, within a soft memory
	// limit (GOGC and GOMEMLIMIT in the environment still rule).
	gctune.Tune(gctune.DefaultPercent)
	// The template every machine's agent starts from; each machine then
	// gets its own identity and GPUs from the fleet description.
	agent := nodeagent.DefaultConfig()
	agent.Bus.RegisterFlags(flag.CommandLine)
	path := flag.String("fleet", "", "fleet description (YAML); empty runs the built-in default (= deploy/fleet/default.yaml)")
	flag.DurationVar(&agent.HeartbeatInterval, "heartbeat-interval", agent.HeartbeatInterval, "interval between heartbeats")
	flag.DurationVar(&agent.TelemetryInterval, "telemetry-interval", agent.TelemetryInterval, "interval between telemetry batches")
	flag.DurationVar(&agent.StopGrace, "stop-grace", agent.StopGrace, "grace between SIGTERM and SIGKILL when stopping a run")
	flag.StringVar(&agent.LogDir, "log-dir", "", "directory for run logs, one subdirectory per machine; empty means temporary directories")
	flag.StringVar(&agent.CheckpointDir, "checkpoint-dir", "", "root of the jobs' checkpoint directories, shared by every machine; empty means one per machine under its log directory")
	flag.Parse()
	service.Main("fleet-sim", func(ctx context.Context, log *slog.Logger) error {
		f := fleet.Default()
		if *path != "" {
			var err error
			if f, err = fleet.Load(*path); err != nil {
				return err
			}
		}
		if err := f.Validate(); err != nil {
			return err
		}
		rt, err := service.Start(ctx, "fleet-sim", agent.Bus, log)
		if err != nil {
			return err
		}
		defer rt.Close()
		return fleet.Run(ctx, f, rt.Bus, agent, rt.Log)
	})
}
