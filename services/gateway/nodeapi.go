package gateway

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// maxFaultBody bounds a fault request's body.
const maxFaultBody = 4 << 10

// admin is the one place an operator-only route is authorised. The
// gateway has no authentication yet (see tenantOf): every caller passes.
// When tokens arrive, this refuses callers without the admin role with
// 403, and every route that calls it is covered.
func admin(http.ResponseWriter, *http.Request) bool { return true }

// nodeID answers 400 invalid_id and returns false for a bad node ID in the path.
func nodeID(w http.ResponseWriter, r *http.Request) (string, bool) {
	id := r.PathValue("node")
	if err := contracts.ValidateID(id); err != nil {
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidID, err.Error(),
			[]contracts.FieldError{{Field: "node", Reason: contracts.ReasonInvalidID, Message: err.Error()}})
		return "", false
	}
	return id, true
}

// knownNode answers 404 unknown_node and returns false for a node no agent
// has published an inventory of, or whose machine the autoscaler deleted
// or its provider reclaimed since (the message says which).
func (s *server) knownNode(w http.ResponseWriter, id string) (contracts.NodeStatus, bool) {
	st, ok := s.nodes.node(id)
	switch gone, removed := s.nodes.gone(id); {
	case ok:
	case removed:
		// Not a lost node: its machine left the fleet on purpose.
		by := "deleted by the autoscaler"
		if gone.Kind == contracts.MachineReclaimed {
			by = "reclaimed by its provider"
		}
		writeError(w, http.StatusNotFound, contracts.ReasonUnknownNode,
			fmt.Sprintf("no node %s: its machine %s was %s at %s (%s)", id, gone.MachineID, by,
				gone.Time.UTC().Format(time.RFC3339), gone.Message), nil)
	default:
		writeError(w, http.StatusNotFound, contracts.ReasonUnknownNode,
			fmt.Sprintf("no node %s (a node appears once its agent has published an inventory)", id), nil)
	}
	return st, ok
}

// listNodes answers every node, ordered by ID; ?pool= keeps one pool.
func (s *server) listNodes(w http.ResponseWriter, r *http.Request) {
	pool := r.URL.Query().Get("pool")
	if pool != "" {
		if err := contracts.ValidatePool(pool); err != nil {
			writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, err.Error(),
				[]contracts.FieldError{{Field: "pool", Reason: contracts.ReasonInvalidValue, Message: err.Error()}})
			return
		}
	}
	if !s.nodeModelReady(w) {
		return
	}
	writeJSON(w, http.StatusOK, contracts.NodeList{Nodes: s.nodes.list(pool)})
}

func (s *server) getNode(w http.ResponseWriter, r *http.Request) {
	id, ok := nodeID(w, r)
	if !ok || !s.nodeModelReady(w) {
		return
	}
	if st, ok := s.knownNode(w, id); ok {
		writeJSON(w, http.StatusOK, st)
	}
}

