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
