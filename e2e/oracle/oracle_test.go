package oracle

import (
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

var t0 = time.Date(2026, 11, 26, 10, 41, 51, 300_000_000, time.UTC)

const lostID = "acme/j1/1"

// seg is a record of lostID over [from, to) seconds after floor(t0), 2 GPUs.
func seg(n int, from, to int64, final, provisional bool, voids string) contracts.UsageRecord {
	base := t0.Truncate(time.Second)
	secs := to - from
	r := contracts.UsageRecord{ID: contracts.UsageSegmentID(lostID, n), AllocationID: lostID, Tenant: "acme", JobID: "j1",
		Attempt: 1, GPUs: 2, Start: base.Add(time.Duration(from) * time.Second), End: base.Add(time.Duration(to) * time.Second),
		GPUMillis: 2 * secs * 1000, UsageSegment: contracts.UsageSegment{Segment: n, Final: final, Provisional: provisional,
			Voids: voids, Seconds: secs, CostMicros: 100 * secs}}
	if voids != "" {
		r.Final = false
		r.Seconds, r.GPUMillis, r.CostMicros = -r.Seconds, -r.GPUMillis, -r.CostMicros
	}
	return r
}

// lostReport is the run: started 10:41:51.3, released node_lost at
// 10:42:14.1; ended (by its agent) at end, or no ended fact when end is zero.
func lostReport(end time.Time, recs ...contracts.UsageRecord) *Report {
	release := t0.Add(22*time.Second + 800*time.Millisecond)
	r := &Report{Jobs: map[string]*Job{}, Runs: map[string]*Run{}, Usage: map[string][]contracts.UsageRecord{},
		Released: map[string]contracts.LedgerEntry{}}
	run := &Run{AllocationID: lostID, GPUs: 2, Started: 1, StartedAt: t0}
	if !end.IsZero() {
		run.Ended, run.EndedAt, run.Outcome = 1, end, contracts.OutcomeFailed
	}
	r.Runs[lostID] = run
	r.Released[lostID] = contracts.LedgerEntry{Kind: contracts.LedgerReleased, Reason: contracts.ReasonNodeLost,
		Allocation: contracts.Allocation{ID: lostID, Tenant: "acme", JobID: "j1", Attempt: 1},
		Run:        &contracts.RunResult{Outcome: contracts.OutcomeFailed, StartedAt: t0, EndedAt: release, Reason: contracts.ReasonNodeLost}}
	if len(recs) > 0 {
		r.Usage[lostID] = recs
	}
	return r
}

// TestBillingMatchesRuns: the check accepts exactly the bills that equal
// the agent's run facts, provisional bills and their voids included, and
// names what is wrong with the others.
func TestBillingMatchesRuns(t *testing.T) {
	later := t0.Add(31*time.Second + 700*time.Millisecond) // 10:42:23.0: 32 whole seconds from 10:41:51
	earlier := t0.Add(10 * time.Second)                    // 11 whole seconds
	tests := map[string]struct {
		report *Report
		want   string // a violation containing this; "" for none
	}{
		"agent's end after the release, provisional voided": {lostReport(later,
			seg(0, 0, 24, true, true, ""), seg(1, 0, 24, false, false, contracts.UsageSegmentID(lostID, 0)), seg(2, 0, 32, true, false, "")), ""},
		"agent's end before the release, provisional voided": {lostReport(earlier,
			seg(0, 0, 24, true, true, ""), seg(1, 0, 24, false, false, contracts.UsageSegmentID(lostID, 0)), seg(2, 0, 11, true, false, "")), ""},
		"ended fact read first: billed once":        {lostReport(later, seg(0, 0, 32, true, false, "")), ""},
		"agent never came back: the release stands": {lostReport(time.Time{}, seg(0, 0, 24, true, true, "")), ""},
		"the agent's end in the release's second":   {lostReport(t0.Add(23*time.Second), seg(0, 0, 24, true, true, "")), ""},
		"billed to the release (the issue)": {lostReport(later, seg(0, 0, 24, true, true, "")),
			"billed 48000 GPU-ms, its run facts (ended fact"},
		"billed to the release, marked final": {lostReport(later, seg(0, 0, 24, true, false, "")),
			"say 64000"},
		"a void of a bill that was not provisional": {lostReport(later,
			seg(0, 0, 24, true, false, ""), seg(1, 0, 24, false, false, contracts.UsageSegmentID(lostID, 0)), seg(2, 0, 32, true, false, "")),
			"not an earlier provisional record"},
		"corrected twice": {lostReport(later,
			seg(0, 0, 24, true, true, ""), seg(1, 0, 24, false, false, contracts.UsageSegmentID(lostID, 0)), seg(2, 0, 32, true, false, ""),
			seg(3, 0, 32, true, false, "")), "billed 128000"},
		"not billed": {lostReport(later), "billed 0 GPU-ms"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			mismatches := tc.report.CheckBillingMatchesRuns()
			got := strings.Join(tc.report.Violations, "\n")
			switch {
			case tc.want == "" && (len(mismatches) != 0 || got != ""):
				t.Errorf("violations for a bill that equals the run facts: %s", got)
			case tc.want != "" && (len(mismatches) != 1 || !strings.Contains(got, tc.want)):
				t.Errorf("mismatches %+v, violations %q; want one containing %q", mismatches, got, tc.want)
			}
		})
	}
}

// TestMeteringReadsWhatStands: CheckMetering, which the e2e tests call,
// counts a provisional bill replaced by the agent's end as one bill of
// the agent's span, and does not flag a node_lost release's end that
// differs from the agent's.
func TestMeteringReadsWhatStands(t *testing.T) {
	end := t0.Add(31*time.Second + 700*time.Millisecond)
	r := lostReport(end, seg(0, 0, 24, true, true, ""), seg(1, 0, 24, false, false, contracts.UsageSegmentID(lostID, 0)),
		seg(2, 0, 32, true, false, ""))
	billed, expected := r.CheckMetering()
	if err := r.Err(); err != nil {
		t.Fatal(err)
	}
	if billed != 64000 || expected != 64000 {
		t.Errorf("billed %d, expected %d; want 64000 both", billed, expected)
	}
	// The provisional bill left standing is billed short.
	r = lostReport(end, seg(0, 0, 24, true, true, ""))
	if billed, expected := r.CheckMetering(); billed != 48000 || expected != 64000 || r.Err() == nil {
		t.Errorf("billed %d, expected %d, violations %v", billed, expected, r.Violations)
	}
}
