package contracts

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"
)

func TestParseMoney(t *testing.T) {
	for in, want := range map[string]Money{
		"4.25": 4_250_000, "0.000001": 1, "12": 12_000_000, ".5": 500_000, "-3": -3_000_000,
		"007.10": 7_100_000, "1000000000000": MaxMoney,
	} {
		got, err := ParseMoney(in)
		if err != nil || got != want {
			t.Errorf("ParseMoney(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", ".", "4.", "4.2.5", "1e3", "0.0000001", "abc", "1,5", "-", "1000000000000.000001", "99999999999999"} {
		if _, err := ParseMoney(in); err == nil {
			t.Errorf("ParseMoney(%q) accepted", in)
		}
	}
}

func TestMoneyFormatsAndRounds(t *testing.T) {
	for m, want := range map[Money]string{4_250_000: "4.25", 125: "0.000125", -3_000_000: "-3.00", 0: "0.00", 1_234_567: "1.234567"} {
		if got := m.String(); got != want {
			t.Errorf("Money(%d).String() = %q, want %q", int64(m), got, want)
		}
	}
	// Half to even at the cent: 0.005 → 0.00, 0.015 → 0.02, 0.025 → 0.02.
	for m, want := range map[Money]string{5_000: "0.00", 15_000: "0.02", 25_000: "0.02", 25_001: "0.03", -15_000: "-0.02",
		-25_000: "-0.02", 4_999: "0.00", 1_994_999: "1.99", 1_995_000: "2.00"} {
		if got := m.CentString(); got != want {
			t.Errorf("Money(%d).CentString() = %q, want %q", int64(m), got, want)
		}
	}
	var m Money
	for in, want := range map[string]Money{`"4.25"`: 4_250_000, `4.25`: 4_250_000, `7`: 7_000_000} {
		if err := json.Unmarshal([]byte(in), &m); err != nil || m != want {
			t.Errorf("unmarshal %s = %d, %v", in, m, err)
		}
	}
	if err := json.Unmarshal([]byte(`4.25e2`), &m); err == nil {
		t.Error("an exponent was accepted")
	}
	if b, _ := json.Marshal(Money(4_250_000)); string(b) != `"4.25"` {
		t.Errorf("marshal = %s", b)
	}
}

func TestRoundHalfEven(t *testing.T) {
	for _, c := range []struct{ n, d, want int64 }{
		{5, 10, 0}, {15, 10, 2}, {25, 10, 2}, {26, 10, 3}, {-15, 10, -2}, {-25, 10, -2}, {-26, 10, -3}, {14, 10, 1}, {7, 7, 1},
	} {
		if got := RoundHalfEven(c.n, c.d); got != c.want {
			t.Errorf("RoundHalfEven(%d, %d) = %d, want %d", c.n, c.d, got, c.want)
		}
	}
}

var jan = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func book(versions ...PriceVersion) PriceBook { return PriceBook{Versions: versions} }

func version(id string, from time.Time, h100 Money) PriceVersion {
	return PriceVersion{ID: id, EffectiveFrom: from, Currency: "USD",
		GPU: map[string]GPUPrices{"H100-80GB": {OnDemand: h100, Spot: h100 / 2}, AnyGPUModel: {OnDemand: 1_000_000}}}
}

func TestPriceBookValidate(t *testing.T) {
	good := book(version("v1", jan, 4_000_000), version("v2", jan.AddDate(0, 1, 0), 3_000_000))
	if err := good.Validate(); err != nil {
		t.Fatalf("valid book: %v", err)
	}
	bad := book(
		PriceVersion{ID: "", EffectiveFrom: jan.Add(time.Millisecond), Currency: "usd",
			GPU: map[string]GPUPrices{"B200": {OnDemand: 1}, "L4": {OnDemand: 0, Spot: -1}}},
		PriceVersion{ID: "v2", EffectiveFrom: jan, Currency: "EUR", CPUCoreHour: -5},
		PriceVersion{ID: "v2", Currency: "USD", GPU: map[string]GPUPrices{"L4": {OnDemand: 1}}},
	)
	err := bad.Validate()
	var ve *ValidationError
	if !errors.As(err, &ve) {
		t.Fatalf("Validate = %v, want a *ValidationError", err)
	}
	want := map[string]Reason{
		"versions[0].id": ReasonMissingField, "versions[0].effectiveFrom": ReasonInvalidValue,
		"versions[0].currency": ReasonInvalidValue, "versions[0].gpu.B200": ReasonUnknownGPUModel,
		"versions[0].gpu.L4.onDemand": ReasonOutOfRange, "versions[0].gpu.L4.spot": ReasonOutOfRange,
		"versions[1].effectiveFrom": ReasonInvalidValue, "versions[1].currency": ReasonInvalidValue,
		"versions[1].gpu": ReasonMissingField, "versions[1].cpuCoreHour": ReasonOutOfRange,
		"versions[2].id": ReasonInvalidValue, "versions[2].effectiveFrom": ReasonMissingField,
	}
	got := map[string]Reason{}
	for _, f := range ve.Fields {
		got[f.Field] = f.Reason
	}
	for field, reason := range want {
		if got[field] != reason {
			t.Errorf("%s: reason %q, want %q (all: %v)", field, got[field], reason, ve.Fields)
		}
	}
}

func TestPriceBookChangeKeepsMeteredTimeReproducible(t *testing.T) {
	v1, v2 := version("v1", jan, 4_000_000), version("v2", jan.AddDate(0, 1, 0), 3_000_000)
	old := book(v1, v2)
	cutoff := jan.AddDate(0, 1, 10) // v1 and v2 are both in effect already
	tests := map[string]struct {
		next PriceBook
		want Reason // "" = accepted
	}{
		"a new version after the cutoff": {book(v1, v2, version("v3", cutoff, 2_000_000)), ""},
		"a new version before the cutoff": {book(v1, v2, version("v3", cutoff.Add(-time.Second), 2_000_000)),
			ReasonEffectiveInPast},
		"an effective version changed": {book(v1, version("v2", v2.EffectiveFrom, 9_000_000)), ReasonImmutableVersion},
		"an effective version removed": {book(v1), ReasonImmutableVersion},
		"a future version edited":      {book(v1, v2, version("v3", cutoff.AddDate(0, 0, 1), 1)), ""},
	}
	for name, tt := range tests {
		err := tt.next.ValidateChange(old, cutoff)
		var ve *ValidationError
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("%s: %v", name, err)
		case tt.want != "" && (!errors.As(err, &ve) || ve.Reason != tt.want):
			t.Errorf("%s: %v, want %s", name, err, tt.want)
		case tt.want == ReasonEffectiveInPast && !strings.Contains(err.Error(), "may not reach back"):
			t.Errorf("%s: the error does not say why: %v", name, err)
		}
	}
}

func TestPriceBookLookups(t *testing.T) {
	b := book(version("v1", jan, 4_000_000), version("v2", jan.Add(time.Hour), 3_000_000))
	if _, ok := b.At(jan.Add(-time.Second)); ok {
		t.Error("a version before the first")
	}
	if v, _ := b.At(jan.Add(time.Hour - time.Second)); v.ID != "v1" {
		t.Errorf("At(just before v2) = %s", v.ID)
	}
	if v, _ := b.At(jan.Add(time.Hour)); v.ID != "v2" {
		t.Errorf("At(v2's start) = %s", v.ID)
	}
	v, _ := b.At(jan)
	for _, c := range []struct {
		model string
		class PriceClass
		want  Money
		ok    bool
	}{
		{"H100-80GB", PriceOnDemand, 4_000_000, true}, {"H100-80GB", PriceSpot, 2_000_000, true},
		{"H100-80GB", PriceReserved, 4_000_000, true}, {"L4", PriceSpot, 1_000_000, true},
	} {
		if got, ok := v.GPUPrice(c.model, c.class); got != c.want || ok != c.ok {
			t.Errorf("GPUPrice(%s, %s) = %s, %v", c.model, c.class, got, ok)
		}
	}
	delete(v.GPU, AnyGPUModel)
	if _, ok := v.GPUPrice("L4", PriceOnDemand); ok {
		t.Error("L4 priced without a * entry")
	}
	if got := b.Changes(jan, jan.Add(2*time.Hour)); len(got) != 1 || !got[0].Equal(jan.Add(time.Hour)) {
		t.Errorf("Changes = %v", got)
	}
	if got := b.Changes(jan.Add(time.Hour), jan.Add(2*time.Hour)); len(got) != 0 {
		t.Errorf("Changes from a change = %v: a segment starting at a change is not split there", got)
	}
}

func TestBudgetValidateAndPeriods(t *testing.T) {
	if _, err := DecodeBudget([]byte(`{"period":"monthly","limit":"100.50","policy":"reject"}`), "acme"); err != nil {
		t.Fatal(err)
	}
	_, err := DecodeBudget([]byte(`{"tenant":"beta","period":"weekly","limit":"0","policy":"maybe"}`), "acme")
	var ve *ValidationError
	if !errors.As(err, &ve) || len(ve.Fields) != 4 {
		t.Fatalf("DecodeBudget = %v, want 4 field errors", err)
	}
	if _, err := DecodeBudget([]byte(`{"period":"daily","limit":"1.2345678","policy":"notify"}`), "acme"); err == nil ||
		!strings.Contains(err.Error(), "limit") {
		t.Errorf("7 decimals: %v", err)
	}
	at := time.Date(2026, 11, 30, 23, 59, 59, 0, time.FixedZone("x", -3600))
	name, start, end := PeriodOf(BudgetMonthly, at)
	if name != "2026-12" || !start.Equal(time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)) || !end.Equal(time.Date(2027, 1, 1, 0, 0, 0, 0, time.UTC)) {
		t.Errorf("PeriodOf(monthly) = %s %s %s: periods are UTC", name, start, end)
	}
	if name, _, _ := PeriodOf(BudgetDaily, at); name != "2026-12-01" {
		t.Errorf("PeriodOf(daily) = %s", name)
	}
	if s, e, err := ParsePeriod("2026-02"); err != nil || e.Sub(s) != 28*24*time.Hour {
		t.Errorf("ParsePeriod = %s %s %v", s, e, err)
	}
	if _, _, err := ParsePeriod("2026-13"); err == nil || !strings.Contains(err.Error(), string(ReasonInvalidPeriod)) {
		t.Errorf("ParsePeriod(2026-13) = %v", err)
	}
}

