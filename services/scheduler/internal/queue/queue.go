// Package queue holds the jobs waiting for placement: one FIFO per tenant
// and priority class, classes highest first, and tenants within a class
// interleaved, one job each in turn. Which tenant goes first is fair
// share's business (package fairshare orders each cycle by dominant share,
// and the tenant served longest ago among equals), so this order is only
// its input. It only orders; whether a job fits is the placement package's
// business, so a job that does not fit never hides the ones behind it (no
// head-of-line blocking).
//
// A Queue is not safe for concurrent use; the scheduler's state owns one
// under its lock.
package queue

import (
	"iter"
	"slices"
	"sort"

	"github.com/gpuplane/gpuplane/contracts"
)

// Item is one waiting job.
type Item[T any] struct {
	// Key identifies the item (tenant/job); Push of a present key is a no-op.
	Key    string
	Tenant string
	// Priority is the job's class; an unknown class is served last.
	Priority contracts.Priority
	// Seq is the submit order (the stream sequence of the job's queued
	// event): FIFO within a class is by Seq, so a requeued job gets its
	// original place back.
	Seq   uint64
	Value T
}

// Queue holds the waiting items. The zero value is not usable; call New.
type Queue[T any] struct {
	classes [numClasses]class[T]
	where   map[string]*entry[T]
}

// numClasses covers contracts.Priorities plus one slot for unknown classes.
const numClasses = 5

type entry[T any] struct {
	item    Item[T]
	removed bool
}

type class[T any] struct {
	tenants map[string]*fifo[T]
	// names are the tenants with a fifo, sorted.
	names []string
}

type fifo[T any] struct {
	entries []*entry[T] // sorted by Seq, with removed tombstones
	live    int
}

// New returns an empty queue.
func New[T any]() *Queue[T] {
	q := &Queue[T]{where: map[string]*entry[T]{}}
	for i := range q.classes {
		q.classes[i].tenants = map[string]*fifo[T]{}
	}
	return q
}

// classIndex maps a priority to its slot: 0 is served first.
func classIndex(p contracts.Priority) int {
	r := p.Rank()
	if r < 0 {
		return numClasses - 1
	}
	return 3 - r
}

// Len is the number of waiting items.
func (q *Queue[T]) Len() int { return len(q.where) }

// Contains reports whether key is waiting.
func (q *Queue[T]) Contains(key string) bool { _, ok := q.where[key]; return ok }

// Push adds it, keeping its tenant and class FIFO ordered by Seq. Pushing a
// key that is already present does nothing.
func (q *Queue[T]) Push(it Item[T]) {
	if _, ok := q.where[it.Key]; ok {
		return
	}
	c := &q.classes[classIndex(it.Priority)]
	f := c.tenants[it.Tenant]
	if f == nil {
		f = &fifo[T]{}
		c.tenants[it.Tenant] = f
		i, _ := slices.BinarySearch(c.names, it.Tenant)
		c.names = slices.Insert(c.names, i, it.Tenant)
	}
	e := &entry[T]{item: it}
	// Appends are the common case (submit order); a requeued job goes back
	// to its original place.
	if n := len(f.entries); n == 0 || f.entries[n-1].item.Seq <= it.Seq {
		f.entries = append(f.entries, e)
	} else {
		i := sort.Search(n, func(i int) bool { return f.entries[i].item.Seq > it.Seq })
		f.entries = slices.Insert(f.entries, i, e)
	}
	f.live++
	q.where[it.Key] = e
}

// Remove takes key out of the queue and reports whether it was there.
func (q *Queue[T]) Remove(key string) bool {
	e, ok := q.where[key]
	if !ok {
		return false
	}
	delete(q.where, key)
	e.removed = true
	c := &q.classes[classIndex(e.item.Priority)]
	f := c.tenants[e.item.Tenant]
	f.live--
	switch {
	case f.live == 0:
		delete(c.tenants, e.item.Tenant)
		if i, found := slices.BinarySearch(c.names, e.item.Tenant); found {
			c.names = slices.Delete(c.names, i, i+1)
		}
	case len(f.entries) > 32 && f.live < len(f.entries)/2:
		// Compact once tombstones dominate, so removal stays O(1) amortised.
		f.entries = slices.DeleteFunc(f.entries, func(e *entry[T]) bool { return e.removed })
	}
	return true
}

// Order yields every waiting item: classes from the highest; within a
// class one item per tenant in turn, tenants by name, each tenant's items
// in Seq order. The queue must not be changed while Order runs.
func (q *Queue[T]) Order() iter.Seq[Item[T]] {
	return func(yield func(Item[T]) bool) {
		for ci := range q.classes {
			if !q.classes[ci].each(yield) {
				return
			}
		}
	}
}

// ByTenant yields every waiting item grouped by class and tenant: classes
// from the highest, within a class tenants by name, each tenant's items
// in Seq order. It is Order without the interleaving, for a caller that
// groups items by class and tenant itself (fair share does): each
// tenant's items come in the same relative order, and a straight walk of
// each FIFO costs less than the turn-taking. The queue must not be
// changed while ByTenant runs.
func (q *Queue[T]) ByTenant() iter.Seq[Item[T]] {
	return func(yield func(Item[T]) bool) {
		for ci := range q.classes {
			c := &q.classes[ci]
			for _, name := range c.names {
				for _, e := range c.tenants[name].entries {
					if !e.removed && !yield(e.item) {
						return
					}
				}
			}
		}
	}
}

func (c *class[T]) each(yield func(Item[T]) bool) bool {
	if len(c.names) == 0 {
		return true
	}
	type cursor struct {
		f *fifo[T]
		i int
	}
	ring := make([]cursor, 0, len(c.names))
	for _, name := range c.names {
		ring = append(ring, cursor{f: c.tenants[name]})
	}
	for len(ring) > 0 {
		kept := ring[:0]
		for _, cur := range ring {
			for cur.i < len(cur.f.entries) && cur.f.entries[cur.i].removed {
				cur.i++
			}
			if cur.i == len(cur.f.entries) {
				continue
			}
			if !yield(cur.f.entries[cur.i].item) {
				return false
			}
			cur.i++
			kept = append(kept, cur)
		}
		ring = kept
	}
	return true
}
