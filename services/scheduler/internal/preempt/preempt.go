// Package preempt chooses which running jobs to evict so that a job that
// does not fit can be placed: a higher-priority job, or a tenant reclaiming
// its guarantee from tenants borrowing beyond theirs. It is pure: a snapshot,
// the running jobs and the time go in, a victim set and the preemptor's
// parts come out; the scheduler stops the victims and requeues them.
//
// Who may be evicted (Kueue's and Volcano's rules): a lower class of the
// preemptor's own tenant, or of another tenant's borrowed work; with
// Reclaim, another tenant's borrowed work of the preemptor's class or
// lower. Another tenant's work is borrowed only beyond its guarantee
// (Options.Spare): a preemptor never takes a tenant below its guarantee,
// however high its class.
//
// A victim set is compared lexicographically: lowest highest-victim
// priority class first (a set of best-effort jobs before one holding a
// normal job, however large; so a victim's next attempt finds nothing it
// may evict that the decision could have taken instead), then fewest GPUs
// evicted (in milli-GPUs, every part of a gang counted), fewest jobs,
// least progress lost, most checkpointable; then node order (node ID
// ascending), so equal choices go to the first node.
//
// The pipeline, per request:
//
//	running ──► units (a job, or every part of a gang) ──► eligible?
//	nodes ──► cheap filters (pool, cordon, selector, taints, Exclude, quota)
//	  ──► per node: candidates = eligible units that free something the
//	      request can use (a card or MIG slot it could take, or host CPU or
//	      memory the node lacks); items = those cards or slots
//	  ──► estimate: the lowest class whose candidates (with every lower
//	      class's) could make room (a count of items, no FitNode), and a
//	      lower bound on the GPUs to evict at that class
//	  ──► nodes by lower bound, until it exceeds the best found; on each,
//	      class by class from the lowest, the first class that fits:
//	        whole GPUs or MIG: cheapest union of holders of enough items
//	        otherwise: candidates every fitting set needs, then best-first
//	        over the other subsets in cost order
//	        (greedy-then-reprieve when a node has too many candidates)
//	      each answer checked with placement.FitNode on the node as it
//	      would be with the victims' devices and host resources given back
//	  ──► the cheapest node; for a multi-machine job the cheapest node again
//	      and again (a gang victim frees its other nodes too), then every
//	      victim the job can spare reprieved
//	  ──► verify: FitNode on each node with exactly the victims removed
package preempt

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// Running is one allocation that preemption may stop.
type Running struct {
	AllocationID, Tenant, JobID string
	NodeID                      string
	// Devices is what it holds on NodeID (MIG and share refs included).
	Devices             []contracts.DeviceRef
	CPUMilli, MemoryMiB int64
	Priority            contracts.Priority
	// Borrowing: its tenant holds more than its guarantee in this pool.
	Borrowing bool
	// StartedAt is zero when the job has not started (nothing to lose, and
	// no minimum runtime to respect).
	StartedAt time.Time
	// LastCheckpoint is zero when there is none; progress lost on eviction
	// is now - max(StartedAt, LastCheckpoint).
	LastCheckpoint time.Time
	Checkpointable bool
	// Gang is non-empty for the parts of one multi-machine job: evicting
	// one part evicts every part with the same key.
	Gang string
	// Pool is the pool the allocation counts in for quotas (Options.Spare).
	Pool string
}

// TenantPool names one tenant's quota in one pool.
type TenantPool struct{ Tenant, Pool string }

// Preemptor is the job that does not fit.
type Preemptor struct {
	Request  placement.Request
	Priority contracts.Priority
	// Reclaim: the tenant is under its guarantee in the pool, so it may
	// evict other tenants' borrowers of its own priority or lower.
	Reclaim bool
}

// Options are the facts of the cycle.
type Options struct {
	Now time.Time
	// MinRuntime protects a started job from eviction until it has run
	// this long; a job not started yet is never protected.
	MinRuntime time.Duration
	// Defragment chooses jobs to move rather than evict: any class is
	// eligible (the jobs go on elsewhere), but only single-machine jobs,
	// and the caller checks that each one fits elsewhere.
	Defragment bool
	// Spare is, per tenant and pool with a guarantee there, how much of
	// its work (milli-GPUs) another tenant's preemptor may evict: what it
	// holds beyond its guarantee, less what is already leaving. A victim
	// set never evicts more than that of a tenant other than the
	// preemptor's. A tenant and pool not in the map have no guarantee to
	// keep. Not used with Defragment (moved jobs go on at once).
	Spare map[TenantPool]int64
}