func TestBudgetStatusAdmit(t *testing.T) {
	now := time.Date(2026, 11, 15, 12, 0, 0, 0, time.UTC)
	_, start, end := PeriodOf(BudgetMonthly, now)
	status := func(policy BudgetPolicy, exceeded bool) *BudgetStatus {
		return &BudgetStatus{Tenant: "acme", Period: BudgetMonthly, PeriodName: "2026-11", PeriodStart: start, PeriodEnd: end,
			Currency: "USD", LimitMicros: 100_000_000, SpentMicros: 100_004_999, Policy: policy, Exceeded: exceeded,
			SpotPools: []string{"l4"}}
	}
	normal := JobRequest{ID: "j", Priority: PriorityNormal}
	bestEffort := JobRequest{ID: "j", Priority: PriorityBestEffort}
	spotPool := JobRequest{ID: "j", Priority: PriorityHigh, Pool: "l4"}
	otherPool := JobRequest{ID: "j", Pool: "h100"}
	tests := []struct {
		name  string
		s     *BudgetStatus
		req   JobRequest
		at    time.Time
		admit bool
	}{
		{"no status", nil, normal, now, true},
		{"under budget", status(PolicyReject, false), normal, now, true},
		{"notify", status(PolicyNotify, true), normal, now, true},
		{"reject", status(PolicyReject, true), bestEffort, now, false},
		{"reject, next period", status(PolicyReject, true), normal, end, true},
		{"spot-only, normal", status(PolicySpotOnly, true), normal, now, false},
		{"spot-only, other pool", status(PolicySpotOnly, true), otherPool, now, false},
		{"spot-only, best-effort", status(PolicySpotOnly, true), bestEffort, now, true},
		{"spot-only, spot pool", status(PolicySpotOnly, true), spotPool, now, true},
	}
	for _, tt := range tests {
		err := tt.s.Admit(tt.req, tt.at)
		var ve *ValidationError
		switch {
		case tt.admit && err != nil:
			t.Errorf("%s: refused: %v", tt.name, err)
		case !tt.admit && (!errors.As(err, &ve) || ve.Reason != ReasonBudgetExceeded):
			t.Errorf("%s: %v, want budget_exceeded", tt.name, err)
		case !tt.admit && !strings.Contains(err.Error(), "100.00 USD of its 100.00 USD monthly budget for 2026-11"):
			t.Errorf("%s: the reason does not say the spend: %v", tt.name, err)
		}
	}
}

