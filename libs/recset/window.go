package recset

import (
	"fmt"
	"math"
	"time"
)

// Window is a set of fixed-size records that forgets each one a while
// after its time, a bucket of them at a time: what a service must
// remember of an ended thing only for as long as a message about it can
// still come (issue 17: "nothing grows with history"). A Set keeps every
// record for ever: at a thousand jobs a second, ~35 bytes an ended job is
// 3 GB a day.
//
// Records are dated by the caller, with the time of the log entry that
// made them, not when it was read: what a Window holds is then a function
// of the records and times added, whatever their order (a rebuild, a
// snapshot and its tail, or replicas reading the nodes' subjects in
// different interleavings agree). The clock is the latest time added or
// advanced to. Each record goes to the bucket of its time, a quarter of
// keep long; a bucket is dropped once the clock is keep past the
// bucket's end, and a record whose bucket is past that is not stored.
// So a record is kept while clock < its time + keep, and forgotten by
// clock = its time + keep + keep/4: memory is the records of the last
// 1.25 keep of log time, whatever the history's length.
//
// A record with the zero time is undated: it is never forgotten (what
// writes records dates them; an undated one comes only from hand-made
// input, and forgetting it early would be the unsafe way to err).
//
// Not safe for concurrent use; the zero value is not usable
// (NewWindow). Like a Set's, the chunks a bucket hands out never change.
type Window struct {
	size       int
	keep, span int64 // nanoseconds
	clock      int64 // unix nanoseconds; noClock before any dated record
	// buckets in ascending order of number; the undated one, if any, last.
	buckets []windowBucket
	n       int
	// keep, when set, names the records a drop keeps: they move to the
	// clock's bucket instead (SetKeep).
	keepRec func(rec []byte) bool
	// forgotten counts the records dropped, or refused as already past.
	forgotten int
}

type windowBucket struct {
	n   int64
	set *Set
}

// Undated is the number of the bucket of undated records.
const Undated = math.MaxInt64

const noClock = math.MinInt64

// windowBuckets is how many buckets keep spans: the overshoot past keep
// is keep/windowBuckets, and a miss probes at most windowBuckets+2 sets.
const windowBuckets = 4

// NewWindow returns an empty window of records of size bytes kept for at
// least keep (at least 4ns) after their time.
func NewWindow(size int, keep time.Duration) *Window {
	if keep < windowBuckets {
		panic(fmt.Sprintf("recset: window of %v", keep))
	}
	New(size) // checks size
	return &Window{size: size, keep: int64(keep), span: int64(keep) / windowBuckets, clock: noClock}
}

// Span is the length of a bucket in nanoseconds.
func (w *Window) Span() int64 { return w.span }

// Rebucket is the bucket of this window that a record of bucket n of a
// window of buckets span long goes to: the bucket of n's last instant,
// so that no record is forgotten sooner than its own time says (a window
// read back with another keep).
func (w *Window) Rebucket(n, span int64) int64 {
	if n == Undated || span == w.span {
		return n
	}
	return w.BucketOf(time.Unix(0, (n+1)*span-1))
}

// BucketOf is the number of the bucket a record of time t goes to.
func (w *Window) BucketOf(t time.Time) int64 {
	if t.IsZero() {
		return Undated
	}
	ns := t.UnixNano()
	n := ns / w.span
	if ns%w.span < 0 {
		n-- // floor, for times before 1970
	}
	return n
}

// expired reports whether bucket n is past keep at clock c.
func (w *Window) expired(n, c int64) bool {
	if n == Undated || c == noClock {
		return false
	}
	end := (n + 1) * w.span
	return c-end >= w.keep
}

// Clock is the latest time added or advanced to; zero before any.
func (w *Window) Clock() time.Time {
	if w.clock == noClock {
		return time.Time{}
	}
	return time.Unix(0, w.clock).UTC()
}

// Advance moves the clock to t, if later, and forgets what that expires.
// The zero time changes nothing.
func (w *Window) Advance(t time.Time) {
	if t.IsZero() {
		return
	}
	if ns := t.UnixNano(); ns > w.clock {
		w.clock = ns
		w.drop()
	}
}

func (w *Window) drop() {
	i := 0
	var kept [][]byte
	for i < len(w.buckets) && w.expired(w.buckets[i].n, w.clock) {
		set := w.buckets[i].set
		w.n -= set.Len()
		if w.keepRec != nil {
			for _, c := range set.Chunks() {
				for off := 0; off+w.size <= len(c); off += w.size {
					if r := c[off : off+w.size]; w.keepRec(r) {
						kept = append(kept, r) // the chunks outlive the set
					}
				}
			}
		}
		w.forgotten += set.Len()
		i++
	}
	if i > 0 {
		rest := copy(w.buckets, w.buckets[i:])
		clear(w.buckets[rest:])
		w.buckets = w.buckets[:rest]
	}
	if len(kept) > 0 {
		now := w.BucketOf(time.Unix(0, w.clock))
		for _, r := range kept {
			w.forgotten--
			w.AddIn(now, r)
		}
	}
}

// SetKeep makes every later drop keep the records keep names, moving
// them to the bucket of the clock, as if added again now, and makes an
// add of one already past keep store it there too: what a live
// thing still refers to must outlast its time (a queued job's
// dependency that ended long ago). nil keeps nothing. keep must not
// change the window.
func (w *Window) SetKeep(keep func(rec []byte) bool) { w.keepRec = keep }

// KeepRule is what SetKeep set.
func (w *Window) KeepRule() func(rec []byte) bool { return w.keepRec }

