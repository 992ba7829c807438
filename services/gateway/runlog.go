package gateway

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/gpuplane/gpuplane/contracts"
)

// maxPendingBytes bounds the output one attempt holds back waiting for a
// missing chunk; past it the missing range is given up as a gap.
const maxPendingBytes = 8 << 20

// runLog reassembles the output of one attempt from its chunks, which may
// arrive twice (a shipper republishing after a restart) or out of order.
// It writes bytes in offset order, each byte once; a chunk that starts
// past what has been written waits for the missing bytes until the caller
// forces it (drain with force), which records the missing range as a gap.
//
// Offsets count the run's raw bytes, while Data is text in which the
// agent replaced each run of invalid UTF-8 with one U+FFFD. After a chunk
// holding U+FFFD, where the written output ends is therefore unknown:
// the next chunk by offset is taken as following on (the agent's shipper
// never cuts one stretch of output two ways, so chunks tile the log), a
// chunk at or before the last one written as a repeat, and gaps cannot
// be told. After a chunk without it the end is exact again. A chunk that
// overlaps output written (a shipper that re-cut it) is trimmed where the
// bytes to trim hold no U+FFFD, and written whole otherwise: replaced
// bytes may at worst repeat, never go missing.
type runLog struct {
	// pending are the chunks not written yet, sorted by offset, one per
	// offset (the longest seen; the EOF flag of any).
	pending      []contracts.LogChunk
	pendingBytes int
	// end is where the written output ends, when exact; last is the
	// offset of the last chunk written (-1: none).
	end     int64
	inexact bool
	last    int64
	gaps    [][2]int64
	// eof: the EOF chunk has been written; the output is complete and
	// later chunks are ignored. An EOF chunk behind a gap waits like any
	// other: the missing chunks may be on their way.
	eof      bool
	exitCode int
}

func newRunLog() *runLog { return &runLog{last: -1} }

// add takes one chunk of this attempt; drain writes what it made writable.
func (l *runLog) add(c contracts.LogChunk) {
	if l.eof {
		return
	}
	i, found := slices.BinarySearchFunc(l.pending, c.Offset, func(p contracts.LogChunk, off int64) int { return cmp.Compare(p.Offset, off) })
	if !found {
		l.pending = slices.Insert(l.pending, i, c)
		l.pendingBytes += len(c.Data)
		return
	}
	p := &l.pending[i]
	if len(c.Data) > len(p.Data) {
		l.pendingBytes += len(c.Data) - len(p.Data)
		p.Data = c.Data
	}
	if c.EOF && !p.EOF {
		p.EOF, p.ExitCode = true, c.ExitCode
	}
}

// drain writes the pending chunks that follow on from what was written.
// With force (the caller knows no more chunks will come) it writes them
// all, recording the ranges never received as gaps.
func (l *runLog) drain(w io.Writer, force bool) error {
	for len(l.pending) > 0 && !l.eof {
		c := l.pending[0]
		if !l.inexact && c.Offset > l.end && !force && l.pendingBytes <= maxPendingBytes {
			return nil // wait for the bytes before it
		}
		l.pending = l.pending[1:]
		l.pendingBytes -= len(c.Data)
		data, start := c.Data, c.Offset
		switch {
		case l.inexact:
			if start <= l.last {
				data = "" // a repeat of a chunk written
			}
		case start > l.end:
			l.gaps = append(l.gaps, [2]int64{l.end, start})
		case start < l.end: // overlaps what was written
			skip := l.end - start
			switch {
			case skip >= int64(len(data)):
				data = ""
			case !strings.ContainsRune(data[:skip], utf8.RuneError):
				data, start = data[skip:], l.end
			}
			// Otherwise which bytes were written cannot be told: write
			// it whole rather than risk dropping output.
		}
		if data != "" {
			if _, err := io.WriteString(w, data); err != nil {
				return err
			}
			l.last = c.Offset
			l.inexact = strings.ContainsRune(data, utf8.RuneError)
			l.end = start + int64(len(data))
		}
		if c.EOF {
			l.eof, l.exitCode = true, c.ExitCode
			l.pending, l.pendingBytes = nil, 0
		}
	}
	return nil
}

// gapText is the gaps as "100-200, 4096-8192" (byte ranges [from, to)).
func (l *runLog) gapText() string {
	parts := make([]string, len(l.gaps))
	for i, g := range l.gaps {
		parts[i] = fmt.Sprintf("%d-%d", g[0], g[1])
	}
	return strings.Join(parts, ", ")
}
