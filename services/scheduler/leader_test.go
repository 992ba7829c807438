package scheduler

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// replica runs one more scheduler with e.cfg until its stop is called.
func (e *env) replica() (stop func()) {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, e.cfg, testLogger(e.t)) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					e.t.Errorf("Run returned %v, want nil on shutdown", err)
				}
			case <-time.After(waitFor):
				e.t.Error("Run did not return after its context ended")
			}
		})
	}
	e.t.Cleanup(stop)
	return stop
}

// ledger reads ALLOCATIONS back from the start: live allocations by ID.
func (e *env) ledger() map[string]contracts.Allocation {
	e.t.Helper()
	live := map[string]contracts.Allocation{}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	_, err := e.bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamAllocations,
		FilterSubjects: []string{contracts.SubjectLedgerAll}}, func(_ context.Context, m *bus.Msg) error {
		le := decode[contracts.LedgerEntry](e.t, m)
		switch le.Kind {
		case contracts.LedgerCommitted:
			live[le.Allocation.ID] = le.Allocation
		case contracts.LedgerReleased:
			delete(live, le.Allocation.ID)
		}
		return nil
	})
	if err != nil {
		e.t.Fatal(err)
	}
	return live
}

func TestTwoReplicasOneLeaderTakeoverNoDoubleAllocation(t *testing.T) {
	e := newEnv(t)
	e.cfg.LeaseTTL = 300 * time.Millisecond
	e.inventory("n1", "default", h100, 4)
	e.inventory("n2", "default", h100, 4)
	e.autoCommit()

	// A leads (it starts alone); B starts once A has planned, as standby.
	stopA := e.replica()
	e.submit("acme", request("a0", 1, h100))
	e.waitEvent("acme", "a0", contracts.EventScheduled)
	stopB := e.replica()
	defer stopB()
	for i := 1; i < 4; i++ {
		e.submit("acme", request(fmt.Sprintf("a%d", i), 1, h100))
	}
	for i := range 4 {
		e.waitEvent("acme", fmt.Sprintf("a%d", i), contracts.EventScheduled)
	}

	// A stops: B takes over and places the rest.
	stopA()
	for i := range 4 {
		e.submit("acme", request(fmt.Sprintf("b%d", i), 1, h100))
	}
	for i := range 4 {
		e.waitEvent("acme", fmt.Sprintf("b%d", i), contracts.EventScheduled)
	}

	// Exactly one leader at a time: the a-jobs were planned at epoch 1,
	// the b-jobs at epoch 2, and every job was proposed once.
	proposed := map[string]int{}
	for _, m := range e.plans.all() {
		p := decode[contracts.Plan](t, m)
		for _, it := range p.Items {
			proposed[it.JobID]++
			want := uint64(1)
			if it.JobID[0] == 'b' {
				want = 2
			}
			if p.Epoch != want {
				t.Errorf("job %s planned in %s at epoch %d; want %d", it.JobID, p.ID, p.Epoch, want)
			}
		}
	}
	for _, prefix := range []string{"a", "b"} {
		for i := range 4 {
			if id := fmt.Sprintf("%s%d", prefix, i); proposed[id] != 1 {
				t.Errorf("job %s proposed %d times; want once", id, proposed[id])
			}
		}
	}

	// The ledger: 8 live allocations, no GPU held twice.
	live := e.ledger()
	holder := map[string]string{}
	for id, a := range live {
		for _, d := range a.Devices {
			if other, taken := holder[d.UUID]; taken {
				t.Errorf("GPU %s held by %s and %s", d.UUID, other, id)
			}
			holder[d.UUID] = id
		}
	}
	if len(live) != 8 || len(holder) != 8 {
		t.Errorf("%d live allocations on %d GPUs; want 8 on 8", len(live), len(holder))
	}
}
