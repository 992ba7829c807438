package e2e

import (
	"os"
	"testing"

	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
)

// TestMain lets this test binary supervise the commands that the node
// agents of the in-process stack run (nodeagent.MaybeRunShim).
func TestMain(m *testing.M) {
	nodeagent.MaybeRunShim()
	if os.Getenv(envRunAgent) == "1" {
		// A node agent of a container test, run as a process of its own.
		os.Exit(runAgentMain(os.Args[1:]))
	}
	os.Exit(m.Run())
}
