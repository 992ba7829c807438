package gpuctl

import (
	"context"
	"encoding/csv"
	"encoding/json"
	"flag"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

// The billing commands: prices (the price book), budget, invoice; usage is
// in show.go. Amounts are shown rounded half to even to the cent, as on an
// invoice; -o json gives the exact micro-units.

// pricesCmd is "prices get" and "prices set -f book.yaml".
func (a *app) pricesCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var file string
	var revision uint64
	fs.StringVar(&file, "f", "", "set: the price book, a YAML or JSON file (- for stdin)")
	fs.Uint64Var(&revision, "revision", 0, "set: fail unless the book is still at this revision (from prices get)")
	return func(ctx context.Context, pos, trailing []string) int {
		if len(pos) != 1 || len(trailing) > 0 || (pos[0] != "get" && pos[0] != "set") {
			return a.usageErr("prices", "want \"prices get\" or \"prices set -f FILE\"")
		}
		c, err := a.api()
		if err != nil {
			return a.fail("prices "+pos[0], err)
		}
		var doc contracts.PriceBookDoc
		if pos[0] == "get" {
			if doc, err = c.PriceBook(ctx); err != nil {
				return a.fail("prices get", err)
			}
		} else {
			if file == "" {
				return a.usageErr("prices set", "-f FILE is required")
			}
			data, err := readRequestFile(file)
			if err != nil {
				return a.fail("prices set", err)
			}
			if data, err = resolveEffective(data, time.Now()); err != nil {
				return a.fail("prices set", err)
			}
			book, err := contracts.DecodePriceBook(data)
			if err != nil {
				return a.fail("prices set", checkedError(err, "invalid price book"))
			}
			var rev *uint64
			if revision > 0 {
				rev = gpuplane.Revision(revision)
			}
			if doc, err = c.SetPriceBook(ctx, book, rev); err != nil {
				return a.fail("prices set", err)
			}
		}
		if a.output == "json" {
			return a.printJSON(doc)
		}
		a.printBook(doc)
		return ExitOK
	}
}

func (a *app) printBook(doc contracts.PriceBookDoc) {
	fmt.Fprintf(a.stdout, "price book revision %d, %d versions", doc.Revision, len(doc.Book.Versions))
	if !doc.MeteredUntil.IsZero() {
		fmt.Fprintf(a.stdout, "; usage metered until %s", doc.MeteredUntil.UTC().Format(time.RFC3339))
	}
	fmt.Fprintln(a.stdout)
	if len(doc.Book.Versions) == 0 {
		return
	}
	fmt.Fprintln(a.stdout)
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VERSION\tEFFECTIVE FROM (UTC)\tCURRENCY\tGPU MODEL\tON-DEMAND/H\tSPOT/H\tRESERVED/H\tCPU CORE/H\tMEMORY GIB/H")
	for _, v := range doc.Book.Versions {
		for i, model := range slices.Sorted(maps.Keys(v.GPU)) {
			p := v.GPU[model]
			id, from, cur, cpu, mem := v.ID, v.EffectiveFrom.UTC().Format(time.RFC3339), v.Currency, money(v.CPUCoreHour), money(v.MemoryGiBHour)
			if i > 0 {
				id, from, cur, cpu, mem = "", "", "", "", ""
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", id, from, cur, model, p.OnDemand,
				p.Price(contracts.PriceSpot), p.Price(contracts.PriceReserved), cpu, mem)
		}
	}
	_ = tw.Flush()
}

func money(m contracts.Money) string {
	if m == 0 {
		return "-"
	}
	return m.String()
}

// budgetCmd is "budget get", "budget set" and "budget delete" for --tenant.
func (a *app) budgetCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var file, period, limit, policy string
	fs.StringVar(&file, "f", "", "set: the budget, a YAML or JSON file (- for stdin)")
	fs.StringVar(&period, "period", "monthly", "set: monthly or daily (UTC calendar periods)")
	fs.StringVar(&limit, "limit", "", "set: the spend allowed per period, in the price book's currency (\"250.00\")")
	fs.StringVar(&policy, "policy", "notify", "set: at 100%: notify, reject or spot-only")
	return func(ctx context.Context, pos, trailing []string) int {
		if len(pos) != 1 || len(trailing) > 0 || !slices.Contains([]string{"get", "set", "delete"}, pos[0]) {
			return a.usageErr("budget", "want \"budget get\", \"budget set --limit L [--period P] [--policy P]\" or \"budget delete\"")
		}
		if err := contracts.ValidateTenant(a.tenant); err != nil {
			return a.usageErr("budget", "%v", err)
		}
		c, err := a.api()
		if err != nil {
			return a.fail("budget "+pos[0], err)
		}
		var doc contracts.BudgetDoc
		switch pos[0] {
		case "get":
			doc, err = c.Budget(ctx, a.tenant)
		case "delete":
			doc, err = c.DeleteBudget(ctx, a.tenant)
		case "set":
			var data []byte
			if file != "" {
				if data, err = readRequestFile(file); err != nil {
					return a.fail("budget set", err)
				}
			} else {
				body := map[string]string{"period": period, "limit": limit, "policy": policy}
				data, _ = json.Marshal(body)
			}
			b, verr := contracts.DecodeBudget(data, a.tenant)
			if verr != nil {
				return a.fail("budget set", checkedError(verr, "invalid budget"))
			}
			doc, err = c.SetBudget(ctx, a.tenant, b)
		}
		if err != nil {
			return a.fail("budget "+pos[0], err)
		}
		if a.output == "json" {
			return a.printJSON(doc)
		}
		a.printBudget(doc)
		return ExitOK
	}
}