// Choice is the outcome of Choose.
type Choice struct {
	// Victims is the minimal set, every part of a gang included, in the
	// order they were given.
	Victims []Running
	// Parts is where the preemptor goes once the victims are gone, one per
	// machine in node order, verified by placement.FitNode.
	Parts []placement.Part
	// Reason is for logs and events: "evicts 2 jobs (3 GPUs) of
	// best-effort on n7".
	Reason string
}

// Limits of the exact search on one node. A node with more candidates, or
// whose cheapest fitting subset lies deeper than maxVisits subsets in cost
// order, falls back to greedy-then-reprieve, which gives a set no victim of
// which can be spared, though not always the cheapest one.
const (
	maxExactCandidates = 64 // subsets are uint64 masks
	maxVisits          = 1 << 14
)

// Choose picks the victims whose eviction lets p be placed, and where p then
// goes. It returns false when no set of eligible victims would make room:
// it never evicts for a preemptor that would still not fit. Should p fit
// without evicting anything, the choice has no victims. snap and running
// are not modified.
func Choose(snap placement.Snapshot, running []Running, p Preemptor, opt Options) (Choice, bool) {
	return NewFleet(snap, running, opt.Now).Choose(p, opt, nil)
}

// run is the search of c.
func (c *chooser) run() (Choice, bool) {
	var (
		best     selection
		bestOK   bool
		perZone  = [][]int{c.candidates()}
		machines = c.machines
	)
	if machines > 1 && c.zone {
		perZone = c.byZone(perZone[0])
	}
	for _, ords := range perZone {
		sel, ok := c.choose(ords, machines)
		if ok && (!bestOK || sel.less(best)) {
			best, bestOK = sel, true
		}
	}
	if !bestOK {
		return Choice{}, false
	}
	return c.finish(best)
}

// unit is what is evicted at once: one allocation, or every part of a gang,
// and what evicting it costs. Both depend on the running allocations and
// the time only (Fleet); what depends on the preemptor is the chooser's.
type unit struct {
	parts []int // indices into running
	cost  cost
}

// budgetUse is milli-GPUs taken from budget b.
type budgetUse struct {
	b     int
	milli int64
}

// cost orders victim sets; for one unit, jobs is 1.
type cost struct {
	milli  int64         // milli-GPUs evicted
	jobs   int           // jobs evicted (a gang is one)
	rank   int           // highest victim priority rank; noRank for none
	lost   time.Duration // progress lost, summed over jobs
	noCkpt int           // jobs that cannot checkpoint
}

const noRank = -1 << 30

func (a cost) add(b cost) cost {
	return cost{milli: a.milli + b.milli, jobs: a.jobs + b.jobs, rank: max(a.rank, b.rank),
		lost: a.lost + b.lost, noCkpt: a.noCkpt + b.noCkpt}
}

// compare is the minimality order: priority class first.
func (a cost) compare(b cost) int {
	return cmp.Or(cmp.Compare(a.rank, b.rank), cmp.Compare(a.milli, b.milli), cmp.Compare(a.jobs, b.jobs),
		cmp.Compare(a.lost, b.lost), cmp.Compare(a.noCkpt, b.noCkpt))
}

// compareAdditive leaves out the rank, which is a max and not a sum: the
// best-first enumeration needs an order that adding a unit never lowers.
func (a cost) compareAdditive(b cost) int {
	return cmp.Or(cmp.Compare(a.milli, b.milli), cmp.Compare(a.jobs, b.jobs),
		cmp.Compare(a.lost, b.lost), cmp.Compare(a.noCkpt, b.noCkpt))
}

// compareLevel compares only the GPUs and jobs, the keys after the class:
// within one class, the searches stop at the first level past the best.
func (a cost) compareLevel(b cost) int {
	return cmp.Or(cmp.Compare(a.milli, b.milli), cmp.Compare(a.jobs, b.jobs))
}

