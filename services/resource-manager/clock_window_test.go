package resourcemanager

// A reviewer's counter-examples to the first version of forgetting ended
// allocations and refusals (b9e3f6f), which dated records by the writing
// replica's clock and the entries' own times: each failed there. Every
// date is now the stream's stamp (stampOf), and they hold.

import (
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/resource-manager/internal/ledger"
)

// foreignAt writes an entry as another replica would (up to date CAS), dated t.
func foreignAt(t *testing.T, s *server, b *bus.Bus, kind contracts.LedgerKind, a contracts.Allocation, at time.Time) {
	t.Helper()
	s.mu.Lock()
	last := s.led.LastSeq(a.NodeID)
	s.mu.Unlock()
	if _, err := b.Publish(t.Context(), contracts.SubjectLedger(a.NodeID), contracts.LedgerEntryID(kind, a.ID),
		contracts.LedgerEntry{SchemaVersion: 1, Kind: kind, Allocation: a, Time: at}, bus.ExpectLastSubjectSeq(last)); err != nil {
		t.Fatal(err)
	}
	if err := s.catchUp(t.Context(), a.NodeID); err != nil {
		t.Fatal(err)
	}
}

// shortDedupe shortens ALLOCATIONS' duplicate window to 100 ms before
// anything is written: a redelivery hours later is past the real 2 minutes.
func shortDedupe(t *testing.T, b *bus.Bus) {
	t.Helper()
	st, err := b.JetStream().Stream(t.Context(), contracts.StreamAllocations)
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	cfg.Duplicates = 100 * time.Millisecond
	if _, err := b.JetStream().UpdateStream(t.Context(), cfg); err != nil {
		t.Fatal(err)
	}
}

// redeliver is the plan item delivered again, retried while the
// shortened duplicate window has not yet let go of the first commit's ID.
func redeliver(t *testing.T, s *server, a contracts.Allocation, planned time.Time) (v ledger.Verdict, err error) {
	t.Helper()
	for range 10 {
		if v, err = s.commitFenced(t.Context(), a, 0, planned); err == nil {
			return v, nil
		}
		time.Sleep(500 * time.Millisecond)
	}
	return v, err
}

// TestSlowWriterClockRecommitsNoEndedAllocation: the leader's clock is
// 32 h behind the NATS server's (NTP broken, VM restored). It commits an
// item of a plan PLANS stamped now, the job runs and ends, and the leader
// writes the release, dated by its own clock. Another replica's entry
// (correct clock) moves the ledger's clock to now: the retired record is
// 25 h "old" and is forgotten at once. The same plan redelivered
// (transient failure of another item, crash before ack: still well inside
// PLANS' 24 h) is not plan_expired by the ledger's clock (it is seconds
// old), so the ended attempt is committed a second time.
func TestSlowWriterClockRecommitsNoEndedAllocation(t *testing.T) {
	s, other := writeServer(t)
	shortDedupe(t, other)
	now := time.Now()
	s.cfg.Now = func() time.Time { return now.Add(-32 * time.Hour) } // the writer's slow clock
	planned := now                                                   // PLANS' stamp (NATS clock)
	a := alloc("ended", "n1", 0)
	if v, err := s.commitFenced(t.Context(), a, 0, planned); err != nil || !v.OK() {
		t.Fatalf("first commit: %+v %v", v, err)
	}
	if err := s.release(t.Context(), a.ID, contracts.ReasonRunEnded, nil); err != nil {
		t.Fatal(err)
	}
	// A replica with a correct clock writes anything on another node.
	foreignAt(t, s, other, contracts.LedgerCommitted, alloc("marker", "n2", 0), now)

	// The plan comes again later (past ALLOCATIONS' 2-minute duplicate
	// window, shortened here to 100 ms): it must not run the ended attempt again.
	time.Sleep(1500 * time.Millisecond) // past the shortened duplicate window
	v, err := redeliver(t, s, a, planned)
	if err != nil {
		t.Fatal(err)
	}
	if n := countCommits(t, other, a.ID); n != 1 || v.OK() {
		t.Fatalf("ended allocation committed %d times (verdict %+v): an ended attempt runs again", n, v)
	}
}

