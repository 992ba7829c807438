package state

import (
	"slices"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

// allocOrder keeps the committed allocations in ID order across cycles:
// between two steady cycles about 1% of ~38,000 allocations commit or are
// released, and sorting them all again was a twentieth of the cycle. It
// is told every change to cluster.allocs (commit, release), and merges the
// changes in when the order is asked for.
type allocOrder struct {
	byID []*contracts.Allocation // sorted as of the last ask
	// added were committed since, gone released or replaced since (by
	// pointer: a commit stores a new one).
	added []*contracts.Allocation
	gone  map[*contracts.Allocation]bool
	// stale: the changes outgrew the order (a rebuild commits and releases
	// a whole history before its first cycle); the next ask sorts afresh.
	stale bool
}

// add records a committed, now in cluster.allocs.
func (o *allocOrder) add(a *contracts.Allocation, live int) {
	if o.stale {
		return
	}
	o.added = append(o.added, a)
	o.bound(live)
}

// remove records that a left cluster.allocs.
func (o *allocOrder) remove(a *contracts.Allocation, live int) {
	if o.stale {
		return
	}
	if o.gone == nil {
		o.gone = map[*contracts.Allocation]bool{}
	}
	o.gone[a] = true
	o.bound(live)
}

// bound drops the changes once they outnumber what is live: sorting
// afresh is then no dearer than merging, and the lists must not keep
// released allocations alive.
func (o *allocOrder) bound(live int) {
	if len(o.added)+len(o.gone) > max(live, 1024) {
		*o = allocOrder{stale: true}
	}
}

// sorted is allocs in ID order. The result is the order's own: the caller
// must not keep it past the next change.
func (o *allocOrder) sorted(allocs map[string]*contracts.Allocation) []*contracts.Allocation {
	byID := func(x, y *contracts.Allocation) int { return strings.Compare(x.ID, y.ID) }
	if o.stale || o.byID == nil {
		all := make([]*contracts.Allocation, 0, len(allocs))
		for _, a := range allocs {
			all = append(all, a)
		}
		slices.SortFunc(all, byID)
		*o = allocOrder{byID: all}
		return all
	}
	if len(o.gone) > 0 {
		drop := func(a *contracts.Allocation) bool { return o.gone[a] }
		o.byID = slices.DeleteFunc(o.byID, drop)
		o.added = slices.DeleteFunc(o.added, drop)
		clear(o.gone)
	}
	if len(o.added) > 0 {
		slices.SortFunc(o.added, byID)
		merged := make([]*contracts.Allocation, 0, len(o.byID)+len(o.added))
		i, j := 0, 0
		for i < len(o.byID) && j < len(o.added) {
			if byID(o.byID[i], o.added[j]) <= 0 {
				merged = append(merged, o.byID[i])
				i++
			} else {
				merged = append(merged, o.added[j])
				j++
			}
		}
		merged = append(append(merged, o.byID[i:]...), o.added[j:]...)
		o.byID = merged
		clear(o.added)
		o.added = o.added[:0]
	}
	return o.byID
}
