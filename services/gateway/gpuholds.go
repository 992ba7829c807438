package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// GPU holds: an administrator holds or releases one GPU of a node, in the
// GPUs map of the node's NodeAdmin (BucketNodeAdmin), the same document the
// scheduler writes its holds of sick and hot GPUs to and the autoscaler its
// drains. So unlike a node's cordon, which replaces the document, a GPU
// edit is a merge of one entry: it reads the document, changes that entry
// and writes it back with compare-and-set on the revision read, reading
// again when another writer got in between.
//
//	POST /v1/nodes/{node}/gpus/{uuid}/cordon    NodeAdminRequest (optional) -> 200 NodeStatus
//	POST /v1/nodes/{node}/gpus/{uuid}/drain     NodeAdminRequest (optional) -> 200 NodeStatus
//	POST /v1/nodes/{node}/gpus/{uuid}/uncordon  NodeAdminRequest (optional) -> 200 NodeStatus

// gpuHoldTries bounds the compare-and-set retries of one GPU edit: a merge
// is safe to apply again to a newer document, and the other writers (the
// scheduler, the autoscaler) write rarely, so losing three times in a row
// means a storm the caller should hear about (409).
const gpuHoldTries = 3

// holdRefusal is an answer that ends a GPU edit without writing.
type holdRefusal struct {
	status int
	reason contracts.Reason
	field  string
	msg    string
}

func (h *holdRefusal) write(w http.ResponseWriter) {
	var fields []contracts.FieldError
	if h.field != "" {
		fields = []contracts.FieldError{{Field: h.field, Reason: h.reason, Message: h.msg}}
	}
	writeError(w, h.status, h.reason, h.msg, fields)
}

// gpuEdit computes a node's next hold from its current one (nil: none).
// write false: the hold is already as asked, answer cur. next nil with
// write: delete the key (the document no longer holds anything).
type gpuEdit func(cur *contracts.NodeAdmin) (next *contracts.NodeAdmin, write bool, refused *holdRefusal)

func (s *server) cordonGPU(w http.ResponseWriter, r *http.Request)   { s.holdGPU(w, r, false) }
func (s *server) drainGPU(w http.ResponseWriter, r *http.Request)    { s.holdGPU(w, r, true) }
func (s *server) uncordonGPU(w http.ResponseWriter, r *http.Request) { s.releaseGPU(w, r) }

// gpuUUIDParam answers 400 invalid_id and returns false for a GPU UUID in
// the path that cannot be one (NVML's GPU-<hex groups> fits contracts'
// ID syntax, which is also what keeps a KV map key and a log line sane).
func gpuUUIDParam(w http.ResponseWriter, r *http.Request) (string, bool) {
	uuid := r.PathValue("uuid")
	if err := contracts.ValidateID(uuid); err != nil {
		msg := fmt.Sprintf("invalid GPU UUID %q: want 1-128 of [A-Za-z0-9_-], starting with a letter or digit (e.g. GPU-4b1f...)", uuid)
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidID, msg,
			[]contracts.FieldError{{Field: "uuid", Reason: contracts.ReasonInvalidID, Message: msg}})
		return "", false
	}
	return uuid, true
}

// gpuHoldRequest reads a GPU hold request: the node and the GPU in the
// path, then the body as holdRequest does.
func (s *server) gpuHoldRequest(w http.ResponseWriter, r *http.Request) (string, string, contracts.NodeAdminRequest, bool) {
	if _, ok := nodeID(w, r); !ok {
		return "", "", contracts.NodeAdminRequest{}, false
	}
	uuid, ok := gpuUUIDParam(w, r)
	if !ok {
		return "", "", contracts.NodeAdminRequest{}, false
	}
	node, req, ok := s.holdRequest(w, r)
	return node, uuid, req, ok
}

