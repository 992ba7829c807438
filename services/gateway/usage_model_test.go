package gateway

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// usageHarness publishes random usage records on a real USAGE stream and
// folds them into a model keeping every record (the way before buckets:
// the reference) and a model folding them into buckets (the gateway's).
type usageHarness struct {
	t      *testing.T
	rnd    *rand.Rand
	op, gw *bus.Bus
	now    time.Time
	ids    []string
	last   uint64
	msgs   int
}

func newUsageHarness(t *testing.T, seed uint64) *usageHarness {
	t.Helper()
	srv := natstest.Start(t)
	h := &usageHarness{t: t, rnd: rand.New(rand.NewPCG(seed, 29)), now: time.Date(2026, 11, 20, 13, 17, 0, 0, time.UTC)}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	var err error
	if h.op, err = bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "test-billing", CredsFile: natstest.Operator(t, srv)}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.op.Close(context.Background()) })
	if err := h.op.EnsureStreams(ctx); err != nil {
		t.Fatal(err)
	}
	if h.gw, err = bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "gateway",
		CredsFile: natstest.Service(t, srv, contracts.BusGateway)}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.gw.Close(context.Background()) })
	return h
}

var (
	usageTenants = []string{"acme", "globex", "initech"}
	usagePools   = []string{"east", "west", "l4"}
	usageClasses = []contracts.PriceClass{"", contracts.PriceOnDemand, contracts.PriceSpot, contracts.PriceReserved}
)

// record is a random record of a random tenant: spans from instants and
// negative ones to several days (records before segments), starts from
// 60 days before now to a day after, voids (negative sums), prices or
// none, one of two currencies or none.
func (h *usageHarness) record() contracts.UsageRecord {
	r := h.rnd
	pick := func(n int) int { return r.IntN(n) }
	tenant := usageTenants[pick(len(usageTenants))]
	start := h.now.Add(-60 * 24 * time.Hour).Add(time.Duration(r.Int64N(int64(61 * 24 * time.Hour))))
	if pick(4) == 0 {
		start = start.Truncate(time.Hour) // on a step's boundary
	}
	var span time.Duration
	switch pick(6) {
	case 0:
		span = -time.Duration(pick(3)) * time.Second // an instant, or ending before it starts
	case 1:
		span = time.Duration(r.Int64N(int64(72 * time.Hour)))
	default:
		span = time.Duration(r.Int64N(int64(3 * time.Hour)))
	}
	millis := r.Int64N(30_000_000)
	rec := contracts.UsageRecord{SchemaVersion: 1, Tenant: tenant, JobID: fmt.Sprintf("j%d", pick(500)), Attempt: 1 + pick(2),
		NodeID: "node-1", Pool: usagePools[pick(len(usagePools))], GPUModel: []string{"H100-80GB", "L4"}[pick(2)], GPUs: 1 + pick(8),
		Start: start, End: start.Add(span), GPUMillis: millis, GPUSeconds: float64(millis) / 1000, Time: start.Add(span)}
	if pick(5) > 0 {
		rec.Start, rec.End = rec.Start.Truncate(time.Second), rec.End.Truncate(time.Second)
	}
	if pick(7) == 0 {
		loc := time.FixedZone("plus2", 2*60*60)
		rec.Start, rec.End = rec.Start.In(loc), rec.End.In(loc) // an offset in the JSON
	}
	rec.PriceClass = usageClasses[pick(len(usageClasses))]
	if pick(4) > 0 {
		rec.PriceVersion = []string{"v1", "v2"}[pick(2)]
		rec.Currency = []string{"USD", "USD", "USD", "EUR"}[pick(4)]
		rec.GPURateMicros = []int64{2_000_000, 3_900_000}[pick(2)]
		rec.Unpriced = pick(10) == 0
		rec.GPUCostMicros, rec.CPUCostMicros, rec.MemoryCostMicros = r.Int64N(9_000_000), r.Int64N(50_000), r.Int64N(50_000)
		rec.CostMicros = rec.GPUCostMicros + rec.CPUCostMicros + rec.MemoryCostMicros
		rec.OnDemandCostMicros = rec.CostMicros + r.Int64N(5_000_000)
	}
	if pick(10) == 0 { // a void: every quantity negated
		rec.GPUMillis, rec.GPUSeconds, rec.GPUCostMicros, rec.CostMicros, rec.OnDemandCostMicros =
			-rec.GPUMillis, -rec.GPUSeconds, -rec.GPUCostMicros, -rec.CostMicros, -rec.OnDemandCostMicros
	}
	// IDs repeat: the same record stored twice, or another record under
	// an ID seen (the first one counts).
	if len(h.ids) > 0 && pick(8) == 0 {
		rec.ID = h.ids[pick(len(h.ids))]
	} else {
		rec.ID = contracts.UsageSegmentID(fmt.Sprintf("%s/%s/%d", tenant, rec.JobID, len(h.ids)), pick(3))
		h.ids = append(h.ids, rec.ID)
	}
	return rec
}

