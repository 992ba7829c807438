package preempt

import (
	"cmp"
	"math"
	"math/bits"
	"slices"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// nodeSearch prices nodes for one selection; evicted holds the units the
// selection already evicts (free for the nodes priced after). Its buffers
// are reused from node to node: a cycle prices thousands.
type nodeSearch struct {
	c        *chooser
	evicted  []bool
	nc       nodeCase
	gone     []int
	cardItem []int // per GPU: its item, or -1
	slotItem []int // per GPU slot, from slotBase: its item, or -1
	slotBase []int
	// used is what the selection's victims so far take from each budget
	// (Options.Spare), tmp scratch of the same length; nil without budgets.
	used, tmp []int64
}

// nodeCase is one node being priced: its state with the already evicted
// units gone, the candidates (cheapest first) and what each frees.
type nodeCase struct {
	c         *chooser
	ord       int
	base      *placement.Node
	pairs     []unitPart // the candidates' parts on this node, by unit
	cands     []int      // units
	span      [][2]int   // per candidate: its parts, pairs[span[0]:span[1]]
	costs     []cost     // per candidate
	items     []item
	groups    int  // distinct item groups
	hostShort bool // the node lacks host CPU or memory for the request
	// Only with at most 64 candidates (masks), filled by setBits:
	cpu, mem []int64 // per candidate, on this node
	// allowed are the candidates of the class searched and below (masks);
	// maxRank is that class (greedy, any number of candidates).
	allowed uint64
	maxRank int
	used    []int64 // the search's, see nodeSearch
	tmp     []int64
	levels  []int
	// Buffers kept from node to node:
	counts  []int // per group
	lbs     [][]int64
	scratch []int
	subsets []subset
	freed   placement.Node
}

type unitPart struct{ unit, part int }

// item is one thing on the node the request could take: a card (whole or
// share requests) or an existing MIG slot of the profile asked for.
type item struct {
	group    int // whole GPUs of one request come from one group
	held     bool
	memMiB   int64 // the card's framebuffer
	shareMem int64
	sharePct int
	wholeBy  uint64 // candidates holding the card or slot whole
	holders  uint64 // every candidate with a device on it
	shares   []shareHold
	// What the candidates' devices on it weigh, in milli-GPUs: all of
	// them, and the lightest one (MaxInt64 for none).
	holdMilli, minHold int64
}

type shareHold struct {
	bit uint64
	mem int64
	pct int
}

// estimate is a lower bound on what node o needs evicted: the lowest
// class whose candidates, with every lower class's, could make room, and
// the milli-GPUs at that class; false when evicting every candidate would
// not make room.
func (s *nodeSearch) estimate(o int) (rank int, milli int64, ok bool) {
	nc, ok := s.prepare(o, false)
	if !ok {
		return 0, 0, false
	}
	if len(nc.cands) > maxExactCandidates {
		return noRank, 0, true
	}
	// Most nodes that cannot make room at all are dismissed with one check.
	full := nc.fullMask()
	if !nc.roomFor(full) {
		return 0, 0, false
	}
	levels := nc.classes()
	for _, lv := range levels[:len(levels)-1] {
		if m := nc.classMask(lv); nc.roomFor(m) {
			nc.allowed = m
			return lv, nc.lowerBound(m), true
		}
	}
	return levels[len(levels)-1], nc.lowerBound(full), true
}

// best is the cheapest set of candidates whose eviction lets the request
// fit on node o, or false when none does. With a bound (a result of
// another node) it is false too when o cannot beat the bound. Classes are
// searched from the lowest: the first class at which a set fits has the
// cheapest set, whatever the GPUs of sets of higher classes.
func (s *nodeSearch) best(o int, bound *nodeResult) (nodeResult, bool) {
	nc, ok := s.prepare(o, true)
	if !ok {
		return nodeResult{}, false
	}
	for _, lv := range nc.classes() {
		b := bound
		if b != nil {
			if lv > b.cost.rank {
				break
			}
			if lv < b.cost.rank {
				b = nil // any set of a lower class beats it
			}
		}
		set, found := nc.atClass(lv, b)
		if !found {
			continue
		}
		res := nodeResult{ord: o, cost: cost{rank: noRank}}
		for _, i := range set {
			res.units = append(res.units, nc.cands[i])
			res.cost = res.cost.add(nc.costs[i])
		}
		return res, true
	}
	return nodeResult{}, false
}

// atClass is the cheapest set of candidates of class lv or lower that lets
// the request fit and keeps to the budgets, or false. With a bound of the
// same class it is false too when no set beats the bound.
func (nc *nodeCase) atClass(lv int, bound *nodeResult) ([]int, bool) {
	nc.maxRank = lv
	if len(nc.cands) > maxExactCandidates {
		return nc.greedy()
	}
	nc.allowed = nc.classMask(lv)
	if !nc.roomFor(nc.allowed) {
		return nil, false
	}
	mask, st := uint64(0), searchGaveUp
	if nc.byCardsApplies() {
		mask, st = nc.byCards(bound)
	}
	if st == searchGaveUp {
		mask, st = nc.exact(bound)
	}
	switch st {
	case searchFound:
		return maskSet(mask), true
	case searchGaveUp:
		return nc.greedy()
	}
	return nil, false
}

// classes are the classes to search, lowest first: none (evict nothing),
// then each candidate's.
func (nc *nodeCase) classes() []int {
	lv := append(nc.levels[:0], noRank)
	for _, c := range nc.costs {
		lv = append(lv, c.rank)
	}
	slices.Sort(lv)
	nc.levels = slices.Compact(lv)
	return nc.levels
}

// classMask is the candidates of class lv or lower.
func (nc *nodeCase) classMask(lv int) uint64 {
	var m uint64
	for k, c := range nc.costs {
		if c.rank <= lv {
			m |= 1 << k
		}
	}
	return m
}

// budgetOK reports whether evicting the candidates of mask keeps every
// tenant at or above its guarantee, with what the selection already
// evicts.
func (nc *nodeCase) budgetOK(mask uint64) bool {
	c := nc.c
	if len(c.budgets) == 0 {
		return true
	}
	return c.withinBudgets(nc.used, nc.tmp, func(yield func(int) bool) {
		for m := mask; m != 0; m &= m - 1 {
			if !yield(nc.cands[bits.TrailingZeros64(m)]) {
				return
			}
		}
	})
}

// prepare builds the node case of o, its candidates cheapest first when
// sorted; false when the request can use nothing on it whatever is
// evicted. The case lives until the next call.
func (s *nodeSearch) prepare(o int, sorted bool) (*nodeCase, bool) {
	c := s.c
	n := c.nodes[o]
	nc := &s.nc
	*nc = nodeCase{c: c, ord: o, base: n, pairs: nc.pairs[:0], cands: nc.cands[:0], span: nc.span[:0], costs: nc.costs[:0],
		items: nc.items[:0], cpu: nc.cpu[:0], mem: nc.mem[:0], scratch: nc.scratch[:0], subsets: nc.subsets[:0],
		counts: nc.counts[:0], lbs: nc.lbs[:0], levels: nc.levels[:0], used: s.used, tmp: s.tmp, maxRank: -noRank}
	s.gone = s.gone[:0]
	for _, i := range c.onNode[o] {
		if u := c.unitOf[i]; s.evicted[u] {
			s.gone = append(s.gone, i)
		} else {
			nc.pairs = append(nc.pairs, unitPart{u, i})
		}
	}
	if len(s.gone) > 0 {
		nc.freed = freeParts(n, c.running, s.gone)
		nc.base = &nc.freed
	}
	s.indexItems(nc)
	if len(nc.items) == 0 {
		return nil, false
	}
	cpuShort := nc.base.CPUMilliFree < c.req.CPUMilli
	memShort := nc.base.MemoryMiBFree < c.req.MemoryMiB
	nc.hostShort = cpuShort || memShort
	// A candidate is kept only if it frees something the request can use;
	// evicting any other one never helps, so no minimal set holds it.
	for lo := 0; lo < len(nc.pairs); {
		hi := lo + 1
		for hi < len(nc.pairs) && nc.pairs[hi].unit == nc.pairs[lo].unit {
			hi++
		}
		relevant := false
		for _, p := range nc.pairs[lo:hi] {
			v := &c.running[p.part]
			if (cpuShort && v.CPUMilli > 0) || (memShort && v.MemoryMiB > 0) {
				relevant = true
			}
			for _, d := range v.Devices {
				if s.itemOf(nc.base, d) >= 0 {
					relevant = true
				}
			}
		}
		if relevant {
			nc.cands = append(nc.cands, nc.pairs[lo].unit)
			nc.span = append(nc.span, [2]int{lo, hi})
		}
		lo = hi
	}
	if !sorted || len(nc.cands) > maxExactCandidates {
		for _, u := range nc.cands {
			nc.costs = append(nc.costs, c.units[u].cost)
		}
	} else {
		nc.sortCands()
	}
	if len(nc.cands) <= maxExactCandidates {
		s.setBits(nc)
		nc.allowed = nc.fullMask()
	}
	return nc, true
}

// sortCands orders the candidates cheapest first, as the exact search
// needs; each keeps its span.
func (nc *nodeCase) sortCands() {
	c := nc.c
	order := nc.scratch[:0]
	for k := range nc.cands {
		order = append(order, k)
	}
	slices.SortFunc(order, func(a, b int) int {
		ua, ub := nc.cands[a], nc.cands[b]
		ca, cb := c.units[ua].cost, c.units[ub].cost
		return cmp.Or(ca.compareAdditive(cb), cmp.Compare(ca.rank, cb.rank), cmp.Compare(ua, ub))
	})
	cands, span := slices.Clone(nc.cands), slices.Clone(nc.span)
	for k, from := range order {
		nc.cands[k], nc.span[k] = cands[from], span[from]
		nc.costs = append(nc.costs, c.units[cands[from]].cost)
	}
	nc.scratch = order
}

// setBits records, per item, which candidates hold it and how, and each
// candidate's host CPU and memory.
func (s *nodeSearch) setBits(nc *nodeCase) {
	c := s.c
	for k := range nc.cands {
		bit := uint64(1) << k
		var cpu, mem int64
		for _, p := range nc.pairs[nc.span[k][0]:nc.span[k][1]] {
			v := &c.running[p.part]
			cpu += v.CPUMilli
			mem += v.MemoryMiB
			for _, d := range v.Devices {
				it := s.itemOf(nc.base, d)
				if it < 0 {
					continue
				}
				x := &nc.items[it]
				if d.Share != nil && d.MIG == nil {
					x.shares = append(x.shares, shareHold{bit: bit, mem: d.Share.MemoryMiB, pct: d.Share.ComputePercent})
				} else {
					x.wholeBy |= bit
				}
				x.holders |= bit
				m := d.MilliGPUs()
				x.holdMilli += m
				x.minHold = min(x.minHold, m)
			}
		}
		nc.cpu = append(nc.cpu, cpu)
		nc.mem = append(nc.mem, mem)
	}
}

// indexItems fills nc.items with what the request could take on nc.base.
func (s *nodeSearch) indexItems(nc *nodeCase) {
	c := s.c
	n := nc.base
	g := c.req.GPU
	allowed := g.AllowedModels()
	nvlink := g.Topology == contracts.TopologyNVLink
	s.cardItem = slices.Grow(s.cardItem[:0], len(n.GPUs))[:len(n.GPUs)]
	s.slotBase = slices.Grow(s.slotBase[:0], len(n.GPUs))[:len(n.GPUs)]
	s.slotItem = s.slotItem[:0]
	for gi := range n.GPUs {
		s.cardItem[gi] = -1
		s.slotBase[gi] = len(s.slotItem)
		gpu := &n.GPUs[gi]
		ok := modelAllowed(allowed, gpu.Model)
		if c.kind == contracts.GPUKindMIG {
			for si := range gpu.Instances {
				it := -1
				if ok && gpu.MIG && gpu.Instances[si].Instance.Profile == g.MIGProfile {
					it = len(nc.items)
					nc.items = append(nc.items, item{held: gpu.Instances[si].Held, minHold: math.MaxInt64})
				}
				s.slotItem = append(s.slotItem, it)
			}
			continue
		}
		if !ok || gpu.MIG || (c.kind == contracts.GPUKindWhole && gpu.MemoryMiB < g.MemoryMiB) {
			continue
		}
		group := 0
		if c.kind == contracts.GPUKindWhole {
			// FitNode takes a job's whole GPUs of one model and, for
			// NVLink, of one domain (never a PCIe-only card).
			if nvlink && gpu.NVLinkDomain == "" {
				continue
			}
			group = -1
			for j := gi - 1; j >= 0; j-- { // the card before is the usual match
				if o := &n.GPUs[j]; s.cardItem[j] >= 0 && o.Model == gpu.Model && (!nvlink || o.NVLinkDomain == gpu.NVLinkDomain) {
					group = nc.items[s.cardItem[j]].group
					break
				}
			}
			if group < 0 {
				group = nc.groups
				nc.groups++
			}
		}
		s.cardItem[gi] = len(nc.items)
		nc.items = append(nc.items, item{group: group, held: gpu.Held, memMiB: gpu.MemoryMiB,
			shareMem: gpu.ShareMemMiB, sharePct: gpu.SharePercent, minHold: math.MaxInt64})
	}
	nc.groups = max(nc.groups, 1)
}

// itemOf is the item a device of n maps to; -1 when the request cannot use
// what the device frees.
func (s *nodeSearch) itemOf(n *placement.Node, d contracts.DeviceRef) int {
	gi := findGPU(n.GPUs, d)
	if gi < 0 {
		return -1
	}
	if s.c.kind != contracts.GPUKindMIG {
		if d.MIG != nil {
			return -1
		}
		return s.cardItem[gi]
	}
	if d.MIG == nil {
		return -1
	}
	if si := findSlot(n.GPUs[gi].Instances, d.MIG); si >= 0 {
		return s.slotItem[s.slotBase[gi]+si]
	}
	return -1
}

// modelAllowed matches a card's model against the request's list (nil: any
// model), leniently: these checks only skip work, FitNode has the last word.
func modelAllowed(allowed []string, model string) bool {
	return len(allowed) == 0 || slices.ContainsFunc(allowed, func(m string) bool { return strings.EqualFold(m, model) })
}

// roomFor is a necessary condition for the request to fit with the
// candidates of mask evicted: enough host CPU and memory, and enough cards
// or slots left free. It never says no where FitNode would say yes; it
// spares FitNode (and a copy of the node) for most subsets.
func (nc *nodeCase) roomFor(mask uint64) bool {
	c := nc.c
	cpu, mem := nc.base.CPUMilliFree, nc.base.MemoryMiBFree
	for m := mask; m != 0; m &= m - 1 {
		i := bits.TrailingZeros64(m)
		cpu += nc.cpu[i]
		mem += nc.mem[i]
	}
	if cpu < c.req.CPUMilli || mem < c.req.MemoryMiB {
		return false
	}
	need := nc.need()
	if need <= 0 {
		return true
	}
	nc.counts = slices.Grow(nc.counts[:0], nc.groups)[:nc.groups]
	clear(nc.counts)
	for k := range nc.items {
		it := &nc.items[k]
		if nc.usable(it, mask) {
			if nc.counts[it.group]++; nc.counts[it.group] >= need {
				return true
			}
		}
	}
	return false
}

// need is how many items the request takes.
func (nc *nodeCase) need() int {
	if nc.c.kind == contracts.GPUKindWhole {
		return nc.c.perGPUs
	}
	return 1
}

// usable says whether the request could take it once the candidates of
// mask are gone.
func (nc *nodeCase) usable(it *item, mask uint64) bool {
	if it.held && (it.wholeBy == 0 || it.wholeBy&^mask != 0) {
		return false
	}
	sm, sp := it.shareMem, it.sharePct
	for _, h := range it.shares {
		if mask&h.bit != 0 {
			sm -= h.mem
			sp -= h.pct
		}
	}
	switch nc.c.kind {
	case contracts.GPUKindWhole:
		return sm <= 0 && sp <= 0
	case contracts.GPUKindShare:
		sh := nc.c.req.GPU.Share
		return it.memMiB-max(sm, 0) >= sh.MemoryMiB && 100-max(sp, 0) >= sh.ComputePercent
	}
	return true
}

// lowerBound is at most the milli-GPUs of any fitting subset: the need
// cheapest items of one group to clear, where clearing a card for whole
// GPUs, or a MIG slot, evicts every device on it, and making room on a card
// for a share evicts at least its lightest device. Devices on different
// items are different devices, so their weights add up.
func (nc *nodeCase) lowerBound(all uint64) int64 {
	for len(nc.lbs) < nc.groups {
		nc.lbs = append(nc.lbs, nil)
	}
	nc.lbs = nc.lbs[:nc.groups]
	for g := range nc.lbs {
		nc.lbs[g] = nc.lbs[g][:0]
	}
	for k := range nc.items {
		it := &nc.items[k]
		var m int64
		switch {
		case nc.usable(it, 0):
		case !nc.usable(it, all):
			continue
		case nc.c.kind == contracts.GPUKindShare:
			m = it.minHold
		default:
			m = it.holdMilli
		}
		nc.lbs[it.group] = append(nc.lbs[it.group], m)
	}
	need := nc.need()
	lb := int64(-1)
	for _, costs := range nc.lbs {
		if len(costs) < need {
			continue
		}
		slices.Sort(costs)
		var sum int64
		for _, m := range costs[:need] {
			sum += m
		}
		if lb < 0 || sum < lb {
			lb = sum
		}
	}
	return max(lb, 0)
}

// fits runs FitNode on the node with the candidates of set evicted.
func (nc *nodeCase) fits(set []int) bool {
	var parts []int
	for _, k := range set {
		for _, p := range nc.pairs[nc.span[k][0]:nc.span[k][1]] {
			parts = append(parts, p.part)
		}
	}
	n := nc.base
	if len(parts) > 0 {
		freed := freeParts(nc.base, nc.c.running, parts)
		n = &freed
	}
	_, ok := placement.FitNode(n, nc.c.req)
	return ok
}

// allMask is the set of every candidate of the class searched.
func (nc *nodeCase) allMask() uint64 { return nc.allowed }

// fullMask is the set of every candidate.
func (nc *nodeCase) fullMask() uint64 {
	if len(nc.cands) == 0 {
		return 0
	}
	return ^uint64(0) >> (64 - len(nc.cands))
}

func maskSet(mask uint64) []int {
	set := make([]int, 0, bits.OnesCount64(mask))
	for m := mask; m != 0; m &= m - 1 {
		set = append(set, bits.TrailingZeros64(m))
	}
	return set
}

type searchStatus int

const (
	searchNone searchStatus = iota
	searchFound
	searchGaveUp
)

// exact finds the cheapest subset of candidates that makes the request
// fit. First the candidates every fitting subset must hold are found (those
// without which even evicting all the others leaves no room): a node full
// of victims for a job that wants all of it costs one check. The other
// candidates are added best-first in the additive order (GPUs, jobs,
// progress lost, not checkpointable) with the classic scheme for subsets in
// order of sum: candidates sorted by cost, a subset whose highest member is
// i begets itself plus i+1 and itself with i replaced by i+1, so each
// subset comes once and never before a cheaper one. The first fitting
// subset fixes the GPUs and jobs; every fitting subset of that level is
// compared in full, since the highest priority is not a sum.
func (nc *nodeCase) exact(bound *nodeResult) (uint64, searchStatus) {
	n := len(nc.cands)
	all := nc.allMask()
	if !nc.roomFor(all) || (bound != nil && nc.lowerBound(all) > bound.cost.milli) {
		return 0, searchNone
	}
	var must uint64
	var opt []int // candidates that may or may not be needed, cheapest first
	for i := range n {
		if all&(1<<i) == 0 {
			continue // of a higher class
		}
		if !nc.roomFor(all &^ (1 << i)) {
			must |= 1 << i
		} else {
			opt = append(opt, i)
		}
	}
	base := cost{}
	for m := must; m != 0; m &= m - 1 {
		base = addKey(base, nc.costs[bits.TrailingZeros64(m)], 1)
	}
	var (
		h        = minHeap[subset]{items: nc.subsets[:0], less: subsetLess}
		best     cost
		bestMask uint64
		found    bool
		allFits  bool
		visits   int
	)
	h.Push(subset{mask: must, last: -1, key: base})
	for h.Len() > 0 {
		s := h.Pop()
		if bound != nil && s.key.compareLevel(bound.cost) > 0 {
			break
		}
		if found && s.key.compareLevel(best) > 0 {
			break
		}
		if visits++; visits > maxVisits {
			if found {
				break
			}
			return 0, searchGaveUp
		}
		if next := s.last + 1; next < len(opt) {
			in := opt[next]
			h.Push(subset{mask: s.mask | 1<<in, last: next, key: addKey(s.key, nc.costs[in], 1)})
			if s.last >= 0 {
				out := opt[s.last]
				key := addKey(addKey(s.key, nc.costs[out], -1), nc.costs[in], 1)
				h.Push(subset{mask: s.mask&^(1<<out) | 1<<in, last: next, key: key})
			}
		}
		full := s.key
		full.rank = noRank
		for m := s.mask; m != 0; m &= m - 1 {
			full.rank = max(full.rank, nc.costs[bits.TrailingZeros64(m)].rank)
		}
		// Only a cheaper set can win; ties go to the first node, and on one
		// node to the subset found first.
		if (bound != nil && !(nodeResult{ord: nc.ord, cost: full}).less(*bound)) || (found && full.compare(best) >= 0) {
			continue
		}
		if !nc.roomFor(s.mask) || !nc.budgetOK(s.mask) {
			continue
		}
		if !allFits {
			// Evicting more never hurts a fit: if all of them gone is not
			// enough, nothing is (topology, or a check roomFor lacks).
			if !nc.fits(maskSet(all)) {
				return 0, searchNone
			}
			allFits = true
		}
		if !nc.fits(maskSet(s.mask)) {
			continue
		}
		best, bestMask, found = full, s.mask, true
	}
	nc.subsets = h.items[:0]
	if !found {
		return 0, searchNone
	}
	return bestMask, searchFound
}

func subsetLess(a, b subset) bool {
	return cmp.Or(a.key.compareAdditive(b.key), cmp.Compare(a.mask, b.mask)) < 0
}

// byCardsApplies: the request takes whole cards or a MIG slot and the
// host has its CPU and memory, so what makes room is exactly clearing
// enough items of one group.
func (nc *nodeCase) byCardsApplies() bool {
	return !nc.hostShort && (nc.c.kind == contracts.GPUKindWhole || nc.c.kind == contracts.GPUKindMIG)
}

// byCards finds the cheapest subset by the items it clears: any fitting
// subset clears need items of one group, and the holders of those items
// alone are a subset no dearer that fits too. So the cheapest fitting
// subset is the cheapest union of holders of need items of one group:
// C(items, need) unions instead of up to 2^candidates subsets. It gives up
// (for exact) where the combinations are too many or FitNode disagrees.
func (nc *nodeCase) byCards(bound *nodeResult) (uint64, searchStatus) {
	all := nc.allMask()
	need := nc.need()
	var (
		best     cost
		bestMask uint64
		found    bool
		visits   int
		idx      = nc.scratch[:0]
	)
	for g := range nc.groups {
		idx = idx[:0]
		for k := range nc.items {
			if it := &nc.items[k]; it.group == g && nc.usable(it, all) {
				idx = append(idx, k)
			}
		}
		if len(idx) < need {
			continue
		}
		if visits += binomial(len(idx), need); visits > maxVisits {
			nc.scratch = idx
			return 0, searchGaveUp
		}
		// pick holds need positions into idx, ascending: every combination
		// in lexicographic order.
		pick := make([]int, need)
		for i := range pick {
			pick[i] = i
		}
		for {
			var mask uint64
			for _, p := range pick {
				mask |= nc.items[idx[p]].holders
			}
			full := nc.maskCost(mask)
			if (bound == nil || (nodeResult{ord: nc.ord, cost: full}).less(*bound)) && (!found || full.compare(best) < 0) &&
				mask&^all == 0 && nc.budgetOK(mask) {
				best, bestMask, found = full, mask, true
			}
			i := need - 1
			for i >= 0 && pick[i] == len(idx)-need+i {
				i--
			}
			if i < 0 {
				break
			}
			pick[i]++
			for j := i + 1; j < need; j++ {
				pick[j] = pick[j-1] + 1
			}
		}
	}
	nc.scratch = idx
	if !found {
		return 0, searchNone
	}
	if !nc.fits(maskSet(bestMask)) {
		return 0, searchGaveUp
	}
	return bestMask, searchFound
}

// maskCost is the full cost of the candidates of mask.
func (nc *nodeCase) maskCost(mask uint64) cost {
	out := cost{rank: noRank}
	for m := mask; m != 0; m &= m - 1 {
		out = out.add(nc.costs[bits.TrailingZeros64(m)])
	}
	return out
}

// binomial is n choose k, saturating well above maxVisits.
func binomial(n, k int) int {
	k = min(k, n-k)
	r := 1
	for i := range k {
		r = r * (n - i) / (i + 1)
		if r > 1<<30 {
			return 1 << 30
		}
	}
	return r
}

// addKey adds (sign 1) or takes away (sign -1) the additive part of b.
func addKey(a, b cost, sign int) cost {
	return cost{milli: a.milli + int64(sign)*b.milli, jobs: a.jobs + sign*b.jobs,
		lost: a.lost + time.Duration(sign)*b.lost, noCkpt: a.noCkpt + sign*b.noCkpt}
}

type subset struct {
	mask uint64
	last int
	key  cost
}

// greedy is kube-scheduler's way: evict every candidate, then reprieve
// them one by one, dearest first, keeping each back that the request can
// spare. The set is minimal by inclusion (no victim can be spared), not
// always the cheapest.
//
// Only candidates of class maxRank or lower are taken; a set that would
// take a tenant below its guarantee is given up (rare: a node with more
// candidates than the exact search handles, or too many subsets).
func (nc *nodeCase) greedy() ([]int, bool) {
	set := make([]int, 0, len(nc.cands))
	for k, c := range nc.costs {
		if c.rank <= nc.maxRank {
			set = append(set, k)
		}
	}
	if !nc.fits(set) {
		return nil, false
	}
	order := slices.Clone(set)
	slices.SortFunc(order, func(a, b int) int { return cmp.Or(nc.costs[b].compare(nc.costs[a]), cmp.Compare(b, a)) })
	for _, k := range order {
		without := slices.DeleteFunc(slices.Clone(set), func(x int) bool { return x == k })
		if nc.fits(without) {
			set = without
		}
	}
	slices.Sort(set)
	if len(nc.c.budgets) > 0 && !nc.c.withinBudgets(nc.used, nc.tmp, func(yield func(int) bool) {
		for _, k := range set {
			if !yield(nc.cands[k]) {
				return
			}
		}
	}) {
		return nil, false
	}
	return set, true
}

// freeParts is n with the devices and host resources of running[parts]
// given back: whole cards unheld, MIG slots freed, shares subtracted. n is
// not modified; the copy shares nothing n's callers could see change.
func freeParts(n *placement.Node, running []Running, parts []int) placement.Node {
	out := *n
	out.GPUs = slices.Clone(n.GPUs)
	for _, i := range parts {
		v := &running[i]
		out.CPUMilliFree += v.CPUMilli
		out.MemoryMiBFree += v.MemoryMiB
		for _, d := range v.Devices {
			gi := findGPU(out.GPUs, d)
			if gi < 0 {
				continue // an unhealthy device is not in the snapshot
			}
			g := &out.GPUs[gi]
			switch {
			case d.MIG != nil:
				si := findSlot(g.Instances, d.MIG)
				if si < 0 {
					continue
				}
				if len(n.GPUs[gi].Instances) > 0 && &g.Instances[0] == &n.GPUs[gi].Instances[0] {
					g.Instances = slices.Clone(g.Instances)
				}
				g.Instances[si].Held = false
			case d.Share != nil:
				g.ShareMemMiB = max(0, g.ShareMemMiB-d.Share.MemoryMiB)
				g.SharePercent = max(0, g.SharePercent-d.Share.ComputePercent)
			default:
				g.Held = false
			}
		}
	}
	return out
}

// findGPU finds d's card by UUID, or by index where d names no UUID.
func findGPU(gpus []placement.GPU, d contracts.DeviceRef) int {
	if i := d.Index; i >= 0 && i < len(gpus) && gpus[i].Index == i && (d.UUID == "" || gpus[i].UUID == "" || gpus[i].UUID == d.UUID) {
		return i // cards listed by index, as the inventory has them
	}
	for i := range gpus {
		if d.UUID != "" && gpus[i].UUID != "" {
			if gpus[i].UUID == d.UUID {
				return i
			}
		} else if gpus[i].Index == d.Index {
			return i
		}
	}
	return -1
}

// findSlot finds a MIG instance by UUID, or by GPU and compute instance.
func findSlot(slots []placement.MIGSlot, m *contracts.MIGInstance) int {
	for i := range slots {
		s := &slots[i].Instance
		if m.UUID != "" && s.UUID != "" {
			if s.UUID == m.UUID {
				return i
			}
		} else if s.GIID == m.GIID && s.CIID == m.CIID {
			return i
		}
	}
	return -1
}
