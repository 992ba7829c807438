package billing_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/billing"
)

// flakyIndex is a store whose Billed fails while fail is set (Redis
// timing out, the breaker open).
type flakyIndex struct {
	billing.Store
	fail atomic.Bool
}

func (f *flakyIndex) Billed(ctx context.Context, keys []billing.AllocationKey) (string, []bool, error) {
	if f.fail.Load() {
		return "", nil, fmt.Errorf("%w: breaker open", billing.ErrStoreUnavailable)
	}
	return f.Store.Billed(ctx, keys)
}

// TestRecallKeepsAnotherReplicasRecordsOfAHeldAllocation (third review,
// HIGH): replica A holds P whole (a provisional bill of a node_lost
// release). Replica B handles the agent's ended fact for P: voids A's
// provisional record and bills the agent's end (segments 1 and 2), then
// dies before its ack. A has not read B's records. The store fails one
// Billed: find reads USAGE back (recall), which skipped every record of
// an allocation A holds but advanced b.last[subject] past them. The fact
// is redelivered to A, which voided and billed P again from its stale
// state; its compare-and-set passed, and once JetStream's duplicate
// window had let go of B's IDs the copies landed: P voided twice and
// billed twice. recall now skips only records it had read before.
func TestRecallKeepsAnotherReplicasRecordsOfAHeldAllocation(t *testing.T) {
	ctx := context.Background()
	srv := natstest.Start(t)
	b := connect(t, srv)
	inventory(t, b, "n1", "h100", "on-demand")
	tap := &logTap{}
	store := &flakyIndex{Store: billing.NewMemoryStore()}
	startLogged(t, srv, store, tap.logger(), func(c *billing.Config) { c.ForgetInterval = 20 * time.Millisecond })

	runs := billAndForget(t, b, tap)

	// P on a lost node: A bills the release provisionally and holds P whole.
	p := alloc("t0", "lostp", 1, "n1", 2)
	publishInputs(t, b, releaseLost(p))
	var prov contracts.UsageRecord
	waitFor(t, "P's provisional bill", func() (bool, string) {
		_, err := b.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamUsage}, func(_ context.Context, m *bus.Msg) error {
			var r contracts.UsageRecord
			if err := m.Decode(&r); err == nil && r.AllocationID == p.ID {
				prov = r
			}
			return nil
		})
		return err == nil && prov.ID != "", fmt.Sprint(err)
	})

	// Replica B handles the agent's end: voids A's record, bills the end.
	end := lostEnds["agent ends it after the release"]
	void := prov
	void.ID, void.Segment, void.Final, void.Provisional, void.Voids = contracts.UsageSegmentID(p.ID, 1), 1, false, false, prov.ID
	void.Seconds, void.GPUMillis, void.GPUSeconds = -prov.Seconds, -prov.GPUMillis, -prov.GPUSeconds
	void.CostMicros, void.OnDemandCostMicros, void.GPUCostMicros = -prov.CostMicros, -prov.OnDemandCostMicros, -prov.GPUCostMicros
	bill := record(p, end.secs)
	bill.ID, bill.Segment, bill.Reason = contracts.UsageSegmentID(p.ID, 2), 2, contracts.ReasonNodeLost
	for _, r := range []contracts.UsageRecord{void, bill} {
		if _, err := b.Publish(ctx, contracts.SubjectUsage(p.Tenant), r.ID, r, bus.CESubject(p.ID)); err != nil {
			t.Fatal(err)
		}
	}

	// One Billed fails while A is asked about an allocation it does not
	// hold (a new run): A reads USAGE back.
	store.fail.Store(true)
	q := forgetRunOf(alloc("t1", "newq", 1, "n1", 1), 4)
	publishInputs(t, b, q.fact, q.rel)
	waitFor(t, "A to read USAGE back", func() (bool, string) {
		n := tap.count("read back what billing forgot from USAGE")
		return n > 0, fmt.Sprintf("%d recalls", n)
	})
	store.fail.Store(false)
	settleConsumers(t, b)

	// B's ack was lost: the agent's fact comes to A, past the duplicate
	// window of B's records.
	natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamUsage)
	publishInputs(t, b, endedFact(p, end.end, end.outcome, end.reason))
	settleConsumers(t, b)
	time.Sleep(500 * time.Millisecond)
	all := append(append([]forgetRun(nil), runs...), q, forgetRun{a: p, lost: true, secs: end.secs})
	if ok, why := billedAsRun(b, all, true); !ok {
		t.Fatalf("USAGE after the redelivered fact: %s", why)
	}
}