// checkGPU refuses a UUID that is not one of the node's physical GPUs:
// a MIG instance is named by its parent (holds are about the hardware, and
// the resource manager reads them by the parent UUID), anything else is
// unknown_device.
func checkGPU(inv contracts.NodeInventory, uuid string) *holdRefusal {
	if slices.ContainsFunc(inv.GPUs, func(g contracts.GPUInfo) bool { return g.UUID == uuid }) {
		return nil
	}
	for _, g := range inv.GPUs {
		if slices.ContainsFunc(g.MIGInstances, func(m contracts.MIGInstance) bool { return m.UUID == uuid }) {
			return &holdRefusal{http.StatusBadRequest, contracts.ReasonInvalidValue, "uuid",
				fmt.Sprintf("%s is a MIG instance of GPU %s; a hold is on a whole GPU: name %s", uuid, g.UUID, g.UUID)}
		}
	}
	return &holdRefusal{http.StatusNotFound, contracts.RefusedUnknownDevice, "uuid",
		fmt.Sprintf("node %s has no GPU %s", inv.NodeID, uuid)}
}

// holdGPU cordons (drain false) or drains one GPU of a node the gateway
// knows. A GPU already held so by an administrator is left as it is (its
// time and reason kept) unless a new reason is given. A hold the platform
// wrote (a Cause, e.g. overheating, which the scheduler lifts when its
// alert resolves) becomes the administrator's: it stays until uncordoned.
func (s *server) holdGPU(w http.ResponseWriter, r *http.Request, drain bool) {
	node, uuid, req, ok := s.gpuHoldRequest(w, r)
	if !ok {
		return
	}
	st, ok := s.knownNode(w, node)
	if !ok {
		return
	}
	if ref := checkGPU(st.NodeInventory, uuid); ref != nil {
		ref.write(w)
		return
	}
	verb := "cordon"
	if drain {
		verb = "drain"
	}
	now := s.now().UTC()
	s.editHold(w, r, node, uuid, verb, req.Reason, st, func(cur *contracts.NodeAdmin) (*contracts.NodeAdmin, bool, *holdRefusal) {
		h, held := contracts.GPUHold{}, false
		if cur != nil {
			h, held = cur.GPUs[uuid]
		}
		if held && h.Cordoned && h.Drain == drain && h.Cause == "" && (req.Reason == "" || req.Reason == h.Reason) {
			return cur, false, nil
		}
		next := editable(cur, node)
		since := now
		if held && (h.Cordoned || h.Drain) && !h.Since.IsZero() {
			since = h.Since // the GPU has been kept off work since then
		}
		next.GPUs[uuid] = contracts.GPUHold{Cordoned: true, Drain: drain, Reason: req.Reason, Since: since}
		next.Time = now
		return next, true, nil
	})
}

// releaseGPU lifts one GPU's hold, whoever set it, leaving the node's own
// hold and its other GPUs' as they are; when nothing is held any more the
// key is deleted, as uncordoning the node does. A GPU without a hold is
// answered as it is (a retried uncordon is not an error); a UUID the node
// neither lists nor holds is 404 unknown_device. A hold on a node no agent
// announces any more can still be lifted.
func (s *server) releaseGPU(w http.ResponseWriter, r *http.Request) {
	node, uuid, req, ok := s.gpuHoldRequest(w, r)
	if !ok {
		return
	}
	st, known := s.nodes.node(node)
	if !known {
		st = contracts.NodeStatus{NodeInventory: contracts.NodeInventory{NodeID: node, GPUs: []contracts.GPUInfo{}}} // gpus: [], not null
	}
	s.editHold(w, r, node, uuid, "uncordon", req.Reason, st, func(cur *contracts.NodeAdmin) (*contracts.NodeAdmin, bool, *holdRefusal) {
		if cur != nil {
			if _, held := cur.GPUs[uuid]; held {
				next := editable(cur, node)
				delete(next.GPUs, uuid)
				next.Time = s.now().UTC()
				if !next.Cordoned && !next.Drain && len(next.GPUs) == 0 {
					return nil, true, nil
				}
				return next, true, nil
			}
		}
		switch {
		case !known && cur == nil:
			return nil, false, &holdRefusal{status: http.StatusNotFound, reason: contracts.ReasonUnknownNode,
				msg: fmt.Sprintf("no node %s and no hold on it (a node appears once its agent has published an inventory)", node)}
		case !known:
			return nil, false, &holdRefusal{http.StatusNotFound, contracts.RefusedUnknownDevice, "uuid",
				fmt.Sprintf("node %s holds no GPU %s", node, uuid)}
		}
		if ref := checkGPU(st.NodeInventory, uuid); ref != nil {
			return nil, false, ref
		}
		return cur, false, nil
	})
}