// injectFault validates a FaultRequest against the node's inventory and
// publishes an inject_fault command for the node's agent on
// SubjectNodeCommands(node), with a new fault ID (a ULID) and Nats-Msg-Id
// FaultCommandID. Each accepted request is a new fault: a retried POST
// injects twice, as two clicks of a drill would.
func (s *server) injectFault(w http.ResponseWriter, r *http.Request) {
	if !admin(w, r) {
		return
	}
	node, ok := nodeID(w, r)
	if !ok {
		return
	}
	data, ok := readBody(w, r, maxFaultBody)
	if !ok {
		return
	}
	req, err := contracts.DecodeFaultRequest(data)
	if err != nil {
		writeInvalid(w, "invalid fault request", err)
		return
	}
	if !s.modelReady(w) {
		return
	}
	st, ok := s.knownNode(w, node)
	if !ok {
		return
	}
	if fields := checkFaultTarget(req, st.NodeInventory); len(fields) > 0 {
		writeFieldErrors(w, "invalid fault request", fields)
		return
	}
	if st.Backend == "nvml" {
		writeError(w, http.StatusConflict, contracts.ReasonNotSimulated,
			fmt.Sprintf("node %s runs on real GPUs (backend nvml); faults are injected only into simulated nodes", node), nil)
		return
	}
	f := contracts.Fault{ID: contracts.NewJobID(), Kind: req.Kind, GPU: req.GPU, Code: req.Code, Duration: req.Duration}
	if err := f.Validate(); err != nil {
		// The checks above are the agent's, field by field; this one
		// keeps the gateway from publishing a fault the agent refuses
		// should the two ever drift apart.
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidRequest, fmt.Sprintf("invalid fault: %v", err), nil)
		return
	}
	cmd := contracts.NodeCommand{SchemaVersion: contracts.SchemaVersion, Kind: contracts.CommandInjectFault, Fault: &f, Time: s.now().UTC()}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	ack, err := s.bus.Publish(ctx, contracts.SubjectNodeCommands(node), contracts.FaultCommandID(node, f.ID), cmd, bus.CESubject(node))
	if err != nil {
		s.log.Warn("fault publish failed", "node_id", node, "err", err)
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("publishing the fault: %v", err), nil)
		return
	}
	s.log.Info("fault injected", "node_id", node, "fault_id", f.ID, "kind", f.Kind, "gpu", f.GPU, "stream_seq", ack.Sequence)
	writeJSON(w, http.StatusAccepted, contracts.FaultResponse{NodeID: node, Fault: f, Stream: ack.Stream, Sequence: ack.Sequence})
}

// checkFaultTarget checks the GPU a fault names against the node's
// inventory: an index the machine has, or one of its GPUs' UUIDs.
func checkFaultTarget(req contracts.FaultRequest, inv contracts.NodeInventory) []contracts.FieldError {
	perGPU := req.Kind != contracts.FaultMachineDeath && req.Kind != contracts.FaultAgentPause && req.Kind != contracts.FaultClear
	bad := func(reason contracts.Reason, format string, args ...any) []contracts.FieldError {
		return []contracts.FieldError{{Field: "gpu", Reason: reason, Message: fmt.Sprintf(format, args...)}}
	}
	switch {
	case req.GPU == "" && perGPU && len(inv.GPUs) == 0:
		return bad(contracts.RefusedUnknownDevice, "node %s has no GPU to give a %s fault", inv.NodeID, req.Kind)
	case req.GPU == "":
		return nil
	}
	if i, err := strconv.Atoi(req.GPU); err == nil {
		if slices.ContainsFunc(inv.GPUs, func(g contracts.GPUInfo) bool { return g.Index == i }) {
			return nil
		}
		return bad(contracts.ReasonOutOfRange, "node %s has no GPU %d (it has %d GPUs%s)", inv.NodeID, i, len(inv.GPUs), indexRange(inv.GPUs))
	}
	if slices.ContainsFunc(inv.GPUs, func(g contracts.GPUInfo) bool { return g.UUID == req.GPU }) {
		return nil
	}
	return bad(contracts.RefusedUnknownDevice, "node %s has no GPU with UUID %q; name a GPU by index or UUID", inv.NodeID, req.GPU)
}

func indexRange(gpus []contracts.GPUInfo) string {
	if len(gpus) == 0 {
		return ""
	}
	lo, hi := gpus[0].Index, gpus[0].Index
	for _, g := range gpus {
		lo, hi = min(lo, g.Index), max(hi, g.Index)
	}
	return fmt.Sprintf(", indices %d to %d", lo, hi)
}

// writeFieldErrors answers 400 with every field error; the summary reason
// is the single reason they share, or invalid_request.
func writeFieldErrors(w http.ResponseWriter, what string, fields []contracts.FieldError) {
	reason := fields[0].Reason
	msgs := make([]string, 0, len(fields))
	for _, f := range fields {
		if f.Reason != reason {
			reason = contracts.ReasonInvalidRequest
		}
		if f.Field != "" {
			msgs = append(msgs, f.Field+": "+f.Message)
		} else {
			msgs = append(msgs, f.Message)
		}
	}
	writeError(w, http.StatusBadRequest, reason, what+": "+strings.Join(msgs, "; "), fields)
}