func TestBuildInvoice(t *testing.T) {
	day := time.Date(2026, 11, 3, 0, 0, 0, 0, time.UTC)
	rec := func(id, tenant string, start time.Time, class PriceClass, cost, onDemand int64) UsageRecord {
		return UsageRecord{ID: id, Tenant: tenant, GPUModel: "H100-80GB", Pool: "p-" + string(class), Start: start, GPUMillis: 1000,
			UsageSegment: UsageSegment{PriceClass: class, PriceVersion: "v1", Currency: "USD", GPURateMicros: cost,
				GPUCostMicros: cost, CostMicros: cost, OnDemandCostMicros: onDemand}}
	}
	recs := []UsageRecord{
		rec("a", "acme", day, PriceOnDemand, 1_005_000, 1_005_000),
		rec("a", "acme", day, PriceOnDemand, 1_005_000, 1_005_000), // a repeat counts once
		rec("b", "acme", day.Add(time.Hour), PriceSpot, 400_000, 1_000_000),
		rec("c", "acme", day.Add(time.Hour), PriceSpot, 400_000, 1_000_000),
		rec("d", "acme", day.AddDate(0, 1, 0), PriceSpot, 1, 1), // next month
		rec("e", "beta", day, PriceSpot, 1, 1),                  // another tenant
		rec("f", "acme", day.Add(2*time.Hour), PriceReserved, 2_500, 5_000),
	}
	inv, err := BuildInvoice("acme", "2026-11", recs)
	if err != nil {
		t.Fatal(err)
	}
	if inv.Records != 4 || inv.TotalMicros != 1_807_500 || inv.Total != "1.81" || inv.SpotSavingsMicros != 1_200_000 ||
		inv.SpotSavings != "1.20" || inv.OnDemandMicros != 3_010_000 || inv.Currency != "USD" {
		t.Errorf("invoice = %+v", inv)
	}
	if len(inv.Lines) != 3 || inv.Lines[0].PriceClass != PriceOnDemand || inv.Lines[1].PriceClass != PriceSpot ||
		inv.Lines[1].Records != 2 || inv.Lines[0].Cost != "1.00" {
		t.Errorf("lines = %+v (on-demand first; 1.005 rounds half to even to 1.00)", inv.Lines)
	}
	if len(inv.ByClass) != 3 || inv.ByClass[2].PriceClass != PriceReserved || inv.ByClass[2].SavingsMicros != 2_500 {
		t.Errorf("by class = %+v", inv.ByClass)
	}
	if _, err := BuildInvoice("acme", "November", recs); err == nil {
		t.Error("a bad period was accepted")
	}
}

