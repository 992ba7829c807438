package billing_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/billing"
)

var t0 = time.Date(2025, 5, 1, 9, 0, 0, 0, time.UTC)

func TestValidateReportsTheBus(t *testing.T) {
	cfg := billing.DefaultConfig()
	cfg.Bus.NATSURL, cfg.Bus.Replicas = "", 2
	cfg.StoreRetryDelay = -time.Second
	err := cfg.Validate()
	if err == nil || !strings.Contains(err.Error(), "nats URL") || !strings.Contains(err.Error(), "replicas") ||
		!strings.Contains(err.Error(), "store retry") {
		t.Errorf("Validate() = %v, want every problem", err)
	}
}

// TestEveryRunIsBilledExactlyOnce: each run is billed once, segment by
// segment, across duplicates beyond JetStream's window, a record written
// by another replica, a poison entry, and restarts with and without the
// consumer's state; the totals, rebuilt from USAGE at every start, agree.
func TestEveryRunIsBilledExactlyOnce(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	inventory(t, b, "n1", "h100", "on-demand")
	inventory(t, b, "n2", "h100", "on-demand")
	inventory(t, b, "n3", "h100", "on-demand")

	a := alloc("acme", "j1", 1, "n1", 2)
	bb := alloc("acme", "j2", 1, "n1", 1)
	never := alloc("acme", "j3", 1, "n2", 4)
	c := alloc("beta", "j4", 1, "n2", 4)
	e := alloc("acme", "j5", 1, "n2", 1)
	d := alloc("acme", "j1", 2, "n3", 8)

	store1 := billing.NewMemoryStore()
	stop := start(t, srv, store1)

	// a ran 90.5 s (91 whole seconds touched), bb 1.2349 s (2 s).
	publishLedger(t, b, "", committed(a), released(a, 90*time.Second+500*time.Millisecond),
		committed(bb), released(bb, 1234*time.Millisecond+900*time.Microsecond),
		committed(never), releasedNeverStarted(never))
	waitUsage(t, b, []contracts.UsageRecord{record(a, 91), record(bb, 2)})

	// Another writer (a second replica) bills e before this one sees it.
	eRec := record(e, 3)
	if _, err := b.Publish(context.Background(), contracts.SubjectUsage("acme"), eRec.ID, eRec); err != nil {
		t.Fatal(err)
	}
	// Beyond JetStream's duplicate window, the same entries come again
	// under other message IDs, then a poison entry, then c as a barrier.
	natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamUsage)
	backwards := released(c, time.Second)
	backwards.Allocation.ID = "beta/bad/1"
	backwards.Run.EndedAt = t0.Add(-time.Second)
	publishLedger(t, b, "again-", released(a, 90*time.Second+500*time.Millisecond), released(e, 3*time.Second), backwards)
	publishLedger(t, b, "", committed(c), released(c, 10*time.Second))
	want := []contracts.UsageRecord{record(a, 91), record(bb, 2), eRec, record(c, 10)}
	waitUsage(t, b, want)
	wantTotals := map[string]billing.Totals{
		"acme":    sumTotals(totalsOf(record(a, 91)), totalsOf(record(bb, 2)), totalsOf(eRec)),
		"beta":    totalsOf(record(c, 10)),
		"acme/j1": totalsOf(record(a, 91)),
		"acme/j3": {},
	}
	waitTotals(t, store1, wantTotals)
	if dl := deadLetters(t, b); len(dl) != 1 || !strings.Contains(dl[0], "beta/bad/1") {
		t.Errorf("dead letters = %q, want the backwards entry", dl)
	}

	// Restart with a new store and no consumer state: the whole ledger is
	// delivered again, plus a' duplicate published while billing was down.
	stop()
	ctx := context.Background()
	if err := b.JetStream().DeleteConsumer(ctx, contracts.StreamAllocations, billing.Consumer); err != nil {
		t.Fatal(err)
	}
	natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamUsage)
	publishLedger(t, b, "down-", released(a, 90*time.Second+500*time.Millisecond))
	publishLedger(t, b, "", committed(d), released(d, 2*time.Millisecond+700*time.Microsecond))
	store2 := billing.NewMemoryStore()
	stop = start(t, srv, store2)
	want = append(want, record(d, 1))
	waitUsage(t, b, want)
	wantTotals["acme"] = sumTotals(wantTotals["acme"], totalsOf(record(d, 1)))
	wantTotals["acme/j1"] = sumTotals(wantTotals["acme/j1"], totalsOf(record(d, 1)))
	waitTotals(t, store2, wantTotals)

	// Restart again, consumer intact: nothing is redelivered, so the totals
	// of acme and beta can only come from replaying USAGE.
	stop()
	store3 := billing.NewMemoryStore()
	start(t, srv, store3)
	g := alloc("gamma", "j1", 1, "n1", 1)
	publishLedger(t, b, "", committed(g), released(g, time.Second))
	want = append(want, record(g, 1))
	waitUsage(t, b, want)
	wantTotals["gamma"] = totalsOf(record(g, 1))
	waitTotals(t, store3, wantTotals)
	// The totals rebuilt from USAGE equal the totals kept live.
	for _, k := range []string{"acme", "beta", "acme/j1"} {
		live, _ := get(store2, k)
		rebuilt, _ := get(store3, k)
		if live != rebuilt {
			t.Errorf("%s: live %+v, rebuilt %+v", k, live, rebuilt)
		}
	}
}

