package state

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/backfill"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// Backfill reservations across cycles (FLOWS.md, "Scheduling"): a cycle
// reserves, for the first jobs blocked by capacity, the devices each will
// take when running jobs end (backfill.Reserve). The reservations outlive
// the cycle: the next one starts from them, so a job that fair share ranks
// ahead this time, or one offered a device that a release just freed, still
// respects them (a release must not reopen reserved capacity to a job that
// would run past the reservation's start). A job that used held devices on
// its promise to end before the start (its expected run time) and runs past
// it is stopped when the reservation comes due.

// promise is what a job placed on held devices said about its end.
type promise struct {
	// expected is its expected run time, counted from its start.
	expected time.Duration
	// reservation names the reserved job whose held devices it took.
	reservation string
}

// carriedReservations is the book a cycle starts from: the reservations
// of the previous cycle whose jobs still wait.
func (s *Store) carriedReservations() backfill.Book {
	var b backfill.Book
	for _, res := range s.reservations {
		if j := s.jobs[res.Key]; j != nil && j.State == contracts.StateQueued && len(j.parts) == 0 && j.Request != nil {
			b.Add(res)
		}
	}
	return b
}

// promiseOf returns the promise of j, just placed as d, when it took
// devices held by a reservation it is allowed to use only because it is
// expected to end before that reservation starts; nil otherwise.
func (s *Store) promiseOf(j *Job, d placement.Decision, book []backfill.Reservation,
	binds func(backfill.Reservation) bool, now time.Time) *promise {
	expected := expectedRunTime(j.Request)
	if expected <= 0 {
		return nil // an unknown run time never uses held devices
	}
	for _, res := range book {
		if res.Key == j.key || backfill.Delays(res, now, expected) || !binds(res) {
			continue
		}
		for _, part := range d.Parts {
			if h, ok := res.Holds[part.NodeID]; ok && overlaps(part.Devices, h.Devices) {
				return &promise{expected: expected, reservation: res.Key}
			}
		}
	}
	return nil
}

// overlaps reports whether two device lists name a common card (whole,
// share) or MIG instance.
func overlaps(a, b []contracts.DeviceRef) bool {
	for _, x := range a {
		for _, y := range b {
			if x.UUID != y.UUID {
				continue
			}
			if x.MIG == nil || y.MIG == nil || x.MIG.UUID == y.MIG.UUID {
				return true
			}
		}
	}
	return false
}

// enforcePromises stops the jobs that took held devices on their promise
// to end first and are still running on those devices when the
// reservation comes due: expectedRunTime is a promise, as a time limit is
// in Slurm. They are moved like a preemption victim (checkpointed first
// when they can, requeued), with the reason in their events.
func (s *Store) enforcePromises(now time.Time) {
	for _, res := range s.reservations {
		if res.Start.After(now) {
			continue
		}
		for _, node := range slices.Sorted(maps.Keys(res.Holds)) {
			n := s.cluster.nodes[node]
			if n == nil {
				continue
			}
			hold := res.Holds[node]
			for _, id := range slices.Sorted(maps.Keys(n.held)) {
				a := n.held[id]
				j := s.jobs[Key(a.Tenant, a.JobID)]
				if j == nil || j.moves().promise == nil || j.Attempt != a.Attempt || j.evict != "" || j.cancel || j.State.Terminal() {
					continue
				}
				p := j.part(a.ID)
				if p == nil || !p.committed || p.done() || p.started == nil || !overlaps(a.Devices, hold.Devices) {
					continue
				}
				end := p.started.Add(j.moves().promise.expected)
				if end.After(now) {
					continue
				}
				rj := strings.TrimPrefix(res.Key, j.Tenant+"/")
				s.log.Info("stopping a backfilled job past its expected run time", "tenant", j.Tenant, "job_id", j.ID,
					"node_id", node, "reservation", res.Key)
				s.evictJob(j, move{reason: contracts.ReasonRunTimeExceeded,
					msg: fmt.Sprintf("ran past its expected run time of %s (started %s, expected to end by %s) on %s, "+
						"capacity reserved for %s from %s", j.moves().promise.expected, p.started.UTC().Format(time.RFC3339),
						end.UTC().Format(time.RFC3339), node, rj, res.Start.UTC().Format(time.RFC3339))})
			}
		}
	}
}

// ahead counts, per tenant and pool, the jobs a cycle has offered so far:
// "N jobs ahead in queue research" counts only jobs that compete for the
// same pools (an L4 share is not behind MIG jobs of another pool).
type ahead struct {
	s *Store
	*aheadTables
	// counts are, by tenant id, the jobs offered so far by pool id: a
	// job's tenant and pool ids are kept with it (jobMemo), so a job
	// costs no map look-up once its request was seen.
	counts []*[]int
}

// aheadTables intern pool names and tenants and list each request
// shape's pools. They outlive a cycle: what a request's pools are depends
// only on which pools have which cards (sig), so a job keeps its ids
// (jobMemo) while the tables' generation stays.
type aheadTables struct {
	sig     string // the fleet's card kinds they were built for (cardKindsSig)
	gen     uint64
	ids     map[string]int32
	tenants map[string]int32
	// tenantNames are the tenants by id, one string each.
	tenantNames []string
	pools       map[poolsKey][]int32 // by request shape: the pools whose cards could hold it
	named       map[string][]int32   // a pool named by a request, as a list
}

