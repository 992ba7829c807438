package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestListWindowDropsOldEndedJobs: a read model with a list window
// answers every job by ID as one that keeps every job whole, those the
// window dropped folded from JOB_EVENTS; its lists are the full model's
// less the ended jobs created before the window (and no others), cursors
// on dropped jobs included; and a duplicate_job_id rejection of a
// dropped job's ID makes no job.
func TestListWindowDropsOldEndedJobs(t *testing.T) {
	h := newRetireHarness(t, 5)
	for range 5 { // jobs created all along the clock, most of them ended
		h.workload(50)
	}
	window := h.clock.Sub(t0) / 2
	all := newMemoryModel()
	allIn := h.ingest(all, nil)
	m := newRetainingModel(RetentionConfig{RetainEnded: time.Minute, RetainEndedMax: 1, CachedJobs: 4, ListRetention: window},
		func() time.Time { return h.clock.Add(time.Hour) }, streamFetcher(h.gw),
		func(ctx context.Context, tenant string, want map[string]*contracts.JobStatus) error {
			return tenantFetch(ctx, h.gw, tenant, want)
		})
	m.pruneStep = 0 // the window applied at every event, exactly at its start
	in := h.ingest(m, nil)
	horizon := h.clock.Add(-window) // the newest event's time, less the window

	ctx := context.Background()
	asJSON := func(v any, err error) string {
		if errors.Is(err, errUnknownJob) {
			return "unknown"
		}
		if err != nil {
			t.Fatalf("read: %v", err)
		}
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	// listed reports whether m should list st: open, whole, or created
	// in the window.
	listed := func(st contracts.JobStatus) bool {
		m.mu.RLock()
		whole := m.jobs[st.Tenant][st.JobID] != nil
		m.mu.RUnlock()
		return endedIndex(st.State) < 0 || whole || !st.CreatedAt.Before(horizon)
	}
	check := func() (dropped []jobKey) {
		t.Helper()
		for _, tenant := range h.tenants {
			for _, id := range append(slices.Clone(h.jobs[tenant]), "nope") {
				w, g := asJSON(all.Job(ctx, tenant, id)), asJSON(m.Job(ctx, tenant, id))
				if w != g {
					t.Fatalf("job %s/%s:\nwant %s\ngot  %s", tenant, id, w, g)
				}
			}
			full, err := all.Jobs(ctx, tenant, jobQuery{})
			if err != nil {
				t.Fatal(err)
			}
			for _, st := range full {
				if !listed(st) {
					dropped = append(dropped, jobKey{tenant, st.JobID})
				}
			}
			for _, state := range append([]contracts.JobState{contracts.StateNew}, jobStates...) {
				for _, after := range []string{"", h.jobs[tenant][0], h.jobs[tenant][len(h.jobs[tenant])/3]} {
					q := jobQuery{State: state, After: after}
					wl, err := all.Jobs(ctx, tenant, q)
					if err != nil {
						t.Fatal(err)
					}
					wl = slices.DeleteFunc(wl, func(st contracts.JobStatus) bool { return !listed(st) })
					if w, g := asJSON(wl, nil), asJSON(m.Jobs(ctx, tenant, q)); w != g {
						t.Fatalf("jobs %s %+v:\nwant %s\ngot  %s", tenant, q, w, g)
					}
					// Paged, 7 at a time, each page's cursor its last job.
					paged := []contracts.JobStatus{}
					for q.Limit = 7; ; q.After = paged[len(paged)-1].JobID {
						page, err := m.Jobs(ctx, tenant, q)
						if err != nil {
							t.Fatalf("jobs %s %+v: %v", tenant, q, err)
						}
						paged = append(paged, page...)
						if len(page) < q.Limit {
							break
						}
					}
					if w, g := asJSON(wl, nil), asJSON(paged, nil); w != g {
						t.Fatalf("jobs %s state %s after %q, in pages of 7:\nwant %s\ngot  %s", tenant, state, after, w, g)
					}
				}
			}
		}
		return dropped
	}
	dropped := check()
	_, retired := m.counts()
	if len(dropped) < 20 || retired < 20 {
		t.Fatalf("%d jobs dropped, %d retired records kept: the test reaches too little of the window", len(dropped), retired)
	}
	t.Logf("%d ended jobs dropped from the lists, %d retired records kept", len(dropped), retired)
	if n := m.retiredKeys.len(); n != retired {
		t.Fatalf("%d retired keys for %d records: the dropped jobs' keys stay", n, retired)
	}
	// A request reusing a dropped job's ID is rejected by the scheduler
	// on the job's subject: the job stays as it was, and no new one is
	// listed.
	for _, k := range dropped[:3] {
		h.publish(contracts.JobEvent{Type: contracts.EventRejected, Tenant: k.tenant, JobID: k.job, Time: h.clock,
			State: contracts.StateRejected, Reason: contracts.ReasonDuplicateJobID})
	}
	h.caughtUp(in)
	h.caughtUp(allIn)
	if again := check(); len(again) != len(dropped) {
		t.Fatalf("%d jobs dropped after the duplicates' rejections, %d before", len(again), len(dropped))
	}
}

// TestListWindowBoundsRecords: however long the history, the read model
// holds the records of the jobs created in one window (and a step),
// their keys and their IDs' bytes, not one per job ever run.
func TestListWindowBoundsRecords(t *testing.T) {
	const (
		window = time.Hour
		every  = 10 * time.Second // a job created, then ended, every 10 s
		jobs   = 20 * int(window/every)
	)
	m := newRetainingModel(RetentionConfig{RetainEnded: time.Minute, RetainEndedMax: 10, CachedJobs: 4, ListRetention: window},
		func() time.Time { return t0.Add(100 * 24 * time.Hour) },
		func(context.Context, string, string) (contracts.JobStatus, error) {
			return contracts.JobStatus{}, errors.New("not read in this test")
		}, nil)
	ctx := context.Background()
	most, mostIDs := 0, 0
	for i := range jobs {
		at := t0.Add(time.Duration(i) * every)
		tenant := []string{"acme", "globex", "initech"}[i%3]
		id := fmt.Sprintf("job-%06d", i)
		q := queued(tenant, id, at)
		for _, ev := range []contracts.JobEvent{q,
			{Type: contracts.EventScheduled, State: contracts.StateScheduled, Placement: &contracts.Placement{AllocationID: "a", NodeID: "n", Pool: "p"}},
			{Type: contracts.EventRunning, State: contracts.StateRunning},
			{Type: contracts.EventSucceeded, State: contracts.StateSucceeded}} {
			ev.SchemaVersion, ev.Tenant, ev.JobID, ev.Time, ev.Attempt = contracts.SchemaVersion, tenant, id, at, 1
			if err := m.ApplyJobEvent(ctx, tenant, id, ev, 0); err != nil {
				t.Fatalf("job %d %s: %v", i, ev.Type, err)
			}
		}
		_, retired := m.counts()
		ids := 0
		m.mu.RLock()
		for _, rs := range m.retired {
			ids += len(rs.ids)
		}
		keys := m.retiredKeys.len()
		m.mu.RUnlock()
		if keys < retired || keys-retired > dropBatch(keys) {
			t.Fatalf("after job %d: %d keys for %d records: want those of the records, and at most a batch more", i, keys, retired)
		}
		most, mostIDs = max(most, retired), max(mostIDs, ids)
	}
	// One window's and a step's, and up to an eighth more (dropBatch).
	perWindow := int((window + pruneEvery) / every)
	if most > perWindow*8/7+2 || most < perWindow/2 {
		t.Fatalf("at most %d records over %d jobs: want about one window's, %d", most, jobs, perWindow)
	}
	if bound := (perWindow*8/7 + 2) * (1 + len("job-000000")); mostIDs > bound {
		t.Fatalf("the records' IDs took %d bytes at most: want one window's, %d", mostIDs, bound)
	}
	t.Logf("%d jobs over 20 windows: at most %d records, %d bytes of IDs", jobs, most, mostIDs)
}
