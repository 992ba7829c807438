package contracts

import "strconv"

// The gateway's snapshot of its read model (services/gateway
// /readmodel_snapshot.go) lives in BucketSnapshots under keys of its own
// that every replica shares (the read model is a pure fold of JOB_EVENTS,
// whichever replica wrote it): GatewaySnapshotHeadKey and
// GatewaySnapshotChunkKey, all matched by GatewaySnapshotKeys, the only
// keys the gateway may write there.
const GatewaySnapshotKeys = "gateway.>"

// GatewaySnapshotHeadKey is the key of the gateway's snapshot head.
func GatewaySnapshotHeadKey() string { return "gateway.head" }

// GatewaySnapshotChunkKey is the key of chunk i of the gateway's snapshot
// in slot (0 or 1).
func GatewaySnapshotChunkKey(slot, i int) string {
	return "gateway." + string(rune('a'+slot)) + "." + strconv.Itoa(i)
}

// Billing's checkpoint of what USAGE holds (services/billing/internal
// /biller/checkpoint.go) lives in BucketSnapshots under keys of its own
// that every replica shares (it is a pure fold of USAGE, whichever replica
// wrote it): BillingSnapshotHeadKey and BillingSnapshotChunkKey, all
// matched by BillingSnapshotKeys, the only keys billing may write there.
const BillingSnapshotKeys = "billing.>"

// BillingSnapshotHeadKey is the key of billing's checkpoint head.
func BillingSnapshotHeadKey() string { return "billing.head" }

// BillingSnapshotChunkKey is the key of chunk i of billing's checkpoint in
// slot (0 or 1).
func BillingSnapshotChunkKey(slot, i int) string {
	return "billing." + string(rune('a'+slot)) + "." + strconv.Itoa(i)
}
