package kvsnap

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/restic/chunker"
)

// Snapshots in parts (issue 17: nothing grows with history). A whole
// snapshot rewrites every chunk at every write, and a snapshot grows with
// history: the scheduler's carries ~29 bytes per job ever retired, so at
// a million jobs each write put ~30 MB into an R3 bucket, once a minute.
// Most of it is the same bytes as the write before: records appended to,
// in the order they were added. A Store with Parts cuts the payload where
// its content says (content-defined chunking, a Rabin fingerprint over a
// sliding window: restic's chunker), so bytes that did not change are cut
// into the same parts, wherever the bytes before them moved; the head
// names each part by its key and SHA-256, and a write puts only the parts
// the head before it does not hold. What a write costs is then what
// changed since the last one.
//
// Part keys are ChunkKey(PartSlot, i): a write puts a new part under an
// index no part of the current head uses, so a reader of the current
// head never sees a part of it change; indices are reused (overwritten)
// by later writes, so the keys are at most the parts of two heads, and
// nothing is ever deleted (a KV delete leaves a marker per key for good).
// A reader of an older head may see one of its parts overwritten: the
// part's checksum says so, and Read tries the head again.
//
// A writer reuses only parts it wrote, or read whole and checked, under
// the head it wrote or read last, at the revisions it saw them at (a
// headers-only watch of the part keys before the write): a part another
// writer overwrote is put again, so no broken part is carried from head
// to head. After a head it did not write or read, a writer writes every
// part afresh once.
//
// Parts suit a writer that writes alone (the scheduler under its lease,
// the resource manager's leader). Writers that race (replicas without a
// lease) choose new parts from the same free indices and can leave a
// head that does not read: its readers replay their streams, and the
// part keys stay bounded (TestRacingWritersKeepThePartKeysBounded); the
// gateway's replicas, which take turns, write whole snapshots.

// PartSlot is the slot a Store with Parts writes its parts under
// (ChunkKey(PartSlot, i)); whole snapshots use slots 0 and 1.
const PartSlot = 2

// Part sizes: the chunker cuts where the fingerprint of the last 64
// bytes has its low partBits bits zero, at least partMin and at most
// ChunkBytes (a bucket value's limit, 60 KiB) apart: ~24 KiB on average.
const (
	partMin  = 8 << 10
	partBits = 14
)

// partPol is the chunker's polynomial. It must be the same for every
// writer, in every process and version, or equal bytes would be cut
// differently: a fixed irreducible polynomial of degree 53 (restic's
// tests' own), not a random one per repository as restic draws.
const partPol = chunker.Pol(0x3DA3358B4DC173)

// Part names one part: the index of its key (ChunkKey(PartSlot, Key)),
// its length and the SHA-256 of its bytes.
type Part struct {
	Key    int    `json:"key"`
	Bytes  int    `json:"bytes"`
	SHA256 string `json:"sha256"`
}

// The index: a head names its payload's parts through an index (a head
// is one bucket value, 64 KiB; a million jobs' scheduler snapshot is
// ~1,300 parts), itself written in parts of ChunkBytes: for each payload
// part its key and length as uvarints, then its SHA-256, ~37 bytes a part
// (0.15 % of the payload). Entries of unchanged parts are unchanged
// bytes, so most of the index's parts are reused too.

// Parts is what a writer knows of the parts it wrote: give a Store one
// (NewParts) and it writes snapshots in parts. It is safe for concurrent
// use, but a Store writes one snapshot at a time (its caller's loop).
type Parts struct {
	mu sync.Mutex
	// head is the checksum and time of the head this writer wrote last;
	// mine its parts (payload and index) by SHA-256, with the revision
	// each was put at.
	head string
	mine map[string]minePart
}

type minePart struct {
	Part
	rev uint64
}

// NewParts returns an empty Parts: the first write puts every part.
func NewParts() *Parts { return &Parts{} }

// headID names a head for Parts.head: its payload checksum and the time
// it was written (two writes of the same payload are two heads).
func headID(h Head) string { return h.SHA256 + "@" + strconv.FormatInt(h.Written.UnixNano(), 10) }

// cut splits data into content-defined parts.
func cut(data []byte) ([][]byte, error) {
	if len(data) == 0 {
		return nil, nil
	}
	c := chunker.NewWithBoundaries(bytes.NewReader(data), partPol, partMin, ChunkBytes)
	c.SetAverageBits(partBits)
	var out [][]byte
	buf := make([]byte, 0, ChunkBytes)
	for {
		ch, err := c.Next(buf)
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("cut snapshot: %w", err)
		}
		out = append(out, data[ch.Start:ch.Start+ch.Length])
	}
}

