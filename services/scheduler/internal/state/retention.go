package state

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/recset"
)

// Retention: a job that ended stays whole in the store for
// Config.RetainTerminal (and while fewer than Config.RetainTerminalMax
// ended jobs are whole), then is retired: the store forgets it but for a
// fixed-size record (retiredJob) of what later decisions still ask of an
// ended job. A resubmit of its ID must be recognised (identical:
// unchanged; another body: duplicate_job_id), a job depending on it must
// see how it ended, a cancel must learn it ended, and a late commit of
// one of its allocations must be stopped. Nothing else reads an ended
// job. So the store's memory is its live jobs plus ~37 bytes per ended
// one, not every job's request, parts and events (issue 17: a million
// jobs in the streams). And a record is kept only Config.RememberEnded
// after its job's end (a recset.Window), but for those a live job depends
// on (pins): past that, what a request asks about the job is read from
// JOB_EVENTS (recall.go). Memory is then the live jobs and the records of
// the last RememberEnded, whatever the history's length.

// retiredKey identifies a retired job: the first 128 bits of the SHA-256
// of its store key (a collision among even 10^12 jobs is ~10^-15 likely).
type retiredKey [16]byte

func retiredKeyOf(key string) retiredKey {
	h := sha256.Sum256([]byte(key))
	return retiredKey(h[:16])
}

// retiredJob is what is kept of a retired job.
type retiredJob struct {
	// hash is the first 64 bits of its request's hash (hashRequest), or of
	// its rejection's (rejectionHash) when it was rejected.
	hash    uint64
	attempt uint32
	state   uint8 // index in terminalStates
}

// retiredSize is the size of a retired job's record in a recset: its key
// (16), hash (8), attempt (4) and state (1). In a Go map, key and value
// padded, with the map's slots and control bytes, a record took ~96 bytes
// of the store's heap per ended job, and as much again in the snapshot
// compactor (BenchmarkStoreMemory); a recset holds it in ~37.
const retiredSize = 16 + 8 + 4 + 1

// foreverKeep is the keep of a window that never forgets in practice
// (Config.RememberEnded 0): ~146 years.
const foreverKeep = time.Duration(1 << 62)

func newRetiredWindow(keep time.Duration) *recset.Window {
	if keep <= 0 {
		keep = foreverKeep
	}
	return recset.NewWindow(retiredSize, keep)
}

// appendRetired appends the record of k, r.
func appendRetired(b []byte, k retiredKey, r retiredJob) []byte {
	b = append(b, k[:]...)
	b = binary.BigEndian.AppendUint64(b, r.hash)
	b = binary.BigEndian.AppendUint32(b, r.attempt)
	return append(b, r.state)
}

// decodeRetired reads what appendRetired wrote.
func decodeRetired(rec []byte) (retiredKey, retiredJob) {
	return retiredKey(rec[:16]), retiredJob{hash: binary.BigEndian.Uint64(rec[16:24]),
		attempt: binary.BigEndian.Uint32(rec[24:28]), state: rec[28]}
}

// getRetired returns the record of k in set, if there is one.
func getRetired(set *recset.Window, k retiredKey) (retiredJob, bool) {
	rec, ok := set.Get(k[:])
	if !ok {
		return retiredJob{}, false
	}
	_, r := decodeRetired(rec)
	return r, true
}

// eachRetired calls fn with every record in pieces (Set.Chunks, or
// records put together: whole records each).
func eachRetired(pieces [][]byte, fn func(retiredKey, retiredJob)) {
	for _, p := range pieces {
		for off := 0; off+retiredSize <= len(p); off += retiredSize {
			fn(decodeRetired(p[off : off+retiredSize]))
		}
	}
}

// terminalStates numbers the terminal states for retiredJob.state.
var terminalStates = []contracts.JobState{contracts.StateSucceeded, contracts.StateFailed,
	contracts.StateCancelled, contracts.StateRejected}

func stateCode(s contracts.JobState) uint8 {
	for i, t := range terminalStates {
		if t == s {
			return uint8(i)
		}
	}
	return 0
}

// endedJob is one job that reached a terminal state, at when.
type endedJob struct {
	key  string
	when time.Time
}

// retention is the store's part of it: a Store's ret (nil until used).
type retention struct {
	// retired holds the records, each dated by its job's end and kept
	// Config.RememberEnded after it (issue 17: nothing grows with
	// history), but for those pins names.
	retired *recset.Window
	// why are the rejection reasons of retired rejected jobs (few), for the
	// message of a request that depends on one; swept of forgotten ones
	// when the window forgets (swept: its Forgotten count then).
	why   map[retiredKey]contracts.Reason
	swept int
	// pins counts, per job, the live jobs that depend on it: its record
	// outlives its time while any does, for a dependent may wait (queued,
	// or requeued after a preemption) far longer than RememberEnded and
	// must still learn that its dependency succeeded.
	pins map[retiredKey]int32
	// forgotBefore is set when a snapshot restored says its window had
	// forgotten records (Snapshot.Meta.Forgot).
	forgotBefore bool
	// ended are the ended jobs still whole, oldest first.
	ended []endedJob
}

