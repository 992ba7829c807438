package logship

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// memLog is a Source in memory, as a simulated run keeps its output.
type memLog struct {
	mu  sync.Mutex
	out []byte
}

func (m *memLog) ReadAt(b []byte, off int64) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if off >= int64(len(m.out)) {
		return 0, io.EOF
	}
	n := copy(b, m.out[off:])
	if n < len(b) {
		return n, io.EOF
	}
	return n, nil
}

func (m *memLog) Size() int64 { m.mu.Lock(); defer m.mu.Unlock(); return int64(len(m.out)) }

// TestAVolatileShipperKeepsNoRecord: a volatile shipper (a simulated
// run's) ships the log as New's does, chunk for chunk, and writes nothing
// beside it; flushes with nothing new publish nothing. Its log is a file
// (NewVolatile) or a Source in memory (NewVolatileSource), which touches
// no file at all.
func TestAVolatileShipperKeepsNoRecord(t *testing.T) {
	for _, tc := range []struct {
		name   string
		memory bool
	}{{"file", false}, {"memory", true}} {
		t.Run(tc.name, func(t *testing.T) {
			b, nb := connect(t)
			ctx := context.Background()
			dir := t.TempDir()
			path := filepath.Join(dir, "run.log")
			mem := &memLog{}
			s := NewVolatile(nb, run, path, time.Now)
			if tc.memory {
				s = NewVolatileSource(nb, run, mem, time.Now)
			}
			want := ""
			write := func(p string) {
				if tc.memory {
					mem.mu.Lock()
					mem.out = append(mem.out, p...)
					mem.mu.Unlock()
				} else {
					appendFile(t, path, []byte(p))
				}
				want += p
			}
			steps := []struct {
				write  string
				chunks int // in the stream after the step's flush
			}{
				{"", 0},                          // no log yet
				{"simulated run of 1h\n", 1},     // its first line
				{"", 1},                          // nothing new: nothing sent
				{"checkpoint ckpt-1 at 1s\n", 2}, // a later line
				{"", 2},
			}
			for i, st := range steps {
				if st.write != "" {
					write(st.write)
				}
				if err := s.Flush(ctx); err != nil {
					t.Fatal(err)
				}
				if n := len(chunks(t, b)); n != st.chunks {
					t.Fatalf("step %d: %d chunks shipped, want %d", i, n, st.chunks)
				}
			}
			if err := s.Finish(ctx, 0); err != nil || !s.Done() {
				t.Fatalf("finish: %v, done %v", err, s.Done())
			}
			cs := chunks(t, b)
			if got := joined(t, cs); got != want || len(cs) != 3 || cs[2].Data != "" {
				t.Fatalf("shipped %q in %d chunks, want %q and an empty EOF chunk", got, len(cs), want)
			}
			entries, err := os.ReadDir(dir)
			if err != nil {
				t.Fatal(err)
			}
			wantFiles := 1 // the log itself
			if tc.memory {
				wantFiles = 0
			}
			if len(entries) != wantFiles || (wantFiles == 1 && entries[0].Name() != "run.log") {
				t.Fatalf("the shipper left %v, want nothing beside the log", entries)
			}
		})
	}
}
