package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

func bookJSON(versions ...string) string {
	return `{"versions":[` + strings.Join(versions, ",") + `]}`
}

func versionJSON(id string, from time.Time, h100 string) string {
	return fmt.Sprintf(`{"id":%q,"effectiveFrom":%q,"currency":"USD","gpu":{"H100-80GB":{"onDemand":%q,"spot":"1.50"},"*":{"onDemand":"1"}}}`,
		id, from.UTC().Format(time.RFC3339), h100)
}

func TestPriceBookEdits(t *testing.T) {
	h := startGateway(t, nil, nil)
	var doc contracts.PriceBookDoc
	if status, body := h.do(http.MethodGet, "/v1/pricebook", "", &doc); status != http.StatusOK || doc.Revision != 0 || len(doc.Book.Versions) != 0 {
		t.Fatalf("GET of no book: %d %s", status, body)
	}
	soon := time.Now().Add(time.Hour).Truncate(time.Second)

	// Invalid: every field error at once.
	var apiErr contracts.APIError
	status, _ := h.do(http.MethodPut, "/v1/pricebook", `{"versions":[{"id":"v1","effectiveFrom":"2099-01-01T00:00:00.5Z","currency":"usd","gpu":{"B300":{"onDemand":"-1"}}}]}`, &apiErr)
	fields := map[string]contracts.Reason{}
	for _, f := range apiErr.Error.Fields {
		fields[f.Field] = f.Reason
	}
	if status != http.StatusBadRequest || fields["versions[0].currency"] != contracts.ReasonInvalidValue ||
		fields["versions[0].gpu.B300"] != contracts.ReasonUnknownGPUModel || fields["versions[0].effectiveFrom"] != contracts.ReasonInvalidValue {
		t.Errorf("invalid book: %d %+v", status, apiErr)
	}
	status, _ = h.do(http.MethodPut, "/v1/pricebook", `{"versions":[{"id":"v1","effectiveFrom":"2099-01-01T00:00:00Z","currency":"USD","gpu":{"L4":{"onDemand":"1.1234567"}}}]}`, &apiErr)
	if status != http.StatusBadRequest || len(apiErr.Error.Fields) != 1 || apiErr.Error.Fields[0].Field != "versions[0].gpu.L4.onDemand" {
		t.Errorf("7 decimals: %d %+v, want the amount's field named", status, apiErr)
	}

	// A book in the past is refused; one from the next hour is taken.
	status, _ = h.do(http.MethodPut, "/v1/pricebook", bookJSON(versionJSON("v1", time.Now().Add(-time.Minute), "4")), &apiErr)
	if status != http.StatusBadRequest || apiErr.Error.Reason != contracts.ReasonEffectiveInPast {
		t.Errorf("a version in the past: %d %+v", status, apiErr)
	}
	if status, body := h.do(http.MethodPut, "/v1/pricebook", bookJSON(versionJSON("v1", soon, "4")), &doc); status != http.StatusOK || doc.Revision == 0 {
		t.Fatalf("PUT: %d %s", status, body)
	}
	rev := doc.Revision
	if status, _ := h.do(http.MethodGet, "/v1/pricebook", "", &doc); status != http.StatusOK || doc.Revision != rev ||
		doc.Book.Versions[0].GPU["H100-80GB"].Spot != 1_500_000 {
		t.Errorf("GET after PUT: %+v", doc)
	}
	// A stale revision loses.
	status, _ = h.do(http.MethodPut, fmt.Sprintf("/v1/pricebook?revision=%d", rev+7), bookJSON(versionJSON("v1", soon, "5")), &apiErr)
	if status != http.StatusConflict || apiErr.Error.Reason != contracts.ReasonConflict {
		t.Errorf("stale revision: %d %+v", status, apiErr)
	}

	// Billing metered up to tomorrow (clocks disagree, or the test says
	// so): a version before that is refused, and a version already in
	// effect cannot change.
	kv, err := h.bus.KeyValue(context.Background(), contracts.BucketPriceBook)
	if err != nil {
		t.Fatal(err)
	}
	metered := time.Now().Add(24 * time.Hour).Truncate(time.Second)
	if _, err := kv.Put(context.Background(), contracts.KeyMeteredUntil, []byte(metered.UTC().Format(time.RFC3339))); err != nil {
		t.Fatal(err)
	}
	status, _ = h.do(http.MethodPut, "/v1/pricebook", bookJSON(versionJSON("v1", soon, "4"), versionJSON("v2", metered.Add(-time.Second), "3")), &apiErr)
	if status != http.StatusBadRequest || apiErr.Error.Reason != contracts.ReasonEffectiveInPast ||
		!strings.Contains(apiErr.Error.Message, "may not reach back") {
		t.Errorf("a version before the metered time: %d %+v", status, apiErr)
	}
	status, _ = h.do(http.MethodPut, "/v1/pricebook", bookJSON(versionJSON("v1", soon, "9")), &apiErr)
	if status != http.StatusBadRequest || apiErr.Error.Reason != contracts.ReasonImmutableVersion {
		t.Errorf("changing a metered version: %d %+v", status, apiErr)
	}
	if status, body := h.do(http.MethodPut, fmt.Sprintf("/v1/pricebook?revision=%d", rev),
		bookJSON(versionJSON("v1", soon, "4"), versionJSON("v2", metered, "3")), &doc); status != http.StatusOK || len(doc.Book.Versions) != 2 ||
		!doc.MeteredUntil.Equal(metered) {
		t.Errorf("adding a version at the metered time: %d %s", status, body)
	}
}

