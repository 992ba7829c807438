// Package fairshare decides whose job the scheduler tries next and whether a
// tenant's quota lets it take more: quotas per tenant and pool (a guarantee
// and a maximum, in GPUs), and the order of one scheduling cycle:
//
//	priority class (rank, highest first)
//	  -> tenant of lowest weighted dominant share (DRF), ties by tenant name
//	     -> FIFO (Seq) within the tenant
//
// A Book holds what every tenant uses (running work plus plans in flight) and
// the quotas; a Round walks one cycle's queue in that order and re-ranks the
// tenants as jobs are placed, so a tenant that just got a large job waits
// behind the others of its class.
//
// Usage is counted as quotas count it: milli-GPU (1000 = one whole GPU, see
// contracts.GPURequest.MilliGPUs), plus host CPU and memory for the dominant
// share. The package is pure: no bus, no clock, not safe for concurrent use.
package fairshare

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

// Usage is an amount of the three resources fair share weighs.
type Usage struct {
	MilliGPU, CPUMilli, MemoryMiB int64
}

// plus adds v to u, never going below zero in any resource: a release larger
// than what was held (a stale or duplicated release) must not leave a tenant
// with negative usage and so with a quota larger than configured.
func (u Usage) plus(v Usage) Usage {
	return Usage{
		MilliGPU:  max(0, u.MilliGPU+v.MilliGPU),
		CPUMilli:  max(0, u.CPUMilli+v.CPUMilli),
		MemoryMiB: max(0, u.MemoryMiB+v.MemoryMiB),
	}
}

// Book is what tenants use and may use during one scheduling cycle.
//
// Quotas are per pool (contracts.TenantQuota.For: the pool's own entry, else
// the QuotaAllPools entry, which applies to each such pool separately). A
// tenant without a quota entry for a pool has no maximum there and a
// guarantee of 0, so everything it holds there counts as borrowing; that only
// matters to a tenant with a guarantee in that pool, which may reclaim it.
type Book struct {
	capacity Usage
	quotas   map[string]contracts.TenantQuota
	accounts map[string]*account
}

// account is one tenant's side of the book.
type account struct {
	weight float64          // EffectiveWeight, sanitised
	total  Usage            // all pools: the dominant share
	held   map[string]int64 // milli-GPU per pool: quotas
	served uint64           // when the tenant last got a placement (caller's clock), for ties
}

// Served records when tenant last got a placement, on the caller's
// monotonic counter: among tenants of equal share, the one served longest
// ago is served first.
func (b *Book) Served(tenant string, stamp uint64) {
	b.account(tenant).served = stamp
}

// NewBook returns an empty book. capacity is the whole cluster's, the
// denominator of dominant shares; a zero component is left out of the share.
// quotas maps tenant to quota and is only read (the caller keeps it).
func NewBook(capacity Usage, quotas map[string]contracts.TenantQuota) *Book {
	return &Book{
		capacity: capacity,
		quotas:   quotas,
		accounts: make(map[string]*account),
	}
}

func (b *Book) account(tenant string) *account {
	a := b.accounts[tenant]
	if a == nil {
		w := b.quotas[tenant].EffectiveWeight()
		if math.IsNaN(w) || math.IsInf(w, 0) {
			w = 1 // a corrupt quota must not make every share NaN and the order arbitrary
		}
		a = &account{weight: w, held: make(map[string]int64, 1)}
		b.accounts[tenant] = a
	}
	return a
}

// Hold counts u as held by tenant in pool: running work and plans in flight.
// Negative amounts release (never below zero).
func (b *Book) Hold(tenant, pool string, u Usage) {
	a := b.account(tenant)
	a.total = a.total.plus(u)
	a.held[pool] = max(0, a.held[pool]+u.MilliGPU)
}

// Held is the milli-GPU tenant holds in pool.
func (b *Book) Held(tenant, pool string) int64 {
	if a := b.accounts[tenant]; a != nil {
		return a.held[pool]
	}
	return 0
}