// publish stores n random records (some twice, under another message
// ID; some without an ID in the body, some naming another tenant, some
// undecodable) on USAGE.
func (h *usageHarness) publish(n int) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	send := func(subject string, data []byte) {
		h.msgs++
		m := nats.NewMsg(subject)
		m.Data = data
		m.Header.Set(contracts.HeaderMsgID, fmt.Sprintf("msg-%d", h.msgs))
		ack, err := h.op.JetStream().PublishMsg(ctx, m)
		if err != nil {
			h.t.Fatal(err)
		}
		h.last = ack.Sequence
	}
	for range n {
		rec := h.record()
		subject := contracts.SubjectUsage(rec.Tenant)
		switch h.rnd.IntN(40) {
		case 0:
			send(subject, []byte("{not json"))
			continue
		case 1:
			rec.Tenant = "other" // the body names another tenant: skipped
		case 2:
			rec.ID = "" // the message ID is the record's
		}
		data, err := json.Marshal(rec)
		if err != nil {
			h.t.Fatal(err)
		}
		send(subject, data)
		if h.rnd.IntN(10) == 0 {
			send(subject, data) // stored twice
		}
	}
}

// fold reads USAGE after seq from into each model as the ingester does,
// handing some messages over twice (a redelivery).
func (h *usageHarness) fold(from uint64, models ...*memoryModel) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	for _, mm := range models {
		in := &ingester{bus: h.gw, model: mm, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
		_, err := h.gw.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamUsage, StartSeq: from + 1}, func(ctx context.Context, m *bus.Msg) error {
			for range 1 + min(1, h.rnd.IntN(8)/7) {
				if err := in.applyUsage(ctx, m); err != nil {
					return err
				}
			}
			mm.usageSeq.Store(m.StreamSeq)
			return nil
		})
		if err != nil {
			h.t.Fatal(err)
		}
	}
}

// aggregating is a gateway's model: buckets, the records read from USAGE.
func (h *usageHarness) aggregating(retention time.Duration) *memoryModel {
	m := newRetainingModel(DefaultRetentionConfig(), func() time.Time { return h.now }, nil, nil)
	m.aggregateUsage(UsageConfig{HourRetention: retention}, streamUsage(h.gw, UsageConfig{}))
	return m
}

// usageQuestion is one question the API can ask of a tenant's usage:
// ask asks a model, old answers it as the model keeping every record did
// from the tenant's summary (decoded once for every question).
type usageQuestion struct {
	ask func(ctx context.Context, m readModel, tenant string) (any, error)
	old func(tenant string, sum contracts.UsageSummary) (any, error)
}

