package contracts

import (
	"cmp"
	"fmt"
	"slices"
	"time"
)

// The gateway's billing endpoints (paths in api.go's list):
//
//	GET /v1/pricebook                          -> 200 PriceBookDoc
//	PUT /v1/pricebook                          PriceBook -> 200 PriceBookDoc (?revision=N: compare-and-set)
//	GET /v1/tenants/{tenant}/budget            -> 200 BudgetDoc
//	PUT /v1/tenants/{tenant}/budget            Budget -> 200 BudgetDoc
//	GET /v1/tenants/{tenant}/invoice?period=P  -> 200 Invoice (P is YYYY-MM or YYYY-MM-DD)

// PriceBookDoc is the price book with its KV revision (0: none yet) and
// billing's metering watermark.
type PriceBookDoc struct {
	Book     PriceBook `json:"book"`
	Revision uint64    `json:"revision"`
	// MeteredUntil is the end of the latest usage billing has metered;
	// no version may take effect before it (nor before now).
	MeteredUntil time.Time `json:"meteredUntil,omitzero"`
}

// BudgetDoc is a tenant's budget and billing's status of it; either may be
// missing.
type BudgetDoc struct {
	Tenant   string        `json:"tenant"`
	Budget   *Budget       `json:"budget,omitempty"`
	Revision uint64        `json:"revision,omitempty"`
	Status   *BudgetStatus `json:"status,omitempty"`
}

// Invoice is a tenant's bill for a period, built from the period's usage
// records alone (BuildInvoice): anyone holding the USAGE stream can
// reproduce it to the micro-unit. Amounts are exact micro-units; Total and
// the lines' Cost are the presentation, rounded half to even to the cent,
// so the lines may differ from the total by rounding.
type Invoice struct {
	Tenant      string    `json:"tenant"`
	Period      string    `json:"period"`
	PeriodStart time.Time `json:"periodStart"`
	PeriodEnd   time.Time `json:"periodEnd"`
	Currency    string    `json:"currency"`
	// Currencies lists every currency seen when records disagree (a book
	// that changed currency); Total then mixes them and is meaningless.
	Currencies []string      `json:"currencies,omitempty"`
	Lines      []InvoiceLine `json:"lines"`
	ByClass    []ClassTotal  `json:"byClass"`
	Records    int           `json:"records"`
	GPUMillis  int64         `json:"gpuMillis"`
	// UnpricedGPUMillis is GPU time the book had no price for.
	UnpricedGPUMillis  int64  `json:"unpricedGpuMillis,omitempty"`
	TotalMicros        int64  `json:"totalMicros"`
	OnDemandMicros     int64  `json:"onDemandMicros"`
	SpotSavingsMicros  int64  `json:"spotSavingsMicros"`
	Total              string `json:"total"`
	OnDemandEquivalent string `json:"onDemandEquivalent"`
	SpotSavings        string `json:"spotSavings"`
}

// InvoiceLine sums the records of one price class, GPU model, pool and
// price version.
type InvoiceLine struct {
	PriceClass         PriceClass `json:"priceClass"`
	GPUModel           string     `json:"gpuModel"`
	Pool               string     `json:"pool"`
	PriceVersion       string     `json:"priceVersion"`
	GPURateMicros      int64      `json:"gpuRateMicros"`
	Records            int        `json:"records"`
	GPUMillis          int64      `json:"gpuMillis"`
	GPUCostMicros      int64      `json:"gpuCostMicros"`
	CPUCostMicros      int64      `json:"cpuCostMicros"`
	MemoryCostMicros   int64      `json:"memoryCostMicros"`
	CostMicros         int64      `json:"costMicros"`
	OnDemandCostMicros int64      `json:"onDemandCostMicros"`
	Cost               string     `json:"cost"`
}

// ClassTotal sums one price class.
type ClassTotal struct {
	PriceClass         PriceClass `json:"priceClass"`
	Records            int        `json:"records"`
	GPUMillis          int64      `json:"gpuMillis"`
	CostMicros         int64      `json:"costMicros"`
	OnDemandCostMicros int64      `json:"onDemandCostMicros"`
	// SavingsMicros is OnDemandCostMicros − CostMicros.
	SavingsMicros int64  `json:"savingsMicros"`
	Cost          string `json:"cost"`
	Savings       string `json:"savings"`
}