// TestPriceChangeMidRunSplitsTheSegment: a version taking effect during a
// run cuts its record in two, each priced by its own version, costs exact
// on both sides; the watermark follows the metered time, and the book can
// no longer change behind it.
func TestPriceChangeMidRunSplitsTheSegment(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	ctx := context.Background()
	inventory(t, b, "s1", "l4", "spot")
	kv, err := b.KeyValue(ctx, contracts.BucketPriceBook)
	if err != nil {
		t.Fatal(err)
	}
	change := t0.Add(40 * time.Second)
	setBook(t, kv, contracts.PriceBook{Versions: []contracts.PriceVersion{
		{ID: "v1", EffectiveFrom: t0.Add(-time.Hour), Currency: "EUR",
			GPU: map[string]contracts.GPUPrices{"L4": {OnDemand: 900_000, Spot: 360_000}}},
		{ID: "v2", EffectiveFrom: change, Currency: "EUR",
			GPU: map[string]contracts.GPUPrices{"L4": {OnDemand: 1_000_000, Spot: 300_000}}},
	}})
	start(t, srv, billing.NewMemoryStore())
	a := alloc("acme", "split", 1, "s1", 3)
	for i := range a.Devices {
		a.Devices[i].Model = "L4"
	}
	a.Pool = "l4"
	// 09:00:00.250 to 09:01:40.100: 40 s at v1, 61 s at v2.
	rel := released(a, 99*time.Second+850*time.Millisecond)
	rel.Run.StartedAt = t0.Add(250 * time.Millisecond)
	rel.Run.EndedAt = t0.Add(100*time.Second + 100*time.Millisecond)
	publishLedger(t, b, "", committed(a), rel)
	recs := usage(t, b, 2)
	type seg struct {
		id, version      string
		start, end       time.Time
		seconds, gpuCost int64
		onDemand         int64
		final            bool
	}
	got := []seg{}
	for _, r := range recs {
		got = append(got, seg{r.ID, r.PriceVersion, r.Start, r.End, r.Seconds, r.GPUCostMicros, r.OnDemandCostMicros, r.Final})
	}
	want := []seg{
		// 3 × 0.36 × 40/3600 = 0.012; at on-demand 3 × 0.90 × 40/3600 = 0.03.
		{"usage/acme/split/1/s0", "v1", t0, change, 40, 12_000, 30_000, false},
		// 3 × 0.30 × 61/3600 = 0.01525; on demand 3 × 1.00 × 61/3600 = 0.050833…
		{"usage/acme/split/1/s1", "v2", change, t0.Add(101 * time.Second), 61, 15_250, 50_833, true},
	}
	if diff := cmp.Diff(want, got, cmp.AllowUnexported(seg{})); diff != "" {
		t.Errorf("segments (-want +got):\n%s", diff)
	}
	if recs[0].PriceClass != contracts.PriceSpot || recs[0].Currency != "EUR" || recs[1].GPUShare != "3" {
		t.Errorf("class %s currency %s share %s", recs[0].PriceClass, recs[0].Currency, recs[1].GPUShare)
	}
	inv, err := contracts.BuildInvoice("acme", "2025-05", recs)
	if err != nil {
		t.Fatal(err)
	}
	if inv.TotalMicros != 27_250 || inv.Total != "0.03" || inv.SpotSavingsMicros != 80_833-27_250 {
		t.Errorf("invoice %s: total %d, savings %d", inv, inv.TotalMicros, inv.SpotSavingsMicros)
	}
	// The watermark is the end of what was metered.
	waitFor(t, "the metering watermark", func() (bool, string) {
		e, err := kv.Get(ctx, contracts.KeyMeteredUntil)
		if err != nil {
			return false, err.Error()
		}
		return string(e.Value()) == "2025-05-01T09:01:41Z", string(e.Value())
	})
}

