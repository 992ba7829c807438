// Package kvsnap stores one snapshot per head key in a JetStream KV
// bucket (contracts.BucketSnapshots), business-free: the scheduler, the
// resource manager and the gateway each encode their own state and hand
// the bytes here (issue 17: a restart with a million jobs in the streams
// starts from a snapshot and reads only the streams' tail).
//
// A bucket value is at most contracts.MaxMessageBytes, so a payload is
// written in ChunkBytes chunks into one of two slots, the one the head
// does not name, and the head (slot, chunks, bytes, SHA-256 of the
// payload) is switched last: a writer that dies half-way leaves the old
// snapshot whole. A reader reads the head, then the chunks it names, and
// verifies length and checksum; anything missing, truncated or corrupt is
// ErrBad, and the caller reads its streams whole. The streams stay the
// truth: Life and Stale say whether a snapshot still fits them.
package kvsnap

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// ChunkBytes is the most payload bytes in one KV value (the bucket's
// values are at most contracts.MaxMessageBytes, headers included).
const ChunkBytes = contracts.MaxMessageBytes - 4096

var (
	// ErrNone says there is no snapshot (no head).
	ErrNone = errors.New("no snapshot")
	// ErrBad says the snapshot cannot be read whole: head unreadable, a
	// chunk missing, the payload truncated or not matching its checksum.
	ErrBad = errors.New("snapshot unreadable")
	// ErrSuperseded says another writer's snapshot covers as far or
	// further, or switched the head meanwhile (Store.CompareAndSet).
	ErrSuperseded = errors.New("snapshot superseded by another writer's")
	// ErrStale says a snapshot does not fit a stream as it is now.
	ErrStale = errors.New("snapshot does not fit the streams")
	// ErrRecreated says a stream was recreated since the writer started.
	ErrRecreated = errors.New("stream recreated during this term")
)

// Head is the value of a head key.
type Head struct {
	// Version is 0 for a whole snapshot (Slot, Chunks) and partsVersion
	// for one in parts: Index names the parts of its index, which names
	// its Chunks parts in order (parts.go); Slot is PartSlot.
	Version int    `json:"version,omitempty"`
	Slot    int    `json:"slot"`
	Chunks  int    `json:"chunks"`
	Index   []Part `json:"index,omitempty"`
	Bytes   int    `json:"bytes"`
	SHA256  string `json:"sha256"`
	// Seq is the position the payload covers, as its writer counts it
	// (0: not said); a CompareAndSet writer skips a write that would not
	// go further than the head's.
	Seq     uint64    `json:"seq,omitempty"`
	Written time.Time `json:"written"`
	// Whole names the whole snapshot the first head in parts replaced:
	// its chunks are deleted by the write after (dropWhole).
	Whole *WholeRef `json:"whole,omitempty"`
	// Put is how many payload bytes the write that returned this head
	// put into the bucket (not stored).
	Put int `json:"-"`
}

// WholeRef names a whole snapshot's chunks.
type WholeRef struct {
	Slot   int `json:"slot"`
	Chunks int `json:"chunks"`
}

// partsVersion is Head.Version of a snapshot in parts.
const partsVersion = 2

// Store names one snapshot's keys in a bucket.
type Store struct {
	KV      jetstream.KeyValue
	HeadKey string
	// ChunkKey names chunk i of slot (0 or 1).
	ChunkKey func(slot, i int) string
	// CompareAndSet is for keys several writers share (replicas without a
	// lease): the head is switched only if no one switched it since it
	// was read, and a write is skipped when the head already covers seq.
	// Two writers may still fill the same slot at once; the head's
	// checksum then refuses the mixed payload.
	CompareAndSet bool
	// Parts, when set, makes Write put the payload in content-defined
	// parts, only those the last head does not hold (parts.go); nil
	// writes it whole, every chunk every time. Read reads either.
	Parts *Parts
}

