package state

import (
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// jobMemo is what a cycle derives from a queued job's request alone, kept
// while the request stays the same (a request is never changed in place:
// a job given another one gets another pointer). Every cycle offers every
// queued job, and ~88,000 of 100,000 stay waiting in a steady one: each
// derived the same placement keys and ahead pools as the cycle before.
type jobMemo struct {
	of *contracts.JobRequest
	// place is placement's (Placer.PlaceMemo).
	place placement.RequestMemo
	// rank and expected are the request's priority rank and
	// expectedRunTime: what reservations a job must not delay depends on
	// them (reservedFor).
	rank     int
	expected time.Duration
	// pools and tenant are ahead's pool ids of the request and the job's
	// tenant id, in the ahead tables of generation aheadGen (0: none);
	// tenantName is the job's tenant, interned there.
	aheadGen   uint64
	pools      []int32
	tenant     int32
	tenantName string
}

// memoFor is j's memo of its current request, made afresh when the
// request changed.
func (j *Job) memoFor() *jobMemo {
	if j.memo == nil || j.memo.of != j.Request {
		j.memo = &jobMemo{of: j.Request}
		if j.Request != nil {
			j.memo.rank, j.memo.expected = j.Request.Priority.Rank(), expectedRunTime(j.Request)
		}
	}
	return j.memo
}
