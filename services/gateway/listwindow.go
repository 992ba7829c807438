package gateway

import (
	"context"
	"slices"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// The list window (issue 17: nothing grows with history). A retired job
// costs the read model ~69 bytes (its record, its ID and its key): per
// job ever run, for ever, so a gateway in front of a million jobs a day
// would hold 25 GB more each year. What needs the records is the job
// list alone: a job's own status is folded from its subject of
// JOB_EVENTS whenever asked for (retiredJob). So an ended job leaves the
// lists once it was created more than ListRetention ago (a week by
// default), as Kubernetes drops finished Jobs after their TTL and
// squeue shows no old jobs; its status still answers by ID, for ever,
// read from the log of record. Memory is then the rate of jobs times the
// window, whatever the history.
//
// The window's clock is the earlier of the gateway's clock and the
// newest job event's time: a replay of old events (a restart, tests)
// drops nothing a live gateway at that point of the stream would keep,
// and one event dated far ahead by a skewed clock drops nothing early.
//
// Two rules keep the answers right once a record is gone:
//   - Job asks the log for an ID the model does not know (droppedJob):
//     the model cannot tell an ID never used from one dropped, in this
//     life or before a restart from a snapshot. One direct get, for a
//     read that would otherwise answer 404.
//   - An ID's duplicate_job_id rejection never makes a job: the ID is
//     another job's (every reader's Transition ignores it when the job
//     is known; a dropped one is not).

// pruneEvery is how far the window's start moves before it is applied
// again: a record outstays it by a minute at most, or by dropBatch.
const pruneEvery = time.Minute

// dropBatch: a tenant's records are dropped once those past the window
// are an eighth of its set (or it has no other), so that the copy of
// what stays costs each record O(1) over its life, however often the
// window moves (a replay moves it at every event).
func dropBatch(n int) int { return max(1, n/8) }

// pruneListed drops the retired records of jobs created before the
// window (m.mu held), whenever the window's start has moved by
// m.pruneStep since it last did.
func (m *memoryModel) pruneListed() {
	if m.ret.ListRetention <= 0 || m.newest.IsZero() {
		return
	}
	clock := m.now()
	if m.newest.Before(clock) {
		clock = m.newest
	}
	horizon := clock.Add(-m.ret.ListRetention)
	if !m.pruned.IsZero() && horizon.Sub(m.pruned) < m.pruneStep {
		return
	}
	m.pruned = horizon
	batched := m.pruneStep > 0
	for tenant, rs := range m.retired {
		for _, id := range rs.dropBefore(horizon, batched) {
			m.gone = append(m.gone, retiredKey(tenant, id))
		}
		if rs.len() == 0 {
			delete(m.retired, tenant)
		}
	}
	// The keys go in batches too, an eighth of the set at a time: one
	// left a while answers as the record would have (Job reads the log,
	// an event for the ended job is refused).
	if len(m.gone) > 0 && (!batched || len(m.gone) >= dropBatch(m.retiredKeys.len())) {
		m.retiredKeys.remove(m.gone)
		m.gone = nil
	}
}

// droppedJob folds a job the model does not hold from the log, for one
// the list window dropped: an ID the log has no event of is unknown
// (errUnknownJob, the fetcher's error as it is).
func (m *memoryModel) droppedJob(ctx context.Context, tenant, job string) (contracts.JobStatus, error) {
	key := cacheKey(tenant, job)
	if st, ok := m.cache.get(key); ok {
		return *st, nil
	}
	st, err := m.fetch(ctx, tenant, job)
	if err != nil {
		return contracts.JobStatus{}, err
	}
	if endedIndex(st.State) >= 0 {
		m.cache.put(key, &st) // an ended job's status changes no more
	}
	return st, nil
}

// dropBefore removes the records of jobs created before horizon (once
// they are a batch, dropBatch, if batched) and returns their IDs. The remaining records are copied into new arrays:
// the strings at() made over the old ones stay valid.
func (rs *retiredSet) dropBefore(horizon time.Time, batched bool) []string {
	if !rs.sorted {
		rs.sort()
	}
	sec, nsec := horizon.Unix(), int32(horizon.Nanosecond())
	n, _ := slices.BinarySearchFunc(rs.recs, struct{}{}, func(r retiredRec, _ struct{}) int {
		if r.sec < sec || r.sec == sec && int32(r.ns>>2) < nsec {
			return -1
		}
		return 1
	})
	if n == 0 || batched && n < dropBatch(len(rs.recs)) && n < len(rs.recs) {
		return nil
	}
	gone := make([]string, n)
	for i, r := range rs.recs[:n] {
		j := rs.unpack(r)
		gone[i] = j.id
		rs.states[j.state]--
	}
	keep := rs.recs[n:]
	size := 0
	for _, r := range keep {
		size += 1 + int(rs.ids[r.off])
	}
	recs, ids := make([]retiredRec, 0, len(keep)), make([]byte, 0, size)
	for _, r := range keep {
		l := 1 + uint32(rs.ids[r.off])
		off := uint32(len(ids))
		ids = append(ids, rs.ids[r.off:r.off+l]...)
		r.off = off
		recs = append(recs, r)
	}
	rs.recs, rs.ids = recs, ids
	return gone
}

// remove drops every key of keys (those it does not hold are ignored).
func (d *usageDigests) remove(keys []usageDigest) {
	slices.SortFunc(keys, cmpDigest)
	all := d.merged()
	out := make([]usageDigest, 0, max(0, len(all)-len(keys)))
	j := 0
	for _, k := range all {
		for j < len(keys) && cmpDigest(keys[j], k) < 0 {
			j++
		}
		if j < len(keys) && keys[j] == k {
			continue
		}
		out = append(out, k)
	}
	d.sorted, d.recent = out, nil
}
