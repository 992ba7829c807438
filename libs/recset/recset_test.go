package recset

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"testing"
)

// rec is a record of size bytes: key from k (hashed-looking or, with
// sameHome, every key sharing its first 8 bytes, so every probe collides),
// then a payload derived from k.
func rec(size int, k uint64, sameHome bool) []byte {
	r := make([]byte, size)
	if sameHome {
		binary.LittleEndian.PutUint64(r[:8], 42)
	} else {
		binary.LittleEndian.PutUint64(r[:8], k*0x9e3779b97f4a7c15)
	}
	binary.LittleEndian.PutUint64(r[8:16], k)
	for i := KeySize; i < size; i++ {
		r[i] = byte(k) + byte(i)
	}
	return r
}

// TestSetIsAMap holds the set to a map of its keys: every Add, Get, Has
// and the records in the order added, across index growth and chunks.
func TestSetIsAMap(t *testing.T) {
	for _, tc := range []struct {
		name     string
		size, n  int
		sameHome bool
	}{
		{"retired records", 28, 3*chunkRecords + 17, false},
		{"refusal keys", 16, 5000, false},
		{"every key one home", 20, 300, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, 2))
			s := New(tc.size)
			ref := map[string][]byte{}
			var order [][]byte
			for range 2 * tc.n {
				r := rec(tc.size, uint64(rng.IntN(tc.n)), tc.sameHome)
				_, had := ref[string(r[:KeySize])]
				if added := s.Add(r); added == had {
					t.Fatalf("Add = %v with the key stored %v", added, had)
				}
				if !had {
					ref[string(r[:KeySize])] = r
					order = append(order, r)
				}
				// Absent keys stay absent.
				miss := rec(tc.size, uint64(tc.n+rng.IntN(tc.n)), tc.sameHome)
				if s.Has(miss) {
					t.Fatal("Has a key never added")
				}
			}
			if s.Len() != len(ref) {
				t.Fatalf("Len = %d, want %d", s.Len(), len(ref))
			}
			for k, want := range ref {
				got, ok := s.Get([]byte(k))
				if !ok || !bytes.Equal(got, want) {
					t.Fatalf("Get(%x) = %x, %v; want %x", k, got, ok, want)
				}
			}
			if got, want := bytes.Join(s.Chunks(), nil), bytes.Join(order, nil); !bytes.Equal(got, want) {
				t.Fatalf("Chunks are not the records in the order added (%d bytes, want %d)", len(got), len(want))
			}
		})
	}
}

// TestPutWritesOver: Put stores a new key as Add does and writes over
// the record of a known one, in its place.
func TestPutWritesOver(t *testing.T) {
	s := New(20)
	a, b := rec(20, 1, false), rec(20, 2, false)
	for _, r := range [][]byte{a, b} {
		if !s.Put(r) {
			t.Fatal("Put of a new key says it was known")
		}
	}
	a2 := append([]byte(nil), a...)
	a2[19] ^= 0xff
	if s.Put(a2) {
		t.Fatal("Put of a known key says it was new")
	}
	if s.Add(a) {
		t.Fatal("Add of a known key stored it")
	}
	if got, _ := s.Get(a); !bytes.Equal(got, a2) {
		t.Fatalf("Get after Put = %x, want %x", got, a2)
	}
	if got := bytes.Join(s.Chunks(), nil); !bytes.Equal(got, append(append([]byte(nil), a2...), b...)) {
		t.Fatalf("Chunks after Put = %x", got)
	}
}

// TestChunksOutliveAdds: what Chunks handed out (a snapshot's view) is
// unchanged by later Adds, however many.
func TestChunksOutliveAdds(t *testing.T) {
	s := New(28)
	for k := range chunkRecords + 5 {
		s.Add(rec(28, uint64(k), false))
	}
	view := s.Chunks()
	before := bytes.Join(view, nil)
	for k := chunkRecords + 5; k < 4*chunkRecords; k++ {
		s.Add(rec(28, uint64(k), false))
	}
	if !bytes.Equal(bytes.Join(view, nil), before) {
		t.Fatal("a view from Chunks changed after later Adds")
	}
	if got := len(bytes.Join(s.Chunks(), nil)); got != 4*chunkRecords*28 {
		t.Fatalf("%d bytes of records, want %d", got, 4*chunkRecords*28)
	}
}

// TestSetIsCompact: the set holds about its records' own size, not a
// map's (issue 17: the resource manager keeps one such record per ended
// allocation). At 100,000 records of 28 bytes: chunks (the last one's
// slack at most one chunk) and an index of 5 bytes a slot (the record's
// number and a fingerprint byte) at most 3/4 and at least 3/8 full.
func TestSetIsCompact(t *testing.T) {
	const n, size = 100_000, 28
	s := New(size)
	for k := range n {
		s.Add(rec(size, uint64(k), false))
	}
	perRecord := float64(s.Bytes()) / n
	if limit := float64(size) + float64(chunkRecords*size)/n + 5/0.375; perRecord > limit {
		t.Fatalf("%.1f bytes per %d-byte record, limit %.1f", perRecord, size, limit)
	}
}
