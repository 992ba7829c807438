package billing_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/billing"
)

// TestBudgetAlertsOncePerThresholdAndPublishesStatus: spend crosses 50, 80
// and 100% of a budget: one alert each, then the status says exceeded with
// the tenant's policy; restarts of billing (beyond JetStream's duplicate
// window too) and budget edits never alert twice in a period.
func TestBudgetAlertsOncePerThresholdAndPublishesStatus(t *testing.T) {
	srv, b, statuses, budgets := budgetBus(t)
	ctx := context.Background()
	inventory(t, b, "s1", "spot-a", "spot")
	putBudget(t, budgets, "acme", 1_000_000, contracts.PolicySpotOnly) // 1.00 USD
	clock := func(c *billing.Config) { c.Now = func() time.Time { return t0.Add(time.Hour) } }
	stop := start(t, srv, billing.NewMemoryStore(), clock)

	status := func(want func(contracts.BudgetStatus) bool) contracts.BudgetStatus {
		t.Helper()
		return waitStatus(t, statuses, "acme", want)
	}
	spend := func(job string, secs int) {
		a := alloc("acme", job, 1, "n1", 1)
		publishLedger(t, b, "", committed(a), released(a, time.Duration(secs)*time.Second))
	}
	spend("a", 50) // 0.50: 50%
	st := status(func(s contracts.BudgetStatus) bool { return s.SpentMicros == 500_000 })
	if !slices.Equal(st.Crossed, []int{50}) || st.Exceeded || st.PeriodName != "2025-05" || st.Currency != "USD" {
		t.Errorf("status at 50%%: %+v", st)
	}
	spend("b", 30) // 0.80
	spend("c", 25) // 1.05: over
	st = status(func(s contracts.BudgetStatus) bool { return s.SpentMicros == 1_050_000 })
	if !slices.Equal(st.Crossed, []int{50, 80, 100}) || !st.Exceeded || st.Policy != contracts.PolicySpotOnly ||
		!slices.Equal(st.SpotPools, []string{"spot-a"}) {
		t.Errorf("status over budget: %+v", st)
	}
	if err := st.Admit(contracts.JobRequest{ID: "x"}, t0.Add(time.Hour)); err == nil {
		t.Error("the status admits a normal job over budget under spot-only")
	}
	if err := st.Admit(contracts.JobRequest{ID: "x", Pool: "spot-a"}, t0.Add(time.Hour)); err != nil {
		t.Errorf("the status refuses a spot job: %v", err)
	}
	wantAlerts := []string{"acme/2025-05/50", "acme/2025-05/80", "acme/2025-05/100"}
	waitAlerts(t, b, wantAlerts)

	// Restarts, beyond the duplicate window: no alert again.
	stop()
	natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamOps)
	stop = start(t, srv, billing.NewMemoryStore(), clock)
	spend("d", 1)
	status(func(s contracts.BudgetStatus) bool { return s.SpentMicros == 1_060_000 })
	// A raised limit uncrosses 100%; lowering it again does not alert again.
	putBudget(t, budgets, "acme", 10_000_000, contracts.PolicyReject)
	status(func(s contracts.BudgetStatus) bool { return !s.Exceeded && s.Policy == contracts.PolicyReject })
	putBudget(t, budgets, "acme", 1_000_000, contracts.PolicyReject)
	st = status(func(s contracts.BudgetStatus) bool { return s.Exceeded && s.Policy == contracts.PolicyReject })
	if !slices.Equal(st.Alerted, []int{50, 80, 100}) {
		t.Errorf("alerted = %v", st.Alerted)
	}
	waitAlerts(t, b, wantAlerts)

	// The budget removed: its status goes.
	if err := budgets.Delete(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the status to go", func() (bool, string) {
		_, err := statuses.Get(ctx, "acme")
		return errors.Is(err, jetstream.ErrKeyNotFound), "still there"
	})
	stop()
}

// waitAlerts checks that OPS holds exactly the budget alerts keyed want,
// in order. Billing publishes a status only after the alerts of its
// evaluation, so once the test has seen a status, every alert it owed is
// already in OPS: there is nothing to wait for.
func waitAlerts(t *testing.T, b *bus.Bus, want []string) {
	t.Helper()
	var got []string
	read := func() {
		got = got[:0]
		_, err := b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamOps,
			FilterSubjects: []string{contracts.SubjectAlert(contracts.AlertKindBudget)}}, func(_ context.Context, m *bus.Msg) error {
			var a contracts.Alert
			if err := m.Decode(&a); err != nil {
				return err
			}
			got = append(got, a.Key)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	read()
	if !slices.Equal(got, want) {
		t.Errorf("budget alerts %v, want %v", got, want)
	}
}
