package resourcemanager

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// Plans handled at once (PlanWorkers) over the same devices: no device is
// committed twice in the stream, an allocation named by two plans on two
// nodes is committed once, and every item has its answer (live in the
// ledger or refused).
func TestPlansHandledAtOnceNeverShareADevice(t *testing.T) {
	for round := range 3 {
		t.Run(fmt.Sprintf("round %d", round), func(t *testing.T) {
			s, _ := writeServer(t)
			const plans = 8
			var msgs []*bus.Msg
			var all [][]contracts.Allocation
			for p := range plans {
				var items []contracts.Allocation
				for i := range 4 {
					// Every plan asks for every device of both nodes in
					// some order: 32 items for 8 devices.
					node := []string{"n1", "n2"}[(p+i)%2]
					items = append(items, alloc(fmt.Sprintf("job-%d-%d-%d", round, p, i), node, (i+round)%4))
				}
				if p < 2 {
					// One allocation in two plans, on two nodes.
					items = append(items, alloc(fmt.Sprintf("dup-%d", round), []string{"n1", "n2"}[p], 3))
				}
				id := fmt.Sprintf("plan-%d-%d", round, p)
				data, err := json.Marshal(contracts.Plan{SchemaVersion: 1, ID: id, Scheduler: "sched-test", Items: items})
				if err != nil {
					t.Fatal(err)
				}
				msgs = append(msgs, &bus.Msg{Stream: contracts.StreamPlans, StreamSeq: uint64(p + 1), Timestamp: time.Now(),
					Subject: contracts.SubjectPlan("sched-test"), Data: data})
				all = append(all, items)
			}
			var wg sync.WaitGroup
			for _, m := range msgs {
				wg.Go(func() {
					if err := s.onPlanMsg(t.Context(), m); err != nil {
						t.Errorf("plan at %d: %v", m.StreamSeq, err)
					}
				})
			}
			wg.Wait()

			// The stream is the truth: each device committed at most once
			// (nothing is released here), each allocation at most once.
			devices, allocs := map[string]string{}, map[string]bool{}
			if _, err := s.bus.Replay(t.Context(), bus.FollowSpec{Stream: contracts.StreamAllocations},
				func(_ context.Context, m *bus.Msg) error {
					var e contracts.LedgerEntry
					if err := m.Decode(&e); err != nil || e.Kind != contracts.LedgerCommitted {
						return err
					}
					if allocs[e.Allocation.ID] {
						t.Errorf("%s committed twice", e.Allocation.ID)
					}
					allocs[e.Allocation.ID] = true
					for _, d := range e.Allocation.Devices {
						key := e.Allocation.NodeID + "/" + d.UUID
						if other, held := devices[key]; held {
							t.Errorf("%s committed to %s and %s", key, other, e.Allocation.ID)
						}
						devices[key] = e.Allocation.ID
					}
					return nil
				}); err != nil {
				t.Fatal(err)
			}
			if len(devices) != 8 {
				t.Errorf("%d of 8 devices committed: %v", len(devices), devices)
			}
			for p, items := range all {
				for i, a := range items {
					_, live, _ := s.allocation(a.ID)
					if !live && !s.wasRefused(fmt.Sprintf("plan-%d-%d", round, p), i, a) {
						t.Errorf("plan %d item %d (%s on %s): neither committed nor refused", p, i, a.ID, a.NodeID)
					}
				}
			}
		})
	}
}

// Two plans of one gang attempt on different machines, handled at once
// (a plan published again after a publish that timed out but was stored,
// or a deposed leader's beside its successor's): the job ends up in one
// placement, never with one part of each (each naming the other's peers),
// and the job gate is empty once both are decided.
func TestPlansOfOneGangAtOnceNeverSplitIt(t *testing.T) {
	for round := range 12 {
		t.Run(fmt.Sprintf("round %d", round), func(t *testing.T) {
			s, _ := writeServer(t)
			readyNodes(s, "n3", "n4") // each part on a node of its own
			job := fmt.Sprintf("gang-%d", round)
			part := func(rank int, nodes []string, gpu int) contracts.Allocation {
				a := alloc(job, nodes[rank], gpu)
				a.ID = contracts.AllocationPartID("acme", job, 1, rank)
				a.Gang = &contracts.GangPart{Rank: rank, Size: len(nodes), Nodes: nodes}
				return a
			}
			placements := [][]string{{"n1", "n2"}, {"n3", "n4"}}
			var msgs []*bus.Msg
			for p, nodes := range placements {
				items := []contracts.Allocation{part(0, nodes, p), part(1, nodes, p)}
				data, err := json.Marshal(contracts.Plan{SchemaVersion: 1, ID: fmt.Sprintf("plan-%d-%d", round, p),
					Scheduler: "sched-test", Items: items})
				if err != nil {
					t.Fatal(err)
				}
				msgs = append(msgs, &bus.Msg{Stream: contracts.StreamPlans, StreamSeq: uint64(p + 1), Timestamp: time.Now(),
					Subject: contracts.SubjectPlan("sched-test"), Data: data})
			}
			var wg sync.WaitGroup
			for _, m := range msgs {
				wg.Go(func() {
					if err := s.onPlanMsg(t.Context(), m); err != nil {
						t.Errorf("plan at %d: %v", m.StreamSeq, err)
					}
				})
			}
			wg.Wait()
			if n := s.planGate.inFlight(); n != 0 {
				t.Errorf("%d jobs still held by the gate after both plans", n)
			}
			// The stream is the truth: every committed part of the job
			// belongs to one placement, and the job holds both ranks.
			var placed [][]string
			if _, err := s.bus.Replay(t.Context(), bus.FollowSpec{Stream: contracts.StreamAllocations},
				func(_ context.Context, m *bus.Msg) error {
					var e contracts.LedgerEntry
					if err := m.Decode(&e); err != nil || e.Kind != contracts.LedgerCommitted || e.Allocation.JobID != job {
						return err
					}
					placed = append(placed, e.Allocation.Gang.Nodes)
					return nil
				}); err != nil {
				t.Fatal(err)
			}
			if len(placed) != 2 || !slices.Equal(placed[0], placed[1]) {
				t.Fatalf("the gang's committed parts name placements %v; want both ranks of one", placed)
			}
		})
	}
}
