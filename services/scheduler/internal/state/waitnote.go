package state

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/services/scheduler/internal/backfill"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/fairshare"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/preempt"
)

// Notes a pending reason carries beyond placement's (issue 18, "reasons
// that are true"): when preemption will make room for a job that found no
// victim yet, and that a tenant at its guarantee cannot reclaim.

// notePreemptionLater records, for j (which may preempt but found no
// victim now), whether preemption would make room once the running jobs
// that protect it pass the minimum run time, and when: the latest start
// plus MinRuntime among the victims it would then choose. The note is
// shown with j's pending reason from now on (and published at once when
// new), until a later search says otherwise.
func (s *Store) notePreemptionLater(j *Job, r placement.Request, fleet *preempt.Fleet, opt preempt.Options) {
	note := ""
	if s.cfg.MinRuntime > 0 {
		o := opt
		o.MinRuntime = 0
		pr := preempt.Preemptor{Request: r, Priority: j.Request.Priority}
		pr.Request.Exclude, pr.Request.Reserved = nil, nil
		var skip func(*preempt.Running) bool
		if kept := s.keptFor(j); kept != nil {
			skip = func(v *preempt.Running) bool { return kept[Key(v.Tenant, v.JobID)] }
		}
		if choice, ok := fleet.Choose(pr, o, skip); ok && len(choice.Victims) > 0 {
			var when time.Time
			var keys []string
			for _, v := range choice.Victims {
				if !v.StartedAt.IsZero() {
					if t := v.StartedAt.Add(s.cfg.MinRuntime); t.After(when) {
						when = t
					}
				}
				if k := Key(v.Tenant, v.JobID); !slices.Contains(keys, k) {
					keys = append(keys, k)
				}
			}
			if now := opt.Now; when.After(now) {
				note = fmt.Sprintf("preemption makes room when %s %s the minimum run time of %s, at %s (in %s)",
					strings.Join(keys, ", "), map[bool]string{true: "passes", false: "pass"}[len(keys) == 1],
					s.cfg.MinRuntime, when.UTC().Format(time.RFC3339), backfill.Wait(when.Sub(now)))
			}
		}
	}
	if note == j.moves().note {
		return
	}
	j.movesW().note = note
	if note != "" {
		s.publishPending(j, withNote(j, stripNote(j.Pending)), true)
	}
}

// guaranteeNote says, for a job blocked by capacity whose tenant holds its
// guarantee (or more) in the pools it may use, that it cannot reclaim from
// other tenants: only priority, inside the tenant, or freed capacity will
// serve it. "" when that is not the case.
func (s *Store) guaranteeNote(j *Job, b *fairshare.Book, r placement.Request) string {
	pools := s.quotaPools(j, r)
	var at []string
	need := r.GPU.MilliGPUs()
	for _, p := range pools {
		g := b.Guarantee(j.Tenant, p)
		if g <= 0 || b.UnderGuarantee(j.Tenant, p, need) {
			continue
		}
		at = append(at, fmt.Sprintf("%s GPUs held of a guarantee of %s in pool %s", fairshare.GPUs(b.Held(j.Tenant, p)),
			fairshare.GPUs(g), p))
	}
	if len(at) == 0 {
		return ""
	}
	return fmt.Sprintf("tenant %s cannot reclaim from other tenants (%s; this job would take it past)", j.Tenant, strings.Join(at, ", "))
}

// noteSep starts the notes appended to a pending message.
const noteSep = "; preemption makes room when "

// withNote is p with j's preemption note appended.
func withNote(j *Job, p placement.Pending) placement.Pending {
	if note := j.moves().note; note != "" {
		p.Message += "; " + note
	}
	return p
}

// stripNote is p without a preemption note appended earlier.
func stripNote(p placement.Pending) placement.Pending {
	if i := strings.Index(p.Message, noteSep); i >= 0 {
		p.Message = p.Message[:i]
	}
	return p
}
