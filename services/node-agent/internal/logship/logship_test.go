package logship

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// connect starts a server for t and returns the operator's bus, which
// provisions the streams and reads the output back, and the bus of the
// run's node agent, which ships it with the node's own permissions.
func connect(t testing.TB) (op, node *bus.Bus) {
	t.Helper()
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	op, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "logship-test", CredsFile: natstest.Operator(t, srv),
		Streams: contracts.StreamOptions{Memory: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = op.Close(context.Background()) })
	node, err = bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "node-agent-" + run.NodeID,
		CredsFile: natstest.Node(t, srv, run.NodeID)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = node.Close(context.Background()) })
	return op, node
}

var run = Run{AllocationID: "acme/job-1/1", Tenant: "acme", JobID: "job-1", Attempt: 1, NodeID: "n1"}

// chunks reads back every chunk of the job's subject.
func chunks(t testing.TB, b *bus.Bus) []contracts.LogChunk {
	t.Helper()
	var out []contracts.LogChunk
	_, err := b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamLogs,
		FilterSubjects: []string{contracts.SubjectJobLogs(run.Tenant, run.JobID)}}, func(_ context.Context, m *bus.Msg) error {
		if len(m.Data) > contracts.MaxMessageBytes {
			t.Errorf("chunk of %d bytes, more than a message may hold", len(m.Data))
		}
		var c contracts.LogChunk
		if err := m.Decode(&c); err != nil {
			return err
		}
		if id := m.ID(); id != contracts.LogChunkID(c.AllocationID, c.Offset, c.EOF) {
			t.Errorf("chunk at %d has message ID %q", c.Offset, id)
		}
		out = append(out, c)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// joined checks that chunks follow each other without gap or overlap,
// each at most MaxLogChunk bytes, only the last one EOF, and returns their
// data; valid output keeps its length, so offsets add up.
func joined(t testing.TB, cs []contracts.LogChunk) string {
	t.Helper()
	var sb strings.Builder
	for i, c := range cs {
		if c.Offset != int64(sb.Len()) {
			t.Fatalf("chunk %d at offset %d, after %d bytes", i, c.Offset, sb.Len())
		}
		if len(c.Data) > contracts.MaxLogChunk || !utf8.ValidString(c.Data) {
			t.Fatalf("chunk %d: %d bytes, valid UTF-8 %v", i, len(c.Data), utf8.ValidString(c.Data))
		}
		if c.EOF != (i == len(cs)-1) {
			t.Fatalf("chunk %d of %d has EOF %v", i, len(cs), c.EOF)
		}
		if c.AllocationID != run.AllocationID || c.NodeID != run.NodeID || c.Attempt != 1 || c.Time.IsZero() {
			t.Fatalf("chunk %d: %+v", i, c)
		}
		sb.WriteString(c.Data)
	}
	return sb.String()
}

func appendFile(t testing.TB, path string, data []byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(data); err != nil {
		t.Fatal(err)
	}
}

func TestCut(t *testing.T) {
	euro := "€" // 3 bytes
	for name, c := range map[string]struct {
		b     string
		final bool
		want  int
	}{
		"empty":                                {"", false, 0},
		"ascii":                                {"hello\n", false, 6},
		"at most a chunk":                      {strings.Repeat("a", contracts.MaxLogChunk+5), false, contracts.MaxLogChunk},
		"a character is not split at the size": {strings.Repeat("a", contracts.MaxLogChunk-1) + euro, false, contracts.MaxLogChunk - 1},
		"an incomplete character waits":        {"ab" + euro[:2], false, 2},
		"the end of a run ships it":            {"ab" + euro[:2], true, 4},
		"invalid bytes do not wait":            {"a\xffb", false, 3},
		"control characters fit once escaped":  {strings.Repeat("\x00", contracts.MaxLogChunk), false, maxEncoded / 6},
		"newlines fit once escaped":            {strings.Repeat("\n", contracts.MaxLogChunk), false, maxEncoded / 2},
	} {
		if got := Cut([]byte(c.b), c.final); got != c.want {
			t.Errorf("%s: %d, want %d", name, got, c.want)
		}
	}
}

func TestShipsTheLogInOrderAndEndsWithEOF(t *testing.T) {
	b, nb := connect(t)
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "run.log")
	s, err := New(nb, run, path, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Flush(ctx); err != nil { // no log yet: nothing
		t.Fatal(err)
	}
	var want bytes.Buffer
	write := func(p []byte) { appendFile(t, path, p); want.Write(p) }
	write([]byte("first line\n"))
	write([]byte("a character cut in two by the writer: " + "€"[:1]))
	if err := s.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	write([]byte("€"[1:] + "\n"))
	write(bytes.Repeat([]byte("0123456789abcdef"), 5000)) // 80 kB: three chunks
	if err := s.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Flush(ctx); err != nil { // nothing new: nothing sent
		t.Fatal(err)
	}
	write([]byte("last words"))
	if err := s.Finish(ctx, 3); err != nil {
		t.Fatal(err)
	}
	if err := s.Finish(ctx, 3); err != nil || !s.Done() || s.Shipped() != int64(want.Len()) {
		t.Fatalf("finish again: %v, done %v, shipped %d of %d", err, s.Done(), s.Shipped(), want.Len())
	}
	cs := chunks(t, b)
	if got := joined(t, cs); got != want.String() {
		t.Fatalf("shipped %d bytes that differ from the %d of the log", len(got), want.Len())
	}
	if last := cs[len(cs)-1]; last.ExitCode != 3 || last.Data != "last words" {
		t.Fatalf("last chunk %+v, want the rest with EOF and exit code 3", last)
	}
}

func TestARestartedShipperResumesWithoutRepeats(t *testing.T) {
	b, nb := connect(t)
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "run.log")
	appendFile(t, path, []byte("before the crash\n"))
	s, err := New(nb, run, path, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	// The next chunk was being published when the agent died: the mark
	// says so, and the stream has it.
	appendFile(t, path, []byte("in flight\n"))
	if err := s.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	inflight := mark{Offset: int64(len("before the crash\n")), Pending: int64(len("in flight\n"))}
	raw, _ := json.Marshal(inflight)
	if err := os.WriteFile(path+".shipped", raw, 0o644); err != nil {
		t.Fatal(err)
	}
	// More output came meanwhile: the chunk in flight must not grow.
	appendFile(t, path, []byte("after\n"))

	s2, err := New(nb, run, path, time.Now)
	if err != nil || s2.Shipped() != inflight.Offset {
		t.Fatalf("resumed at %d: %v", s2.Shipped(), err)
	}
	if err := s2.Finish(ctx, 0); err != nil {
		t.Fatal(err)
	}
	cs := chunks(t, b)
	if got := joined(t, cs); got != "before the crash\nin flight\nafter\n" || len(cs) != 3 {
		t.Fatalf("%d chunks %q; want each part once", len(cs), got)
	}
}

func TestInvalidUTF8AndBinaryOutput(t *testing.T) {
	b, nb := connect(t)
	path := filepath.Join(t.TempDir(), "run.log")
	binary := bytes.Repeat([]byte{0, 1, 2}, 40000) // valid UTF-8, 6 bytes each in JSON
	invalid := "bad \xff\xfe bytes\n"
	appendFile(t, path, append(binary, invalid...))
	s, err := New(nb, run, path, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Finish(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	cs := chunks(t, b) // each checked to fit a message
	last := cs[len(cs)-1]
	if !last.EOF || !strings.HasSuffix(last.Data, "bad \uFFFD bytes\n") ||
		last.Offset+int64(len(last.Data)-len("\uFFFD")+len("\xff\xfe")) != int64(len(binary)+len(invalid)) {
		t.Fatalf("last chunk at %d: %q, want the invalid bytes replaced, ending the log", last.Offset, last.Data)
	}
	if got := joined(t, cs); got != string(binary)+"bad \uFFFD bytes\n" {
		t.Fatal("binary output changed on its way")
	}
}

var attempts int

// BenchmarkShip10MB ships a 10 MB log: the rate at which a run's output
// reaches the bus (the run itself never waits for it).
func BenchmarkShip10MB(b *testing.B) {
	_, bs := connect(b)
	dir := b.TempDir()
	data := bytes.Repeat([]byte("the quick brown fox jumps over the lazy dog 0123456789\n"), 10<<20/55)
	path := filepath.Join(dir, "run.log")
	appendFile(b, path, data)
	b.SetBytes(int64(len(data)))
	b.ResetTimer()
	for range b.N {
		// A new attempt each time: the same IDs would be dropped as duplicates.
		attempts++
		r := run
		r.Attempt = attempts
		r.AllocationID = contracts.AllocationID(run.Tenant, run.JobID, attempts)
		s, err := New(bs, r, path, time.Now)
		if err != nil {
			b.Fatal(err)
		}
		_ = os.Remove(path + ".shipped")
		if err := s.Finish(context.Background(), 0); err != nil {
			b.Fatal(err)
		}
	}
}