// BuildInvoice bills tenant for the period named period ("2026-11" or
// "2026-11-03") from records, which may hold anything: records of other
// tenants or periods are left out, and a record repeated (same ID) counts
// once. Records are assigned to the period holding their Start (a segment
// never crosses a UTC midnight).
func BuildInvoice(tenant, period string, records []UsageRecord) (Invoice, error) {
	start, end, err := ParsePeriod(period)
	if err != nil {
		return Invoice{}, err
	}
	inv := Invoice{Tenant: tenant, Period: period, PeriodStart: start, PeriodEnd: end, Lines: []InvoiceLine{}, ByClass: []ClassTotal{}}
	type lineKey struct {
		class                PriceClass
		model, pool, version string
		rate                 int64
	}
	lines := map[lineKey]*InvoiceLine{}
	classes := map[PriceClass]*ClassTotal{}
	seen := map[string]bool{}
	currencies := map[string]bool{}
	for _, r := range records {
		if r.Tenant != tenant || r.Start.Before(start) || !r.Start.Before(end) || seen[r.ID] {
			continue
		}
		seen[r.ID] = true
		class := r.PriceClass
		if class == "" {
			class = PriceOnDemand
		}
		if r.Currency != "" {
			currencies[r.Currency] = true
		}
		k := lineKey{class, r.GPUModel, r.Pool, r.PriceVersion, r.GPURateMicros}
		l := lines[k]
		if l == nil {
			l = &InvoiceLine{PriceClass: class, GPUModel: r.GPUModel, Pool: r.Pool, PriceVersion: r.PriceVersion, GPURateMicros: r.GPURateMicros}
			lines[k] = l
		}
		l.Records++
		l.GPUMillis += r.GPUMillis
		l.GPUCostMicros += r.GPUCostMicros
		l.CPUCostMicros += r.CPUCostMicros
		l.MemoryCostMicros += r.MemoryCostMicros
		l.CostMicros += r.CostMicros
		l.OnDemandCostMicros += r.OnDemandCostMicros
		c := classes[class]
		if c == nil {
			c = &ClassTotal{PriceClass: class}
			classes[class] = c
		}
		c.Records++
		c.GPUMillis += r.GPUMillis
		c.CostMicros += r.CostMicros
		c.OnDemandCostMicros += r.OnDemandCostMicros
		inv.Records++
		inv.GPUMillis += r.GPUMillis
		if r.Unpriced || r.PriceVersion == "" {
			inv.UnpricedGPUMillis += r.GPUMillis
		}
		inv.TotalMicros += r.CostMicros
		inv.OnDemandMicros += r.OnDemandCostMicros
		if class == PriceSpot {
			inv.SpotSavingsMicros += r.OnDemandCostMicros - r.CostMicros
		}
	}
	for _, l := range lines {
		l.Cost = Money(l.CostMicros).CentString()
		inv.Lines = append(inv.Lines, *l)
	}
	slices.SortFunc(inv.Lines, func(a, b InvoiceLine) int {
		return cmp.Or(cmp.Compare(classRank(a.PriceClass), classRank(b.PriceClass)), cmp.Compare(a.GPUModel, b.GPUModel),
			cmp.Compare(a.Pool, b.Pool), cmp.Compare(a.PriceVersion, b.PriceVersion), cmp.Compare(a.GPURateMicros, b.GPURateMicros))
	})
	for _, class := range PriceClasses {
		if c := classes[class]; c != nil {
			c.SavingsMicros = c.OnDemandCostMicros - c.CostMicros
			c.Cost, c.Savings = Money(c.CostMicros).CentString(), Money(c.SavingsMicros).CentString()
			inv.ByClass = append(inv.ByClass, *c)
		}
	}
	for c := range currencies {
		inv.Currencies = append(inv.Currencies, c)
	}
	slices.Sort(inv.Currencies)
	switch len(inv.Currencies) {
	case 0:
	case 1:
		inv.Currency, inv.Currencies = inv.Currencies[0], nil
	default:
		inv.Currency = inv.Currencies[0]
	}
	inv.Total = Money(inv.TotalMicros).CentString()
	inv.OnDemandEquivalent = Money(inv.OnDemandMicros).CentString()
	inv.SpotSavings = Money(inv.SpotSavingsMicros).CentString()
	return inv, nil
}

func classRank(c PriceClass) int {
	if i := slices.Index(PriceClasses, c); i >= 0 {
		return i
	}
	return len(PriceClasses)
}

// String is a one-line summary, for logs.
func (inv Invoice) String() string {
	return fmt.Sprintf("invoice %s %s: %d records, %s %s (on-demand equivalent %s, spot saved %s)",
		inv.Tenant, inv.Period, inv.Records, inv.Total, inv.Currency, inv.OnDemandEquivalent, inv.SpotSavings)
}
