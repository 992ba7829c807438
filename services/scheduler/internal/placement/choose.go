package placement

import (
	"math/bits"
	"slices"
)

// The pick functions work on a view: a node's slots (by Index) or a class's
// canonical slots. Whether they succeed depends only on the multiset of
// cards per NVLink domain, so a class fits exactly when each member does;
// which positions they pick is the device choice on a member.

// pickWhole finds s.k whole cards of one model (the smallest model id that
// has them). With NVLink required, or preferDomain and several cards, it
// takes the tightest NVLink domain that holds them (fewest such cards, ties
// to the lowest domain ordinal); otherwise, or when preferDomain finds no
// domain, the lowest positions. domFree is the chosen domain's count of
// such cards, 0 when the cards are not taken from one domain.
func (p *Placer) pickWhole(v []slot, s *shape, preferDomain bool, out []int) (picked []int, domFree int, ok bool) {
	var modelBuf [8]int32
	models := modelBuf[:0]
	n := 0
	for i := range v {
		if p.wholeOK(&v[i], s, -1) {
			n++
			if m := p.kinds[v[i].kind].model; !slices.Contains(models, m) {
				models = append(models, m)
			}
		}
	}
	if n < s.k {
		return nil, 0, false
	}
	slices.Sort(models)
	var cntBuf [32]int
	for _, m := range models {
		if s.nvlink || (preferDomain && s.k > 1) {
			cnt := cntBuf[:0]
			if len(v) > len(cntBuf) {
				cnt = make([]int, 0, len(v))
			}
			for i := range v {
				if d := int(v[i].domain); d >= 0 && p.wholeOK(&v[i], s, m) {
					for len(cnt) <= d {
						cnt = append(cnt, 0)
					}
					cnt[d]++
				}
			}
			best := -1
			for d, c := range cnt {
				if c >= s.k && (best < 0 || c < cnt[best]) {
					best = d
				}
			}
			if best >= 0 {
				out = out[:0]
				for i := range v {
					if len(out) < s.k && int(v[i].domain) == best && p.wholeOK(&v[i], s, m) {
						out = append(out, i)
					}
				}
				return out, cnt[best], true
			}
			if s.nvlink {
				continue
			}
		}
		out = out[:0]
		for i := range v {
			if len(out) < s.k && p.wholeOK(&v[i], s, m) {
				out = append(out, i)
			}
		}
		if len(out) == s.k {
			return out, 0, true
		}
	}
	return nil, 0, false
}

// wholeOK reports whether sl is a free whole card s may take (of model m,
// or any allowed model when m < 0).
func (p *Placer) wholeOK(sl *slot, s *shape, m int32) bool {
	k := &p.kinds[sl.kind]
	return !k.mig && sl.whole() && k.memMiB >= s.minMem && (m < 0 && s.allows(k.model) || k.model == m)
}

// pickMIG finds a free instance of s's profile: on the MIG card with the
// fewest free instances (ties to the lowest position), the lowest start.
func (p *Placer) pickMIG(v []slot, s *shape) (pos, inst int, ok bool) {
	pos, inst = -1, -1
	bestFree := 0
	for i := range v {
		sl := &v[i]
		k := &p.kinds[sl.kind]
		if !k.mig || sl.held || !s.allows(k.model) {
			continue
		}
		in := -1
		for m := sl.migFree; m != 0; m &= m - 1 {
			j := bits.TrailingZeros64(m)
			x := &k.inst[j]
			if x.profile == s.profile && x.memMiB >= s.minMem && (in < 0 || x.start < k.inst[in].start) {
				in = j
			}
		}
		if in < 0 {
			continue
		}
		if free := bits.OnesCount64(sl.migFree); pos < 0 || free < bestFree {
			pos, inst, bestFree = i, in, free
		}
	}
	return pos, inst, pos >= 0
}

// shareOK reports whether s's share fits card sl.
func (p *Placer) shareOK(sl *slot, s *shape) bool {
	k := &p.kinds[sl.kind]
	return !k.mig && !sl.held && s.allows(k.model) && k.memMiB >= s.minMem &&
		sl.mem+s.shareMem <= k.memMiB && int64(sl.pct)+int64(s.sharePct) <= 100
}

// pickShare finds the tightest card for s's share: least compute left
// after it, then least framebuffer left, then the lowest position.
func (p *Placer) pickShare(v []slot, s *shape) (int, bool) {
	best := -1
	var bestPct, bestMem int64
	for i := range v {
		sl := &v[i]
		if !p.shareOK(sl, s) {
			continue
		}
		pct, mem := 100-int64(sl.pct), p.kinds[sl.kind].memMiB-sl.mem
		if best < 0 || pct < bestPct || pct == bestPct && mem < bestMem {
			best, bestPct, bestMem = i, pct, mem
		}
	}
	return best, best >= 0
}
