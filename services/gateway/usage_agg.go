package gateway

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// The usage read model without its records (issue 17: nothing grows with
// history). The gateway answers three questions from USAGE:
//
//   - GET .../usage: the tenant's sums and every record (ByJob): a
//     per-record answer, read from USAGE by the tenant's subject when asked
//     (usageReader), up to the sequence the model has folded;
//   - GET .../usage/series: sums per UTC hour or day, pool and price class:
//     folded, as records arrive, into one bucket per (step, pool, class)
//     each record touches, with the same cumulative rounding the series
//     did over the records (spread), so every point is the sum of the
//     shares the old series added, exactly;
//   - GET .../invoice: sums per UTC day of the records' start and invoice
//     line (class, GPU model, pool, price version, rate), and the
//     currencies each day's records name: a period (a month or a day) is
//     a run of whole days.
//
// A record counts once per ID (JetStream redelivers; USAGE could hold a
// record twice under two message IDs), as when the model kept every
// record: the IDs are kept as 128-bit digests with their day, 20 bytes a
// record instead of ~330, for UsageConfig.DuplicateWindow after USAGE
// stored the record (usageWindow), not for ever: they were what grew with
// history (issue 17). The hour buckets are kept for
// UsageConfig.HourRetention; an hourly series reaching before what was
// dropped is computed from the records read from USAGE, as before.

// UsageConfig bounds the usage read model.
type UsageConfig struct {
	// HourRetention is how long the hourly buckets of the usage series are
	// kept (days and invoice lines are kept for ever: a few a day per
	// tenant, pool and price class); an hourly series asked from before it
	// is read from USAGE. 0 means the default.
	HourRetention time.Duration
	// DuplicateWindow is how long after USAGE stored a record another copy
	// of it (its ID under another message ID) is still known for one and
	// not counted again. Billing never stores an ID twice: it publishes
	// each record with a compare-and-set on its tenant's subject, having
	// read the subject, and the stream drops a message ID seen within
	// contracts.DuplicateWindow. The check guards against that failing;
	// its memory is 20 bytes a record stored within the window. 0 means
	// the default.
	DuplicateWindow time.Duration
}

// DefaultUsageConfig keeps 35 days of hours (a month's hourly chart from
// memory) and knows a record's copies for 7 days: a billing stopped for a
// week and started from older state is the worst this guards against.
func DefaultUsageConfig() UsageConfig {
	return UsageConfig{HourRetention: 35 * 24 * time.Hour, DuplicateWindow: 7 * 24 * time.Hour}
}

func (c *UsageConfig) registerFlags(fs *flag.FlagSet) {
	fs.DurationVar(&c.HourRetention, "usage-hour-retention", c.HourRetention,
		"how long the read model keeps hourly usage buckets; an hourly series from before is read from the USAGE stream")
	fs.DurationVar(&c.DuplicateWindow, "usage-duplicate-window", c.DuplicateWindow,
		"how long after USAGE stored a usage record the read model still recognises a copy of it (20 bytes a record in the window)")
}

func (c UsageConfig) validate() error {
	if c.HourRetention < 0 {
		return fmt.Errorf("usage hour retention is %s; want > 0 (0: the default)", c.HourRetention)
	}
	if c.DuplicateWindow < 0 {
		return fmt.Errorf("usage duplicate window is %s; want > 0 (0: the default)", c.DuplicateWindow)
	}
	return nil
}

func (c UsageConfig) withDefaults() UsageConfig {
	c.HourRetention = cmp.Or(c.HourRetention, DefaultUsageConfig().HourRetention)
	c.DuplicateWindow = cmp.Or(c.DuplicateWindow, DefaultUsageConfig().DuplicateWindow)
	return c
}

// usageReader returns a tenant's distinct usage records in USAGE up to
// sequence upto, in stream order (the first of an ID kept, and a copy
// stored beyond the duplicate window of it, as the fold counts it:
// copyCounts).
type usageReader func(ctx context.Context, tenant string, upto uint64) ([]contracts.UsageRecord, error)

