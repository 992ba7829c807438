package gateway

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// errUnknownJob is returned (wrapped) by readModel.Job for a job the read
// model has no event of.
var errUnknownJob = errors.New("unknown job")

// jobQuery selects a page of a tenant's jobs.
type jobQuery struct {
	// State keeps only jobs in this state; StateNew keeps all.
	State contracts.JobState
	// Limit is the most jobs returned; the newest (by CreatedAt) first.
	Limit int
	// After is the last job of the previous page: only jobs after it in
	// the list's order are returned. It is a job ID, not an offset, so a
	// job submitted between two pages shifts nothing: it is newer, and
	// sorts before the cursor.
	After string
}

// readModel is the gateway's view of jobs and usage, folded from JOB_EVENTS
// and USAGE by one ingester and read by the HTTP handlers. Implementations
// are safe for concurrent use and their Apply methods are idempotent, so a
// replay of a stream from its start (every restart of the in-memory model)
// or a redelivery is harmless. The in-memory implementation is the only one
// today; a shared one (Redis) is the next, and both must pass the tests of
// readmodel_test.go.
type readModel interface {
	// ApplyJobEvent folds ev, read at JOB_EVENTS sequence seq, into the
	// status of (tenant, job) with contracts.JobStatus.Apply. An event
	// already applied or refused by the state machine leaves the status
	// unchanged and comes back as an error wrapping
	// contracts.ErrStaleEvent or contracts.ErrTransition.
	ApplyJobEvent(ctx context.Context, tenant, job string, ev contracts.JobEvent, seq uint64) error
	// ApplyUsage adds rec, which USAGE stored at at, to its tenant's
	// summary once per record ID (a model folding usage knows an ID for
	// UsageConfig.DuplicateWindow after at); it reports whether the
	// record was new.
	ApplyUsage(ctx context.Context, tenant string, rec contracts.UsageRecord, at time.Time) (bool, error)
	// Job returns one job's status, or an error wrapping errUnknownJob.
	Job(ctx context.Context, tenant, job string) (contracts.JobStatus, error)
	// Jobs returns a tenant's jobs matching q, newest first (ties by ID).
	Jobs(ctx context.Context, tenant string, q jobQuery) ([]contracts.JobStatus, error)
	// Usage returns a tenant's usage summary (zero for an unknown tenant).
	Usage(ctx context.Context, tenant string) (contracts.UsageSummary, error)
	// UsageSeries returns a tenant's usage over time (usage_series.go).
	UsageSeries(ctx context.Context, tenant string, q seriesQuery) (contracts.UsageSeries, error)
	// Invoice bills a tenant for a period (contracts.BuildInvoice over
	// its records).
	Invoice(ctx context.Context, tenant, period string) (contracts.Invoice, error)
}

var _ readModel = (*memoryModel)(nil)

// memoryModel is the in-memory readModel: rebuilt at every start from the
// streams (or from a snapshot and the streams after it,
// readmodel_snapshot.go), lost at exit. With a retention (retire.go) it
// keeps ended jobs whole only for a while, then as retired records.
type memoryModel struct {
	mu   sync.RWMutex
	jobs map[string]map[string]*contracts.JobStatus // tenant -> job ID -> status
	// usage keeps each record as its JSON, decoded when a summary is
	// asked for, unless the model folds usage into buckets (usageAgg,
	// set by aggregateUsage: the gateway's), reading the records
	// themselves from USAGE with usageRecs (usage_agg.go).
	usage     map[string]map[string][]byte // tenant -> record ID -> record
	usageAgg  *usageAgg
	usageRecs usageReader
	// usageSeq is the last USAGE sequence folded (the ingester's), the
	// end of what usageRecs reads.
	usageSeq atomic.Uint64

	// ret is zero when every job is kept whole (no fetch).
	ret RetentionConfig
	now func() time.Time
	// ended lists the ended jobs kept whole in the order they ended
	// (from endedHead on): the next to retire first.
	ended     []jobKey
	endedHead int
	// retired holds each tenant's retired jobs; retiredKeys says which
	// jobs are retired (retiredKey).
	retired     map[string]*retiredSet
	retiredKeys usageDigests
	fetch       jobFetcher
	cache       *statusCache
	// tenantFetch folds many retired jobs of a tenant in one read.
	tenantFetch func(ctx context.Context, tenant string, want map[string]*contracts.JobStatus) error
	// fetchOne is the most retired jobs of a list fetched one by one
	// (maxFetchOne; tests lower it).
	fetchOne int
	// The list window (listwindow.go): the newest job event's time, the
	// window's start when it was last applied, and how far it moves
	// before it is applied again (pruneEvery; tests set 0: at every
	// event).
	newest    time.Time
	pruned    time.Time
	pruneStep time.Duration
	prunes    int // passes over the records (tests)
}

