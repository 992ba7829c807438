package window

// refRing is the ring as it was before layouts (every bucket kept count,
// sum, min, max, first and last): the reference the differential tests
// hold every layout to.

import "time"

type refBucket struct {
	num   int64 // bucket number (unix ns / res); 0 means never used
	n     uint32
	sum   float64
	min   float64
	max   float64
	first float64
	last  float64
}

// Ring is a rolling window of one value. The zero Ring is unusable; make
// one with New. A Ring is not safe for concurrent use.
type refRing struct {
	res     int64
	buckets []refBucket
}

func newRef(res time.Duration, n int) refRing {
	return refRing{res: max(int64(res), int64(time.Millisecond)), buckets: make([]refBucket, max(n, 2))}
}

// Add records v at unix time at (nanoseconds). Within a bucket, last is
// the value added last, not the one with the latest time.
func (r *refRing) Add(at int64, v float64) {
	num := at / r.res
	b := &r.buckets[num%int64(len(r.buckets))]
	switch {
	case b.num == num:
		b.n++
		b.sum += v
		b.min = min(b.min, v)
		b.max = max(b.max, v)
		b.last = v
	case b.num < num:
		*b = refBucket{num: num, n: 1, sum: v, min: v, max: v, first: v, last: v}
	default:
		// The slot holds a newer bucket: at is older than the ring's span.
	}
}

// Stats sums up the buckets within span of now (unix ns): the bucket of now
// and the ceil(span/res) before it, at most the whole ring, so a window
// covers at least span and at most span+res. The bucket after now's counts
// too: a sample stamped by a clock slightly ahead is not lost. Slope is
// left 0; StatsSlope computes it. Neither allocates.
func (r *refRing) Stats(now int64, span time.Duration) Stats { return r.stats(now, span, false) }

// StatsSlope is Stats with Slope.
func (r *refRing) StatsSlope(now int64, span time.Duration) Stats { return r.stats(now, span, true) }

func (r *refRing) stats(now int64, span time.Duration, slope bool) Stats {
	n := int64(len(r.buckets))
	oldest, newest := r.bounds(now, span)
	var s Stats
	// Least squares over (bucket number relative to oldest, bucket mean).
	var nb, sx, sy, sxx, sxy float64
	// Walk the slots from oldest's without a division per bucket. Each slot
	// matches at most one number, so a range one longer than the ring
	// counts no bucket twice.
	slot := oldest % n
	for num := oldest; num <= newest; num++ {
		b := &r.buckets[slot]
		if slot++; slot == n {
			slot = 0
		}
		if b.num != num || b.n == 0 {
			continue
		}
		// Buckets come in time order: the first one seen holds First,
		// the last one Last.
		if s.Count == 0 {
			s.Min, s.Max, s.First = b.min, b.max, b.first
		} else {
			s.Min, s.Max = min(s.Min, b.min), max(s.Max, b.max)
		}
		s.Last = b.last
		s.Count += int(b.n)
		s.Sum += b.sum
		if slope {
			x, y := float64(b.num-oldest), b.sum/float64(b.n)
			nb++
			sx += x
			sy += y
			sxx += x * x
			sxy += x * y
		}
	}
	if d := nb*sxx - sx*sx; nb >= 2 && d != 0 {
		perBucket := (nb*sxy - sx*sy) / d
		s.Slope = perBucket / time.Duration(r.res).Seconds()
	}
	return s
}

// bounds returns the bucket numbers Stats reads.
func (r *refRing) bounds(now int64, span time.Duration) (oldest, newest int64) {
	k := max(min((int64(span)+r.res-1)/r.res+1, int64(len(r.buckets))), 1)
	return now/r.res - k + 1, now/r.res + 1
}

// Last is Stats(now, span).Last, found by walking back from the newest
// bucket: usually one or two buckets read instead of the window's.
func (r *refRing) Last(now int64, span time.Duration) (float64, bool) {
	oldest, newest := r.bounds(now, span)
	n := int64(len(r.buckets))
	for num := newest; num >= oldest; num-- {
		if b := &r.buckets[num%n]; b.num == num && b.n > 0 {
			return b.last, true
		}
	}
	return 0, false
}

// Increase is Stats(now, span).Last − First, for counters: it reads the
// newest and the oldest buckets holding samples and none between.
func (r *refRing) Increase(now int64, span time.Duration) (float64, bool) {
	last, ok := r.Last(now, span)
	if !ok {
		return 0, false
	}
	oldest, newest := r.bounds(now, span)
	n := int64(len(r.buckets))
	for num := oldest; num <= newest; num++ {
		if b := &r.buckets[num%n]; b.num == num && b.n > 0 {
			return last - b.first, true
		}
	}
	return 0, false
}
