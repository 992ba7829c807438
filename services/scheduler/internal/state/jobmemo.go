package state

import (
	"hash/maphash"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/fairshare"
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
	// expected and rank are the request's expectedRunTime and priority
	// rank: what reservations a job must not delay depends on them
	// (reservedFor).
	expected time.Duration
	// usage is usageOf(of) (Job.usage).
	usage fairshare.Usage
	// pools and tenant are ahead's pool ids of the request and the job's
	// tenant id, in the ahead tables of generation aheadGen (0: none);
	// tenantName is the job's tenant, interned there.
	aheadGen   uint64
	pools      []int32
	tenantName string
	tenant     int32
	rank       int32
}

// memoFor is j's memo of its current request, made afresh when the
// request changed.
func (j *Job) memoFor() *jobMemo {
	if j.memo == nil || j.memo.of != j.Request {
		j.memo = &jobMemo{of: j.Request}
		if j.Request != nil {
			j.memo.rank, j.memo.expected = int32(j.Request.Priority.Rank()), expectedRunTime(j.Request)
			j.memo.usage = usageOf(j.Request)
		}
	}
	return j.memo
}

// msgSeed seeds msgKey: keys are compared within this process only (a
// rebuild computes them again from the events it reads).
var msgSeed = maphash.MakeSeed()

// msgKey stands for a published pending message, to tell whether the
// current one differs: a waiting job's message is ~150 bytes, unique to
// it (its place in the queue), and the last one published was kept beside
// the current one, which the next cycles change without publishing (events
// are spaced). 0 is the empty message, as before any was published. Two
// messages with the same key (odds of 2^-63) would only hold back the
// changed message's event until the message or its code changes again.
func msgKey(s string) uint64 {
	if s == "" {
		return 0
	}
	return maphash.String(msgSeed, s) | 1
}