func (s *Store) retention() *retention {
	if s.ret == nil {
		r := &retention{retired: newRetiredWindow(s.cfg.RememberEnded), why: map[retiredKey]contracts.Reason{},
			pins: map[retiredKey]int32{}}
		r.retired.SetKeep(func(rec []byte) bool { return r.pins[retiredKey(rec[:16])] > 0 })
		s.ret = r
	}
	return s.ret
}

// Forgetting reports whether the store may have forgotten a job it once
// knew: then a request naming a job it does not hold must have the job
// read from JOB_EVENTS first (Submission.Recall).
func (s *Store) Forgetting() bool {
	return s.ret != nil && (s.ret.forgotBefore || s.ret.retired.Forgotten() > 0)
}

// pinDeps pins the records of the jobs j depends on (Store.finish
// unpins them).
func (s *Store) pinDeps(j *Job) {
	if j.Request != nil {
		s.pinKeys(j.Tenant, j.Request.DependsOn, 1)
	}
}

func (s *Store) unpinDeps(j *Job) {
	if j.Request != nil {
		s.pinKeys(j.Tenant, j.Request.DependsOn, -1)
	}
}

// pinKeys adds delta to the pins of tenant's jobs deps.
func (s *Store) pinKeys(tenant string, deps []string, delta int32) {
	if len(deps) == 0 {
		return
	}
	r := s.retention()
	for _, d := range deps {
		k := retiredKeyOf(Key(tenant, d))
		if r.pins[k] += delta; r.pins[k] <= 0 {
			delete(r.pins, k)
		}
	}
}

// sweepWhy drops the reasons of records the window forgot.
func (r *retention) sweepWhy() {
	if f := r.retired.Forgotten(); f != r.swept {
		r.swept = f
		for k := range r.why {
			if !r.retired.Has(k[:]) {
				delete(r.why, k)
			}
		}
	}
}

func hash64(h [sha256.Size]byte) uint64 { return binary.BigEndian.Uint64(h[:8]) }

// rejectionHash is the hash of a rejection, as a retired job keeps it.
func rejectionHash(reason contracts.Reason, errs []contracts.FieldError) [sha256.Size]byte {
	b, _ := json.Marshal(struct {
		R contracts.Reason
		E []contracts.FieldError
	}{reason, errs})
	return sha256.Sum256(b)
}

// noteEnded records that j reached a terminal state at when (finish calls
// it; a replay corrects when to the event's time with endedAt).
func (s *Store) noteEnded(j *Job, when time.Time) {
	if s.cfg.RetainTerminal <= 0 && s.cfg.RetainTerminalMax <= 0 {
		return // retention off: ended jobs stay whole
	}
	r := s.retention()
	r.ended = append(r.ended, endedJob{key: j.key, when: when})
}

// endedAt corrects the time of the last ended job noted (j's).
func (s *Store) endedAt(j *Job, when time.Time) {
	if r := s.ret; r != nil && len(r.ended) > 0 && r.ended[len(r.ended)-1].key == j.key {
		r.ended[len(r.ended)-1].when = when
	}
}

// RetireTerminal retires the ended jobs past their retention: those that
// ended more than Config.RetainTerminal ago, and the oldest beyond
// Config.RetainTerminalMax. It returns how many it retired. The scheduler
// calls it now and then (and during a replay, so that a full replay of a
// long history never holds it whole).
func (s *Store) RetireTerminal() int {
	r := s.ret
	if r == nil {
		return 0
	}
	now := s.cfg.Now()
	defer r.sweepWhy()
	r.retired.Advance(now)
	cut := now.Add(-s.cfg.RetainTerminal)
	n := 0
	for len(r.ended) > 0 {
		e := r.ended[0]
		over := s.cfg.RetainTerminalMax > 0 && len(r.ended) > s.cfg.RetainTerminalMax
		if !over && (s.cfg.RetainTerminal <= 0 || e.when.After(cut)) {
			break
		}
		r.ended[0] = endedJob{}
		r.ended = r.ended[1:]
		if j := s.jobs[e.key]; j != nil && j.State.Terminal() {
			s.retire(j, e.when)
			n++
		}
	}
	if cap(r.ended) > 1024 && len(r.ended) < cap(r.ended)/4 {
		r.ended = append([]endedJob(nil), r.ended...) // let the backing array go
	}
	return n
}

