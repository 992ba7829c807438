package scheduler

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestBudgetPolicyAtIntake: billing says acme is over its budget; the
// scheduler's intake applies acme's policy to new jobs; other tenants and
// jobs accepted before are untouched; a status of a past period or a
// budget raised admits again.
func TestBudgetPolicyAtIntake(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	kv, err := e.bus.KeyValue(ctx, contracts.BucketBudgetStatus)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	_, start, end := contracts.PeriodOf(contracts.BudgetMonthly, now)
	put := func(policy contracts.BudgetPolicy, exceeded bool, periodEnd time.Time) {
		t.Helper()
		st := contracts.BudgetStatus{SchemaVersion: 1, Tenant: "acme", Period: contracts.BudgetMonthly, PeriodName: "now",
			PeriodStart: start, PeriodEnd: periodEnd, Currency: "USD", LimitMicros: 100, SpentMicros: 120, Policy: policy,
			Exceeded: exceeded, SpotPools: []string{"cheap"}}
		data, _ := json.Marshal(st)
		if _, err := kv.Put(ctx, "acme", data); err != nil {
			t.Fatal(err)
		}
	}
	// The status is there before the scheduler starts: intake must not
	// take a request before it has read it.
	put(contracts.PolicyReject, true, end)
	e.start()
	e.submit("acme", request("r1", 1, h100))
	e.submit("beta", request("b1", 1, h100))
	ev := e.waitEvent("acme", "r1", contracts.EventRejected)
	if ev.Reason != contracts.ReasonBudgetExceeded || !strings.Contains(ev.Message, "policy reject") ||
		len(ev.Errors) != 1 || ev.Errors[0].Reason != contracts.ReasonBudgetExceeded {
		t.Errorf("rejection = %+v", ev)
	}
	e.waitEvent("beta", "b1", contracts.EventQueued)

	put(contracts.PolicySpotOnly, true, end)
	normal := request("s1", 1, h100)
	best := request("s2", 1, h100)
	best.Priority = contracts.PriorityBestEffort
	spot := request("s3", 1, h100)
	spot.Pool = "cheap"
	// The status change reaches the scheduler through the bus: wait until
	// it rejects for the new policy.
	try := 0
	eventually(t, "the spot-only policy to apply", func() bool {
		try++
		normal.ID = fmt.Sprintf("s1-%d", try)
		e.submit("acme", normal)
		ev := e.waitEvent("acme", normal.ID, contracts.EventRejected)
		return strings.Contains(ev.Message, "policy spot-only")
	})
	e.submit("acme", best)
	e.submit("acme", spot)
	e.waitEvent("acme", "s2", contracts.EventQueued)
	e.waitEvent("acme", "s3", contracts.EventQueued)

	// A status of a period that has ended says nothing; neither does one
	// under the limit.
	put(contracts.PolicyReject, true, now.Add(-time.Second))
	eventually(t, "a stale status to admit", func() bool {
		try++
		id := fmt.Sprintf("late-%d", try)
		e.submit("acme", request(id, 1, h100))
		eventually(t, "an answer to "+id, func() bool { return len(e.jobEvents("acme", id)) > 0 })
		return e.jobEvents("acme", id)[0].Type == contracts.EventQueued
	})
}
