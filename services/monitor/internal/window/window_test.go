package window

import (
	"math"
	"testing"
	"time"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano()

func at(d time.Duration) int64 { return t0 + int64(d) }

func TestStats(t *testing.T) {
	type sample struct {
		at time.Duration
		v  float64
	}
	tests := map[string]struct {
		samples []sample
		now     time.Duration
		span    time.Duration
		want    Stats
	}{
		"empty": {now: time.Minute, span: time.Minute},
		"one bucket": {
			samples: []sample{{0, 10}, {time.Second, 30}, {2 * time.Second, 20}},
			now:     4 * time.Second, span: 5 * time.Second,
			want: Stats{Count: 3, Sum: 60, Min: 10, Max: 30, First: 10, Last: 20},
		},
		"rising one per second over buckets": {
			samples: []sample{{0, 0}, {5 * time.Second, 5}, {10 * time.Second, 10}, {15 * time.Second, 15}},
			now:     15 * time.Second, span: 20 * time.Second,
			want: Stats{Count: 4, Sum: 30, Min: 0, Max: 15, First: 0, Last: 15, Slope: 1},
		},
		"span leaves old buckets out": {
			samples: []sample{{0, 100}, {5 * time.Second, 5}, {10 * time.Second, 10}},
			now:     10 * time.Second, span: 5 * time.Second,
			want: Stats{Count: 2, Sum: 15, Min: 5, Max: 10, First: 5, Last: 10, Slope: 1},
		},
		"samples older than the ring are dropped": {
			// 4 buckets of 5s: the sample at 0 is overwritten by the one at 20s.
			samples: []sample{{0, 100}, {20 * time.Second, 1}, {0, 50}},
			now:     20 * time.Second, span: time.Hour,
			want: Stats{Count: 1, Sum: 1, Min: 1, Max: 1, First: 1, Last: 1},
		},
		"a late sample within the span joins its bucket": {
			samples: []sample{{10 * time.Second, 4}, {time.Second, 2}},
			now:     10 * time.Second, span: 20 * time.Second,
			want: Stats{Count: 2, Sum: 6, Min: 2, Max: 4, First: 2, Last: 4, Slope: 0.2},
		},
		"a sample one bucket ahead of now counts": {
			samples: []sample{{5 * time.Second, 7}},
			now:     4 * time.Second, span: 5 * time.Second,
			want: Stats{Count: 1, Sum: 7, Min: 7, Max: 7, First: 7, Last: 7},
		},
		"nothing recent": {
			samples: []sample{{0, 1}},
			now:     time.Hour, span: 10 * time.Second,
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			r := New(5*time.Second, 4)
			for _, s := range tc.samples {
				r.Add(at(s.at), s.v)
			}
			got := r.StatsSlope(at(tc.now), tc.span)
			if plain := r.Stats(at(tc.now), tc.span); plain.Slope != 0 || plain.Count != got.Count || plain.Last != got.Last {
				t.Errorf("Stats = %+v, StatsSlope = %+v", plain, got)
			}
			if math.Abs(got.Slope-tc.want.Slope) > 1e-9 {
				t.Errorf("slope = %v, want %v", got.Slope, tc.want.Slope)
			}
			if last, ok := r.Last(at(tc.now), tc.span); ok != (tc.want.Count > 0) || last != tc.want.Last {
				t.Errorf("Last = %v, %v; want %v", last, ok, tc.want.Last)
			}
			if inc, ok := r.Increase(at(tc.now), tc.span); ok != (tc.want.Count > 0) || inc != tc.want.Last-tc.want.First {
				t.Errorf("Increase = %v, %v; want %v", inc, ok, tc.want.Last-tc.want.First)
			}
			got.Slope, tc.want.Slope = 0, 0
			if got != tc.want {
				t.Errorf("Stats = %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestBuckets(t *testing.T) {
	for _, tc := range []struct {
		span, res time.Duration
		want      int
	}{{time.Minute, 5 * time.Second, 13}, {61 * time.Second, 5 * time.Second, 14}, {0, time.Second, 1}, {time.Minute, 0, 2}} {
		if got := Buckets(tc.span, tc.res); got != tc.want {
			t.Errorf("Buckets(%s, %s) = %d, want %d", tc.span, tc.res, got, tc.want)
		}
	}
}

func TestAddDoesNotAllocate(t *testing.T) {
	r := New(time.Second, 60)
	i := int64(0)
	if n := testing.AllocsPerRun(1000, func() {
		i++
		r.Add(t0+i*int64(100*time.Millisecond), float64(i))
		_ = r.StatsSlope(t0+i*int64(100*time.Millisecond), time.Minute)
	}); n != 0 {
		t.Errorf("Add+Stats allocate %v times per run", n)
	}
}