func (a *app) printBudget(doc contracts.BudgetDoc) {
	if doc.Budget == nil {
		fmt.Fprintf(a.stdout, "tenant %s has no budget\n", doc.Tenant)
		return
	}
	b := doc.Budget
	fmt.Fprintf(a.stdout, "tenant %s: %s budget of %s, policy %s at 100%%\n", doc.Tenant, b.Period, b.Limit.CentString(), b.Policy)
	st := doc.Status
	if st == nil {
		fmt.Fprintln(a.stdout, "no status from billing yet")
		return
	}
	state := "within budget"
	if st.Exceeded {
		state = "EXCEEDED"
	}
	fmt.Fprintf(a.stdout, "%s: spent %s of %s %s (%.1f%%), %s; %s\n", st.PeriodName,
		contracts.Money(st.SpentMicros).CentString(), contracts.Money(st.LimitMicros).CentString(), st.Currency, st.Percent(), state,
		alerts(st.Alerted))
	if st.Exceeded && st.Policy == contracts.PolicySpotOnly {
		fmt.Fprintf(a.stdout, "admitted now: priority best-effort, or a spot pool (%s)\n", strings.Join(st.SpotPools, ", "))
	}
}

// alerts says which of the budget's alert levels (contracts.BudgetThresholds)
// have alerted this period: "no alert sent yet (alerts at 50%, 80%, 100%)",
// "alerts sent at 50%, 80% (of 50%, 80%, 100%)".
func alerts(sent []int) string {
	levels := percents(contracts.BudgetThresholds)
	if len(sent) == 0 {
		return "no alert sent yet (alerts at " + levels + ")"
	}
	what := "alerts sent at "
	if len(sent) == 1 {
		what = "alert sent at "
	}
	return what + percents(sent) + " (of " + levels + ")"
}

// percents is "50%, 80%, 100%".
func percents(ps []int) string {
	parts := make([]string, len(ps))
	for i, p := range ps {
		parts[i] = strconv.Itoa(p) + "%"
	}
	return strings.Join(parts, ", ")
}

// invoiceCmd prints the tenant's invoice for --period.
func (a *app) invoiceCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var period string
	fs.StringVar(&period, "period", "", "YYYY-MM (default: this month, UTC) or YYYY-MM-DD")
	return func(ctx context.Context, pos, trailing []string) int {
		if !a.noPositional("invoice", pos, trailing) {
			return ExitUsage
		}
		if err := contracts.ValidateTenant(a.tenant); err != nil {
			return a.usageErr("invoice", "%v", err)
		}
		if period == "" {
			period = time.Now().UTC().Format("2006-01")
		}
		if _, _, err := contracts.ParsePeriod(period); err != nil {
			return a.usageErr("invoice", "%v", err)
		}
		c, err := a.api()
		if err != nil {
			return a.fail("invoice", err)
		}
		inv, err := c.Invoice(ctx, a.tenant, period)
		if err != nil {
			return a.fail("invoice", err)
		}
		switch a.output {
		case "json":
			return a.printJSON(inv)
		case "csv":
			return a.invoiceCSV(inv)
		}
		fmt.Fprintf(a.stdout, "invoice for tenant %s, %s (%s to %s UTC)\n\n", inv.Tenant, inv.Period,
			inv.PeriodStart.Format(time.DateOnly), inv.PeriodEnd.Format(time.DateOnly))
		tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "CLASS\tMODEL\tPOOL\tVERSION\tRATE/GPU-H\tRECORDS\tGPU-HOURS\tCOST\tAT ON-DEMAND\t")
		for _, l := range inv.Lines {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t\n", l.PriceClass, dash(l.GPUModel), dash(l.Pool), dash(l.PriceVersion),
				contracts.Money(l.GPURateMicros), l.Records, gpuHours(l.GPUMillis), l.Cost, contracts.Money(l.OnDemandCostMicros).CentString())
		}
		_ = tw.Flush()
		fmt.Fprintln(a.stdout)
		tw = tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "BY CLASS\tRECORDS\tGPU-HOURS\tCOST\tSAVED VS ON-DEMAND\t")
		for _, c := range inv.ByClass {
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t\n", c.PriceClass, c.Records, gpuHours(c.GPUMillis), c.Cost, c.Savings)
		}
		_ = tw.Flush()
		fmt.Fprintf(a.stdout, "\ntotal %s %s (at on-demand rates %s; spot saved %s)\n", inv.Total, inv.Currency,
			inv.OnDemandEquivalent, inv.SpotSavings)
		if inv.UnpricedGPUMillis > 0 {
			fmt.Fprintf(a.stdout, "%s GPU-hours had no price in the price book and cost nothing\n", gpuHours(inv.UnpricedGPUMillis))
		}
		if len(inv.Currencies) > 1 {
			fmt.Fprintf(a.stdout, "warning: the records mix currencies %v: the total is meaningless\n", inv.Currencies)
		}
		return ExitOK
	}
}

