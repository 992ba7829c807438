package scheduler

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/lease"
)

// TestLeaderThatCannotRebuildGivesTheLeaseUp (issue 13, finding 5): a
// leader whose rebuild does not finish within RebuildTimeout releases the
// lease, so another contender takes it at the next epoch long before the
// rebuild would have ended (here: never), and it contends again: once the
// lease is free and its rebuild can finish, it leads and schedules.
// Before, it renewed the lease for as long as the rebuild hung and nothing
// was scheduled.
func TestLeaderThatCannotRebuildGivesTheLeaseUp(t *testing.T) {
	e := newEnv(t)
	e.cfg.LeaseTTL = 300 * time.Millisecond
	e.cfg.RebuildTimeout = 600 * time.Millisecond
	var rebuilds atomic.Int32
	// The first term's rebuild hangs as one cut off by a dying NATS node
	// did; later ones go through.
	e.cfg.rebuildHook = func(ctx context.Context) error {
		if rebuilds.Add(1) == 1 {
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	}
	e.inventory("n1", "default", h100, 4)
	e.autoCommit()
	e.start()
	eventually(t, "the scheduler to lead and start its rebuild", func() bool { return rebuilds.Load() >= 1 })

	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	kv, err := e.bus.KeyValue(ctx, contracts.BucketLeases)
	if err != nil {
		t.Fatal(err)
	}
	// Another replica, polling: it gets the lease only if the stuck
	// leader gives it up (the leader renews it every 100 ms otherwise).
	other, err := lease.New(lease.Config{KV: kv, Key: contracts.LeaseKeyScheduler(e.cfg.Name), Holder: "other",
		TTL: e.cfg.LeaseTTL})
	if err != nil {
		t.Fatal(err)
	}
	var term lease.Term
	eventually(t, "the stuck leader to give the lease up", func() bool {
		actx, acancel := context.WithTimeout(ctx, 2*time.Second)
		defer acancel()
		tm, ok, err := other.TryAcquire(actx)
		if err != nil {
			t.Fatal(err)
		}
		term = tm
		return ok
	})
	if rebuilds.Load() != 1 {
		t.Errorf("%d rebuilds before the lease was given up; want 1", rebuilds.Load())
	}
	if term.Epoch != 2 {
		t.Errorf("the other replica leads at epoch %d; want 2", term.Epoch)
	}
	// The other replica goes away; the scheduler leads again, rebuilds
	// and schedules under epoch 3.
	if err := other.Release(ctx, term); err != nil {
		t.Fatal(err)
	}
	e.submit("acme", request("j1", 1, h100))
	e.waitEvent("acme", "j1", contracts.EventScheduled)
	for _, m := range e.plans.all() {
		if p := decode[contracts.Plan](t, m); p.Epoch != 3 {
			t.Errorf("plan %s at epoch %d; want 3", p.ID, p.Epoch)
		}
	}
}

// TestRebuildBoundGrowsWithStepDowns: the bound doubles for each
// step-down in a row, so a state larger than the first bound is rebuilt
// by a later term instead of every term giving up on it.
func TestRebuildBoundGrowsWithStepDowns(t *testing.T) {
	tests := []struct {
		timeout, ttl time.Duration
		stepDowns    int
		want         time.Duration
	}{
		{0, 3 * time.Second, 0, 15 * time.Second},
		{0, 3 * time.Second, 1, 30 * time.Second},
		{0, 3 * time.Second, 2, time.Minute},
		{0, 3 * time.Second, 6, 16 * time.Minute},
		{0, 3 * time.Second, 40, 16 * time.Minute},
		{10 * time.Second, 3 * time.Second, 0, 10 * time.Second},
		{10 * time.Second, 3 * time.Second, 3, 80 * time.Second},
	}
	for _, tt := range tests {
		c := Config{RebuildTimeout: tt.timeout, LeaseTTL: tt.ttl}
		if got := c.rebuildBound(tt.stepDowns); got != tt.want {
			t.Errorf("timeout %s, ttl %s, %d step-downs: bound %s, want %s", tt.timeout, tt.ttl, tt.stepDowns, got, tt.want)
		}
	}
}
