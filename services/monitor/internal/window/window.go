// Package window keeps a rolling window of one value in a fixed ring of
// time buckets, so that "the average over the last minute" or "how fast is
// this rising" costs a constant amount of memory per series and no
// allocation per sample.
//
// A Ring of n buckets of width res covers the last n×res of time. A sample
// lands in the bucket of its time (bucket number = unix time / res, slot =
// number mod n); a bucket whose number is older than the sample's is reused
// in place. Samples older than the ring's span are dropped: telemetry that
// arrives that late says nothing about the present.
//
// A bucket keeps only the fields its Layout names (count and sum, min,
// max, first, last), each a 64-bit word after the bucket number: a ring
// read only for its last value costs 16 bytes a bucket instead of 56. The
// monitor holds several rings per GPU of a 10,000-machine fleet, so the
// fields no rule reads were most of its memory (issue 17). Kept fields are
// computed exactly as when every field was kept; values stay float64.
package window

import (
	"math"
	"time"
)

// Fields says which values a bucket keeps.
type Fields uint8

const (
	// FieldSum keeps the sample count and sum: Stats.Count, Sum, Mean
	// and Slope (least squares over the bucket means) need it.
	FieldSum Fields = 1 << iota
	FieldMin
	FieldMax
	FieldFirst // Stats.First and Increase
	FieldLast  // Stats.Last, Last and Increase

	FieldAll = FieldSum | FieldMin | FieldMax | FieldFirst | FieldLast
)

// Layout is the shape of the buckets of rings: their width and the fields
// they keep. Rings share their layout.
type Layout struct {
	res    int64
	fields Fields
	stride int64 // words a bucket takes: the number, then the kept fields
	// Word offsets within a bucket; 0 when not kept (word 0 is the number).
	n, sum, min, max, first, last int64
}

// NewLayout returns the layout of rings of buckets res wide keeping
// fields. res < 1ms is raised to 1ms, so a misconfigured ring still works.
func NewLayout(res time.Duration, fields Fields) *Layout {
	l := &Layout{res: max(int64(res), int64(time.Millisecond)), fields: fields & FieldAll, stride: 1}
	next := func(keep bool) int64 {
		if !keep {
			return 0
		}
		l.stride++
		return l.stride - 1
	}
	l.n = next(fields&FieldSum != 0)
	l.sum = next(fields&FieldSum != 0)
	l.min = next(fields&FieldMin != 0)
	l.max = next(fields&FieldMax != 0)
	l.first = next(fields&FieldFirst != 0)
	l.last = next(fields&FieldLast != 0)
	return l
}

// Fields are the fields the layout keeps.
func (l *Layout) Fields() Fields { return l.fields }

// Ring returns a ring of n buckets of the layout. n < 2 is raised to 2.
func (l *Layout) Ring(n int) Ring {
	return l.View(make([]uint64, l.Words(n)))
}

// Words is how many words a ring of n buckets of the layout takes.
func (l *Layout) Words(n int) int { return max(n, 2) * int(l.stride) }

// View returns the ring of the layout over w, which must be Words(n)
// long and zero, or the words of a ring of the same layout and n: rings
// of one series can share one allocation.
func (l *Layout) View(w []uint64) Ring { return Ring{lay: l, w: w} }

// BytesPerBucket is what a bucket of the layout takes.
func (l *Layout) BytesPerBucket() int { return int(l.stride) * 8 }

// Ring is a rolling window of one value. The zero Ring is unusable; make
// one with New, Layout.Ring or Layout.View. A Ring is a view of its
// words: copies share them. A Ring is not safe for concurrent use.
//
// Buckets are words: w[i*stride] is bucket i's number (unix ns / res; 0
// means never used), the layout's fields follow as float64 bits (the count
// as an integer).
type Ring struct {
	lay *Layout
	w   []uint64
}

// New returns a ring of n buckets, each res wide, keeping every field.
func New(res time.Duration, n int) Ring { return NewLayout(res, FieldAll).Ring(n) }

// Buckets returns how many buckets a window of span at resolution res
// needs: one per res, plus the bucket being filled now.
func Buckets(span, res time.Duration) int {
	if res <= 0 {
		return 2
	}
	return int((span+res-1)/res) + 1
}

func (r Ring) len() int64 { return int64(len(r.w)) / r.lay.stride }

// f reads the float field at word offset off of the bucket at base.
func (r Ring) f(base, off int64) float64 { return math.Float64frombits(r.w[base+off]) }

func (r Ring) setf(base, off int64, v float64) { r.w[base+off] = math.Float64bits(v) }

// Add records v at unix time at (nanoseconds). Within a bucket, last is
// the value added last, not the one with the latest time. Samples before
// the first bucket after the Unix epoch are dropped: bucket number 0 marks
// an unused bucket.
func (r Ring) Add(at int64, v float64) {
	l := r.lay
	num := at / l.res
	if num <= 0 {
		return
	}
	base := (num % r.len()) * l.stride
	switch b := int64(r.w[base]); {
	case b == num:
		if l.n != 0 {
			r.w[base+l.n]++
			r.setf(base, l.sum, r.f(base, l.sum)+v)
		}
		if l.min != 0 {
			r.setf(base, l.min, min(r.f(base, l.min), v))
		}
		if l.max != 0 {
			r.setf(base, l.max, max(r.f(base, l.max), v))
		}
		if l.last != 0 {
			r.setf(base, l.last, v)
		}
	case b < num:
		r.w[base] = uint64(num)
		bits := math.Float64bits(v)
		if l.n != 0 {
			r.w[base+l.n] = 1
			r.w[base+l.sum] = bits
		}
		if l.min != 0 {
			r.w[base+l.min] = bits
		}
		if l.max != 0 {
			r.w[base+l.max] = bits
		}
		if l.first != 0 {
			r.w[base+l.first] = bits
		}
		if l.last != 0 {
			r.w[base+l.last] = bits
		}
	default:
		// The slot holds a newer bucket: at is older than the ring's span.
	}
}

