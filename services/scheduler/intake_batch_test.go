package scheduler

import (
	"fmt"
	"slices"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestIntakeBatchAnswersEachRequestOnce: requests that arrive together
// are decided and answered together (consumeRequests), yet each job gets
// one queued event, a job submitted twice in the same batch is still
// queued once, a cancel right behind its job's submit finds the job queued
// and cancels it, and the queue keeps arrival order.
func TestIntakeBatchAnswersEachRequestOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const jobs = 300
	// Everything is stored before the scheduler starts: its first pulls
	// take the requests in large batches.
	for i := range jobs {
		r := request(fmt.Sprintf("j%d", i), 1, h100)
		r.Pool = "nowhere" // stays queued: no cycle places it
		e.submit("acme", r)
		switch i {
		case 50:
			// The same request again under another message ID: a
			// client's retry that missed the deduplication window.
			e.publish(contracts.SubjectSubmit("acme"), "retry-j50", r)
		case 100:
			e.cancel("acme", r.ID)
		}
	}
	e.start()
	e.barrier("acme")
	var queuedSeqs []uint64
	for i := range jobs {
		id := fmt.Sprintf("j%d", i)
		if i == 100 {
			e.waitEvent("acme", id, contracts.EventCancelled)
		}
		got := e.types("acme", id)
		if len(got) == 0 || got[0] != string(contracts.EventQueued) || countOf(got, string(contracts.EventQueued)) != 1 ||
			countOf(got, string(contracts.EventRejected)) != 0 || (countOf(got, string(contracts.EventCancelled)) == 1) != (i == 100) {
			t.Fatalf("job %s: events %v, want one queued first, no rejection, cancelled only for j100", id, got)
		}
		queuedSeqs = append(queuedSeqs, e.jobEvents("acme", id)[0].SubmitSeq)
	}
	if !slices.IsSorted(queuedSeqs) {
		t.Fatalf("queued events name submit sequences out of arrival order: %v", queuedSeqs)
	}
	if n := len(e.dead.all()); n != 0 {
		t.Fatalf("%d requests dead-lettered, want none", n)
	}
}

func countOf(s []string, v string) int {
	n := 0
	for _, x := range s {
		if x == v {
			n++
		}
	}
	return n
}