// split cuts the index in ChunkBytes pieces.
func split(data []byte) [][]byte {
	var out [][]byte
	for off := 0; off < len(data); off += ChunkBytes {
		out = append(out, data[off:min(off+ChunkBytes, len(data))])
	}
	return out
}

func encodeIndex(parts []Part) []byte {
	b := make([]byte, 0, len(parts)*(sha256.Size+5))
	for _, pt := range parts {
		b = binary.AppendUvarint(b, uint64(pt.Key))
		b = binary.AppendUvarint(b, uint64(pt.Bytes))
		sum, _ := hex.DecodeString(pt.SHA256)
		b = append(b, sum...)
	}
	return b
}

func decodeIndex(b []byte) ([]Part, error) {
	var parts []Part
	for len(b) > 0 {
		key, n := binary.Uvarint(b)
		if n <= 0 || key > math.MaxInt32 {
			return nil, errors.New("bad key")
		}
		b = b[n:]
		size, n := binary.Uvarint(b)
		if n <= 0 || size > math.MaxInt32 || len(b)-n < sha256.Size {
			return nil, errors.New("bad length")
		}
		b = b[n:]
		parts = append(parts, Part{Key: int(key), Bytes: int(size), SHA256: hex.EncodeToString(b[:sha256.Size])})
		b = b[sha256.Size:]
	}
	return parts, nil
}

// writeParts puts data's parts, and its index's, that the current head
// cur does not already hold for this writer, and returns the head naming
// them (not yet switched) and how many bytes it put.
func (s Store) writeParts(ctx context.Context, cur Head, data []byte) (Head, int, error) {
	pieces, err := cut(data)
	if err != nil {
		return Head{}, 0, err
	}
	sums := make([]string, len(pieces))
	for i, piece := range pieces {
		sum := sha256.Sum256(piece)
		sums[i] = hex.EncodeToString(sum[:])
	}
	p := s.Parts
	p.mu.Lock()
	defer p.mu.Unlock()
	own := cur.Version == partsVersion && p.head == headID(cur)
	if !own {
		clear(p.mine) // not the head this writer wrote last: trust none of its parts
	}
	taken := map[int]bool{}
	for _, mp := range p.mine { // its own head's, reused or not
		taken[mp.Key] = true
	}
	reuse := slices.ContainsFunc(sums, func(id string) bool { _, ok := p.mine[id]; return ok })
	var revs map[int]uint64
	if reuse {
		var err error
		if revs, err = s.partRevisions(ctx); err != nil {
			return Head{}, 0, err
		}
	}
	// A part is reused only at the revision this writer put it at: a
	// writer that raced this one (it read an older head, chose an index
	// free there, and then lost its switch) may have overwritten it
	// under the head this one still trusts. (Nothing to reuse, nothing
	// to look at: a small snapshot of one part that changed.)
	for id, mp := range p.mine {
		if !reuse || revs[mp.Key] != mp.rev {
			delete(p.mine, id)
		}
	}
	// New parts go under indices no part of the current head uses: its
	// readers must find them as it names them. This writer's own head's
	// are p.mine's; another's are read from its index, or, unreadable,
	// every part key there is counts as taken.
	if !own {
		keys, err := s.headKeys(ctx, cur)
		switch {
		case errors.Is(err, ErrBad):
			// Unreadable: its payload parts are nobody's; its index's
			// keys stay out of the way of whoever still reads it.
			for _, pt := range cur.Index {
				taken[pt.Key] = true
			}
		case err != nil:
			return Head{}, 0, err
		}
		for _, k := range keys {
			taken[k] = true
		}
	}
	w := partWriter{s: s, old: p.mine, mine: map[string]minePart{}, taken: taken}
	parts, err := w.put(ctx, pieces, sums)
	if err != nil {
		return Head{}, w.bytes, err
	}
	index, err := w.put(ctx, split(encodeIndex(parts)), nil)
	if err != nil {
		return Head{}, w.bytes, err
	}
	p.mine = w.mine
	sum := sha256.Sum256(data)
	return Head{Version: partsVersion, Slot: PartSlot, Chunks: len(parts), Index: index, Bytes: len(data),
		SHA256: hex.EncodeToString(sum[:])}, w.bytes, nil
}

