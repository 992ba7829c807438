package gateway

import (
	"context"
	"errors"
	"fmt"
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
// lists once it ended more than ListRetention ago (a week by default),
// as Kubernetes drops a finished Job a TTL after it finished: a training
// run of ten days that failed last night is listed this morning. Its
// status still answers by ID, for ever, read from the log of record.
// Memory is then the rate of jobs times the window, whatever the
// history.
//
// The window's clock is the earlier of the gateway's clock and the
// newest job event's time: a replay of old events (a restart, tests)
// drops nothing a live gateway at that point of the stream would keep,
// and one event dated far ahead by a skewed clock drops nothing early.
//
// Two rules keep the answers right once a record is gone:
//   - Job asks the log for an ID the model does not know (jobFromLog):
//     the model cannot tell an ID never used from one dropped, in this
//     life or before a restart from a snapshot. One direct get, for a
//     read that would otherwise answer 404.
//   - An ID's duplicate_job_id rejection never makes a job: the ID is
//     another job's (every reader's Transition ignores it when the job
//     is known; a dropped one is not).

// pruneEvery is how often the window is applied: an eighth of it, and a
// minute at least. A record outstays the window by that much at most (up
// to an eighth more records than the window's), and each application, a
// pass over every record, costs each record O(1) over its life, however
// fast the window moves (a replay moves it at every event). The minute:
// ends are kept to the minute, so a window of seconds keeps a minute's
// records anyway, and a pass a second would cost each of them sixty.
func pruneEvery(window time.Duration) time.Duration { return max(window/8, time.Minute) }

// pruneListed drops the retired records of jobs that ended before the
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
	m.prunes++
	var gone []retiredID
	for tenant, rs := range m.retired {
		for _, id := range rs.dropEndedBefore(horizon) {
			gone = append(gone, retiredKey(tenant, id))
		}
		if rs.len() == 0 {
			delete(m.retired, tenant)
		}
	}
	if len(gone) > 0 {
		m.retiredKeys.remove(gone)
	}
}

// dropEndedBefore removes the records of jobs that ended before horizon
// and returns their IDs. What stays is copied, in its order, into new
// arrays: the strings at() made over the old ones stay valid.
func (rs *retiredSet) dropEndedBefore(horizon time.Time) []string {
	var gone []string
	size := 0
	for _, r := range rs.recs {
		if j := rs.unpack(r); j.endedBy().Before(horizon) {
			gone = append(gone, j.id)
		} else {
			size += 1 + len(j.id)
		}
	}
	if len(gone) == 0 {
		return nil
	}
	recs, ids := make([]retiredRec, 0, len(rs.recs)-len(gone)), make([]byte, 0, size)
	for _, r := range rs.recs {
		j := rs.unpack(r)
		if j.endedBy().Before(horizon) {
			rs.states[j.state]--
			continue
		}
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

// errLogUnavailable: a job the model does not hold could not be asked
// of the log (the API answers 503: retry; it was a 404 before the list
// window, when the model held every job).
var errLogUnavailable = errors.New("the bus did not answer for a job the read model does not hold")

// jobFromLog folds a job the model does not hold whole from the log: a
// retired one, or one the list window dropped. An ID the log has no
// event of is unknown (errUnknownJob, the fetcher's error as it is), one
// the log could not be asked about is errLogUnavailable. An ended job's
// status, which changes no more, is cached.
func (m *memoryModel) jobFromLog(ctx context.Context, tenant, job string) (contracts.JobStatus, error) {
	key := cacheKey(tenant, job)
	if st, ok := m.cache.get(key); ok {
		return *st, nil
	}
	st, err := m.fetch(ctx, tenant, job)
	if errors.Is(err, errUnknownJob) {
		return contracts.JobStatus{}, err
	}
	if err != nil {
		return contracts.JobStatus{}, fmt.Errorf("job %s/%s: %w: %w", tenant, job, errLogUnavailable, err)
	}
	if endedIndex(st.State) >= 0 {
		m.cache.put(key, &st)
	}
	return st, nil
}
