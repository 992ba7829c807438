package nodeagent_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/libs/bus"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
)

// helperAgentEnv makes the test binary run one node agent instead of the
// tests (see TestMain), so a test can SIGKILL an agent as a crash does:
// an agent in the test process could only be stopped cleanly.
const helperAgentEnv = "GPUPLANE_TEST_HELPER_AGENT"

// helperAgent is what the helper process is told to run.
type helperAgent struct {
	URL           string
	Creds         string // the node's creds file
	NodeID        string
	LogDir        string
	CheckpointDir string
	StopGrace     time.Duration
	MPSControl    string // the stand-in MPS control program, "" for none
	MPSDir        string
	MPSHostShm    bool
	Runc          string // runc of container runs, "" to look it up
	ImageDir      string // the image cache, "" for the default
}

func TestMain(m *testing.M) {
	// The agent runs commands under a copy of this binary (the shim).
	nodeagent.MaybeRunShim()
	if spec := os.Getenv(helperAgentEnv); spec != "" {
		os.Exit(runHelperAgent(spec))
	}
	os.Exit(m.Run())
}

func runHelperAgent(spec string) int {
	var h helperAgent
	if err := json.Unmarshal([]byte(spec), &h); err != nil {
		fmt.Fprintln(os.Stderr, "helper agent:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("helper", true)
	b, err := bus.Connect(ctx, bus.Config{URL: h.URL, Name: "helper-agent", CredsFile: h.Creds, SkipProvision: true})
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper agent:", err)
		return 1
	}
	defer b.Close(context.Background())
	cfg := nodeagent.Config{NodeID: h.NodeID, Pool: "test", GPUModel: "H100-80GB", GPUCount: 8, NVLink: true,
		HeartbeatInterval: tick, TelemetryInterval: tick, StopGrace: h.StopGrace, LogDir: h.LogDir, CheckpointDir: h.CheckpointDir,
		MPSControl: h.MPSControl, MPSDir: h.MPSDir, MPSHostShm: h.MPSHostShm, Runc: h.Runc, ImageDir: h.ImageDir}
	if err := nodeagent.RunWithBus(ctx, cfg, b, log); err != nil {
		fmt.Fprintln(os.Stderr, "helper agent:", err)
		return 1
	}
	return 0
}
