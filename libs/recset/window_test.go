package recset

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// windowRef is the rule Window keeps, written the plain way: a map of
// key to record and bucket, and every record of a bucket keep past its
// end dropped.
type windowRef struct {
	keep, span int64
	clock      int64
	has        bool
	recs       map[string]refRec
}

type refRec struct {
	rec []byte
	n   int64
}

func (r *windowRef) bucketOf(t time.Time) int64 {
	if t.IsZero() {
		return Undated
	}
	ns := t.UnixNano()
	n := ns / r.span
	if ns%r.span < 0 {
		n--
	}
	return n
}

func (r *windowRef) gone(n int64) bool {
	return n != Undated && r.has && r.clock-(n+1)*r.span >= r.keep
}

func (r *windowRef) advance(t time.Time) {
	if t.IsZero() || (r.has && t.UnixNano() <= r.clock) {
		return
	}
	r.clock, r.has = t.UnixNano(), true
	for k, v := range r.recs {
		if r.gone(v.n) {
			delete(r.recs, k)
		}
	}
}

func (r *windowRef) add(rec []byte, t time.Time) bool {
	r.advance(t)
	n := r.bucketOf(t)
	if _, ok := r.recs[string(rec[:KeySize])]; ok || r.gone(n) {
		return false
	}
	r.recs[string(rec[:KeySize])] = refRec{rec: slices.Clone(rec), n: n}
	return true
}

// TestWindowIsATimedMap holds the window to windowRef through random
// adds (in order, late, undated, repeated) and clock moves, across
// bucket drops and chunk boundaries: every answer, every record, and
// the bound (nothing kept keep + keep/4 past its time).
func TestWindowIsATimedMap(t *testing.T) {
	const keep = 40 * time.Second
	base := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	for seed := range uint64(8) {
		rng := rand.New(rand.NewPCG(seed, 7))
		w := NewWindow(28, keep)
		ref := &windowRef{keep: int64(keep), span: int64(keep) / 4, recs: map[string]refRec{}}
		keys := 500 + rng.IntN(3*chunkRecords)
		at := base
		times := map[string]time.Time{}
		for step := range 6000 {
			k := uint64(rng.IntN(keys))
			r := rec(28, k, false)
			switch op := rng.IntN(20); {
			case op < 14: // a record of about now, or late by up to 2 keep
				tm := at.Add(-time.Duration(rng.Int64N(int64(2 * keep))))
				if rng.IntN(3) == 0 {
					tm = at
				}
				if rng.IntN(200) == 0 {
					tm = time.Time{}
				}
				want := ref.add(r, tm)
				if got := w.Add(r, tm); got != want {
					t.Fatalf("seed %d step %d: Add(key %d, %v) = %v, want %v", seed, step, k, tm, got, want)
				}
				if want {
					times[string(r[:KeySize])] = tm
				}
			case op < 18: // time passes
				at = at.Add(time.Duration(rng.Int64N(int64(keep / 8))))
				ref.advance(at)
				w.Advance(at)
			case op < 19: // the clock never goes back
				back := at.Add(-keep)
				ref.advance(back)
				w.Advance(back)
			default: // a zero time moves nothing
				w.Advance(time.Time{})
			}
			if w.Len() != len(ref.recs) {
				t.Fatalf("seed %d step %d: Len %d, want %d", seed, step, w.Len(), len(ref.recs))
			}
			if step%241 != 0 {
				continue
			}
			for k := range uint64(keys) {
				r := rec(28, k, false)
				got, ok := w.Get(r)
				want, wok := ref.recs[string(r[:KeySize])]
				if ok != wok || (ok && !bytes.Equal(got, want.rec)) || w.Has(r) != wok {
					t.Fatalf("seed %d step %d: key %d: Get %x %v, want %x %v", seed, step, k, got, ok, want.rec, wok)
				}
				if tm := times[string(r[:KeySize])]; ok && !tm.IsZero() && !w.Clock().Before(tm.Add(keep+keep/4)) {
					t.Fatalf("seed %d step %d: key %d of %v still kept at %v", seed, step, k, tm, w.Clock())
				}
			}
		}
	}
}

