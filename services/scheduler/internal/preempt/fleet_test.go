package preempt_test

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/preempt"
)

// A Fleet's searches decide as Choose on the list they stand for: the
// running allocations less what Remove took (a decision's victims, whole
// jobs; sometimes one part of a gang, which cuts its unit) and what skip
// reports (a victim's kept work); RemoveJobs of a job as Remove of its
// allocations; for preemptors of every class, tenant,
// reclaim and size over one fleet, budgets that move between searches,
// and now and then another time (the costs are then not the fleet's).
func TestFleetSearchesDecideAsChoose(t *testing.T) {
	pris := []contracts.Priority{be, norm, high, crit}
	tenants := []string{"research", "other", "third"}
	for seed := range uint64(400) {
		rng := rand.New(rand.NewPCG(seed, 41))
		w := randomWorld(rng, 2+rng.IntN(4), seed%3 == 0)
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			snap := placement.Snapshot{Nodes: w.nodes}
			fleet := preempt.NewFleet(snap, w.running, t0)
			removed := map[string]bool{} // allocation IDs
			for search := range 6 {
				// Remove a random job (every part), or one part only.
				if len(w.running) > 0 && rng.IntN(2) == 0 {
					v := w.running[rng.IntN(len(w.running))]
					onePart := rng.IntN(4) == 0
					match := func(r *preempt.Running) bool {
						if onePart {
							return r.AllocationID == v.AllocationID
						}
						return r.Tenant == v.Tenant && r.JobID == v.JobID
					}
					switch {
					case onePart:
						fleet.Remove(match)
					case rng.IntN(2) == 0:
						// By job, with a job nothing running is of.
						fleet.RemoveJobs([]preempt.JobRef{{Tenant: "nobody", JobID: v.JobID}, {Tenant: v.Tenant, JobID: v.JobID}})
					default:
						fleet.Remove(match)
					}
					for _, r := range w.running {
						if match(&r) {
							removed[r.AllocationID] = true
						}
					}
				}
				var skip func(*preempt.Running) bool
				if rng.IntN(3) == 0 {
					tn := tenants[rng.IntN(len(tenants))]
					skip = func(r *preempt.Running) bool { return r.Tenant == tn && r.Priority == norm }
				}
				p := w.p
				p.Priority = pris[1+rng.IntN(len(pris)-1)]
				p.Reclaim = rng.IntN(2) == 0
				p.Request.Tenant = tenants[rng.IntN(len(tenants))]
				if rng.IntN(3) == 0 && p.Request.GPU.Kind() == contracts.GPUKindWhole {
					k := 2 + rng.IntN(2)
					p.Request.GPU.Count, p.Request.GPU.Nodes = k, k
				}
				opt := preempt.Options{Now: t0, MinRuntime: w.minRuntime, Spare: w.spare}
				if w.spare != nil && rng.IntN(2) == 0 {
					opt.Spare = map[preempt.TenantPool]int64{}
					for k, v := range w.spare {
						opt.Spare[k] = max(0, v-int64(rng.IntN(3))*500)
					}
				}
				if rng.IntN(6) == 0 {
					opt.Now = t0.Add(time.Duration(1+rng.IntN(30)) * time.Minute)
				}
				var rs []preempt.Running
				for _, r := range w.running {
					if !removed[r.AllocationID] && (skip == nil || !skip(&r)) {
						rs = append(rs, r)
					}
				}
				want, wantOK := preempt.Choose(snap, slices.Clone(rs), p, opt)
				got, gotOK := fleet.Choose(p, opt, skip)
				if gotOK != wantOK || !reflect.DeepEqual(got, want) {
					t.Fatalf("search %d: fleet %v %+v, Choose %v %+v", search, gotOK, got, wantOK, want)
				}
			}
		})
	}
}