func FuzzDecodePriceBook(f *testing.F) {
	f.Add([]byte(`{"versions":[{"id":"v1","effectiveFrom":"2026-01-01T00:00:00Z","currency":"USD","gpu":{"*":{"onDemand":"2.5"}}}]}`))
	f.Add([]byte(`{"versions":[{"gpu":{"L4":{"onDemand":1e400}}}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := DecodePriceBook(data)
		if err == nil {
			if verr := b.Validate(); verr != nil {
				t.Fatalf("decoded a book that does not validate: %v", verr)
			}
		}
	})
}

func FuzzDecodeBudget(f *testing.F) {
	f.Add([]byte(`{"period":"monthly","limit":"100","policy":"reject"}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := DecodeBudget(data, "acme")
		if err == nil && (b.Limit <= 0 || b.Tenant != "acme") {
			t.Fatalf("accepted %+v", b)
		}
	})
}

func FuzzParseMoney(f *testing.F) {
	f.Add("4.25")
	f.Add("-0.000001")
	f.Fuzz(func(t *testing.T, s string) {
		m, err := ParseMoney(s)
		if err != nil {
			return
		}
		if back, err := ParseMoney(m.String()); err != nil || back != m {
			t.Fatalf("%q → %d → %q → %d, %v", s, m, m.String(), back, err)
		}
	})
}
