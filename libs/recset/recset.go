// Package recset keeps fixed-size records keyed by their first 16 bytes,
// a hash already (the first 128 bits of a SHA-256), in about the records'
// own size: what a service must keep per ended job (issue 17: "nothing
// grows with history"), such as the resource manager's retired
// allocations and refusals and billing's applied usage records, settled
// allocations and job totals.
//
// Why not a Go map (and, for the resource manager, an append-only log
// beside it, as before): the map's slots (key and value padded, its
// control bytes, a load factor of 7/8 and tables that double) cost
// several times a 16- to 48-byte record; the resource manager's map and
// log took ~100 bytes per 28-byte record, measured
// (BenchmarkHistoryMemory). Here the records are stored once, in chunks
// of fixed capacity that are never moved, in the order added, and an
// open-addressing index of uint32 record numbers and a fingerprint byte
// finds them: 5 bytes a slot at a load of 3/8 to 3/4, so ~7-13 bytes a
// record beside the record itself.
//
// Because a chunk is never reallocated and records are only appended,
// Chunks hands out views of what is stored that later Adds never change:
// a snapshot takes them under its owner's lock in O(chunks), not
// O(records), and encodes them after.
package recset

import (
	"encoding/binary"
	"fmt"
)

// KeySize is the size of a record's key, its first bytes.
const KeySize = 16

// chunkRecords is the number of records a chunk holds: 2,048 records of
// 28 bytes is 56 KiB, so the slack of the last chunk is at most that.
const chunkRecords = 2048

// Set is a set of fixed-size records keyed by their first KeySize bytes.
// Not safe for concurrent use; the zero value is not usable (New).
type Set struct {
	size   int
	chunks [][]byte
	n      int
	// slots is the index, probed linearly from a key's home: 0 is empty,
	// i+1 names the record numbered i (in the order added). Its length is
	// a power of two, and it doubles before it would be over 3/4 full.
	slots []uint32
	// fps holds a byte of each slot's key (fingerprint), so that a probe
	// reads a record only when that byte matches: a miss, which probes
	// ~8 slots at 3/4 full, would otherwise fetch as many records from
	// all over the chunks (a recset.Window looks up every set it holds).
	fps []uint8
}

// New returns an empty set of records of size bytes (at least KeySize).
func New(size int) *Set {
	if size < KeySize {
		panic(fmt.Sprintf("recset: record size %d below the key's %d", size, KeySize))
	}
	return &Set{size: size}
}

// Size is the size of each record.
func (s *Set) Size() int { return s.size }

// Len is the number of records.
func (s *Set) Len() int { return s.n }

// record is the record numbered i.
func (s *Set) record(i int) []byte {
	off := (i % chunkRecords) * s.size
	return s.chunks[i/chunkRecords][off : off+s.size : off+s.size]
}

// fingerprint is the key's byte kept in fps: its last, which home's mask
// never reaches (the index would need 2^120 slots).
func fingerprint(key []byte) uint8 { return key[KeySize-1] }

// home is where a key's probe starts: its first 8 bytes, a hash already.
func home(key []byte, mask int) int {
	return int(binary.LittleEndian.Uint64(key[:8]) & uint64(mask))
}

// find is the record numbered by the slot holding key, or -1, and the
// slot where the probe for key stopped.
func (s *Set) find(key []byte) (rec, slot int) {
	if len(s.slots) == 0 {
		return -1, -1
	}
	mask := len(s.slots) - 1
	// The key as two words, compared inline (a string comparison calls
	// memeqbody), and only where the fingerprint matches.
	k0, k1 := binary.LittleEndian.Uint64(key[:8]), binary.LittleEndian.Uint64(key[8:KeySize])
	fp := fingerprint(key)
	for i := int(k0 & uint64(mask)); ; i = (i + 1) & mask {
		v := s.slots[i]
		if v == 0 {
			return -1, i
		}
		if s.fps[i] != fp {
			continue
		}
		r := s.record(int(v - 1))
		if binary.LittleEndian.Uint64(r[:8]) == k0 && binary.LittleEndian.Uint64(r[8:KeySize]) == k1 {
			return int(v - 1), i
		}
	}
}

// Get returns the record whose key is key's first KeySize bytes, and
// whether there is one. The record is a view into the set: not to be
// written to.
func (s *Set) Get(key []byte) ([]byte, bool) {
	i, _ := s.find(key)
	if i < 0 {
		return nil, false
	}
	return s.record(i), true
}

// Has reports whether a record has key's first KeySize bytes as its key.
func (s *Set) Has(key []byte) bool {
	i, _ := s.find(key)
	return i >= 0
}

// Add stores rec (Size bytes, copied) unless a record with its key is
// stored already; it reports whether it stored it.
func (s *Set) Add(rec []byte) bool { return s.add(rec, false) }

// Put stores rec (Size bytes, copied), over the record with its key when
// there is one (its place in Chunks kept); it reports whether the key is
// new. A record written over changes in the views Chunks handed out:
// Put is for sets whose records are not shared.
func (s *Set) Put(rec []byte) bool { return s.add(rec, true) }

func (s *Set) add(rec []byte, over bool) bool {
	if len(rec) != s.size {
		panic(fmt.Sprintf("recset: record of %d bytes in a set of %d", len(rec), s.size))
	}
	if (s.n+1)*4 > len(s.slots)*3 {
		s.grow()
	}
	i, slot := s.find(rec)
	if i >= 0 {
		if over {
			copy(s.record(i), rec)
		}
		return false
	}
	if s.n == 1<<32-1 {
		panic("recset: more than 2^32-1 records")
	}
	if s.n%chunkRecords == 0 {
		s.chunks = append(s.chunks, make([]byte, 0, chunkRecords*s.size))
	}
	last := len(s.chunks) - 1
	s.chunks[last] = append(s.chunks[last], rec...)
	s.n++
	s.slots[slot] = uint32(s.n)
	s.fps[slot] = fingerprint(rec)
	return true
}

// grow doubles the index (16 slots at first) and places every record
// again, reading the records in the order added.
func (s *Set) grow() {
	s.slots = make([]uint32, max(16, 2*len(s.slots)))
	s.fps = make([]uint8, len(s.slots))
	mask := len(s.slots) - 1
	for r := range s.n {
		rec := s.record(r)
		i := home(rec, mask)
		for s.slots[i] != 0 {
			i = (i + 1) & mask
		}
		s.slots[i] = uint32(r + 1)
		s.fps[i] = fingerprint(rec)
	}
}

// Chunks returns the records in the order added, as views of the chunks
// that hold them, which later Adds never change (the caller must not
// write to them). O(chunks).
func (s *Set) Chunks() [][]byte {
	out := make([][]byte, len(s.chunks))
	for i, c := range s.chunks {
		out[i] = c[:len(c):len(c)]
	}
	return out
}

// Bytes is the memory the set holds: its chunks' capacity and its index.
func (s *Set) Bytes() int {
	b := 5 * len(s.slots)
	for _, c := range s.chunks {
		b += cap(c)
	}
	return b
}