func TestBudgetEdits(t *testing.T) {
	h := startGateway(t, nil, nil)
	var doc contracts.BudgetDoc
	if status, body := h.do(http.MethodGet, "/v1/tenants/acme/budget", "", &doc); status != http.StatusOK || doc.Budget != nil {
		t.Fatalf("no budget: %d %s", status, body)
	}
	var apiErr contracts.APIError
	status, _ := h.do(http.MethodPut, "/v1/tenants/acme/budget", `{"tenant":"beta","period":"weekly","limit":"x","policy":"reject"}`, &apiErr)
	if status != http.StatusBadRequest || apiErr.Error.Fields[0].Field != "limit" {
		t.Errorf("bad limit: %d %+v", status, apiErr)
	}
	status, _ = h.do(http.MethodPut, "/v1/tenants/acme/budget", `{"tenant":"beta","period":"weekly","limit":"5","policy":"maybe"}`, &apiErr)
	if status != http.StatusBadRequest || len(apiErr.Error.Fields) != 3 {
		t.Errorf("bad budget: %d %+v, want tenant, period and policy", status, apiErr)
	}
	if status, body := h.do(http.MethodPut, "/v1/tenants/acme/budget", `{"period":"daily","limit":"250.5","policy":"spot-only"}`, &doc); status != http.StatusOK ||
		doc.Budget == nil || doc.Budget.Limit != 250_500_000 || doc.Budget.Tenant != "acme" {
		t.Fatalf("PUT: %d %s", status, body)
	}
	// Billing's status shows beside the budget.
	statuses, err := h.bus.KeyValue(context.Background(), contracts.BucketBudgetStatus)
	if err != nil {
		t.Fatal(err)
	}
	st, _ := json.Marshal(contracts.BudgetStatus{Tenant: "acme", Exceeded: true, Policy: contracts.PolicySpotOnly})
	if _, err := statuses.Put(context.Background(), "acme", st); err != nil {
		t.Fatal(err)
	}
	if h.do(http.MethodGet, "/v1/tenants/acme/budget", "", &doc); doc.Status == nil || !doc.Status.Exceeded {
		t.Errorf("GET: %+v", doc)
	}
	if status, _ := h.do(http.MethodDelete, "/v1/tenants/acme/budget", "", nil); status != http.StatusOK {
		t.Errorf("DELETE: %d", status)
	}
	var after contracts.BudgetDoc
	if h.do(http.MethodGet, "/v1/tenants/acme/budget", "", &after); after.Budget != nil {
		t.Errorf("after DELETE: %+v", after.Budget)
	}
	if status, _ := h.do(http.MethodPut, "/v1/tenants/Bad.Tenant/budget", `{}`, nil); status != http.StatusBadRequest {
		t.Errorf("bad tenant: %d", status)
	}
}

func TestInvoiceFromUsage(t *testing.T) {
	h := startGateway(t, nil, nil)
	nov := time.Date(2026, 11, 2, 10, 0, 0, 0, time.UTC)
	recs := []contracts.UsageRecord{
		{ID: "usage/acme/a/1/s0", AllocationID: "acme/a/1", Tenant: "acme", JobID: "a", Pool: "h100", GPUModel: "H100-80GB", Start: nov,
			GPUMillis: 3_600_000, UsageSegment: contracts.UsageSegment{PriceClass: contracts.PriceOnDemand, PriceVersion: "v1",
				Currency: "USD", CostMicros: 4_000_000, OnDemandCostMicros: 4_000_000}},
		{ID: "usage/acme/b/1/s0", AllocationID: "acme/b/1", Tenant: "acme", JobID: "b", Pool: "l4", GPUModel: "L4", Start: nov,
			GPUMillis: 3_600_000, UsageSegment: contracts.UsageSegment{PriceClass: contracts.PriceSpot, PriceVersion: "v1",
				Currency: "USD", CostMicros: 300_005, OnDemandCostMicros: 800_000}},
		{ID: "usage/acme/c/1/s0", AllocationID: "acme/c/1", Tenant: "acme", JobID: "c", Pool: "l4", GPUModel: "L4",
			Start: nov.AddDate(0, 1, 0), GPUMillis: 1000, UsageSegment: contracts.UsageSegment{PriceClass: contracts.PriceSpot, CostMicros: 1}},
	}
	for _, r := range recs {
		if _, err := h.bus.Publish(context.Background(), contracts.SubjectUsage(r.Tenant), r.ID, r); err != nil {
			t.Fatal(err)
		}
	}
	var inv contracts.Invoice
	h.eventually("the invoice", func() bool {
		status, _ := h.do(http.MethodGet, "/v1/tenants/acme/invoice?period=2026-11", "", &inv)
		return status == http.StatusOK && inv.Records == 2
	})
	if inv.Total != "4.30" || inv.SpotSavings != "0.50" || inv.Currency != "USD" || len(inv.ByClass) != 2 {
		t.Errorf("invoice = %+v", inv)
	}
	// The December record may be folded after November's invoice is
	// whole: wait for all three.
	var sum contracts.UsageSummary
	h.eventually("three usage records", func() bool {
		h.do(http.MethodGet, "/v1/tenants/acme/usage", "", &sum)
		return sum.Records == 3
	})
	if sum.CostMicros != 4_300_006 || sum.Currency != "USD" {
		t.Errorf("usage = %+v", sum)
	}
	var apiErr contracts.APIError
	if status, _ := h.do(http.MethodGet, "/v1/tenants/acme/invoice?period=2026-13", "", &apiErr); status != http.StatusBadRequest ||
		apiErr.Error.Reason != contracts.ReasonInvalidPeriod {
		t.Errorf("bad period: %d %+v", status, apiErr)
	}
}