// aheadGens numbers the tables (0 is no generation).
var aheadGens atomic.Uint64

// maxAheadNames bounds the tables: pools named by requests, tenants and
// request shapes (model lists) come from users; past it they are built
// afresh.
const maxAheadNames = 1 << 14

// poolsKey is what poolsOf reads of a request naming no pool.
type poolsKey struct {
	kind       contracts.GPUKind
	mig, model string
	models     string // Models joined, when it lists any
}

// newAhead starts a cycle's count over the kept tables, or new ones when
// the fleet's card kinds changed.
func (s *Store) newAhead() *ahead {
	sig := s.cardKindsSig()
	t := s.cycleBufs.ahead
	// The reference (exhaustive) builds them afresh every cycle.
	if t == nil || t.sig != sig || len(t.named)+len(t.tenants)+len(t.pools) > maxAheadNames || s.exhaustive {
		t = newAheadTables(sig)
		s.cycleBufs.ahead = t
	}
	return &ahead{s: s, aheadTables: t}
}

func newAheadTables(sig string) *aheadTables {
	return &aheadTables{sig: sig, gen: aheadGens.Add(1), ids: map[string]int32{}, tenants: map[string]int32{},
		pools: map[poolsKey][]int32{}, named: map[string][]int32{}}
}

// cardKindsSig names the (pool, model) kinds of cards out of MIG mode and
// the (pool, model, profile) kinds of MIG instances the fleet has: all
// poolsOf reads of the cluster. A few dozen kinds, sorted.
func (s *Store) cardKindsSig() string {
	c := s.cluster
	keys := make([]string, 0, len(c.sizes)+len(c.migKinds))
	for k := range c.sizes {
		keys = append(keys, k.pool+"\x00"+k.model)
	}
	for k := range c.migKinds {
		keys = append(keys, k.pool+"\x00"+k.model+"\x00"+k.profile+"\x01")
	}
	slices.Sort(keys)
	return strings.Join(keys, "\x02")
}

// id interns a pool name.
func (a *ahead) id(pool string) int32 {
	id, ok := a.ids[pool]
	if !ok {
		id = int32(len(a.ids))
		a.ids[pool] = id
	}
	return id
}

// next returns how many jobs of j's tenant were offered before it in any
// of the pools j could use, and counts j. It runs for every job a cycle
// offers: no map look-up once the job's request was seen with these
// tables, no allocation once its tenant and pools were counted.
func (a *ahead) next(j *Job) int {
	m := j.memoFor()
	if m.aheadGen != a.gen {
		m.pools = a.poolsOf(j.Request)
		t, ok := a.tenants[j.Tenant]
		if !ok {
			t = int32(len(a.tenantNames))
			a.tenants[j.Tenant] = t
			a.tenantNames = append(a.tenantNames, j.Tenant)
		}
		m.tenant, m.tenantName, m.aheadGen = t, a.tenantNames[t], a.gen
	}
	pools := m.pools
	for int(m.tenant) >= len(a.counts) {
		a.counts = append(a.counts, nil)
	}
	cs := a.counts[m.tenant]
	if cs == nil {
		cs = new([]int)
		a.counts[m.tenant] = cs
	}
	if len(*cs) < len(a.ids) {
		*cs = append(*cs, make([]int, len(a.ids)-len(*cs))...)
	}
	c := *cs
	n := 0
	for _, p := range pools {
		n = max(n, c[p])
	}
	for _, p := range pools {
		c[p]++ // pools are distinct: each counted once
	}
	return n
}

// poolsOf lists (by id) the pools with a card that could hold r's kind of GPU
// (r.Pool alone when it names one), from the fleet's card counts; one
// unnamed pool when none has.
func (a *ahead) poolsOf(r *contracts.JobRequest) []int32 {
	if r.Pool != "" {
		ps, ok := a.named[r.Pool]
		if !ok {
			ps = []int32{a.id(r.Pool)}
			a.named[r.Pool] = ps
		}
		return ps
	}
	g := &r.Resources.GPU
	key := poolsKey{kind: g.Kind(), mig: g.MIGProfile, model: g.Model}
	if len(g.Models) > 0 {
		key.models = strings.Join(g.Models, ",")
	}
	if ps, ok := a.pools[key]; ok {
		return ps
	}
	models := g.AllowedModels()
	var ps []string
	add := func(pool, model string) {
		if (models == nil || slices.Contains(models, model)) && !slices.Contains(ps, pool) {
			ps = append(ps, pool)
		}
	}
	if g.Kind() == contracts.GPUKindMIG {
		for k := range a.s.cluster.migKinds {
			if k.profile == g.MIGProfile {
				add(k.pool, k.model)
			}
		}
	} else {
		for k := range a.s.cluster.sizes {
			add(k.pool, k.model)
		}
	}
	slices.Sort(ps)
	if len(ps) == 0 {
		ps = []string{""}
	}
	ids := make([]int32, len(ps))
	for i, p := range ps {
		ids[i] = a.id(p)
	}
	a.pools[key] = ids
	return ids
}
