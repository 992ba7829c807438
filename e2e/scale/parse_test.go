package scale

import (
	"math"
	"testing"
	"time"
)

// The benchmark's figures come from reading other processes' output; a
// format it misreads would report zeros, not fail. These pin the readers.

func TestGCLiveHeap(t *testing.T) {
	for _, tc := range []struct {
		line string
		want float64
		ok   bool
	}{
		{"gc 12 @3.105s 2%: 0.021+1.2+0.003 ms clock, 0.043+0.10/1.1/0+0.007 ms cpu, 41->43->20 MB, 42 MB goal, 0 MB stacks, 0 MB globals, 2 P\n", 20, true},
		{"gc 1 @0.004s 1%: 0.010+0.30+0.002 ms clock, 0.020+0/0.2/0+0.005 ms cpu, 3->3->0 MB, 4 MB goal, 0 MB stacks, 0 MB globals, 2 P\n", 0, true},
		{"time=2026-11-26T20:49:10Z level=INFO msg=leader service=scheduler\n", 0, false},
		{"gc is not a trace line\n", 0, false},
	} {
		got, ok := gcLiveHeap(tc.line)
		if got != tc.want || ok != tc.ok {
			t.Errorf("gcLiveHeap(%q) = %v, %v; want %v, %v", tc.line, got, ok, tc.want, tc.ok)
		}
	}
}

func TestCycleLine(t *testing.T) {
	c := &cycleLog{}
	for _, l := range []string{
		"time=2026-11-26T20:50:51.186Z level=DEBUG msg=cycle service=scheduler epoch=1 placed=16 waiting=0 took=51.296519ms\n",
		"time=2026-11-26T20:50:51.231Z level=DEBUG msg=cycle service=scheduler epoch=1 placed=0 waiting=120 took=2.5ms\n",
		"time=2026-11-26T20:50:51.231Z level=DEBUG msg=\"plan published\" service=scheduler plan=p1 items=3\n",
		"time=2026-11-26T20:50:51.231Z level=DEBUG msg=cycle service=scheduler placed=1 waiting=100 took=1s\n",
	} {
		c.line(l)
	}
	s := c.summary()
	if s.n != 3 || s.maxWaiting != 120 || s.max != time.Second || s.p50 != 51300*time.Microsecond {
		t.Fatalf("summary %+v; want 3 cycles, most waiting 120, max 1s, p50 51.3ms", s)
	}
	// Cycles that left at least 90% of the most waiting: 120 only
	// (100 is 83%).
	if s.bigN != 1 || s.bigMax != 2500*time.Microsecond {
		t.Fatalf("at the largest queue: %d cycles, max %s; want 1, 2.5ms", s.bigN, s.bigMax)
	}
}

func TestSplitFleet(t *testing.T) {
	for _, tc := range []struct {
		n, k int
		want []int
	}{
		{10, 3, []int{4, 3, 3}},
		{1000, 1, []int{1000}},
		{2, 5, []int{1, 1}},
		{10000, 4, []int{2500, 2500, 2500, 2500}},
	} {
		got := splitFleet(tc.n, tc.k)
		sum := 0
		for _, v := range got {
			sum += v
		}
		if len(got) != len(tc.want) || sum != tc.n {
			t.Fatalf("splitFleet(%d, %d) = %v; want %v", tc.n, tc.k, got, tc.want)
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Fatalf("splitFleet(%d, %d) = %v; want %v", tc.n, tc.k, got, tc.want)
			}
		}
	}
}

// TestCompression: the factor found makes the GPUs busy at the end of
// the submissions the load asked for, and is capped at the trace's own
// durations when no factor can.
func TestCompression(t *testing.T) {
	gpus := []int{1, 1, 2, 8}
	secs := []float64{100, 1000, 10000, 100000}
	for _, tc := range []struct {
		name     string
		cfg      scaleConfig
		wantLoad float64
		capped   bool
	}{
		{"fills", scaleConfig{machines: 10, jobs: 1000, rate: 10, load: 1.5}, 1.5, false},
		{"too large a fleet", scaleConfig{machines: 100000, jobs: 1000, rate: 10, load: 1.5}, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, load := compression(tc.cfg, gpus, secs)
			if tc.capped {
				if c != 1 || load >= tc.cfg.load {
					t.Fatalf("compression = %v, load %v; want 1 and a load below %v", c, load, tc.cfg.load)
				}
				return
			}
			if math.Abs(load-tc.wantLoad) > 1e-6 || c <= 0 || c > 1 {
				t.Fatalf("compression = %v, load %v; want a factor in (0, 1] giving load %v", c, load, tc.wantLoad)
			}
		})
	}
}
