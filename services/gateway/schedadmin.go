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

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
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
// key does not exist (or was deleted).
func readDoc(ctx context.Context, kv jetstream.KeyValue, key string, v any) (uint64, error) {
	e, err := kv.Get(ctx, key)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		return 0, nil
	case err != nil:
		return 0, err
	}
	if err := json.Unmarshal(e.Value(), v); err != nil {
		return 0, fmt.Errorf("stored %s/%s at revision %d: %w", kv.Bucket(), key, e.Revision(), err)
	}
	return e.Revision(), nil
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
	if conflict(err) {
		writeError(w, http.StatusConflict, contracts.ReasonConflict, conflictMsg, nil)
		return
	}
	writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("%s: %v", doing, err), nil)
}

// conflict reports whether a KV write lost a compare-and-set.
func conflict(err error) bool {
	if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return true
	}
	apiErr, ok := errors.AsType[*jetstream.APIError](err)
	return ok && apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence
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

// --- quotas ---

func (s *server) getQuota(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenant(w, r)
	if !ok {
		return
	}
	kv := s.kv(w, r, contracts.BucketQuotas)
	if kv == nil {
		return
	}
	var q contracts.TenantQuota
	rev, err := readDoc(r.Context(), kv, tenant, &q)
	if err != nil {
		s.internalError(w, "quota", err)
		return
	}
	doc := contracts.QuotaDoc{Tenant: tenant}
	if rev > 0 {
		doc.Quota, doc.Revision = &q, rev
	}
	writeJSON(w, http.StatusOK, doc)
}

// listQuotas answers every stored quota; one that does not decode is
// logged and left out.
func (s *server) listQuotas(w http.ResponseWriter, r *http.Request) {
	kv := s.kv(w, r, contracts.BucketQuotas)
	if kv == nil {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	entries, err := listDocs(ctx, kv)
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("reading the quotas: %v", err), nil)
		return
	}
	list := contracts.QuotaList{Quotas: []contracts.QuotaDoc{}}
	for _, e := range entries {
		var q contracts.TenantQuota
		if err := json.Unmarshal(e.Value(), &q); err != nil {
			s.log.Warn("skipping a stored quota that does not decode", "tenant", e.Key(), "revision", e.Revision(), "err", err)
			continue
		}
		list.Quotas = append(list.Quotas, contracts.QuotaDoc{Tenant: e.Key(), Quota: &q, Revision: e.Revision()})
	}
	writeJSON(w, http.StatusOK, list)
}