// TestWindowIsAFunctionOfWhatWasAdded: the same dated records added in
// two random orders (late ones among them) leave the same clock and the
// same records in the same buckets. This is what lets replicas and a
// rebuild from a snapshot agree.
func TestWindowIsAFunctionOfWhatWasAdded(t *testing.T) {
	const keep = time.Minute
	base := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	for seed := range uint64(30) {
		rng := rand.New(rand.NewPCG(seed, 11))
		type dated struct {
			r  []byte
			tm time.Time
		}
		var all []dated
		for k := range uint64(300 + rng.IntN(3000)) {
			all = append(all, dated{rec(16, k, false), base.Add(time.Duration(rng.Int64N(int64(5 * keep))))})
		}
		content := func(order []dated) (time.Time, map[int64][]string) {
			w := NewWindow(16, keep)
			for _, d := range order {
				w.Add(d.r, d.tm)
			}
			out := map[int64][]string{}
			for _, b := range w.Buckets() {
				var ks []string
				for _, c := range b.Chunks {
					for off := 0; off < len(c); off += 16 {
						ks = append(ks, string(c[off:off+16]))
					}
				}
				if len(ks) != b.Records {
					t.Fatalf("bucket %d: %d records listed, %d in chunks", b.N, b.Records, len(ks))
				}
				slices.Sort(ks)
				out[b.N] = ks
			}
			return w.Clock(), out
		}
		c1, b1 := content(all)
		shuffled := slices.Clone(all)
		rng.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
		c2, b2 := content(shuffled)
		if !c1.Equal(c2) || len(b1) != len(b2) {
			t.Fatalf("seed %d: clock %v vs %v, %d vs %d buckets", seed, c1, c2, len(b1), len(b2))
		}
		for n, ks := range b1 {
			if !slices.Equal(ks, b2[n]) {
				t.Fatalf("seed %d: bucket %d differs (%d vs %d records)", seed, n, len(ks), len(b2[n]))
			}
		}
	}
}

// TestWindowComesBackFromItsBuckets: a window rebuilt from Buckets and
// Clock (as a snapshot does) answers as the original, and the views
// taken stay what they were while the original adds and drops.
func TestWindowComesBackFromItsBuckets(t *testing.T) {
	const keep = time.Minute
	at := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	w := NewWindow(20, keep)
	for k := range uint64(3 * chunkRecords) {
		w.Add(rec(20, k, false), at.Add(time.Duration(k)*time.Millisecond*30))
	}
	w.Add(rec(20, 1<<40, false), time.Time{})
	bs, clock := w.Buckets(), w.Clock()
	var frozen [][]byte
	for _, b := range bs {
		for _, c := range b.Chunks {
			frozen = append(frozen, slices.Clone(c))
		}
	}
	// Back through Restore, from the records cut into pieces of 7
	// bytes (records split between pieces, as a decoded snapshot may be).
	var all []byte
	for _, b := range bs {
		for _, c := range b.Chunks {
			all = append(all, c...)
		}
	}
	var pieces [][]byte
	for len(all) > 0 {
		n := min(7, len(all))
		pieces, all = append(pieces, all[:n]), all[n:]
	}
	back := NewWindow(20, keep)
	seen := 0
	if err := back.Restore(clock, back.Span(), bs, pieces, func([]byte) error { seen++; return nil }); err != nil {
		t.Fatal(err)
	}
	if seen != w.Len() {
		t.Fatalf("check saw %d records, want %d", seen, w.Len())
	}
	for _, bad := range []struct {
		name    string
		buckets []Bucket
		pieces  [][]byte
	}{
		{"a count too many", append([]Bucket{{N: bs[0].N, Records: bs[0].Records + 1}}, bs[1:]...), pieces},
		{"buckets out of order", []Bucket{bs[1], bs[0]}, pieces},
		{"bytes not whole records", bs, append(slices.Clone(pieces), []byte{1})},
	} {
		if err := NewWindow(20, keep).Restore(clock, back.Span(), bad.buckets, bad.pieces, nil); err == nil {
			t.Errorf("%s: restored", bad.name)
		}
	}
	if back.Len() != w.Len() || !back.Clock().Equal(w.Clock()) {
		t.Fatalf("back: %d records at %v, want %d at %v", back.Len(), back.Clock(), w.Len(), w.Clock())
	}
	for k := range uint64(3 * chunkRecords) {
		r := rec(20, k, false)
		if back.Has(r) != w.Has(r) {
			t.Fatalf("key %d: %v back, %v before", k, back.Has(r), w.Has(r))
		}
	}
	// Move on: drop every dated bucket, add more.
	later := clock.Add(3 * keep)
	for k := range uint64(chunkRecords) {
		w.Add(rec(20, 1<<20+k, false), later)
	}
	if w.Has(rec(20, 0, false)) || !w.Has(rec(20, 1<<40, false)) {
		t.Fatal("after 3 keep: the first record kept or the undated one forgotten")
	}
	i := 0
	for _, b := range bs {
		for _, c := range b.Chunks {
			if !bytes.Equal(c, frozen[i]) {
				t.Fatalf("view %d of bucket %d changed", i, b.N)
			}
			i++
		}
	}
}