func newMemoryModel() *memoryModel {
	return &memoryModel{
		jobs:  map[string]map[string]*contracts.JobStatus{},
		usage: map[string]map[string][]byte{},
	}
}

// newRetainingModel is a memoryModel that retires ended jobs after ret
// and folds them again with fetch (one job) or many (a tenant's) when
// asked for them.
func newRetainingModel(ret RetentionConfig, now func() time.Time, fetch jobFetcher,
	many func(ctx context.Context, tenant string, want map[string]*contracts.JobStatus) error) *memoryModel {
	m := newMemoryModel()
	m.ret, m.now, m.fetch, m.tenantFetch = ret.withDefaults(), now, fetch, many
	m.retired = map[string]*retiredSet{}
	m.cache = newStatusCache(m.ret.CachedJobs)
	m.fetchOne = maxFetchOne
	m.pruneStep = pruneEvery(m.ret.ListRetention)
	return m
}

// retiring reports whether the model retires ended jobs.
func (m *memoryModel) retiring() bool { return m.fetch != nil }

func (m *memoryModel) ApplyJobEvent(_ context.Context, tenant, job string, ev contracts.JobEvent, seq uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.retiring() {
		if ev.Time.After(m.newest) {
			m.newest = ev.Time
		}
		// Jobs that ended a while ago leave before this event, not
		// after: the caller reads the job it just changed (observe).
		m.retireLocked()
	}
	st := m.jobs[tenant][job]
	if st == nil && m.retiring() {
		if m.retiredKeys.has(retiredKey(tenant, job)) {
			// An ended job takes no event: as Apply would refuse it.
			return fmt.Errorf("job %s/%s seq %d: retired: %w", tenant, job, seq, contracts.ErrTransition)
		}
		if ev.AnswersDuplicate() {
			// The ID is another job's, one the list window dropped: a
			// rejection of a request reusing it makes no job.
			return fmt.Errorf("job %s/%s seq %d: duplicate of a dropped job: %w", tenant, job, seq, contracts.ErrTransition)
		}
	}
	next := contracts.JobStatus{}
	if st != nil {
		next = *st
	}
	// Apply on a copy: readers may hold the previous value.
	if err := next.Apply(ev, seq); err != nil {
		return fmt.Errorf("job %s/%s seq %d: %w", tenant, job, seq, err)
	}
	if m.jobs[tenant] == nil {
		m.jobs[tenant] = map[string]*contracts.JobStatus{}
	}
	m.jobs[tenant][job] = &next
	if m.retiring() && endedIndex(next.State) >= 0 {
		m.ended = append(m.ended, jobKey{tenant, job})
	}
	return nil
}

// retireLocked retires the ended jobs past the retention (m.mu held).
func (m *memoryModel) retireLocked() {
	horizon := m.now().Add(-m.ret.RetainEnded)
	for m.endedHead < len(m.ended) {
		k := m.ended[m.endedHead]
		st := m.jobs[k.tenant][k.job]
		if st != nil && len(m.ended)-m.endedHead <= m.ret.RetainEndedMax && !st.UpdatedAt.Before(horizon) {
			break
		}
		m.ended[m.endedHead] = jobKey{}
		m.endedHead++
		if st != nil {
			m.retireJob(k, st)
		}
	}
	// The list's head is dropped once it is half the list.
	if m.endedHead > 1024 && m.endedHead*2 > len(m.ended) {
		m.ended = append(m.ended[:0:0], m.ended[m.endedHead:]...)
		m.endedHead = 0
	}
	m.pruneListed()
}