// putQuota replaces a tenant's quota (contracts.DecodeTenantQuota: 400
// with every field error), conditionally with ?revision=N.
func (s *server) putQuota(w http.ResponseWriter, r *http.Request) {
	if !admin(w, r) {
		return
	}
	tenant, ok := tenant(w, r)
	if !ok {
		return
	}
	want, has, ok := revisionParam(w, r)
	if !ok {
		return
	}
	data, ok := readBody(w, r, s.cfg.MaxBodyBytes)
	if !ok {
		return
	}
	q, err := contracts.DecodeTenantQuota(data, tenant)
	if err != nil {
		writeInvalid(w, "invalid quota", err)
		return
	}
	q.UpdatedAt = s.now().UTC()
	kv := s.kv(w, r, contracts.BucketQuotas)
	if kv == nil {
		return
	}
	body, err := json.Marshal(q)
	if err != nil {
		s.internalError(w, "quota", err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	rev, ok := s.writeDoc(ctx, w, kv, tenant, body, want, has, "the quota of tenant "+tenant)
	if !ok {
		return
	}
	s.log.Info("quota set", "tenant", tenant, "revision", rev, "weight", q.EffectiveWeight(), "strict_fifo", q.StrictFIFO, "pools", len(q.Pools))
	writeJSON(w, http.StatusOK, contracts.QuotaDoc{Tenant: tenant, Quota: &q, Revision: rev})
}

func (s *server) deleteQuota(w http.ResponseWriter, r *http.Request) {
	if !admin(w, r) {
		return
	}
	tenant, ok := tenant(w, r)
	if !ok {
		return
	}
	want, has, ok := revisionParam(w, r)
	if !ok {
		return
	}
	kv := s.kv(w, r, contracts.BucketQuotas)
	if kv == nil {
		return
	}
	if !s.deleteDoc(r.Context(), w, kv, tenant, want, has, "the quota of tenant "+tenant) {
		return
	}
	s.log.Info("quota removed", "tenant", tenant)
	writeJSON(w, http.StatusOK, contracts.QuotaDoc{Tenant: tenant})
}

// --- pools ---

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

func (s *server) getPool(w http.ResponseWriter, r *http.Request) {
	pool, ok := poolName(w, r)
	if !ok || !s.modelReady(w) {
		return
	}
	kv := s.kv(w, r, contracts.BucketPools)
	if kv == nil {
		return
	}
	var c contracts.PoolConfig
	rev, err := readDoc(r.Context(), kv, pool, &c)
	if err != nil {
		s.internalError(w, "pool", err)
		return
	}
	doc := contracts.PoolDoc{Pool: pool, Nodes: len(s.nodes.list(pool))}
	if rev > 0 {
		doc.Config, doc.Revision = &c, rev
	}
	writeJSON(w, http.StatusOK, doc)
}

// listPools answers every configured pool and every pool of a known node.
func (s *server) listPools(w http.ResponseWriter, r *http.Request) {
	if !s.modelReady(w) {
		return
	}
	kv := s.kv(w, r, contracts.BucketPools)
	if kv == nil {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	entries, err := listDocs(ctx, kv)
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("reading the pools: %v", err), nil)
		return
	}
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
	for _, e := range entries {
		var c contracts.PoolConfig
		if err := json.Unmarshal(e.Value(), &c); err != nil {
			s.log.Warn("skipping a stored pool config that does not decode", "pool", e.Key(), "revision", e.Revision(), "err", err)
			continue
		}
		d := doc(e.Key())
		d.Config, d.Revision = &c, e.Revision()
	}
	list := contracts.PoolList{Pools: make([]contracts.PoolDoc, 0, len(pools))}
	for _, p := range slices.Sorted(maps.Keys(pools)) {
		list.Pools = append(list.Pools, *pools[p])
	}
	writeJSON(w, http.StatusOK, list)
}

// putPool replaces a pool's settings (contracts.DecodePoolConfig),
// conditionally with ?revision=N. A pool need not have nodes yet.
func (s *server) putPool(w http.ResponseWriter, r *http.Request) {
	if !admin(w, r) {
		return
	}
	pool, ok := poolName(w, r)
	if !ok {
		return
	}
	want, has, ok := revisionParam(w, r)
	if !ok {
		return
	}
	data, ok := readBody(w, r, s.cfg.MaxBodyBytes)
	if !ok {
		return
	}
	c, err := contracts.DecodePoolConfig(data, pool)
	if err != nil {
		writeInvalid(w, "invalid pool config", err)
		return
	}
	c.UpdatedAt = s.now().UTC()
	kv := s.kv(w, r, contracts.BucketPools)
	if kv == nil {
		return
	}
	body, err := json.Marshal(c)
	if err != nil {
		s.internalError(w, "pool", err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	rev, ok := s.writeDoc(ctx, w, kv, pool, body, want, has, "the config of pool "+pool)
	if !ok {
		return
	}
	s.log.Info("pool configured", "pool", pool, "revision", rev, "policy", c.Policy)
	writeJSON(w, http.StatusOK, contracts.PoolDoc{Pool: pool, Config: &c, Revision: rev, Nodes: len(s.nodes.list(pool))})
}

// deletePool returns a pool to the scheduler's defaults.
func (s *server) deletePool(w http.ResponseWriter, r *http.Request) {
	if !admin(w, r) {
		return
	}
	pool, ok := poolName(w, r)
	if !ok {
		return
	}
	want, has, ok := revisionParam(w, r)
	if !ok {
		return
	}
	kv := s.kv(w, r, contracts.BucketPools)
	if kv == nil {
		return
	}
	if !s.deleteDoc(r.Context(), w, kv, pool, want, has, "the config of pool "+pool) {
		return
	}
	s.log.Info("pool config removed", "pool", pool)
	writeJSON(w, http.StatusOK, contracts.PoolDoc{Pool: pool, Nodes: len(s.nodes.list(pool))})
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
// stops the drain (jobs already moved stay where they went).
func (s *server) holdNode(w http.ResponseWriter, r *http.Request, drain bool) {
	if !admin(w, r) {
		return
	}
	node, ok := nodeID(w, r)
	if !ok {
		return
	}
	data, ok := readBody(w, r, maxAdminBody)
	if !ok {
		return
	}
	req, err := contracts.DecodeNodeAdminRequest(data)
	if err != nil {
		writeInvalid(w, "invalid node hold", err)
		return
	}
	if !s.nodeModelReady(w) {
		return
	}
	st, ok := s.knownNode(w, node)
	if !ok {
		return
	}
	kv := s.kv(w, r, contracts.BucketNodeAdmin)
	if kv == nil {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	cur, rev, err := s.readHold(ctx, kv, node)
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("reading the hold of node %s: %v", node, err), nil)
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
	body, err := json.Marshal(hold)
	if err != nil {
		s.internalError(w, "node hold", err)
		return
	}
	newRev, err := putDoc(ctx, kv, node, body, rev, true)
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
	if !admin(w, r) {
		return
	}
	node, ok := nodeID(w, r)
	if !ok {
		return
	}
	data, ok := readBody(w, r, maxAdminBody)
	if !ok {
		return
	}
	req, err := contracts.DecodeNodeAdminRequest(data)
	if err != nil {
		writeInvalid(w, "invalid node hold", err)
		return
	}
	if !s.nodeModelReady(w) {
		return
	}
	kv := s.kv(w, r, contracts.BucketNodeAdmin)
	if kv == nil {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	cur, rev, err := s.readHold(ctx, kv, node)
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("reading the hold of node %s: %v", node, err), nil)
		return
	}
	st, known := s.nodes.node(node)
	switch {
	case !known && rev == 0:
		s.knownNode(w, node) // answers 404 unknown_node
		return
	case !known:
		st = contracts.NodeStatus{NodeInventory: contracts.NodeInventory{NodeID: node}}
	}
	st.Admin = nil
	if rev == 0 {
		writeJSON(w, http.StatusOK, st)
		return
	}
	if err := kv.Delete(ctx, node, jetstream.LastRevision(rev)); err != nil {
		writeKVError(w, err, fmt.Sprintf("the hold of node %s changed while this uncordon was written: retry", node), "deleting the hold of node "+node)
		return
	}
	// The delete marker's revision is above rev (revisions are the
	// bucket's stream sequence): the watch applies it too, or a later put.
	s.nodes.applyHold(node, nil, rev+1)
	s.log.Info("node uncordoned", "node_id", node, "reason", req.Reason, "was_draining", cur != nil && cur.Drain)
	writeJSON(w, http.StatusOK, st)
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
