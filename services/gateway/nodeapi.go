package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// Bounds of a fault request. maxXID is the largest code
// contracts.Fault.Validate, which the agent applies, accepts.
const (
	maxFaultBody = 4 << 10
	maxXID       = 1<<16 - 1
)

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
// has published an inventory of.
func (s *server) knownNode(w http.ResponseWriter, id string) (contracts.NodeStatus, bool) {
	st, ok := s.nodes.node(id)
	if !ok {
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
	req, fields := decodeFaultRequest(data)
	if len(fields) > 0 {
		writeFieldErrors(w, "invalid fault request", fields)
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

// faultBody is a FaultRequest as it arrives: duration is parsed here so a
// bad one is reported on its own field.
type faultBody struct {
	Kind     contracts.FaultKind `json:"kind"`
	GPU      string              `json:"gpu"`
	Code     int                 `json:"code"`
	Duration json.RawMessage     `json:"duration"`
}

// decodeFaultRequest decodes one JSON object strictly and checks what can
// be checked without the node: every problem at once, each on its field.
func decodeFaultRequest(data []byte) (contracts.FaultRequest, []contracts.FieldError) {
	var b faultBody
	if len(bytes.TrimSpace(data)) == 0 {
		return contracts.FaultRequest{}, []contracts.FieldError{{Reason: contracts.ReasonEmptyBody, Message: "body is empty; want {\"kind\": ...}"}}
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&b); err != nil {
		return contracts.FaultRequest{}, []contracts.FieldError{jsonFieldError(err)}
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return contracts.FaultRequest{}, []contracts.FieldError{{Reason: contracts.ReasonInvalidJSON, Message: "trailing data after the JSON object"}}
	}
	req := contracts.FaultRequest{Kind: b.Kind, GPU: b.GPU, Code: b.Code}
	var errs []contracts.FieldError
	add := func(field string, reason contracts.Reason, format string, args ...any) {
		errs = append(errs, contracts.FieldError{Field: field, Reason: reason, Message: fmt.Sprintf(format, args...)})
	}
	switch {
	case b.Kind == "":
		add("kind", contracts.ReasonMissingField, "kind is required; want one of %s", kindList())
	case !slices.Contains(contracts.FaultKinds, b.Kind):
		add("kind", contracts.ReasonInvalidValue, "unknown fault kind %q; want one of %s", b.Kind, kindList())
	}
	machineWide := b.Kind == contracts.FaultMachineDeath || b.Kind == contracts.FaultAgentPause
	if b.GPU != "" && machineWide {
		add("gpu", contracts.ReasonInvalidValue, "%s concerns the whole machine; leave gpu empty", b.Kind)
	}
	switch {
	case b.Code != 0 && b.Kind != contracts.FaultXID:
		add("code", contracts.ReasonInvalidValue, "code applies only to kind xid")
	case b.Code < 0 || b.Code > maxXID:
		add("code", contracts.ReasonOutOfRange, "XID %d; want 1 to %d (0 or none: %d, fell off the bus)", b.Code, maxXID, contracts.DefaultFaultXID)
	}
	if len(b.Duration) > 0 && string(b.Duration) != "null" {
		var d contracts.Duration
		switch err := d.UnmarshalJSON(b.Duration); {
		case err != nil:
			add("duration", contracts.ReasonInvalidDuration, "%v", err)
		case d < 0:
			add("duration", contracts.ReasonInvalidDuration, "duration %s is negative", d.D())
		case d != 0 && b.Kind != contracts.FaultOverheat && b.Kind != contracts.FaultAgentPause:
			add("duration", contracts.ReasonInvalidValue, "duration applies only to overheat and agent_pause")
		case d.D() > contracts.MaxFaultDuration:
			add("duration", contracts.ReasonOutOfRange, "duration %s; want at most %s", d.D(), contracts.MaxFaultDuration)
		default:
			req.Duration = d
		}
	}
	return req, errs
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

func kindList() string {
	names := make([]string, len(contracts.FaultKinds))
	for i, k := range contracts.FaultKinds {
		names[i] = string(k)
	}
	return strings.Join(names, ", ")
}

// jsonFieldError maps a decoder error to a field error, as the job request
// decoder of contracts does.
func jsonFieldError(err error) contracts.FieldError {
	var typeErr *json.UnmarshalTypeError
	var syntaxErr *json.SyntaxError
	switch {
	case errors.As(err, &typeErr):
		return contracts.FieldError{Field: typeErr.Field, Reason: contracts.ReasonInvalidType,
			Message: fmt.Sprintf("got JSON %s, want %s", typeErr.Value, typeErr.Type)}
	case errors.As(err, &syntaxErr):
		return contracts.FieldError{Reason: contracts.ReasonInvalidJSON, Message: fmt.Sprintf("%v at byte %d", syntaxErr, syntaxErr.Offset)}
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		return contracts.FieldError{Reason: contracts.ReasonInvalidJSON, Message: "unexpected end of JSON"}
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		name := strings.Trim(strings.TrimPrefix(err.Error(), "json: unknown field "), `"`)
		return contracts.FieldError{Field: name, Reason: contracts.ReasonUnknownField, Message: fmt.Sprintf("unknown field %q", name)}
	default:
		return contracts.FieldError{Reason: contracts.ReasonInvalidJSON, Message: err.Error()}
	}
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
