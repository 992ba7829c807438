package meter

import (
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

var start = time.Date(2025, 5, 1, 9, 0, 0, 0, time.UTC)

func released(gpus int, from time.Time, ran time.Duration) contracts.LedgerEntry {
	a := contracts.Allocation{ID: "acme/j1/2", Tenant: "acme", JobID: "j1", Attempt: 2, NodeID: "n1", Pool: "h100"}
	for i := range gpus {
		a.Devices = append(a.Devices, contracts.DeviceRef{Index: i, UUID: "GPU-" + string(rune('a'+i)), Model: "H100-80GB"})
	}
	return contracts.LedgerEntry{Kind: contracts.LedgerReleased, Allocation: a, Time: from.Add(ran + time.Second),
		Reason: contracts.ReasonRunEnded, Run: &contracts.RunResult{Outcome: contracts.OutcomeSucceeded,
			StartedAt: from, EndedAt: from.Add(ran)}}
}

// priceBook: H100 4.00 on demand, 1.60 spot; from noon 3.00 and 1.20;
// CPU and memory rates only in the second version.
func priceBook() contracts.PriceBook {
	return contracts.PriceBook{Versions: []contracts.PriceVersion{
		{ID: "v1", EffectiveFrom: start.Add(-24 * time.Hour), Currency: "USD",
			GPU: map[string]contracts.GPUPrices{"H100-80GB": {OnDemand: 4_000_000, Spot: 1_600_000}}},
		{ID: "v2", EffectiveFrom: start.Add(3 * time.Hour), Currency: "USD",
			GPU:         map[string]contracts.GPUPrices{"H100-80GB": {OnDemand: 3_000_000, Spot: 1_200_000}},
			CPUCoreHour: 40_000, MemoryGiBHour: 5_000},
	}}
}

func TestMeterBillsWholeSecondsTouched(t *testing.T) {
	// 09:00:00.5 to 09:01:30.7: the seconds 09:00:00 to 09:01:31, 91 s.
	e := released(4, start.Add(500*time.Millisecond), 90*time.Second+200*time.Millisecond)
	got, err := Meter(Input{Entry: e, Node: Node{Pool: "h100", Class: contracts.PriceOnDemand}, Book: priceBook()})
	if err != nil || len(got) != 1 {
		t.Fatalf("Meter = %v, %v", got, err)
	}
	want := contracts.UsageRecord{SchemaVersion: 1, ID: "usage/acme/j1/2/s0", AllocationID: "acme/j1/2", Tenant: "acme",
		JobID: "j1", Attempt: 2, NodeID: "n1", Pool: "h100", GPUModel: "H100-80GB", GPUs: 4,
		Start: start, End: start.Add(91 * time.Second), GPUMillis: 4 * 91_000, GPUSeconds: 364, Time: e.Time,
		UsageSegment: contracts.UsageSegment{Segment: 0, Final: true, Reason: contracts.ReasonRunEnded, Devices: e.Allocation.Devices,
			Seconds: 91, GPUShare: "4", PriceClass: contracts.PriceOnDemand, PriceVersion: "v1", Currency: "USD",
			GPURateMicros: 4_000_000, OnDemandRateMicros: 4_000_000,
			// 4 × 4.00 × 91 / 3600 = 0.40444…
			GPUCostMicros: 404_444, CostMicros: 404_444, OnDemandCostMicros: 404_444}}
	if diff := cmp.Diff(want, got[0]); diff != "" {
		t.Errorf("record (-want +got):\n%s", diff)
	}
	again, _ := Meter(Input{Entry: e, Node: Node{Pool: "h100", Class: contracts.PriceOnDemand}, Book: priceBook()})
	if !cmp.Equal(got, again) {
		t.Error("metering the same entry twice gave two different records")
	}
}

func TestMeterSplitsAtPriceChangesAndMidnights(t *testing.T) {
	// Spot, 2 GPUs, 11:59:00 to the next day 00:00:30: v1 until noon, v2
	// after, and a new day at midnight.
	from := start.Add(2*time.Hour + 59*time.Minute)
	to := time.Date(2025, 5, 2, 0, 0, 30, 0, time.UTC)
	e := released(2, from, to.Sub(from))
	e.Allocation.Devices[0].Model, e.Allocation.Devices[1].Model = "H100-80GB", "H100-80GB"
	got, err := Meter(Input{Entry: e, Node: Node{Class: contracts.PriceSpot}, Book: priceBook(), CPUMilli: 8000, MemoryMiB: 65536})
	if err != nil {
		t.Fatal(err)
	}
	type seg struct {
		start, end         time.Time
		version            string
		gpu, cpu, mem, odc int64
		final              bool
	}
	noon, midnight := start.Add(3*time.Hour), time.Date(2025, 5, 2, 0, 0, 0, 0, time.UTC)
	want := []seg{
		// 60 s × 2 × 1.60/h = 0.053333; no CPU or memory rate in v1.
		{from, noon, "v1", 53_333, 0, 0, 133_333, false},
		// 43200 s × 2 × 1.20/h = 28.80; 8 cores × 0.04/h × 12 h = 3.84;
		// 64 GiB × 0.005/h × 12 h = 3.84; on demand 2 × 3.00 × 12 = 72.
		{noon, midnight, "v2", 28_800_000, 3_840_000, 3_840_000, 72_000_000 + 7_680_000, false},
		// 30 s: 2 × 1.20 × 30/3600 = 0.02; 8 × 0.04 × 30/3600 = 0.002666… →
		// 0.002667; 64 × 0.005 × 30/3600 = 0.002666… → 0.002667.
		{midnight, to, "v2", 20_000, 2_667, 2_667, 50_000 + 2*2_667, true},
	}
	if len(got) != len(want) {
		t.Fatalf("%d records, want %d: %+v", len(got), len(want), got)
	}
	var secs int64
	for i, w := range want {
		r := got[i]
		g := seg{r.Start, r.End, r.PriceVersion, r.GPUCostMicros, r.CPUCostMicros, r.MemoryCostMicros, r.OnDemandCostMicros, r.Final}
		if g != w {
			t.Errorf("segment %d = %+v, want %+v", i, g, w)
		}
		if r.Segment != i || r.ID != contracts.UsageSegmentID("acme/j1/2", i) || r.CostMicros != r.GPUCostMicros+r.CPUCostMicros+r.MemoryCostMicros {
			t.Errorf("segment %d: number %d, ID %s, cost %d", i, r.Segment, r.ID, r.CostMicros)
		}
		secs += r.Seconds
	}
	if secs != int64(to.Sub(from)/time.Second) {
		t.Errorf("segments bill %d s, the run took %s", secs, to.Sub(from))
	}

	// Resumed after the first segment was published: the rest, numbered on.
	rest, err := Meter(Input{Entry: e, Node: Node{Class: contracts.PriceSpot}, Book: priceBook(), CPUMilli: 8000, MemoryMiB: 65536,
		From: noon, Segment: 1})
	if err != nil || !cmp.Equal(rest, got[1:]) {
		t.Errorf("resumed metering differs from the tail of a full one: %v", err)
	}
}

func TestMeterRoundsHalfToEven(t *testing.T) {
	b := contracts.PriceBook{Versions: []contracts.PriceVersion{{ID: "tiny", EffectiveFrom: start.Add(-time.Hour), Currency: "USD",
		GPU: map[string]contracts.GPUPrices{"*": {OnDemand: 1}}}}} // one micro-unit per GPU-hour
	for ran, want := range map[time.Duration]int64{
		1800 * time.Second: 0, // 0.5 → 0
		5400 * time.Second: 2, // 1.5 → 2
		9000 * time.Second: 2, // 2.5 → 2
		9001 * time.Second: 3, // 2.5003 → 3
	} {
		got, err := Meter(Input{Entry: released(1, start, ran), Book: b})
		if err != nil || got[0].GPUCostMicros != want {
			t.Errorf("%s at 1 micro/h: %d, %v; want %d", ran, got[0].GPUCostMicros, err, want)
		}
	}
}

func TestMeterPricesSharesOfACard(t *testing.T) {
	e := released(2, start, time.Hour)
	e.Allocation.Devices[0].MIG = &contracts.MIGInstance{UUID: "MIG-1", Profile: "3g.40gb"}
	e.Allocation.Devices[1].Share = &contracts.GPUShare{MemoryMiB: 40960, ComputePercent: 25}
	node := Node{Class: contracts.PriceOnDemand, GPUMemoryMiB: map[string]int64{"GPU-b": 81920}}
	got, err := Meter(Input{Entry: e, Node: node, Book: priceBook()})
	if err != nil {
		t.Fatal(err)
	}
	// 3/7 + max(40960/81920, 25/100) = 3/7 + 1/2 = 13/14 of 4.00 for an
	// hour: 3.714285…
	if r := got[0]; r.GPUShare != "13/14" || r.GPUCostMicros != 3_714_286 {
		t.Errorf("share %s cost %d, want 13/14 and 3714286", r.GPUShare, r.GPUCostMicros)
	}
	// Without the card's memory the compute share alone counts.
	got, _ = Meter(Input{Entry: e, Node: Node{}, Book: priceBook()})
	if got[0].GPUShare != "19/28" {
		t.Errorf("share without the card's memory = %s, want 3/7 + 1/4 = 19/28", got[0].GPUShare)
	}
}

func TestMeterWithoutAPrice(t *testing.T) {
	e := released(1, start, time.Minute)
	got, _ := Meter(Input{Entry: e, Book: contracts.PriceBook{}})
	if r := got[0]; r.Seconds != 60 || r.PriceVersion != "" || r.CostMicros != 0 || r.PriceClass != contracts.PriceOnDemand {
		t.Errorf("no book: %+v", r)
	}
	e.Allocation.Devices[0].Model = "L4"
	got, _ = Meter(Input{Entry: e, Book: priceBook()})
	if r := got[0]; !r.Unpriced || r.PriceVersion != "v1" || r.CostMicros != 0 {
		t.Errorf("unpriced model: %+v", r)
	}
}

func TestMeterBillsNothing(t *testing.T) {
	neverRan := released(2, start, time.Minute)
	neverRan.Run.StartedAt = time.Time{}
	noRun := released(2, start, time.Minute)
	noRun.Run = nil
	committed := released(2, start, time.Minute)
	committed.Kind, committed.Run = contracts.LedgerCommitted, nil
	instant := released(2, start, 0)
	done := released(2, start, time.Minute)
	for name, in := range map[string]Input{
		"committed":          {Entry: committed},
		"released, no run":   {Entry: noRun},
		"released, no start": {Entry: neverRan},
		"no time at all":     {Entry: instant},
		"already billed":     {Entry: done, From: start.Add(time.Minute), Segment: 3},
	} {
		if recs, err := Meter(in); len(recs) != 0 || err != nil {
			t.Errorf("%s: Meter = %+v, %v; want nothing", name, recs, err)
		}
	}
}

func TestMeterRefusesMalformedEntries(t *testing.T) {
	backwards := released(1, start, time.Minute)
	backwards.Run.EndedAt = start.Add(-time.Second)
	noDevices := released(0, start, time.Minute)
	badTenant := released(1, start, time.Minute)
	badTenant.Allocation.Tenant = "ACME.*"
	for name, e := range map[string]contracts.LedgerEntry{
		"ended before it started": backwards,
		"no devices":              noDevices,
		"tenant not a token":      badTenant,
	} {
		if _, err := Meter(Input{Entry: e}); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err=%v, want ErrMalformed", name, err)
		}
	}
}