// retireJob replaces the ended job k's status with its record (a job its
// set cannot take stays whole).
func (m *memoryModel) retireJob(k jobKey, st *contracts.JobStatus) {
	rs := m.retired[k.tenant]
	if rs == nil {
		rs = &retiredSet{sorted: true}
		m.retired[k.tenant] = rs
	}
	// An ended status was last updated by the event that ended it.
	if !rs.add(retiredJob{sec: st.CreatedAt.Unix(), nsec: int32(st.CreatedAt.Nanosecond()), id: k.job, state: uint8(endedIndex(st.State)),
		endMin: endMinutes(st.CreatedAt, st.UpdatedAt)}) {
		return
	}
	delete(m.jobs[k.tenant], k.job)
	if len(m.jobs[k.tenant]) == 0 {
		delete(m.jobs, k.tenant)
	}
	m.retiredKeys.add(retiredKey(k.tenant, k.job))
	m.cache.put(cacheKey(k.tenant, k.job), st)
}

// aggregateUsage makes the model fold usage into buckets instead of
// keeping the records, and read them from USAGE with read when a summary
// is asked for. Call it before anything is applied.
func (m *memoryModel) aggregateUsage(cfg UsageConfig, read usageReader) {
	m.usageAgg, m.usageRecs = newUsageAgg(cfg), read
}

