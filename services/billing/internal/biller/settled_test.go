package biller

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// usage is a record of allocation id, segment seg.
func usage(id string, seg int, final, provisional bool, voids string) contracts.UsageRecord {
	start := time.Date(2026, 11, 27, 0, 0, 0, 0, time.UTC).Add(time.Duration(seg) * time.Minute)
	return contracts.UsageRecord{ID: fmt.Sprintf("%s/%d", id, seg), AllocationID: id, Tenant: "acme",
		Start: start, End: start.Add(time.Minute),
		UsageSegment: contracts.UsageSegment{Segment: seg, Final: final, Provisional: provisional, Voids: voids}}
}

// TestSettledAllocationsAreKeptAsDigests: after N runs billed to their
// end, the biller keeps no allocation whole, N digests, and answers every
// basis for them with nothing to publish (its Nodes, Prices and Requests
// are nil: metering would panic). An allocation billed provisionally is
// kept whole until the agent's end replaces its bill; a record that comes
// for a settled allocation folds over "billed to its end".
func TestSettledAllocationsAreKeptAsDigests(t *testing.T) {
	const n = 1000
	b := New(Config{})
	subj := contracts.SubjectUsage("acme")
	seq := uint64(0)
	rec := func(r contracts.UsageRecord) {
		seq++
		b.record(r, subj, seq)
	}
	for i := range n {
		id := fmt.Sprintf("acme/j%04d/1", i)
		rec(usage(id, 0, false, false, ""))
		rec(usage(id, 1, true, false, ""))
	}
	if whole, settled := b.Retained(); whole != 0 || settled != n {
		t.Fatalf("after %d billed runs: %d whole, %d settled; want 0, %d", n, whole, settled, n)
	}
	if got := b.Billed(); got != n {
		t.Fatalf("Billed() = %d, want %d", got, n)
	}
	entry := func(id string) contracts.LedgerEntry {
		return contracts.LedgerEntry{Kind: contracts.LedgerReleased, Allocation: contracts.Allocation{ID: id, Tenant: "acme"}}
	}
	for _, provisional := range []bool{false, true} {
		recs, err := b.plan(context.Background(), basis{entry: entry("acme/j0007/1"), provisional: provisional}, nil)
		if err != nil || len(recs) != 0 {
			t.Fatalf("plan for a settled allocation (provisional basis %v) = %v, %v; want nothing", provisional, recs, err)
		}
	}

	// A lost node's run: billed provisionally, kept whole; the agent's end
	// voids it and bills the run again, which settles it.
	lost := "acme/lost/1"
	rec(usage(lost, 0, true, true, ""))
	if whole, settled := b.Retained(); whole != 1 || settled != n {
		t.Fatalf("with a provisional bill: %d whole, %d settled; want 1, %d", whole, settled, n)
	}
	rec(usage(lost, 1, false, false, lost+"/0"))
	rec(usage(lost, 2, true, false, ""))
	if whole, settled := b.Retained(); whole != 0 || settled != n+1 {
		t.Fatalf("after the agent's end: %d whole, %d settled; want 0, %d", whole, settled, n+1)
	}
	// Voids were published for it: a provisional record after them is
	// ignored as before, and it stays billed to its end.
	rec(usage(lost, 3, true, true, ""))
	if st, settled := b.lookup(lost); st == nil || !settled || !st.voiding {
		t.Fatalf("after a provisional record past its voids: %+v (settled %v), want settled, voids published", st, settled)
	}

	// A record for a settled allocation folds over "billed to its end",
	// as it did over the whole state: still final, so settled again. A
	// provisional one (no voids were published) opens a provisional bill.
	rec(usage("acme/j0003/1", 2, false, false, ""))
	if st, settled := b.lookup("acme/j0003/1"); st == nil || !settled {
		t.Fatalf("after a late record: %+v (settled %v), want settled", st, settled)
	}
	rec(usage("acme/j0004/1", 2, true, true, ""))
	st, settled := b.lookup("acme/j0004/1")
	if st == nil || settled || !st.provisional || st.next != 3 || len(st.open) != 1 {
		t.Fatalf("after a late provisional record: %+v (settled %v), want whole, provisional, next segment 3", st, settled)
	}
}
