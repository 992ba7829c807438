package resourcemanager

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/lease"
	"github.com/gpuplane/gpuplane/services/resource-manager/internal/liveness"
)

// frozenAt is a clock a test moves by hand: a SIGSTOPped leader's view of
// time jumps when it thaws.
type frozenAt struct{ ns atomic.Int64 }

func (c *frozenAt) Now() time.Time          { return time.Unix(0, c.ns.Load()) }
func (c *frozenAt) Advance(d time.Duration) { c.ns.Add(int64(d)) }

// leaderTerm takes the resource manager's lease on the real bucket with a
// clock the test controls.
func leaderTerm(t *testing.T, b *bus.Bus, clk *frozenAt) lease.Term {
	t.Helper()
	kv, err := b.KeyValue(t.Context(), contracts.BucketLeases)
	if err != nil {
		t.Fatal(err)
	}
	e, err := lease.New(lease.Config{KV: kv, Key: contracts.LeaseKeyResourceManager, Holder: "rm-under-test",
		TTL: time.Second, Now: clk.Now, Log: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	term, ok, err := e.TryAcquire(t.Context())
	if err != nil || !ok {
		t.Fatalf("acquire the lease: %v %v", ok, err)
	}
	return term
}

// hook runs fn at the first Valid call, then answers as term does: a
// leader frozen between its check and its publish, while the next leader
// writes.
type hook struct {
	term  fence
	calls int
	fn    func()
}

func (h *hook) Valid() bool {
	h.calls++
	if h.calls == 1 {
		ok := h.term.Valid()
		h.fn()
		return ok
	}
	return h.term.Valid()
}

// TestDeposedLeaderWritesNothing: a leader whose lease ran out (frozen
// past it, then thawed) publishes no ledger entry, no refusal and no node
// event; one frozen between its check and its publish while the next
// leader writes to the node is refused by the compare-and-set and then
// finds its term over.
func TestDeposedLeaderWritesNothing(t *testing.T) {
	t.Run("thawed past the lease", func(t *testing.T) {
		s, other := writeServer(t)
		clk := &frozenAt{}
		clk.ns.Store(time.Now().UnixNano())
		s.term = leaderTerm(t, other, clk)
		if v, err := s.commit(t.Context(), alloc("before", "n1", 0)); err != nil || !v.OK() {
			t.Fatalf("commit while leading = %+v, %v", v, err)
		}
		clk.Advance(2 * time.Second) // SIGSTOP for twice the TTL, then SIGCONT
		if _, err := s.commit(t.Context(), alloc("after", "n1", 1)); !errors.Is(err, errDeposed) {
			t.Fatalf("commit after the lease ran out: err %v, want errDeposed", err)
		}
		if err := s.release(t.Context(), "acme/before/1", contracts.ReasonNodeLost, nil); !errors.Is(err, errDeposed) {
			t.Fatalf("release after the lease ran out: err %v, want errDeposed", err)
		}
		if err := s.refuse(t.Context(), "p1", 0, alloc("after", "n1", 1), s.led.Verify(alloc("after", "n1", 0)), time.Now()); !errors.Is(err, errDeposed) {
			t.Fatalf("refusal after the lease ran out: err %v, want errDeposed", err)
		}
		s.lifeMu.Lock()
		s.publishLifecycle(t.Context(), liveness.Decision{ID: "node/lost/n1/0",
			Event: contracts.NodeEvent{SchemaVersion: 1, Kind: contracts.NodeLost, NodeID: "n1"}})
		s.lifeMu.Unlock()
		if n := countCommits(t, other, "acme/after/1"); n != 0 {
			t.Errorf("the deposed leader's commit is in the ledger %d times", n)
		}
		if n := countMsgs(t, other, contracts.StreamAllocations, contracts.SubjectLedgerAll); n != 1 {
			t.Errorf("ledger holds %d entries, want only the one written while leading", n)
		}
		if n := countMsgs(t, other, contracts.StreamAllocations, contracts.SubjectRefusedAll); n != 0 {
			t.Errorf("%d refusals stored from a deposed leader", n)
		}
		if n := countMsgs(t, other, contracts.StreamNodes, contracts.SubjectNodeLifecycleAll); n != 0 {
			t.Errorf("%d node events stored from a deposed leader", n)
		}
	})
	t.Run("frozen between its check and its publish", func(t *testing.T) {
		s, other := writeServer(t)
		clk := &frozenAt{}
		clk.ns.Store(time.Now().UnixNano())
		term := leaderTerm(t, other, clk)
		// While frozen, the lease expires and the next leader commits to
		// n1: the frozen one's publish expects n1's old last sequence.
		s.term = &hook{term: term, fn: func() {
			clk.Advance(2 * time.Second)
			foreign(t, other, alloc("new-leader", "n1", 0), 0)
		}}
		_, err := s.commit(t.Context(), alloc("stale", "n1", 1))
		if !errors.Is(err, errDeposed) {
			t.Fatalf("commit of the thawed leader = %v, want errDeposed after its compare-and-set lost", err)
		}
		if n := countCommits(t, other, "acme/stale/1"); n != 0 {
			t.Fatalf("the stale commit is stored %d times", n)
		}
	})
}

func countMsgs(t *testing.T, b *bus.Bus, stream, filter string) int {
	t.Helper()
	n := 0
	if _, err := b.Replay(t.Context(), bus.FollowSpec{Stream: stream, FilterSubjects: []string{filter}},
		func(context.Context, *bus.Msg) error { n++; return nil }); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestStalledFeedIsReplaced: a feed found behind the stream for longer
// than the heartbeat timeout asks for a new consumer; one that catches up
// in time does not.
func TestStalledFeedIsReplaced(t *testing.T) {
	s := newServer(DefaultConfig(), nil, slog.New(slog.DiscardHandler))
	t0 := time.Now()
	for _, at := range []time.Duration{0, 3 * time.Second, 6 * time.Second} {
		s.watchLag(true, t0.Add(at))
	}
	select {
	case <-s.refeed:
		t.Fatal("a new feed asked for after 6 s behind; the timeout is 6 s")
	default:
	}
	s.watchLag(false, t0.Add(6500*time.Millisecond)) // it caught up
	s.watchLag(true, t0.Add(7*time.Second))
	s.watchLag(true, t0.Add(13*time.Second))
	select {
	case <-s.refeed:
		t.Fatal("a new feed asked for though the lag restarted at 7 s")
	default:
	}
	s.watchLag(true, t0.Add(13100*time.Millisecond))
	select {
	case <-s.refeed:
	default:
		t.Fatal("no new feed after 6.1 s behind the stream")
	}
}