// errReadDone stops a read of USAGE past the sequence asked for.
var errReadDone = errors.New("read done")

// streamUsage reads a tenant's records from USAGE by its subject, with
// the duplicate window of cfg.
func streamUsage(b *bus.Bus, cfg UsageConfig) usageReader {
	window := cfg.withDefaults().DuplicateWindow
	return func(ctx context.Context, tenant string, upto uint64) ([]contracts.UsageRecord, error) {
		recs := []contracts.UsageRecord{}
		if upto == 0 {
			return recs, nil
		}
		copies := newUsageCopies(window)
		_, err := b.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamUsage, FilterSubjects: []string{contracts.SubjectUsage(tenant)}},
			func(_ context.Context, m *bus.Msg) error {
				if m.StreamSeq > upto {
					return errReadDone
				}
				t, rec, why := usageRecordOf(m)
				if why != "" || t != tenant || rec.ID == "" {
					return nil
				}
				if !copies.counts(rec.ID, m.Timestamp) {
					return nil
				}
				recs = append(recs, rec)
				return nil
			})
		if err != nil && !errors.Is(err, errReadDone) {
			return nil, fmt.Errorf("reading %s's usage records: %w", tenant, err)
		}
		return recs, nil
	}
}

// usageRecordOf is the record a USAGE message holds and its tenant, or
// why it is skipped (the ingester logs it): the subject names the tenant,
// the body must agree, and a record without an ID takes the message's.
func usageRecordOf(m *bus.Msg) (tenant string, rec contracts.UsageRecord, why string) {
	tenant, err := contracts.TenantFromSubject(m.Subject)
	if err != nil {
		return "", rec, "skipping usage record on a malformed subject: " + err.Error()
	}
	if err := m.Decode(&rec); err != nil {
		return "", rec, "skipping undecodable usage record: " + err.Error()
	}
	if rec.Tenant != tenant {
		return "", rec, "skipping usage record whose body names another tenant: " + rec.Tenant
	}
	if rec.ID == "" {
		rec.ID = m.ID() // the Nats-Msg-Id is the same key (UsageID)
	}
	return tenant, rec, ""
}

// usageDigest identifies a record of a tenant: the first 16 bytes of the
// SHA-256 of tenant, NUL, record ID (stable across processes: snapshots
// carry them). Two records collide with odds of ~10^-15 among 10^12.
type usageDigest [16]byte

func digestOf(tenant, id string) usageDigest {
	h := sha256.New()
	h.Write([]byte(tenant))
	h.Write([]byte{0})
	h.Write([]byte(id))
	var d usageDigest
	copy(d[:], h.Sum(nil))
	return d
}

// cmpDigest orders digests as their bytes, comparing them as two
// big-endian words rather than byte by byte: every record folded
// searches the sorted digests.
func cmpDigest(a, b usageDigest) int {
	if c := cmp.Compare(binary.BigEndian.Uint64(a[:8]), binary.BigEndian.Uint64(b[:8])); c != 0 {
		return c
	}
	return cmp.Compare(binary.BigEndian.Uint64(a[8:]), binary.BigEndian.Uint64(b[8:]))
}

// usageDigests is a set of digests: a sorted array (16 bytes each,
// shared by snapshots: never changed in place) and the recent ones in a
// map, merged into a new array when the map holds an eighth as many.
type usageDigests struct {
	sorted []usageDigest
	recent map[usageDigest]struct{}
}

func (d *usageDigests) has(k usageDigest) bool {
	if _, ok := d.recent[k]; ok {
		return true
	}
	_, ok := slices.BinarySearchFunc(d.sorted, k, cmpDigest)
	return ok
}