// questions are the usage questions the API can ask of a tenant: its
// summary, series by hour and day (every pool and one, unbounded or
// from..to on and off step boundaries), invoices of each month and of
// days spanning the records.
func (h *usageHarness) questions() []usageQuestion {
	qs := []usageQuestion{{
		ask: func(ctx context.Context, m readModel, tenant string) (any, error) { return m.Usage(ctx, tenant) },
		old: func(_ string, sum contracts.UsageSummary) (any, error) { return sum, nil },
	}}
	times := []time.Time{{}, h.now.Add(-40 * 24 * time.Hour), h.now.Add(-10 * 24 * time.Hour).Truncate(time.Hour),
		h.now.Add(-36*time.Hour - 17*time.Minute), h.now.Add(-3 * time.Hour), h.now.Add(20 * time.Hour)}
	for _, step := range []string{"hour", "day"} {
		width := map[string]time.Duration{"hour": time.Hour, "day": 24 * time.Hour}[step]
		for _, pool := range []string{"", usagePools[0]} {
			for i, from := range times {
				for j, to := range times[i:] {
					if !to.IsZero() && !to.After(from) {
						continue
					}
					if step == "hour" && i < 2 && (pool != "" || (j > 0 && i+j < len(times)-1)) {
						continue // read from USAGE: a few are enough
					}
					q := seriesQuery{step: step, width: width, pool: pool, from: from, to: to}
					qs = append(qs, usageQuestion{
						ask: func(ctx context.Context, m readModel, tenant string) (any, error) {
							return m.UsageSeries(ctx, tenant, q)
						},
						old: func(_ string, sum contracts.UsageSummary) (any, error) {
							return oldSeriesOf(sum, q.step, q.width, q.pool, q.from, q.to), nil
						},
					})
				}
			}
		}
	}
	periods := []string{"2026-08", "2026-09", "2026-10", "2026-11", "2026-12", "2027-01"}
	for d := h.now.Add(-62 * 24 * time.Hour); d.Before(h.now.Add(48 * time.Hour)); d = d.Add(24 * time.Hour) {
		periods = append(periods, d.Format(time.DateOnly))
	}
	for _, p := range periods {
		qs = append(qs, usageQuestion{
			ask: func(ctx context.Context, m readModel, tenant string) (any, error) { return m.Invoice(ctx, tenant, p) },
			old: func(tenant string, sum contracts.UsageSummary) (any, error) {
				return contracts.BuildInvoice(tenant, p, sum.ByJob)
			},
		})
	}
	return qs
}

// sameAnswers asks got every question of every tenant (and one with no
// usage) and wants the JSON (the API's answer) that the model keeping
// every record, want, gives.
func (h *usageHarness) sameAnswers(want, got readModel) {
	h.t.Helper()
	asked := 0
	for _, tenant := range append([]string{"nobody"}, usageTenants...) {
		ctx, cancel := context.WithTimeout(context.Background(), waitFor)
		sum, err := want.Usage(ctx, tenant)
		cancel()
		if err != nil {
			h.t.Fatal(err)
		}
		for i, q := range h.questions() {
			w, err := q.old(tenant, sum)
			if err != nil {
				h.t.Fatalf("%s question %d of the reference: %v", tenant, i, err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), waitFor)
			g, err := q.ask(ctx, got, tenant)
			cancel()
			if err != nil {
				h.t.Fatalf("%s question %d: %v", tenant, i, err)
			}
			wj, _ := json.Marshal(w)
			gj, _ := json.Marshal(g)
			if string(wj) != string(gj) {
				h.t.Fatalf("%s question %d:\n got %s\nwant %s", tenant, i, gj, wj)
			}
			asked++
		}
	}
	if asked < 100 {
		h.t.Fatalf("only %d questions asked", asked)
	}
}

