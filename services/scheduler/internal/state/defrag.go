package state

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/preempt"
)

// Defragmentation: while the monitor reports a pool's free capacity
// fragmented (a firing defragment alert), a job blocked there by capacity
// may have small jobs moved out of its way, when
//   - moving them lets it start: preempt.Choose, in defragment mode, finds
//     the cheapest set of single-machine jobs whose devices it needs;
//   - every moved job fits elsewhere right now, off the freed nodes (it is
//     migrated, not evicted to wait);
//   - the progress lost is worth it: each move costs its GPUs × (the time
//     since its start or last checkpoint, nothing for a job that
//     checkpoints first, plus moveOverhead for the restart), and the sum
//     must not exceed the blocked job's GPUs × the time it has waited;
//   - no moved job is expected to end within moveOverhead anyway (its
//     ExpectedRunTime, or its run's duration, from its start): waiting for
//     it costs less than restarting it;
//   - at most maxDefragMoves jobs, for one blocked job per cycle.
// The moved jobs keep off the freed nodes in their next attempt (avoid), so
// the blocked job, waiting for their releases as a preemptor does, gets
// them.

const (
	maxDefragMoves = 4
	moveOverhead   = 30 * time.Second
)

// ApplyDefrag records whether pool's defragment alert (key) fires.
func (s *Store) ApplyDefrag(pool, key string, firing bool) {
	switch {
	case firing:
		s.defrag[pool] = key
	case s.defrag[pool] == key:
		delete(s.defrag, pool)
	}
	s.cfg.Wake()
}

// Defragmenting returns the pools where consolidation is allowed, each with
// the key of the alert that allows it. It is a copy, so that a reader (the
// service's tests of its alert follow) can look without holding the store.
func (s *Store) Defragmenting() map[string]string { return maps.Clone(s.defrag) }

// defragment tries the cycle's blocked jobs, in queue order, until one
// gets room.
func (s *Store) defragment(now time.Time, misses []miss) {
	if len(s.defrag) == 0 {
		return
	}
	var snap placement.Snapshot
	var running []preempt.Running
	var fleet *preempt.Fleet // every search below shares it: nothing moves until the one decision
	defragPools := slices.Sorted(maps.Keys(s.defrag))
	// searched keeps, per search asked (defragAsk), what the search and
	// the refit check found: nothing moves until the one decision, so a
	// blocked job asking what an earlier one asked gets the same answer.
	// Thousands of jobs wait behind a few request shapes while a pool is
	// fragmented, and each search walks the whole fleet. Only what is
	// worth it (the job's own wait) is judged per job. The exhaustive
	// reference searches every job afresh.
	searched := map[string]defragFound{}
	for _, m := range misses {
		j := m.j
		if j.State != contracts.StateQueued || len(j.parts) > 0 || len(j.moves().victims) > 0 || j.Request == nil ||
			j.Pending.Code != contracts.PendingInsufficientGPUs {
			continue
		}
		pools := defragPools
		if m.r.Pool != "" {
			if _, ok := s.defrag[m.r.Pool]; !ok {
				continue
			}
			pools = []string{m.r.Pool}
		}
		askBase, memo := defragAsk(m.r, j.Request.Priority, usageOf(j.Request).MilliGPU)
		memo = memo && !s.exhaustive
		if running == nil {
			snap = s.cluster.snapshot(now)
			running = s.movable(now)
			fleet = preempt.NewFleet(snap, running, now)
		}
		for _, pool := range pools {
			found, ok := searched[askBase+pool]
			if !ok || !memo {
				r := m.r
				r.Pool, r.Exclude, r.Reserved, r.ExcludeKey = pool, nil, nil, ""
				found = s.defragSearch(fleet, snap, r, j.Request.Priority, now)
				s.defragSearches++
				if memo {
					searched[askBase+pool] = found
				}
			}
			if !found.ok {
				continue
			}
			choice, freed := found.choice, found.freed
			lost, gain := moveCost(now, choice.Victims), gpuSeconds(j.Request.Resources.GPU.MilliGPUs(), now.Sub(j.queued()))
			if lost > gain {
				s.log.Debug("defragmentation not worth it", "tenant", j.Tenant, "job_id", j.ID, "lost_gpu_s", lost, "gain_gpu_s", gain)
				continue
			}
			s.consolidate(j, choice, freed, pool)
			return
		}
	}
}

// defragFound is a defragment search's answer for one blocked request in
// one pool: ok when its victims are few enough and all fit elsewhere.
type defragFound struct {
	ok     bool
	choice preempt.Choice
	freed  map[string]bool
}