// TestVoidNegatesItsRecord: a void is its record's segment with every
// quantity and cost negated, so the two sum to nothing in every total
// (same day, price version, class and pool), under the next segment's ID.
func TestVoidNegatesItsRecord(t *testing.T) {
	start := time.Date(2026, 11, 26, 10, 41, 51, 0, time.UTC)
	rec := contracts.UsageRecord{ID: contracts.UsageSegmentID("acme/j1/1", 0), AllocationID: "acme/j1/1", Tenant: "acme",
		Pool: "h100", GPUs: 2, Start: start, End: start.Add(24 * time.Second), GPUMillis: 48_000, GPUSeconds: 48,
		UsageSegment: contracts.UsageSegment{Final: true, Provisional: true, Reason: contracts.ReasonNodeLost, Seconds: 24,
			PriceVersion: "v1", GPURateMicros: 3_000_000, GPUCostMicros: 40_000, CPUCostMicros: 3, MemoryCostMicros: 2,
			CostMicros: 40_005, OnDemandCostMicros: 40_005}}
	at := start.Add(time.Minute)
	v := Void(rec, 1, at)
	want := rec
	want.ID, want.Segment, want.Final, want.Provisional, want.Voids, want.Time = contracts.UsageSegmentID("acme/j1/1", 1), 1, false, false, rec.ID, at
	want.Seconds, want.GPUMillis, want.GPUSeconds = -24, -48_000, -48
	want.GPUCostMicros, want.CPUCostMicros, want.MemoryCostMicros, want.CostMicros, want.OnDemandCostMicros = -40_000, -3, -2, -40_005, -40_005
	if diff := cmp.Diff(want, v); diff != "" {
		t.Errorf("void (-want +got):\n%s", diff)
	}
}
