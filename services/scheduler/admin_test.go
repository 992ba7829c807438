package scheduler

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

func (e *env) putKV(bucket, key string, v any) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	kv, err := e.bus.KeyValue(ctx, bucket)
	if err != nil {
		e.t.Fatal(err)
	}
	data, err := json.Marshal(v)
	if err != nil {
		e.t.Fatal(err)
	}
	if _, err := kv.Put(ctx, key, data); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) deleteKV(bucket, key string) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	kv, err := e.bus.KeyValue(ctx, bucket)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := kv.Delete(ctx, key); err != nil {
		e.t.Fatal(err)
	}
}

// TestQuotaChangesApplyLive sets a tenant's quota in the gp-quotas bucket
// before the scheduler starts (it must be known before the first cycle),
// then raises it while jobs wait: the change applies without a restart.
func TestQuotaChangesApplyLive(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	one := 1.0
	e.putKV(contracts.BucketQuotas, "acme", contracts.TenantQuota{Tenant: "acme",
		Pools: map[string]contracts.PoolQuota{"east": {Max: &one}}})
	e.inventory("h100-01", "east", h100, 8)
	e.start()
	e.submit("acme", request("first", 1, h100))
	e.submit("acme", request("second", 1, h100))
	e.waitItem("acme", "first", 1, "")
	p := e.waitEvent("acme", "second", contracts.EventPending)
	if p.Reason != contracts.PendingQuotaExceeded || !strings.Contains(p.Message, "quota acme/east at 1 of 1 GPUs") {
		t.Fatalf("pending %+v", p)
	}
	two := 2.0
	e.putKV(contracts.BucketQuotas, "acme", contracts.TenantQuota{Tenant: "acme",
		Pools: map[string]contracts.PoolQuota{"east": {Max: &two}}})
	e.waitItem("acme", "second", 1, "")
}

// TestCordonedNodesTakeNoWork cordons a node in the gp-node-admin bucket:
// jobs go to the other node, and to the cordoned one once it is lifted.
func TestCordonedNodesTakeNoWork(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.putKV(contracts.BucketNodeAdmin, "h100-01", contracts.NodeAdmin{NodeID: "h100-01", Cordoned: true, Reason: "bad fan"})
	// An invalid pool setting is ignored, not fatal.
	e.putKV(contracts.BucketPools, "east", map[string]string{"pool": "east", "policy": "random"})
	e.inventory("h100-01", "east", h100, 8)
	e.inventory("h100-02", "east", h100, 1)
	e.start()
	e.submit("acme", request("a", 1, h100))
	if a := e.waitItem("acme", "a", 1, ""); a.NodeID != "h100-02" {
		t.Fatalf("placed on %s, want the uncordoned h100-02", a.NodeID)
	}
	e.submit("acme", request("b", 2, h100))
	p := e.waitEvent("acme", "b", contracts.EventPending)
	if p.Reason != contracts.PendingNoSchedulableNode && p.Reason != contracts.PendingInsufficientGPUs {
		t.Fatalf("pending %+v", p)
	}
	e.deleteKV(contracts.BucketNodeAdmin, "h100-01")
	if b := e.waitItem("acme", "b", 1, ""); b.NodeID != "h100-01" {
		t.Fatalf("placed on %s after uncordon", b.NodeID)
	}
}