// Forgotten counts the records this window dropped, or refused because
// their time was already past keep: zero means it still holds every
// record ever added to it (a reader may then trust a miss).
func (w *Window) Forgotten() int { return w.forgotten }

// Add stores rec (Size bytes, copied), dated t, after advancing the clock
// to t, unless a record with its key is stored or t is already past keep.
// It reports whether it stored it.
func (w *Window) Add(rec []byte, t time.Time) bool {
	w.Advance(t)
	return w.AddIn(w.BucketOf(t), rec)
}

// AddIn stores rec in bucket n, as Add would a record whose time is in
// it, without moving the clock (a snapshot's records, read back with
// SetClock). It reports whether it stored it.
func (w *Window) AddIn(n int64, rec []byte) bool {
	if len(rec) != w.size {
		panic(fmt.Sprintf("recset: record of %d bytes in a window of %d", len(rec), w.size))
	}
	if w.expired(n, w.clock) {
		if w.keepRec == nil || !w.keepRec(rec) {
			w.forgotten++
			return false
		}
		n = w.BucketOf(time.Unix(0, w.clock)) // as a drop keeps it
	}
	if w.Has(rec) {
		return false
	}
	w.bucket(n).Add(rec)
	w.n++
	return true
}

// bucket is bucket n's set, made in its place when new.
func (w *Window) bucket(n int64) *Set {
	i := len(w.buckets)
	for i > 0 && w.buckets[i-1].n >= n {
		if w.buckets[i-1].n == n {
			return w.buckets[i-1].set
		}
		i--
	}
	b := windowBucket{n: n, set: New(w.size)}
	w.buckets = append(w.buckets, windowBucket{})
	copy(w.buckets[i+1:], w.buckets[i:])
	w.buckets[i] = b
	return b.set
}

// Get returns the record whose key is key's first KeySize bytes, and
// whether there is one; a view, not to be written to.
func (w *Window) Get(key []byte) ([]byte, bool) {
	for i := len(w.buckets) - 1; i >= 0; i-- {
		if rec, ok := w.buckets[i].set.Get(key); ok {
			return rec, true
		}
	}
	return nil, false
}

// Has reports whether a record has key's first KeySize bytes as its key.
func (w *Window) Has(key []byte) bool {
	_, ok := w.Get(key)
	return ok
}

// Len is the number of records.
func (w *Window) Len() int { return w.n }

// Bytes is the memory the records and their indexes hold.
func (w *Window) Bytes() int {
	b := 0
	for _, bk := range w.buckets {
		b += bk.set.Bytes()
	}
	return b
}

// Bucket is one bucket's records, for a snapshot: its number, how many
// records, and views of the chunks holding them (Set.Chunks).
type Bucket struct {
	N       int64    `json:"n"`
	Records int      `json:"records"`
	Chunks  [][]byte `json:"-"`
}

// Buckets returns every bucket in ascending order (the undated last).
// O(buckets + chunks): the views stay valid and unchanged however the
// window changes after.
func (w *Window) Buckets() []Bucket {
	out := make([]Bucket, len(w.buckets))
	for i, b := range w.buckets {
		out[i] = Bucket{N: b.n, Records: b.set.Len(), Chunks: b.set.Chunks()}
	}
	return out
}

// SetClock sets the clock of an empty window (a snapshot's, before its
// records are added back with AddIn).
func (w *Window) SetClock(t time.Time) {
	if w.n != 0 || len(w.buckets) != 0 {
		panic("recset: SetClock on a window holding records")
	}
	w.clock = noClock
	w.Advance(t)
}

// Restore fills an empty window with what Buckets and Clock gave of one
// (a snapshot): its clock, then each bucket's records, pieces holding
// them in bucket order (a record may be split between two pieces, and is
// put together), read where they lie. Buckets of span other than this
// window's are read by their ends (Rebucket); a bucket past keep at the
// clock is dropped, as the window would have, but for the records
// SetKeep names, kept as a drop keeps them. check, when set, sees each
// record first and may refuse the whole; a key listed twice is kept once.
// An error says the buckets, counts and bytes do not agree.
func (w *Window) Restore(clock time.Time, span int64, buckets []Bucket, pieces [][]byte, check func(rec []byte) error) error {
	size := 0
	for _, p := range pieces {
		size += len(p)
	}
	listed := 0
	for i, b := range buckets {
		if b.Records < 0 || (i > 0 && b.N <= buckets[i-1].N) {
			return fmt.Errorf("recset: bucket %d of %d records out of order", b.N, b.Records)
		}
		listed += b.Records
	}
	if size%w.size != 0 || listed*w.size != size {
		return fmt.Errorf("recset: buckets list %d records of %d bytes, %d bytes given", listed, w.size, size)
	}
	if listed > 0 && span <= 0 {
		return fmt.Errorf("recset: %d records without their buckets' span", listed)
	}
	w.SetClock(clock)
	rec := make([]byte, w.size)
	have, bucket, left := 0, 0, 0
	if len(buckets) > 0 {
		left = buckets[0].Records
	}
	for _, p := range pieces {
		for len(p) > 0 {
			r := p
			if have > 0 || len(p) < w.size {
				n := copy(rec[have:], p)
				have, p = have+n, p[n:]
				if have < w.size {
					continue
				}
				r, have = rec, 0
			} else {
				r, p = p[:w.size], p[w.size:]
			}
			for left == 0 {
				bucket++
				left = buckets[bucket].Records
			}
			left--
			if check != nil {
				if err := check(r); err != nil {
					return err
				}
			}
			w.AddIn(w.Rebucket(buckets[bucket].N, span), r)
		}
	}
	return nil
}