// TestWindowBoundsMemory: a steady stream of records for 20 keep holds
// what 1.25 keep of it holds, not 20 keep's.
func TestWindowBoundsMemory(t *testing.T) {
	const keep = time.Minute
	at := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	w := NewWindow(28, keep)
	const perKeep = 4000
	most := 0
	for k := range uint64(20 * perKeep) {
		w.Add(rec(28, k, false), at.Add(time.Duration(k)*keep/perKeep))
		most = max(most, w.Len())
	}
	if most > perKeep*5/4+1 || w.Len() < perKeep {
		t.Fatalf("held at most %d records, %d at the end; a keep is %d", most, w.Len(), perKeep)
	}
}

// TestRebucketKeepsNoRecordLess: a record read back into a window of
// another keep is forgotten no sooner than its own time says, and not
// much later.
func TestRebucketKeepsNoRecordLess(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	base := time.Date(2026, 11, 27, 0, 0, 0, 0, time.UTC)
	for range 2000 {
		from := NewWindow(16, time.Duration(4+rng.Int64N(int64(48*time.Hour))))
		to := NewWindow(16, time.Duration(4+rng.Int64N(int64(48*time.Hour))))
		tm := base.Add(time.Duration(rng.Int64N(int64(240 * time.Hour))))
		n := to.Rebucket(from.BucketOf(tm), from.Span())
		start := n * to.Span()
		if end := start + to.Span(); end <= tm.UnixNano() {
			t.Fatalf("a record of %v read into bucket [%d, %d): earlier than its time", tm, start, end)
		}
		if late := start - tm.UnixNano(); late > from.Span() {
			t.Fatalf("a record of %v read into a bucket %v later", tm, time.Duration(late))
		}
	}
}

