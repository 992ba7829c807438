package kvsnap_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
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
// chunks for whoever still reads them, the one after deletes both slots'
// once it is switched, chunks past a smaller payload's count too, and the
// one after that names no whole snapshot.
func TestFromWholeToParts(t *testing.T) {
	e := start(t)
	kv := bucket(t, e.op)
	whole := partsStore(kv)
	whole.Parts = nil
	write(t, whole, 1, payload(3*kvsnap.ChunkBytes+5)) // slot 0: chunks 0-3
	write(t, whole, 2, payload(kvsnap.ChunkBytes+5))   // slot 1: chunks 0-1
	write(t, whole, 3, payload(20))                    // slot 0: chunk 0 (1-3 left from write 1)
	parts := partsStore(kv)
	data := history(1, 40_000, 1000)
	if h := write(t, parts, 4, data); h.Whole == nil || len(wholeKeys(t, kv)) != 6 {
		t.Errorf("the first head in parts names no whole snapshot (%+v) or dropped its chunks", h.Whole)
	}
	write(t, parts, 5, data)
	if keys := wholeKeys(t, kv); len(keys) > 0 {
		t.Errorf("whole chunks left after the second write in parts: %v", keys)
	}
	if h := write(t, parts, 6, data); h.Whole != nil {
		t.Errorf("the third head in parts still names a whole snapshot: %+v", h.Whole)
	}
	// And back: a writer without Parts writes whole again, readable.
	write(t, whole, 7, payload(kvsnap.ChunkBytes+7))
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

// TestManyPartKeysUnderAServicesGrants (review of parts, HIGH): the
// headers-only watch of the part keys is a push consumer with flow
// control; past ~1 MB pending the server waits for a reply on
// $JS.FC.<stream>.…, which no service was granted: with ~16,000 part keys
// (a ~400 MB snapshot, or keys left by racing writers) every write hung
// for good. The grant is contracts/access.go's; a stuck watch now also
// fails the write after watchTimeout instead of the term.
func TestManyPartKeysUnderAServicesGrants(t *testing.T) {
	e := start(t)
	kv := bucket(t, e.op)
	const n = 20_000
	for i := range n {
		if _, err := kv.Put(t.Context(), contracts.RMSnapshotChunkKey(kvsnap.PartSlot, i), []byte("x")); err != nil {
			t.Fatal(err)
		}
	}
	rm := connectAs(t, e.srv, natstest.Service(t, e.srv, contracts.BusResourceManager))
	s := partsStore(bucket(t, rm))
	// Two writes: the second reuses its parts, after the watch.
	for seq := range uint64(2) {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		_, err := s.Write(ctx, seq+1, func() ([]byte, error) { return history(1, 4_000, 100), nil })
		cancel()
		if err != nil {
			t.Fatalf("write %d with %d part keys in the bucket: %v", seq+1, n, err)
		}
	}
}

// pausingKV pauses a writer at its first put of a part key (a slow
// replica: it chose its part indices, then its puts were delayed).
type pausingKV struct {
	jetstream.KeyValue
	armed          *bool
	paused, resume chan struct{}
}

func (k pausingKV) Put(ctx context.Context, key string, v []byte) (uint64, error) {
	if *k.armed && strings.Contains(key, ".c.") {
		*k.armed = false
		k.paused <- struct{}{}
		<-k.resume
	}
	return k.KeyValue.Put(ctx, key, v)
}

// TestRacingWritersKeepThePartKeysBounded (review of parts, MED): two
// writers sharing keys under compare-and-set. Each round, writer b (not
// the head's writer) chooses its part indices from the head it read, is
// delayed, and puts its parts after writer a switched the head (b's
// switch then fails). Racing writers may leave a head that does not read
// (its readers replay their streams), but the part keys must stay
// bounded: b used to count every key as taken when a's head did not
// read, and put a whole snapshot above them all, for good.
func TestRacingWritersKeepThePartKeysBounded(t *testing.T) {
	e := start(t)
	kv := bucket(t, e.op)
	cas := func(kv jetstream.KeyValue) kvsnap.Store {
		s := gatewayStore(kv)
		s.CompareAndSet, s.Parts = true, kvsnap.NewParts()
		return s
	}
	a := cas(kv)
	armed := false
	hook := pausingKV{KeyValue: kv, armed: &armed, paused: make(chan struct{}), resume: make(chan struct{})}
	b := cas(hook)
	seq := uint64(1)
	h, err := a.Write(t.Context(), seq, func() ([]byte, error) { return history(0, 20_000, 5_000), nil })
	if err != nil {
		t.Fatal(err)
	}
	perHead := h.Chunks + len(h.Index)
	for round := 1; round <= 8; round++ {
		armed = true
		done := make(chan error, 1)
		seq += 2
		go func(seq uint64) {
			_, err := b.Write(t.Context(), seq, func() ([]byte, error) { return history(100+seq, 20_000+10*int(seq), 5_000), nil })
			done <- err
		}(seq)
		<-hook.paused
		if _, err := a.Write(t.Context(), seq-1, func() ([]byte, error) { return history(seq, 20_000+10*int(seq), 5_000), nil }); err != nil {
			t.Fatalf("round %d: a: %v", round, err)
		}
		hook.resume <- struct{}{}
		if err := <-done; !errors.Is(err, kvsnap.ErrSuperseded) {
			t.Fatalf("round %d: b: %v, want ErrSuperseded", round, err)
		}
	}
	if keys := len(partKeys(t, kv, "gateway.c.")); keys > 3*perHead {
		t.Errorf("%d part keys after 8 races, more than three heads' %d", keys, 3*perHead)
	}
}

// deleteHookKV runs before at its first Delete.
type deleteHookKV struct {
	jetstream.KeyValue
	before *func()
}

func (k deleteHookKV) Delete(ctx context.Context, key string, opts ...jetstream.KVDeleteOpt) error {
	if f := *k.before; f != nil {
		*k.before = nil
		f()
	}
	return k.KeyValue.Delete(ctx, key, opts...)
}

// TestDroppingWholeChunksSparesANewWholeHead (review of parts, MED): a
// rolling upgrade: a writer still writing whole snapshots switches the
// head to a whole one while a writer in parts deletes the whole chunks
// its head no longer needs. Those were listed before its switch, and
// deleted after it: the new whole head's chunks are not among them.
func TestDroppingWholeChunksSparesANewWholeHead(t *testing.T) {
	e := start(t)
	kv := bucket(t, e.op)
	old := gatewayStore(kv) // a writer of before parts: whole snapshots
	old.CompareAndSet = true
	write(t, old, 1, payload(kvsnap.ChunkBytes+5))
	var before func()
	p := gatewayStore(deleteHookKV{KeyValue: kv, before: &before})
	p.CompareAndSet, p.Parts = true, kvsnap.NewParts()
	data := history(1, 40_000, 1000)
	write(t, p, 2, data) // the first head in parts: Whole names slot 0
	want := payload(kvsnap.ChunkBytes + 9)
	before = func() {
		if _, err := old.Write(t.Context(), 4, func() ([]byte, error) { return want, nil }); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := p.Write(t.Context(), 3, func() ([]byte, error) { return data, nil }); err != nil {
		t.Fatal(err)
	}
	if got, h, err := p.Read(t.Context()); err != nil || !bytes.Equal(got, want) {
		t.Errorf("the whole writer's head (slot %d, %d chunks) does not read: %v", h.Slot, h.Chunks, err)
	}
}
