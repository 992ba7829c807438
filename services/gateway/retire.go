package gateway

import (
	"cmp"
	"container/list"
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"hash/maphash"
	"math"
	"slices"
	"sync"
	"time"
	"unsafe"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// Retention of ended jobs (issue 17: bounded memory, nothing grows with
// history). The read model keeps a job whole while it is open and for a
// while after it ended (RetainEnded, at most RetainEndedMax ended jobs);
// then it retires it: what stays in memory is a record of what a list
// needs to place and filter it (created-at, ID and state packed in 16
// bytes beside the ID's, and its 16-byte key: about 40 bytes beside the
// ID), and the job's status is folded
// again from its own subject of JOB_EVENTS when asked for (behind a
// bounded cache). A job's ended state accepts no event, so a retired
// record never changes, and the answers of Job and Jobs are the same
// before and after retirement (TestRetiredJobsAnswerAsBefore).

// RetentionConfig says how long the read model keeps ended jobs whole.
// Zero fields take the defaults of DefaultRetentionConfig.
type RetentionConfig struct {
	// RetainEnded is how long after its end (by the ending event's time)
	// a job stays whole in memory; RetainEndedMax is the most ended jobs
	// kept whole.
	RetainEnded    time.Duration
	RetainEndedMax int
	// CachedJobs bounds the statuses of retired jobs kept after a read.
	CachedJobs int
	// SnapshotInterval is how often the read model is written to
	// BucketSnapshots (readmodel_snapshot.go); negative: never.
	SnapshotInterval time.Duration
	// ListRetention is how long after its end an ended job stays in job
	// lists (listwindow.go); negative: for ever.
	ListRetention time.Duration
}

// DefaultRetentionConfig keeps ended jobs whole for 10 minutes, at most
// 20,000 of them (as the scheduler does), and 2,000 retired statuses
// (about 2.6 KiB each with their requests: a few pages of every tenant),
// and lists the jobs that ended in the last 7 days.
func DefaultRetentionConfig() RetentionConfig {
	return RetentionConfig{RetainEnded: 10 * time.Minute, RetainEndedMax: 20_000, CachedJobs: 2_000, SnapshotInterval: time.Minute,
		ListRetention: DefaultListRetention}
}

// DefaultListRetention is how long ended jobs stay listed by default: a
// week of history in the console and gpuctl's lists, and at most a
// week's rate of records in memory (~69 bytes a job: ~48 MB at 100,000
// jobs a day).
const DefaultListRetention = 7 * 24 * time.Hour

func (c RetentionConfig) withDefaults() RetentionConfig {
	d := DefaultRetentionConfig()
	c.RetainEnded = cmp.Or(c.RetainEnded, d.RetainEnded)
	c.RetainEndedMax = cmp.Or(c.RetainEndedMax, d.RetainEndedMax)
	c.CachedJobs = cmp.Or(c.CachedJobs, d.CachedJobs)
	c.SnapshotInterval = cmp.Or(c.SnapshotInterval, d.SnapshotInterval)
	c.ListRetention = cmp.Or(c.ListRetention, d.ListRetention)
	return c
}

// endedStates are the states a job never leaves (contracts' state
// machine has no transition out of them): the only ones retired.
var endedStates = []contracts.JobState{contracts.StateSucceeded, contracts.StateFailed, contracts.StateCancelled,
	contracts.StateRejected}

func endedIndex(s contracts.JobState) int {
	for i, e := range endedStates {
		if e == s {
			return i
		}
	}
	return -1
}

// retiredJob is what stays of a retired job: its place in the list order
// (created-at, ID), its state, and when it ended (for the list window,
// listwindow.go). Nothing else is read: its status is folded again from
// the job's subject, which direct gets find without a sequence. A set
// keeps it packed (retiredRec); this is the record read back.
type retiredJob struct {
	sec int64
	id  string
	// endMin is how many minutes after its creation the job ended,
	// rounded up (at most maxEndMin).
	endMin uint32
	nsec   int32
	state  uint8 // index in endedStates
}

func (r *retiredJob) createdAt() time.Time { return time.Unix(r.sec, int64(r.nsec)).UTC() }

// endedBy is the end of the minute in which r's job ended, at the latest.
func (r *retiredJob) endedBy() time.Time {
	return r.createdAt().Add(time.Duration(r.endMin) * time.Minute)
}

// endMinutes is endMin for a job created at created that ended at ended:
// whole minutes, rounded up (an end before the creation, a skewed clock's,
// counts as 0), at most maxEndMin.
func endMinutes(created, ended time.Time) uint32 {
	d := ended.Sub(created) // saturates at ±292 years
	switch {
	case d <= 0:
		return 0
	case d >= maxEndMin*time.Minute:
		return maxEndMin
	}
	return uint32((d + time.Minute - 1) / time.Minute)
}

// The packing of a record's creation second and end minutes into one
// int64 (retiredRec.secEnd): the second in the high 40 bits (years -15,000
// to 19,000: every time a job is made at), the minutes in the low 24 (31
// years).
const (
	endBits   = 24
	maxEndMin = 1<<endBits - 1
	maxSec    = 1<<(63-endBits) - 1
	minSec    = -1 << (63 - endBits)
)

// listOrderAt is listOrder on a retired record and a status.
func listOrderAt(r *retiredJob, b contracts.JobStatus) int {
	if c := b.CreatedAt.Compare(r.createdAt()); c != 0 {
		return c
	}
	return cmp.Compare(r.id, b.JobID)
}

// retiredRec is a retired job as its set keeps it: 16 bytes, its ID in
// the set's ids (a length byte, then the ID: IDs are 1-128 bytes). A
// record of its own with the ID as a string was 32 bytes beside the
// ID's own allocation (16 bytes for an ID of 9-16 bytes, 48 for a UUID):
// per job ever seen, the bulk of what the read model keeps.
type retiredRec struct {
	secEnd int64  // created-at's second<<endBits | end minutes
	off    uint32 // where the ID's length byte is in ids
	ns     uint32 // nanoseconds<<2 | state
}

// maxRetiredIDBytes bounds a set's ids (offsets are 32 bits): a tenant
// with more than 4 GiB of retired IDs (30 million jobs or more) keeps
// its later ended jobs whole instead.
const maxRetiredIDBytes = math.MaxUint32

// retiredSet holds a tenant's retired jobs, oldest first (the list
// order reversed: jobs retire mostly in the order they were created, so
// they are mostly appended in order).
type retiredSet struct {
	recs []retiredRec
	// ids holds every record's ID; appended to, never changed in place,
	// so the strings at() makes over it stay valid (a grown array leaves
	// the old one to those strings).
	ids []byte
	// sorted is false after an append out of order; the next list sorts.
	sorted bool
	states [4]int // how many retired jobs are in each endedStates
}

// at returns record i; its id shares the set's ids (no copy: clone it to
// keep it beyond a request).
func (rs *retiredSet) at(i int) retiredJob { return rs.unpack(rs.recs[i]) }

func (rs *retiredSet) unpack(r retiredRec) retiredJob {
	n := uint32(rs.ids[r.off])
	return retiredJob{sec: r.secEnd >> endBits, endMin: uint32(r.secEnd & maxEndMin), nsec: int32(r.ns >> 2), state: uint8(r.ns & 3),
		id: unsafe.String(&rs.ids[r.off+1], int(n))}
}

// len is the number of records.
func (rs *retiredSet) len() int { return len(rs.recs) }

// storeOrder is the order of retiredSet.recs: the list order reversed.
func storeOrder(a, b retiredJob) int {
	if c := cmp.Compare(a.sec, b.sec); c != 0 {
		return c
	}
	if c := cmp.Compare(a.nsec, b.nsec); c != 0 {
		return c
	}
	return cmp.Compare(b.id, a.id)
}

// packs reports whether r fits a retiredRec: an ID of 1 to 255 bytes, a
// state, nanoseconds, second and end minutes in range.
func (r *retiredJob) packs() bool {
	return len(r.id) > 0 && len(r.id) <= math.MaxUint8 && int(r.state) < len(endedStates) && r.nsec >= 0 && r.nsec < 1e9 &&
		r.sec >= minSec && r.sec <= maxSec && r.endMin <= maxEndMin
}

// add appends r; it reports false, adding nothing, when the set's ids
// are full or r cannot be packed (packs).
func (rs *retiredSet) add(r retiredJob) bool {
	if !r.packs() || uint64(len(rs.ids))+1+uint64(len(r.id)) > maxRetiredIDBytes {
		return false
	}
	if n := len(rs.recs); n > 0 && storeOrder(rs.at(n-1), r) > 0 {
		rs.sorted = false
	}
	off := uint32(len(rs.ids))
	rs.ids = append(rs.ids, byte(len(r.id)))
	rs.ids = append(rs.ids, r.id...)
	rs.recs = append(rs.recs, retiredRec{secEnd: r.sec<<endBits | int64(r.endMin), off: off, ns: uint32(r.nsec)<<2 | uint32(r.state)})
	rs.states[r.state]++
	return true
}

// sort puts the records in store order.
func (rs *retiredSet) sort() {
	slices.SortFunc(rs.recs, func(a, b retiredRec) int { return storeOrder(rs.unpack(a), rs.unpack(b)) })
	rs.sorted = true
}

// records returns every record in store order (a snapshot's copy; the
// ids still share the set's).
func (rs *retiredSet) records() []retiredJob {
	out := make([]retiredJob, len(rs.recs))
	for i, r := range rs.recs {
		out[i] = rs.unpack(r)
	}
	if !rs.sorted {
		slices.SortFunc(out, storeOrder)
	}
	return out
}

var keySeeds = [2]maphash.Seed{maphash.MakeSeed(), maphash.MakeSeed()}

// retiredID is a retired job's entry in the model's set of them: 128 bits
// of two seeded hashes of tenant and ID. A collision would make a new
// job's events be refused as a retired one's, so the key is as wide as
// the scheduler's and resource manager's retired keys (a collision among
// 10^12 jobs is about 10^-15 likely) rather than 64 bits (about 10^-7 at
// a million jobs). The seeds are random per process: tenants choose IDs,
// and cannot aim at a collision; the set is rebuilt from the records'
// IDs at start, so nothing stored depends on them.
//
// The keys are held in a usageDigests set (a sorted array of 16 bytes a
// key and a map of the recent ones, merged at an eighth of the array),
// not in a map: a map of a million keys held ~19-38 bytes a key (its
// load factor and the doubling of its table), the array 16.
type retiredID = usageDigest

func retiredKey(tenant, job string) retiredID {
	var k retiredID
	for i, seed := range keySeeds {
		var h maphash.Hash
		h.SetSeed(seed)
		_, _ = h.WriteString(tenant)
		_ = h.WriteByte('/')
		_, _ = h.WriteString(job)
		binary.LittleEndian.PutUint64(k[8*i:], h.Sum64())
	}
	return k
}

// jobFetcher folds one job's events from the log of record.
type jobFetcher func(ctx context.Context, tenant, job string) (contracts.JobStatus, error)

// statusCache is a bounded LRU of retired jobs' statuses.
type statusCache struct {
	mu    sync.Mutex
	max   int
	ll    *list.List
	items map[string]*list.Element
}

type cacheEntry struct {
	key string
	st  *contracts.JobStatus
}

func newStatusCache(max int) *statusCache {
	return &statusCache{max: max, ll: list.New(), items: map[string]*list.Element{}}
}

func (c *statusCache) get(key string) (*contracts.JobStatus, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.items[key]
	if !ok {
		return nil, false
	}
	c.ll.MoveToFront(e)
	return e.Value.(*cacheEntry).st, true
}

func (c *statusCache) put(key string, st *contracts.JobStatus) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[key]; ok {
		e.Value.(*cacheEntry).st = st
		c.ll.MoveToFront(e)
		return
	}
	c.items[key] = c.ll.PushFront(&cacheEntry{key: key, st: st})
	for c.ll.Len() > c.max {
		e := c.ll.Back()
		c.ll.Remove(e)
		delete(c.items, e.Value.(*cacheEntry).key)
	}
}

