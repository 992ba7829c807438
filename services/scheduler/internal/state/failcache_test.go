package state

import (
	"reflect"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestFailCacheAnswersAsPlacement drives a store whose cycles answer
// repeated failures from the cycle's failCache and the exhaustive
// reference (every request placed and explained afresh) through the
// steady driver with its extras (quota changes, cancels, lost and new
// nodes): every cycle's result and every job's pending reason must be the
// same, the cache must have answered many failures, among them ones with
// quota notes, and the reference none.
func TestFailCacheAnswersAsPlacement(t *testing.T) {
	cycles := 20
	if testing.Short() || raceEnabled {
		cycles = 8
	}
	fast, full := benchMixed(t, 80, 400), benchMixed(t, 80, 400)
	full.exhaustive = true
	sd := newSteady(80, fast, full)
	sd.extra = steadyExtras(80)
	quotaNoted := 0
	for cycle := range cycles {
		got, want := fast.Cycle(), full.Cycle()
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("cycle %d differs: %s", cycle, firstDiff(got, want))
		}
		for k, j := range fast.jobs {
			if o := full.jobs[k]; o == nil || o.Pending != j.Pending || o.State != j.State {
				t.Fatalf("cycle %d: job %s: fast %s %+v, exhaustive %+v", cycle, k, j.State, j.Pending, o)
			}
			if j.State == contracts.StateQueued && j.Pending.Code == contracts.PendingQuotaExceeded {
				quotaNoted++
			}
		}
		sd.apply(got)
		sd.delta(40, 10)
	}
	if fast.cycleBufs.failHits < 100 || full.cycleBufs.failHits != 0 {
		t.Fatalf("failures answered by the cache: %d (fast), %d (reference)", fast.cycleBufs.failHits, full.cycleBufs.failHits)
	}
	if quotaNoted == 0 {
		t.Fatal("no job waited on quota: the notes went untested")
	}
	t.Logf("%d failures answered by the cache, %d quota reasons compared", fast.cycleBufs.failHits, quotaNoted)
}
