package ledger

import (
	"crypto/sha256"
	"encoding/binary"
	"slices"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// Retirement (issue 17: a million jobs in the streams). A released
// allocation leaves the ledger but for a fixed-size record of what later
// decisions still ask of it: a late or redelivered commit of its ID must
// get the answer it got while live (Duplicate for the identical
// placement, job_already_allocated for another), a commit or release
// read again must stay a no-op, and a run fact about it must learn that
// it is known, not live, and on which node. Nothing else reads an ended
// allocation. So the ledger's memory is its live allocations plus ~35
// bytes per ended one (the 28-byte record in a libs/recset, and its
// index's slot), not every allocation's devices, run spec and trace
// context. A Go map and a log beside it took ~100 (BenchmarkHistoryMemory).
//
// Nor is the record kept for ever: a late commit of an ended allocation
// can only come from a plan stored before it ended, and a plan older than
// the plans' maximum age is refused whatever the ledger holds (the
// server's plan_expired, judged on Clock). So a record is kept in a
// recset.Window for that age plus a margin after its release, and then
// forgotten: the ledger's memory is its live allocations plus the
// allocations ended within about a day, not every one that ever ended.
//
// Every date is a JetStream stream timestamp (the caller's to pass in the
// entry's Time): the one clock that also stamps the plans, and one that
// is in the log, so replicas, replays and snapshots agree. A resource
// manager's own clock dates nothing: one running behind would have its
// records forgotten while their plans were still young.

// DefaultMargin is how much longer than the plans' maximum age a retired
// record is kept by default: room for the NATS servers' clocks to
// disagree (a stream's leader stamps its messages) and for the seconds
// between a plan's stamp and its commit.
const DefaultMargin = time.Hour

// Keep is how long a retired record is kept for plans of at most
// planMaxAge, with margin.
func Keep(planMaxAge, margin time.Duration) time.Duration { return planMaxAge + margin }

// retiredKey identifies a retired allocation: the first 128 bits of the
// SHA-256 of its ID (a collision among even 10^12 IDs is ~10^-15 likely).
type retiredKey [16]byte

func retiredKeyOf(id string) retiredKey {
	h := sha256.Sum256([]byte(id))
	return retiredKey(h[:16])
}

// retiredAlloc is what is kept of a retired allocation.
type retiredAlloc struct {
	// place is placementHash of the allocation as committed (or as its
	// release named it, when the release came first).
	place uint64
	// node is the index of its node in Ledger.nodeIDs.
	node uint32
}

// placementHash is the first 64 bits of the SHA-256 of what samePlacement
// compares (beside the ID, which the record's key holds): the node and
// the multiset of what the devices claim, in a canonical order. Two
// placements samePlacement tells apart hash apart but with a chance of
// 2^-64.
func placementHash(a contracts.Allocation) uint64 {
	keys := make([]string, len(a.Devices))
	for i, d := range a.Devices {
		keys[i] = deviceKey(d)
	}
	slices.Sort(keys)
	h := sha256.New()
	h.Write([]byte(a.NodeID))
	for _, k := range keys {
		h.Write([]byte{0})
		h.Write([]byte(k))
	}
	var sum [sha256.Size]byte
	return binary.BigEndian.Uint64(h.Sum(sum[:0]))
}

// retire records r under k, which must be new, retired at t.
func (l *Ledger) retire(k retiredKey, r retiredAlloc, t time.Time) {
	var rec [RetiredRecordSize]byte
	l.retired.Add(appendRetired(rec[:0], k, r), t)
}

// retiredOf is the retired record of k, if there is one.
func (l *Ledger) retiredOf(k retiredKey) (retiredAlloc, bool) {
	rec, ok := l.retired.Get(k[:])
	if !ok {
		return retiredAlloc{}, false
	}
	return decodeRetired(rec), true
}

// isRetired says whether k has a retired record.
func (l *Ledger) isRetired(k retiredKey) bool { return l.retired.Has(k[:]) }

// decodeRetired reads what appendRetired wrote (after the key).
func decodeRetired(rec []byte) retiredAlloc {
	return retiredAlloc{place: binary.BigEndian.Uint64(rec[16:24]), node: binary.BigEndian.Uint32(rec[24:28])}
}

// appendRetired appends the RetiredRecordSize-byte encoding of a record.
func appendRetired(b []byte, k retiredKey, r retiredAlloc) []byte {
	b = append(b, k[:]...)
	b = binary.BigEndian.AppendUint64(b, r.place)
	return binary.BigEndian.AppendUint32(b, r.node)
}

// Retired is the number of retired allocation records.
func (l *Ledger) Retired() int { return l.retired.Len() }

// Clock is the latest date of an entry applied (zero before any dated
// one): the log's own now, which forgetting retired records follows.
func (l *Ledger) Clock() time.Time { return l.retired.Clock() }

// RetiredBytes is the memory the retired records hold (records and
// their index).
func (l *Ledger) RetiredBytes() int { return l.retired.Bytes() }

// Records is the number of whole allocations the ledger holds: its live
// ones (what grows with the fleet, not with history).
func (l *Ledger) Records() int { return len(l.allocs) }
