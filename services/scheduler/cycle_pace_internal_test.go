package scheduler

import (
	"testing"
	"time"
)

// TestNextCycle: the next cycle starts an interval after the last one
// started, or rest times its duration after it ended when that is later,
// the rest bounded by maxCycleRest.
func TestNextCycle(t *testing.T) {
	t0 := time.Date(2026, 11, 27, 0, 0, 0, 0, time.UTC)
	ms := time.Millisecond
	for _, c := range []struct {
		name          string
		took, elapsed time.Duration // in the cycle; from its start to its end (with the lock wait)
		rest          float64
		want          time.Duration // after t0, the last cycle's start
	}{
		{name: "short cycle: the interval", took: ms, elapsed: ms, rest: 1, want: 5 * ms},
		{name: "rest off", took: 40 * ms, elapsed: 40 * ms, rest: 0, want: 5 * ms},
		{name: "long cycle rests its duration", took: 40 * ms, elapsed: 40 * ms, rest: 1, want: 80 * ms},
		{name: "rest counts the cycle, not the lock wait", took: 10 * ms, elapsed: 30 * ms, rest: 1, want: 40 * ms},
		{name: "rest in multiples", took: 10 * ms, elapsed: 10 * ms, rest: 3, want: 40 * ms},
		{name: "rest below the interval", took: 2 * ms, elapsed: 2 * ms, rest: 1, want: 5 * ms},
		{name: "rest bounded", took: 2 * time.Second, elapsed: 2 * time.Second, rest: 1, want: 2*time.Second + maxCycleRest},
		{name: "cycle longer than the interval, no rest", took: 20 * ms, elapsed: 20 * ms, rest: 0, want: 5 * ms},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := nextCycle(t0, t0.Add(c.elapsed), c.took, 5*ms, c.rest)
			if got.Sub(t0) != c.want {
				t.Errorf("next cycle %s after the last start, want %s", got.Sub(t0), c.want)
			}
		})
	}
}
