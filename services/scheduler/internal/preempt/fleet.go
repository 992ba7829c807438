package preempt

import (
	"cmp"
	"slices"
	"time"

	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// Fleet is what every victim search over one snapshot and one list of
// running allocations shares: the nodes in ID order, the units (a job, or
// every part of a gang) and what evicting each costs. A scheduling cycle
// makes one and runs its searches (up to four preemptors, each once per
// pool it may reclaim in and once by priority) over it, instead of
// grouping and pricing ~38,000 running allocations per search at issue
// 17's scale. Decisions are those of Choose on the same inputs: Choose is
// a Fleet of one search.
//
// The snapshot's nodes are read when a search runs, not copied: a caller
// may hold devices on them between searches (what an earlier decision
// claimed), as it may between Choose calls.
type Fleet struct {
	snap    placement.Snapshot
	nodes   []*placement.Node // node ID ascending
	running []Running
	rank    []int // per running: its Priority.Rank()
	units   []unit
	unitOf  []int // running index -> unit
	nodeOf  []int // running index -> node ord, -1 when not in the snapshot
	now     time.Time
	// removed is per running allocation, gone per unit: what Remove took
	// out. split: a removal took some of a unit's parts and not the others,
	// so the units are no longer those of the remaining list.
	removed []bool
	gone    []bool
	split   bool
	// facts are what judging an allocation for a preemptor reads of it
	// (judge.go).
	facts facts
}

// NewFleet prepares searches over snap and running at now (the progress a
// victim loses is counted to now). running is not modified.
func NewFleet(snap placement.Snapshot, running []Running, now time.Time) *Fleet {
	f := &Fleet{snap: snap, running: running, now: now}
	f.nodes = make([]*placement.Node, len(snap.Nodes))
	for i := range snap.Nodes {
		f.nodes[i] = &snap.Nodes[i]
	}
	slices.SortStableFunc(f.nodes, func(a, b *placement.Node) int { return cmp.Compare(a.ID, b.ID) })
	ordOf := make(map[string]int, len(f.nodes))
	for i, n := range f.nodes {
		if _, dup := ordOf[n.ID]; !dup {
			ordOf[n.ID] = i
		}
	}
	f.gatherFacts()
	f.buildUnits(ordOf)
	f.removed = make([]bool, len(running))
	f.gone = make([]bool, len(f.units))
	return f
}

// buildUnits groups running into units and prices each one.
func (f *Fleet) buildUnits(ordOf map[string]int) {
	var gangs map[string]int
	counts := make([]int, 0, len(f.running))
	f.units = make([]unit, 0, len(f.running))
	f.unitOf = make([]int, len(f.running))
	f.nodeOf = make([]int, len(f.running))
	f.rank = make([]int, len(f.running))
	lastNode, lastOrd := "", -1
	for i := range f.running {
		v := &f.running[i]
		u := len(counts)
		if v.Gang != "" {
			if gu, ok := gangs[v.Gang]; ok {
				u = gu
			} else {
				if gangs == nil {
					gangs = map[string]int{}
				}
				gangs[v.Gang] = u
			}
		}
		if u == len(counts) {
			counts = append(counts, 0)
			f.units = append(f.units, unit{cost: cost{jobs: 1, rank: noRank}})
		}
		counts[u]++
		f.unitOf[i] = u
		f.rank[i] = v.Priority.Rank()
		un := &f.units[u]
		un.cost.rank = max(un.cost.rank, f.rank[i])
		un.cost.milli += f.facts.milli[i]
		un.cost.lost = max(un.cost.lost, lost(v, f.now))
		if !v.Checkpointable {
			un.cost.noCkpt = 1
		}
		// Allocations usually come grouped by node: one lookup per run.
		if i == 0 || v.NodeID != lastNode {
			lastNode, lastOrd = v.NodeID, -1
			if o, ok := ordOf[v.NodeID]; ok {
				lastOrd = o
			}
		}
		f.nodeOf[i] = lastOrd
	}
	flat := make([]int, len(f.running))
	off := 0
	for u := range f.units {
		f.units[u].parts = flat[off : off : off+counts[u]]
		off += counts[u]
	}
	for i, u := range f.unitOf {
		f.units[u].parts = append(f.units[u].parts, i)
	}
}

// Remove takes the running allocations match reports out of every later
// search, as if they were not in the list (a decision's victims, which the
// next decisions must not count on).
func (f *Fleet) Remove(match func(*Running) bool) {
	f.removeIdx(func(i int) bool { return match(&f.running[i]) })
}

// removeIdx is Remove with match asked of running indices.
func (f *Fleet) removeIdx(match func(int) bool) {
	for u, un := range f.units {
		if f.gone[u] {
			continue
		}
		n := 0
		for _, i := range un.parts {
			if !f.removed[i] && match(i) {
				f.removed[i] = true
			}
			if f.removed[i] {
				n++
			}
		}
		switch n {
		case 0:
		case len(un.parts):
			f.gone[u] = true
		default:
			f.split = true
		}
	}
}

// Choose is Choose(snap, running less what Remove took and what skip (when
// not nil) reports, p, opt).
func (f *Fleet) Choose(p Preemptor, opt Options, skip func(*Running) bool) (Choice, bool) {
	gone := f.gone
	whole := !f.split && opt.Now.Equal(f.now)
	if whole && skip != nil {
		gone = slices.Clone(f.gone)
		for u, un := range f.units {
			if gone[u] {
				continue
			}
			n := 0
			for _, i := range un.parts {
				if skip(&f.running[i]) {
					n++
				}
			}
			if n == len(un.parts) {
				gone[u] = true
			} else if n > 0 {
				whole = false
				break
			}
		}
	}
	if !whole {
		// The units of what is left are not the fleet's (a gang cut in
		// two), or the costs are of another time: a fleet of its own.
		rs := make([]Running, 0, len(f.running))
		for i := range f.running {
			if !f.removed[i] && (skip == nil || !skip(&f.running[i])) {
				rs = append(rs, f.running[i])
			}
		}
		return NewFleet(f.snap, rs, opt.Now).Choose(p, opt, nil)
	}
	c, ok := f.newChooser(p, opt, gone)
	if !ok {
		return Choice{}, false
	}
	return c.run()
}