func (c *statusCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ll.Len()
}

// streamFetcher folds a job's status from its subject of JOB_EVENTS
// (bus.SubjectMsgs: direct gets, the next message of the subject each),
// the way the ingester folds it: the same events, the same checks, the
// same state machine, so the same status.
func streamFetcher(b *bus.Bus) jobFetcher {
	return func(ctx context.Context, tenant, job string) (contracts.JobStatus, error) {
		var st contracts.JobStatus
		err := b.SubjectMsgs(ctx, contracts.StreamJobEvents, contracts.SubjectJobEvents(tenant, job), func(m *bus.Msg) bool {
			foldJobEvent(&st, tenant, job, m)
			return false
		})
		if err != nil {
			return contracts.JobStatus{}, fmt.Errorf("job %s/%s: %w", tenant, job, err)
		}
		if st.State == contracts.StateNew {
			return st, fmt.Errorf("job %s/%s: %w", tenant, job, errUnknownJob)
		}
		return st, nil
	}
}

// foldJobEvent applies m to st as the ingester does (applyJobEvent):
// a message it would skip or the state machine refuses changes nothing.
func foldJobEvent(st *contracts.JobStatus, tenant, job string, m *bus.Msg) {
	var ev contracts.JobEvent
	if m.Decode(&ev) != nil || ev.Tenant != tenant || ev.JobID != job {
		return
	}
	next := *st
	if next.Apply(ev, m.StreamSeq) == nil {
		*st = next
	}
}