// Write encodes a payload (payload is called only when the write is not
// skipped) into the slot the head does not name, then switches the head.
// seq is the position the payload covers (see Head.Seq).
func (s Store) Write(ctx context.Context, seq uint64, payload func() ([]byte, error)) (Head, error) {
	if _, _, err := s.current(ctx, seq); err != nil {
		return Head{}, err
	}
	data, err := payload()
	if err != nil {
		return Head{}, fmt.Errorf("encode snapshot: %w", err)
	}
	// The head again, after the (long) encoding: a writer that switched
	// it meanwhile has its slot kept, not overwritten by this one's chunks.
	cur, rev, err := s.current(ctx, seq)
	if err != nil {
		return Head{}, err
	}
	var next Head
	var drop []wholeChunk
	if s.Parts != nil {
		if next, drop, err = s.partsHead(ctx, cur, data); err != nil {
			s.Parts.forget()
			return Head{}, err
		}
	} else {
		slot, chunks := 1-cur.Slot&1, 0
		if cur.Version == partsVersion {
			slot = 0 // back from parts: either slot is free
		}
		for off := 0; off < len(data) || chunks == 0; off += ChunkBytes {
			end := min(off+ChunkBytes, len(data))
			if _, err := s.KV.Put(ctx, s.ChunkKey(slot, chunks), data[off:end]); err != nil {
				return Head{}, fmt.Errorf("chunk %d: %w", chunks, err)
			}
			chunks++
		}
		sum := sha256.Sum256(data)
		next = Head{Slot: slot, Chunks: chunks, Bytes: len(data), SHA256: hex.EncodeToString(sum[:]), Put: len(data)}
	}
	next.Seq, next.Written = seq, time.Now().UTC()
	value, err := json.Marshal(next)
	if err != nil {
		return Head{}, err
	}
	switch {
	case !s.CompareAndSet:
		_, err = s.KV.Put(ctx, s.HeadKey, value)
	case rev == 0:
		_, err = s.KV.Create(ctx, s.HeadKey, value)
	default:
		_, err = s.KV.Update(ctx, s.HeadKey, value, rev)
	}
	if err != nil {
		if s.Parts != nil {
			s.Parts.forget()
		}
		if s.CompareAndSet && (errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch)) {
			return Head{}, fmt.Errorf("%w: head switched meanwhile", ErrSuperseded)
		}
		return Head{}, fmt.Errorf("head: %w", err)
	}
	if s.Parts != nil {
		s.Parts.wrote(next)
	}
	// A failure leaves them named (Whole): the next write lists them again.
	_ = s.dropWhole(ctx, drop)
	return next, nil
}

// partsHead puts data's new parts (writeParts) and returns the head to
// switch to, and the whole chunks to delete once it is switched. The
// first head in parts names the whole snapshot it replaced (Whole: its
// readers still need it); the one after lists the whole chunks left, to
// delete after its switch, and names them again until none is left.
func (s Store) partsHead(ctx context.Context, cur Head, data []byte) (Head, []wholeChunk, error) {
	var whole *WholeRef
	var drop []wholeChunk
	switch {
	case cur.Version == partsVersion && cur.Whole != nil:
		keys, err := s.wholeKeys(ctx)
		if err != nil {
			return Head{}, nil, err
		}
		if len(keys) > 0 {
			whole, drop = cur.Whole, keys
		}
	case cur.Version != partsVersion && cur.Chunks > 0:
		whole = &WholeRef{Slot: cur.Slot & 1, Chunks: cur.Chunks}
	}
	next, put, err := s.writeParts(ctx, cur, data)
	if err != nil {
		return Head{}, nil, err
	}
	next.Whole, next.Put = whole, put
	return next, drop, nil
}

// current returns the head and its revision (0: none); ErrSuperseded when
// a CompareAndSet writer's seq would not go further than the head's.
func (s Store) current(ctx context.Context, seq uint64) (Head, uint64, error) {
	var cur Head
	e, err := s.KV.Get(ctx, s.HeadKey)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		cur.Slot = 1 // the first snapshot goes to slot 0
		return cur, 0, nil
	case err != nil:
		return Head{}, 0, fmt.Errorf("head: %w", err)
	}
	if json.Unmarshal(e.Value(), &cur) != nil {
		cur.Slot = 1
	}
	if s.CompareAndSet && cur.Seq > 0 && cur.Seq >= seq {
		return Head{}, 0, fmt.Errorf("%w: the head covers %d, this one %d", ErrSuperseded, cur.Seq, seq)
	}
	return cur, e.Revision(), nil
}

// Read returns the payload the head names, whole and verified: ErrNone
// when there is no head, ErrBad when it cannot be read whole.
func (s Store) Read(ctx context.Context) ([]byte, Head, error) {
	// A head in parts whose part a later write overwrote (the reader was
	// slow, or a writer raced another) is read again if the head moved.
	var last string
	for range 3 {
		data, head, err := s.read(ctx)
		if err == nil || !errors.Is(err, ErrBad) || head.Version != partsVersion || headID(head) == last {
			return data, head, err
		}
		last = headID(head)
		e, gerr := s.KV.Get(ctx, s.HeadKey)
		var cur Head
		if gerr != nil || json.Unmarshal(e.Value(), &cur) != nil || headID(cur) == last {
			return data, head, err
		}
	}
	return s.read(ctx)
}

