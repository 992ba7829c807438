package resourcemanager

// A second reviewer's counter-examples to 98d10fd's dates (a writer's
// date from the latest stamp seen): each failed there, and holds since the
// writer's date is never before the log's clocks, a snapshot's clocks
// count as seen, and a reader's clamp is symmetric.

import (
	"log/slog"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// restarted is a fresh server on s's bus that installed s's snapshot: a
// restart from a snapshot that covers everything (nothing after it to
// replay, so nothing observed yet).
func restarted(t *testing.T, s *server) *server {
	t.Helper()
	s2 := newServer(s.cfg, s.bus, slog.New(slog.DiscardHandler))
	readyNodes(s2, "n1", "n2")
	if err := s2.install(s.takeSnapshot()); err != nil {
		t.Fatal(err)
	}
	readyNodes(s2, "n1", "n2")
	return s2
}

// replayed is a fresh server that read both nodes' ledger subjects whole
// (a replica, or a replay without snapshot).
func replayed(t *testing.T, b *bus.Bus, cfg Config) *server {
	t.Helper()
	r := newServer(cfg, b, slog.New(slog.DiscardHandler))
	readyNodes(r, "n1", "n2")
	for _, n := range []string{"n1", "n2"} {
		if err := r.catchUp(t.Context(), n); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

// TestReleaseAfterSnapshotLoadIsDatedAsOnReplicas: a manager
// restarted from a snapshot that covers the log has observed no stamp
// (install does not seed stampSeen). Its first release (checkLiveness
// releases a lost node's allocations before any plan, and the node-lost
// path observes nothing) is written with Time zero. The writer applies it
// undated (a record never forgotten, and kept by its snapshots); every
// replica and replay dates it by its stamp. Writer and replay differ.
func TestReleaseAfterSnapshotLoadIsDatedAsOnReplicas(t *testing.T) {
	s, other := writeServer(t)
	now := time.Now()
	a := alloc("ended", "n1", 0)
	if v, err := s.commitFenced(t.Context(), a, 0, now); err != nil || !v.OK() {
		t.Fatalf("commit: %+v %v", v, err)
	}
	s2 := restarted(t, s)
	t.Logf("seen after install: %v (zero at 98d10fd)", s2.seen())
	if err := s2.release(t.Context(), a.ID, contracts.ReasonNodeLost, nil); err != nil {
		t.Fatal(err)
	}
	r := replayed(t, other, s.cfg)
	s2.mu.Lock()
	wb := s2.led.Export().RetiredBuckets
	wd := s2.led.Digest()
	s2.mu.Unlock()
	rb := r.led.Export().RetiredBuckets
	if wd != r.led.Digest() {
		t.Fatalf("writer's own apply and the replay disagree: writer buckets %+v, replay buckets %+v", wb, rb)
	}
}

// TestStaleSeenAfterSnapshotRecommitsNothing: same
// restart, but the first stamp observed is an old one (here a plan
// stored 23 h ago, redelivered: PLANS keeps it 24 h, MaxDeliver 1000; or
// an old RUNS fact replayed from a lagging coverage). The writer dates the
// release of A (committed from a plan stamped now) 23 h back, and applies
// that date unclamped: its record is forgotten once the log clock passes
// the end of its 6.25 h bucket + 25 h (by now+8.25 h), while A's plan
// expires only at now+24h. 9 h of log time later (an entry
// stamped then, as the follow applies it), the plan of A redelivered
// commits the ended attempt again. A replica would have dated the release
// by stamp-1h (dateOf) and is safe: only the writer, the one that
// answers plans, is wrong.
func TestStaleSeenAfterSnapshotRecommitsNothing(t *testing.T) {
	s, other := writeServer(t)
	shortDedupe(t, other)
	now := time.Now()
	planned := now
	a := alloc("ended", "n1", 0)
	if v, err := s.commitFenced(t.Context(), a, 0, planned); err != nil || !v.OK() {
		t.Fatalf("commit: %+v %v", v, err)
	}
	s2 := restarted(t, s)
	s2.observe(now.Add(-23 * time.Hour)) // an old plan's stamp, redelivered
	if err := s2.release(t.Context(), a.ID, contracts.ReasonNodeLost, nil); err != nil {
		t.Fatal(err)
	}
	// 9 h of log time pass: an entry stamped then (read by the follow).
	m := alloc("marker", "n2", 1)
	s2.apply(func() *slog.Logger { return s2.log }, contracts.LedgerEntry{Kind: contracts.LedgerCommitted, Allocation: m,
		Time: now.Add(9 * time.Hour)}, 0)
	time.Sleep(1500 * time.Millisecond) // past the shortened duplicate window
	v, err := redeliver(t, s2, a, planned)
	if err != nil {
		t.Fatal(err)
	}
	if n := countCommits(t, other, a.ID); n != 1 || v.OK() {
		t.Fatalf("ended allocation committed %d times by its plan, 9 h old (verdict %+v)", n, v)
	}
}

// TestClockSkewMustBePositive: a margin of 0 would read every date as
// its stamp, while a writer applies the latest stamp it saw (a little
// earlier): every record would differ between the writer and a replay.
// Validate refuses it, and a server made without one takes the default.
func TestClockSkewMustBePositive(t *testing.T) {
	cfg := DefaultConfig()
	cfg.ClockSkew = 0
	if err := cfg.Validate(); err == nil {
		t.Fatal("Validate accepts a clock skew of 0")
	}
	if s := newServer(Config{}, nil, slog.New(slog.DiscardHandler)); s.cfg.ClockSkew <= 0 {
		t.Fatalf("a server made without a clock skew has %v", s.cfg.ClockSkew)
	}
}

// TestStampAheadOnAnotherStreamAgreesWithReplay: R3, the HEARTBEATS (or
// PLANS) leader's clock 10 min ahead of ALLOCATIONS' leader (within the
// 1 h skew). The writer dates its release with that stamp and applies it
// as written; readers read it as written too (the clamp is symmetric).
func TestStampAheadOnAnotherStreamAgreesWithReplay(t *testing.T) {
	s, other := writeServer(t)
	now := time.Now()
	a := alloc("ended", "n1", 0)
	if v, err := s.commitFenced(t.Context(), a, 0, now); err != nil || !v.OK() {
		t.Fatalf("commit: %+v %v", v, err)
	}
	s.observe(now.Add(10 * time.Minute)) // a heartbeat's stamp, another server's clock
	if err := s.release(t.Context(), a.ID, contracts.ReasonRunEnded, nil); err != nil {
		t.Fatal(err)
	}
	r := replayed(t, other, s.cfg)
	if s.led.Digest() != r.led.Digest() {
		t.Fatalf("writer clock %v, replay clock %v: digests differ", s.led.Clock(), r.led.Clock())
	}
}
