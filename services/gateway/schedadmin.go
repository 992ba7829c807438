package gateway

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// The scheduling administration endpoints: tenant quotas, pool settings
// and node holds (cordon, drain) are KV documents the scheduler watches
// and applies at its next cycle (contracts/schedapi.go lists the paths).
// Each is validated with the contracts function the scheduler's reader
// trusts, and a write can be made conditional on the revision it was read
// at (?revision=N), so two administrators never overwrite each other
// unknowingly. Like the price book, these are administrator operations
// (see admin).

// maxAdminBody bounds a node hold's body: a reason of MaxAdminReason
// bytes, JSON-escaped.
const maxAdminBody = 8 << 10

// revisionParam reads ?revision=N: the KV revision a write must replace
// (0: the key must not exist). has is false without one; ok is false
// after answering 400.
func revisionParam(w http.ResponseWriter, r *http.Request) (rev uint64, has, ok bool) {
	if !r.URL.Query().Has("revision") {
		return 0, false, true
	}
	v := r.URL.Query().Get("revision")
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		msg := fmt.Sprintf("revision %q: want the revision the document was read at (0: only if there is none)", v)
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, msg,
			[]contracts.FieldError{{Field: "revision", Reason: contracts.ReasonInvalidValue, Message: msg}})
		return 0, false, false
	}
	return n, true, true
}

// readDoc reads key of kv into v; it returns the revision, or 0 when the
// key does not exist (or was deleted). A stored value that does not decode
// is an *unreadableError, with its revision.
func readDoc(ctx context.Context, kv jetstream.KeyValue, key string, v any) (uint64, error) {
	e, err := kv.Get(ctx, key)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		return 0, nil
	case err != nil:
		return 0, err
	}
	if err := json.Unmarshal(e.Value(), v); err != nil {
		return e.Revision(), &unreadableError{bucket: kv.Bucket(), key: key, rev: e.Revision(), err: err}
	}
	return e.Revision(), nil
}

// unreadableError is a stored KV document that does not decode (written by
// hand, by an older version, or by someone who should not have). It is
// reported, never answered with 500: an administrator replaces it with a
// PUT, conditionally on rev.
type unreadableError struct {
	bucket, key string
	rev         uint64
	err         error
}

func (e *unreadableError) Error() string {
	return fmt.Sprintf("stored %s/%s at revision %d does not decode: %v", e.bucket, e.key, e.rev, e.err)
}

func (e *unreadableError) Unwrap() error { return e.err }

// writeUnreadable answers a read of an unreadable document: 409
// unreadable_document, naming the revision to replace and how.
func (s *server) writeUnreadable(w http.ResponseWriter, what string, e *unreadableError, repair string) {
	s.log.Warn("stored document does not decode", "bucket", e.bucket, "key", e.key, "revision", e.rev, "err", e.err)
	writeError(w, http.StatusConflict, contracts.ReasonUnreadableDocument,
		fmt.Sprintf("%s (KV %s, key %s, revision %d) is unreadable: %v; %s", what, e.bucket, e.key, e.rev, e.err, repair), nil)
}

// readFailed answers a failed read: 409 for an unreadable document, 500
// otherwise.
func (s *server) readFailed(w http.ResponseWriter, kind, what string, err error, repair string) {
	if ue, ok := errors.AsType[*unreadableError](err); ok {
		s.writeUnreadable(w, what, ue, repair)
		return
	}
	s.internalError(w, kind, err)
}

// listDocs returns the current entry of every key of kv, deleted ones
// left out, ordered by key.
func listDocs(ctx context.Context, kv jetstream.KeyValue) ([]jetstream.KeyValueEntry, error) {
	wt, err := kv.WatchAll(ctx, jetstream.IgnoreDeletes())
	if err != nil {
		return nil, err
	}
	defer func() { _ = wt.Stop() }()
	var out []jetstream.KeyValueEntry
	for {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case e, ok := <-wt.Updates():
			if !ok {
				return nil, errors.New("watch closed")
			}
			if e == nil { // every current value is in
				slices.SortFunc(out, func(a, b jetstream.KeyValueEntry) int { return cmp.Compare(a.Key(), b.Key()) })
				return out, nil
			}
			out = append(out, e)
		}
	}
}