// Usage is what tenant holds across all pools.
func (b *Book) Usage(tenant string) Usage {
	if a := b.accounts[tenant]; a != nil {
		return a.total
	}
	return Usage{}
}

// Share is tenant's weighted dominant share: the largest of its GPU, CPU and
// memory usage over the cluster's capacity of each, divided by its weight. A
// tenant of weight 2 is served as if it used half of what it does.
func (b *Book) Share(tenant string) float64 { return b.share(b.account(tenant)) }

func (b *Book) share(a *account) float64 {
	u, c := a.total, b.capacity
	var s float64
	if c.MilliGPU > 0 {
		s = max(s, float64(u.MilliGPU)/float64(c.MilliGPU))
	}
	if c.CPUMilli > 0 {
		s = max(s, float64(u.CPUMilli)/float64(c.CPUMilli))
	}
	if c.MemoryMiB > 0 {
		s = max(s, float64(u.MemoryMiB)/float64(c.MemoryMiB))
	}
	s /= a.weight
	if math.IsNaN(s) {
		return math.Inf(1) // never: capacity and weight are positive; kept so ranking cannot loop
	}
	return s
}

// Verdict is the quota's answer for one request.
type Verdict struct {
	OK bool
	// Borrowing: after adding the request the tenant holds more than its
	// guarantee in the pool, so the job may be preempted by a tenant
	// reclaiming its guarantee.
	Borrowing bool
	// Code and Message say why not, when !OK.
	Code    contracts.Reason
	Message string
}

// Admit says whether tenant may take milliGPU more in pool (the pool the job
// would be placed in; AllowPool asks it per pool): not past the quota's Max
// where one applies. Admit counts nothing; the caller Holds what it places
// (Round.Placed does).
func (b *Book) Admit(tenant, pool string, milliGPU int64) Verdict {
	q, ok := b.quotas[tenant].For(pool)
	held := b.Held(tenant, pool)
	after := held + max(0, milliGPU)
	if ok && q.Max != nil {
		if limit := milli(*q.Max); after > limit {
			return Verdict{
				Code: contracts.PendingQuotaExceeded,
				Message: fmt.Sprintf("quota %s/%s at %s of %s GPUs (job needs %s)",
					tenant, poolName(pool), GPUs(held), GPUs(limit), GPUs(milliGPU)),
			}
		}
	}
	return Verdict{OK: true, Borrowing: after > milli(q.Guarantee)}
}

// UnderGuarantee reports whether tenant, after taking milliGPU more in pool,
// still holds no more than its guarantee there: such a request may reclaim
// capacity from other tenants' borrowed work. A tenant without a guarantee
// in the pool never is.
func (b *Book) UnderGuarantee(tenant, pool string, milliGPU int64) bool {
	q, ok := b.quotas[tenant].For(pool)
	if !ok || q.Guarantee <= 0 {
		return false
	}
	return b.Held(tenant, pool)+max(0, milliGPU) <= milli(q.Guarantee)
}

// Guarantee is tenant's guarantee in pool, in milli-GPU; 0 when it has
// none there.
func (b *Book) Guarantee(tenant, pool string) int64 {
	q, ok := b.quotas[tenant].For(pool)
	if !ok {
		return 0
	}
	return milli(q.Guarantee)
}

// Borrowing reports whether tenant holds more than its guarantee in pool
// (anything at all when it has no quota there).
func (b *Book) Borrowing(tenant, pool string) bool {
	q, _ := b.quotas[tenant].For(pool)
	return b.Held(tenant, pool) > milli(q.Guarantee)
}

// milli converts a quota in GPUs to milli-GPU, rounding to the nearest so
// 2.5 GPUs is exactly 2500. NaN and negatives are 0: a corrupt quota admits
// nothing rather than everything.
func milli(gpus float64) int64 {
	switch {
	case !(gpus > 0):
		return 0
	case gpus > 1e12:
		return math.MaxInt64 / 2
	}
	return int64(math.Round(gpus * 1000))
}