// --- helpers ---

// connect connects the test's own client, which plays every other party
// (node agents, the scheduler, the gateway) and observes: the operator.
func connect(t *testing.T, srv *natsserver.Server) *bus.Bus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "test", Logger: quietLog(), CredsFile: natstest.Operator(t, srv)})
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	return b
}

func quietLog() *slog.Logger {
	if os.Getenv("GPUPLANE_TEST_DEBUG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// start runs billing until stop is called or the test ends, and checks that
// it stops cleanly within a bounded time. Billing runs with its own bus
// identity, which proves its permissions suffice.
func start(t *testing.T, srv *natsserver.Server, store billing.Store, opts ...func(*billing.Config)) (stop func()) {
	t.Helper()
	return startLogged(t, srv, store, quietLog(), opts...)
}

// startLogged is start with billing's log going to log.
func startLogged(t *testing.T, srv *natsserver.Server, store billing.Store, log *slog.Logger, opts ...func(*billing.Config)) (stop func()) {
	t.Helper()
	cfg := billing.DefaultConfig()
	cfg.Bus = service.BusConfig{NATSURL: srv.URL(), Replicas: 1, Creds: natstest.Service(t, srv, contracts.BusBilling)}
	cfg.Store = store
	cfg.StoreRetryDelay = 200 * time.Millisecond
	cfg.BudgetInterval = 100 * time.Millisecond
	for _, o := range opts {
		o(&cfg)
	}
	return natstest.RunService(t, "billing", func(ctx context.Context) error { return billing.Run(ctx, cfg, log) })
}

// inventory publishes a node's inventory with 8 GPUs of 80 GiB.
func inventory(t *testing.T, b *bus.Bus, node, pool, class string) {
	t.Helper()
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: node, Pool: pool, PriceClass: class, Incarnation: "i1", Time: t0}
	for i := range 8 {
		inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: fmt.Sprintf("GPU-%s-%d", node, i), Model: "H100-80GB",
			MemoryMiB: 81920, Healthy: true})
	}
	if _, err := b.Publish(context.Background(), contracts.SubjectInventory(node), contracts.InventoryID(node, "i1", 1), inv); err != nil {
		t.Fatal(err)
	}
}

func setBook(t *testing.T, kv interface {
	Put(context.Context, string, []byte) (uint64, error)
}, book contracts.PriceBook) {
	t.Helper()
	if err := book.Validate(); err != nil {
		t.Fatal(err)
	}
	data, _ := json.Marshal(book)
	if _, err := kv.Put(context.Background(), contracts.KeyPriceBook, data); err != nil {
		t.Fatal(err)
	}
}

func alloc(tenant, job string, attempt int, node string, gpus int) contracts.Allocation {
	a := contracts.Allocation{ID: contracts.AllocationID(tenant, job, attempt), Tenant: tenant, JobID: job,
		Attempt: attempt, NodeID: node, Pool: "h100"}
	for i := range gpus {
		a.Devices = append(a.Devices, contracts.DeviceRef{Index: i, UUID: fmt.Sprintf("GPU-%s-%d", node, i), Model: "H100-80GB"})
	}
	return a
}

func committed(a contracts.Allocation) contracts.LedgerEntry {
	return contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a, Time: t0}
}

