package gateway

import (
	"cmp"
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// maxSeriesPoints bounds the steps of one series: a year of hours.
const maxSeriesPoints = 24 * 366

// usageSeries serves GET /v1/tenants/{tenant}/usage/series?step=day&pool=
// &from=&to=: the tenant's usage records (as GET .../usage sums them)
// spread over UTC hours or days, per pool and price class. A record is
// shared among the steps it spans in proportion to its time in each, by
// cumulative rounding, so the points of a record sum to the record.
func (s *server) usageSeries(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenant(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	var fields []contracts.FieldError
	bad := func(field, format string, args ...any) {
		fields = append(fields, contracts.FieldError{Field: field, Reason: contracts.ReasonInvalidValue, Message: fmt.Sprintf(format, args...)})
	}
	step := cmp.Or(q.Get("step"), "day")
	width := map[string]time.Duration{"hour": time.Hour, "day": 24 * time.Hour}[step]
	if width == 0 {
		bad("step", "step %q: want hour or day", step)
	}
	pool := q.Get("pool")
	if pool != "" {
		if err := contracts.ValidatePool(pool); err != nil {
			bad("pool", "%v", err)
		}
	}
	var from, to time.Time
	for _, p := range []struct {
		name string
		t    *time.Time
	}{{"from", &from}, {"to", &to}} {
		if v := q.Get(p.name); v != "" {
			t, err := time.Parse(time.RFC3339, v)
			if err != nil {
				bad(p.name, "%s %q: want an RFC 3339 time", p.name, v)
			}
			*p.t = t.UTC()
		}
	}
	if !from.IsZero() && !to.IsZero() && !to.After(from) {
		bad("to", "to %s is not after from %s", to.Format(time.RFC3339), from.Format(time.RFC3339))
	} else if width > 0 && !from.IsZero() && !to.IsZero() && to.Sub(from)/width > maxSeriesPoints {
		bad("from", "%s to %s is more than %d steps of a %s", from.Format(time.RFC3339), to.Format(time.RFC3339), maxSeriesPoints, step)
	}
	if len(fields) > 0 {
		msg := fields[0].Message
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, msg, fields)
		return
	}
	if !s.modelReady(w) {
		return
	}
	series, err := s.model.UsageSeries(r.Context(), tenant, seriesQuery{step: step, width: width, pool: pool, from: from, to: to})
	if err != nil {
		s.internalError(w, "read model", err)
		return
	}
	writeJSON(w, http.StatusOK, series)
}

type seriesKey struct {
	start       time.Time
	pool, class string
}

// seriesQuery is what a series asks for: its step (hour or day) and
// width, a pool ("" for all) and the time from..to (zero: unbounded).
type seriesQuery struct {
	step     string
	width    time.Duration
	pool     string
	from, to time.Time
}

// seriesOf spreads a summary's records over steps of width, keeping pool
// ("" for all) and the time from..to (zero: unbounded): the series from
// the records themselves (a model keeping them, or the records read from
// USAGE when the buckets kept do not reach back far enough).
func seriesOf(sum contracts.UsageSummary, q seriesQuery) contracts.UsageSeries {
	points := map[seriesKey]*contracts.UsagePoint{}
	for _, rec := range sum.ByJob {
		if q.pool != "" && rec.Pool != q.pool {
			continue
		}
		spread(rec, q.width, func(b time.Time, dm, dc, do int64) {
			if (!q.from.IsZero() && !b.Add(q.width).After(q.from)) || (!q.to.IsZero() && !b.Before(q.to)) {
				return
			}
			k := seriesKey{b, rec.Pool, string(rec.PriceClass)}
			p := points[k]
			if p == nil {
				p = &contracts.UsagePoint{Start: k.start, Pool: k.pool, PriceClass: k.class}
				points[k] = p
			}
			p.GPUMillis += dm
			p.CostMicros += dc
			p.OnDemandCostMicros += do
		})
	}
	return seriesOfPoints(sum.Tenant, sum.Currency, q, points)
}

// seriesOfPoints is the series of the points summed per step, pool and
// price class: their totals, both in order.
func seriesOfPoints(tenant, currency string, q seriesQuery, points map[seriesKey]*contracts.UsagePoint) contracts.UsageSeries {
	out := contracts.UsageSeries{Tenant: tenant, Step: q.step, Pool: q.pool, Currency: currency,
		Points: []contracts.UsagePoint{}, Totals: []contracts.UsagePoint{}}
	totals := map[seriesKey]*contracts.UsagePoint{}
	for k, p := range points {
		p.GPUSeconds = float64(p.GPUMillis) / 1000
		p.SavedMicros = p.OnDemandCostMicros - p.CostMicros
		out.Points = append(out.Points, *p)
		tk := seriesKey{pool: k.pool, class: k.class}
		t := totals[tk]
		if t == nil {
			t = &contracts.UsagePoint{Pool: k.pool, PriceClass: k.class}
			totals[tk] = t
		}
		t.GPUMillis += p.GPUMillis
		t.CostMicros += p.CostMicros
		t.OnDemandCostMicros += p.OnDemandCostMicros
	}
	for _, t := range totals {
		t.GPUSeconds = float64(t.GPUMillis) / 1000
		t.SavedMicros = t.OnDemandCostMicros - t.CostMicros
		out.Totals = append(out.Totals, *t)
	}
	order := func(a, b contracts.UsagePoint) int {
		return cmp.Or(a.Start.Compare(b.Start), cmp.Compare(a.Pool, b.Pool), cmp.Compare(a.PriceClass, b.PriceClass))
	}
	slices.SortFunc(out.Points, order)
	slices.SortFunc(out.Totals, order)
	return out
}
