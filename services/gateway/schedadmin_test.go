package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// refusal is one bad request and the answer it must get.
type refusal struct {
	method, path, body string
	status             int
	reason             contracts.Reason
	field              string // "" when no field error is expected
	message            string // in the answer's message or one field's message
}

// refused sends tt and checks its status, reason, field and message.
func (h *harness) refused(t *testing.T, tt refusal) {
	t.Helper()
	var apiErr contracts.APIError
	got, data := h.do(tt.method, tt.path, tt.body, &apiErr, "Content-Type", "application/json")
	if got != tt.status || apiErr.Error.Reason != tt.reason {
		t.Fatalf("%s %s: status %d reason %q, want %d %q; body %s", tt.method, tt.path, got, apiErr.Error.Reason, tt.status, tt.reason, data)
	}
	if tt.field != "" && !hasField(apiErr.Error.Fields, tt.field) {
		t.Errorf("fields %+v do not name %q", apiErr.Error.Fields, tt.field)
	}
	if !strings.Contains(string(data), tt.message) {
		t.Errorf("answer %s lacks %q", data, tt.message)
	}
}

// kvGet reads key of bucket straight from JetStream, as the scheduler does.
func (h *harness) kvGet(bucket, key string, v any) (uint64, error) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	kv, err := h.bus.KeyValue(ctx, bucket)
	if err != nil {
		h.t.Fatal(err)
	}
	e, err := kv.Get(ctx, key)
	if err != nil {
		return 0, err
	}
	if err := json.Unmarshal(e.Value(), v); err != nil {
		h.t.Fatalf("%s/%s: %v", bucket, key, err)
	}
	return e.Revision(), nil
}

func (h *harness) kvPut(bucket, key string, value []byte) uint64 {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	kv, err := h.bus.KeyValue(ctx, bucket)
	if err != nil {
		h.t.Fatal(err)
	}
	rev, err := kv.Put(ctx, key, value)
	if err != nil {
		h.t.Fatal(err)
	}
	return rev
}

func TestQuotaRequestsValidated(t *testing.T) {
	h := startGateway(t, nil, nil)
	const path = "/v1/quotas/acme"
	tests := map[string]refusal{
		"max under guarantee": {http.MethodPut, path, `{"pools":{"h100":{"guarantee":8,"max":4}}}`, 400, contracts.ReasonOutOfRange,
			"pools.h100.max", "max 4 GPUs; want at least the guarantee (8)"},
		"negative guarantee": {http.MethodPut, path, `{"pools":{"*":{"guarantee":-1}}}`, 400, contracts.ReasonOutOfRange,
			"pools.*.guarantee", "guarantee -1 GPUs"},
		"weight too large": {http.MethodPut, path, `{"weight":5000}`, 400, contracts.ReasonOutOfRange, "weight", "weight 5000"},
		"bad pool name": {http.MethodPut, path, `{"pools":{"H100.x":{"guarantee":1}}}`, 400, contracts.ReasonInvalidValue,
			"pools.H100.x", `invalid pool \"H100.x\"`},
		"other tenant": {http.MethodPut, path, `{"tenant":"beta"}`, 400, contracts.ReasonTenantMismatch, "tenant",
			`quota names tenant \"beta\" but is stored for \"acme\"`},
		"unknown field":    {http.MethodPut, path, `{"weigth":2}`, 400, contracts.ReasonUnknownField, "weigth", "invalid quota"},
		"weight as string": {http.MethodPut, path, `{"weight":"2"}`, 400, contracts.ReasonInvalidType, "weight", "invalid quota"},
		"empty body":       {http.MethodPut, path, ``, 400, contracts.ReasonEmptyBody, "", "body is empty"},
		"not json":         {http.MethodPut, path, `weight=2`, 400, contracts.ReasonInvalidJSON, "", "invalid quota"},
		"several problems": {http.MethodPut, path, `{"weight":-1,"pools":{"x.y":{}}}`, 400, contracts.ReasonInvalidRequest, "weight", "pools.x.y"},
		"bad tenant":       {http.MethodPut, "/v1/quotas/Acme", `{}`, 400, contracts.ReasonInvalidTenant, "tenant", "invalid tenant"},
		"bad revision":     {http.MethodPut, path + "?revision=latest", `{}`, 400, contracts.ReasonInvalidValue, "revision", "revision \\\"latest\\\""},
		"get bad tenant":   {http.MethodGet, "/v1/quotas/a.b", ``, 400, contracts.ReasonInvalidTenant, "tenant", "invalid tenant"},
		"delete bad rev":   {http.MethodDelete, path + "?revision=-1", ``, 400, contracts.ReasonInvalidValue, "revision", "revision"},
		"post":             {http.MethodPost, path, `{}`, 405, contracts.ReasonMethodNotAllowed, "", "allowed: DELETE, GET, PUT, HEAD"},
		"put on the list":  {http.MethodPut, "/v1/quotas", `{}`, 405, contracts.ReasonMethodNotAllowed, "", "allowed: GET, HEAD"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) { h.refused(t, tt) })
	}
	var q contracts.TenantQuota
	if _, err := h.kvGet(contracts.BucketQuotas, "acme", &q); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("a refused quota was stored: %+v, %v", q, err)
	}
}