func released(a contracts.Allocation, ran time.Duration) contracts.LedgerEntry {
	return contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerReleased, Allocation: a, Time: t0.Add(ran + time.Second),
		Reason: contracts.ReasonRunEnded, Run: &contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: t0, EndedAt: t0.Add(ran)}}
}

func releasedNeverStarted(a contracts.Allocation) contracts.LedgerEntry {
	e := released(a, 0)
	e.Reason, e.Run.StartedAt, e.Run.Outcome = contracts.ReasonCancelled, time.Time{}, contracts.OutcomeCancelled
	return e
}

// record is the single record of a run of a on the H100 on-demand nodes
// with no price book, billed secs whole seconds from t0.
func record(a contracts.Allocation, secs int64) contracts.UsageRecord {
	gpus := int64(len(a.Devices))
	return contracts.UsageRecord{SchemaVersion: 1, ID: contracts.UsageSegmentID(a.ID, 0), AllocationID: a.ID, Tenant: a.Tenant,
		JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Pool: a.Pool, GPUModel: "H100-80GB", GPUs: len(a.Devices),
		Start: t0, End: t0.Add(time.Duration(secs) * time.Second), GPUMillis: gpus * secs * 1000, GPUSeconds: float64(gpus * secs),
		UsageSegment: contracts.UsageSegment{Final: true, Reason: contracts.ReasonRunEnded, Devices: a.Devices, Seconds: secs,
			GPUShare: fmt.Sprint(gpus), PriceClass: contracts.PriceOnDemand}}
}

func totalsOf(r contracts.UsageRecord) billing.Totals {
	return billing.Totals{Records: 1, GPUMillis: r.GPUMillis, CostMicros: r.CostMicros, OnDemandMicros: r.OnDemandCostMicros}
}

func sumTotals(ts ...billing.Totals) billing.Totals {
	var s billing.Totals
	for _, t := range ts {
		s.Records += t.Records
		s.GPUMillis += t.GPUMillis
		s.CostMicros += t.CostMicros
		s.OnDemandMicros += t.OnDemandMicros
	}
	return s
}

// publishLedger publishes entries on their node's ledger subject; prefix
// makes the message IDs differ from the resource manager's, as a second
// copy of an entry would.
func publishLedger(t *testing.T, b *bus.Bus, prefix string, entries ...contracts.LedgerEntry) {
	t.Helper()
	for _, e := range entries {
		id := prefix + contracts.LedgerEntryID(e.Kind, e.Allocation.ID)
		if _, err := b.Publish(context.Background(), contracts.SubjectLedger(e.Allocation.NodeID), id, e); err != nil {
			t.Fatalf("publish %s: %v", id, err)
		}
	}
}