// Stats sums up a window. Fields the ring's layout does not keep are 0.
type Stats struct {
	// Count is the number of samples (with FieldSum; without it, the
	// number of buckets holding samples); every other field is 0 when it
	// is 0.
	Count int
	Sum   float64
	Min   float64
	Max   float64
	// First and Last are the first value of the oldest bucket and the
	// last of the newest.
	First float64
	Last  float64
	// Slope is the least-squares slope of the bucket means over time, in
	// units per second; 0 with fewer than two buckets or without FieldSum.
	Slope float64
}

// Mean is Sum/Count, 0 when empty.
func (s Stats) Mean() float64 {
	if s.Count == 0 {
		return 0
	}
	return s.Sum / float64(s.Count)
}

// Stats sums up the buckets within span of now (unix ns): the bucket of now
// and the ceil(span/res) before it, at most the whole ring, so a window
// covers at least span and at most span+res. The bucket after now's counts
// too: a sample stamped by a clock slightly ahead is not lost. Slope is
// left 0; StatsSlope computes it. Neither allocates.
func (r Ring) Stats(now int64, span time.Duration) Stats { return r.stats(now, span, false) }

// StatsSlope is Stats with Slope.
func (r Ring) StatsSlope(now int64, span time.Duration) Stats { return r.stats(now, span, true) }

func (r Ring) stats(now int64, span time.Duration, slope bool) Stats {
	l := r.lay
	n := r.len()
	slope = slope && l.n != 0
	oldest, newest := r.bounds(now, span)
	var s Stats
	// Least squares over (bucket number relative to oldest, bucket mean).
	var nb, sx, sy, sxx, sxy float64
	// Walk the slots from oldest's without a division per bucket. Each slot
	// matches at most one number, so a range one longer than the ring
	// counts no bucket twice.
	slot := oldest % n
	for num := oldest; num <= newest; num++ {
		base := slot * l.stride
		if slot++; slot == n {
			slot = 0
		}
		if int64(r.w[base]) != num || num <= 0 {
			continue
		}
		// Buckets come in time order: the first one seen holds First,
		// the last one Last.
		first := s.Count == 0
		if l.min != 0 {
			if v := r.f(base, l.min); first {
				s.Min = v
			} else {
				s.Min = min(s.Min, v)
			}
		}
		if l.max != 0 {
			if v := r.f(base, l.max); first {
				s.Max = v
			} else {
				s.Max = max(s.Max, v)
			}
		}
		if l.first != 0 && first {
			s.First = r.f(base, l.first)
		}
		if l.last != 0 {
			s.Last = r.f(base, l.last)
		}
		if l.n == 0 {
			s.Count++
			continue
		}
		bn, bsum := r.w[base+l.n], r.f(base, l.sum)
		s.Count += int(bn)
		s.Sum += bsum
		if slope {
			x, y := float64(num-oldest), bsum/float64(bn)
			nb++
			sx += x
			sy += y
			sxx += x * x
			sxy += x * y
		}
	}
	if d := nb*sxx - sx*sx; nb >= 2 && d != 0 {
		perBucket := (nb*sxy - sx*sy) / d
		s.Slope = perBucket / time.Duration(l.res).Seconds()
	}
	return s
}

// bounds returns the bucket numbers Stats reads.
func (r Ring) bounds(now int64, span time.Duration) (oldest, newest int64) {
	res := r.lay.res
	k := max(min((int64(span)+res-1)/res+1, r.len()), 1)
	return now/res - k + 1, now/res + 1
}

// find returns the word index of the bucket numbered num, -1 if the ring
// does not hold it.
func (r Ring) find(num int64) int64 {
	if num <= 0 {
		return -1
	}
	base := (num % r.len()) * r.lay.stride
	if int64(r.w[base]) != num {
		return -1
	}
	return base
}

// Last is Stats(now, span).Last, found by walking back from the newest
// bucket: usually one or two buckets read instead of the window's. It
// needs FieldLast.
func (r Ring) Last(now int64, span time.Duration) (float64, bool) {
	oldest, newest := r.bounds(now, span)
	for num := newest; num >= oldest; num-- {
		if base := r.find(num); base >= 0 {
			return r.f(base, r.lay.last), true
		}
	}
	return 0, false
}

// Increase is Stats(now, span).Last − First, for counters: it reads the
// newest and the oldest buckets holding samples and none between. It needs
// FieldFirst and FieldLast.
func (r Ring) Increase(now int64, span time.Duration) (float64, bool) {
	last, ok := r.Last(now, span)
	if !ok {
		return 0, false
	}
	oldest, newest := r.bounds(now, span)
	for num := oldest; num <= newest; num++ {
		if base := r.find(num); base >= 0 {
			return last - r.f(base, r.lay.first), true
		}
	}
	return 0, false
}
