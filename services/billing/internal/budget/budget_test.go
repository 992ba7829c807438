package budget

import (
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestReachedIsExactAtTheThreshold(t *testing.T) {
	const limit = 1_000_001 // 1.000001: 50% is 500000.5 micro-units
	for _, c := range []struct {
		spent     int64
		threshold int
		want      bool
	}{
		{500_000, 50, false}, {500_001, 50, true}, {800_000, 80, false}, {800_001, 80, true},
		{1_000_000, 100, false}, {1_000_001, 100, true},
		// No overflow near the largest budget.
		{int64(contracts.MaxMoney), 100, true}, {int64(contracts.MaxMoney) - 1, 100, false},
	} {
		l := int64(limit)
		if c.spent > limit*2 {
			l = int64(contracts.MaxMoney)
		}
		if got := reached(c.spent, l, c.threshold); got != c.want {
			t.Errorf("reached(%d, %d, %d%%) = %v", c.spent, l, c.threshold, got)
		}
	}
}

func TestSameIgnoresOnlyTheTime(t *testing.T) {
	a := contracts.BudgetStatus{Tenant: "acme", SpentMicros: 5, Time: time.Now()}
	b := a
	b.Time = a.Time.Add(time.Hour)
	if !same(a, b) {
		t.Error("statuses differing only in time are not the same")
	}
	b.Alerted = []int{50}
	if same(a, b) {
		t.Error("a new alert is not a change")
	}
}

// TestTouchAllIsNeverDroppedBehindTouches: the store becomes complete
// right after a replay whose every batch touched its tenants, filling the
// queue; the evaluation of every tenant owed then must still come (from a
// review: it waited for the next tick, 30 s by default).
func TestTouchAllIsNeverDroppedBehindTouches(t *testing.T) {
	w := New(Config{})
	for range cap(w.touched) + 1 {
		w.Touch([]string{"acme"})
	}
	w.TouchAll()
	w.TouchAll() // one request waiting covers a second
	if len(w.all) != 1 {
		t.Errorf("%d requests to evaluate every tenant wait, want 1", len(w.all))
	}
}
