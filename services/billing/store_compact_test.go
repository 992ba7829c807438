package billing

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestMemoryStoreKeepsJobsCompactly: what the in-memory store keeps per
// job (its applied marker and its job's totals, what grows with history:
// issue 17) is a compact record each, ~24 and ~56 bytes, not Go map
// slots (~36 and ~110 measured before); every job's totals are still
// served, and the records applied again (a replay of USAGE, a
// redelivery) count nothing.
func TestMemoryStoreKeepsJobsCompactly(t *testing.T) {
	const jobs = 20_000
	ctx := context.Background()
	s := NewMemoryStore()
	start := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	recs := make([]contracts.UsageRecord, 0, 2*jobs)
	for i := range jobs {
		tenant, job := fmt.Sprintf("t%d", i%7), fmt.Sprintf("j%06d", i)
		id := contracts.AllocationID(tenant, job, 1)
		// Two segments a job, as a run that crosses midnight has.
		for seg := range 2 {
			recs = append(recs, contracts.UsageRecord{ID: contracts.UsageSegmentID(id, seg), AllocationID: id, Tenant: tenant,
				JobID: job, Attempt: 1, Pool: "p", Start: start.Add(time.Duration(seg) * 24 * time.Hour),
				GPUMillis: int64(1000 * (i + seg)), UsageSegment: contracts.UsageSegment{CostMicros: int64(i), OnDemandCostMicros: int64(2 * i)}})
		}
	}
	for round, want := range []int{len(recs), 0} {
		n, err := s.Apply(ctx, recs)
		if err != nil {
			t.Fatal(err)
		}
		if n != want {
			t.Fatalf("round %d: Apply counted %d records new, want %d", round, n, want)
		}
	}
	for i := range jobs {
		got, err := s.Job(ctx, fmt.Sprintf("t%d", i%7), fmt.Sprintf("j%06d", i))
		if err != nil {
			t.Fatal(err)
		}
		want := Totals{Records: 2, GPUMillis: int64(1000 * (2*i + 1)), CostMicros: int64(2 * i), OnDemandMicros: int64(4 * i)}
		if got != want {
			t.Fatalf("job %d totals %+v, want %+v", i, got, want)
		}
	}
	if got, err := s.Job(ctx, "t0", "never"); err != nil || got != (Totals{}) {
		t.Fatalf("totals of a job never billed = %+v, %v; want zero", got, err)
	}
	if got, _ := s.Tenant(ctx, "t0"); got.Records != int64(2*((jobs+6)/7)) {
		t.Fatalf("tenant t0 counted %d records, want %d", got.Records, 2*((jobs+6)/7))
	}
	// Record, last chunk's slack, index slots 4 bytes at most 3/4 and at
	// least 3/8 full.
	if per := float64(s.applied.Bytes()) / float64(s.applied.Len()); per > 16+11+3 {
		t.Errorf("%.1f bytes per applied marker, want at most 30", per)
	}
	if per := float64(s.jobs.Bytes()) / float64(s.jobs.Len()); per > jobRecordSize+11+6 {
		t.Errorf("%.1f bytes per job's totals, want at most %d", per, jobRecordSize+17)
	}
}
