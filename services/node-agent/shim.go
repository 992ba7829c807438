package nodeagent

import "github.com/gpuplane/gpuplane/services/node-agent/internal/runner"

// MaybeRunShim turns the process into the supervisor ("shim") of one run
// when the agent started it as one, and then never returns; otherwise it
// returns at once. The agent runs each command under a shim, a copy of its
// own program, so that the command outlives the agent and a restarted
// agent re-adopts it: every program that runs the agent (Run, RunWithBus,
// fleet.Run) must call it first thing in main, and test binaries that
// launch commands in TestMain. A program that does not is refused at its
// first command launch (the run fails with launch_failed).
func MaybeRunShim() { runner.MaybeRunShim() }