// TestWindowKeepsWhatItIsTold holds a window with a keep rule to
// windowRef extended the plain way: a record past keep whose key the
// rule names at the drop moves to the clock's bucket, any other goes.
// Forgotten must count exactly the records dropped or refused as past,
// and a record named for keeping must never be lost, however late.
func TestWindowKeepsWhatItIsTold(t *testing.T) {
	const keep = 40 * time.Second
	base := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	for seed := range uint64(8) {
		rng := rand.New(rand.NewPCG(seed, 11))
		keys := 300 + rng.IntN(2*chunkRecords)
		pinned := map[uint64]bool{}
		keyOf := func(r []byte) uint64 { return binary.LittleEndian.Uint64(r[8:16]) }
		w := NewWindow(28, keep)
		w.SetKeep(func(r []byte) bool { return pinned[keyOf(r)] })
		ref := &windowRef{keep: int64(keep), span: int64(keep) / 4, recs: map[string]refRec{}}
		forgotten := 0
		refAdvance := func(tm time.Time) {
			if tm.IsZero() || (ref.has && tm.UnixNano() <= ref.clock) {
				return
			}
			ref.clock, ref.has = tm.UnixNano(), true
			for k, v := range ref.recs {
				if !ref.gone(v.n) {
					continue
				}
				if pinned[keyOf(v.rec)] {
					ref.recs[k] = refRec{rec: v.rec, n: ref.bucketOf(tm)}
				} else {
					delete(ref.recs, k)
					forgotten++
				}
			}
		}
		at := base
		for step := range 5000 {
			k := uint64(rng.IntN(keys))
			r := rec(28, k, false)
			switch op := rng.IntN(20); {
			case op < 10:
				tm := at.Add(-time.Duration(rng.Int64N(int64(2 * keep))))
				refAdvance(tm)
				n := ref.bucketOf(tm)
				_, had := ref.recs[string(r[:KeySize])]
				if ref.gone(n) && pinned[k] {
					n = ref.bucketOf(time.Unix(0, ref.clock))
				}
				want := !had && !ref.gone(n)
				if ref.gone(n) {
					forgotten++
				}
				if want {
					ref.recs[string(r[:KeySize])] = refRec{rec: slices.Clone(r), n: n}
				}
				if got := w.Add(r, tm); got != want {
					t.Fatalf("seed %d step %d: Add(key %d) = %v, want %v", seed, step, k, got, want)
				}
			case op < 14:
				pinned[k] = !pinned[k]
			default:
				at = at.Add(time.Duration(rng.Int64N(int64(keep / 4))))
				refAdvance(at)
				w.Advance(at)
			}
			if w.Len() != len(ref.recs) || w.Forgotten() != forgotten {
				t.Fatalf("seed %d step %d: Len %d Forgotten %d, want %d %d", seed, step, w.Len(), w.Forgotten(), len(ref.recs), forgotten)
			}
			if step%97 != 0 {
				continue
			}
			for k := range uint64(keys) {
				r := rec(28, k, false)
				got, ok := w.Get(r)
				want, wok := ref.recs[string(r[:KeySize])]
				if ok != wok || (ok && !bytes.Equal(got, want.rec)) {
					t.Fatalf("seed %d step %d: key %d: Get %x %v, want %x %v", seed, step, k, got, ok, want.rec, wok)
				}
			}
		}
		if forgotten == 0 {
			t.Fatalf("seed %d: nothing was ever dropped: the test proves nothing", seed)
		}
	}
}

// TestWindowRestoreKeepsWhatItIsTold: a window read back with a shorter
// keep drops the buckets now past it, but a record the keep rule names
// moves to the clock's bucket, as a drop would keep it.
func TestWindowRestoreKeepsWhatItIsTold(t *testing.T) {
	base := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	w := NewWindow(28, 3*time.Hour)
	for k := range uint64(100) {
		w.Add(rec(28, k, false), base.Add(time.Duration(k)*time.Minute))
	}
	var pieces [][]byte
	bs := w.Buckets()
	for _, b := range bs {
		pieces = append(pieces, b.Chunks...)
	}
	short := NewWindow(28, 10*time.Minute)
	short.SetKeep(func(r []byte) bool { return binary.LittleEndian.Uint64(r[8:16]) == 3 })
	if err := short.Restore(w.Clock(), w.Span(), bs, pieces, nil); err != nil {
		t.Fatal(err)
	}
	if !short.Has(rec(28, 3, false)) || short.Has(rec(28, 4, false)) || !short.Has(rec(28, 99, false)) {
		t.Fatalf("restored: key 3 %v (kept), 4 %v (dropped), 99 %v (recent)", short.Has(rec(28, 3, false)),
			short.Has(rec(28, 4, false)), short.Has(rec(28, 99, false)))
	}
	if short.Forgotten() == 0 {
		t.Fatal("the records dropped at the restore are not counted as forgotten")
	}
	short.Advance(w.Clock().Add(time.Hour))
	if !short.Has(rec(28, 3, false)) || short.Len() != 1 {
		t.Fatalf("an hour on: key 3 kept %v, %d records", short.Has(rec(28, 3, false)), short.Len())
	}
}
