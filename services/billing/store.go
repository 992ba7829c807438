package billing

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/recset"
	"github.com/gpuplane/gpuplane/services/billing/internal/biller"
)

// Totals is metered usage summed up; amounts are micro-units of the price
// book's currency.
type Totals struct {
	Records   int64
	GPUMillis int64
	// CostMicros is what was billed; OnDemandMicros the same usage at
	// on-demand rates.
	CostMicros     int64
	OnDemandMicros int64
}

// GPUSeconds is GPUMillis in seconds, for display.
func (t Totals) GPUSeconds() float64 { return float64(t.GPUMillis) / 1000 }

// Errors of a Store.
var (
	// ErrGenerationChanged: the store lost what it held since Open (Redis
	// flushed or restarted). Open again: it starts a new generation,
	// which billing fills by replaying USAGE from its first record.
	ErrGenerationChanged = errors.New("billing store: generation changed")
	// ErrStoreUnavailable: the store is failing and its circuit breaker is
	// open; try again later.
	ErrStoreUnavailable = errors.New("billing store unavailable")
	// ErrIncomplete: the store's generation does not hold all of USAGE
	// yet (it is being filled by a replay, on this replica or another) or
	// no longer (it lost its content since): totals read now would
	// understate what was spent.
	ErrIncomplete = errors.New("billing store: content incomplete, being rebuilt from USAGE")
)

// Store keeps running totals of usage records by tenant, tenant and day,
// tenant and month, pool and day, and job. It is a view that the USAGE
// stream can always rebuild, never the record itself. Every
// implementation passes the conformance test in store_test.go.
//
// Days and months are UTC and taken from a record's Start: billing cuts
// segments at midnight, so a record lies within one day.
type Store interface {
	// Open names the generation of the store's content, creating it when
	// the store is empty. A generation is filled by replaying USAGE from
	// its start; billing keeps one durable consumer per generation.
	Open(ctx context.Context) (generation string, err error)
	// Apply counts each record in its totals at most once (keyed by its
	// ID: a record applied again, by a replay or a redelivery, counts
	// nothing), atomically with its applied marker. It returns how many
	// records were new. It fails with ErrGenerationChanged when the store
	// lost its content since Open.
	Apply(ctx context.Context, recs []contracts.UsageRecord) (applied int, err error)
	// Tenant, TenantDay, TenantMonth, PoolDay and Job return totals; zero
	// for what was never billed. day and month may be any instant in them.
	Tenant(ctx context.Context, tenant string) (Totals, error)
	TenantDay(ctx context.Context, tenant string, day time.Time) (Totals, error)
	TenantMonth(ctx context.Context, tenant string, month time.Time) (Totals, error)
	PoolDay(ctx context.Context, pool string, day time.Time) (Totals, error)
	Job(ctx context.Context, tenant, jobID string) (Totals, error)
	// Billed reports, for each allocation (named by AllocationKey of its
	// ID), whether a record of it was applied, and the generation the
	// answer is of (an allocation is marked atomically with its records'
	// applied markers). The biller forgets allocations billed to their end
	// once the store confirms them, and asks here when one comes up again
	// (internal/biller). keys may be empty: a probe of the generation.
	Billed(ctx context.Context, keys []AllocationKey) (generation string, billed []bool, err error)
	// Generation is the store's generation now ("" when it has none): a
	// probe. One other than the generation Open named means the store
	// lost its content since, as ErrGenerationChanged does.
	Generation(ctx context.Context) (string, error)
	// MarkComplete records that generation holds every record USAGE held
	// when its replay began: the projector calls it once its consumer's
	// acknowledgements reach that point. It fails with
	// ErrGenerationChanged, and marks nothing, when the store's
	// generation is another by now.
	MarkComplete(ctx context.Context, generation string) error
	// CompleteTenantDay and CompleteTenantMonth are TenantDay and
	// TenantMonth for decisions (budgets): read together with the
	// store's generation and its mark, they fail with ErrIncomplete
	// unless that generation was marked complete. Replicas share a
	// store (Redis): one that refills it after a loss leaves the others
	// nothing in their own state to tell them, so the store says it.
	CompleteTenantDay(ctx context.Context, tenant string, day time.Time) (Totals, error)
	CompleteTenantMonth(ctx context.Context, tenant string, month time.Time) (Totals, error)
}

