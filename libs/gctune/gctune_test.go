package gctune

import (
	"math"
	"os"
	"runtime/debug"
	"testing"
)

// gcSettings reads the collector's target and soft memory limit without
// changing them.
func gcSettings() (percent int, limit int64) {
	percent = debug.SetGCPercent(100)
	debug.SetGCPercent(percent)
	return percent, debug.SetMemoryLimit(-1)
}

// TestTune: the target and the limit are set only where the
// environment leaves them to the program, and restore puts back what
// was there. Not parallel: both settings are the process's.
func TestTune(t *testing.T) {
	before, beforeLimit := gcSettings()
	for _, c := range []struct {
		name             string
		env              map[string]string
		percent          int
		wantPercent      int // -2: as before
		wantLimitChanged bool
		wantLimitKept    bool
	}{
		{name: "defaults", percent: DefaultPercent, wantPercent: DefaultPercent, wantLimitChanged: memoryAvailable() > 0},
		{name: "GOGC set", env: map[string]string{"GOGC": "150"}, percent: DefaultPercent, wantPercent: -2, wantLimitChanged: memoryAvailable() > 0},
		{name: "GOMEMLIMIT set", env: map[string]string{"GOMEMLIMIT": "1GiB"}, percent: 250, wantPercent: 250, wantLimitKept: true},
		{name: "both set", env: map[string]string{"GOGC": "off", "GOMEMLIMIT": "1GiB"}, percent: DefaultPercent, wantPercent: -2, wantLimitKept: true},
		{name: "no percent", percent: 0, wantPercent: -2, wantLimitChanged: memoryAvailable() > 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, k := range []string{"GOGC", "GOMEMLIMIT"} {
				v, ok := c.env[k]
				if !ok {
					// t.Setenv records the old value for the test's end;
					// then the variable is removed for this case.
					t.Setenv(k, "")
					os.Unsetenv(k)
					continue
				}
				t.Setenv(k, v)
			}
			restore := Tune(c.percent)
			percent, limit := gcSettings()
			want := c.wantPercent
			if want == -2 {
				want = before
			}
			if percent != want {
				t.Errorf("GC percent %d, want %d", percent, want)
			}
			switch {
			case c.wantLimitChanged && limit != int64(float64(memoryAvailable())*gcMemoryShare):
				t.Errorf("memory limit %d, want %.0f", limit, float64(memoryAvailable())*gcMemoryShare)
			case c.wantLimitKept && limit != beforeLimit:
				t.Errorf("memory limit %d, want it unchanged (%d)", limit, beforeLimit)
			}
			restore()
			if p, l := gcSettings(); p != before || l != beforeLimit {
				t.Errorf("after restore: percent %d, limit %d; want %d, %d", p, l, before, beforeLimit)
			}
		})
	}
}

func TestMemoryReadings(t *testing.T) {
	for _, c := range []struct {
		in   string
		want uint64
	}{
		{"   131072 kB", 131072 * 1024},
		{"131072 kB", 131072 * 1024},
		{"131072", 0},
		{"131072 MB", 0},
		{"x kB", 0},
		{"", 0},
		{"18446744073709551615 kB", 0},
	} {
		if got := parseMemInfoKB(c.in); got != c.want {
			t.Errorf("parseMemInfoKB(%q) = %d, want %d", c.in, got, c.want)
		}
	}
	for _, c := range []struct {
		in   string
		want uint64
	}{
		{"max\n", 0},
		{"8589934592\n", 8589934592},
		{"", 0},
		{"-1", 0},
	} {
		if got := parseCgroupMax([]byte(c.in)); got != c.want {
			t.Errorf("parseCgroupMax(%q) = %d, want %d", c.in, got, c.want)
		}
	}
	if got := memoryAvailable(); got > 0 && got > math.MaxInt64 {
		t.Errorf("memoryAvailable %d does not fit a memory limit", got)
	}
}
