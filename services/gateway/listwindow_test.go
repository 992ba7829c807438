package gateway

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestListWindowDropsOldEndedJobs: a read model with a list window
// answers every job by ID as one that keeps every job whole, those the
// window dropped folded from JOB_EVENTS; its lists are the full model's
// less the ended jobs that ended before the window's start when it was
// last applied (and no others), cursors on dropped jobs included; and a
// duplicate_job_id rejection of a dropped job's ID makes no job. The
// window is applied at every event, then every eighth of it (records
// past it left a while, their keys with them).
func TestListWindowDropsOldEndedJobs(t *testing.T) {
	for _, every := range []string{"event", "eighth"} {
		t.Run(every, func(t *testing.T) { testListWindow(t, every == "event") })
	}
}

func testListWindow(t *testing.T, atEveryEvent bool) {
	h := newRetireHarness(t, 5)
	for range 5 { // jobs created all along the clock, most of them ended, some long after
		h.workload(50)
	}
	window := h.clock.Sub(t0) / 2
	all := newMemoryModel()
	allIn := h.ingest(all, nil)
	wall := h.clock // the gateway's clock: the newest event's time
	m := newRetainingModel(RetentionConfig{RetainEnded: time.Minute, RetainEndedMax: 1, CachedJobs: 4, ListRetention: window},
		func() time.Time { return wall }, streamFetcher(h.gw),
		func(ctx context.Context, tenant string, want map[string]*contracts.JobStatus) error {
			return tenantFetch(ctx, h.gw, tenant, want)
		})
	if atEveryEvent {
		m.pruneStep = 0
	}
	in := h.ingest(m, nil)

	ctx := context.Background()
	asJSON := func(v any, err error) string { return answerJSON(t, v, err) }
	// listed reports whether m should list st: open, whole, or ended
	// since the window's start when it was last applied.
	listed := func(st contracts.JobStatus) bool {
		m.mu.RLock()
		whole, start := m.jobs[st.Tenant][st.JobID] != nil, m.pruned
		m.mu.RUnlock()
		r := retiredJob{sec: st.CreatedAt.Unix(), nsec: int32(st.CreatedAt.Nanosecond()), endMin: endMinutes(st.CreatedAt, st.UpdatedAt)}
		return endedIndex(st.State) < 0 || whole || !r.endedBy().Before(start)
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
	// The window starts a window before the clock (the newest event's
	// time and the gateway's alike here), as last applied: exactly, or
	// up to a step before.
	start := func() time.Time {
		m.mu.RLock()
		defer m.mu.RUnlock()
		return m.pruned
	}
	want := wall.Add(-window)
	if s := start(); s.After(want) || !s.After(want.Add(-m.pruneStep-time.Nanosecond)) {
		t.Fatalf("the window starts at %s, want %s (or up to %s before)", s, want, m.pruneStep)
	}
	dropped := check()
	// Each set's counts by state are its records'.
	m.mu.RLock()
	for tenant, rs := range m.retired {
		var states [4]int
		for i := range rs.len() {
			states[rs.at(i).state]++
		}
		if states != rs.states {
			t.Fatalf("tenant %s: states %v, its records' %v", tenant, rs.states, states)
		}
	}
	m.mu.RUnlock()
	_, retired := m.counts()
	if len(dropped) < 20 || retired < 20 {
		t.Fatalf("%d jobs dropped, %d retired records kept: the test reaches too little of the window", len(dropped), retired)
	}
	t.Logf("%d ended jobs dropped from the lists, %d retired records kept", len(dropped), retired)
	if n := m.retiredKeys.len(); n != retired {
		t.Fatalf("%d retired keys for %d records: the dropped jobs' keys stay", n, retired)
	}
	// Some of the dropped jobs were created long before they ended: the
	// window counts from the end.
	late := 0
	for _, k := range dropped {
		st, err := all.Job(ctx, k.tenant, k.job)
		if err != nil {
			t.Fatal(err)
		}
		if st.UpdatedAt.Sub(st.CreatedAt) > window/8 {
			late++
		}
	}
	kept := 0
	for _, tenant := range h.tenants {
		full, _ := all.Jobs(ctx, tenant, jobQuery{})
		for _, st := range full {
			if endedIndex(st.State) >= 0 && listed(st) && st.CreatedAt.Before(m.pruned) {
				kept++ // created before the window, ended in it: listed
			}
		}
	}
	if kept == 0 {
		t.Fatalf("no job created before the window and ended in it: the test does not tell end from creation (%d late drops)", late)
	}
	// A request reusing a dropped job's ID is rejected by the scheduler
	// on the job's subject: the job stays as it was, and no new one is
	// listed.
	for _, k := range dropped[:3] {
		h.publish(contracts.JobEvent{Type: contracts.EventRejected, Tenant: k.tenant, JobID: k.job, Time: h.clock,
			State: contracts.StateRejected, Reason: contracts.ReasonDuplicateJobID})
	}
	// And an event dated a month ahead (a skewed clock's) moves the
	// window no further than the gateway's clock.
	h.publish(contracts.JobEvent{Type: contracts.EventRejected, Tenant: h.tenants[0], JobID: "from-the-future",
		Time: wall.Add(30 * 24 * time.Hour), State: contracts.StateRejected, Reason: contracts.ReasonInvalidValue,
		Errors: []contracts.FieldError{{Field: "run", Reason: contracts.ReasonInvalidValue, Message: "no"}}})
	h.jobs[h.tenants[0]] = append(h.jobs[h.tenants[0]], "from-the-future")
	h.caughtUp(in)
	h.caughtUp(allIn)
	if s := start(); s.After(want) {
		t.Fatalf("an event dated ahead moved the window's start to %s, past %s", s, want)
	}
	if again := check(); len(again) != len(dropped) {
		t.Fatalf("%d jobs dropped after the duplicates' rejections, %d before", len(again), len(dropped))
	}
	// A snapshot carries each record's end: decoded, the records are
	// the same, ends included.
	snap := m.snapshot(in.folded.Load())
	data, err := snap.encode()
	if err != nil {
		t.Fatal(err)
	}
	decoded, err := decodeModelSnap(data)
	if err != nil {
		t.Fatal(err)
	}
	ends := 0
	for tenant, recs := range snap.retired {
		if !slices.Equal(decoded.retired[tenant], recs) {
			t.Fatalf("tenant %s's records after a snapshot:\n%+v\nwant\n%+v", tenant, decoded.retired[tenant], recs)
		}
		for _, r := range recs {
			if r.endMin > 0 {
				ends++
			}
		}
	}
	if ends == 0 {
		t.Fatal("no record ended after its creation minute: the snapshot's ends are not tested")
	}
}

// TestListWindowBoundsRecords: however long the history, the read model
// holds the records of the jobs that ended in one window (and an
// eighth), their keys and their IDs' bytes, not one per job ever run;
// and it applies the window an eighth of it at a time, not at every
// event.
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
		if keys != retired {
			t.Fatalf("after job %d: %d keys for %d records", i, keys, retired)
		}
		most, mostIDs = max(most, retired), max(mostIDs, ids)
	}
	// One window's and an eighth's (pruneEvery), and a minute (endedBy
	// rounds up).
	perWindow := int((window + pruneEvery(window) + time.Minute) / every)
	if most > perWindow+1 || most < perWindow/2 {
		t.Fatalf("at most %d records over %d jobs: want about one window's, %d", most, jobs, perWindow)
	}
	if bound := (perWindow + 1) * (1 + len("job-000000")); mostIDs > bound {
		t.Fatalf("the records' IDs took %d bytes at most: want one window's, %d", mostIDs, bound)
	}
	if passes := 20*8 + 2; m.prunes > passes {
		t.Fatalf("%d passes over the records for 20 windows: want one an eighth of a window, %d", m.prunes, passes)
	}
	t.Logf("%d jobs over 20 windows: at most %d records, %d bytes of IDs", jobs, most, mostIDs)
}