func (s Store) read(ctx context.Context) ([]byte, Head, error) {
	e, err := s.KV.Get(ctx, s.HeadKey)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, Head{}, ErrNone
	}
	if err != nil {
		return nil, Head{}, fmt.Errorf("snapshot head: %w", err)
	}
	var head Head
	err = json.Unmarshal(e.Value(), &head)
	switch {
	case err != nil || head.Bytes < 0 || len(head.SHA256) != 2*sha256.Size:
		return nil, Head{}, fmt.Errorf("%w: head %q", ErrBad, e.Value())
	case head.Version == partsVersion:
		if !validParts(head.Index) || head.Chunks < 0 {
			return nil, Head{}, fmt.Errorf("%w: head %q", ErrBad, e.Value())
		}
		data, err := s.readParts(ctx, head)
		if err != nil {
			return nil, head, err
		}
		return checked(data, head)
	case head.Version != 0 || head.Slot < 0 || head.Slot > 1 || head.Chunks < 1 || head.Bytes > head.Chunks*ChunkBytes:
		return nil, Head{}, fmt.Errorf("%w: head %q", ErrBad, e.Value())
	}
	data := make([]byte, 0, head.Bytes)
	for i := range head.Chunks {
		c, err := s.KV.Get(ctx, s.ChunkKey(head.Slot, i))
		if err != nil {
			return nil, head, fmt.Errorf("%w: chunk %d of %d: %w", ErrBad, i, head.Chunks, err)
		}
		if len(data)+len(c.Value()) > head.Bytes {
			return nil, head, fmt.Errorf("%w: chunks longer than the head's %d bytes", ErrBad, head.Bytes)
		}
		data = append(data, c.Value()...)
	}
	return checked(data, head)
}

// checked returns data if it is the payload head describes.
func checked(data []byte, head Head) ([]byte, Head, error) {
	if len(data) != head.Bytes {
		return nil, head, fmt.Errorf("%w: %d bytes, the head says %d", ErrBad, len(data), head.Bytes)
	}
	if sum := sha256.Sum256(data); hex.EncodeToString(sum[:]) != head.SHA256 {
		return nil, head, fmt.Errorf("%w: the chunks do not match the head's checksum", ErrBad)
	}
	return data, head, nil
}

// Life is what says whether a snapshot of a stream still fits it: its
// creation time (RFC 3339; a stream deleted and created again has
// another) and its first and last sequence.
type Life struct {
	Created     string
	First, Last uint64
}

// Lives returns each named stream's Life.
func Lives(ctx context.Context, js jetstream.JetStream, streams ...string) (map[string]Life, error) {
	lives := make(map[string]Life, len(streams))
	for _, name := range streams {
		st, err := js.Stream(ctx, name)
		if err != nil {
			return nil, fmt.Errorf("stream %s: %w", name, err)
		}
		info := st.CachedInfo()
		lives[name] = Life{Created: info.Created.UTC().Format(time.RFC3339Nano), First: info.State.FirstSeq,
			Last: info.State.LastSeq}
	}
	return lives, nil
}

// Created returns each stream's creation time, what a snapshot records.
func Created(lives map[string]Life) map[string]string {
	created := make(map[string]string, len(lives))
	for name, l := range lives {
		created[name] = l.Created
	}
	return created
}

// Recreated returns ErrRecreated when a stream in lives was created at
// another time than created (recorded when the writer started): the
// writer's state is then wrong for it.
func Recreated(created map[string]string, lives map[string]Life) error {
	for name, l := range lives {
		if created[name] != l.Created {
			return fmt.Errorf("%w: %s", ErrRecreated, name)
		}
	}
	return nil
}

// Stale returns ErrStale when a snapshot of stream's life created that
// covers it up to seq does not fit it as it is now: another life, or
// ahead of its end.
func Stale(stream string, now Life, created string, seq uint64) error {
	if created != now.Created {
		return fmt.Errorf("%w: stream %s was created at %s, the snapshot's at %s", ErrStale, stream, now.Created, created)
	}
	if seq > now.Last {
		return fmt.Errorf("%w: it covers %s up to %d, the stream ends at %d", ErrStale, stream, seq, now.Last)
	}
	return nil
}