// add adds k and reports whether it was new.
func (d *usageDigests) add(k usageDigest) bool {
	if d.has(k) {
		return false
	}
	if d.recent == nil {
		d.recent = map[usageDigest]struct{}{}
	}
	d.recent[k] = struct{}{}
	if len(d.recent) >= max(4096, len(d.sorted)/8) {
		d.sorted = d.merged()
		d.recent = nil
	}
	return true
}

// merged returns every digest sorted, in a new array when there are
// recent ones.
func (d *usageDigests) merged() []usageDigest {
	if len(d.recent) == 0 {
		return d.sorted
	}
	add := slices.SortedFunc(maps.Keys(d.recent), cmpDigest)
	out := make([]usageDigest, 0, len(d.sorted)+len(add))
	i, j := 0, 0
	for i < len(d.sorted) && j < len(add) {
		if cmpDigest(d.sorted[i], add[j]) < 0 {
			out = append(out, d.sorted[i])
			i++
		} else {
			out = append(out, add[j])
			j++
		}
	}
	out = append(out, d.sorted[i:]...)
	return append(out, add[j:]...)
}

func (d *usageDigests) len() int { return len(d.sorted) + len(d.recent) }

// usageWindow is the digests of the records USAGE stored within a window
// of the latest one, each with the UTC day USAGE stored it (the message's
// timestamp). A day's digests are dropped once it ends more than the
// window before the latest record, so a copy stored within the window of
// its original is always known (up to a day longer), and what is kept is
// the records of a window and a day, however long the stream. The window
// moves with the stream's timestamps, not the clock: a start that replays
// USAGE counts exactly what the gateway that followed it live did.
//
// Like usageDigests it is a sorted array (shared by snapshots: never
// changed in place) and the recent ones in a map, so a lookup is one map
// access and one binary search whatever the window (a set a day took two
// to three times as long to fold a record, searching each day's); a day
// (4 bytes) rides beside each digest, and the array is rebuilt without
// the days that left the window when the oldest one does.
type usageWindow struct {
	window time.Duration
	sorted []usageDigest
	days   []int32 // sorted[i] was stored on day days[i] (days since 1970)
	recent map[usageDigest]int32
	oldest int32     // the oldest day among them, when any
	latest time.Time // when USAGE stored the latest record
}

func newUsageWindow(window time.Duration) usageWindow { return usageWindow{window: window} }

// find returns the day k was stored on, if it is kept.
func (w *usageWindow) find(k usageDigest) (int32, bool) {
	if day, ok := w.recent[k]; ok {
		return day, true
	}
	if i, ok := slices.BinarySearchFunc(w.sorted, k, cmpDigest); ok {
		return w.days[i], true
	}
	return 0, false
}

// copyCounts says whether a copy of a record counted on day (since
// 1970), stored at at, counts again: when the day ended the window or
// more before it. The rule reads the copy and its original only, so the
// fold and a read of a tenant's records from USAGE (streamUsage) count
// alike (from a review: the summary, read from USAGE, and the invoice,
// folded, disagreed). The fold has dropped every digest the rule would
// count a copy of, but for a copy stored a window before the latest
// record, which stream timestamps out of order by that much would take.
func copyCounts(day int32, at time.Time, window time.Duration) bool {
	return (int64(day)+1)*daySeconds <= at.Add(-window).Unix()
}

// usageCopies is copyCounts over a read of records by ID: when each ID
// last counted.
type usageCopies struct {
	window time.Duration
	last   map[string]time.Time
}

func newUsageCopies(window time.Duration) usageCopies {
	return usageCopies{window: window, last: map[string]time.Time{}}
}

// counts says whether the record id, stored at at, counts, and notes it.
func (c usageCopies) counts(id string, at time.Time) bool {
	if prev, ok := c.last[id]; ok && !copyCounts(dayOf(prev), at, c.window) {
		return false
	}
	c.last[id] = at
	return true
}

