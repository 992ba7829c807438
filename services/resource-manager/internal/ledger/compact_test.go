package ledger

import (
	"fmt"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestRetiredRecordsStayCompactAndAnswer: many ended allocations (past
// several growths of the retired records' index and several chunks) cost
// about their 28-byte records, not a map's slots (issue 17: what the
// manager keeps grows with history only by this), and every one of them
// still answers as it did when live: a redelivered commit is Duplicate,
// a commit of its ID elsewhere is job_already_allocated, its commit or
// release read again changes nothing, it is known, not live, on its
// node; and a ledger loaded from the exported state answers the same.
func TestRetiredRecordsStayCompactAndAnswer(t *testing.T) {
	n := 20_000
	if raceEnabled || testing.Short() {
		n = 5_000
	}
	l := fixture(t)
	base, baseRetired := l.Records(), l.Retired()
	seq := uint64(100)
	nodes := []string{"n1", "n2"}
	ended := make([]contracts.Allocation, n)
	for i := range n {
		node := nodes[i%2]
		a := alloc("acme", fmt.Sprintf("ended-%d", i), 1, node, dev(node, 1, "H100-80GB"))
		ended[i] = a
		for _, e := range []contracts.LedgerEntry{committed(a), released(a)} {
			seq++
			if err := l.Apply(e, seq); err != nil {
				t.Fatalf("%s of %s: %v", e.Kind, a.ID, err)
			}
		}
	}
	if got := l.Retired(); got != baseRetired+n {
		t.Fatalf("retired records = %d, want %d", got, baseRetired+n)
	}
	// 28 bytes a record, the last chunk's slack and an index of 5 bytes a
	// slot kept at most 3/4 and at least 3/8 full: under 45 bytes a
	// record at this size. The map and log before took ~100.
	if per := float64(l.RetiredBytes()) / float64(l.Retired()); per > 45 {
		t.Errorf("%.1f bytes per retired record, want at most 45", per)
	}
	loaded, err := FromState(l.Export(), testKeep)
	if err != nil {
		t.Fatalf("FromState: %v", err)
	}
	if l.Digest() != loaded.Digest() {
		t.Fatal("the ledger loaded from its state has another digest")
	}
	for _, x := range []struct {
		name string
		l    *Ledger
	}{{"ledger", l}, {"loaded", loaded}} {
		for i, a := range ended {
			if v := x.l.Verify(a); !v.Duplicate {
				t.Fatalf("%s: Verify of ended %s = %+v, want Duplicate", x.name, a.ID, v)
			}
			elsewhere := alloc("acme", a.JobID, 1, nodes[(i+1)%2], dev(nodes[(i+1)%2], 2, "H100-80GB"))
			if v := x.l.Verify(elsewhere); v.Reason != contracts.RefusedAlreadyPlaced {
				t.Fatalf("%s: Verify of ended %s elsewhere = %+v, want %s", x.name, a.ID, v, contracts.RefusedAlreadyPlaced)
			}
			if got, live, ok := x.l.Allocation(a.ID); !ok || live || got.NodeID != a.NodeID {
				t.Fatalf("%s: Allocation(%s) = %s live %v known %v, want known, not live, on %s", x.name, a.ID, got.NodeID, live, ok, a.NodeID)
			}
		}
	}
	// The log read again, without its sequences (a redelivery the node's
	// sequence does not stop), changes nothing.
	before := l.Digest()
	for _, a := range ended {
		for _, e := range []contracts.LedgerEntry{committed(a), released(a)} {
			if err := l.Apply(e, 0); err != nil {
				t.Fatalf("%s of %s again: %v", e.Kind, a.ID, err)
			}
		}
	}
	if l.Digest() != before || l.Records() != base || l.Retired() != baseRetired+n {
		t.Fatalf("the log read again changed the ledger: %d whole, %d retired", l.Records(), l.Retired())
	}
}