// GPUs formats milli-GPU as GPUs, without trailing zeros: 16, 2.5, 0.142.
func GPUs(milliGPU int64) string {
	return strconv.FormatFloat(float64(milliGPU)/1000, 'f', -1, 64)
}

func poolName(pool string) string {
	if pool == "" {
		return contracts.QuotaAllPools
	}
	return pool
}

// Item is one waiting job as the round orders it.
type Item struct {
	Key, Tenant string
	Priority    contracts.Priority
	// Seq is the submit order within the tenant (FIFO); ties by Key.
	Seq uint64
	// Usage is what the job takes once placed (all machines of a gang).
	Usage Usage
	// Ref is the caller's, handed back as it came (an index into the
	// caller's jobs saves a lookup by Key per item).
	Ref int
}

// Round is one cycle's walk over the queue. Next hands out every item at
// most once. Usage is expected to only grow during a round (Placed): the
// tenant order is refreshed lazily on that assumption.
type Round struct {
	book    *Book
	classes []*class // rank descending
	cur     int
	queues  map[classTenant]*queue
}

type classTenant struct {
	rank   int
	tenant string
}

type class struct {
	rank   int
	queues []*queue
	heap   []*queue // built when the class is reached, so it sees the shares earlier classes left
	built  bool
}

// queue is one tenant's items of one class, in FIFO order.
type queue struct {
	tenant string
	acct   *account
	items  []Item
	next   int
	key    float64 // the tenant's share when last ranked in the heap
}

// NewRound orders items (any order in) for one cycle over b. Placed updates
// b, so quota checks later in the cycle see what the cycle placed. The
// round may keep items and reorder each class and tenant's items in place:
// the caller leaves the slice alone until the round is done.
func (b *Book) NewRound(items []Item) *Round {
	r := &Round{book: b, queues: make(map[classTenant]*queue)}
	byRank := make(map[int]*class)
	// Two passes: count each queue's items, then give each queue its
	// items as one slice (a deep queue's items grew every tenant's slice
	// by doubling, most of a steady cycle's garbage here).
	// Items usually come grouped by class and tenant (the scheduler's
	// queue.ByTenant): an item of the previous item's class and tenant
	// skips the map, and when no class and tenant comes in two runs each
	// queue is its run of items itself, not a copy (100,000 items are
	// 7 MB a cycle).
	counts := make(map[classTenant]int)
	var (
		last    classTenant
		run     int
		valid   bool
		grouped = true
	)
	end := func() {
		if counts[last] > 0 {
			grouped = false // its second run
		}
		counts[last] += run
	}
	for i := range items {
		k := classTenant{items[i].Priority.Rank(), items[i].Tenant}
		if valid && k == last {
			run++
			continue
		}
		if valid {
			end()
		}
		last, run, valid = k, 1, true
	}
	if valid {
		end()
	}
	var backing []Item
	if !grouped {
		backing = make([]Item, len(items))
	}
	var lastQ *queue
	for i, it := range items {
		rank := it.Priority.Rank()
		k := classTenant{rank, it.Tenant}
		if lastQ != nil && k == last {
			if !grouped {
				lastQ.items = append(lastQ.items, it)
			}
			continue
		}
		q := r.queues[k]
		last, lastQ = k, q
		if q == nil {
			n := counts[k]
			q = &queue{tenant: it.Tenant, acct: b.account(it.Tenant)}
			if grouped {
				q.items = items[i : i+n : i+n]
			} else {
				q.items = backing[:0:n]
				backing = backing[n:]
			}
			r.queues[k] = q
			c := byRank[rank]
			if c == nil {
				c = &class{rank: rank}
				byRank[rank] = c
				r.classes = append(r.classes, c)
			}
			c.queues = append(c.queues, q)
			lastQ = q
		}
		if !grouped {
			q.items = append(q.items, it)
		}
	}
	slices.SortFunc(r.classes, func(a, b *class) int { return b.rank - a.rank })
	byOrder := func(a, b Item) int {
		if a.Seq != b.Seq {
			if a.Seq < b.Seq {
				return -1
			}
			return 1
		}
		return strings.Compare(a.Key, b.Key)
	}
	for _, q := range r.queues {
		// The scheduler's queue hands each tenant's items over in order
		// already: checking costs one pass, sorting more.
		if !slices.IsSortedFunc(q.items, byOrder) {
			slices.SortFunc(q.items, byOrder)
		}
	}
	return r
}

