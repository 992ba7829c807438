package ledger

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/recset"
)

// State is what a snapshot keeps of a ledger: what the allocation log made
// of it, and nothing the other logs set (inventories, readiness, holds),
// which a rebuild reads from them as it always does.
type State struct {
	// Nodes are the nodes the ledger knows with the last ledger sequence
	// applied on each (the expected sequence of the next compare-and-set
	// there); a retired record names its node by its index here.
	Nodes []NodeSeq `json:"nodes"`
	// Live are the live allocations in commit order.
	Live []contracts.Allocation `json:"live"`
	// Retired are the retired records, RetiredRecordSize bytes each, in
	// pieces whose concatenation is the records (Export: the views of the
	// ledger's chunks; a decoded snapshot: one piece): the key (16), the
	// placement hash (8, big-endian) and the node's index in Nodes (4,
	// big-endian).
	Retired [][]byte `json:"-"`
	// RetiredBuckets say which window bucket the records are in: the
	// first Records of Retired in the first bucket, and so on (their
	// Chunks unused); RetiredSpan is a bucket's length in nanoseconds
	// (recset.Window.Span: a ledger keeping records for another time
	// reads them by their buckets' ends).
	RetiredBuckets []recset.Bucket `json:"retiredBuckets,omitempty"`
	RetiredSpan    int64           `json:"retiredSpan,omitempty"`
	// Clock is the ledger's clock (Ledger.Clock).
	Clock time.Time `json:"clock,omitzero"`
}

// NodeSeq is a node and the last ledger sequence applied on it.
type NodeSeq struct {
	ID      string `json:"id"`
	LastSeq uint64 `json:"lastSeq"`
}

// RetiredRecordSize is the size of one record in State.Retired.
const RetiredRecordSize = 28

// RetiredLen is the size of st.Retired's records in bytes.
func (st State) RetiredLen() int {
	n := 0
	for _, p := range st.Retired {
		n += len(p)
	}
	return n
}

// ErrBadState says a State cannot be loaded.
var ErrBadState = errors.New("ledger: unusable state")

// Export returns the ledger's state, which stays valid however the ledger
// changes after: its nodes and live allocations are copied, and its
// retired records are views of append-only chunks, shared (the caller
// must not write to them). O(nodes + live allocations), not O(history):
// a snapshot is taken under the owner's lock.
func (l *Ledger) Export() State {
	st := State{Nodes: make([]NodeSeq, len(l.nodeIDs)), Live: make([]contracts.Allocation, 0, len(l.allocs)),
		RetiredBuckets: l.retired.Buckets(), RetiredSpan: l.retired.Span(), Clock: l.retired.Clock()}
	for i, b := range st.RetiredBuckets {
		st.Retired = append(st.Retired, b.Chunks...)
		st.RetiredBuckets[i].Chunks = nil
	}
	for i, id := range l.nodeIDs {
		st.Nodes[i] = NodeSeq{ID: id, LastSeq: l.nodes[id].lastSeq}
	}
	live := make([]*record, 0, len(l.allocs))
	for _, r := range l.allocs {
		live = append(live, r)
	}
	slices.SortFunc(live, func(a, b *record) int { return cmp.Compare(a.order, b.order) })
	for _, r := range live {
		st.Live = append(st.Live, r.alloc)
	}
	return st
}