// retire replaces the ended job j, ended at when, by its record.
func (s *Store) retire(j *Job, when time.Time) {
	r := s.retention()
	k := retiredKeyOf(j.key)
	rec := retiredJob{hash: hash64(j.hash), attempt: uint32(max(j.Attempt, 0)), state: stateCode(j.State)}
	if j.rejection != nil {
		rec.hash = hash64(rejectionHash(j.rejection.reason, j.rejection.errors))
		r.why[k] = j.rejection.reason
	}
	if now := s.cfg.Now(); when.After(now) {
		// An event dated ahead (a leader's clock off) must not move the
		// window's clock, which would forget every record early.
		when = now
	}
	var b [retiredSize]byte
	r.retired.Add(appendRetired(b[:0], k, rec), when)
	delete(s.jobs, j.key)
	delete(s.seenIDs, contracts.JobEventID(j.Tenant, j.ID, contracts.EventRejected, 0, 0))
}

// isRetired reports whether the job with store key key was retired.
func (s *Store) isRetired(key string) bool {
	if s.ret == nil {
		return false
	}
	k := retiredKeyOf(key)
	return s.ret.retired.Has(k[:])
}

// lookup returns the job with store key key: the whole job, or, for a
// retired one, a stand-in that holds what is kept of it (state, attempt,
// request or rejection hash). A stand-in is not in the store: changing it
// changes nothing, and it holds no parts. Nil when the job is unknown.
func (s *Store) lookup(tenant, id string) *Job {
	key := Key(tenant, id)
	if j := s.jobs[key]; j != nil {
		return j
	}
	if s.ret == nil {
		return nil
	}
	k := retiredKeyOf(key)
	rec, ok := getRetired(s.ret.retired, k)
	if !ok {
		return nil
	}
	j := &Job{Tenant: tenant, ID: id, key: key, State: terminalStates[rec.state], Attempt: int(rec.attempt), stub: true}
	binary.BigEndian.PutUint64(j.hash[:8], rec.hash)
	if j.State == contracts.StateRejected {
		j.rejection = &rejection{reason: s.ret.why[k]}
	}
	return j
}

// sameRequest reports whether a request hashing to h is the one j was
// submitted with.
func sameRequest(j *Job, h [sha256.Size]byte) bool {
	if j.stub {
		return binary.BigEndian.Uint64(j.hash[:8]) == hash64(h)
	}
	return j.hash == h
}

// sameRejection reports whether j was rejected for reason and errs.
func sameRejection(j *Job, reason contracts.Reason, errs []contracts.FieldError) bool {
	if j.rejection == nil {
		return false
	}
	if j.stub {
		return binary.BigEndian.Uint64(j.hash[:8]) == hash64(rejectionHash(reason, errs))
	}
	return j.rejection.reason == reason && slices.Equal(j.rejection.errors, errs)
}

// Retained counts the jobs the store holds whole (live and ended ones not
// yet retired) and the retired records, for tests and the scheduler's
// logs.
func (s *Store) Retained() (whole, retired int) {
	if s.ret != nil {
		retired = s.ret.retired.Len()
	}
	return len(s.jobs), retired
}

// bucketPieces is every record of buckets, in bucket order, as pieces.
func bucketPieces(buckets []recset.Bucket) [][]byte {
	var out [][]byte
	for _, b := range buckets {
		out = append(out, b.Chunks...)
	}
	return out
}

// windowFrom returns a window of keep holding snap's retired records and
// then old's (those retired before it was restored), pinned as old is:
// a record past keep that a live job depends on is kept, even when keep
// is shorter than the snapshot's. old's clock carries over; the
// snapshot's, never past now.
func windowFrom(keep time.Duration, old *recset.Window, snap *Snapshot, now time.Time) *recset.Window {
	w := newRetiredWindow(keep)
	w.SetKeep(old.KeepRule())
	clock := snap.Meta.Clock
	if clock.After(now) {
		clock = now // a snapshot of a leader whose clock was ahead
	}
	if err := w.Restore(clock, snap.Meta.Span, snap.retired, bucketPieces(snap.retired), nil); err != nil {
		// DecodeSnapshot checks what Restore does, and a compactor's
		// snapshot is whole by construction.
		panic(fmt.Sprintf("scheduler snapshot's retired records: %v", err))
	}
	for _, b := range old.Buckets() {
		n := w.Rebucket(b.N, old.Span())
		eachRetired(b.Chunks, func(k retiredKey, r retiredJob) {
			var rec [retiredSize]byte
			w.AddIn(n, appendRetired(rec[:0], k, r))
		})
	}
	w.Advance(old.Clock())
	return w
}