func (m *memoryModel) ApplyUsage(_ context.Context, tenant string, rec contracts.UsageRecord, at time.Time) (bool, error) {
	if rec.ID == "" {
		return false, errors.New("usage record without an id")
	}
	if m.usageAgg != nil {
		m.mu.Lock()
		defer m.mu.Unlock()
		if m.now != nil {
			m.usageAgg.prune(m.now())
		}
		return m.usageAgg.add(tenant, rec, at), nil
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return false, fmt.Errorf("usage record %s: %w", rec.ID, err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.usage[tenant][rec.ID]; ok {
		return false, nil
	}
	if m.usage[tenant] == nil {
		m.usage[tenant] = map[string][]byte{}
	}
	m.usage[tenant][rec.ID] = data
	return true, nil
}

func (m *memoryModel) Job(ctx context.Context, tenant, job string) (contracts.JobStatus, error) {
	m.mu.RLock()
	st, ok := m.jobs[tenant][job]
	// A job the model does not hold whole is read from the log when it
	// was retired, or perhaps dropped by the list window (in this life or
	// an earlier one: any ID then).
	fromLog := !ok && m.retiring() && (m.ret.ListRetention > 0 || m.retiredKeys.has(retiredKey(tenant, job)))
	m.mu.RUnlock()
	switch {
	case ok:
		return *st, nil
	case fromLog:
		return m.jobFromLog(ctx, tenant, job)
	}
	return contracts.JobStatus{}, fmt.Errorf("job %s/%s: %w", tenant, job, errUnknownJob)
}

// maxFetchOne is the most retired jobs of one list folded one by one
// (direct gets); a list with more reads the tenant's events once.
const maxFetchOne = 256

func (m *memoryModel) Jobs(ctx context.Context, tenant string, q jobQuery) ([]contracts.JobStatus, error) {
	var cursor *contracts.JobStatus
	if q.After != "" {
		st, err := m.Job(ctx, tenant, q.After)
		if err != nil {
			return nil, fmt.Errorf("after: %w", err)
		}
		cursor = &st
	}
	m.rlockSorted(tenant)
	out := make([]contracts.JobStatus, 0, len(m.jobs[tenant]))
	for _, st := range m.jobs[tenant] {
		if (q.State == contracts.StateNew || st.State == q.State) && (cursor == nil || listOrder(*cursor, *st) < 0) {
			out = append(out, *st)
		}
	}
	// The retired jobs after the cursor that match, in list order: a
	// page's worth at most (the list takes Limit of both).
	var refs []retiredJob
	if rs := m.retired[tenant]; rs != nil {
		si := endedIndex(q.State)
		if q.State == contracts.StateNew || (si >= 0 && rs.states[si] > 0) {
			end := rs.len()
			if cursor != nil {
				// Records before end come after the cursor in the list.
				end = searchRecs(rs, *cursor)
			}
			for i := end - 1; i >= 0; i-- {
				r := rs.at(i)
				if q.State == contracts.StateNew || int(r.state) == si {
					refs = append(refs, r)
					if q.Limit > 0 && len(refs) == q.Limit {
						break
					}
				}
			}
		}
	}
	m.mu.RUnlock()
	slices.SortFunc(out, listOrder)
	if len(refs) == 0 {
		if q.Limit > 0 && len(out) > q.Limit {
			out = out[:q.Limit]
		}
		return out, nil
	}
	// Merge the two lists, then fold the retired jobs the page kept.
	merged := make([]contracts.JobStatus, 0, len(out)+len(refs))
	var fetch []int // indexes in merged of retired jobs
	i, j := 0, 0
	for (q.Limit <= 0 || len(merged) < q.Limit) && (i < len(out) || j < len(refs)) {
		if j == len(refs) || (i < len(out) && listOrderAt(&refs[j], out[i]) > 0) {
			merged = append(merged, out[i])
			i++
			continue
		}
		fetch = append(fetch, len(merged))
		// A copy: the record's ID shares its set's array.
		merged = append(merged, contracts.JobStatus{Tenant: tenant, JobID: strings.Clone(refs[j].id)})
		j++
	}
	if err := m.fillRetired(ctx, tenant, merged, fetch); err != nil {
		return nil, err
	}
	return merged, nil
}

// searchRecs returns the index of the first record (in store order) that
// is not after cursor in the list order: those before it are.
func searchRecs(rs *retiredSet, cursor contracts.JobStatus) int {
	lo, hi := 0, rs.len()
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if r := rs.at(mid); listOrderAt(&r, cursor) > 0 {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	return lo
}

// sortRetired puts a tenant's retired records in list order if an append
// left them out of it.
func (m *memoryModel) sortRetired(tenant string) {
	if !m.retiring() {
		return
	}
	m.mu.RLock()
	rs := m.retired[tenant]
	sorted := rs == nil || rs.sorted
	m.mu.RUnlock()
	if sorted {
		return
	}
	m.mu.Lock()
	if !rs.sorted {
		rs.sort()
	}
	m.mu.Unlock()
}

// rlockSorted takes the read lock with tenant's retired records in list
// order: a job retired between sortRetired's write lock and this read
// lock appends out of order, and the page's binary searches would then
// answer from an unsorted set.
func (m *memoryModel) rlockSorted(tenant string) {
	for {
		m.sortRetired(tenant)
		m.mu.RLock()
		if rs := m.retired[tenant]; !m.retiring() || rs == nil || rs.sorted {
			return
		}
		m.mu.RUnlock()
	}
}

// fillRetired replaces the jobs at idx in page with their statuses, from
// the cache or the log of record.
func (m *memoryModel) fillRetired(ctx context.Context, tenant string, page []contracts.JobStatus, idx []int) error {
	want := map[string]*contracts.JobStatus{}
	for _, i := range idx {
		if st, ok := m.cache.get(cacheKey(tenant, page[i].JobID)); ok {
			page[i] = *st
			continue
		}
		want[page[i].JobID] = &contracts.JobStatus{}
	}
	if len(want) > m.fetchOne && m.tenantFetch != nil {
		if err := m.tenantFetch(ctx, tenant, want); err != nil {
			return fmt.Errorf("%w: %w", errLogUnavailable, err)
		}
	} else {
		for id, st := range want {
			got, err := m.fetch(ctx, tenant, id)
			if errors.Is(err, errUnknownJob) {
				continue // no event left: reported below
			}
			if err != nil {
				return fmt.Errorf("retired job: %w: %w", errLogUnavailable, err)
			}
			*st = got
		}
	}
	for _, i := range idx {
		st, ok := want[page[i].JobID]
		if !ok {
			continue
		}
		if st.State == contracts.StateNew {
			// Not errUnknownJob: that would say the cursor is unknown.
			return fmt.Errorf("retired job %s/%s has no event left in %s", tenant, page[i].JobID, contracts.StreamJobEvents)
		}
		page[i] = *st
		if len(want) <= m.ret.CachedJobs/4 {
			m.cache.put(cacheKey(tenant, st.JobID), st)
		}
	}
	return nil
}

// listOrder is the order of a job list: newest first, ties by ID.
func listOrder(a, b contracts.JobStatus) int {
	if c := b.CreatedAt.Compare(a.CreatedAt); c != 0 {
		return c
	}
	return cmp.Compare(a.JobID, b.JobID)
}

func (m *memoryModel) Usage(ctx context.Context, tenant string) (contracts.UsageSummary, error) {
	if m.usageAgg != nil {
		recs, err := m.usageRecs(ctx, tenant, m.usageSeq.Load())
		if err != nil {
			return contracts.UsageSummary{}, err
		}
		return summarize(tenant, recs), nil
	}
	m.mu.RLock()
	raw := slices.Collect(maps.Values(m.usage[tenant]))
	m.mu.RUnlock()
	recs := make([]contracts.UsageRecord, len(raw))
	for i, data := range raw {
		if err := json.Unmarshal(data, &recs[i]); err != nil {
			return contracts.UsageSummary{}, fmt.Errorf("usage record of %s: %w", tenant, err)
		}
	}
	return summarize(tenant, recs), nil
}

func (m *memoryModel) UsageSeries(ctx context.Context, tenant string, q seriesQuery) (contracts.UsageSeries, error) {
	if m.usageAgg != nil {
		m.mu.RLock()
		tu := m.usageAgg.tenants[tenant]
		if tu == nil {
			tu = newTenantUsage()
		}
		series, ok := tu.series(tenant, q)
		m.mu.RUnlock()
		if ok {
			return series, nil
		}
	}
	// The records themselves: the model keeps them, or the hours asked
	// for were dropped.
	sum, err := m.Usage(ctx, tenant)
	if err != nil {
		return contracts.UsageSeries{}, err
	}
	return seriesOf(sum, q), nil
}

func (m *memoryModel) Invoice(ctx context.Context, tenant, period string) (contracts.Invoice, error) {
	if m.usageAgg != nil {
		m.mu.RLock()
		defer m.mu.RUnlock()
		return m.usageAgg.tenants[tenant].invoiceFor(tenant, period)
	}
	sum, err := m.Usage(ctx, tenant)
	if err != nil {
		return contracts.Invoice{}, err
	}
	return contracts.BuildInvoice(tenant, period, sum.ByJob)
}

// summarize folds a tenant's distinct usage records into its summary,
// records ordered by start time (ties by ID).
func summarize(tenant string, recs []contracts.UsageRecord) contracts.UsageSummary {
	slices.SortFunc(recs, func(a, b contracts.UsageRecord) int {
		if c := a.Start.Compare(b.Start); c != 0 {
			return c
		}
		return cmp.Compare(a.ID, b.ID)
	})
	s := contracts.UsageSummary{Tenant: tenant, Records: len(recs), ByJob: recs}
	for _, r := range recs {
		s.GPUMillis += r.GPUMillis
		s.CostMicros += r.CostMicros
		s.OnDemandCostMicros += r.OnDemandCostMicros
		if r.Currency != "" {
			s.Currency = r.Currency
		}
	}
	s.GPUSeconds = float64(s.GPUMillis) / 1000
	return s
}