// TestUnknownJobAsksTheLog: with a list window, a job the model does not
// hold is asked of the log: found, it answers (an ended one cached);
// unknown there, it is unknown (404); a log that does not answer is
// errLogUnavailable (503: retry), never unknown.
func TestUnknownJobAsksTheLog(t *testing.T) {
	ctx := context.Background()
	asked := 0
	var answer func(tenant, job string) (contracts.JobStatus, error)
	m := newRetainingModel(RetentionConfig{ListRetention: time.Hour}, func() time.Time { return t0 },
		func(_ context.Context, tenant, job string) (contracts.JobStatus, error) {
			asked++
			return answer(tenant, job)
		}, nil)
	answer = func(tenant, job string) (contracts.JobStatus, error) {
		return contracts.JobStatus{Tenant: tenant, JobID: job, State: contracts.StateSucceeded}, nil
	}
	for range 2 {
		if st, err := m.Job(ctx, "acme", "old"); err != nil || st.State != contracts.StateSucceeded {
			t.Fatalf("a dropped job: %+v, %v", st, err)
		}
	}
	if asked != 1 {
		t.Fatalf("the log was asked %d times for one ended job, want once (then cached)", asked)
	}
	answer = func(tenant, job string) (contracts.JobStatus, error) {
		return contracts.JobStatus{}, fmt.Errorf("job %s/%s: %w", tenant, job, errUnknownJob)
	}
	if _, err := m.Job(ctx, "acme", "never"); !errors.Is(err, errUnknownJob) || errors.Is(err, errLogUnavailable) {
		t.Fatalf("an ID the log has no event of: %v, want errUnknownJob", err)
	}
	answer = func(string, string) (contracts.JobStatus, error) {
		return contracts.JobStatus{}, errors.New("nats: timeout")
	}
	_, err := m.Job(ctx, "acme", "maybe")
	if !errors.Is(err, errLogUnavailable) || errors.Is(err, errUnknownJob) {
		t.Fatalf("a log that does not answer: %v, want errLogUnavailable", err)
	}
	if _, err := m.Jobs(ctx, "acme", jobQuery{After: "maybe"}); !errors.Is(err, errLogUnavailable) {
		t.Fatalf("a list after a job the log does not answer for: %v, want errLogUnavailable", err)
	}
}

