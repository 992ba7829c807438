package resourcemanager

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// These tests drive the commit path of a server whose follows are not
// running, so entries "another replica" writes reach its ledger only
// through the catch-up a lost compare-and-set or a duplicate triggers.

func writeServer(t *testing.T) (*server, *bus.Bus) {
	t.Helper()
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	connect := func(name string) *bus.Bus {
		b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: name, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = b.Close(context.Background()) })
		return b
	}
	cfg := DefaultConfig()
	cfg.CommitAttempts = 3
	s := newServer(cfg, connect("rm-under-test"), slog.New(slog.DiscardHandler))
	for _, n := range []string{"n1", "n2"} {
		inv := contracts.NodeInventory{NodeID: n}
		for i := range 4 {
			inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: gpu(n, i), Model: "L4", Healthy: true})
		}
		s.led.SetInventory(inv)
		s.led.SetReady(n, true)
	}
	return s, connect("other-replica")
}

func gpu(node string, i int) string { return "GPU-" + node + "-" + string(rune('0'+i)) }

func alloc(job, node string, gpus ...int) contracts.Allocation {
	a := contracts.Allocation{ID: contracts.AllocationID("acme", job, 1), Tenant: "acme", JobID: job, Attempt: 1, NodeID: node}
	for _, i := range gpus {
		a.Devices = append(a.Devices, contracts.DeviceRef{Index: i, UUID: gpu(node, i), Model: "L4"})
	}
	return a
}

// foreign writes a committed entry as another replica would, with the
// compare-and-set of a writer that is up to date.
func foreign(t *testing.T, b *bus.Bus, a contracts.Allocation, expect uint64) uint64 {
	t.Helper()
	ack, err := b.Publish(t.Context(), contracts.SubjectLedger(a.NodeID), contracts.LedgerEntryID(contracts.LedgerCommitted, a.ID),
		contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a}, bus.ExpectLastSubjectSeq(expect))
	if err != nil {
		t.Fatal(err)
	}
	return ack.Sequence
}

func countCommits(t *testing.T, b *bus.Bus, id string) int {
	t.Helper()
	n := 0
	_, err := b.Replay(t.Context(), bus.FollowSpec{Stream: contracts.StreamAllocations, FilterSubjects: []string{contracts.SubjectLedgerAll}},
		func(_ context.Context, m *bus.Msg) error {
			var e contracts.LedgerEntry
			if err := m.Decode(&e); err != nil {
				return err
			}
			if e.Kind == contracts.LedgerCommitted && e.Allocation.ID == id {
				n++
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestCommitCatchesUpAfterLosingTheCAS(t *testing.T) {
	s, other := writeServer(t)
	// The other replica took GPU 0 of n1; our ledger has not seen it.
	seq := foreign(t, other, alloc("theirs", "n1", 0), 0)
	v, err := s.commit(t.Context(), alloc("ours", "n1", 0, 1))
	if err != nil || v.Reason != contracts.RefusedDeviceTaken {
		t.Fatalf("commit over an unseen holder = %+v, %v; want device_taken", v, err)
	}
	if got := s.led.LastSeq("n1"); got != seq {
		t.Fatalf("LastSeq(n1) = %d after catch-up, want %d", got, seq)
	}
	// A free GPU still commits, expecting the caught-up sequence.
	if v, err := s.commit(t.Context(), alloc("ours", "n1", 1)); err != nil || !v.OK() {
		t.Fatalf("commit of a free GPU = %+v, %v", v, err)
	}
}

func TestCommitOfAnEntryAlreadyStoredIsANoOp(t *testing.T) {
	s, other := writeServer(t)
	a := alloc("same", "n1", 2)
	foreign(t, other, a, 0) // the same item, committed by a replica first
	v, err := s.commit(t.Context(), a)
	if err != nil || !v.Duplicate {
		t.Fatalf("commit of a stored entry = %+v, %v; want a duplicate no-op", v, err)
	}
	if n := countCommits(t, other, a.ID); n != 1 {
		t.Fatalf("%s committed %d times in the stream", a.ID, n)
	}
	// The same allocation ID stored on another node's subject: refused.
	b := alloc("elsewhere", "n2", 0)
	foreign(t, other, b, 0)
	moved := alloc("elsewhere", "n1", 3)
	v, err = s.commit(t.Context(), moved)
	if err != nil || v.Reason != contracts.RefusedAlreadyPlaced {
		t.Fatalf("commit of an ID stored on another node = %+v, %v; want job_already_allocated", v, err)
	}
	if n := countCommits(t, other, b.ID); n != 1 {
		t.Fatalf("%s committed %d times in the stream", b.ID, n)
	}
}

func TestCommitGivesUpAsCommitConflict(t *testing.T) {
	s, other := writeServer(t)
	s.cfg.CommitAttempts = 1
	foreign(t, other, alloc("theirs", "n1", 0), 0)
	v, err := s.commit(t.Context(), alloc("ours", "n1", 1))
	if err != nil || v.Reason != contracts.RefusedCommitConflict {
		t.Fatalf("commit after the last attempt lost = %+v, %v; want commit_conflict", v, err)
	}
	if n := countCommits(t, other, "acme/ours/1"); n != 0 {
		t.Fatalf("a commit_conflict item was stored %d times", n)
	}
}
