package resourcemanager

import (
	"log/slog"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestRaisedPlanAgeAfterSnapshotRecommitsNothing (third review, HIGH):
// the manager ran with -plan-max-age 2h (keep 3h) and wrote a snapshot;
// an operator restores the default 24h, and the next term starts from
// that snapshot. The snapshot's window no longer holds what the 3h keep
// dropped, yet under 24h a plan 5h old is young: the plan item of an
// allocation that ended 5h ago, redelivered, would commit the ended
// attempt again. A snapshot written with a shorter keep than the
// manager's is not used (the streams are read whole, as a full replay
// under 24h holds the record and answers Duplicate).
func TestRaisedPlanAgeAfterSnapshotRecommitsNothing(t *testing.T) {
	s0, other := writeServer(t)
	shortDedupe(t, other)
	small := s0.cfg
	small.PlanMaxAge = 2 * time.Hour
	s := newServer(small, s0.bus, slog.New(slog.DiscardHandler))
	readyNodes(s, "n1", "n2")
	now := time.Now()
	planned := now
	a := alloc("ended", "n1", 0)
	if v, err := s.commitFenced(t.Context(), a, 0, planned); err != nil || !v.OK() {
		t.Fatalf("commit: %+v %v", v, err)
	}
	if err := s.release(t.Context(), a.ID, contracts.ReasonRunEnded, nil); err != nil {
		t.Fatal(err)
	}
	m := alloc("marker", "n2", 1)
	s.apply(func() *slog.Logger { return s.log }, contracts.LedgerEntry{Kind: contracts.LedgerCommitted, Allocation: m,
		Time: now.Add(5 * time.Hour)}, 0)
	sn := s.takeSnapshot()

	def := s0.cfg
	def.PlanMaxAge = contracts.PlansMaxAge
	s2 := newServer(def, s0.bus, slog.New(slog.DiscardHandler))
	readyNodes(s2, "n1", "n2")
	if err := s2.install(sn); err == nil {
		t.Fatal("a snapshot written with a 3h keep was installed under 25h")
	}
	// What a term does then: the streams read whole.
	r := replayed(t, other, def)
	readyNodes(r, "n1", "n2")
	time.Sleep(1500 * time.Millisecond) // past the shortened duplicate window
	v, err := redeliver(t, r, a, planned)
	if err != nil {
		t.Fatal(err)
	}
	if n := countCommits(t, other, a.ID); n != 1 || v.OK() {
		t.Fatalf("ended allocation committed %d times by its plan, 5 h old (verdict %+v)", n, v)
	}
}