// BenchmarkListWindowReplay folds GPUPLANE_WINDOW_JOBS jobs (80,000 by
// default), one created every 30 s and each ended 0-2 h later, so that
// jobs end out of their creation order (the order the retired sets keep),
// as a replay feeds them: without a window and with the default one
// (7 days, the history ~28 days). The window's passes must cost the
// replay little: ns/event of both, and the records kept.
func BenchmarkListWindowReplay(b *testing.B) {
	n := envInt(b, "GPUPLANE_WINDOW_JOBS", 80_000)
	type timed struct {
		ev  contracts.JobEvent
		key jobKey
	}
	rng := rand.New(rand.NewPCG(3, 4))
	var evs []timed
	for i := range n {
		at := t0.Add(time.Duration(i) * 30 * time.Second)
		tenant, id := []string{"acme", "globex", "initech"}[i%3], fmt.Sprintf("job-%07d", i)
		q := queued(tenant, id, at)
		end := at.Add(time.Duration(rng.Int64N(int64(2 * time.Hour))))
		evs = append(evs, timed{q, jobKey{tenant, id}},
			timed{contracts.JobEvent{Type: contracts.EventScheduled, State: contracts.StateScheduled, Time: at,
				Placement: &contracts.Placement{AllocationID: "a", NodeID: "n", Pool: "p"}}, jobKey{tenant, id}},
			timed{contracts.JobEvent{Type: contracts.EventRunning, State: contracts.StateRunning, Time: at}, jobKey{tenant, id}},
			timed{contracts.JobEvent{Type: contracts.EventSucceeded, State: contracts.StateSucceeded, Time: end}, jobKey{tenant, id}})
	}
	slices.SortStableFunc(evs, func(a, b timed) int { return a.ev.Time.Compare(b.ev.Time) })
	for _, window := range []time.Duration{-1, DefaultListRetention} {
		name := "window=off"
		if window > 0 {
			name = "window=" + window.String()
		}
		b.Run(name, func(b *testing.B) {
			var kept int
			for range b.N {
				m := newRetainingModel(RetentionConfig{ListRetention: window}, func() time.Time { return t0.Add(365 * 24 * time.Hour) },
					func(context.Context, string, string) (contracts.JobStatus, error) {
						return contracts.JobStatus{}, errors.New("not read in this benchmark")
					}, nil)
				ctx := context.Background()
				for i, e := range evs {
					ev := e.ev
					ev.SchemaVersion, ev.Tenant, ev.JobID, ev.Attempt = contracts.SchemaVersion, e.key.tenant, e.key.job, 1
					if err := m.ApplyJobEvent(ctx, e.key.tenant, e.key.job, ev, uint64(i+1)); err != nil {
						b.Fatal(err)
					}
				}
				_, kept = m.counts()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(evs)), "ns/event")
			b.ReportMetric(float64(kept), "records")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// TestJobReadsTheLogOr503: the API answers a job the log could not be
// asked about with 503 (retry), not 500.
func TestJobReadsTheLogOr503(t *testing.T) {
	rec := httptest.NewRecorder()
	(&server{}).jobFound(rec, "acme", "x", fmt.Errorf("job acme/x: %w: %w", errLogUnavailable, errors.New("nats: timeout")))
	if rec.Code != http.StatusServiceUnavailable || !strings.Contains(rec.Body.String(), string(contracts.ReasonUnavailable)) {
		t.Fatalf("%d %s, want 503 unavailable", rec.Code, rec.Body)
	}
}

// TestSnapshotRefusesUnpackableRecords: a snapshot whose retired record
// would not pack (an end or a second out of range) is refused whole, as
// any damage is: the gateway then reads the log.
func TestSnapshotRefusesUnpackableRecords(t *testing.T) {
	for _, r := range []retiredJob{{sec: 1, id: "a", endMin: maxEndMin + 1}, {sec: maxSec + 1, id: "a"}, {sec: minSec - 1, id: "a"}} {
		s := &modelSnap{retired: map[string][]retiredJob{"acme": {r}}, usage: map[string]*tenantUsage{}}
		data, err := s.encode()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := decodeModelSnap(data); !errors.Is(err, errBadSnapshot) {
			t.Fatalf("record %+v: decode = %v, want errBadSnapshot", r, err)
		}
	}
}
