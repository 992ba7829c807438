package gateway

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestUsageSeriesSpreadsRecordsOverSteps: a spot run over midnight is
// shared between its two days in proportion (its sums exact), an
// on-demand run of another pool is its own point, totals sum per pool
// and price class with what spot saved; ?pool= and ?from= keep part of
// it, and bad parameters are refused with a field error each.
func TestUsageSeriesSpreadsRecordsOverSteps(t *testing.T) {
	h := startGateway(t, nil, nil)
	day1 := time.Date(2026, 11, 20, 0, 0, 0, 0, time.UTC)
	day2 := day1.Add(24 * time.Hour)
	rec := func(alloc, pool string, class contracts.PriceClass, start, end time.Time, millis, cost, onDemand int64) contracts.UsageRecord {
		r := contracts.UsageRecord{SchemaVersion: 1, ID: contracts.UsageID(alloc), AllocationID: alloc, Tenant: "acme", JobID: "j-" + alloc,
			Attempt: 1, Pool: pool, GPUs: 2, Start: start, End: end, GPUMillis: millis, GPUSeconds: float64(millis) / 1000, Time: end}
		r.PriceClass, r.Currency, r.CostMicros, r.OnDemandCostMicros = class, "USD", cost, onDemand
		return r
	}
	spot := rec("a1", "h100", "spot", day1.Add(22*time.Hour), day2.Add(2*time.Hour), 28_800_000, 8_000_001, 20_000_000)
	l4 := rec("a2", "l4", "on-demand", day2.Add(3*time.Hour), day2.Add(4*time.Hour), 7_200_000, 1_000_000, 1_000_000)
	for _, r := range []contracts.UsageRecord{spot, l4} {
		if _, err := h.bus.Publish(context.Background(), contracts.SubjectUsage("acme"), r.ID, r); err != nil {
			t.Fatal(err)
		}
	}
	h.eventually("both records read", func() bool {
		var sum contracts.UsageSummary
		h.do(http.MethodGet, "/v1/tenants/acme/usage", "", &sum)
		return sum.Records == 2
	})
	var got contracts.UsageSeries
	if s, body := h.do(http.MethodGet, "/v1/tenants/acme/usage/series?step=day", "", &got); s != http.StatusOK {
		t.Fatalf("series: %d %s", s, body)
	}
	pt := func(start time.Time, pool, class string, millis, cost, onDemand int64) contracts.UsagePoint {
		return contracts.UsagePoint{Start: start, Pool: pool, PriceClass: class, GPUMillis: millis, GPUSeconds: float64(millis) / 1000,
			CostMicros: cost, OnDemandCostMicros: onDemand, SavedMicros: onDemand - cost}
	}
	want := contracts.UsageSeries{Tenant: "acme", Step: "day", Currency: "USD",
		Points: []contracts.UsagePoint{
			pt(day1, "h100", "spot", 14_400_000, 4_000_000, 10_000_000),
			pt(day2, "h100", "spot", 14_400_000, 4_000_001, 10_000_000),
			pt(day2, "l4", "on-demand", 7_200_000, 1_000_000, 1_000_000),
		},
		Totals: []contracts.UsagePoint{
			pt(time.Time{}, "h100", "spot", 28_800_000, 8_000_001, 20_000_000),
			pt(time.Time{}, "l4", "on-demand", 7_200_000, 1_000_000, 1_000_000),
		},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("series by day (-want +got):\n%s", diff)
	}

	var hours contracts.UsageSeries
	h.do(http.MethodGet, "/v1/tenants/acme/usage/series?step=hour&pool=h100&from="+day2.Format(time.RFC3339), "", &hours)
	if len(hours.Points) != 2 || !hours.Points[0].Start.Equal(day2) || hours.Points[0].GPUMillis != 7_200_000 ||
		hours.Points[1].GPUMillis != 7_200_000 || hours.Pool != "h100" || len(hours.Totals) != 1 || hours.Totals[0].GPUMillis != 14_400_000 {
		t.Fatalf("h100 by hour from day 2: %+v", hours)
	}

	for query, field := range map[string]string{"step=week": "step", "pool=H_100": "pool", "from=yesterday": "from",
		"from=2026-11-21T00:00:00Z&to=2026-11-20T00:00:00Z": "to"} {
		var ae contracts.APIError
		if s, _ := h.do(http.MethodGet, "/v1/tenants/acme/usage/series?"+query, "", &ae); s != http.StatusBadRequest ||
			len(ae.Error.Fields) != 1 || ae.Error.Fields[0].Field != field {
			t.Fatalf("?%s: %d %+v, want 400 naming %s", query, s, ae, field)
		}
	}
}
