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
	// The server under test has the resource manager's own identity; the
	// test's other client, which plays another replica and the node
	// agents, is the operator.
	connect := func(name, creds string) *bus.Bus {
		b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: name, Logger: slog.New(slog.DiscardHandler),
			CredsFile: creds})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = b.Close(context.Background()) })
		return b
	}
	cfg := DefaultConfig()
	cfg.CommitAttempts = 3
	s := newServer(cfg, connect("rm-under-test", natstest.Service(t, srv, contracts.BusResourceManager)), slog.New(slog.DiscardHandler))
	readyNodes(s, "n1", "n2")
	return s, connect("other-replica", natstest.Operator(t, srv))
}

// readyNodes gives s's ledger each node with four healthy L4s, ready.
func readyNodes(s *server, nodes ...string) {
	for _, n := range nodes {
		inv := contracts.NodeInventory{NodeID: n}
		for i := range 4 {
			inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: gpu(n, i), Model: "L4", Healthy: true})
		}
		s.led.SetInventory(inv)
		s.led.SetReady(n, true)
	}
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

// TestCommitReadsANodeNotFollowedYet: the scheduler follows NODES on its
// own, so a plan may name a node whose inventory this manager has not read.
// The commit reads the node's messages first: the item commits and the
// node's registration is published. A node NODES does not hold stays
// unknown, and a lost node stays not ready.
func TestCommitReadsANodeNotFollowedYet(t *testing.T) {
	s, other := writeServer(t)
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: "n3", Incarnation: "i1"}
	for i := range 3 {
		inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: gpu("n3", i), Model: "L4", Healthy: true})
	}
	if _, err := other.Publish(t.Context(), contracts.SubjectInventory("n3"), "inv-n3-1", inv); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		a    contracts.Allocation
		want contracts.Reason
	}{
		{"inventory in the stream", alloc("first", "n3", 0), ""},
		{"read once, not twice", alloc("second", "n3", 1), ""},
		{"no inventory anywhere", alloc("nowhere", "n9", 0), contracts.RefusedUnknownNode},
	}
	for _, tc := range tests {
		v, err := s.commit(t.Context(), tc.a)
		if err != nil || v.Reason != tc.want {
			t.Fatalf("%s: commit = %+v, %v; want reason %q", tc.name, v, err, tc.want)
		}
	}
	var kinds []contracts.NodeLifecycleKind
	_, err := other.Replay(t.Context(), bus.FollowSpec{Stream: contracts.StreamNodes,
		FilterSubjects: []string{contracts.SubjectNodeLifecycle("n3")}}, func(_ context.Context, m *bus.Msg) error {
		var ev contracts.NodeEvent
		if err := m.Decode(&ev); err != nil {
			return err
		}
		kinds = append(kinds, ev.Kind)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(kinds) != 1 || kinds[0] != contracts.NodeRegistered {
		t.Fatalf("lifecycle of n3 = %v, want one registered", kinds)
	}

	// Lost (as the follow reads it), then its inventory again: read by
	// the commit's catch-up, it owes no registration.
	lost := contracts.NodeEvent{SchemaVersion: 1, Kind: contracts.NodeLost, NodeID: "n3", Incarnation: "i1"}
	if _, err := other.Publish(t.Context(), contracts.SubjectNodeLifecycle("n3"), "lost-n3", lost); err != nil {
		t.Fatal(err)
	}
	if err := s.catchUpNode(t.Context(), "n3"); err != nil {
		t.Fatal(err)
	}
	if _, err := other.Publish(t.Context(), contracts.SubjectInventory("n3"), "inv-n3-2", inv); err != nil {
		t.Fatal(err)
	}
	v, err := s.commit(t.Context(), alloc("third", "n3", 2))
	if err != nil || v.Reason != contracts.RefusedNodeNotReady {
		t.Fatalf("commit on a lost node = %+v, %v; want node_not_ready", v, err)
	}
	if got, want := s.nodesSeq["n3"], uint64(4); got != want {
		// inventory, registered, lost, inventory: the commit read them all.
		t.Fatalf("NODES read to %d for n3, want %d", got, want)
	}
}

// TestCommitReadsTheReleaseOfTheJobsEarlierAttempt: the scheduler places
// a job's next attempt once it reads the earlier attempt's release, which
// this manager may not have read yet (another replica wrote it, or its
// own writer has not applied it after the publish). The commit reads the
// nodes of the attempts in its way and commits; an attempt still live
// keeps refusing it, on its own node or another.
func TestCommitReadsTheReleaseOfTheJobsEarlierAttempt(t *testing.T) {
	attempt := func(job, node string, n, gpu int) contracts.Allocation {
		a := alloc(job, node, gpu)
		a.ID, a.Attempt = contracts.AllocationID("acme", job, n), n
		return a
	}
	for _, tc := range []struct {
		name      string
		next      string // the node of attempt 2
		released  bool   // attempt 1's release is stored by another replica
		wantRefus contracts.Reason
	}{
		{"released, next on another node", "n2", true, ""},
		{"released, next on the same node", "n1", true, ""},
		{"still live, next on another node", "n2", false, contracts.RefusedAlreadyPlaced},
		{"still live, next on the same node", "n1", false, contracts.RefusedAlreadyPlaced},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, other := writeServer(t)
			first := attempt("moved", "n1", 1, 0)
			if v, err := s.commit(t.Context(), first); err != nil || !v.OK() {
				t.Fatalf("commit of attempt 1 = %+v, %v", v, err)
			}
			if tc.released {
				if _, err := other.Publish(t.Context(), contracts.SubjectLedger("n1"),
					contracts.LedgerEntryID(contracts.LedgerReleased, first.ID),
					contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerReleased, Allocation: first, Reason: contracts.ReasonDrained},
					bus.ExpectLastSubjectSeq(s.led.LastSeq("n1"))); err != nil {
					t.Fatal(err)
				}
			}
			v, err := s.commit(t.Context(), attempt("moved", tc.next, 2, 1))
			if err != nil || v.Reason != tc.wantRefus {
				t.Fatalf("commit of attempt 2 = %+v, %v; want reason %q", v, err, tc.wantRefus)
			}
		})
	}
}