// chooser holds what one Choose call derives from its inputs: the fleet's
// (shared, read only) and what depends on the preemptor.
type chooser struct {
	nodes   []*placement.Node // node ID ascending
	running []Running
	units   []unit
	unitOf  []int // running index -> unit
	nodeOf  []int // running index -> node ord, -1 when not in the snapshot
	// eligible and spends are per unit, for this preemptor: whether it may
	// be evicted, and what evicting it takes from the budgets
	// (Options.Spare) of tenants other than the preemptor's (nil for most).
	eligible []bool
	spends   [][]budgetUse
	onNode   [][]int // node ord -> running indices of eligible units there
	req      placement.Request
	zone     bool // the request wants its machines in one zone
	machines int  // the request's, before req is cut to one machine's part
	kind     contracts.GPUKind
	perGPUs  int // whole GPUs per machine
	opt      Options
	pri      contracts.Priority
	priRank  int // pri.Rank(), asked per running allocation
	reclaim  bool
	// budgets are the caps of Options.Spare in use, by index (judge).
	budgets []int64
}

// newChooser derives p's search over f; false when placement would refuse
// the request whatever is evicted. gone says, per unit, which are left out
// (as if not in running).
func (f *Fleet) newChooser(p Preemptor, opt Options, gone []bool) (*chooser, bool) {
	r := p.Request
	machines := r.Machines()
	g := r.GPU
	// What placement would refuse anyway is refused before any work.
	if g.Count < 1 || g.Count%machines != 0 || machines > len(f.nodes) {
		return nil, false
	}
	c := &chooser{
		nodes:    f.nodes,
		running:  f.running,
		units:    f.units,
		unitOf:   f.unitOf,
		nodeOf:   f.nodeOf,
		zone:     g.Topology == contracts.TopologyZone,
		machines: machines,
		kind:     g.Kind(),
		perGPUs:  g.Count / machines,
		opt:      opt,
		pri:      p.Priority,
		priRank:  p.Priority.Rank(),
		reclaim:  p.Reclaim,
	}
	if c.kind == contracts.GPUKindShare && (g.Share.ComputePercent < 1 || g.Share.ComputePercent > 100 || g.Share.MemoryMiB < 1) {
		return nil, false
	}
	// FitNode sees one machine's part: the per-machine count on one node.
	// NVLink is a per-machine constraint and stays; zone is handled here.
	r.GPU.Count = c.perGPUs
	r.GPU.Nodes = 1
	if r.GPU.Topology == contracts.TopologyZone {
		r.GPU.Topology = contracts.TopologyAny
	}
	if allow := r.AllowPool; allow != nil {
		// The caller's AllowPool is asked once per pool at most, however
		// many what-ifs FitNode runs.
		seen := map[string]bool{}
		r.AllowPool = func(pool string) bool {
			ok, done := seen[pool]
			if !done {
				ok = allow(pool)
				seen[pool] = ok
			}
			return ok
		}
	}
	c.req = r
	c.onNode = make([][]int, len(c.nodes))
	c.judgeUnits(f, gone)
	return c, true
}

// judgeUnits decides, per unit, whether the preemptor may evict it and
// what that spends, and lists the eligible ones' parts per node. Parts and
// per-node lists share flat backing arrays: a cycle has tens of thousands
// of allocations, and Choose runs for every job that must preempt.
func (c *chooser) judgeUnits(f *Fleet, gone []bool) {
	c.eligible = make([]bool, len(c.units))
	for u := range c.eligible {
		c.eligible[u] = !gone[u]
	}
	// In running order, as the budgets are numbered by first use.
	c.judge(f, gone)
	// A unit that alone takes a tenant below its guarantee never goes.
	for u, uses := range c.spends {
		for _, use := range uses {
			if use.milli > c.budgets[use.b] {
				c.eligible[u] = false
			}
		}
	}
	perNode := make([]int, len(c.nodes))
	total := 0
	for i := range c.running {
		if o := c.nodeOf[i]; o >= 0 && c.eligible[c.unitOf[i]] {
			perNode[o]++
			total++
		}
	}
	onNode := make([]int, 0, total)
	for o, n := range perNode {
		c.onNode[o] = onNode[len(onNode) : len(onNode) : len(onNode)+n]
		onNode = onNode[:len(onNode)+n]
	}
	// By unit, so a node's list has each unit's parts together.
	for u, un := range c.units {
		if !c.eligible[u] {
			continue
		}
		for _, i := range un.parts {
			if o := c.nodeOf[i]; o >= 0 {
				c.onNode[o] = append(c.onNode[o], i)
			}
		}
	}
}

