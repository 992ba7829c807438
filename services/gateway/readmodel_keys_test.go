package gateway

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestRetiredKeysStayCompact: the set of retired jobs' keys holds one
// entry per retired job, in a sorted array and a map of the recent ones
// that never holds more than max(4096, an eighth of the array) (merged
// beyond), whether the keys came one by one or from a snapshot; every
// retired job is found in it and no other, so each still refuses its
// events and answers from the log, and a job never seen is unknown.
func TestRetiredKeysStayCompact(t *testing.T) {
	ctx := context.Background()
	fetch := func(_ context.Context, tenant, job string) (contracts.JobStatus, error) {
		return contracts.JobStatus{Tenant: tenant, JobID: job, State: contracts.StateCancelled}, nil
	}
	m := newRetainingModel(RetentionConfig{RetainEnded: time.Nanosecond, RetainEndedMax: 1, CachedJobs: 1},
		func() time.Time { return t0.Add(time.Hour) }, fetch, nil)
	tenants := []string{"acme", "globex", "initech"}
	seq := uint64(0)
	apply := func(ev contracts.JobEvent) error {
		seq++
		return m.ApplyJobEvent(ctx, ev.Tenant, ev.JobID, ev, seq)
	}
	const rounds, perRound = 6, 5_000
	check := func(t *testing.T, m *memoryModel, retired int) {
		t.Helper()
		m.mu.RLock()
		keys := m.retiredKeys
		m.mu.RUnlock()
		if keys.len() != retired {
			t.Fatalf("%d retired keys, want %d", keys.len(), retired)
		}
		if bound := max(4096, len(keys.sorted)/8); len(keys.recent) >= bound {
			t.Fatalf("%d recent keys beside %d sorted: want < %d", len(keys.recent), len(keys.sorted), bound)
		}
		for i := range retired {
			tenant, id := tenants[i%len(tenants)], fmt.Sprintf("job-%d", i)
			if !keys.has(retiredKey(tenant, id)) {
				t.Fatalf("retired job %s/%s is not in the set", tenant, id)
			}
			if keys.has(retiredKey(tenants[(i+1)%len(tenants)], id)) {
				t.Fatalf("job %s of another tenant than %s is in the set", id, tenant)
			}
		}
		if _, err := m.Job(ctx, "acme", "never-seen"); !errors.Is(err, errUnknownJob) {
			t.Fatalf("a job never seen: %v, want errUnknownJob", err)
		}
	}
	n := 0
	for round := 1; round <= rounds; round++ {
		for range perRound {
			tenant, id := tenants[n%len(tenants)], fmt.Sprintf("job-%d", n)
			if err := apply(queued(tenant, id, t0)); err != nil {
				t.Fatal(err)
			}
			if err := apply(contracts.JobEvent{Type: contracts.EventCancelled, Tenant: tenant, JobID: id, Attempt: 1, Time: t0}); err != nil {
				t.Fatal(err)
			}
			n++
		}
		// The last job ended stays whole (RetainEndedMax 1): it retires
		// with the next event.
		check(t, m, n-1)
	}
	// Each retired job still refuses its events and answers from the log.
	for _, i := range []int{0, n / 2, n - 2} {
		tenant, id := tenants[i%len(tenants)], fmt.Sprintf("job-%d", i)
		err := apply(contracts.JobEvent{Type: contracts.EventRunning, Tenant: tenant, JobID: id, Attempt: 1, Time: t0})
		if !errors.Is(err, contracts.ErrTransition) {
			t.Fatalf("event on retired job %s/%s: %v, want ErrTransition", tenant, id, err)
		}
		if st, err := m.Job(ctx, tenant, id); err != nil || st.State != contracts.StateCancelled {
			t.Fatalf("retired job %s/%s: %+v, %v", tenant, id, st, err)
		}
	}
	// From a snapshot: every key at once, sorted, none recent.
	r := newRetainingModel(RetentionConfig{RetainEnded: time.Nanosecond, RetainEndedMax: 1, CachedJobs: 1},
		func() time.Time { return t0.Add(time.Hour) }, fetch, nil)
	r.install(m.snapshot(seq))
	if len(r.retiredKeys.recent) != 0 {
		t.Fatalf("%d recent keys after a snapshot's install, want 0", len(r.retiredKeys.recent))
	}
	// The events above retired the last job too.
	check(t, r, n)
}
