package gateway

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
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
	// No list window: a job the model does not hold is unknown without
	// asking this test's log, which answers for any ID.
	m := newRetainingModel(RetentionConfig{RetainEnded: time.Nanosecond, RetainEndedMax: 1, CachedJobs: 1, ListRetention: -1},
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
	r := newRetainingModel(RetentionConfig{RetainEnded: time.Nanosecond, RetainEndedMax: 1, CachedJobs: 1, ListRetention: -1},
		func() time.Time { return t0.Add(time.Hour) }, fetch, nil)
	r.install(m.snapshot(seq))
	if len(r.retiredKeys.recent) != 0 {
		t.Fatalf("%d recent keys after a snapshot's install, want 0", len(r.retiredKeys.recent))
	}
	// The events above retired the last job too.
	check(t, r, n)
}

// TestRetiredSetPacksEveryRecord: a set gives back each record as it was
// added (created-at to the nanosecond, negative seconds, every ended
// state, IDs of 1 to 255 bytes), in store order once sorted, holds one
// 16-byte record and the ID's bytes plus one per job, and refuses what
// it cannot pack (an empty ID or one over 255 bytes, a state or
// nanoseconds out of range) without changing.
func TestRetiredSetPacksEveryRecord(t *testing.T) {
	long := strings.Repeat("x", 255)
	recs := []retiredJob{
		{sec: t0.Unix(), nsec: 999_999_999, id: "a", state: 3, endMin: 1},
		{sec: t0.Unix(), nsec: 0, id: long, state: 0, endMin: maxEndMin},
		{sec: -62135596800, nsec: 1, id: "zero-time", state: 1},                // out of order: sorts first
		{sec: t0.Unix(), nsec: 999_999_999, id: "b", state: 2, endMin: 14_400}, // same instant: b sorts before a
		{sec: t0.Unix() + 1, nsec: 5, id: "c-" + strings.Repeat("9", 126), state: 1, endMin: 7},
		{sec: maxSec, id: "last", state: 0, endMin: maxEndMin},
		{sec: minSec, id: "first", state: 0, endMin: 3},
	}
	rs := &retiredSet{sorted: true}
	bytes := 0
	for _, r := range recs {
		if !rs.add(r) {
			t.Fatalf("add(%+v) refused", r)
		}
		bytes += 1 + len(r.id)
	}
	for _, bad := range []retiredJob{{sec: 1, id: ""}, {sec: 1, id: long + "x"}, {sec: 1, id: "s", state: 4}, {sec: 1, id: "n", nsec: 1e9},
		{sec: 1, id: "m", nsec: -1}, {sec: maxSec + 1, id: "late"}, {sec: minSec - 1, id: "early"}, {sec: 1, id: "e", endMin: maxEndMin + 1}} {
		if rs.add(bad) {
			t.Fatalf("add(%+v) accepted", bad)
		}
	}
	if rs.len() != len(recs) || len(rs.ids) != bytes || rs.sorted {
		t.Fatalf("%d records, %d id bytes, sorted %v; want %d, %d, false", rs.len(), len(rs.ids), rs.sorted, len(recs), bytes)
	}
	if got, want := rs.records(), slices.SortedFunc(slices.Values(recs), storeOrder); !slices.Equal(got, want) {
		t.Fatalf("records %+v\nwant %+v", got, want)
	}
	rs.sort()
	want := slices.SortedFunc(slices.Values(recs), storeOrder)
	for i := range want {
		if got := rs.at(i); got != want[i] {
			t.Fatalf("record %d after sort: %+v, want %+v", i, got, want[i])
		}
	}
	if want[0].id != "first" || want[1].id != "zero-time" || want[3].id != "b" || want[4].id != "a" {
		t.Fatalf("store order %v", want)
	}
	if got := [4]int{3, 2, 1, 1}; rs.states != got {
		t.Fatalf("states %v, want %v", rs.states, got)
	}
}