// writeDoc stores body under key: unconditionally, or with has only over
// revision want (0: only if the key does not exist). It answers 409
// conflict or 503 and returns false when it cannot; what names the
// document in those answers ("the quota of tenant acme").
func (s *server) writeDoc(ctx context.Context, w http.ResponseWriter, kv jetstream.KeyValue, key string, body []byte,
	want uint64, has bool, what string) (uint64, bool) {
	rev, err := putDoc(ctx, kv, key, body, want, has)
	if err == nil {
		return rev, true
	}
	msg := fmt.Sprintf("%s is no longer at revision %d: read it again", what, want)
	if want == 0 {
		msg = fmt.Sprintf("%s already exists (revision=0 writes only a new one): read it again", what)
	}
	writeKVError(w, err, msg, "writing "+what)
	return 0, false
}

func putDoc(ctx context.Context, kv jetstream.KeyValue, key string, body []byte, want uint64, has bool) (uint64, error) {
	switch {
	case !has:
		return kv.Put(ctx, key, body)
	case want == 0:
		return kv.Create(ctx, key, body)
	}
	return kv.Update(ctx, key, body, want)
}

// writeKVError answers a failed KV write: 409 conflict with conflictMsg
// when a compare-and-set lost, 503 otherwise.
func writeKVError(w http.ResponseWriter, err error, conflictMsg, doing string) {
	if bus.IsConflict(err) {
		writeError(w, http.StatusConflict, contracts.ReasonConflict, conflictMsg, nil)
		return
	}
	writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("%s: %v", doing, err), nil)
}

// deleteDoc deletes key, with has only at revision want. It answers 409 or
// 503 and returns false when it cannot.
func (s *server) deleteDoc(ctx context.Context, w http.ResponseWriter, kv jetstream.KeyValue, key string,
	want uint64, has bool, what string) bool {
	var opts []jetstream.KVDeleteOpt
	if has {
		opts = append(opts, jetstream.LastRevision(want))
	}
	if err := kv.Delete(ctx, key, opts...); err != nil {
		writeKVError(w, err, fmt.Sprintf("%s is no longer at revision %d: read it again", what, want), "deleting "+what)
		return false
	}
	return true
}

// --- quotas and pools ---

// kvDoc is one kind of administrator-edited KV document (a tenant's quota,
// a pool's settings). Its get, list, put and delete are the same steps for
// every kind, so that every kind checks, conflicts and fails alike; what
// differs (the key in the path, the decoder the scheduler trusts, the
// answer's shape) is named here. T is the stored document, D the answer
// about one key.
type kvDoc[T, D any] struct {
	bucket string
	// kind names the document in internal errors and the list's 503
	// ("quota": "reading the quotas"); noun in logs and 400 answers
	// ("pool config": "invalid pool config"); keyAttr is the log attribute
	// of its key, the path's {keyAttr}.
	kind, noun, keyAttr string
	// of names one document in 409 and 503 answers: of+key ("the quota
	// of tenant acme").
	of string
	// key reads the key from the path; it answers 400 and returns false
	// when it is not valid.
	key func(http.ResponseWriter, *http.Request) (string, bool)
	// ready, when set, must hold before a get or a list is answered (the
	// answer counts what the gateway's model knows).
	ready func(*server, http.ResponseWriter) bool
	// decode is the contracts decoder the scheduler's reader trusts.
	decode func(data []byte, key string) (T, error)
	// stamp records when an administrator wrote the document.
	stamp func(*T, time.Time)
	// setMsg is the log message of a put, with setAttrs after the key and
	// revision.
	setMsg   string
	setAttrs func(*T) []any
	// answer is the answer about key: doc is nil (and rev 0) when there is
	// none. answerList is the list's answer, docs ordered by key.
	answer     func(s *server, key string, doc *T, rev uint64) D
	answerList func(s *server, docs []storedDoc[T]) any
}

