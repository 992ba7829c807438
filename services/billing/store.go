package billing

import (
	"context"
	"sync"

	"github.com/gpuplane/gpuplane/contracts"
)

// Totals is metered usage summed up.
type Totals struct {
	Records   int
	GPUMillis int64
}

// GPUSeconds is GPUMillis in seconds, for display.
func (t Totals) GPUSeconds() float64 { return float64(t.GPUMillis) / 1000 }

// Store keeps usage totals by tenant and by job. It is a view that the USAGE
// stream can always rebuild, never the record itself: billing replays USAGE
// into it at every start. A Redis implementation will come with a later
// issue; every implementation passes the conformance test in store_test.go.
type Store interface {
	// Add counts rec in the totals of its tenant and of its job. It is
	// idempotent on rec.ID: a record added again, by a replay or a
	// redelivery, counts once.
	Add(ctx context.Context, rec contracts.UsageRecord) error
	// Tenant returns a tenant's totals, zero for a tenant never billed.
	Tenant(ctx context.Context, tenant string) (Totals, error)
	// Job returns the totals of one job of a tenant, all attempts together.
	Job(ctx context.Context, tenant, jobID string) (Totals, error)
}

// MemoryStore is the in-memory Store, for the embedded default and tests.
// It is safe for concurrent use.
type MemoryStore struct {
	mu      sync.Mutex
	added   map[string]struct{} // record IDs
	tenants map[string]Totals
	jobs    map[[2]string]Totals // (tenant, job)
}

var _ Store = (*MemoryStore)(nil)

// NewMemoryStore returns an empty in-memory store.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{added: map[string]struct{}{}, tenants: map[string]Totals{}, jobs: map[[2]string]Totals{}}
}

// Add implements Store.
func (s *MemoryStore) Add(_ context.Context, rec contracts.UsageRecord) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.added[rec.ID]; ok {
		return nil
	}
	s.added[rec.ID] = struct{}{}
	add := func(t Totals) Totals {
		t.Records++
		t.GPUMillis += rec.GPUMillis
		return t
	}
	s.tenants[rec.Tenant] = add(s.tenants[rec.Tenant])
	k := [2]string{rec.Tenant, rec.JobID}
	s.jobs[k] = add(s.jobs[k])
	return nil
}

// Tenant implements Store.
func (s *MemoryStore) Tenant(_ context.Context, tenant string) (Totals, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tenants[tenant], nil
}

// Job implements Store.
func (s *MemoryStore) Job(_ context.Context, tenant, jobID string) (Totals, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.jobs[[2]string{tenant, jobID}], nil
}
