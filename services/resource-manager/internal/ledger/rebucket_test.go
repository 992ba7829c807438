package ledger

import (
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestStateReadWithAnotherKeep: a snapshot's buckets are in units of its
// writer's bucket length (keep/4). Read back by a ledger keeping records
// for another time (a restart with another -plan-max-age, 24 h to 23 h
// or 48 h), an allocation that ended a minute ago is still remembered
// (a redelivered plan answers Duplicate), and one that ended a window
// ago is forgotten no later than a bucket after it would have been.
// Before the span was in the state, 23 h read every bucket as years old
// and dropped every record at the load (found in review).
func TestStateReadWithAnotherKeep(t *testing.T) {
	now := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	for _, age := range []time.Duration{23 * time.Hour, 24 * time.Hour, 48 * time.Hour} {
		t.Run(fmt.Sprint(age), func(t *testing.T) {
			l := New(Keep(24*time.Hour, DefaultMargin))
			if err := l.SetInventory(contracts.NodeInventory{NodeID: "n1", GPUs: gpus("n1", 4, "H100-80GB")}); err != nil {
				t.Fatal(err)
			}
			l.SetReady("n1", true)
			old := alloc("acme", "old", 1, "n1", dev("n1", 1, "H100-80GB"))
			recent := alloc("acme", "recent", 1, "n1", dev("n1", 0, "H100-80GB"))
			seq := uint64(0)
			for _, x := range []struct {
				a  contracts.Allocation
				at time.Time
			}{{old, now.Add(-20 * time.Hour)}, {recent, now.Add(-time.Minute)}} {
				c, r := committed(x.a), released(x.a)
				c.Time, r.Time = x.at.Add(-time.Minute), x.at
				for _, e := range []contracts.LedgerEntry{c, r} {
					seq++
					if err := l.Apply(e, seq); err != nil {
						t.Fatal(err)
					}
				}
			}
			keep := Keep(age, DefaultMargin)
			l2, err := FromState(l.Export(), keep)
			if err != nil {
				t.Fatal(err)
			}
			if err := l2.SetInventory(contracts.NodeInventory{NodeID: "n1", GPUs: gpus("n1", 4, "H100-80GB")}); err != nil {
				t.Fatal(err)
			}
			l2.SetReady("n1", true)
			if v := l2.Verify(recent); !v.Duplicate {
				t.Fatalf("the allocation that ended a minute ago verifies %+v after the load (retired %d)", v, l2.Retired())
			}
			// The log moves on: old is remembered until keep past its
			// release, and forgotten by keep and a bucket.
			tick := func(at time.Time) {
				seq++
				e := committed(alloc("acme", fmt.Sprint("tick", seq), 1, "n1", dev("n1", 2, "H100-80GB")))
				e.Time = at
				if err := l2.Apply(e, seq); err != nil {
					t.Fatal(err)
				}
				seq++
				r := released(e.Allocation)
				r.Time = at
				if err := l2.Apply(r, seq); err != nil {
					t.Fatal(err)
				}
			}
			released := now.Add(-20 * time.Hour)
			tick(released.Add(keep - time.Second))
			if v := l2.Verify(old); !v.Duplicate {
				t.Fatalf("old forgotten before keep (%v) past its release: %+v", keep, v)
			}
			tick(released.Add(keep + keep/4 + 24*time.Hour/4 + time.Second))
			if _, _, known := l2.Allocation(old.ID); known {
				t.Fatal("old still remembered a bucket of either length past keep")
			}
		})
	}
}