// spendOf is what evicting unit u takes from the budgets.
func (c *chooser) spendOf(u int) []budgetUse {
	if c.spends == nil {
		return nil
	}
	return c.spends[u]
}

// withinBudgets reports whether evicting units, on top of used (what the
// selection already takes; nil for nothing), keeps every tenant at or
// above its guarantee. tmp is scratch of len(c.budgets).
func (c *chooser) withinBudgets(used, tmp []int64, units func(yield func(int) bool)) bool {
	if len(c.budgets) == 0 {
		return true
	}
	if used != nil {
		copy(tmp, used)
	} else {
		clear(tmp)
	}
	for u := range units {
		for _, use := range c.spendOf(u) {
			if tmp[use.b] += use.milli; tmp[use.b] > c.budgets[use.b] {
				return false
			}
		}
	}
	return true
}

// lost is the progress v loses when stopped at now.
func lost(v *Running, now time.Time) time.Duration {
	if v.StartedAt.IsZero() {
		return 0
	}
	from := v.StartedAt
	if v.LastCheckpoint.After(from) {
		from = v.LastCheckpoint
	}
	return max(0, now.Sub(from))
}

// candidates is the node ords that pass the checks FitNode would fail
// whatever is evicted. FitNode checks them again; these only save work.
func (c *chooser) candidates() []int {
	r := c.req
	var ords []int
	for o, n := range c.nodes {
		if n.Cordoned || r.Exclude[n.ID] || (r.Pool != "" && n.Pool != r.Pool) ||
			!contracts.Selected(r.Selector, n.Labels) ||
			!contracts.Tolerated(r.Tolerations, n.Taints, contracts.TaintNoSchedule) ||
			(r.AllowPool != nil && !r.AllowPool(n.Pool)) {
			continue
		}
		ords = append(ords, o)
	}
	return ords
}

// byZone splits ords by zone, zones in the order of their first node.
func (c *chooser) byZone(ords []int) [][]int {
	idx := map[string]int{}
	var out [][]int
	for _, o := range ords {
		z := c.nodes[o].Zone
		i, ok := idx[z]
		if !ok {
			i = len(out)
			idx[z] = i
			out = append(out, nil)
		}
		out[i] = append(out[i], o)
	}
	return out
}

// selection is the nodes chosen for a preemptor and the units evicted.
type selection struct {
	ords  []int // ascending
	units []int // ascending
	cost  cost
}

func (a selection) less(b selection) bool {
	if d := a.cost.compare(b.cost); d != 0 {
		return d < 0
	}
	return slices.Compare(a.ords, b.ords) < 0
}

// nodeResult is the cheapest victim set found for one node.
type nodeResult struct {
	ord   int
	units []int
	cost  cost
}

func (a nodeResult) less(b nodeResult) bool {
	return cmp.Or(a.cost.compare(b.cost), cmp.Compare(a.ord, b.ord)) < 0
}

