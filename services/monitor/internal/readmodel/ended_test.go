package readmodel

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestEndedJobsLeaveOnlyTheirKeys: random event streams (redeliveries,
// stale and impossible events among them) give the same answers and the
// same counts by state as the state machine applied to a map that keeps
// every job, while the model keeps whole records of open jobs only.
func TestEndedJobsLeaveOnlyTheirKeys(t *testing.T) {
	types := contracts.JobEventTypes
	for seed := range uint64(5) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rnd := rand.New(rand.NewPCG(seed, 3))
			m := New()
			ref := map[jobKey]contracts.JobState{} // every job, kept whole
			for i := range 20000 {
				k := jobKey{[]string{"acme", "beta"}[rnd.IntN(2)], fmt.Sprintf("j%d", rnd.IntN(1+i/4))}
				ev := types[rnd.IntN(len(types))]
				if rnd.IntN(3) == 0 { // mostly the events a job would get next
					ev = []contracts.JobEventType{contracts.EventQueued, contracts.EventScheduled, contracts.EventRunning,
						contracts.EventSucceeded}[rnd.IntN(4)]
				}
				to, wantErr := contracts.Transition(ref[k], ev)
				err := m.ApplyJobEvent(k.tenant, k.job, contracts.JobEvent{Type: ev})
				if (wantErr != nil) != (err != nil) || (err != nil && err.Error() != wantErr.Error()) {
					t.Fatalf("event %d, %v %s on %q: model %v, state machine %v", i, k, ev, ref[k], err, wantErr)
				}
				if err == nil {
					ref[k] = to
				}
			}
			want := map[string]map[contracts.JobState]int{}
			open, ended := 0, 0
			for k, st := range ref {
				if want[k.tenant] == nil {
					want[k.tenant] = map[contracts.JobState]int{}
				}
				want[k.tenant][st]++
				if st.Terminal() {
					ended++
				} else {
					open++
				}
			}
			got := map[string]map[contracts.JobState]int{}
			for _, c := range m.Snapshot(time.Time{}).Jobs {
				if c.Jobs == 0 {
					continue
				}
				if got[c.Tenant] == nil {
					got[c.Tenant] = map[contracts.JobState]int{}
				}
				got[c.Tenant][c.State] = c.Jobs
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("jobs by tenant and state (-state machine +model):\n%s", diff)
			}
			if ended == 0 || open == 0 {
				t.Fatalf("%d ended and %d open jobs: the workload proves nothing", ended, open)
			}
			if len(m.jobs) != open || len(m.ended) != ended {
				t.Errorf("model keeps %d whole and %d ended keys; want %d open whole and %d ended keys", len(m.jobs), len(m.ended), open, ended)
			}
		})
	}
}

// An ended job's redelivered or late event is refused as before.
func TestAnEndedJobRefusesEveryEvent(t *testing.T) {
	m := New()
	for _, ev := range []contracts.JobEventType{contracts.EventQueued, contracts.EventCancelled} {
		if err := m.ApplyJobEvent("acme", "j", contracts.JobEvent{Type: ev}); err != nil {
			t.Fatal(err)
		}
	}
	for _, ev := range contracts.JobEventTypes {
		err := m.ApplyJobEvent("acme", "j", contracts.JobEvent{Type: ev})
		if !errors.Is(err, contracts.ErrTransition) {
			t.Errorf("%s on an ended job: %v, want ErrTransition", ev, err)
		}
	}
	if len(m.jobs) != 0 || len(m.ended) != 1 {
		t.Errorf("%d whole, %d ended; want 0 and 1", len(m.jobs), len(m.ended))
	}
}
