package kvsnap_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
)

// partsStore is the resource manager's layout, written in parts.
func partsStore(kv jetstream.KeyValue) kvsnap.Store {
	return kvsnap.Store{KV: kv, HeadKey: contracts.RMSnapshotHeadKey(), ChunkKey: contracts.RMSnapshotChunkKey,
		Parts: kvsnap.NewParts()}
}

// history is a snapshot's shape: a header that changes at every write,
// records only ever appended to (n of them, 29 bytes each, as random as
// a scheduler's retired keys), and a tail of live state that changes.
func history(seed uint64, n, tail int) []byte {
	rng := rand.New(rand.NewPCG(1, 1)) // the records: the same at every write
	var b bytes.Buffer
	fmt.Fprintf(&b, "header %d\n", seed)
	rec := make([]byte, 29)
	for range n {
		for i := range rec {
			rec[i] = byte(rng.Uint32())
		}
		b.Write(rec)
	}
	live := rand.New(rand.NewPCG(seed, 2))
	for range tail {
		b.WriteByte(byte(live.Uint32()))
	}
	return b.Bytes()
}

func write(t *testing.T, s kvsnap.Store, seq uint64, data []byte) kvsnap.Head {
	t.Helper()
	h, err := s.Write(t.Context(), seq, func() ([]byte, error) { return data, nil })
	if err != nil {
		t.Fatalf("write %d: %v", seq, err)
	}
	got, _, err := s.Read(t.Context())
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("write %d does not read back (%d bytes, %d written): %v", seq, len(got), len(data), err)
	}
	return h
}

// TestPartsWriteThenRead: any payload reads back as written, in parts.
func TestPartsWriteThenRead(t *testing.T) {
	e := start(t)
	s := partsStore(bucket(t, e.op))
	for i, n := range []int{0, 1, 1000, kvsnap.ChunkBytes, 2*kvsnap.ChunkBytes + 5, 10, 0} {
		h := write(t, s, uint64(i+1), payload(n))
		if h.Version != 2 || h.Slot != kvsnap.PartSlot || h.Bytes != n {
			t.Errorf("%d bytes: head %+v, want version 2 in slot %d", n, h, kvsnap.PartSlot)
		}
	}
}

// TestPartsPutOnlyWhatChanged: a write puts the parts the head before it
// does not hold, however the bytes before the change moved; the same
// payload again puts nothing.
func TestPartsPutOnlyWhatChanged(t *testing.T) {
	e := start(t)
	s := partsStore(bucket(t, e.op))
	first := history(1, 150_000, 50_000) // ~4.4 MB
	if h := write(t, s, 1, first); h.Put < len(first) {
		t.Errorf("first write put %d bytes of %d, want all and its index", h.Put, len(first))
	}
	if h := write(t, s, 2, first); h.Put != 0 {
		t.Errorf("the same payload again put %d bytes, want none", h.Put)
	}
	// 3,000 records appended (87 kB), another header and another tail.
	second := history(2, 153_000, 50_000)
	h := write(t, s, 3, second)
	// The header's part, the records' last part or two and the tail's:
	// each at most a value (ChunkBytes), 256 KiB on average.
	if h.Put > 4*kvsnap.ChunkBytes || h.Put > len(second)/3 {
		t.Errorf("after 87 kB appended to %d bytes, the write put %d bytes in %d parts", len(second), h.Put, h.Chunks)
	}
	t.Logf("%d bytes in %d parts (index in %d); after 3,000 records appended the write put %d bytes", len(second),
		h.Chunks, len(h.Index), h.Put)
}