func TestQuotaEdits(t *testing.T) {
	h := startGateway(t, nil, nil)
	var doc contracts.QuotaDoc
	if status, body := h.do(http.MethodGet, "/v1/quotas/acme", "", fresh(&doc)); status != 200 || doc.Quota != nil || doc.Tenant != "acme" || doc.Revision != 0 {
		t.Fatalf("GET of no quota: %d %s", status, body)
	}
	var list contracts.QuotaList
	if status, body := h.do(http.MethodGet, "/v1/quotas", "", fresh(&list)); status != 200 || list.Quotas == nil || len(list.Quotas) != 0 {
		t.Fatalf("GET of no quotas: %d %s", status, body)
	}

	status, body := h.do(http.MethodPut, "/v1/quotas/acme", `{"weight":2,"strictFifo":true,"pools":{"h100":{"guarantee":8,"max":16},"*":{"guarantee":1}}}`, fresh(&doc))
	if status != 200 || doc.Revision == 0 || doc.Quota == nil {
		t.Fatalf("PUT: %d %s", status, body)
	}
	sixteen := 16.0
	want := contracts.TenantQuota{SchemaVersion: contracts.SchemaVersion, Tenant: "acme", Weight: 2, StrictFIFO: true,
		Pools: map[string]contracts.PoolQuota{"h100": {Guarantee: 8, Max: &sixteen}, "*": {Guarantee: 1}}, UpdatedAt: doc.Quota.UpdatedAt}
	if doc.Quota.UpdatedAt.IsZero() || time.Since(doc.Quota.UpdatedAt) > time.Minute {
		t.Errorf("updatedAt %s; want now", doc.Quota.UpdatedAt)
	}
	if diff := cmp.Diff(want, *doc.Quota); diff != "" {
		t.Fatalf("PUT answered (-want +got):\n%s", diff)
	}
	// What the scheduler reads is what was answered.
	var stored contracts.TenantQuota
	if rev, err := h.kvGet(contracts.BucketQuotas, "acme", &stored); err != nil || rev != doc.Revision {
		t.Fatalf("KV holds revision %d (%v), want %d", rev, err, doc.Revision)
	}
	if diff := cmp.Diff(want, stored, cmpTime); diff != "" {
		t.Fatalf("KV holds (-want +got):\n%s", diff)
	}
	rev := doc.Revision

	// Compare-and-set: a stale revision loses, and so does "create" of an
	// existing quota; the current revision wins.
	for _, q := range []string{fmt.Sprintf("?revision=%d", rev+10), "?revision=0"} {
		h.refused(t, refusal{http.MethodPut, "/v1/quotas/acme" + q, `{"weight":3}`, 409, contracts.ReasonConflict, "", "read it again"})
	}
	if status, body := h.do(http.MethodPut, fmt.Sprintf("/v1/quotas/acme?revision=%d", rev), `{"weight":3}`, fresh(&doc)); status != 200 ||
		doc.Revision <= rev || doc.Quota.Weight != 3 || doc.Quota.Pools != nil {
		t.Fatalf("PUT at the current revision: %d %s", status, body)
	}
	rev = doc.Revision
	if status, body := h.do(http.MethodPut, "/v1/quotas/beta?revision=0", `{"tenant":"beta","pools":{"l4":{"guarantee":0.5}}}`, fresh(&doc)); status != 200 {
		t.Fatalf("create beta: %d %s", status, body)
	}
	if status, body := h.do(http.MethodGet, "/v1/quotas", "", fresh(&list)); status != 200 || len(list.Quotas) != 2 ||
		list.Quotas[0].Tenant != "acme" || list.Quotas[0].Revision != rev || list.Quotas[0].Quota.Weight != 3 ||
		list.Quotas[1].Tenant != "beta" || list.Quotas[1].Quota.Pools["l4"].Guarantee != 0.5 {
		t.Fatalf("list: %d %s", status, body)
	}
	if status, body := h.do(http.MethodGet, "/v1/quotas/acme", "", fresh(&doc)); status != 200 || doc.Revision != rev || doc.Quota.Weight != 3 {
		t.Fatalf("GET: %d %s", status, body)
	}

	h.refused(t, refusal{http.MethodDelete, fmt.Sprintf("/v1/quotas/acme?revision=%d", rev+10), "", 409, contracts.ReasonConflict, "", "no longer at revision"})
	if status, body := h.do(http.MethodDelete, "/v1/quotas/acme", "", fresh(&doc)); status != 200 || doc.Quota != nil || doc.Tenant != "acme" {
		t.Fatalf("DELETE: %d %s", status, body)
	}
	if _, err := h.kvGet(contracts.BucketQuotas, "acme", &stored); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("deleted quota still in KV: %v", err)
	}
	if h.do(http.MethodGet, "/v1/quotas", "", fresh(&list)); len(list.Quotas) != 1 || list.Quotas[0].Tenant != "beta" {
		t.Fatalf("list after DELETE: %+v", list)
	}
	// A deleted quota can be created again with revision=0.
	if status, body := h.do(http.MethodPut, "/v1/quotas/acme?revision=0", `{}`, fresh(&doc)); status != 200 || doc.Quota == nil {
		t.Fatalf("re-create: %d %s", status, body)
	}
	// A value the gateway cannot read is left out of the list, not a 500.
	h.kvPut(contracts.BucketQuotas, "gamma", []byte("not json"))
	if status, _ := h.do(http.MethodGet, "/v1/quotas", "", fresh(&list)); status != 200 || len(list.Quotas) != 2 {
		t.Fatalf("list with a broken value: %d %+v", status, list)
	}
}

