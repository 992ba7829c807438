package gateway

import (
	"io"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

func chunk(off int64, data string) contracts.LogChunk {
	return contracts.LogChunk{Tenant: "acme", JobID: "j", Attempt: 1, Offset: off, Data: data}
}

func eof(off int64, data string, code int) contracts.LogChunk {
	c := chunk(off, data)
	c.EOF, c.ExitCode = true, code
	return c
}

// TestRunLogReassembles feeds chunks in the orders a shipper can produce
// (repeats, re-cut boundaries, late arrivals, replaced bytes) and checks
// the exact output.
func TestRunLogReassembles(t *testing.T) {
	const bad = "\uFFFD" // what the agent writes for one invalid byte
	tests := map[string]struct {
		chunks []contracts.LogChunk
		force  bool // drain with force after the last chunk
		want   string
		gaps   string
		eof    bool
	}{
		"in order":             {chunks: []contracts.LogChunk{chunk(0, "hello "), chunk(6, "world\n"), eof(12, "", 0)}, want: "hello world\n", eof: true},
		"reversed":             {chunks: []contracts.LogChunk{eof(12, "", 0), chunk(6, "world\n"), chunk(0, "hello ")}, want: "hello world\n", eof: true},
		"every chunk twice":    {chunks: []contracts.LogChunk{chunk(0, "ab"), chunk(0, "ab"), chunk(2, "cd"), chunk(0, "ab"), chunk(2, "cd"), eof(4, "", 0), eof(4, "", 0)}, want: "abcd", eof: true},
		"re-cut longer":        {chunks: []contracts.LogChunk{chunk(0, "ab"), chunk(0, "abcdef"), chunk(6, "g")}, want: "abcdefg"},
		"re-cut overlapping":   {chunks: []contracts.LogChunk{chunk(0, "abcd"), chunk(2, "cdef"), chunk(6, "gh")}, want: "abcdefgh"},
		"longer first":         {chunks: []contracts.LogChunk{chunk(2, "cdef"), chunk(2, "cd"), chunk(0, "ab")}, want: "abcdef"},
		"waits for a gap":      {chunks: []contracts.LogChunk{chunk(0, "ab"), chunk(4, "ef")}, want: "ab"},
		"gap given up":         {chunks: []contracts.LogChunk{chunk(0, "ab"), chunk(4, "ef"), eof(6, "", 1)}, force: true, want: "abef", gaps: "2-4", eof: true},
		"missing start":        {chunks: []contracts.LogChunk{chunk(3, "def")}, force: true, want: "def", gaps: "0-3"},
		"eof with data":        {chunks: []contracts.LogChunk{chunk(0, "ab"), eof(2, "cd", 7)}, want: "abcd", eof: true},
		"after eof ignored":    {chunks: []contracts.LogChunk{eof(0, "ab", 0), chunk(2, "zz")}, want: "ab", eof: true},
		"replaced byte":        {chunks: []contracts.LogChunk{chunk(0, "a"+bad+"b"), chunk(3, "cd")}, want: "a" + bad + "bcd"},
		"replaced, repeated":   {chunks: []contracts.LogChunk{chunk(0, "a"+bad+"b"), chunk(3, "cd"), chunk(0, "a"+bad+"b"), chunk(3, "cd")}, want: "a" + bad + "bcd"},
		"real U+FFFD in data":  {chunks: []contracts.LogChunk{chunk(0, bad), chunk(3, "x")}, want: bad + "x"},
		"a run replaced":       {chunks: []contracts.LogChunk{chunk(0, "a"+bad+"b"), chunk(7, "cd"), eof(9, "", 0)}, want: "a" + bad + "bcd", eof: true},
		"replaced at the end":  {chunks: []contracts.LogChunk{chunk(0, "ab"), chunk(2, bad), eof(6, "", 0)}, want: "ab" + bad, eof: true},
		"exact after replaced": {chunks: []contracts.LogChunk{chunk(0, bad), chunk(4, "xy"), chunk(8, "z")}, force: true, want: bad + "xyz", gaps: "6-8"},
		"empty output":         {chunks: []contracts.LogChunk{eof(0, "", 0)}, want: "", eof: true},
		"overlap with replace": {chunks: []contracts.LogChunk{chunk(0, "abc"), chunk(1, bad+"cd")}, want: "abc" + bad + "cd"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			l := newRunLog()
			var out strings.Builder
			for _, c := range tt.chunks {
				l.add(c)
				if err := l.drain(&out, false); err != nil {
					t.Fatal(err)
				}
			}
			if tt.force {
				if err := l.drain(&out, true); err != nil {
					t.Fatal(err)
				}
			}
			if diff := cmp.Diff(tt.want, out.String()); diff != "" {
				t.Errorf("output (-want +got):\n%s", diff)
			}
			if got := l.gapText(); got != tt.gaps {
				t.Errorf("gaps %q, want %q", got, tt.gaps)
			}
			if l.eof != tt.eof {
				t.Errorf("eof %v, want %v", l.eof, tt.eof)
			}
		})
	}
}

func TestRunLogGivesUpOnAGapPastTheBound(t *testing.T) {
	l := newRunLog()
	var out strings.Builder
	big := strings.Repeat("x", maxPendingBytes/4)
	l.add(chunk(0, "ab"))
	for i := range 5 {
		l.add(chunk(int64(10+i*len(big)), big))
		if err := l.drain(&out, false); err != nil {
			t.Fatal(err)
		}
	}
	if l.pendingBytes > maxPendingBytes {
		t.Fatalf("%d bytes held back, bound is %d", l.pendingBytes, maxPendingBytes)
	}
	if l.gapText() != "2-10" || !strings.HasPrefix(out.String(), "ab"+big) {
		t.Fatalf("gaps %q, output starts %q; want the gap 2-10 given up and the rest written", l.gapText(), out.String()[:4])
	}
}

func TestRunLogExitCode(t *testing.T) {
	l := newRunLog()
	l.add(chunk(0, "x"))
	l.add(eof(1, "", 42))
	if err := l.drain(&strings.Builder{}, false); err != nil {
		t.Fatal(err)
	}
	if !l.eof || l.exitCode != 42 {
		t.Fatalf("eof %v exit %d, want true 42", l.eof, l.exitCode)
	}
}

// BenchmarkRunLog reassembles a run's output of full chunks, each one
// delivered twice (a shipper restarted after every chunk, the worst case).
func BenchmarkRunLog(b *testing.B) {
	data := strings.Repeat("step 1234: loss 0.123456\n", contracts.MaxLogChunk/25)
	b.SetBytes(int64(len(data)))
	l := newRunLog()
	var off int64
	for b.Loop() {
		c := chunk(off, data)
		l.add(c)
		l.add(c)
		if err := l.drain(io.Discard, false); err != nil {
			b.Fatal(err)
		}
		off += int64(len(data))
	}
	if l.end != off || len(l.pending) != 0 {
		b.Fatalf("wrote up to %d of %d, %d chunks pending", l.end, off, len(l.pending))
	}
}