// add adds k, stored at at (zero: with the latest), and reports whether
// it counts: new, or a copy stored beyond the window of its original
// (copyCounts).
func (w *usageWindow) add(k usageDigest, at time.Time) bool {
	if at.IsZero() {
		at = w.latest
	}
	if day, ok := w.find(k); ok && !copyCounts(day, at, w.window) {
		return false
	}
	if at.After(w.latest) {
		w.latest = at
		if w.len() > 0 && !w.keeps(w.oldest) {
			w.merge()
		}
	}
	day := dayOf(at)
	if !w.keeps(day) {
		return true // stored before the window (timestamps out of order): too old to keep
	}
	if w.len() == 0 || day < w.oldest {
		w.oldest = day
	}
	if w.recent == nil {
		w.recent = map[usageDigest]int32{}
	}
	w.recent[k] = day
	if len(w.recent) >= max(4096, len(w.sorted)/8) {
		w.merge()
	}
	return true
}

// dayOf is the UTC day of t, in days since 1970: the day the invoice
// lines use (add), counted.
func dayOf(t time.Time) int32 { return int32(t.UTC().Truncate(24*time.Hour).Unix() / daySeconds) }

// keeps says whether day ends within the window of the latest record.
func (w *usageWindow) keeps(day int32) bool {
	return (int64(day)+1)*daySeconds > w.latest.Add(-w.window).Unix()
}

// merge makes one new sorted array of the digests kept and the recent
// ones, without those whose day left the window.
func (w *usageWindow) merge() {
	add := slices.SortedFunc(maps.Keys(w.recent), cmpDigest)
	sorted := make([]usageDigest, 0, len(w.sorted)+len(add))
	days := make([]int32, 0, len(w.sorted)+len(add))
	first := true
	keep := func(k usageDigest, day int32) {
		if !w.keeps(day) {
			return
		}
		sorted, days = append(sorted, k), append(days, day)
		if first || day < w.oldest {
			w.oldest, first = day, false
		}
	}
	i, j := 0, 0
	for i < len(w.sorted) || j < len(add) {
		c := -1
		if j < len(add) && i < len(w.sorted) {
			c = cmpDigest(w.sorted[i], add[j])
		} else if j < len(add) {
			c = 1
		}
		switch {
		case c < 0:
			keep(w.sorted[i], w.days[i])
			i++
		case c == 0:
			i++ // a copy counted again: its recent day supersedes
		default:
			keep(add[j], w.recent[add[j]])
			j++
		}
	}
	w.sorted, w.days, w.recent = sorted, days, nil
}

func (w *usageWindow) len() int { return len(w.sorted) + len(w.recent) }

// clone copies w for a snapshot: the arrays are shared (never changed in
// place), the recent digests copied.
func (w *usageWindow) clone() usageWindow {
	c := *w
	c.recent = maps.Clone(w.recent)
	return c
}

// pointKey is a bucket of the series: the step's start (Unix seconds),
// pool and price class.
type pointKey struct {
	start       int64
	pool, class string
}

// pointSums are a bucket's sums.
type pointSums struct{ millis, cost, onDemand int64 }

// lineKey is an invoice line of a day (contracts.BuildInvoice's key).
type lineKey struct {
	class                contracts.PriceClass
	model, pool, version string
	rate                 int64
}

// lineSums are a line's sums over a day's records; unpriced is their GPU
// time without a price.
type lineSums struct {
	records, millis, gpuCost, cpuCost, memCost, cost, onDemand, unpriced int64
}

// usageDay is what a UTC day's records (by start) add to invoices.
type usageDay struct {
	lines      map[lineKey]lineSums
	currencies []string // sorted
}

// tenantUsage is a tenant's folded usage.
type tenantUsage struct {
	hours, days map[pointKey]pointSums
	invoice     map[int64]*usageDay // day (Unix seconds) -> lines
	// currency is the summary's: that of the last record naming one, in
	// the summary's order (start, then ID), which curStart, curID are.
	currency, curID string
	curStart        time.Time
	// hoursFrom, when hoursCut, is where the hours kept begin: hours
	// before it were dropped (or never kept).
	hoursFrom int64
	hoursCut  bool
}