// usage waits for n records in USAGE and returns them in order, checking
// that each came under its own ID as Nats-Msg-Id on its tenant's subject.
func usage(t *testing.T, b *bus.Bus, n int) []contracts.UsageRecord {
	t.Helper()
	var got []contracts.UsageRecord
	deadline := time.Now().Add(15 * time.Second)
	for {
		got = got[:0]
		_, err := b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamUsage}, func(_ context.Context, m *bus.Msg) error {
			var r contracts.UsageRecord
			if err := m.Decode(&r); err != nil {
				return err
			}
			if m.ID() != r.ID || m.Subject != contracts.SubjectUsage(r.Tenant) {
				return fmt.Errorf("record %s came as %s on %s", r.ID, m.ID(), m.Subject)
			}
			got = append(got, r)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(got) >= n || time.Now().After(deadline) {
			return got
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitUsage waits until USAGE holds exactly want, in order (record times
// are not compared: they are the release entries').
func waitUsage(t *testing.T, b *bus.Bus, want []contracts.UsageRecord) {
	t.Helper()
	got := usage(t, b, len(want))
	if diff := cmp.Diff(want, got, cmp.FilterPath(func(p cmp.Path) bool { return p.Last().String() == ".Time" }, cmp.Ignore())); diff != "" {
		t.Fatalf("usage records (-want +got):\n%s", diff)
	}
}

// get reads totals; keys are "tenant" or "tenant/job".
func get(s billing.Store, k string) (billing.Totals, error) {
	if tenant, job, ok := strings.Cut(k, "/"); ok {
		return s.Job(context.Background(), tenant, job)
	}
	return s.Tenant(context.Background(), k)
}

// waitTotals waits until a store's totals are want (the projector applies
// records shortly after they are published).
func waitTotals(t *testing.T, s billing.Store, want map[string]billing.Totals) {
	t.Helper()
	waitFor(t, "the store's totals", func() (bool, string) {
		got := map[string]billing.Totals{}
		for k := range want {
			v, err := get(s, k)
			if err != nil {
				return false, err.Error()
			}
			got[k] = v
		}
		diff := cmp.Diff(want, got)
		return diff == "", "(-want +got)\n" + diff
	})
}

// waitFor polls cond every 20 ms for up to 20 s.
func waitFor(t *testing.T, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ok, status := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s: %s", what, status)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func deadLetters(t *testing.T, b *bus.Bus) []string {
	t.Helper()
	return deadLettersOf(t, b, contracts.StreamAllocations, billing.Consumer)
}

// deadLettersOf returns the reasons of the dead letters of stream's
// consumers (of one consumer when named).
func deadLettersOf(t *testing.T, b *bus.Bus, stream string, consumer ...string) []string {
	t.Helper()
	filter := "gp.dlq." + stream + ".>"
	if len(consumer) > 0 {
		filter = contracts.SubjectDeadLetter(stream, consumer[0])
	}
	var out []string
	_, err := b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamDeadLetters,
		FilterSubjects: []string{filter}},
		func(_ context.Context, m *bus.Msg) error {
			out = append(out, m.Header.Get(contracts.HeaderDeadLetterReason))
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestCPUAndMemoryArePricedFromTheRequest: with CPU and memory rates in
// the book, billing finds the job's request in its queued event and bills
// the cores and memory it asked for, for as long as it ran.
func TestCPUAndMemoryArePricedFromTheRequest(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	ctx := context.Background()
	inventory(t, b, "n1", "h100", "reserved")
	kv, err := b.KeyValue(ctx, contracts.BucketPriceBook)
	if err != nil {
		t.Fatal(err)
	}
	setBook(t, kv, contracts.PriceBook{Versions: []contracts.PriceVersion{{ID: "v1", EffectiveFrom: t0.Add(-time.Hour),
		Currency: "USD", GPU: map[string]contracts.GPUPrices{"*": {OnDemand: 3_600_000, Reserved: 1_800_000}},
		CPUCoreHour: 36_000, MemoryGiBHour: 3_600}}})
	req := contracts.JobRequest{ID: "big", Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1},
		CPUMilli: 16_500, MemoryMiB: 65_536}, Run: contracts.RunSpec{Duration: contracts.Duration(time.Minute)}}
	queued := contracts.JobEvent{SchemaVersion: 1, Type: contracts.EventQueued, Tenant: "acme", JobID: "big", Attempt: 1,
		State: contracts.StateQueued, Time: t0, Request: &req}
	if _, err := b.Publish(ctx, contracts.SubjectJobEvents("acme", "big"), contracts.JobEventID("acme", "big", contracts.EventQueued, 1, 0), queued); err != nil {
		t.Fatal(err)
	}
	start(t, srv, billing.NewMemoryStore())
	a := alloc("acme", "big", 1, "n1", 1)
	publishLedger(t, b, "", committed(a), released(a, 100*time.Second))
	r := usage(t, b, 1)[0]
	// 100 s: GPU 1.80/h reserved = 0.05, on demand 0.10; 16.5 cores ×
	// 0.036/h = 0.0165; 64 GiB × 0.0036/h = 0.0064.
	if r.GPUCostMicros != 50_000 || r.CPUCostMicros != 16_500 || r.MemoryCostMicros != 6_400 || r.CostMicros != 72_900 ||
		r.OnDemandCostMicros != 100_000+16_500+6_400 || r.CPUMilli != 16_500 || r.MemoryMiB != 65_536 || r.PriceClass != contracts.PriceReserved {
		t.Errorf("record %+v", r.UsageSegment)
	}
}
