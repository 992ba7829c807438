package gateway

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

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
	// ApplyUsage adds rec to its tenant's summary once per record ID;
	// it reports whether the record was new.
	ApplyUsage(ctx context.Context, tenant string, rec contracts.UsageRecord) (bool, error)
	// Job returns one job's status, or an error wrapping errUnknownJob.
	Job(ctx context.Context, tenant, job string) (contracts.JobStatus, error)
	// Jobs returns a tenant's jobs matching q, newest first (ties by ID).
	Jobs(ctx context.Context, tenant string, q jobQuery) ([]contracts.JobStatus, error)
	// Usage returns a tenant's usage summary (zero for an unknown tenant).
	Usage(ctx context.Context, tenant string) (contracts.UsageSummary, error)
}

var _ readModel = (*memoryModel)(nil)

// memoryModel is the in-memory readModel: rebuilt from the streams at every
// start, lost at exit.
type memoryModel struct {
	mu    sync.RWMutex
	jobs  map[string]map[string]*contracts.JobStatus  // tenant -> job ID -> status
	usage map[string]map[string]contracts.UsageRecord // tenant -> record ID -> record
}

func newMemoryModel() *memoryModel {
	return &memoryModel{
		jobs:  map[string]map[string]*contracts.JobStatus{},
		usage: map[string]map[string]contracts.UsageRecord{},
	}
}

func (m *memoryModel) ApplyJobEvent(_ context.Context, tenant, job string, ev contracts.JobEvent, seq uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	st := m.jobs[tenant][job]
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
	return nil
}

func (m *memoryModel) ApplyUsage(_ context.Context, tenant string, rec contracts.UsageRecord) (bool, error) {
	if rec.ID == "" {
		return false, errors.New("usage record without an id")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.usage[tenant][rec.ID]; ok {
		return false, nil
	}
	if m.usage[tenant] == nil {
		m.usage[tenant] = map[string]contracts.UsageRecord{}
	}
	m.usage[tenant][rec.ID] = rec
	return true, nil
}

func (m *memoryModel) Job(_ context.Context, tenant, job string) (contracts.JobStatus, error) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	st, ok := m.jobs[tenant][job]
	if !ok {
		return contracts.JobStatus{}, fmt.Errorf("job %s/%s: %w", tenant, job, errUnknownJob)
	}
	return *st, nil
}

func (m *memoryModel) Jobs(_ context.Context, tenant string, q jobQuery) ([]contracts.JobStatus, error) {
	m.mu.RLock()
	var cursor *contracts.JobStatus
	if q.After != "" {
		if cursor = m.jobs[tenant][q.After]; cursor == nil {
			m.mu.RUnlock()
			return nil, fmt.Errorf("after %s/%s: %w", tenant, q.After, errUnknownJob)
		}
	}
	out := make([]contracts.JobStatus, 0, len(m.jobs[tenant]))
	for _, st := range m.jobs[tenant] {
		if (q.State == contracts.StateNew || st.State == q.State) && (cursor == nil || listOrder(*cursor, *st) < 0) {
			out = append(out, *st)
		}
	}
	m.mu.RUnlock()
	slices.SortFunc(out, listOrder)
	if q.Limit > 0 && len(out) > q.Limit {
		out = out[:q.Limit]
	}
	return out, nil
}

// listOrder is the order of a job list: newest first, ties by ID.
func listOrder(a, b contracts.JobStatus) int {
	if c := b.CreatedAt.Compare(a.CreatedAt); c != 0 {
		return c
	}
	return cmp.Compare(a.JobID, b.JobID)
}

func (m *memoryModel) Usage(_ context.Context, tenant string) (contracts.UsageSummary, error) {
	m.mu.RLock()
	recs := make([]contracts.UsageRecord, 0, len(m.usage[tenant]))
	for _, r := range m.usage[tenant] {
		recs = append(recs, r)
	}
	m.mu.RUnlock()
	return summarize(tenant, recs), nil
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