// TestSlowWriterClockRecommitsNoRefusedItem: the same for a refusal.
// The slow-clock leader refuses an item (GPU busy); the refusal is dated
// 32 h back. A refusal by a replica with a correct clock moves the
// refusals' clock to now and the first refusal is forgotten; the plan
// redelivered once the GPU is free commits the item the scheduler was
// told was refused (and has placed again elsewhere).
func TestSlowWriterClockRecommitsNoRefusedItem(t *testing.T) {
	s, other := writeServer(t)
	shortDedupe(t, other)
	now := time.Now()
	s.cfg.Now = func() time.Time { return now.Add(-32 * time.Hour) }
	planned := now
	busy := alloc("busy", "n1", 0)
	if v, err := s.commitFenced(t.Context(), busy, 0, planned); err != nil || !v.OK() {
		t.Fatalf("busy: %+v %v", v, err)
	}
	a := alloc("refused", "n1", 0)
	v, err := s.commitFenced(t.Context(), a, 0, planned)
	if err != nil || !v.Refused() {
		t.Fatalf("want a refusal, got %+v %v", v, err)
	}
	if err := s.refuse(t.Context(), "p1", 0, a, v, planned); err != nil {
		t.Fatal(err)
	}
	if !s.wasRefused("p1", 0, a) {
		t.Fatal("refusal not recorded")
	}
	// Another replica's refusal of something else, correct clock (what
	// onLedgerMsg does with it).
	s.mu.Lock()
	s.addRefusal(refusalHashOf(contracts.RefusalID("other-plan", "x")), now)
	s.mu.Unlock()
	if err := s.release(t.Context(), busy.ID, contracts.ReasonRunEnded, nil); err != nil {
		t.Fatal(err)
	}
	if !s.wasRefused("p1", 0, a) {
		time.Sleep(1500 * time.Millisecond)
		v, err := redeliver(t, s, a, planned)
		if err == nil && v.OK() {
			t.Fatalf("plan item p1/0 was refused, then committed on redelivery (%d commits): two contrary answers", countCommits(t, other, a.ID))
		}
		t.Fatalf("refusal of p1/0 forgotten while its plan is seconds old (redelivery verdict %+v %v)", v, err)
	}
}

// TestFutureDatedEntryStallsNoPlan: one ledger entry written by a
// replica whose clock is 25 h ahead (or hand-written) moves the ledger's
// clock a day ahead for good (the clock never goes back; snapshots keep
// it). From then every item of every fresh plan is refused plan_expired
// until real time catches up: no job can be placed.
func TestFutureDatedEntryStallsNoPlan(t *testing.T) {
	s, other := writeServer(t)
	shortDedupe(t, other)
	now := time.Now()
	s.cfg.Now = func() time.Time { return now }
	foreignAt(t, s, other, contracts.LedgerCommitted, alloc("future", "n2", 0), now.Add(25*time.Hour))
	v, err := s.commitFenced(t.Context(), alloc("fresh", "n1", 0), 0, now) // a plan PLANS stamped now
	if err != nil {
		t.Fatal(err)
	}
	if !v.OK() {
		t.Fatalf("a plan stored this second refused %s: %s", v.Reason, v.Message)
	}
}

// TestTwoHourSkewRecommitsNothing: the skew needs only exceed
// ledger.ClockSkew (1 h). The writer is 2 h behind NATS; its release R is
// dated just before a bucket's end, so the record is forgotten at ledger
// clock R + 25 h = T + 23 h, while the plan (stamped T, before the
// release) expires only at T + 24 h. A redelivery at T + 23.5 h (PLANS
// still holds the plan; MaxDeliver is 1000) commits the ended attempt again.
func TestTwoHourSkewRecommitsNothing(t *testing.T) {
	s, other := writeServer(t)
	shortDedupe(t, other)
	bucket := int64((contracts.PlansMaxAge + time.Hour) / 4)
	r := time.Unix(0, (time.Now().UnixNano()/bucket)*bucket-1) // the release's date, a bucket's last ns
	planned := r.Add(2 * time.Hour)                            // T: NATS stamped the plan 2 h "after" the slow writer's clock
	s.cfg.Now = func() time.Time { return r }
	a := alloc("ended", "n1", 0)
	if v, err := s.commitFenced(t.Context(), a, 0, planned); err != nil || !v.OK() {
		t.Fatalf("first commit: %+v %v", v, err)
	}
	if err := s.release(t.Context(), a.ID, contracts.ReasonRunEnded, nil); err != nil {
		t.Fatal(err)
	}
	foreignAt(t, s, other, contracts.LedgerCommitted, alloc("marker", "n2", 0), planned.Add(23*time.Hour+30*time.Minute))
	time.Sleep(1500 * time.Millisecond) // past the shortened duplicate window
	v, err := redeliver(t, s, a, planned)
	if err != nil {
		t.Fatal(err)
	}
	if n := countCommits(t, other, a.ID); n != 1 || v.OK() {
		t.Fatalf("ended allocation committed %d times by a plan 23.5 h old (verdict %+v)", n, v)
	}
}

// TestReleaseDatedPast2262IsRemembered: a release entry whose
// time does not fit UnixNano (after 2262: a corrupt clock or a
// hand-written entry) wraps to a date before 1970; its record's bucket is
// past keep at once and is never stored, so the ended allocation is
// forgotten the moment it ends and its plan, seconds old, commits again.
func TestReleaseDatedPast2262IsRemembered(t *testing.T) {
	s, other := writeServer(t)
	shortDedupe(t, other)
	now := time.Now()
	s.cfg.Now = func() time.Time { return now }
	a := alloc("ended", "n1", 0)
	if v, err := s.commitFenced(t.Context(), a, 0, now); err != nil || !v.OK() {
		t.Fatalf("first commit: %+v %v", v, err)
	}
	foreignAt(t, s, other, contracts.LedgerReleased, a, time.Date(3000, 1, 1, 0, 0, 0, 0, time.UTC))
	time.Sleep(1500 * time.Millisecond) // past the shortened duplicate window
	v, err := redeliver(t, s, a, now)
	if err != nil {
		t.Fatal(err)
	}
	if n := countCommits(t, other, a.ID); n != 1 || v.OK() {
		t.Fatalf("ended allocation committed %d times (verdict %+v)", n, v)
	}
}