// tenantFetch folds every job of want from one read of the tenant's
// subjects: a page with more retired jobs than this costs one read of
// the tenant's events rather than a direct get per event.
func tenantFetch(ctx context.Context, b *bus.Bus, tenant string, want map[string]*contracts.JobStatus) error {
	spec := bus.FollowSpec{Stream: contracts.StreamJobEvents, FilterSubjects: []string{contracts.SubjectTenantJobEvents(tenant)}}
	_, err := b.Replay(ctx, spec, func(_ context.Context, m *bus.Msg) error {
		job := contracts.Token(m.Subject, 4)
		if st, ok := want[job]; ok {
			foldJobEvent(st, tenant, job, m)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("tenant %s's job events: %w", tenant, err)
	}
	return nil
}

// cacheKey is a job's key in the status cache.
func cacheKey(tenant, job string) string { return tenant + "/" + job }

func (c *RetentionConfig) registerFlags(fs *flag.FlagSet) {
	fs.DurationVar(&c.RetainEnded, "retain-ended", c.RetainEnded, "how long an ended job stays whole in the read model before it is retired (read again from JOB_EVENTS when asked for)")
	fs.IntVar(&c.RetainEndedMax, "retain-ended-max", c.RetainEndedMax, "most ended jobs kept whole in the read model")
	fs.IntVar(&c.CachedJobs, "retired-cache", c.CachedJobs, "retired jobs' statuses cached after a read or their retirement")
	fs.DurationVar(&c.SnapshotInterval, "snapshot-interval", c.SnapshotInterval, "how often the read model is written to the gp-snapshots bucket (negative: never)")
	fs.DurationVar(&c.ListRetention, "list-retention", c.ListRetention, "how long after its end an ended job stays in job lists; older ones still answer by ID, read from JOB_EVENTS (negative: for ever)")
}

// validate reports every negative size.
func (c RetentionConfig) validate() error {
	var errs []error
	if c.RetainEnded < 0 {
		errs = append(errs, fmt.Errorf("retain ended is %s; want > 0 (0: the default)", c.RetainEnded))
	}
	if c.RetainEndedMax < 0 || c.CachedJobs < 0 {
		errs = append(errs, fmt.Errorf("retain ended max %d and retired cache %d; want > 0 (0: the default)", c.RetainEndedMax, c.CachedJobs))
	}
	return errors.Join(errs...)
}