// partWriter puts the pieces of one write.
type partWriter struct {
	s     Store
	old   map[string]minePart // the writer's parts it may reuse
	mine  map[string]minePart // the parts of this write
	taken map[int]bool        // indices not to put a new part under
	next  int
	bytes int
}

// put puts pieces, whose SHA-256s are sums (nil: hashed here).
func (w *partWriter) put(ctx context.Context, pieces [][]byte, sums []string) ([]Part, error) {
	out := make([]Part, 0, len(pieces))
	for i, piece := range pieces {
		var id string
		if sums != nil {
			id = sums[i]
		} else {
			sum := sha256.Sum256(piece)
			id = hex.EncodeToString(sum[:])
		}
		mp, ok := w.mine[id]
		if !ok {
			mp, ok = w.old[id]
		}
		if !ok {
			for w.taken[w.next] {
				w.next++
			}
			w.taken[w.next] = true
			mp = minePart{Part: Part{Key: w.next, Bytes: len(piece), SHA256: id}}
			rev, err := w.s.KV.Put(ctx, w.s.ChunkKey(PartSlot, mp.Key), piece)
			if err != nil {
				return nil, fmt.Errorf("part %d: %w", mp.Key, err)
			}
			mp.rev = rev
			w.bytes += len(piece)
		}
		w.mine[id] = mp
		out = append(out, mp.Part)
	}
	return out, nil
}

// headKeys returns the part keys h uses (its index's and its payload's).
func (s Store) headKeys(ctx context.Context, h Head) ([]int, error) {
	if h.Version != partsVersion {
		return nil, nil
	}
	parts, err := s.readIndex(ctx, h, nil)
	if err != nil {
		return nil, err
	}
	keys := make([]int, 0, len(parts)+len(h.Index))
	for _, pt := range h.Index {
		keys = append(keys, pt.Key)
	}
	for _, pt := range parts {
		keys = append(keys, pt.Key)
	}
	return keys, nil
}

// wrote notes h as the head this writer wrote last.
func (p *Parts) wrote(h Head) {
	p.mu.Lock()
	p.head = headID(h)
	p.mu.Unlock()
}

// forget drops what the writer knows: its head was not switched.
func (p *Parts) forget() {
	p.mu.Lock()
	p.head, p.mine = "", nil
	p.mu.Unlock()
}

// validParts reports whether parts name values a reader can check: each
// within a value's size and with a checksum.
func validParts(parts []Part) bool {
	for _, pt := range parts {
		if pt.Key < 0 || pt.Bytes < 1 || pt.Bytes > ChunkBytes || len(pt.SHA256) != 2*sha256.Size {
			return false
		}
	}
	return true
}

// getParts reads parts, each checked against its length and checksum,
// and notes in seen (if not nil) each part with the revision read.
func (s Store) getParts(ctx context.Context, what string, parts []Part, size int, seen map[string]minePart) ([]byte, error) {
	data := make([]byte, 0, size)
	for i, pt := range parts {
		e, err := s.KV.Get(ctx, s.ChunkKey(PartSlot, pt.Key))
		if err != nil {
			return nil, fmt.Errorf("%w: %s part %d of %d (key %d): %w", ErrBad, what, i, len(parts), pt.Key, err)
		}
		v := e.Value()
		if sum := sha256.Sum256(v); len(v) != pt.Bytes || hex.EncodeToString(sum[:]) != pt.SHA256 {
			return nil, fmt.Errorf("%w: %s part %d of %d (key %d) does not match the head", ErrBad, what, i, len(parts), pt.Key)
		}
		if seen != nil {
			seen[pt.SHA256] = minePart{Part: pt, rev: e.Revision()}
		}
		data = append(data, v...)
	}
	return data, nil
}

// readIndex reads h's index: its payload's parts, checked to add up to
// the head's length and count.
func (s Store) readIndex(ctx context.Context, h Head, seen map[string]minePart) ([]Part, error) {
	size := 0
	for _, pt := range h.Index {
		size += pt.Bytes
	}
	raw, err := s.getParts(ctx, "index", h.Index, size, seen)
	if err != nil {
		return nil, err
	}
	parts, err := decodeIndex(raw)
	if err != nil {
		return nil, fmt.Errorf("%w: index: %w", ErrBad, err)
	}
	total := 0
	for _, pt := range parts {
		total += pt.Bytes
	}
	if len(parts) != h.Chunks || total != h.Bytes || !validParts(parts) {
		return nil, fmt.Errorf("%w: the index names %d parts of %d bytes, the head %d of %d", ErrBad, len(parts), total,
			h.Chunks, h.Bytes)
	}
	return parts, nil
}

