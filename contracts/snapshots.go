package contracts

import "strconv"

// BucketSnapshots holds each scheduler's snapshot of its log of record
// (services/scheduler/snapshot.go): what a new leader loads before it
// replays the streams from the sequences the snapshot covers, instead of
// from their beginning (issue 17: a rebuild with a million jobs in the
// streams). A snapshot is only a shortcut: one that is missing, corrupt,
// of another schema or ahead of the streams is ignored and the streams
// are replayed whole. Keys: SnapshotHeadKey(name) names the slot and
// chunk count of the last complete snapshot; SnapshotChunkKey(name, slot,
// i) its chunks, each under MaxMessageBytes. A snapshot is written into
// the slot the head does not name, then the head is switched, so a
// writer that dies halfway leaves the previous snapshot whole.
const BucketSnapshots = "gp-snapshots"

// SnapshotHeadKey is the key of scheduler name's snapshot head.
func SnapshotHeadKey(name string) string { return "scheduler." + name + ".head" }

// SnapshotChunkKey is the key of chunk i of scheduler name's snapshot in
// slot (0 or 1).
func SnapshotChunkKey(name string, slot, i int) string {
	return "scheduler." + name + "." + string(rune('a'+slot)) + "." + strconv.Itoa(i)
}

// The resource manager's snapshot of its ledger (services/resource-manager
// /snapshot.go) lives in BucketSnapshots too, under keys of its own that
// every replica shares (the ledger is one, whichever replica leads):
// RMSnapshotHeadKey and RMSnapshotChunkKey, all matched by RMSnapshotKeys,
// the only keys the resource manager may write there.
const RMSnapshotKeys = "resource-manager.>"

// RMSnapshotHeadKey is the key of the resource manager's snapshot head.
func RMSnapshotHeadKey() string { return "resource-manager.head" }

// RMSnapshotChunkKey is the key of chunk i of the resource manager's
// snapshot in slot (0 or 1).
func RMSnapshotChunkKey(slot, i int) string {
	return "resource-manager." + string(rune('a'+slot)) + "." + strconv.Itoa(i)
}
