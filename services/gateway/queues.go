package gateway

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

// GET /v1/queues answers, per pool and tenant, what waits and why: the
// queued jobs with the scheduler's last pending reason (and the backfill
// reservation it holds for a job, which the scheduler states in that
// message), what the tenant's scheduled and running jobs hold against its
// quota's guarantee and max, its place in fair-share order and its
// waiting jobs per priority class. It is read from the gateway's job read
// model, the fleet hub's placements and the quotas bucket; a caller who
// is not a platform admin sees only the tenants it has a role on.
//
// The fair-share order is the gateway's view of the scheduler's: tenants
// by weighted GPU share (held GPUs over weight), lowest first, ties by
// name. The scheduler's dominant share also counts host CPU and memory,
// and it serves a higher priority class of any tenant first; the waiting
// jobs are listed in that order within a tenant (class, then age).

// reservationPrefix is how the scheduler's backfill names a reservation it
// holds for a job in the job's pending message (backfill.message).
const reservationPrefix = "capacity reserved on "

// anyPool groups the queued jobs that name no pool.
const anyPool = "*"

// queuesRequest is what GET /v1/queues and its stream share before they
// answer: a read model caught up, the caller, and a valid pool filter;
// ok is false once it has answered the request itself.
func (s *server) queuesRequest(w http.ResponseWriter, r *http.Request) (p Principal, pool string, ok bool) {
	if !s.modelReady(w) {
		return p, "", false
	}
	if p, ok = principalFrom(r.Context()); !ok {
		s.unauthorized(w, r, refused(contracts.ReasonUnauthenticated, "no credentials"))
		return p, "", false
	}
	pool = r.URL.Query().Get("pool")
	if !validPoolFilter(w, pool) {
		return p, "", false
	}
	return p, pool, true
}

