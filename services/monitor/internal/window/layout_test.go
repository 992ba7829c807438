package window

import (
	"math/rand/v2"
	"testing"
	"time"
)

// TestLayoutsMatchTheFullRing feeds random samples (out of order, with
// gaps, late and early ones, repeated and negative values) to rings of
// every layout and to the reference ring that keeps every field, and
// queries random windows: every kept field of Stats, StatsSlope, Last and
// Increase must be bit for bit the reference's.
func TestLayoutsMatchTheFullRing(t *testing.T) {
	rng := rand.New(rand.NewPCG(17, 4))
	for trial := range 3000 {
		fields := Fields(rng.IntN(int(FieldAll) + 1))
		res := []time.Duration{time.Millisecond, time.Second, 5 * time.Second, time.Minute}[rng.IntN(4)]
		n := 1 + rng.IntN(70)
		ref, got := newRef(res, n), NewLayout(res, fields).Ring(n)
		if want := max(n, 2) * NewLayout(res, fields).BytesPerBucket(); len(got.w)*8 != want {
			t.Fatalf("ring of %d buckets takes %d bytes, want %d", n, len(got.w)*8, want)
		}
		now := t0
		for range rng.IntN(400) {
			// Time mostly moves forward, sometimes jumps or goes back.
			switch rng.IntN(10) {
			case 0:
				now += int64(rng.IntN(3*n)) * int64(res)
			case 1:
				now -= int64(rng.IntN(n+2)) * int64(res)
			default:
				now += int64(rng.Int64N(int64(res)))
			}
			at := now + int64(rng.IntN(3)-1)*int64(res)
			var v float64
			switch rng.IntN(4) {
			case 0:
				v = float64(rng.IntN(5)) // repeats and ties
			case 1:
				v = float64(rng.Uint64N(1 << 53)) // counters: exact integers
			default:
				v = (rng.Float64() - 0.3) * 200
			}
			ref.Add(at, v)
			got.Add(at, v)
			q := now + int64(rng.IntN(5)-2)*int64(res)
			span := time.Duration(rng.Int64N(int64(res) * int64(n+3)))
			check(t, trial, fields, &ref, &got, q, span)
		}
	}
}

func check(t *testing.T, trial int, fields Fields, ref *refRing, got *Ring, now int64, span time.Duration) {
	t.Helper()
	for _, slope := range []bool{false, true} {
		want, have := ref.stats(now, span, slope), got.stats(now, span, slope)
		if (want.Count > 0) != (have.Count > 0) {
			t.Fatalf("trial %d fields %b: Count %d, want %d", trial, fields, have.Count, want.Count)
		}
		if fields&FieldSum == 0 {
			want.Count, want.Sum, want.Slope = have.Count, 0, 0
		}
		if fields&FieldMin == 0 {
			want.Min = 0
		}
		if fields&FieldMax == 0 {
			want.Max = 0
		}
		if fields&FieldFirst == 0 {
			want.First = 0
		}
		if fields&FieldLast == 0 {
			want.Last = 0
		}
		if have != want {
			t.Fatalf("trial %d fields %b slope %v: Stats = %+v, want %+v", trial, fields, slope, have, want)
		}
	}
	if fields&FieldLast != 0 {
		wv, wok := ref.Last(now, span)
		hv, hok := got.Last(now, span)
		if wv != hv || wok != hok {
			t.Fatalf("trial %d fields %b: Last = %v, %v; want %v, %v", trial, fields, hv, hok, wv, wok)
		}
		if fields&FieldFirst != 0 {
			wv, wok := ref.Increase(now, span)
			hv, hok := got.Increase(now, span)
			if wv != hv || wok != hok {
				t.Fatalf("trial %d fields %b: Increase = %v, %v; want %v, %v", trial, fields, hv, hok, wv, wok)
			}
		}
	}
}

func TestAddOfEveryLayoutDoesNotAllocate(t *testing.T) {
	for fields := range FieldAll + 1 {
		r := NewLayout(time.Second, fields).Ring(60)
		i := int64(0)
		if n := testing.AllocsPerRun(200, func() {
			i++
			r.Add(t0+i*int64(100*time.Millisecond), float64(i))
			_ = r.StatsSlope(t0+i*int64(100*time.Millisecond), time.Minute)
			_, _ = r.Last(t0+i*int64(100*time.Millisecond), time.Minute)
		}); n != 0 {
			t.Errorf("fields %b: Add+Stats allocate %v times per run", fields, n)
		}
	}
}
