package resourcemanager

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"

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
				msgs = append(msgs, &bus.Msg{Stream: contracts.StreamPlans, StreamSeq: uint64(p + 1),
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