// FromState returns a ledger keeping retired records for keep (New)
// holding st: its nodes' sequences, its live allocations committed again
// in their order (so every claim is where the log put it, a conflict the
// log holds included), its retired records in their buckets and its
// clock. A state of buckets of another length (another keep) has each
// bucket's records dated by the bucket's end, which forgets none sooner
// than its own date says. Inventories, readiness and holds are for the
// caller to set.
func FromState(st State, keep time.Duration) (*Ledger, error) {
	l := New(keep)
	for _, n := range st.Nodes {
		if _, dup := l.nodes[n.ID]; dup || n.ID == "" {
			return nil, fmt.Errorf("%w: node %q empty or listed twice", ErrBadState, n.ID)
		}
		l.node(n.ID).lastSeq = n.LastSeq
	}
	for _, a := range st.Live {
		if a.ID == "" || a.NodeID == "" {
			return nil, fmt.Errorf("%w: live allocation %q on node %q", ErrBadState, a.ID, a.NodeID)
		}
		if _, dup := l.allocs[a.ID]; dup {
			return nil, fmt.Errorf("%w: live allocation %s listed twice", ErrBadState, a.ID)
		}
		// ErrConflict: the log holds a device twice, and so does the
		// ledger it made; the rebuild from the log said so already.
		_ = l.commit(l.node(a.NodeID), a)
	}
	// The records are read where they lie (Window.Restore): joining the
	// pieces first would copy every record once more, ~28 MB per million
	// ended allocations while a restart loads.
	if err := l.retired.Restore(st.Clock, st.RetiredSpan, st.RetiredBuckets, st.Retired, func(r []byte) error {
		if d := decodeRetired(r); int(d.node) >= len(st.Nodes) {
			return fmt.Errorf("retired record names node %d of %d", d.node, len(st.Nodes))
		}
		if l.retired.Has(r) {
			return errors.New("a retired record listed twice")
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadState, err)
	}
	for _, a := range st.Live {
		if l.isRetired(retiredKeyOf(a.ID)) {
			return nil, fmt.Errorf("%w: allocation %s both live and retired", ErrBadState, a.ID)
		}
	}
	return l, nil
}

// Digest is a hash of everything the allocation log decides in the
// ledger, independent of the order in which nodes became known and of
// how entries of different nodes interleaved: per node its last sequence,
// live allocations, claims in order and host use; the jobs' live
// allocations; the retired records. Two ledgers with the same digest
// answer every Verify, Allocation and LastSeq alike (given the same
// inventories, readiness and holds). For tests and checks, O(state).
func (l *Ledger) Digest() [sha256.Size]byte {
	var b strings.Builder
	for _, id := range l.Nodes() {
		n := l.nodes[id]
		fmt.Fprintf(&b, "node %s seq %d host %d %d\n", id, n.lastSeq, n.cpuUsed, n.memUsed)
		for _, a := range l.Live(id) {
			fmt.Fprintf(&b, " live %s %x\n", a.ID, placementHash(a))
		}
		for _, m := range []map[string][]string{n.whole, n.mig, n.migOn} {
			for _, k := range sortedKeys(m) {
				fmt.Fprintf(&b, " claim %s %v\n", k, m[k])
			}
		}
		for _, k := range sortedKeys(n.shares) {
			fmt.Fprintf(&b, " share %s %v\n", k, n.shares[k])
		}
	}
	for _, k := range sortedKeys(l.liveJobs) {
		ids := slices.Sorted(slices.Values(l.liveJobs[k]))
		fmt.Fprintf(&b, "job %s %v\n", k, ids)
	}
	fmt.Fprintf(&b, "clock %d\n", l.retired.Clock().UnixNano())
	for _, bk := range l.retired.Buckets() {
		var recs [][]byte
		for _, c := range bk.Chunks {
			for off := 0; off < len(c); off += RetiredRecordSize {
				recs = append(recs, c[off:off+RetiredRecordSize])
			}
		}
		slices.SortFunc(recs, func(a, b []byte) int { return bytes.Compare(a[:16], b[:16]) })
		for _, rec := range recs {
			r := decodeRetired(rec)
			fmt.Fprintf(&b, "retired %d %x %x %s\n", bk.N, rec[:16], r.place, l.nodeIDs[r.node])
		}
	}
	return sha256.Sum256([]byte(b.String()))
}

func sortedKeys[V any](m map[string]V) []string {
	return slices.Sorted(func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	})
}