// storedDoc is one decoded document of a list.
type storedDoc[T any] struct {
	key string
	doc *T
	rev uint64
}

var quotaDocs = kvDoc[contracts.TenantQuota, contracts.QuotaDoc]{
	bucket: contracts.BucketQuotas, kind: "quota", noun: "quota", keyAttr: "tenant", of: "the quota of tenant ",
	key:    tenant,
	decode: contracts.DecodeTenantQuota,
	stamp:  func(q *contracts.TenantQuota, now time.Time) { q.UpdatedAt = now },
	setMsg: "quota set",
	setAttrs: func(q *contracts.TenantQuota) []any {
		return []any{"weight", q.EffectiveWeight(), "strict_fifo", q.StrictFIFO, "pools", len(q.Pools)}
	},
	answer: func(_ *server, tenant string, q *contracts.TenantQuota, rev uint64) contracts.QuotaDoc {
		return contracts.QuotaDoc{Tenant: tenant, Quota: q, Revision: rev}
	},
	answerList: func(_ *server, docs []storedDoc[contracts.TenantQuota]) any {
		list := contracts.QuotaList{Quotas: make([]contracts.QuotaDoc, 0, len(docs))}
		for _, d := range docs {
			list.Quotas = append(list.Quotas, contracts.QuotaDoc{Tenant: d.key, Quota: d.doc, Revision: d.rev})
		}
		return list
	},
}

// poolDocs answers a pool need not have a config, nor nodes yet: a pool's
// answer counts the nodes the gateway knows in it, and the list names
// every configured pool and every pool of a known node.
var poolDocs = kvDoc[contracts.PoolConfig, contracts.PoolDoc]{
	bucket: contracts.BucketPools, kind: "pool", noun: "pool config", keyAttr: "pool", of: "the config of pool ",
	key:    poolName,
	ready:  (*server).modelReady,
	decode: contracts.DecodePoolConfig,
	stamp:  func(c *contracts.PoolConfig, now time.Time) { c.UpdatedAt = now },
	setMsg: "pool configured",
	setAttrs: func(c *contracts.PoolConfig) []any {
		return []any{"policy", c.Policy}
	},
	answer: func(s *server, pool string, c *contracts.PoolConfig, rev uint64) contracts.PoolDoc {
		return contracts.PoolDoc{Pool: pool, Config: c, Revision: rev, Nodes: len(s.nodes.list(pool))}
	},
	answerList: func(s *server, docs []storedDoc[contracts.PoolConfig]) any {
		pools := map[string]*contracts.PoolDoc{}
		doc := func(p string) *contracts.PoolDoc {
			if pools[p] == nil {
				pools[p] = &contracts.PoolDoc{Pool: p}
			}
			return pools[p]
		}
		for _, n := range s.nodes.list("") {
			doc(n.Pool).Nodes++
		}
		for _, c := range docs {
			d := doc(c.key)
			d.Config, d.Revision = c.doc, c.rev
		}
		list := contracts.PoolList{Pools: make([]contracts.PoolDoc, 0, len(pools))}
		for _, p := range slices.Sorted(maps.Keys(pools)) {
			list.Pools = append(list.Pools, *pools[p])
		}
		return list
	},
}

