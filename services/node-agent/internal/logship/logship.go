// Package logship ships a run's log file to the bus: contracts.LogChunk
// messages on SubjectLogs(tenant, job, node), each at most MaxLogChunk bytes of
// output, the last one marked EOF with the exit code.
//
// The run writes its file directly and never waits for the bus: shipping
// only lags. Every chunk's Nats-Msg-Id is LogChunkID(allocation, offset),
// and what was shipped is kept beside the log (<log>.shipped): before a
// chunk is published its extent is recorded there, so a shipper restarted
// after a crash publishes exactly the same bytes at the same offset again
// (JetStream drops the duplicate within its window, and a reader that keys
// chunks by allocation and offset drops it after) and never two different
// chunks at one offset; after the crash it resumes where shipping stopped.
package logship

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// Publisher publishes one message; *bus.Bus is one.
type Publisher interface {
	Publish(ctx context.Context, subject, id string, v any, opts ...bus.PublishOption) (*jetstream.PubAck, error)
}

// Run names the run whose log is shipped.
type Run struct {
	AllocationID string
	Tenant       string
	JobID        string
	Attempt      int
	NodeID       string
}

// maxEncoded bounds the JSON of one chunk's data, so that a chunk of
// control characters (6 bytes each once escaped) still fits
// contracts.MaxMessageBytes with its envelope.
const maxEncoded = contracts.MaxMessageBytes - 1024

// mark is what <log>.shipped holds.
type mark struct {
	// Offset is how much of the log was shipped.
	Offset int64 `json:"offset"`
	// Pending is the length of the chunk at Offset being published, and
	// PendingEOF (with PendingExit) whether it is the last: a restarted
	// shipper publishes exactly it first.
	Pending     int64 `json:"pending,omitempty"`
	PendingEOF  bool  `json:"pendingEof,omitempty"`
	PendingExit int   `json:"pendingExit,omitempty"`
	// EOF is set once the last chunk is published.
	EOF bool `json:"eof,omitempty"`
}

// Shipper ships one run's log. Its methods are called from one goroutine.
type Shipper struct {
	pub      Publisher
	run      Run
	path     string
	markPath string // "" for a volatile shipper
	src      Source // where a volatile shipper reads, nil: the file at path
	now      func() time.Time
	mark     mark
}

// bufs holds the chunk buffers of shippers, taken for one ship only: a
// buffer per shipper, kept for its run's life, was 32 KiB for each run
// of a machine (80,000 runs are 2.5 GiB in a fleet of 10,000 simulated
// machines).
var bufs = sync.Pool{New: func() any { b := make([]byte, contracts.MaxLogChunk); return &b }}

// New returns a shipper of the log at path, resuming from what an earlier
// shipper of the same log recorded. now is the clock of the chunks' Time.
func New(pub Publisher, run Run, path string, now func() time.Time) (*Shipper, error) {
	s := &Shipper{pub: pub, run: run, path: path, markPath: markPath(path), now: now}
	b, err := os.ReadFile(s.markPath)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return nil, fmt.Errorf("read shipped offset: %w", err)
	default:
		if err := json.Unmarshal(b, &s.mark); err != nil {
			return nil, fmt.Errorf("read shipped offset %s: %w", s.markPath, err)
		}
	}
	return s, nil
}

// NewVolatile returns a shipper of the log at path that keeps what it
// shipped in memory only, for a log no shipper ever resumes: a simulated
// run's, which ends with its agent (the next agent reports it lost and
// ships nothing of it). It writes no <log>.shipped, twice per chunk, and
// reads none: that file work was most of what a simulated run cost its
// agent (issue 17).
func NewVolatile(pub Publisher, run Run, path string, now func() time.Time) *Shipper {
	return &Shipper{pub: pub, run: run, path: path, now: now}
}

// Source is a log held somewhere else than a file: a simulated run keeps
// its few lines in memory and writes its file only when it ends.
type Source interface {
	io.ReaderAt
	// Size is how many bytes the log holds now.
	Size() int64
}

// NewVolatileSource is NewVolatile for a log read from src instead of a
// file: no stat, no open, no read of the disk at any flush.
func NewVolatileSource(pub Publisher, run Run, src Source, now func() time.Time) *Shipper {
	return &Shipper{pub: pub, run: run, src: src, now: now}
}

// Reset forgets what was shipped of the log at path: for a log that was
// started afresh (a new launch truncates it), where an old record would
// make a shipper skip output.
func Reset(path string) error {
	if err := os.Remove(markPath(path)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("reset shipped offset: %w", err)
	}
	return nil
}

func markPath(logPath string) string { return logPath + ".shipped" }

// Shipped is how many bytes of the log were shipped.
func (s *Shipper) Shipped() int64 { return s.mark.Offset }

// Done reports whether the last chunk was shipped.
func (s *Shipper) Done() bool { return s.mark.EOF }

// Flush ships what the log holds now, except a trailing incomplete UTF-8
// sequence (the rest of it may be on its way).
func (s *Shipper) Flush(ctx context.Context) error { return s.ship(ctx, false, 0) }

// Finish ships the rest of the log of a run that ended, the last chunk
// marked EOF with exitCode. It does nothing once done.
func (s *Shipper) Finish(ctx context.Context, exitCode int) error { return s.ship(ctx, true, exitCode) }