func newTenantUsage() *tenantUsage {
	return &tenantUsage{hours: map[pointKey]pointSums{}, days: map[pointKey]pointSums{}, invoice: map[int64]*usageDay{}}
}

// usageAgg is the folded usage of every tenant.
type usageAgg struct {
	cfg     UsageConfig
	tenants map[string]*tenantUsage
	ids     usageWindow
	// cut is the start of the oldest hour kept (Unix seconds), advanced
	// by prune; hours before it are not folded.
	cut int64
}

func newUsageAgg(cfg UsageConfig) *usageAgg {
	cfg = cfg.withDefaults()
	return &usageAgg{cfg: cfg, tenants: map[string]*tenantUsage{}, ids: newUsageWindow(cfg.DuplicateWindow), cut: minUnix}
}

// minUnix is an hour before every time: no cut.
const minUnix = -1 << 62

const daySeconds = 24 * 60 * 60

// add folds rec, which USAGE stored at at, into tenant's usage once per
// ID (within the duplicate window) and reports whether it was new.
func (a *usageAgg) add(tenant string, rec contracts.UsageRecord, at time.Time) bool {
	if !a.ids.add(digestOf(tenant, rec.ID), at) {
		return false
	}
	tu := a.tenants[tenant]
	if tu == nil {
		tu = newTenantUsage()
		a.tenants[tenant] = tu
	}
	if rec.Currency != "" {
		if tu.currency == "" || cmp.Or(rec.Start.Compare(tu.curStart), cmp.Compare(rec.ID, tu.curID)) > 0 {
			tu.currency, tu.curStart, tu.curID = rec.Currency, rec.Start, rec.ID
		}
	}
	class := string(rec.PriceClass)
	spread(rec, time.Hour, func(b time.Time, dm, dc, do int64) {
		if s := b.Unix(); s < a.cut {
			tu.cutHours(a.cut)
		} else {
			k := pointKey{s, rec.Pool, class}
			p := tu.hours[k]
			tu.hours[k] = pointSums{p.millis + dm, p.cost + dc, p.onDemand + do}
		}
	})
	spread(rec, 24*time.Hour, func(b time.Time, dm, dc, do int64) {
		k := pointKey{b.Unix(), rec.Pool, class}
		p := tu.days[k]
		tu.days[k] = pointSums{p.millis + dm, p.cost + dc, p.onDemand + do}
	})
	day := rec.Start.UTC().Truncate(24 * time.Hour).Unix()
	d := tu.invoice[day]
	if d == nil {
		d = &usageDay{lines: map[lineKey]lineSums{}}
		tu.invoice[day] = d
	}
	lc := rec.PriceClass
	if lc == "" {
		lc = contracts.PriceOnDemand
	}
	lk := lineKey{lc, rec.GPUModel, rec.Pool, rec.PriceVersion, rec.GPURateMicros}
	l := d.lines[lk]
	l.records++
	l.millis += rec.GPUMillis
	l.gpuCost += rec.GPUCostMicros
	l.cpuCost += rec.CPUCostMicros
	l.memCost += rec.MemoryCostMicros
	l.cost += rec.CostMicros
	l.onDemand += rec.OnDemandCostMicros
	if rec.Unpriced || rec.PriceVersion == "" {
		l.unpriced += rec.GPUMillis
	}
	d.lines[lk] = l
	if rec.Currency != "" {
		if i, found := slices.BinarySearch(d.currencies, rec.Currency); !found {
			d.currencies = slices.Insert(d.currencies, i, rec.Currency)
		}
	}
	return true
}