func (s *server) getQuota(w http.ResponseWriter, r *http.Request)    { quotaDocs.get(s, w, r) }
func (s *server) listQuotas(w http.ResponseWriter, r *http.Request)  { quotaDocs.list(s, w, r) }
func (s *server) putQuota(w http.ResponseWriter, r *http.Request)    { quotaDocs.put(s, w, r) }
func (s *server) deleteQuota(w http.ResponseWriter, r *http.Request) { quotaDocs.delete(s, w, r) }
func (s *server) getPool(w http.ResponseWriter, r *http.Request)     { poolDocs.get(s, w, r) }
func (s *server) listPools(w http.ResponseWriter, r *http.Request)   { poolDocs.list(s, w, r) }
func (s *server) putPool(w http.ResponseWriter, r *http.Request)     { poolDocs.put(s, w, r) }

// deletePool returns a pool to the scheduler's defaults.
func (s *server) deletePool(w http.ResponseWriter, r *http.Request) { poolDocs.delete(s, w, r) }

// poolName answers 400 invalid_value and returns false for a bad pool in
// the path.
func poolName(w http.ResponseWriter, r *http.Request) (string, bool) {
	p := r.PathValue("pool")
	if err := contracts.ValidatePool(p); err != nil {
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, err.Error(),
			[]contracts.FieldError{{Field: "pool", Reason: contracts.ReasonInvalidValue, Message: err.Error()}})
		return "", false
	}
	return p, true
}

func (k *kvDoc[T, D]) get(s *server, w http.ResponseWriter, r *http.Request) {
	key, ok := k.key(w, r)
	if !ok || (k.ready != nil && !k.ready(s, w)) {
		return
	}
	kv := s.kv(w, r, k.bucket)
	if kv == nil {
		return
	}
	var doc T
	rev, err := readDoc(r.Context(), kv, key, &doc)
	if err != nil {
		s.readFailed(w, k.kind, k.of+key, err, fmt.Sprintf("replace it with PUT %s?revision=%d, or delete it", r.URL.Path, rev))
		return
	}
	var stored *T // nil: the key has no document
	if rev > 0 {
		stored = &doc
	}
	writeJSON(w, http.StatusOK, k.answer(s, key, stored, rev))
}

// list answers every stored document; one that does not decode is logged
// and left out.
func (k *kvDoc[T, D]) list(s *server, w http.ResponseWriter, r *http.Request) {
	if k.ready != nil && !k.ready(s, w) {
		return
	}
	kv := s.kv(w, r, k.bucket)
	if kv == nil {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	entries, err := listDocs(ctx, kv)
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("reading the %ss: %v", k.kind, err), nil)
		return
	}
	docs := make([]storedDoc[T], 0, len(entries))
	for _, e := range entries {
		doc := new(T)
		if err := json.Unmarshal(e.Value(), doc); err != nil {
			s.log.Warn("skipping a stored "+k.noun+" that does not decode", k.keyAttr, e.Key(), "revision", e.Revision(), "err", err)
			continue
		}
		docs = append(docs, storedDoc[T]{key: e.Key(), doc: doc, rev: e.Revision()})
	}
	writeJSON(w, http.StatusOK, k.answerList(s, docs))
}

// edit checks an edit's request: an administrator's, a valid key, and
// ?revision=N when given (revisionParam). It answers 400 (or admin's
// refusal) and returns false when the edit cannot go on.
func (k *kvDoc[T, D]) edit(w http.ResponseWriter, r *http.Request) (key string, want uint64, has, ok bool) {
	if !admin(w, r) {
		return "", 0, false, false
	}
	if key, ok = k.key(w, r); !ok {
		return "", 0, false, false
	}
	want, has, ok = revisionParam(w, r)
	return key, want, has, ok
}