// choose picks k nodes among ords, cheapest first. After each pick the
// victims it evicts are gone for the remaining picks: a gang victim's other
// parts free their nodes too, so those nodes are priced again.
func (c *chooser) choose(ords []int, k int) (selection, bool) {
	if len(ords) < k {
		return selection{}, false
	}
	s := &nodeSearch{c: c, evicted: make([]bool, len(c.units))}
	if len(c.budgets) > 0 {
		s.used = make([]int64, len(c.budgets))
		s.tmp = make([]int64, len(c.budgets))
	}
	// With budgets a multi-machine pick can make another node dearer (the
	// budget it would spend is gone), so no node is dismissed on the
	// others' prices; each is checked again as it is picked.
	bounded := k == 1 || len(c.budgets) == 0
	var (
		h        = minHeap[resultEntry]{less: func(a, b resultEntry) bool { return a.res.less(b.res) }}
		version  = make([]int, len(c.nodes))
		chosen   = make([]bool, len(c.nodes))
		inSet    = make([]bool, len(c.nodes))
		kbest    []nodeResult // the k cheapest seen, ascending: a bound
		zeroCost []int        // nodes that fit as they are
	)
	for _, o := range ords {
		inSet[o] = true
	}
	// Nodes are priced cheapest lower bound first, so the bound tightens
	// early and most nodes are dismissed on their lower bound alone. A node
	// dearer than the k-th cheapest cannot be picked: costs only fall as
	// victims are evicted, and a node whose cost falls is priced again.
	type estimate struct {
		rank int
		lb   int64
		ord  int
	}
	var est []estimate
	for _, o := range ords {
		if rank, lb, ok := s.estimate(o); ok {
			est = append(est, estimate{rank, lb, o})
		}
	}
	slices.SortFunc(est, func(a, b estimate) int {
		return cmp.Or(cmp.Compare(a.rank, b.rank), cmp.Compare(a.lb, b.lb), cmp.Compare(a.ord, b.ord))
	})
	for _, e := range est {
		var bound *nodeResult
		if bounded && len(kbest) == k {
			bound = &kbest[k-1]
			if e.rank > bound.cost.rank || (e.rank == bound.cost.rank && e.lb > bound.cost.milli) {
				break
			}
		}
		res, ok := s.best(e.ord, bound)
		if !ok {
			continue
		}
		if len(res.units) == 0 {
			zeroCost = append(zeroCost, e.ord)
		}
		h.Push(resultEntry{res: res})
		i, _ := slices.BinarySearchFunc(kbest, res, func(a, b nodeResult) int {
			if a.less(b) {
				return -1
			}
			return 1
		})
		if i < k {
			kbest = slices.Insert(kbest, i, res)
			kbest = kbest[:min(len(kbest), k)]
		}
	}
	slices.Sort(zeroCost)
	sel := selection{cost: cost{rank: noRank}}
	for len(sel.ords) < k {
		if h.Len() == 0 {
			return selection{}, false
		}
		e := h.Pop()
		o := e.res.ord
		if chosen[o] || e.version != version[o] {
			continue
		}
		if len(c.budgets) > 0 && !c.withinBudgets(s.used, s.tmp, slices.Values(e.res.units)) {
			// Priced before an earlier pick spent the budget it needs.
			version[o]++
			if res, ok := s.best(o, nil); ok {
				h.Push(resultEntry{res: res, version: version[o]})
			}
			continue
		}
		chosen[o] = true
		sel.ords = append(sel.ords, o)
		var touched []int
		for _, u := range e.res.units {
			if s.evicted[u] {
				continue
			}
			s.evicted[u] = true
			for _, use := range c.spendOf(u) {
				s.used[use.b] += use.milli
			}
			sel.units = append(sel.units, u)
			sel.cost = sel.cost.add(c.units[u].cost)
			for _, i := range c.units[u].parts {
				if to := c.nodeOf[i]; to >= 0 && to != o && inSet[to] && !chosen[to] {
					touched = append(touched, to)
				}
			}
		}
		slices.Sort(touched)
		for _, to := range slices.Compact(touched) {
			version[to]++
			if res, ok := s.best(to, nil); ok {
				h.Push(resultEntry{res: res, version: version[to]})
			}
		}
	}
	if k > 1 {
		sel = c.reprieve(sel, s.evicted, zeroCost, inSet, k)
	}
	slices.Sort(sel.ords)
	slices.Sort(sel.units)
	return sel, true
}

// reprieve takes back, dearest first, every victim of a multi-machine
// selection that k machines can do without. Picking the cheapest node
// each time can evict a job on one node and then a gang whose eviction
// frees that node's place elsewhere too; reprieve undoes the first. The
// machines are then the first k in node order that fit.
func (c *chooser) reprieve(sel selection, evicted []bool, zeroCost []int, inSet []bool, k int) selection {
	fitting := func() []int {
		cand := slices.Clone(zeroCost)
		for _, u := range sel.units {
			if !evicted[u] {
				continue
			}
			for _, i := range c.units[u].parts {
				if o := c.nodeOf[i]; o >= 0 && inSet[o] {
					cand = append(cand, o)
				}
			}
		}
		slices.Sort(cand)
		cand = slices.Compact(cand)
		return slices.DeleteFunc(cand, func(o int) bool { return !c.fitsAfter(o, evicted) })
	}
	order := slices.Clone(sel.units)
	slices.SortFunc(order, func(a, b int) int { return cmp.Or(c.units[b].cost.compare(c.units[a].cost), cmp.Compare(b, a)) })
	for _, u := range order {
		evicted[u] = false
		if len(fitting()) < k {
			evicted[u] = true
		}
	}
	out := selection{ords: fitting()[:k], cost: cost{rank: noRank}}
	for _, u := range sel.units {
		if evicted[u] {
			out.units = append(out.units, u)
			out.cost = out.cost.add(c.units[u].cost)
		}
	}
	return out
}

