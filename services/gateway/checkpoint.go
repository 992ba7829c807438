package gateway

import (
	"context"
	"fmt"
	"net/http"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// checkpointJob asks the run of a running job to write a checkpoint: it
// publishes a checkpoint_run command for the job's allocation on
// SubjectNodeCommands(node of the placement). The command's sequence is
// the request time in nanoseconds, so every request is a new command (a
// job may checkpoint many times) while a publish retried inside the
// request stays one message. A job that is not running answers 409
// not_running: there is no process to signal. The checkpoint itself is
// reported by the agent as a checkpointed run fact.
func (s *server) checkpointJob(w http.ResponseWriter, r *http.Request) {
	tenant, id, st, ok := s.knownJob(w, r)
	if !ok {
		return
	}
	p := st.Placement
	if st.State != contracts.StateRunning || p == nil || p.AllocationID == "" || p.NodeID == "" {
		writeError(w, http.StatusConflict, contracts.ReasonNotRunning,
			fmt.Sprintf("job %s is %s; only a running job can be asked to checkpoint", id, st.State), nil)
		return
	}
	if st.Request != nil && !st.Request.Run.Checkpoint {
		writeError(w, http.StatusConflict, contracts.ReasonNotCheckpointable,
			fmt.Sprintf("job %s does not declare run.checkpoint: it would not survive SIGUSR1", id), nil)
		return
	}
	now := s.now().UTC()
	cmdID := contracts.CheckpointCommandID(p.AllocationID, int(now.UnixNano()))
	cmd := contracts.NodeCommand{SchemaVersion: contracts.SchemaVersion, Kind: contracts.CommandCheckpointRun,
		AllocationID: p.AllocationID, Tenant: tenant, JobID: id, Attempt: st.Attempt, Time: now}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	ack, err := s.bus.Publish(ctx, contracts.SubjectNodeCommands(p.NodeID), cmdID, cmd, bus.CESubject(id))
	if err != nil {
		s.log.Warn("checkpoint publish failed", "tenant", tenant, "job_id", id, "node_id", p.NodeID, "err", err)
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("publishing the checkpoint command: %v", err), nil)
		return
	}
	s.log.Info("checkpoint requested", "tenant", tenant, "job_id", id, "node_id", p.NodeID, "stream_seq", ack.Sequence)
	writeJSON(w, http.StatusAccepted, contracts.CheckpointResponse{Tenant: tenant, JobID: id, Attempt: st.Attempt,
		AllocationID: p.AllocationID, NodeID: p.NodeID, CommandID: cmdID, Stream: ack.Stream, Sequence: ack.Sequence})
}