// readParts reads the payload h names. With Parts, a payload read whole
// and checked is this writer's to reuse (a new term's first write then
// puts only what changed since the head it loaded, not everything): its
// parts at the revisions read, which the write checks again.
func (s Store) readParts(ctx context.Context, h Head) ([]byte, error) {
	var seen map[string]minePart
	if s.Parts != nil {
		seen = map[string]minePart{}
	}
	parts, err := s.readIndex(ctx, h, seen)
	if err != nil {
		return nil, err
	}
	data, err := s.getParts(ctx, "payload", parts, h.Bytes, seen)
	if err != nil {
		return nil, err
	}
	if s.Parts != nil {
		if _, _, err := checked(data, h); err == nil {
			s.Parts.mu.Lock()
			s.Parts.head, s.Parts.mine = headID(h), seen
			s.Parts.mu.Unlock()
		}
	}
	return data, nil
}

// wholeChunk is a whole snapshot's chunk key, at the revision listed.
type wholeChunk struct {
	key string
	rev uint64
}

// wholeKeys lists the chunk keys of whole snapshots (slots 0 and 1) in
// the bucket, whatever head named them (a whole writer never deleted the
// chunks past a smaller payload's).
func (s Store) wholeKeys(ctx context.Context) ([]wholeChunk, error) {
	var out []wholeChunk
	for slot := range 2 {
		revs, prefix, err := s.keyRevisions(ctx, slot)
		if err != nil {
			return nil, err
		}
		for i, rev := range revs {
			out = append(out, wholeChunk{prefix + strconv.Itoa(i), rev})
		}
	}
	return out, nil
}

// dropWhole deletes the chunks of whole snapshots listed, after the
// second head in parts is switched (no reader of it needs them), each
// only at the revision listed: a whole writer that wrote one since (a
// binary of before parts, in a rolling upgrade) keeps its head's.
func (s Store) dropWhole(ctx context.Context, chunks []wholeChunk) error {
	for _, c := range chunks {
		err := s.KV.Delete(ctx, c.key, jetstream.LastRevision(c.rev))
		if err != nil && !errors.Is(err, jetstream.ErrKeyExists) && !errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
			return fmt.Errorf("delete whole chunk %s: %w", c.key, err)
		}
	}
	return nil
}

// watchTimeout bounds the look at the part keys' revisions.
const watchTimeout = 30 * time.Second

// partRevisions returns the revision of every part key in the bucket, by
// index: one headers-only watch of the part keys (the key's index must be
// ChunkKey's last token, as every service's layout has it).
func (s Store) partRevisions(ctx context.Context) (map[int]uint64, error) {
	revs, _, err := s.keyRevisions(ctx, PartSlot)
	return revs, err
}

// keyRevisions returns the revision of every key of slot in the bucket,
// by index, and the keys' prefix.
func (s Store) keyRevisions(ctx context.Context, slot int) (map[int]uint64, string, error) {
	k0 := s.ChunkKey(slot, 0)
	if !strings.HasSuffix(k0, ".0") {
		return map[int]uint64{}, "", nil // no pattern: trust no part, list no chunk
	}
	prefix := strings.TrimSuffix(k0, "0")
	// A stuck watch fails this write, not the writer's term.
	ctx, cancel := context.WithTimeout(ctx, watchTimeout)
	defer cancel()
	w, err := s.KV.Watch(ctx, prefix+"*", jetstream.MetaOnly(), jetstream.IgnoreDeletes())
	if err != nil {
		return nil, "", fmt.Errorf("watch %s*: %w", prefix, err)
	}
	defer func() { _ = w.Stop() }()
	revs := map[int]uint64{}
	for {
		select {
		case <-ctx.Done():
			return nil, "", fmt.Errorf("watch %s*: %w", prefix, ctx.Err())
		case e, ok := <-w.Updates():
			if !ok {
				return nil, "", fmt.Errorf("watch %s*: closed", prefix)
			}
			if e == nil {
				return revs, prefix, nil // the initial values are all in
			}
			if i, err := strconv.Atoi(strings.TrimPrefix(e.Key(), prefix)); err == nil {
				revs[i] = e.Revision()
			}
		}
	}
}