// tenantDayKey and tenantMonthKey name a tenant's totals of a day and a
// month, as both stores key them (RedisStore under its prefix).
func tenantDayKey(tenant string, day time.Time) string {
	return "tenant:" + tenant + ":day:" + dayKey(day)
}
func tenantMonthKey(tenant string, month time.Time) string {
	return "tenant:" + tenant + ":month:" + monthKey(month)
}

// dayKey and monthKey name a UTC day and month.
func dayKey(t time.Time) string   { return t.UTC().Format(time.DateOnly) }
func monthKey(t time.Time) string { return t.UTC().Format("2006-01") }

// MemoryStore is the in-memory Store: the embedded default of `make run`
// and of tests. Its content dies with the process, so every process has a
// new generation and rebuilds from USAGE. It is safe for concurrent use.
type MemoryStore struct {
	mu  sync.Mutex
	gen string
	// complete is gen once MarkComplete named it.
	complete string
	// applied holds a digest of each applied record's ID (recordKey): the
	// IDs themselves, some 70 bytes each, were most of what the store
	// kept per record, and records come with every job (issue 17). In a
	// recset, 16 bytes a record and its index's slot (~24 B), not a Go
	// map's slot (~36 B measured).
	applied *recset.Set
	// jobs are the totals by job (what grows with history): a record per
	// job of the digest of its key (jobKey) and its totals (jobRecord).
	// Keyed by the key's string in a Go map they took ~110 bytes a job
	// (the key's bytes, the slot, the map's growth), here ~56.
	jobs *recset.Set
	// billed holds the AllocationKey of each allocation a record was
	// applied of: Billed's answer.
	billed *recset.Set
	totals map[string]Totals // by the same keys as RedisStore's, but the jobs'
}

var _ Store = (*MemoryStore)(nil)

// NewMemoryStore returns an empty in-memory store.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{gen: newGeneration(), applied: recset.New(recset.KeySize), jobs: recset.New(jobRecordSize),
		billed: recset.New(recset.KeySize), totals: map[string]Totals{}}
}

// jobRecordSize is the size of a job's record in MemoryStore.jobs: the
// digest of its total's key, then its Totals' four fields, 8 bytes each.
const jobRecordSize = recset.KeySize + 4*8

// jobDigest is the first 16 bytes of the SHA-256 of a job total's key
// (as totalKeys names it): as for recordKey, a digest no tenant can
// collide on purpose (a collision would add one job's usage to
// another's totals).
func jobDigest(key string) [recset.KeySize]byte {
	sum := sha256.Sum256([]byte(key))
	return [recset.KeySize]byte(sum[:recset.KeySize])
}

// jobTotals reads the totals of a job's record.
func jobTotals(rec []byte) Totals {
	v := rec[recset.KeySize:]
	return Totals{Records: int64(binary.LittleEndian.Uint64(v[0:])), GPUMillis: int64(binary.LittleEndian.Uint64(v[8:])),
		CostMicros: int64(binary.LittleEndian.Uint64(v[16:])), OnDemandMicros: int64(binary.LittleEndian.Uint64(v[24:]))}
}

// addJob adds r to the totals of the job whose total's key is key.
func (s *MemoryStore) addJob(key string, r contracts.UsageRecord) {
	k := jobDigest(key)
	var rec [jobRecordSize]byte
	copy(rec[:], k[:])
	var t Totals
	if old, ok := s.jobs.Get(k[:]); ok {
		t = jobTotals(old)
	}
	t.Records++
	t.GPUMillis += r.GPUMillis
	t.CostMicros += r.CostMicros
	t.OnDemandMicros += r.OnDemandCostMicros
	v := rec[recset.KeySize:]
	binary.LittleEndian.PutUint64(v[0:], uint64(t.Records))
	binary.LittleEndian.PutUint64(v[8:], uint64(t.GPUMillis))
	binary.LittleEndian.PutUint64(v[16:], uint64(t.CostMicros))
	binary.LittleEndian.PutUint64(v[24:], uint64(t.OnDemandMicros))
	s.jobs.Put(rec[:])
}

// recordKey is the first 16 bytes of the SHA-256 of a record's ID: a
// digest no tenant can collide on purpose (a collision would count one
// record as another's redelivery).
type recordKey [16]byte

func keyOfRecord(id string) recordKey {
	sum := sha256.Sum256([]byte(id))
	return recordKey(sum[:16])
}

