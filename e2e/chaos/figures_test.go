package chaos

import (
	"testing"
	"time"
)

// TestFigures checks the arithmetic the report rests on: percentiles,
// the first output after a fault, and the longest gap between outputs.
func TestFigures(t *testing.T) {
	t0 := time.Date(2026, 11, 26, 10, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }

	pct := []struct {
		name          string
		in            []time.Duration
		p50, p99, max time.Duration
	}{
		{"empty", nil, 0, 0, 0},
		{"one", []time.Duration{ms(7)}, ms(7), ms(7), ms(7)},
		{"hundred", func() []time.Duration {
			var d []time.Duration
			for i := 100; i >= 1; i-- {
				d = append(d, ms(i))
			}
			return d
		}(), ms(50), ms(99), ms(100)},
	}
	for _, c := range pct {
		if p50, p99, mx := percentiles(c.in); p50 != c.p50 || p99 != c.p99 || mx != c.max {
			t.Errorf("percentiles %s: %s %s %s, want %s %s %s", c.name, p50, p99, mx, c.p50, c.p99, c.max)
		}
	}

	outs := []time.Time{at(900), at(100), at(500)}
	first := []struct {
		from time.Time
		want time.Time
		ok   bool
	}{
		{at(0), at(100), true},
		{at(100), at(100), true},
		{at(101), at(500), true},
		{at(901), time.Time{}, false},
	}
	for _, c := range first {
		if got, ok := firstAfter(outs, c.from); ok != c.ok || !got.Equal(c.want) {
			t.Errorf("firstAfter(%s): %s %v, want %s %v", c.from.Sub(t0), got.Sub(t0), ok, c.want.Sub(t0), c.ok)
		}
	}

	gaps := []struct {
		name     string
		from, to time.Time
		want     time.Duration
	}{
		{"from the fault to the first output", at(0), at(600), ms(400)},
		{"between outputs", at(200), at(1000), ms(400)},
		{"to the window's end", at(950), at(2000), ms(1050)},
		{"nothing in the window", at(1000), at(1300), ms(300)},
	}
	for _, c := range gaps {
		if got := longestGap(outs, c.from, c.to); got != c.want {
			t.Errorf("longestGap %s: %s, want %s", c.name, got, c.want)
		}
	}
}
