package state

import (
	"encoding/json"
	"fmt"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/demand"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// CycleResult is what one scheduling cycle decided.
type CycleResult struct {
	// Plans to publish, in order. Usually one; a cycle that places more
	// than MaxPlanBytes of items splits it.
	Plans []contracts.Plan
	// Publish are pending events of jobs whose reason changed.
	Publish []Publish
	// Demand is every pool's demand after the cycle.
	Demand map[string]contracts.PoolDemand
	// Placed and Waiting count the jobs proposed and left waiting.
	Placed, Waiting int
}

// Cycle offers every queued job, in queue order, to a first-fit placer over
// the current snapshot (ledger and plans in flight both hold devices). Jobs
// that fit become plan items and are held in flight until the ledger or a
// refusal answers; the others get a pending reason. It is level-triggered:
// calling it twice with no new fact in between places nothing new and
// publishes nothing new.
func (s *Store) Cycle() CycleResult {
	snap := s.cluster.snapshot(s.cfg.Now())
	p := placement.NewPlacer(snap)
	type hit struct {
		j *Job
		d placement.Decision
	}
	type miss struct {
		j *Job
		p placement.Pending
		r placement.Request
	}
	var (
		hits   []hit
		misses []miss
		ahead  = map[string]int{}
		served = map[contracts.Priority]string{}
	)
	// The watermark: a job that arrived after a request still being
	// accepted waits for it (a cycle or two, milliseconds), or it could
	// take capacity the earlier arrival is owed.
	watermark := ^uint64(0)
	for seq := range s.accepting {
		watermark = min(watermark, seq)
	}
	for it := range s.queue.Order() {
		j := it.Value
		if j.seq > watermark {
			continue
		}
		g := j.Request.Resources.GPU
		r := placement.Request{Tenant: j.Tenant, Ahead: ahead[j.Tenant], Count: g.Count, Model: g.Model,
			MemoryMiB: g.MemoryMiB, Pool: j.Request.Pool}
		ahead[j.Tenant]++
		if d := p.Place(r); d.Placed() {
			hits = append(hits, hit{j, d})
			served[it.Priority] = j.Tenant
		} else {
			misses = append(misses, miss{j, d.Pending, r})
		}
	}
	for prio, tenant := range served {
		s.queue.StartAfter(prio, tenant)
	}

	now := s.cfg.Now().UTC()
	res := CycleResult{Placed: len(hits), Waiting: len(misses)}
	used := map[string]int{}
	size := 0
	for _, h := range hits {
		j, d := h.j, h.d
		refs := make([]contracts.DeviceRef, len(d.Devices))
		for i, g := range d.Devices {
			refs[i] = contracts.DeviceRef{Index: g.Index, UUID: g.UUID, Model: g.Model}
		}
		item := contracts.Allocation{ID: contracts.AllocationID(j.Tenant, j.ID, j.Attempt), Tenant: j.Tenant,
			JobID: j.ID, Attempt: j.Attempt, NodeID: d.NodeID, Pool: d.Pool, Devices: refs,
			Priority: j.Request.Priority, Run: j.Request.Run, Scheduler: s.cfg.Scheduler}
		n := itemSize(item)
		if len(res.Plans) == 0 || size+n > s.cfg.MaxPlanBytes {
			s.planSeq++
			res.Plans = append(res.Plans, contracts.Plan{SchemaVersion: contracts.SchemaVersion,
				ID:        fmt.Sprintf("%s-%s-%d", s.cfg.Scheduler, s.cfg.Boot, s.planSeq),
				Scheduler: s.cfg.Scheduler, Time: now})
			size = 256
		}
		plan := &res.Plans[len(res.Plans)-1]
		item.PlanID = plan.ID
		plan.Items = append(plan.Items, item)
		size += n
		used[d.Pool] += len(refs)
		s.fly(j, &item)
	}
	waiting := make([]placement.Request, len(misses))
	for i, m := range misses {
		s.setPending(m.j, m.p)
		waiting[i] = m.r
	}
	res.Publish = s.take()
	res.Demand = demand.Compute(snap, used, waiting, s.cluster.pools(), now)
	return res
}

// itemSize estimates an item's encoded size. A plain simulated run is
// estimated from its strings (cheap, and cycles run under the scheduler's
// lock); one with a command or environment, whose escaping can grow it, is
// encoded to be sure.
func itemSize(a contracts.Allocation) int {
	if len(a.Run.Command) > 0 || len(a.Run.Env) > 0 {
		b, err := json.Marshal(a)
		if err != nil {
			return contracts.MaxMessageBytes
		}
		return len(b) + 128 // planId, set afterwards
	}
	n := 512 + 2*len(a.ID) + len(a.Tenant) + len(a.JobID) + len(a.NodeID) + len(a.Pool) + len(a.Scheduler)
	for _, d := range a.Devices {
		n += 48 + len(d.UUID) + len(d.Model)
	}
	return n
}

// PlanFailed puts back the items of a plan that could not be published:
// their devices are free again and their jobs wait in the queue (or are
// cancelled, when a cancel waited on the plan).
func (s *Store) PlanFailed(planID string) []Publish {
	for id, j := range s.flying {
		if j.inFlight.PlanID != planID {
			continue
		}
		s.cluster.forget(id, planID)
		s.land(j)
		if j.cancel {
			s.cancelQueued(j)
		} else {
			s.enqueue(j)
		}
	}
	s.cfg.Wake()
	return s.take()
}