// invoiceCSV writes one row per line, then one per class and the total;
// amounts are exact decimals of the micro-units (no rounding).
func (a *app) invoiceCSV(inv contracts.Invoice) int {
	w := csv.NewWriter(a.stdout)
	_ = w.Write([]string{"tenant", "period", "kind", "price_class", "gpu_model", "pool", "price_version", "gpu_rate_per_hour",
		"records", "gpu_hours", "cost", "on_demand_cost", "savings", "currency"})
	row := func(kind string, class contracts.PriceClass, model, pool, version string, rate int64, records int, gpuMillis, cost, onDemand int64) {
		_ = w.Write([]string{inv.Tenant, inv.Period, kind, string(class), model, pool, version, contracts.Money(rate).String(),
			strconv.Itoa(records), gpuHours(gpuMillis), contracts.Money(cost).String(), contracts.Money(onDemand).String(),
			contracts.Money(onDemand - cost).String(), inv.Currency})
	}
	for _, l := range inv.Lines {
		row("line", l.PriceClass, l.GPUModel, l.Pool, l.PriceVersion, l.GPURateMicros, l.Records, l.GPUMillis, l.CostMicros, l.OnDemandCostMicros)
	}
	for _, c := range inv.ByClass {
		row("class", c.PriceClass, "", "", "", 0, c.Records, c.GPUMillis, c.CostMicros, c.OnDemandCostMicros)
	}
	row("total", "", "", "", "", 0, inv.Records, inv.GPUMillis, inv.TotalMicros, inv.OnDemandMicros)
	w.Flush()
	if err := w.Error(); err != nil {
		return a.fail("invoice", err)
	}
	return ExitOK
}

// gpuHours shows GPU-milliseconds as hours with four decimals.
func gpuHours(ms int64) string { return strconv.FormatFloat(float64(ms)/3_600_000, 'f', 4, 64) }

// checkedError presents a document refused before sending as the gateway
// would have answered it.
func checkedError(err error, what string) error {
	return gpuplane.ValidationError(err, what+" (checked before sending)")
}

// resolveEffective replaces an effectiveFrom of "now", or "+DURATION"
// ("+1h"), by that instant rounded up to the next whole second and one
// more: a new version may not take effect in the past, and the request
// takes a moment to arrive. Other documents are returned as they are.
func resolveEffective(doc []byte, now time.Time) ([]byte, error) {
	var book map[string]json.RawMessage
	if json.Unmarshal(doc, &book) != nil {
		return doc, nil
	}
	var versions []map[string]json.RawMessage
	if json.Unmarshal(book["versions"], &versions) != nil {
		return doc, nil
	}
	changed := false
	for i, v := range versions {
		var from string
		if json.Unmarshal(v["effectiveFrom"], &from) != nil || from != "now" && !strings.HasPrefix(from, "+") {
			continue
		}
		var d time.Duration
		if from != "now" {
			var err error
			if d, err = time.ParseDuration(from[1:]); err != nil || d < 0 {
				return nil, fmt.Errorf("versions[%d].effectiveFrom %q: want an RFC 3339 time, now, or +DURATION such as +1h", i, from)
			}
		}
		at := now.Add(d).UTC().Truncate(time.Second).Add(2 * time.Second)
		v["effectiveFrom"], _ = json.Marshal(at.Format(time.RFC3339))
		changed = true
	}
	if !changed {
		return doc, nil
	}
	book["versions"], _ = json.Marshal(versions)
	return json.Marshal(book)
}
