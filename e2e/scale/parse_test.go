package scale

import (
	"math"
	"os"
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

func TestLogMsg(t *testing.T) {
	for _, tc := range []struct{ line, want string }{
		{`time=2026-11-26T21:03:23.539Z level=WARN msg="heartbeat feed stalled behind the stream; starting a new one" service=resource-manager epoch=1`,
			"heartbeat feed stalled behind the stream; starting a new one"},
		{`time=2026-11-26T21:03:23.539Z level=WARN msg=leader service=scheduler`, "leader"},
		{`time=2026-11-26T21:03:23.539Z level=ERROR msg="quote \" inside" x=1`, `quote " inside`},
		{"no msg at all\n", "no msg at all"},
	} {
		if got := logMsg(tc.line); got != tc.want {
			t.Errorf("logMsg(%q) = %q; want %q", tc.line, got, tc.want)
		}
	}
}

// TestRefusedAndWarnings: plan refusals are counted by reason, and a
// process's WARN and ERROR lines by message, commonest first.
func TestRefusedAndWarnings(t *testing.T) {
	c := &cycleLog{}
	for _, l := range []string{
		`time=2026-11-26T21:25:30.821Z level=INFO msg="plan item refused" service=scheduler epoch=1 tenant=scale job_id=s-0003222 node_id=scale1-0456 plan=p-214 reason=node_not_ready`,
		`time=2026-11-26T21:25:30.821Z level=INFO msg="plan item refused" service=scheduler epoch=1 tenant=scale job_id=s-0003209 node_id=scale1-0455 plan=p-214 reason=node_not_ready`,
		`time=2026-11-26T21:25:30.821Z level=INFO msg="plan item refused" service=scheduler plan=p-215 reason=devices_taken`,
	} {
		c.line(l + "\n")
	}
	if c.refused["node_not_ready"] != 2 || c.refused["devices_taken"] != 1 || len(c.took) != 0 {
		t.Fatalf("refused %v, %d cycles; want node_not_ready 2, devices_taken 1, no cycle", c.refused, len(c.took))
	}

	dir := t.TempDir()
	p := &proc{name: "resource-manager", logPath: dir + "/rm.log"}
	log := "time=1 level=WARN msg=\"feed stalled\" a=1\n" +
		"gc 3 @1.0s 1%: 0.01+0.2+0.003 ms clock, 0.02+0/0.1/0+0.006 ms cpu, 9->9->4 MB, 10 MB goal, 0 MB stacks, 0 MB globals, 2 P\n" +
		"time=2 level=WARN msg=\"feed stalled\" a=2\n" +
		"time=3 level=ERROR msg=boom\n" +
		"time=4 level=INFO msg=fine\n" +
		"time=5 level=WARN msg=\"half a li" // not yet whole: read on the next scan
	if err := os.WriteFile(p.logPath, []byte(log), 0o644); err != nil {
		t.Fatal(err)
	}
	p.scan()
	if got, want := p.warningSummary(), `3: "feed stalled" ×2, "boom" ×1`; got != want {
		t.Fatalf("warnings %q; want %q", got, want)
	}
	if p.heapMB != 4 {
		t.Fatalf("live heap %v MB; want 4", p.heapMB)
	}
	f, err := os.OpenFile(p.logPath, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString("ne\" x=1\n"); err != nil {
		t.Fatal(err)
	}
	_ = f.Close()
	p.scan()
	if got := p.warnings["half a line"]; got != 1 {
		t.Fatalf("the line finished later counted %d times; want 1 (%v)", got, p.warnings)
	}
}
