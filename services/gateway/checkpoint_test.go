package gateway

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestCheckpointARunningJob(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.runJob("j1", time.Now(), checkpointable)
	alloc := contracts.AllocationID("acme", "j1", 1)
	var ids []string
	for i := range 2 { // each request is a new checkpoint command
		var res contracts.CheckpointResponse
		if status, body := h.do(http.MethodPost, "/v1/tenants/acme/jobs/j1/checkpoint", "", &res); status != http.StatusAccepted {
			t.Fatalf("POST checkpoint: %d %s", status, body)
		}
		if res.Tenant != "acme" || res.JobID != "j1" || res.Attempt != 1 || res.AllocationID != alloc || res.NodeID != "node-1" ||
			res.Stream != contracts.StreamNodeCommands || res.Sequence != uint64(i+1) ||
			!strings.HasPrefix(res.CommandID, "cmd/checkpoint_run/"+alloc+"/") {
			t.Fatalf("answer %+v", res)
		}
		ids = append(ids, res.CommandID)
	}
	msgs := h.messages(contracts.StreamNodeCommands, contracts.SubjectNodeCommandsAll)
	if len(msgs) != 2 || ids[0] == ids[1] {
		t.Fatalf("%d commands with IDs %v; want 2 distinct", len(msgs), ids)
	}
	for i, m := range msgs {
		var cmd contracts.NodeCommand
		if err := m.Decode(&cmd); err != nil {
			t.Fatal(err)
		}
		if m.Subject != contracts.SubjectNodeCommands("node-1") || m.ID() != ids[i] || cmd.Kind != contracts.CommandCheckpointRun ||
			cmd.AllocationID != alloc || cmd.Tenant != "acme" || cmd.JobID != "j1" || cmd.Attempt != 1 || cmd.Fault != nil {
			t.Fatalf("command %d on %s id %q: %+v", i, m.Subject, m.ID(), cmd)
		}
	}
}

func TestCheckpointRefusedUnlessRunning(t *testing.T) {
	h := startGateway(t, nil, nil)
	now := time.Now()
	h.publishEvent(queued("acme", "waiting", now))
	h.runJob("plain", now) // does not declare run.checkpoint
	h.runJob("done", now, checkpointable)
	h.publishEvent(contracts.JobEvent{Type: contracts.EventSucceeded, Tenant: "acme", JobID: "done", Attempt: 1, Time: now})
	h.waitState("waiting", contracts.StateQueued, 1)
	h.waitState("done", contracts.StateSucceeded, 1)
	for path, want := range map[string]struct {
		status int
		reason contracts.Reason
	}{
		"/v1/tenants/acme/jobs/waiting/checkpoint": {409, contracts.ReasonNotRunning},
		"/v1/tenants/acme/jobs/done/checkpoint":    {409, contracts.ReasonNotRunning},
		"/v1/tenants/acme/jobs/plain/checkpoint":   {409, contracts.ReasonNotCheckpointable},
		"/v1/tenants/acme/jobs/ghost/checkpoint":   {404, contracts.ReasonUnknownJob},
		"/v1/tenants/acme/jobs/a*b/checkpoint":     {400, contracts.ReasonInvalidID},
		"/v1/tenants/ACME/jobs/done/checkpoint":    {400, contracts.ReasonInvalidTenant},
	} {
		var apiErr contracts.APIError
		if status, body := h.do(http.MethodPost, path, "", &apiErr); status != want.status || apiErr.Error.Reason != want.reason || apiErr.Error.Message == "" {
			t.Errorf("POST %s: %d %s, want %d %s", path, status, body, want.status, want.reason)
		}
	}
	if status, _ := h.do(http.MethodGet, "/v1/tenants/acme/jobs/waiting/checkpoint", "", nil); status != http.StatusMethodNotAllowed {
		t.Errorf("GET checkpoint: %d, want 405", status)
	}
	if n := h.streamMsgs(contracts.StreamNodeCommands); n != 0 {
		t.Fatalf("a refused checkpoint reached the bus: NODE_COMMANDS holds %d messages", n)
	}
}

// checkpointable makes a queued event's job declare run.checkpoint.
func checkpointable(ev *contracts.JobEvent) { ev.Request.Run.Checkpoint = true }