// fitsAfter reports whether the request fits node o once the evicted
// units are gone.
func (c *chooser) fitsAfter(o int, evicted []bool) bool {
	var parts []int
	for _, i := range c.onNode[o] {
		if evicted[c.unitOf[i]] {
			parts = append(parts, i)
		}
	}
	n := c.nodes[o]
	if len(parts) > 0 {
		freed := freeParts(n, c.running, parts)
		n = &freed
	}
	_, ok := placement.FitNode(n, c.req)
	return ok
}

type resultEntry struct {
	res     nodeResult
	version int
}

// finish verifies the selection with exactly its victims removed and
// builds the choice.
func (c *chooser) finish(sel selection) (Choice, bool) {
	if !c.withinBudgets(nil, make([]int64, len(c.budgets)), slices.Values(sel.units)) {
		return Choice{}, false // the searches keep to the budgets; never evict past one
	}
	var victims []int
	for _, u := range sel.units {
		victims = append(victims, c.units[u].parts...)
	}
	slices.Sort(victims)
	byNode := map[int][]int{}
	for _, i := range victims {
		if o := c.nodeOf[i]; o >= 0 {
			byNode[o] = append(byNode[o], i)
		}
	}
	ch := Choice{Victims: make([]Running, 0, len(victims))}
	for _, i := range victims {
		ch.Victims = append(ch.Victims, c.running[i])
	}
	for _, o := range sel.ords {
		n := c.nodes[o]
		freed := freeParts(n, c.running, byNode[o])
		devs, ok := placement.FitNode(&freed, c.req)
		if !ok {
			// The search only ever frees more than it checked; reaching here
			// means FitNode disagrees with itself. Evict nothing.
			return Choice{}, false
		}
		ch.Parts = append(ch.Parts, placement.Part{NodeID: n.ID, Pool: n.Pool, Zone: n.Zone, Devices: devs})
	}
	ch.Reason = c.reason(sel, victims)
	return ch, true
}

func (c *chooser) reason(sel selection, victims []int) string {
	ids := make([]string, 0, len(sel.ords))
	for _, o := range sel.ords {
		ids = append(ids, c.nodes[o].ID)
	}
	on := strings.Join(ids, ", ")
	if len(ids) > 4 {
		on = fmt.Sprintf("%s and %d more", strings.Join(ids[:4], ", "), len(ids)-4)
	}
	if len(sel.units) == 0 {
		return "fits without eviction on " + on
	}
	var classes []contracts.Priority
	reclaimed := false
	for _, i := range victims {
		v := c.running[i]
		if p := cmp.Or(v.Priority, contracts.PriorityNormal); !slices.Contains(classes, p) {
			classes = append(classes, p)
		}
		reclaimed = reclaimed || v.Priority.Rank() >= c.pri.Rank()
	}
	slices.SortFunc(classes, func(a, b contracts.Priority) int { return cmp.Compare(a.Rank(), b.Rank()) })
	names := make([]string, len(classes))
	for i, p := range classes {
		names[i] = string(p)
	}
	jobs := "jobs"
	if sel.cost.jobs == 1 {
		jobs = "job"
	}
	gpus := strconv.FormatFloat(float64(sel.cost.milli)/1000, 'f', -1, 64)
	s := fmt.Sprintf("evicts %d %s (%s GPUs) of %s on %s", sel.cost.jobs, jobs, gpus, strings.Join(names, ", "), on)
	if reclaimed {
		s += "; reclaiming guarantee from borrowing tenants"
	}
	return s
}