// cutHours notes that the hours before cut are not all kept.
func (tu *tenantUsage) cutHours(cut int64) {
	if !tu.hoursCut || tu.hoursFrom < cut {
		tu.hoursFrom, tu.hoursCut = cut, true
	}
}

// prune drops the hours older than the retention at now.
func (a *usageAgg) prune(now time.Time) {
	cut := now.Add(-a.cfg.HourRetention).Truncate(time.Hour).Unix()
	if cut <= a.cut {
		return
	}
	a.cut = cut
	for _, tu := range a.tenants {
		for k := range tu.hours {
			if k.start < cut {
				delete(tu.hours, k)
				tu.cutHours(cut)
			}
		}
	}
}

// spread shares rec among the steps of width it spans, in proportion to
// its time in each, by cumulative rounding (the points of a record sum to
// the record), calling add for each step with its start and shares of
// GPU time, cost and on-demand cost. An instant is all in its step.
func spread(rec contracts.UsageRecord, width time.Duration, add func(b time.Time, dm, dc, do int64)) {
	start, end := rec.Start.UTC(), rec.End.UTC()
	if !end.After(start) {
		end = start.Add(time.Nanosecond) // an instant: all of it in its step
	}
	total := end.Sub(start)
	var done time.Duration
	var millis, cost, onDemand int64 // what earlier steps took
	for b := start.Truncate(width); b.Before(end); b = b.Add(width) {
		e, s0 := b.Add(width), b
		if e.After(end) {
			e = end
		}
		if start.After(s0) {
			s0 = start
		}
		done += e.Sub(s0)
		// Cumulative rounding: step i gets round(total·done_i) −
		// round(total·done_{i−1}), so the steps sum to the record.
		share := func(v int64, before *int64) int64 {
			upto := int64(float64(v) * float64(done) / float64(total))
			if e.Equal(end) {
				upto = v
			}
			d := upto - *before
			*before = upto
			return d
		}
		dm, dc, do := share(rec.GPUMillis, &millis), share(rec.CostMicros, &cost), share(rec.OnDemandCostMicros, &onDemand)
		add(b, dm, dc, do)
	}
}

// series answers q from the buckets; ok is false when the hours it needs
// were dropped (the caller reads the records).
func (tu *tenantUsage) series(tenant string, q seriesQuery) (contracts.UsageSeries, bool) {
	buckets := tu.days
	if q.width == time.Hour {
		if tu.hoursCut && (q.from.IsZero() || q.from.Unix() < tu.hoursFrom) {
			return contracts.UsageSeries{}, false
		}
		buckets = tu.hours
	}
	points := map[seriesKey]*contracts.UsagePoint{}
	for k, p := range buckets {
		if q.pool != "" && k.pool != q.pool {
			continue
		}
		b := time.Unix(k.start, 0).UTC()
		if (!q.from.IsZero() && !b.Add(q.width).After(q.from)) || (!q.to.IsZero() && !b.Before(q.to)) {
			continue
		}
		points[seriesKey{b, k.pool, k.class}] = &contracts.UsagePoint{Start: b, Pool: k.pool, PriceClass: k.class,
			GPUMillis: p.millis, CostMicros: p.cost, OnDemandCostMicros: p.onDemand}
	}
	return seriesOfPoints(tenant, tu.currency, q, points), true
}