// AllocationKey names an allocation in Store.Billed: the first 16 bytes
// of the SHA-256 of its ID, as the biller keeps it (biller.KeyOf). A
// digest no tenant can collide on purpose: a collision would let one of
// its allocations pass as billed.
type AllocationKey = biller.Key

// KeyOfAllocation is the AllocationKey of an allocation's ID.
func KeyOfAllocation(id string) AllocationKey { return biller.KeyOf(id) }

// newGeneration is a random name for a store's content.
func newGeneration() string { return rand.Text()[:16] }

// Open implements Store.
func (s *MemoryStore) Open(context.Context) (string, error) { return s.gen, nil }

// Apply implements Store.
func (s *MemoryStore) Apply(_ context.Context, recs []contracts.UsageRecord) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, r := range recs {
		k := keyOfRecord(r.ID)
		if !s.applied.Add(k[:]) {
			continue
		}
		n++
		if r.AllocationID != "" {
			a := KeyOfAllocation(r.AllocationID)
			s.billed.Add(a[:])
		}
		keys := totalKeys(r)
		s.addJob(keys[len(keys)-1], r)
		for _, k := range keys[:len(keys)-1] {
			t := s.totals[k]
			t.Records++
			t.GPUMillis += r.GPUMillis
			t.CostMicros += r.CostMicros
			t.OnDemandMicros += r.OnDemandCostMicros
			s.totals[k] = t
		}
	}
	return n, nil
}

// totalKeys are the totals one record counts in, named as RedisStore
// names its hashes (without the prefix); the job's is the last.
func totalKeys(r contracts.UsageRecord) []string {
	day, month := dayKey(r.Start), monthKey(r.Start)
	return []string{"tenant:" + r.Tenant, "tenant:" + r.Tenant + ":day:" + day, "tenant:" + r.Tenant + ":month:" + month,
		"pool:" + r.Pool + ":day:" + day, "job:" + r.Tenant + ":" + r.JobID}
}

func (s *MemoryStore) get(k string) (Totals, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.totals[k], nil
}

// Tenant implements Store.
func (s *MemoryStore) Tenant(_ context.Context, tenant string) (Totals, error) {
	return s.get("tenant:" + tenant)
}

// TenantDay implements Store.
func (s *MemoryStore) TenantDay(_ context.Context, tenant string, day time.Time) (Totals, error) {
	return s.get(tenantDayKey(tenant, day))
}

// TenantMonth implements Store.
func (s *MemoryStore) TenantMonth(_ context.Context, tenant string, month time.Time) (Totals, error) {
	return s.get(tenantMonthKey(tenant, month))
}

// PoolDay implements Store.
func (s *MemoryStore) PoolDay(_ context.Context, pool string, day time.Time) (Totals, error) {
	return s.get("pool:" + pool + ":day:" + dayKey(day))
}

// Job implements Store.
func (s *MemoryStore) Job(_ context.Context, tenant, jobID string) (Totals, error) {
	k := jobDigest("job:" + tenant + ":" + jobID)
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, ok := s.jobs.Get(k[:])
	if !ok {
		return Totals{}, nil
	}
	return jobTotals(rec), nil
}

// Billed implements Store.
func (s *MemoryStore) Billed(_ context.Context, keys []AllocationKey) (string, []bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]bool, len(keys))
	for i, k := range keys {
		out[i] = s.billed.Has(k[:])
	}
	return s.gen, out, nil
}

// Generation implements Store.
func (s *MemoryStore) Generation(context.Context) (string, error) { return s.gen, nil }

// MarkComplete implements Store.
func (s *MemoryStore) MarkComplete(_ context.Context, generation string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if generation != s.gen {
		return ErrGenerationChanged
	}
	s.complete = generation
	return nil
}

// CompleteTenantDay implements Store.
func (s *MemoryStore) CompleteTenantDay(_ context.Context, tenant string, day time.Time) (Totals, error) {
	return s.getComplete(tenantDayKey(tenant, day))
}

// CompleteTenantMonth implements Store.
func (s *MemoryStore) CompleteTenantMonth(_ context.Context, tenant string, month time.Time) (Totals, error) {
	return s.getComplete(tenantMonthKey(tenant, month))
}

func (s *MemoryStore) getComplete(k string) (Totals, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.complete != s.gen {
		return Totals{}, ErrIncomplete
	}
	return s.totals[k], nil
}