// defragSearch finds the victims whose move would let r start in its pool
// (r.Pool), and whether they all fit elsewhere, off the nodes they free.
func (s *Store) defragSearch(fleet *preempt.Fleet, snap placement.Snapshot, r placement.Request, prio contracts.Priority, now time.Time) defragFound {
	choice, ok := fleet.Choose(preempt.Preemptor{Request: r, Priority: prio},
		preempt.Options{Now: now, MinRuntime: s.cfg.MinRuntime, Defragment: true}, nil)
	if !ok || len(choice.Victims) == 0 || len(choice.Victims) > maxDefragMoves {
		return defragFound{}
	}
	freed := map[string]bool{}
	for _, p := range choice.Parts {
		freed[p.NodeID] = true
	}
	if !s.refits(snap, choice.Victims, freed) {
		return defragFound{}
	}
	return defragFound{ok: true, choice: choice, freed: freed}
}

// defragAsk names everything a defragment search reads of a blocked
// job's request (preempt.Choose, with the pool appended by the caller):
// its tenant (whose quota AllowPool asks), priority, GPUs, host CPU
// and memory, selector and tolerations, and the need (milli-GPUs) its
// AllowPool asks the quota about. The message fields
// (Ahead, Extra) and Prefer are not read by a search; a request with a
// runtime check (PoolRuns, a closure over the job's run) is not named
// (false): it is searched on its own.
func defragAsk(r placement.Request, prio contracts.Priority, need int64) (string, bool) {
	if r.PoolRuns != nil {
		return "", false
	}
	b, err := json.Marshal(struct {
		Tenant      string
		Priority    contracts.Priority
		GPU         contracts.GPURequest
		CPU, Mem    int64
		Need        int64
		Quota       bool
		Selector    map[string]string
		Tolerations []contracts.Toleration
	}{r.Tenant, prio, r.GPU, r.CPUMilli, r.MemoryMiB, need, r.AllowPool != nil, r.Selector, r.Tolerations})
	if err != nil {
		return "", false
	}
	return string(b) + "\x00", true
}

// movable lists the single-machine jobs a consolidation may move: not
// those expected to end within moveOverhead of now. One already past its
// expected end says nothing about when it will end, and may move.
func (s *Store) movable(now time.Time) []preempt.Running {
	var out []preempt.Running
	for _, r := range s.victimsOf(nil) {
		if r.Gang != "" {
			continue
		}
		if j := s.jobs[Key(r.Tenant, r.JobID)]; !r.StartedAt.IsZero() && j != nil && j.Request != nil {
			if d := expectedRunTime(j.Request); d > 0 {
				if left := r.StartedAt.Add(d).Sub(now); left >= 0 && left < moveOverhead {
					continue
				}
			}
		}
		out = append(out, r)
	}
	return out
}

// refits reports whether every victim can be placed again at once on the
// cluster as it is, off the freed nodes.
func (s *Store) refits(snap placement.Snapshot, victims []preempt.Running, freed map[string]bool) bool {
	p := placement.NewPlacer(snap, placement.Options{Policy: s.policyFor, Workload: s.workload.requests()})
	for _, v := range victims {
		vj := s.jobs[Key(v.Tenant, v.JobID)]
		if vj == nil || vj.Request == nil {
			return false
		}
		r := s.request(vj, 0)
		r.Exclude, r.ExcludeKey = freed, "defrag-freed"
		if !p.Place(r).Placed() {
			return false
		}
	}
	return true
}

// moveCost is the progress the victims lose, with the restart overhead,
// in GPU-seconds.
func moveCost(now time.Time, victims []preempt.Running) float64 {
	var total float64
	for _, v := range victims {
		lost := moveOverhead
		if !v.StartedAt.IsZero() && !v.Checkpointable {
			from := v.StartedAt
			if v.LastCheckpoint.After(from) {
				from = v.LastCheckpoint
			}
			lost += now.Sub(from)
		}
		total += gpuSeconds(milliOf(&contracts.Allocation{Devices: v.Devices}), lost)
	}
	return total
}

func gpuSeconds(milli int64, d time.Duration) float64 {
	return float64(milli) / 1000 * d.Seconds()
}

// consolidate moves the victims and makes j wait for their devices.
func (s *Store) consolidate(j *Job, choice preempt.Choice, freed map[string]bool, pool string) {
	nodes := slices.Sorted(maps.Keys(freed))
	keys := s.evictVictims(j, choice, move{reason: contracts.ReasonDefragment, triggered: s.cfg.Now(),
		msg: fmt.Sprintf("moved to consolidate pool %s: %s/%s needs %s", pool, j.Tenant, j.ID, strings.Join(nodes, ", "))}, freed)
	s.setPending(j, placement.Pending{Code: contracts.PendingPreempting,
		Message: "defragmenting pool " + pool + ": moving " + strings.Join(keys, ", ") + " off " + strings.Join(nodes, ", ")})
	s.log.Info("defragmenting", "tenant", j.Tenant, "job_id", j.ID, "moved", keys, "nodes", nodes)
}