// fresh zeroes *v and returns v, so that a decoded answer never keeps a
// field of the previous one (encoding/json leaves absent fields alone).
func fresh[T any](v *T) *T {
	var zero T
	*v = zero
	return v
}

// cmpTime compares times by instant (a JSON round trip drops the monotonic
// clock and the location).
var cmpTime = cmp.Comparer(func(a, b time.Time) bool { return a.Equal(b) })

func TestPoolEdits(t *testing.T) {
	h := startGateway(t, nil, nil)
	l4 := inventory("l4-1", "sim")
	l4.Pool = "l4"
	for _, inv := range []contracts.NodeInventory{inventory("h-1", "sim"), inventory("h-2", "sim"), l4} {
		h.publishInventory(inv, 1)
		h.waitNode(inv.NodeID)
	}
	var list contracts.PoolList
	if status, body := h.do(http.MethodGet, "/v1/pools", "", fresh(&list)); status != 200 ||
		!cmp.Equal(list.Pools, []contracts.PoolDoc{{Pool: "h100", Nodes: 2}, {Pool: "l4", Nodes: 1}}) {
		t.Fatalf("pools from the inventory: %d %s", status, body)
	}
	tests := map[string]refusal{
		"invalid policy": {http.MethodPut, "/v1/pools/h100", `{"policy":"random"}`, 400, contracts.ReasonInvalidValue, "policy",
			`unknown policy \"random\"; want one of [binpack spread topology fragaware]`},
		"no policy":     {http.MethodPut, "/v1/pools/h100", `{}`, 400, contracts.ReasonInvalidValue, "policy", `unknown policy \"\"`},
		"other pool":    {http.MethodPut, "/v1/pools/h100", `{"pool":"l4","policy":"spread"}`, 400, contracts.ReasonInvalidValue, "pool", "stored for"},
		"bad pool":      {http.MethodPut, "/v1/pools/H100", `{"policy":"spread"}`, 400, contracts.ReasonInvalidValue, "pool", `invalid pool \"H100\"`},
		"all pools":     {http.MethodPut, "/v1/pools/*", `{"policy":"spread"}`, 400, contracts.ReasonInvalidValue, "pool", `invalid pool \"*\"`},
		"unknown field": {http.MethodPut, "/v1/pools/h100", `{"policy":"spread","weight":1}`, 400, contracts.ReasonUnknownField, "weight", "invalid pool config"},
		"get bad pool":  {http.MethodGet, "/v1/pools/H.1", ``, 400, contracts.ReasonInvalidValue, "pool", "invalid pool"},
		"post":          {http.MethodPost, "/v1/pools/h100", `{}`, 405, contracts.ReasonMethodNotAllowed, "", "allowed: DELETE, GET, PUT, HEAD"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) { h.refused(t, tt) })
	}

	var doc contracts.PoolDoc
	if status, body := h.do(http.MethodPut, "/v1/pools/h100", `{"policy":"binpack"}`, fresh(&doc)); status != 200 || doc.Revision == 0 ||
		doc.Nodes != 2 || doc.Config == nil || doc.Config.Policy != contracts.PolicyBinpack || doc.Config.Pool != "h100" ||
		doc.Config.SchemaVersion != contracts.SchemaVersion || doc.Config.UpdatedAt.IsZero() {
		t.Fatalf("PUT h100: %d %s", status, body)
	}
	var stored contracts.PoolConfig
	if rev, err := h.kvGet(contracts.BucketPools, "h100", &stored); err != nil || rev != doc.Revision || stored.Policy != contracts.PolicyBinpack {
		t.Fatalf("KV: %+v at %d, %v", stored, rev, err)
	}
	h.refused(t, refusal{http.MethodPut, fmt.Sprintf("/v1/pools/h100?revision=%d", doc.Revision+5), `{"policy":"spread"}`, 409,
		contracts.ReasonConflict, "", "the config of pool h100 is no longer at revision"})
	// A pool may be configured before it has nodes.
	if status, body := h.do(http.MethodPut, "/v1/pools/a100?revision=0", `{"policy":"spread"}`, fresh(&doc)); status != 200 || doc.Nodes != 0 {
		t.Fatalf("PUT a100: %d %s", status, body)
	}
	if status, body := h.do(http.MethodGet, "/v1/pools/h100", "", fresh(&doc)); status != 200 || doc.Config.Policy != contracts.PolicyBinpack || doc.Nodes != 2 {
		t.Fatalf("GET h100: %d %s", status, body)
	}
	h.do(http.MethodGet, "/v1/pools", "", fresh(&list))
	got := map[string]string{}
	for _, p := range list.Pools {
		policy := "-"
		if p.Config != nil {
			policy = string(p.Config.Policy)
		}
		got[p.Pool] = fmt.Sprintf("%s/%d", policy, p.Nodes)
	}
	if diff := cmp.Diff(map[string]string{"a100": "spread/0", "h100": "binpack/2", "l4": "-/1"}, got); diff != "" || list.Pools[0].Pool != "a100" {
		t.Fatalf("list (-want +got):\n%s", diff)
	}
	if status, body := h.do(http.MethodDelete, "/v1/pools/h100", "", fresh(&doc)); status != 200 || doc.Config != nil || doc.Nodes != 2 {
		t.Fatalf("DELETE: %d %s", status, body)
	}
	if status, body := h.do(http.MethodGet, "/v1/pools/h100", "", fresh(&doc)); status != 200 || doc.Config != nil || doc.Revision != 0 {
		t.Fatalf("GET after DELETE: %d %s", status, body)
	}
}