func (s *server) listQueues(w http.ResponseWriter, r *http.Request) {
	p, poolFilter, ok := s.queuesRequest(w, r)
	if !ok {
		return
	}
	quotas, ok := s.readQuotas(w, r)
	if !ok {
		return
	}
	out, err := s.buildQueues(r.Context(), p, poolFilter, quotas)
	if err != nil {
		s.internalError(w, "read model", err)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// validPoolFilter answers 400 and returns false when the ?pool= filter is
// neither empty, * nor a pool name.
func validPoolFilter(w http.ResponseWriter, poolFilter string) bool {
	if poolFilter != "" && poolFilter != anyPool {
		if err := contracts.ValidatePool(poolFilter); err != nil {
			writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, err.Error(),
				[]contracts.FieldError{{Field: "pool", Reason: contracts.ReasonInvalidValue, Message: err.Error()}})
			return false
		}
	}
	return true
}

// buildQueues assembles the queues as p sees them (GET /v1/queues and
// each event of GET /v1/queues/events); poolFilter keeps one pool.
func (s *server) buildQueues(ctx context.Context, p Principal, poolFilter string, quotas map[string]contracts.TenantQuota) (contracts.QueueList, error) {
	visible := func(t string) bool { return p.has(contracts.RoleViewer, t) }

	type key struct{ pool, tenant string }
	queues := map[key]*contracts.TenantQueue{}
	queue := func(pool, tenant string) *contracts.TenantQueue {
		k := key{pool, tenant}
		if queues[k] == nil {
			q := quotas[tenant]
			tq := &contracts.TenantQueue{Tenant: tenant, Weight: q.EffectiveWeight(), Waiting: []contracts.WaitingJob{}}
			if pool != anyPool {
				if pq, ok := q.For(pool); ok {
					tq.Quota = &pq
				}
			}
			queues[k] = tq
		}
		return queues[k]
	}
	// What is held: the fleet hub's placements of scheduled and running
	// jobs, per pool of the node.
	s.fleet.dmu.RLock()
	for k, ps := range s.fleet.jobs {
		if !visible(k.tenant) {
			continue
		}
		counted := map[string]bool{}
		for _, pl := range ps {
			q := queue(pl.Pool, k.tenant)
			for _, d := range pl.Devices {
				q.UsedGPUs += float64(d.MilliGPUs()) / 1000
			}
			if !counted[pl.Pool] {
				q.Running++
				counted[pl.Pool] = true
			}
		}
	}
	s.fleet.dmu.RUnlock()
	// What waits: every queued job of every visible tenant.
	for _, t := range s.fleet.knownTenants() {
		if !visible(t) {
			continue
		}
		jobs, err := s.model.Jobs(ctx, t, jobQuery{State: contracts.StateQueued})
		if err != nil {
			return contracts.QueueList{}, fmt.Errorf("queued jobs of %s: %w", t, err)
		}
		for _, st := range jobs {
			pool, prio, gpus := anyPool, contracts.PriorityNormal, 0.0
			if st.Request != nil {
				if st.Request.Pool != "" {
					pool = st.Request.Pool
				}
				if st.Request.Priority != "" {
					prio = st.Request.Priority
				}
				g := st.Request.Resources.GPU
				gpus = float64(g.MilliGPUs()) / 1000
			}
			wj := contracts.WaitingJob{JobID: st.JobID, Name: st.Name, Priority: prio, GPUs: gpus, Attempt: st.Attempt,
				Reason: st.Reason, Message: st.Message, QueuedAt: st.CreatedAt, UpdatedAt: st.UpdatedAt}
			if i := strings.Index(st.Message, reservationPrefix); i >= 0 {
				wj.Reservation = st.Message[i:]
			}
			q := queue(pool, t)
			q.Waiting = append(q.Waiting, wj)
			if q.WaitingByPriority == nil {
				q.WaitingByPriority = map[string]int{}
			}
			q.WaitingByPriority[string(prio)]++
		}
	}
	byPool := map[string][]contracts.TenantQueue{}
	for k, q := range queues {
		if poolFilter != "" && k.pool != poolFilter {
			continue
		}
		q.Share = q.UsedGPUs / q.Weight
		slices.SortFunc(q.Waiting, func(a, b contracts.WaitingJob) int {
			return cmp.Or(cmp.Compare(b.Priority.Rank(), a.Priority.Rank()), a.QueuedAt.Compare(b.QueuedAt), cmp.Compare(a.JobID, b.JobID))
		})
		byPool[k.pool] = append(byPool[k.pool], *q)
	}
	out := contracts.QueueList{Priorities: contracts.Priorities, Pools: []contracts.PoolQueue{}, Time: s.now().UTC()}
	for _, pool := range slices.Sorted(maps.Keys(byPool)) {
		ts := byPool[pool]
		slices.SortFunc(ts, func(a, b contracts.TenantQueue) int {
			return cmp.Or(cmp.Compare(a.Share, b.Share), cmp.Compare(a.Tenant, b.Tenant))
		})
		for i := range ts {
			ts[i].Order = i + 1
		}
		out.Pools = append(out.Pools, contracts.PoolQueue{Pool: pool, Tenants: ts})
	}
	return out, nil
}

// readQuotas reads every tenant's quota (one that does not decode is
// logged and left out: the tenant shows without one). It answers 503 and
// returns false when the bucket cannot be read.
func (s *server) readQuotas(w http.ResponseWriter, r *http.Request) (map[string]contracts.TenantQuota, bool) {
	kv := s.kv(w, r, contracts.BucketQuotas)
	if kv == nil {
		return nil, false
	}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	entries, err := listDocs(ctx, kv)
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("reading the quotas: %v", err), nil)
		return nil, false
	}
	out := make(map[string]contracts.TenantQuota, len(entries))
	for _, e := range entries {
		var q contracts.TenantQuota
		if err := json.Unmarshal(e.Value(), &q); err != nil {
			s.log.Warn("queues: skipping a stored quota that does not decode", "tenant", e.Key(), "revision", e.Revision(), "err", err)
			continue
		}
		out[e.Key()] = q
	}
	return out, true
}