// put replaces a document (k.decode: 400 with every field error),
// conditionally with ?revision=N.
func (k *kvDoc[T, D]) put(s *server, w http.ResponseWriter, r *http.Request) {
	key, want, has, ok := k.edit(w, r)
	if !ok {
		return
	}
	data, ok := readBody(w, r, s.cfg.MaxBodyBytes)
	if !ok {
		return
	}
	doc, err := k.decode(data, key)
	if err != nil {
		writeInvalid(w, "invalid "+k.noun, err)
		return
	}
	k.stamp(&doc, s.now().UTC())
	kv := s.kv(w, r, k.bucket)
	if kv == nil {
		return
	}
	body, err := json.Marshal(doc)
	if err != nil {
		s.internalError(w, k.kind, err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	rev, ok := s.writeDoc(ctx, w, kv, key, body, want, has, k.of+key)
	if !ok {
		return
	}
	s.log.Info(k.setMsg, append([]any{k.keyAttr, key, "revision", rev}, k.setAttrs(&doc)...)...)
	writeJSON(w, http.StatusOK, k.answer(s, key, &doc, rev))
}

// delete removes a document, conditionally with ?revision=N: the
// scheduler goes back to its defaults for the key.
func (k *kvDoc[T, D]) delete(s *server, w http.ResponseWriter, r *http.Request) {
	key, want, has, ok := k.edit(w, r)
	if !ok {
		return
	}
	kv := s.kv(w, r, k.bucket)
	if kv == nil {
		return
	}
	if !s.deleteDoc(r.Context(), w, kv, key, want, has, k.of+key) {
		return
	}
	s.log.Info(k.noun+" removed", k.keyAttr, key)
	writeJSON(w, http.StatusOK, k.answer(s, key, nil, 0))
}

// --- node holds ---

// nodeModelReady answers 503 and returns false until the node model has
// caught up with NODES and with the node holds.
func (s *server) nodeModelReady(w http.ResponseWriter) bool {
	if !s.modelReady(w) {
		return false
	}
	if s.adminReady == nil || !s.adminReady() {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable,
			fmt.Sprintf("the node holds (KV %s) are not read yet; retry shortly", contracts.BucketNodeAdmin), nil)
		return false
	}
	return true
}

func (s *server) cordonNode(w http.ResponseWriter, r *http.Request) { s.holdNode(w, r, false) }
func (s *server) drainNode(w http.ResponseWriter, r *http.Request)  { s.holdNode(w, r, true) }

// holdNode cordons (drain false) or drains a node the gateway knows: it
// writes the node's NodeAdmin with compare-and-set on the revision it
// read. A hold already in that state is left as it is (its time and
// reason kept) unless a new reason is given; cordoning a draining node
// stops the drain (jobs already moved stay where they went). GPU holds in
// the document are kept (see gpuholds.go).
func (s *server) holdNode(w http.ResponseWriter, r *http.Request, drain bool) {
	node, req, ok := s.holdRequest(w, r)
	if !ok {
		return
	}
	st, ok := s.knownNode(w, node)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	kv, cur, rev, ok := s.currentHold(ctx, w, r, node)
	if !ok {
		return
	}
	verb := "cordon"
	if drain {
		verb = "drain"
	}
	if cur != nil && cur.Cordoned && cur.Drain == drain && (req.Reason == "" || req.Reason == cur.Reason) {
		st.Admin = cur
		writeJSON(w, http.StatusOK, st)
		return
	}
	hold := contracts.NodeAdmin{SchemaVersion: contracts.SchemaVersion, NodeID: node, Cordoned: true, Drain: drain,
		Reason: req.Reason, Time: s.now().UTC()}
	if cur != nil {
		// The node's hold becomes the administrator's (no Cause), but
		// what the same document says about single GPUs (the
		// scheduler's holds of sick or hot GPUs) and when the machine
		// goes away stay true: only uncordon lifts everything.
		hold.GPUs, hold.Deadline = cur.GPUs, cur.Deadline
	}
	newRev, err := s.writeHold(ctx, kv, node, &hold, rev)
	if err != nil {
		writeKVError(w, err, fmt.Sprintf("the hold of node %s changed while this %s was written: retry", node, verb), "writing the hold of node "+node)
		return
	}
	s.nodes.applyHold(node, &hold, newRev)
	s.log.Info("node "+verb+"ed", "node_id", node, "reason", req.Reason, "revision", newRev)
	st.Admin = &hold
	writeJSON(w, http.StatusOK, st)
}

// uncordonNode releases a node's hold by deleting its key (compare-and-set
// on the revision read). A node without a hold is answered as it is; a
// hold on a node the gateway does not know can still be released.
func (s *server) uncordonNode(w http.ResponseWriter, r *http.Request) {
	node, req, ok := s.holdRequest(w, r)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	kv, cur, rev, ok := s.currentHold(ctx, w, r, node)
	if !ok {
		return
	}
	st, known := s.nodes.node(node)
	switch {
	case !known && rev == 0:
		s.knownNode(w, node) // answers 404 unknown_node
		return
	case !known:
		st = contracts.NodeStatus{NodeInventory: contracts.NodeInventory{NodeID: node, GPUs: []contracts.GPUInfo{}}} // gpus: [], not null
	}
	st.Admin = nil
	if rev == 0 {
		writeJSON(w, http.StatusOK, st)
		return
	}
	newRev, err := s.writeHold(ctx, kv, node, nil, rev)
	if err != nil {
		writeKVError(w, err, fmt.Sprintf("the hold of node %s changed while this uncordon was written: retry", node), "deleting the hold of node "+node)
		return
	}
	s.nodes.applyHold(node, nil, newRev)
	s.log.Info("node uncordoned", "node_id", node, "reason", req.Reason, "was_draining", cur != nil && cur.Drain)
	writeJSON(w, http.StatusOK, st)
}

// holdRequest reads a cordon, drain or uncordon request: the node in the
// path and the body, once the node model is ready to answer it. It answers
// 400, 413 or 503 (or admin's refusal) and returns false when it cannot.
func (s *server) holdRequest(w http.ResponseWriter, r *http.Request) (string, contracts.NodeAdminRequest, bool) {
	if !admin(w, r) {
		return "", contracts.NodeAdminRequest{}, false
	}
	node, ok := nodeID(w, r)
	if !ok {
		return "", contracts.NodeAdminRequest{}, false
	}
	data, ok := readBody(w, r, maxAdminBody)
	if !ok {
		return "", contracts.NodeAdminRequest{}, false
	}
	req, err := contracts.DecodeNodeAdminRequest(data)
	if err != nil {
		writeInvalid(w, "invalid node hold", err)
		return "", contracts.NodeAdminRequest{}, false
	}
	if !s.nodeModelReady(w) {
		return "", contracts.NodeAdminRequest{}, false
	}
	return node, req, true
}

// currentHold opens the node holds' bucket and reads node's hold and its
// revision (readHold). It answers 503 and returns false when it cannot.
func (s *server) currentHold(ctx context.Context, w http.ResponseWriter, r *http.Request, node string) (
	jetstream.KeyValue, *contracts.NodeAdmin, uint64, bool) {
	kv := s.kv(w, r, contracts.BucketNodeAdmin)
	if kv == nil {
		return nil, nil, 0, false
	}
	cur, rev, err := s.readHold(ctx, kv, node)
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("reading the hold of node %s: %v", node, err), nil)
		return nil, nil, 0, false
	}
	return kv, cur, rev, true
}

// readHold reads a node's hold and its revision (0: none). A stored value
// that does not decode is logged and read as no hold, at its revision, so
// that an administrator can still overwrite or release it.
func (s *server) readHold(ctx context.Context, kv jetstream.KeyValue, node string) (*contracts.NodeAdmin, uint64, error) {
	e, err := kv.Get(ctx, node)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		return nil, 0, nil
	case err != nil:
		return nil, 0, err
	}
	var a contracts.NodeAdmin
	if err := json.Unmarshal(e.Value(), &a); err != nil {
		s.log.Warn("stored node hold does not decode; it will be replaced", "node_id", node, "revision", e.Revision(), "err", err)
		return nil, e.Revision(), nil
	}
	return &a, e.Revision(), nil
}