func (s *Shipper) ship(ctx context.Context, final bool, exitCode int) error {
	if s.mark.EOF {
		return nil
	}
	if !final && s.mark.Pending == 0 && !s.mark.PendingEOF {
		if s.src != nil {
			if s.src.Size() <= s.mark.Offset {
				return nil
			}
		} else {
			// A run that wrote nothing since the last flush (most ticks
			// of most runs) costs one stat: no open, no read, no buffer.
			fi, err := os.Stat(s.path)
			if errors.Is(err, fs.ErrNotExist) || (err == nil && fi.Size() <= s.mark.Offset) {
				return nil
			}
		}
	}
	var f io.ReaderAt
	if s.src != nil {
		f = s.src
	} else {
		file, err := os.Open(s.path)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("open log: %w", err)
		}
		if file != nil {
			defer file.Close()
			f = file
		}
	}
	bp := bufs.Get().(*[]byte)
	defer bufs.Put(bp)
	buf := *bp
	if s.mark.Pending > 0 || s.mark.PendingEOF {
		// A crash came while this chunk was being published.
		if s.mark.Pending > int64(len(buf)) {
			return fmt.Errorf("%s: chunk in flight of %d bytes, more than a chunk holds", s.markPath, s.mark.Pending)
		}
		data, err := readAt(f, buf[:s.mark.Pending], s.mark.Offset)
		if err != nil || int64(len(data)) != s.mark.Pending {
			return fmt.Errorf("read the chunk in flight at %d: %w", s.mark.Offset, errors.Join(err, io.ErrUnexpectedEOF))
		}
		if err := s.publish(ctx, data, s.mark.PendingEOF, s.mark.PendingExit); err != nil {
			return err
		}
	}
	shipped := false
	for !s.mark.EOF {
		data, err := readAt(f, buf, s.mark.Offset)
		if err != nil {
			return fmt.Errorf("read log: %w", err)
		}
		atEnd := len(data) < len(buf) // the end of the file, as of now
		n := Cut(data, final && atEnd)
		eof := final && atEnd && n == len(data)
		if n == 0 && !eof {
			break
		}
		s.mark.Pending, s.mark.PendingEOF, s.mark.PendingExit = int64(n), eof, exitCode
		if !eof {
			s.mark.PendingExit = 0
		}
		if err := s.save(); err != nil {
			return err
		}
		if err := s.publish(ctx, data[:n], eof, exitCode); err != nil {
			return err
		}
		shipped = true
	}
	if shipped {
		return s.save()
	}
	return nil
}

// publish publishes the chunk at the mark's offset and moves past it; the
// mark is saved by the caller.
func (s *Shipper) publish(ctx context.Context, data []byte, eof bool, exitCode int) error {
	c := contracts.LogChunk{SchemaVersion: contracts.SchemaVersion, AllocationID: s.run.AllocationID, Tenant: s.run.Tenant,
		JobID: s.run.JobID, Attempt: s.run.Attempt, NodeID: s.run.NodeID, Offset: s.mark.Offset,
		Data: strings.ToValidUTF8(string(data), "\uFFFD"), EOF: eof, Time: s.now()}
	if eof {
		c.ExitCode = exitCode
	}
	if _, err := s.pub.Publish(ctx, contracts.SubjectLogs(s.run.Tenant, s.run.JobID, s.run.NodeID),
		contracts.LogChunkID(s.run.AllocationID, c.Offset, eof), c, bus.CESubject(s.run.AllocationID)); err != nil {
		return fmt.Errorf("publish log chunk at %d: %w", c.Offset, err)
	}
	s.mark = mark{Offset: s.mark.Offset + int64(len(data)), EOF: eof}
	return nil
}

func (s *Shipper) save() error {
	if s.markPath == "" {
		return nil // volatile (NewVolatile)
	}
	b, err := json.Marshal(s.mark)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(s.markPath), "."+filepath.Base(s.markPath)+".*")
	if err != nil {
		return fmt.Errorf("save shipped offset: %w", err)
	}
	defer os.Remove(tmp.Name()) // a no-op once renamed
	_, err = tmp.Write(b)
	if err = errors.Join(err, tmp.Close()); err == nil {
		err = os.Rename(tmp.Name(), s.markPath)
	}
	if err != nil {
		return fmt.Errorf("save shipped offset: %w", err)
	}
	return nil
}

// readAt reads up to len(buf) bytes of f at off; a missing file (nil f)
// reads as empty.
func readAt(f io.ReaderAt, buf []byte, off int64) ([]byte, error) {
	if f == nil {
		return buf[:0], nil
	}
	n, err := f.ReadAt(buf, off)
	if errors.Is(err, io.EOF) {
		err = nil
	}
	return buf[:n], err
}

// Cut returns how many bytes of b the next chunk takes: at most
// MaxLogChunk, no more than encode into maxEncoded bytes of JSON string,
// and never the start of a UTF-8 sequence without its end unless final
// (the run ended: what it wrote is all there will be).
func Cut(b []byte, final bool) int {
	n, cost := 0, 0
	for n < len(b) {
		r, size := utf8.DecodeRune(b[n:])
		var c int
		switch {
		case r == utf8.RuneError && size <= 1:
			if !final && !utf8.FullRune(b[n:]) {
				return n // the rest of this character has not been read yet
			}
			size, c = 1, len("\uFFFD")
		case r == '\n' || r == '\r' || r == '\t' || r == '"' || r == '\\':
			c = 2
		case r < 0x20 || r == '\u2028' || r == '\u2029':
			c = 6 // \u00XX
		default:
			c = size
		}
		if n+size > contracts.MaxLogChunk || cost+c > maxEncoded {
			return n
		}
		n, cost = n+size, cost+c
	}
	return n
}