// editable returns a copy of cur (or a new hold of node) whose GPUs map may
// be written: the read model shares the documents it stores with readers.
func editable(cur *contracts.NodeAdmin, node string) *contracts.NodeAdmin {
	next := contracts.NodeAdmin{NodeID: node}
	if cur != nil {
		next = *cur
	}
	next.SchemaVersion, next.NodeID = contracts.SchemaVersion, node
	next.GPUs = maps.Clone(next.GPUs)
	if next.GPUs == nil {
		next.GPUs = map[string]contracts.GPUHold{}
	}
	return &next
}

// editHold runs edit against the node's stored hold and writes its answer
// with compare-and-set, up to gpuHoldTries times; it answers st with the
// hold as it ends up. A stored value that does not decode is not edited:
// the resource manager holds the whole node on it (fail closed), and a
// GPU edit must not lift that by accident; replacing it is the node
// routes' business.
func (s *server) editHold(w http.ResponseWriter, r *http.Request, node, uuid, verb, reason string, st contracts.NodeStatus, edit gpuEdit) {
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	for try := 1; ; try++ {
		kv, cur, rev, ok := s.currentHold(ctx, w, r, node)
		if !ok {
			return
		}
		if cur == nil && rev > 0 {
			writeError(w, http.StatusConflict, contracts.ReasonConflict, fmt.Sprintf(
				"the hold of node %s does not decode; cordon, drain or uncordon the node to replace it first", node), nil)
			return
		}
		next, write, refused := edit(cur)
		if refused != nil {
			refused.write(w)
			return
		}
		if !write {
			st.Admin = cur
			writeJSON(w, http.StatusOK, st)
			return
		}
		newRev, err := s.writeHold(ctx, kv, node, next, rev)
		if bus.IsConflict(err) && try < gpuHoldTries {
			s.log.Debug("gpu hold lost a compare-and-set; reading again", "node_id", node, "gpu_uuid", uuid, "revision", rev)
			continue
		}
		if err != nil {
			writeKVError(w, err, fmt.Sprintf("the hold of node %s kept changing while this GPU %s was written: retry", node, verb),
				"writing the hold of node "+node)
			return
		}
		s.nodes.applyHold(node, next, newRev)
		s.log.Info("gpu "+verb, "node_id", node, "gpu_uuid", uuid, "reason", reason, "revision", newRev, "node_hold_left", next != nil)
		st.Admin = next
		writeJSON(w, http.StatusOK, st)
		return
	}
}

// writeHold stores next at the node's key if it is still at revision rev
// (0: only if there is none), or deletes the key at rev when next is nil.
// It returns the revision the read model should apply next at.
func (s *server) writeHold(ctx context.Context, kv jetstream.KeyValue, node string, next *contracts.NodeAdmin, rev uint64) (uint64, error) {
	if next == nil {
		if err := kv.Delete(ctx, node, jetstream.LastRevision(rev)); err != nil {
			return 0, err
		}
		// The delete marker's revision is above rev (revisions are the
		// bucket's stream sequence); the watch applies it too.
		return rev + 1, nil
	}
	body, err := json.Marshal(next)
	if err != nil {
		return 0, fmt.Errorf("encoding the hold of node %s: %w", node, err)
	}
	return putDoc(ctx, kv, node, body, rev, true)
}