// TestUsageBucketsAnswerAsTheRecords: random usage records (stored twice,
// repeated IDs with other contents, redelivered, without an ID, of
// another tenant, undecodable; instants, voids, spans of days, offsets)
// on a real USAGE stream: a model folding them into buckets and reading
// records from USAGE answers every summary, series (hour and day, pools,
// time ranges, with its hours cut and not) and invoice (months and days)
// as the model keeping every record; so does one started from its
// snapshot, before and after more records, and one whose hours kept
// were dropped days later. It keeps no record.
func TestUsageBucketsAnswerAsTheRecords(t *testing.T) {
	h := newUsageHarness(t, 7)
	h.publish(700)
	all := newMemoryModel()
	buckets := h.aggregating(20 * 24 * time.Hour)
	h.fold(0, all, buckets)
	h.sameAnswers(all, buckets)
	if len(buckets.usage) != 0 {
		t.Fatalf("the bucket model keeps %d tenants' records", len(buckets.usage))
	}
	// Both ways of answering a series were taken: from the hours kept,
	// and from the records for a series reaching before them.
	tu := buckets.usageAgg.tenants["acme"]
	if !tu.hoursCut {
		t.Fatal("no hour was cut: the records did not reach back far enough")
	}
	if _, ok := tu.series("acme", seriesQuery{step: "hour", width: time.Hour, from: h.now.Add(-3 * time.Hour)}); !ok {
		t.Fatal("a recent hourly series is not answered from the hours kept")
	}
	if _, ok := tu.series("acme", seriesQuery{step: "hour", width: time.Hour}); ok {
		t.Fatal("an unbounded hourly series is answered from the hours kept")
	}

	// A start from its snapshot answers as the log.
	s := buckets.snapshotWithUsage(1, h.last)
	data, err := s.encode()
	if err != nil {
		t.Fatal(err)
	}
	decoded, err := decodeModelSnap(data)
	if err != nil {
		t.Fatal(err)
	}
	restarted := h.aggregating(20 * 24 * time.Hour)
	restarted.install(decoded)
	if restarted.usageSeq.Load() != h.last {
		t.Fatalf("the restart reads USAGE after %d, want %d", restarted.usageSeq.Load(), h.last)
	}
	h.sameAnswers(all, restarted)
	// More records, and a fold that reads some of the snapshot's again.
	from := h.last
	h.publish(200)
	h.fold(from, all, buckets)
	h.fold(from-50, restarted)
	h.sameAnswers(all, restarted)
	h.sameAnswers(all, buckets)

	// Days later every hour kept is past the retention.
	h.now = h.now.Add(30 * 24 * time.Hour)
	from = h.last
	h.publish(50)
	h.fold(from, all, buckets)
	cut := h.now.Add(-20 * 24 * time.Hour).Truncate(time.Hour).Unix()
	for _, tu := range buckets.usageAgg.tenants {
		for k := range tu.hours {
			if k.start < cut {
				t.Fatalf("an hour %s kept past the retention", time.Unix(k.start, 0).UTC())
			}
		}
	}
	h.sameAnswers(all, buckets)
}