// invoice bills tenant for period from the days' lines, as
// contracts.BuildInvoice does from the records.
func (tu *tenantUsage) invoiceFor(tenant, period string) (contracts.Invoice, error) {
	start, end, err := contracts.ParsePeriod(period)
	if err != nil {
		return contracts.Invoice{}, err
	}
	inv := contracts.Invoice{Tenant: tenant, Period: period, PeriodStart: start, PeriodEnd: end,
		Lines: []contracts.InvoiceLine{}, ByClass: []contracts.ClassTotal{}}
	lines := map[lineKey]*contracts.InvoiceLine{}
	classes := map[contracts.PriceClass]*contracts.ClassTotal{}
	currencies := map[string]bool{}
	if tu != nil {
		for day := start.Unix(); day < end.Unix(); day += daySeconds {
			d := tu.invoice[day]
			if d == nil {
				continue
			}
			for _, c := range d.currencies {
				currencies[c] = true
			}
			for k, s := range d.lines {
				l := lines[k]
				if l == nil {
					l = &contracts.InvoiceLine{PriceClass: k.class, GPUModel: k.model, Pool: k.pool, PriceVersion: k.version, GPURateMicros: k.rate}
					lines[k] = l
				}
				l.Records += int(s.records)
				l.GPUMillis += s.millis
				l.GPUCostMicros += s.gpuCost
				l.CPUCostMicros += s.cpuCost
				l.MemoryCostMicros += s.memCost
				l.CostMicros += s.cost
				l.OnDemandCostMicros += s.onDemand
				c := classes[k.class]
				if c == nil {
					c = &contracts.ClassTotal{PriceClass: k.class}
					classes[k.class] = c
				}
				c.Records += int(s.records)
				c.GPUMillis += s.millis
				c.CostMicros += s.cost
				c.OnDemandCostMicros += s.onDemand
				inv.Records += int(s.records)
				inv.GPUMillis += s.millis
				inv.UnpricedGPUMillis += s.unpriced
				inv.TotalMicros += s.cost
				inv.OnDemandMicros += s.onDemand
				if k.class == contracts.PriceSpot {
					inv.SpotSavingsMicros += s.onDemand - s.cost
				}
			}
		}
	}
	for _, l := range lines {
		l.Cost = contracts.Money(l.CostMicros).CentString()
		inv.Lines = append(inv.Lines, *l)
	}
	slices.SortFunc(inv.Lines, func(a, b contracts.InvoiceLine) int {
		return cmp.Or(cmp.Compare(classRank(a.PriceClass), classRank(b.PriceClass)), cmp.Compare(a.GPUModel, b.GPUModel),
			cmp.Compare(a.Pool, b.Pool), cmp.Compare(a.PriceVersion, b.PriceVersion), cmp.Compare(a.GPURateMicros, b.GPURateMicros))
	})
	for _, class := range contracts.PriceClasses {
		if c := classes[class]; c != nil {
			c.SavingsMicros = c.OnDemandCostMicros - c.CostMicros
			c.Cost, c.Savings = contracts.Money(c.CostMicros).CentString(), contracts.Money(c.SavingsMicros).CentString()
			inv.ByClass = append(inv.ByClass, *c)
		}
	}
	inv.Currencies = slices.Sorted(maps.Keys(currencies))
	switch len(inv.Currencies) {
	case 0:
		inv.Currencies = nil
	case 1:
		inv.Currency, inv.Currencies = inv.Currencies[0], nil
	default:
		inv.Currency = inv.Currencies[0]
	}
	inv.Total = contracts.Money(inv.TotalMicros).CentString()
	inv.OnDemandEquivalent = contracts.Money(inv.OnDemandMicros).CentString()
	inv.SpotSavings = contracts.Money(inv.SpotSavingsMicros).CentString()
	return inv, nil
}

// classRank orders price classes as contracts.PriceClasses does, others
// last (contracts.BuildInvoice's order).
func classRank(c contracts.PriceClass) int {
	if i := slices.Index(contracts.PriceClasses, c); i >= 0 {
		return i
	}
	return len(contracts.PriceClasses)
}

// clone copies tu for a snapshot.
func (tu *tenantUsage) clone() *tenantUsage {
	c := *tu
	c.hours, c.days = maps.Clone(tu.hours), maps.Clone(tu.days)
	c.invoice = make(map[int64]*usageDay, len(tu.invoice))
	for day, d := range tu.invoice {
		c.invoice[day] = &usageDay{lines: maps.Clone(d.lines), currencies: slices.Clone(d.currencies)}
	}
	return &c
}