func TestNodeHolds(t *testing.T) {
	h := startGateway(t, nil, nil)
	inv := inventory("sim-1", "sim")
	inv.Zone, inv.Purpose = "zone-a", "training"
	inv.Labels = map[string]string{"rack": "r1"}
	inv.Taints = []contracts.Taint{{Key: "spot", Value: "true", Effect: contracts.TaintNoSchedule}}
	h.publishInventory(inv, 1)
	h.publishInventory(inventory("sim-2", "sim"), 1)
	h.waitNode("sim-1")
	h.waitNode("sim-2")

	var st contracts.NodeStatus
	status, body := h.do(http.MethodPost, "/v1/nodes/sim-1/cordon", `{"reason":"fan noise"}`, fresh(&st))
	if status != 200 || st.NodeID != "sim-1" || st.Admin == nil || !st.Admin.Cordoned || st.Admin.Drain ||
		st.Admin.Reason != "fan noise" || st.Admin.NodeID != "sim-1" || st.Admin.Time.IsZero() {
		t.Fatalf("cordon: %d %s", status, body)
	}
	first := *st.Admin
	var stored contracts.NodeAdmin
	if _, err := h.kvGet(contracts.BucketNodeAdmin, "sim-1", &stored); err != nil || !cmp.Equal(first, stored, cmpTime) {
		t.Fatalf("KV holds %+v (%v), want %+v", stored, err, first)
	}
	// Read your writes: the node shows its hold at once, with what its
	// inventory says about where it is and who may run there.
	if h.do(http.MethodGet, "/v1/nodes/sim-1", "", fresh(&st)); st.Admin == nil || !st.Admin.Cordoned {
		t.Fatalf("GET after cordon: %+v", st.Admin)
	}
	var list contracts.NodeList
	h.do(http.MethodGet, "/v1/nodes", "", fresh(&list))
	if len(list.Nodes) != 2 || list.Nodes[0].Admin == nil || list.Nodes[1].Admin != nil || list.Nodes[0].Zone != "zone-a" ||
		list.Nodes[0].Purpose != "training" || list.Nodes[0].Labels["rack"] != "r1" || len(list.Nodes[0].Taints) != 1 {
		t.Fatalf("list: %+v", list.Nodes)
	}
	// Cordoning again changes nothing; a new reason replaces the old.
	if h.do(http.MethodPost, "/v1/nodes/sim-1/cordon", "", fresh(&st)); !cmp.Equal(*st.Admin, first, cmpTime) {
		t.Fatalf("second cordon changed the hold: %+v, was %+v", st.Admin, first)
	}
	if h.do(http.MethodPost, "/v1/nodes/sim-1/cordon", `{"reason":"new fan"}`, fresh(&st)); st.Admin.Reason != "new fan" {
		t.Fatalf("cordon with a new reason: %+v", st.Admin)
	}
	// Drain, then cordon stops the drain.
	if status, body := h.do(http.MethodPost, "/v1/nodes/sim-1/drain", `{"reason":"maintenance"}`, fresh(&st)); status != 200 ||
		!st.Admin.Cordoned || !st.Admin.Drain || st.Admin.Reason != "maintenance" {
		t.Fatalf("drain: %d %s", status, body)
	}
	if h.kvGet(contracts.BucketNodeAdmin, "sim-1", &stored); !stored.Drain {
		t.Fatalf("KV after drain: %+v", stored)
	}
	if h.do(http.MethodPost, "/v1/nodes/sim-1/cordon", "", fresh(&st)); !st.Admin.Cordoned || st.Admin.Drain {
		t.Fatalf("cordon of a draining node: %+v", st.Admin)
	}
	// Uncordon deletes the key; again is a no-op.
	for range 2 {
		if status, body := h.do(http.MethodPost, "/v1/nodes/sim-1/uncordon", "", fresh(&st)); status != 200 || st.Admin != nil || st.NodeID != "sim-1" {
			t.Fatalf("uncordon: %d %s", status, body)
		}
		if _, err := h.kvGet(contracts.BucketNodeAdmin, "sim-1", &stored); !errors.Is(err, jetstream.ErrKeyNotFound) {
			t.Fatalf("hold still in KV after uncordon: %v", err)
		}
		if h.do(http.MethodGet, "/v1/nodes/sim-1", "", fresh(&st)); st.Admin != nil {
			t.Fatalf("GET after uncordon: %+v", st.Admin)
		}
	}

	// A hold written by another writer (another gateway replica, the CLI
	// on the bus) shows through the watch, and a garbled one is replaced.
	other, _ := json.Marshal(contracts.NodeAdmin{SchemaVersion: 1, NodeID: "sim-2", Cordoned: true, Drain: true, Reason: "elsewhere"})
	h.kvPut(contracts.BucketNodeAdmin, "sim-2", other)
	h.eventually("sim-2 drained through the watch", func() bool {
		h.do(http.MethodGet, "/v1/nodes/sim-2", "", fresh(&st))
		return st.Admin != nil && st.Admin.Drain && st.Admin.Reason == "elsewhere"
	})
	h.kvPut(contracts.BucketNodeAdmin, "sim-2", []byte("{garbled"))
	if status, body := h.do(http.MethodPost, "/v1/nodes/sim-2/cordon", "", fresh(&st)); status != 200 || st.Admin == nil || st.Admin.Drain {
		t.Fatalf("cordon over a garbled hold: %d %s", status, body)
	}
	// A hold on a node no agent announces can still be released.
	gone, _ := json.Marshal(contracts.NodeAdmin{SchemaVersion: 1, NodeID: "gone-1", Cordoned: true})
	h.kvPut(contracts.BucketNodeAdmin, "gone-1", gone)
	if status, body := h.do(http.MethodPost, "/v1/nodes/gone-1/uncordon", "", fresh(&st)); status != 200 || st.NodeID != "gone-1" || st.Admin != nil {
		t.Fatalf("uncordon of a node without inventory: %d %s", status, body)
	}

	long := strings.Repeat("x", contracts.MaxAdminReason+1)
	tests := map[string]refusal{
		"cordon unknown node":   {http.MethodPost, "/v1/nodes/ghost/cordon", "", 404, contracts.ReasonUnknownNode, "", "no node ghost"},
		"drain unknown node":    {http.MethodPost, "/v1/nodes/ghost/drain", `{"reason":"x"}`, 404, contracts.ReasonUnknownNode, "", "no node ghost"},
		"uncordon unknown node": {http.MethodPost, "/v1/nodes/ghost/uncordon", "", 404, contracts.ReasonUnknownNode, "", "no node ghost"},
		"bad node id":           {http.MethodPost, "/v1/nodes/a.b/cordon", "", 400, contracts.ReasonInvalidID, "node", "invalid id"},
		"unknown field":         {http.MethodPost, "/v1/nodes/sim-1/cordon", `{"why":"x"}`, 400, contracts.ReasonUnknownField, "why", "invalid node hold"},
		"reason not a string":   {http.MethodPost, "/v1/nodes/sim-1/drain", `{"reason":7}`, 400, contracts.ReasonInvalidType, "reason", "invalid node hold"},
		"reason too long":       {http.MethodPost, "/v1/nodes/sim-1/cordon", `{"reason":"` + long + `"}`, 400, contracts.ReasonOutOfRange, "reason", "reason is 1025 characters, limit is 1024"},
		"not json":              {http.MethodPost, "/v1/nodes/sim-1/uncordon", `please`, 400, contracts.ReasonInvalidJSON, "", "invalid node hold"},
		"body too large":        {http.MethodPost, "/v1/nodes/sim-1/cordon", `{"reason":"` + strings.Repeat("x", maxAdminBody) + `"}`, 413, contracts.ReasonTooLarge, "", "exceeds the limit"},
		"get cordon":            {http.MethodGet, "/v1/nodes/sim-1/cordon", "", 405, contracts.ReasonMethodNotAllowed, "", "allowed: POST"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) { h.refused(t, tt) })
	}
	if _, err := h.kvGet(contracts.BucketNodeAdmin, "ghost", &stored); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("a refused hold was stored: %v", err)
	}
}
