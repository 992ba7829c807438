package billing_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/billing"
)

// TestTwoReplicasBillEachRunOnce runs two billing replicas on one bus
// while runs end, and stops one of them halfway: the shared durable
// consumers give each ledger entry to one replica, the compare-and-set per
// tenant keeps USAGE to one record per run whoever meters it, and each
// store ends with every run once. With one shared store (as on one Redis,
// one generation) the replicas share its projector consumer; with a store
// each (in memory), each store is fed all of USAGE by its own.
func TestTwoReplicasBillEachRunOnce(t *testing.T) {
	for name, shared := range map[string]bool{"one shared store": true, "a store each": false} {
		t.Run(name, func(t *testing.T) {
			srv := natstest.Start(t)
			b := connect(t, srv)
			inventory(t, b, "n1", "h100", "on-demand")
			storeA := billing.NewMemoryStore()
			storeB := storeA
			if !shared {
				storeB = billing.NewMemoryStore()
			}
			stopA := start(t, srv, storeA)
			start(t, srv, storeB)

			var want []contracts.UsageRecord
			total := billing.Totals{}
			run := func(i int) {
				a := alloc("acme", fmt.Sprintf("rep-%02d", i), 1, "n1", 1+i%4)
				secs := int64(1 + i%7)
				publishLedger(t, b, "", committed(a), released(a, time.Duration(secs)*time.Second))
				want = append(want, record(a, secs))
				total = sumTotals(total, totalsOf(record(a, secs)))
			}
			for i := range 10 {
				run(i)
			}
			// Both replicas are up: wait until the first half is billed,
			// then one goes, and the other meters the rest alone.
			waitUsage(t, b, want)
			stopA()
			for i := 10; i < 20; i++ {
				run(i)
			}
			waitUsage(t, b, want)
			waitTotals(t, storeB, map[string]billing.Totals{"acme": total})
			if !shared {
				// A's store stopped being fed with A; what it holds is the
				// first half at most, never a run twice.
				got, err := get(storeA, "acme")
				if err != nil {
					t.Fatal(err)
				}
				if got.GPUMillis > total.GPUMillis {
					t.Errorf("the stopped replica's store holds %d GPU-ms, more than all runs' %d", got.GPUMillis, total.GPUMillis)
				}
			}
		})
	}
}