// TestUsageSnapshotOfAnOlderFormatIsRefused: a snapshot written before
// the usage buckets (its records as JSON, format 3) is refused, and a
// start reads JOB_EVENTS and USAGE whole, answering as the records.
func TestUsageSnapshotOfAnOlderFormatIsRefused(t *testing.T) {
	h := newUsageHarness(t, 11)
	h.publish(200)
	buckets := h.aggregating(0)
	h.fold(0, buckets)
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	kv, err := h.gw.KeyValue(ctx, contracts.BucketSnapshots)
	if err != nil {
		t.Fatal(err)
	}
	lives, err := kvsnap.Lives(ctx, h.gw.JetStream(), contracts.StreamJobEvents, contracts.StreamUsage)
	if err != nil {
		t.Fatal(err)
	}
	s := buckets.snapshotWithUsage(0, h.last)
	s.created, s.first = lives[contracts.StreamJobEvents].Created, lives[contracts.StreamJobEvents].First
	s.usageCreated, s.usageFirst = lives[contracts.StreamUsage].Created, lives[contracts.StreamUsage].First
	// As format 3 wrote it: its magic, a body and the body's checksum.
	old := func() ([]byte, error) {
		data, err := s.encode()
		if err != nil {
			return nil, err
		}
		body := append([]byte("gpuplane gateway read model 3\n"), data[len(snapshotMagic):len(data)-sha256.Size]...)
		sum := sha256.Sum256(body)
		return append(body, sum[:]...), nil
	}
	if _, err := snapshotStore(kv).Write(ctx, 1, old); err != nil {
		t.Fatal(err)
	}
	if _, err := loadModelSnapshot(ctx, h.gw); err == nil {
		t.Fatal("a snapshot of format 3 loads")
	}
	restarted := h.aggregating(0)
	in := &ingester{bus: h.gw, model: restarted, log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		snaps: newModelSnapshotter(h.gw, -1, slog.New(slog.NewTextHandler(io.Discard, nil))), loadDone: make(chan struct{})}
	rctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 2)
	go func() { done <- in.followJobEvents(rctx) }()
	go func() { done <- in.followUsage(rctx) }()
	t.Cleanup(func() { stop(); <-done; <-done })
	deadline := time.Now().Add(waitFor)
	for !in.jobsReady.Load() || !in.usageReady.Load() || in.usageFolded.Load() < h.last {
		if time.Now().After(deadline) {
			t.Fatal("the restart did not catch up")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if in.usageFrom != 0 || in.startSeq.Load() != 0 {
		t.Fatalf("the restart read USAGE after %d and JOB_EVENTS from %d, want both whole", in.usageFrom, in.startSeq.Load())
	}
	all := newMemoryModel()
	h.fold(0, all)
	h.sameAnswers(all, restarted)
}

// TestUsageDigestsCountEachOnce: the digest set says new once per
// digest across merges of its recent ones into the sorted array.
func TestUsageDigestsCountEachOnce(t *testing.T) {
	var d usageDigests
	rnd := rand.New(rand.NewPCG(3, 5))
	seen := map[usageDigest]bool{}
	for i := range 30_000 {
		k := digestOf("acme", fmt.Sprintf("usage/%d", rnd.IntN(20_000)))
		if got := d.add(k); got == seen[k] {
			t.Fatalf("add %d: new %v, seen before %v", i, got, seen[k])
		}
		seen[k] = true
	}
	if d.len() != len(seen) || len(d.sorted) == 0 {
		t.Fatalf("%d digests (%d sorted), want %d", d.len(), len(d.sorted), len(seen))
	}
	for k := range seen {
		if !d.has(k) {
			t.Fatal("a digest added is missing")
		}
	}
	if d.has(digestOf("globex", "usage/1")) {
		t.Fatal("another tenant's record is seen")
	}
}

// TestUsageDigestsAreKeptForTheDuplicateWindow: over 60 days of records,
// a copy of a record (its ID again) stored within the duplicate window of
// the original is never counted again, whatever lies between; the
// digests kept are those of the window and a day, not of the 60 days; a
// model started from a snapshot taken midway (of this format, through
// its encoding) counts every later record and copy as the model that
// went on; one started with a shorter window keeps less of it. A read of
// the tenant's records from USAGE (streamUsage's usageCopies, on the same
// timestamps) counts every record and copy as the fold does: the summary
// and the invoice agree (from a review).
func TestUsageDigestsAreKeptForTheDuplicateWindow(t *testing.T) {
	const (
		window = 7 * 24 * time.Hour
		perDay = 400
		days   = 60
	)
	ctx := context.Background()
	rnd := rand.New(rand.NewPCG(17, 3))
	model := func(w time.Duration) *memoryModel {
		m := newMemoryModel()
		m.aggregateUsage(UsageConfig{DuplicateWindow: w}, nil)
		return m
	}
	live := model(window)
	var restarted *memoryModel
	type stored struct {
		id string
		at time.Time
	}
	var past []stored
	byID := newUsageCopies(window)
	var added []time.Time // when each digest counted new was stored
	lastAdded := map[string]time.Time{}
	t0 := time.Date(2026, 9, 1, 0, 0, 0, 0, time.UTC)
	rec := func(id string, at time.Time) contracts.UsageRecord {
		return contracts.UsageRecord{SchemaVersion: 1, ID: id, Tenant: "acme", Pool: "east", Start: at.Add(-time.Hour), End: at,
			GPUMillis: 1000, Time: at}
	}
	apply := func(m *memoryModel, id string, at time.Time) bool {
		t.Helper()
		isNew, err := m.ApplyUsage(ctx, "acme", rec(id, at), at)
		if err != nil {
			t.Fatal(err)
		}
		return isNew
	}
	copies := map[string]int{} // "within", "beyond"
	for i := range days * perDay {
		at := t0.Add(time.Duration(i) * (24 * time.Hour / perDay))
		id, isCopy := fmt.Sprintf("usage/%d", i), false
		var lag time.Duration
		if len(past) > 0 && rnd.IntN(5) == 0 {
			// A copy of an earlier record, from minutes to 12 days back.
			o := past[len(past)-1-rnd.IntN(min(len(past), 12*perDay))]
			// Its lag is from when its digest was last added: a copy
			// counted again starts the window again.
			id, isCopy, lag = o.id, true, at.Sub(lastAdded[o.id])
		} else {
			past = append(past, stored{id, at})
		}
		got := apply(live, id, at)
		if read := byID.counts(id, at); read != got {
			t.Fatalf("a read from USAGE counts %s (copy %v, lag %s): %v; the fold: %v", id, isCopy, lag, read, got)
		}
		if got {
			added = append(added, at)
			lastAdded[id] = at
		}
		switch {
		case !isCopy && !got:
			t.Fatalf("record %s, never stored before, not counted", id)
		case isCopy && lag <= window && got:
			t.Fatalf("a copy stored %s after its original (window %s) counted again", lag, window)
		case isCopy && lag > window+24*time.Hour && !got:
			t.Fatalf("a copy stored %s after its original was known: the digests outlive the window and a day", lag)
		case isCopy && lag <= window:
			copies["within"]++
		case isCopy && lag > window+24*time.Hour:
			copies["beyond"]++
		}
		if restarted != nil && apply(restarted, id, at) != got {
			t.Fatalf("a model started from the snapshot counts %s (copy %v, lag %s) otherwise: %v", id, isCopy, lag, !got)
		}
		// The digests kept: at most the records stored within the window
		// and a day of the latest.
		if i%perDay == perDay-1 {
			recent := 0
			for _, a := range added {
				if at.Sub(a) < window+24*time.Hour {
					recent++
				}
			}
			if n := live.usageAgg.ids.len(); n > recent || n < perDay*int(window/(24*time.Hour)) && i > days*perDay/2 {
				t.Fatalf("day %d: %d digests kept, want at most the %d stored within the window and a day, and at least the window's",
					i/perDay, n, recent)
			}
		}
		if i == days*perDay/2 {
			data, err := live.snapshotWithUsage(1, 1).encode()
			if err != nil {
				t.Fatal(err)
			}
			install := func(w time.Duration) *memoryModel {
				s, err := decodeModelSnap(data)
				if err != nil {
					t.Fatal(err)
				}
				m := model(w)
				m.install(s)
				return m
			}
			restarted = install(window)
			if n, all := restarted.usageAgg.ids.len(), live.usageAgg.ids.len(); n != all {
				t.Fatalf("the snapshot gave back %d of %d digests", n, all)
			}
			// A gateway started with a shorter window keeps only its own.
			short := install(3 * 24 * time.Hour)
			if n, all := short.usageAgg.ids.len(), live.usageAgg.ids.len(); n >= all || n == 0 {
				t.Fatalf("a model with a 3-day window keeps %d of the snapshot's %d digests", n, all)
			}
		}
	}
	if copies["within"] < 100 || copies["beyond"] < 100 {
		t.Fatalf("copies within the window %d, beyond it %d: want both exercised", copies["within"], copies["beyond"])
	}
	// What was folded: each record once, and each copy beyond the window
	// again; the restarted model folded the same from its snapshot on.
	folded := func(m *memoryModel) (ms int64) {
		for _, p := range m.usageAgg.tenants["acme"].days {
			ms += p.millis
		}
		return ms
	}
	if got, want := folded(live), int64(len(added))*1000; got != want {
		t.Fatalf("%d ms folded, want %d: the %d records counted new", got, want, len(added))
	}
	if got, want := folded(restarted), folded(live); got != want {
		t.Fatalf("the model started from the snapshot folded %d ms, want %d", got, want)
	}
}

// oldSeriesOf is the series as the gateway computed it from the records
// before the buckets (seriesOf in usage_series.go at 760bc29^), kept
// verbatim as the reference of TestUsageBucketsAnswerAsTheRecords: it
// spreads a summary's records over steps of width, keeping pool ("" for
// all) and the time from..to (zero: unbounded).
func oldSeriesOf(sum contracts.UsageSummary, step string, width time.Duration, pool string, from, to time.Time) contracts.UsageSeries {
	out := contracts.UsageSeries{Tenant: sum.Tenant, Step: step, Pool: pool, Currency: sum.Currency,
		Points: []contracts.UsagePoint{}, Totals: []contracts.UsagePoint{}}
	points := map[seriesKey]*contracts.UsagePoint{}
	add := func(k seriesKey, millis, cost, onDemand int64) {
		p := points[k]
		if p == nil {
			p = &contracts.UsagePoint{Start: k.start, Pool: k.pool, PriceClass: k.class}
			points[k] = p
		}
		p.GPUMillis += millis
		p.CostMicros += cost
		p.OnDemandCostMicros += onDemand
	}
	for _, rec := range sum.ByJob {
		if pool != "" && rec.Pool != pool {
			continue
		}
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
			if (!from.IsZero() && !b.Add(width).After(from)) || (!to.IsZero() && !b.Before(to)) {
				continue
			}
			add(seriesKey{b, rec.Pool, string(rec.PriceClass)}, dm, dc, do)
		}
	}
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

// FuzzDecodeModelSnapshot: any body under a valid magic and checksum (a
// snapshot written by a buggy or other build) decodes to a snapshot or an
// error, never a panic or a runaway allocation. Seeded with a snapshot
// holding usage digests over several days.
func FuzzDecodeModelSnapshot(f *testing.F) {
	m := newMemoryModel()
	m.aggregateUsage(UsageConfig{DuplicateWindow: 3 * 24 * time.Hour}, nil)
	t0 := time.Date(2026, 9, 1, 0, 0, 0, 0, time.UTC)
	for i := range 40 {
		at := t0.Add(time.Duration(i) * 3 * time.Hour)
		if _, err := m.ApplyUsage(context.Background(), "acme", contracts.UsageRecord{ID: fmt.Sprintf("usage/%d", i), Tenant: "acme",
			Pool: "east", Start: at.Add(-time.Hour), End: at, GPUMillis: 1000}, at); err != nil {
			f.Fatal(err)
		}
	}
	data, err := m.snapshotWithUsage(1, 1).encode()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(data[len(snapshotMagic) : len(data)-sha256.Size])
	f.Fuzz(func(t *testing.T, body []byte) {
		raw := append([]byte(snapshotMagic), body...)
		sum := sha256.Sum256(raw)
		s, err := decodeModelSnap(append(raw, sum[:]...))
		if err == nil {
			// What decodes installs.
			into := newMemoryModel()
			into.aggregateUsage(UsageConfig{}, nil)
			into.install(s)
		}
	})
}