// TestPartKeysStayBounded: however many writes, the bucket holds the
// parts of two heads at most (indices are reused, never deleted), and
// every head reads back.
func TestPartKeysStayBounded(t *testing.T) {
	e := start(t)
	kv := bucket(t, e.op)
	s := partsStore(kv)
	var prev kvsnap.Head
	most := 0
	for i := range 30 {
		h := write(t, s, uint64(i+1), history(uint64(i), 20_000+2_000*i, 10_000))
		most = max(most, prev.Chunks+len(prev.Index)+h.Chunks+len(h.Index))
		prev = h
	}
	keys := partKeys(t, kv, "resource-manager.c.")
	if len(keys) > most {
		t.Errorf("%d part keys in the bucket, more than two heads' %d", len(keys), most)
	}
}

func partKeys(t *testing.T, kv jetstream.KeyValue, prefix string) []string {
	t.Helper()
	lister, err := kv.ListKeys(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for k := range lister.Keys() {
		if strings.HasPrefix(k, prefix) {
			out = append(out, k)
		}
	}
	return out
}

// TestPartsTrustOnlyWhatTheWriterPut: a writer reuses no part of a head
// it did not write, nor one of its own parts that another writer
// overwrote (a racing writer that chose the same free index and then
// lost its switch): it puts them again, and the next head reads back.
func TestPartsTrustOnlyWhatTheWriterPut(t *testing.T) {
	e := start(t)
	kv := bucket(t, e.op)
	a, b := partsStore(kv), partsStore(kv)
	data := history(1, 60_000, 10_000)
	write(t, a, 1, data)
	write(t, b, 2, history(2, 60_000, 10_000))
	if h := write(t, a, 3, data); h.Put < len(data) {
		t.Errorf("after another writer's head, a put %d bytes of %d, want all", h.Put, len(data))
	}
	// A racer overwrites a part of a's head and does not switch it.
	h := write(t, a, 4, data)
	parts, err := kvsnap.ReadIndex(a, t.Context(), h)
	if err != nil {
		t.Fatal(err)
	}
	put(t, kv, contracts.RMSnapshotChunkKey(kvsnap.PartSlot, parts[1].Key), []byte("a racer's part"))
	if _, _, err := a.Read(t.Context()); !errors.Is(err, kvsnap.ErrBad) {
		t.Fatalf("a head with an overwritten part read: %v, want ErrBad", err)
	}
	// The part again, and the index part naming it.
	if h := write(t, a, 5, data); h.Put < parts[1].Bytes || h.Put > parts[1].Bytes+len(h.Index)*kvsnap.ChunkBytes {
		t.Errorf("the next write put %d bytes, want the overwritten part's %d and its index", h.Put, parts[1].Bytes)
	}
}

// TestFromWholeToParts: a bucket whose head is a whole snapshot (as every
// one was before parts) reads; the first write in parts keeps the whole
// chunks for whoever still reads them, the one after deletes both slots'.
func TestFromWholeToParts(t *testing.T) {
	e := start(t)
	kv := bucket(t, e.op)
	whole := partsStore(kv)
	whole.Parts = nil
	write(t, whole, 1, payload(2*kvsnap.ChunkBytes+5))
	write(t, whole, 2, payload(kvsnap.ChunkBytes+5)) // both slots hold chunks
	parts := partsStore(kv)
	data := history(1, 40_000, 1000)
	if h := write(t, parts, 3, data); h.Whole == nil || len(wholeKeys(t, kv)) == 0 {
		t.Errorf("the first head in parts names no whole snapshot (%+v) or dropped its chunks", h.Whole)
	}
	if h := write(t, parts, 4, data); h.Whole != nil {
		t.Errorf("the second head in parts still names a whole snapshot: %+v", h.Whole)
	}
	if keys := wholeKeys(t, kv); len(keys) > 0 {
		t.Errorf("whole chunks left after the second write in parts: %v", keys)
	}
	// And back: a writer without Parts writes whole again, readable.
	write(t, whole, 5, payload(kvsnap.ChunkBytes+7))
}

func wholeKeys(t *testing.T, kv jetstream.KeyValue) []string {
	return append(partKeys(t, kv, "resource-manager.a."), partKeys(t, kv, "resource-manager.b.")...)
}

// TestUnreadablePartsSnapshots: a damaged snapshot in parts is ErrBad,
// never a wrong payload.
func TestUnreadablePartsSnapshots(t *testing.T) {
	corrupt := func(t *testing.T, s kvsnap.Store, key int) {
		e, err := s.KV.Get(t.Context(), s.ChunkKey(kvsnap.PartSlot, key))
		if err != nil {
			t.Fatal(err)
		}
		v := bytes.Clone(e.Value())
		v[10] ^= 1
		put(t, s.KV, s.ChunkKey(kvsnap.PartSlot, key), v)
	}
	for _, tc := range []struct {
		name  string
		spoil func(t *testing.T, s kvsnap.Store, h kvsnap.Head, parts []kvsnap.Part)
	}{
		{"part missing", func(t *testing.T, s kvsnap.Store, _ kvsnap.Head, parts []kvsnap.Part) {
			if err := s.KV.Delete(t.Context(), s.ChunkKey(kvsnap.PartSlot, parts[3].Key)); err != nil {
				t.Fatal(err)
			}
		}},
		{"part corrupt", func(t *testing.T, s kvsnap.Store, _ kvsnap.Head, parts []kvsnap.Part) {
			corrupt(t, s, parts[0].Key)
		}},
		{"index corrupt", func(t *testing.T, s kvsnap.Store, h kvsnap.Head, _ []kvsnap.Part) {
			corrupt(t, s, h.Index[0].Key)
		}},
		{"the index of another payload", func(t *testing.T, s kvsnap.Store, h kvsnap.Head, _ []kvsnap.Part) {
			other := write(t, s, 2, history(2, 40_000, 1000))
			h.Index = other.Index
			putHead(t, s, h)
		}},
		{"a part dropped", func(t *testing.T, s kvsnap.Store, h kvsnap.Head, _ []kvsnap.Part) {
			h.Chunks--
			putHead(t, s, h)
		}},
		{"lengths do not add up", func(t *testing.T, s kvsnap.Store, h kvsnap.Head, _ []kvsnap.Part) {
			h.Bytes++
			putHead(t, s, h)
		}},
		{"an index part without checksum", func(t *testing.T, s kvsnap.Store, h kvsnap.Head, _ []kvsnap.Part) {
			h.Index[0].SHA256 = ""
			putHead(t, s, h)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := start(t)
			s := partsStore(bucket(t, e.op))
			h := write(t, s, 1, history(1, 40_000, 1000))
			parts, err := kvsnap.ReadIndex(s, t.Context(), h)
			if err != nil || len(parts) < 4 {
				t.Fatalf("%d parts (%v), want four or more", len(parts), err)
			}
			tc.spoil(t, s, h, parts)
			got, _, err := s.Read(context.Background())
			if !errors.Is(err, kvsnap.ErrBad) || got != nil {
				t.Fatalf("read %d bytes: %v, want ErrBad", len(got), err)
			}
		})
	}
}

// TestPartsANewTermReusesWhatItRead: a writer of a new term (a new
// leader, a restart) that read the head whole puts only what changed
// since it; one that did not read it puts everything.
func TestPartsANewTermReusesWhatItRead(t *testing.T) {
	e := start(t)
	kv := bucket(t, e.op)
	write(t, partsStore(kv), 1, history(1, 60_000, 10_000))
	next := history(2, 61_000, 10_000)
	read := partsStore(kv)
	if _, _, err := read.Read(t.Context()); err != nil {
		t.Fatal(err)
	}
	if h := write(t, read, 2, next); h.Put > len(next)/4 {
		t.Errorf("after reading the head, a new term's first write put %d bytes of %d", h.Put, len(next))
	}
	if h := write(t, partsStore(kv), 3, history(3, 61_000, 10_000)); h.Put < len(next) {
		t.Errorf("without reading the head, a new term's first write put %d bytes of %d, want all", h.Put, len(next))
	}
}