// Next returns the next item to try: the highest class with items left, in
// it the tenant of lowest Share (ties by name), its earliest item.
func (r *Round) Next() (Item, bool) {
	for r.cur < len(r.classes) {
		c := r.classes[r.cur]
		if !c.built {
			c.build(r.book)
		}
		for len(c.heap) > 0 {
			q := c.heap[0]
			if q.next >= len(q.items) {
				c.pop()
				continue
			}
			// Lazy re-ranking: a key can only be stale low (usage grows), so
			// once the root's key is its true share, no other tenant's true
			// share is lower.
			if s := r.book.share(q.acct); s != q.key {
				q.key = s
				c.down(0)
				continue
			}
			it := q.items[q.next]
			q.next++
			return it, true
		}
		r.cur++
	}
	return Item{}, false
}

// Placed counts it as placed in pool: Book.Hold of its usage, so the caller
// must not Hold it again. Its tenant's rank adapts for the rest of the round.
func (r *Round) Placed(it Item, pool string) {
	r.book.Hold(it.Tenant, pool, it.Usage)
}

// Blocked records that it could not be placed. When its tenant's queue is
// strict FIFO, every later item of the tenant in its class leaves the round
// and is returned (FIFO order), so the caller can mark them
// contracts.PendingStrictFIFO (see StrictFIFOMessage); otherwise nothing
// changes and Blocked returns nil.
func (r *Round) Blocked(it Item) []Item {
	if !r.book.quotas[it.Tenant].StrictFIFO {
		return nil
	}
	q := r.queues[classTenant{it.Priority.Rank(), it.Tenant}]
	if q == nil || q.next >= len(q.items) {
		return nil
	}
	dropped := slices.Clone(q.items[q.next:])
	q.next = len(q.items)
	return dropped
}

// StrictFIFOMessage is the pending message of a job held back by blocking,
// the earlier job of a strict FIFO tenant that could not be placed.
func StrictFIFOMessage(blocking Item) string {
	return fmt.Sprintf("tenant %s's queue is strict FIFO; waiting behind job %s", blocking.Tenant, blocking.Key)
}

func (c *class) build(b *Book) {
	c.built = true
	c.heap = c.queues
	for _, q := range c.heap {
		q.key = b.share(q.acct)
	}
	for i := len(c.heap)/2 - 1; i >= 0; i-- {
		c.down(i)
	}
}

func less(a, b *queue) bool {
	if a.key != b.key {
		return a.key < b.key
	}
	// Equal shares (an idle cluster between jobs): the tenant served
	// longest ago goes first, so scarce capacity alternates across
	// cycles rather than going to the first name every time.
	if a.acct.served != b.acct.served {
		return a.acct.served < b.acct.served
	}
	return a.tenant < b.tenant
}

func (c *class) pop() {
	n := len(c.heap) - 1
	c.heap[0] = c.heap[n]
	c.heap[n] = nil
	c.heap = c.heap[:n]
	if n > 0 {
		c.down(0)
	}
}

func (c *class) down(i int) {
	h := c.heap
	for {
		l := 2*i + 1
		if l >= len(h) {
			return
		}
		m := l
		if r := l + 1; r < len(h) && less(h[r], h[l]) {
			m = r
		}
		if !less(h[m], h[i]) {
			return
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
}
