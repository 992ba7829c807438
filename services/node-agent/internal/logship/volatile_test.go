package logship

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestAVolatileShipperKeepsNoRecord: a volatile shipper (a simulated
// run's) ships the log as New's does, chunk for chunk, and writes nothing
// beside it; flushes with nothing new publish nothing.
func TestAVolatileShipperKeepsNoRecord(t *testing.T) {
	b, nb := connect(t)
	ctx := context.Background()
	dir := t.TempDir()
	path := filepath.Join(dir, "run.log")
	s := NewVolatile(nb, run, path, time.Now)
	want := ""
	write := func(p string) { appendFile(t, path, []byte(p)); want += p }
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
	if len(entries) != 1 || entries[0].Name() != "run.log" {
		t.Fatalf("the shipper left %v beside the log, want nothing", entries)
	}
}
