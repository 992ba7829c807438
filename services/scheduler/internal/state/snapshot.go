package state

import (
	"bufio"
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"

	segjson "github.com/segmentio/encoding/json"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/recset"
)

// A snapshot is the scheduler's log of record compacted: for each stream
// the scheduler rebuilds from, the sequence it covers and those of its
// messages that still matter, plus the records of retired jobs. A rebuild
// from it replays those messages with the same code as a full replay,
// installs the records, and then replays each stream from the sequence
// after the one covered: the log stays the truth, the snapshot only skips
// what it proves cannot change the rebuilt state.
//
// What it drops: every message about a job that ended (in JOB_EVENTS) and
// whose allocations are all released (in ALLOCATIONS) once the job is
// closed: its events, cancels, ledger entries, refusals and run facts.
// Each is a no-op on a store where the job ended (Transition refuses
// events after an end, facts about an ended job change only the cluster,
// where the commits and releases of its allocations cancel out), and a
// retired job's record answers what a whole ended job did. A plan is
// dropped once none of its items' jobs is open. Of a run of a live job's
// pending events only the highest and the last are kept (pendingRun).
// Everything else is kept.

// SnapshotSchema is the version of the snapshot's encoding and of the
// rules above; a snapshot of another version is ignored.
//
// 2: retired records are kept in a window (Config.RememberEnded), by
// bucket, with its clock and span; a queued job's dependencies' records
// are pinned.
const SnapshotSchema = 2

// LogMsg is one message of a stream, as a snapshot keeps it.
type LogMsg struct {
	Stream  string
	Seq     uint64
	Subject string
	Header  map[string][]string
	Data    []byte
}

// SnapshotMeta describes a snapshot: whose it is and what it covers.
type SnapshotMeta struct {
	Schema    int    `json:"schema"`
	Scheduler string `json:"scheduler"`
	// Seqs is the last sequence covered per stream; Created each stream's
	// creation time (RFC 3339), so one recreated since is noticed.
	Seqs    map[string]uint64 `json:"seqs"`
	Created map[string]string `json:"created"`
	Jobs    int               `json:"jobs"`
	Retired int               `json:"retired"`
	Msgs    int               `json:"msgs"`
	// Clock and Span are the retired records' window's (recset.Window);
	// Forgot is set once that window forgot a record, so a store
	// restored from it reads the log for a job it does not hold
	// (Store.Forgetting).
	Clock  time.Time `json:"clock"`
	Span   int64     `json:"span"`
	Forgot bool      `json:"forgot,omitempty"`
}

// Snapshot is a decoded snapshot.
type Snapshot struct {
	Meta SnapshotMeta
	Msgs []*LogMsg // by stream, then sequence (a decoded snapshot)
	// recs are a compactor's snapshot's messages, each as Encode writes
	// one (encodeMsg), by stream then sequence; Encode writes them as
	// they are. Msgs is nil then.
	recs [][]byte
	// retired are the retired jobs' records (retiredSize bytes each) by
	// bucket of their window (Meta.Clock, Meta.Span): views of the
	// compactor's chunks, which it only appends to, or pieces of a
	// decoded snapshot.
	retired []recset.Bucket
	why     map[retiredKey]contracts.Reason
	work    workload
}

// cjob is an open job of a Compactor.
type cjob struct {
	// msgs are the job's messages, each encoded as a snapshot writes it
	// (encodeMsg): the exact bytes and one slice header each. Keeping the
	// *LogMsg instead held nats.go's read buffer of each message (its
	// headers and reply subject too), a header map and the record: about
	// 10 KB per live job in a whole-platform run (issue 17), twice what
	// the bytes are.
	msgs [][]byte
	// run is the run of pending events the job is in: a waiting job
	// publishes one a minute for as long as it waits (more when its
	// reason changes), and of a run only two matter (runPending).
	run pendingRun
	// seen is set once a JOB_EVENTS event of the job was read: until then
	// (facts and cancels may be read first) it is not known to be ours.
	seen      bool
	state     contracts.JobState
	attempt   int
	hash      [sha256.Size]byte
	rejection *rejection
	// open are the committed allocations not released yet.
	open map[string]bool
	// endAt is when its terminal event was published: its record's time.
	endAt time.Time
	// deps are the records it pins while it lives (its dependsOn).
	deps []retiredKey
	// mine is set when one of its allocations is (or may be: no name)
	// this scheduler's, foreign when one names another scheduler. A job
	// only foreign, never seen in our events, is closed once its
	// allocations are all released: no event of ours will ever end it.
	mine, foreign bool
}

// decodeMsg decodes the fields the compactor reads from a message's body.
// It is the bus's decoder (bus.Msg.Decode: github.com/segmentio/encoding/json,
// held to encoding/json on every contract type by libs/bus's
// decode_compat_test), so the compactor reads each message as the store
// that applies it does, at about a third of encoding/json's CPU: the
// compactor follows every JOB_EVENTS, ALLOCATIONS and RUNS message beside
// the live scheduler, and its decoding was 4 % of a burst's CPU
// (BenchmarkBurst R1, issue 17). A variable so that a test and a benchmark
// can set encoding/json beside it.
var decodeMsg = segjson.Unmarshal

// Compactor folds the streams' messages into what a snapshot keeps. Not
// safe for concurrent use.
type Compactor struct {
	scheduler string
	seqs      map[string]uint64
	jobs      map[string]*cjob
	plans     []*planMsg
	retired   *recset.Window // retiredSize records (Snapshot shares their chunks)
	why       map[retiredKey]contracts.Reason
	swept     int                  // retired.Forgotten when why was last swept
	pins      map[retiredKey]int32 // as the store's (retention.pins)
	forgot    bool                 // the snapshot it went on from had forgotten
	work      workload
	// now bounds the times the window is moved to (time.Now): an event
	// dated ahead (a leader's clock off) must not make it forget early.
	now func() time.Time
}

// jobRef is the job a message is about (refusals, run facts, plan items
// and allocations all name it so).
type jobRef struct {
	Tenant string `json:"tenant"`
	JobID  string `json:"jobId"`
}

type planMsg struct {
	rec  []byte // encodeMsg
	keys []string
}

// NewCompactor returns an empty compactor for scheduler, keeping retired
// records for keep after their end (Config.RememberEnded), or one that
// goes on from snap when it is not nil.
func NewCompactor(scheduler string, keep time.Duration, snap *Snapshot) *Compactor {
	return newCompactor(scheduler, keep, snap, time.Now)
}

// newCompactor is NewCompactor with its clock (tests).
func newCompactor(scheduler string, keep time.Duration, snap *Snapshot, now func() time.Time) *Compactor {
	c := &Compactor{scheduler: scheduler, seqs: map[string]uint64{}, jobs: map[string]*cjob{},
		retired: newRetiredWindow(keep), why: map[retiredKey]contracts.Reason{}, pins: map[retiredKey]int32{},
		now: now}
	c.retired.SetKeep(func(rec []byte) bool { return c.pins[retiredKey(rec[:16])] > 0 })
	if snap == nil {
		return c
	}
	for k, v := range snap.why {
		c.why[k] = v
	}
	c.work = workload{reqs: slices.Clone(snap.work.reqs), next: snap.work.next}
	for _, m := range snap.Msgs {
		c.Observe(m)
	}
	// After its messages: they pin what its live jobs depend on, which
	// the records read back must keep, whatever keep is now.
	c.forgot = snap.Meta.Forgot || c.retired.Forgotten() > 0
	c.retired = windowFrom(keep, c.retired, snap, c.now())
	// After its messages, which Observe would otherwise take as read.
	for k, v := range snap.Meta.Seqs {
		c.seqs[k] = max(c.seqs[k], v)
	}
	return c
}

// Seqs returns the last sequence observed per stream.
func (c *Compactor) Seqs() map[string]uint64 {
	out := make(map[string]uint64, len(c.seqs))
	for k, v := range c.seqs {
		out[k] = v
	}
	return out
}

// Open is the number of open jobs (whose messages are kept).
func (c *Compactor) Open() int { return len(c.jobs) }

func (c *Compactor) job(key string) *cjob {
	j := c.jobs[key]
	if j == nil {
		j = &cjob{state: contracts.StateNew, open: map[string]bool{}}
		c.jobs[key] = j
	}
	return j
}

// Observe folds one message in. Messages of one stream must come in
// stream order; streams may interleave in any way.
func (c *Compactor) Observe(m *LogMsg) {
	if m.Seq <= c.seqs[m.Stream] {
		// Read already (one follow per stream, in order): folding it again
		// would count it twice in its job's run of pending events.
		return
	}
	c.seqs[m.Stream] = m.Seq
	switch m.Stream {
	case contracts.StreamJobEvents:
		c.event(m)
	case contracts.StreamJobs:
		tenant, err := contracts.TenantFromSubject(m.Subject)
		if err != nil {
			return
		}
		cr, err := contracts.DecodeCancelRequest(m.Data)
		if err != nil {
			return
		}
		c.fact(Key(tenant, cr.JobID), m, "", "", "")
	case contracts.StreamPlans:
		var p struct{ Items []jobRef }
		if decodeMsg(m.Data, &p) != nil {
			return
		}
		pm := &planMsg{rec: encodeMsg(m)}
		for _, it := range p.Items {
			pm.keys = append(pm.keys, Key(it.Tenant, it.JobID))
		}
		c.plans = append(c.plans, pm)
	case contracts.StreamAllocations:
		switch {
		case strings.HasPrefix(m.Subject, "gp.alloc.ledger."):
			// Only the fields the compactor reads: a ledger entry carries a
			// whole allocation, and this runs beside the rebuild.
			var e struct {
				Kind       contracts.LedgerKind
				Allocation struct {
					jobRef
					ID, Scheduler string
				}
			}
			if decodeMsg(m.Data, &e) != nil {
				return
			}
			a := e.Allocation
			c.fact(Key(a.Tenant, a.JobID), m, e.Kind, a.ID, a.Scheduler)
		case strings.HasPrefix(m.Subject, "gp.alloc.refused."):
			var r jobRef
			if decodeMsg(m.Data, &r) != nil {
				return
			}
			c.fact(Key(r.Tenant, r.JobID), m, "", "", "")
		}
	case contracts.StreamRuns:
		var r jobRef
		if decodeMsg(m.Data, &r) != nil {
			return
		}
		c.fact(Key(r.Tenant, r.JobID), m, "", "", "")
	}
}

func (c *Compactor) event(m *LogMsg) {
	var ev struct {
		Type          contracts.JobEventType `json:"type"`
		Tenant, JobID string
		Attempt       int
		Time          time.Time
		Reason        contracts.Reason
		Errors        []contracts.FieldError
		// Request (queued only) is decoded on its own, into maps made
		// beforehand (decodeRequest).
		Request json.RawMessage
	}
	if decodeMsg(m.Data, &ev) != nil {
		return
	}
	var req *contracts.JobRequest
	if len(ev.Request) > 0 && string(ev.Request) != "null" {
		if req = decodeRequest(ev.Request); req == nil {
			return // the event does not decode whole: ignored, as the store does
		}
	}
	key := Key(ev.Tenant, ev.JobID)
	c.retired.Advance(c.notAhead(ev.Time))
	if old := c.jobs[key]; (old == nil || !old.seen) && (c.isRetired(key) || (contracts.JobEvent{Type: ev.Type, Reason: ev.Reason}).AnswersDuplicate()) {
		// No event applies to an ended job, and a duplicate_job_id answer
		// never makes one (as Store.ReplayJobEvent).
		return
	}
	j := c.job(key)
	j.seen = true
	to, err := contracts.Transition(j.state, ev.Type)
	if err != nil {
		j.msgs, j.run = append(j.msgs, encodeMsg(m)), pendingRun{}
		return
	}
	if ev.Type == contracts.EventPending && decodesWhole(m.Data) {
		j.runPending(m, ev.Attempt)
	} else {
		j.msgs, j.run = append(j.msgs, encodeMsg(m)), pendingRun{}
	}
	j.state = to
	if to.Terminal() {
		j.endAt = ev.Time
	}
	switch ev.Type {
	case contracts.EventQueued:
		if req != nil {
			j.hash, j.attempt = hashRequest(*req), max(ev.Attempt, 1)
			c.work.add(req.Resources.GPU)
			for _, d := range req.DependsOn {
				k := retiredKeyOf(Key(ev.Tenant, d))
				j.deps = append(j.deps, k)
				c.pins[k]++
			}
		}
	case contracts.EventRejected:
		j.rejection = &rejection{reason: ev.Reason, errors: ev.Errors}
	case contracts.EventRequeued:
		j.attempt = ev.Attempt
	}
	c.close(key, j)
}

// pendingRun is a run of a job's pending events: of one attempt, with
// IDs that carry their sequence, and no other event of the job between
// them. Replayed (Store.ReplayJobEvent), each of a run sets the reason
// published and when, which the last one sets again, and raises the
// job's pending sequence to its own, which the highest one does too:
// every event of a run is applied or none is (the job's state and
// attempt change only by its other events, which end the run). So a run
// keeps two events, the highest (top) and the last (last; 0 when the top
// is the last), and a snapshot replays to what the whole log does.
// Indexes are into the job's msgs, plus one; top is 0 outside a run.
type pendingRun struct {
	top, last int
	attempt   int
	topSeq    int
}

// decodesWhole reports whether data decodes as a whole job event, as the
// rebuild decodes each (bus.Msg.Decode): one that does not is skipped by
// every replay, so it must not take the place of one of its run that a
// replay applies. Only pending events pay for it (the compactor reads
// the few fields it needs of the others).
func decodesWhole(data []byte) bool {
	var ev contracts.JobEvent
	return decodeMsg(data, &ev) == nil
}

// runPending keeps m, a pending event of attempt that its job's state
// machine accepts, as its run allows.
func (j *cjob) runPending(m *LogMsg, attempt int) {
	var seq int
	if ids := m.Header[contracts.HeaderMsgID]; len(ids) == 1 {
		seq = pendingSeqOf(ids[0])
	}
	r := &j.run
	switch {
	case seq <= 0:
		// No sequence to compare (not written by this code): kept, and
		// no run around it.
		j.msgs, j.run = append(j.msgs, encodeMsg(m)), pendingRun{}
	case r.top == 0 || r.attempt != attempt:
		j.msgs = append(j.msgs, encodeMsg(m))
		j.run = pendingRun{top: len(j.msgs), attempt: attempt, topSeq: seq}
	case seq >= r.topSeq:
		// The highest and the last: it takes the top's place, and the
		// last before it goes (it is the job's last message of JOB_EVENTS,
		// and after the top, so no index kept moves).
		j.msgs[r.top-1], r.topSeq = encodeMsg(m), seq
		if r.last != 0 {
			j.msgs = slices.Delete(j.msgs, r.last-1, r.last)
			r.last = 0
		}
	case r.last != 0:
		j.msgs[r.last-1] = encodeMsg(m)
	default:
		j.msgs = append(j.msgs, encodeMsg(m))
		r.last = len(j.msgs)
	}
}

// decodeRequest decodes a queued event's request, nil when it does not
// decode. Its maps are made empty beforehand: segmentio's decoder makes a
// map it has to create with room for 64 entries (~4.6 KB for each of
// labels, node selector and environment, twice encoding/json's bytes per
// labelled job in BenchmarkCompactorObserve) and fills one it is given.
// An empty map is what a nil one is to hashRequest (omitempty), the only
// reader of the request besides its GPU.
func decodeRequest(data []byte) *contracts.JobRequest {
	req := &contracts.JobRequest{Labels: map[string]string{}, NodeSelector: map[string]string{},
		Run: contracts.RunSpec{Env: map[string]string{}}}
	if decodeMsg(data, req) != nil {
		return nil
	}
	return req
}

// fact folds a message about a job other than its events: a cancel, a
// ledger entry (kind, allocation and scheduler set), a refusal or a run
// fact.
func (c *Compactor) fact(key string, m *LogMsg, kind contracts.LedgerKind, alloc, scheduler string) {
	j := c.jobs[key]
	if j == nil {
		if c.isRetired(key) && kind != contracts.LedgerCommitted {
			return // about an ended job, and holds nothing
		}
		j = c.job(key)
		if c.isRetired(key) {
			// A commit after the end (a plan whose outcome came late): the
			// cluster holds its devices until its release.
			j.seen, j.state = true, contracts.StateSucceeded
		}
	}
	j.msgs = append(j.msgs, encodeMsg(m))
	switch kind {
	case contracts.LedgerCommitted:
		j.open[alloc] = true
		if scheduler == c.scheduler || scheduler == "" {
			j.mine = true
		} else {
			j.foreign = true
		}
	case contracts.LedgerReleased:
		delete(j.open, alloc)
	}
	c.close(key, j)
}

// close forgets the job's messages when nothing of it is left to apply:
// it ended and holds no allocation (retired), or it is another
// scheduler's and holds none.
func (c *Compactor) close(key string, j *cjob) {
	if len(j.open) > 0 {
		return
	}
	switch {
	case j.seen && j.state.Terminal():
		k := retiredKeyOf(key)
		if !c.retired.Has(k[:]) {
			rec := retiredJob{hash: hash64(j.hash), attempt: uint32(max(j.attempt, 0)), state: stateCode(j.state)}
			if j.rejection != nil {
				rec.hash = hash64(rejectionHash(j.rejection.reason, j.rejection.errors))
			}
			var b [retiredSize]byte
			if c.retired.Add(appendRetired(b[:0], k, rec), c.notAhead(j.endAt)) && j.rejection != nil {
				c.why[k] = j.rejection.reason
			}
		}
		c.drop(key, j)
	case !j.seen && j.foreign && !j.mine:
		c.drop(key, j) // another scheduler's job, all released
	}
}

// notAhead is t, or now if t is later.
func (c *Compactor) notAhead(t time.Time) time.Time {
	if now := c.now(); t.After(now) {
		return now
	}
	return t
}

// drop forgets the closed job j and unpins what it depended on.
func (c *Compactor) drop(key string, j *cjob) {
	for _, k := range j.deps {
		if c.pins[k]--; c.pins[k] <= 0 {
			delete(c.pins, k)
		}
	}
	delete(c.jobs, key)
}

// isRetired reports whether the job with store key key is retired.
func (c *Compactor) isRetired(key string) bool {
	k := retiredKeyOf(key)
	return c.retired.Has(k[:])
}

// Snapshot returns what the compactor holds as a snapshot: a copy, which
// another goroutine may encode while the compactor goes on (the messages
// are shared; they are never changed).
func (c *Compactor) Snapshot() *Snapshot {
	if f := c.retired.Forgotten(); f != c.swept {
		c.swept = f
		for k := range c.why {
			if !c.retired.Has(k[:]) {
				delete(c.why, k)
			}
		}
	}
	s := &Snapshot{Meta: SnapshotMeta{Schema: SnapshotSchema, Scheduler: c.scheduler, Seqs: c.Seqs(),
		Jobs: len(c.jobs), Retired: c.retired.Len(), Clock: c.retired.Clock(), Span: c.retired.Span(),
		Forgot: c.forgot || c.retired.Forgotten() > 0},
		retired: c.retired.Buckets(), why: maps.Clone(c.why), work: workload{reqs: slices.Clone(c.work.reqs), next: c.work.next}}
	var recs []keyedRec
	for _, j := range c.jobs {
		for _, r := range j.msgs {
			recs = append(recs, keyRec(r))
		}
	}
	live := c.plans[:0]
	for _, p := range c.plans {
		// Kept unless every item's job is retired (a job not seen yet
		// may be one whose events are read later).
		for _, k := range p.keys {
			if !c.isRetired(k) || c.jobs[k] != nil {
				live = append(live, p)
				recs = append(recs, keyRec(p.rec))
				break
			}
		}
	}
	clear(c.plans[len(live):])
	c.plans = live
	slices.SortFunc(recs, func(a, b keyedRec) int {
		if c := bytes.Compare(a.stream, b.stream); c != 0 {
			return c
		}
		return cmp.Compare(a.seq, b.seq)
	})
	recs = slices.CompactFunc(recs, func(a, b keyedRec) bool { return bytes.Equal(a.stream, b.stream) && a.seq == b.seq })
	s.recs = make([][]byte, len(recs))
	for i, r := range recs {
		s.recs[i] = r.rec
	}
	s.Meta.Msgs = len(s.recs)
	return s
}

// encodeMsg encodes m as a snapshot writes a message: its stream,
// sequence, subject, headers and body, in one allocation of exactly their
// size (the compactor keeps it for as long as the job lives).
func encodeMsg(m *LogMsg) []byte {
	strLen := func(v string) int { return uvarintLen(uint64(len(v))) + len(v) }
	n := strLen(m.Stream) + uvarintLen(m.Seq) + strLen(m.Subject) + uvarintLen(uint64(len(m.Header))) +
		uvarintLen(uint64(len(m.Data))) + len(m.Data)
	for k, vs := range m.Header {
		n += strLen(k) + uvarintLen(uint64(len(vs)))
		for _, v := range vs {
			n += strLen(v)
		}
	}
	b := make([]byte, 0, n)
	str := func(v string) { b = binary.AppendUvarint(b, uint64(len(v))); b = append(b, v...) }
	str(m.Stream)
	b = binary.AppendUvarint(b, m.Seq)
	str(m.Subject)
	b = binary.AppendUvarint(b, uint64(len(m.Header)))
	for k, vs := range m.Header {
		str(k)
		b = binary.AppendUvarint(b, uint64(len(vs)))
		for _, v := range vs {
			str(v)
		}
	}
	b = binary.AppendUvarint(b, uint64(len(m.Data)))
	return append(b, m.Data...)
}

// uvarintLen is the length of v as binary.AppendUvarint writes it.
func uvarintLen(v uint64) int {
	n := 1
	for ; v >= 0x80; v >>= 7 {
		n++
	}
	return n
}

// keyedRec is an encoded message with the stream and sequence it is
// sorted by (the stream a view into the record, not a copy).
type keyedRec struct {
	stream []byte
	seq    uint64
	rec    []byte
}

func keyRec(rec []byte) keyedRec {
	d := &decoder{b: rec}
	return keyedRec{stream: d.bytes(), seq: d.uv(), rec: rec}
}

// msg reads one message that encodeMsg wrote (as a snapshot holds them).
func (d *decoder) msg() *LogMsg {
	m := &LogMsg{Stream: d.str(), Seq: d.uv(), Subject: d.str()}
	if nh := d.count(); nh > 0 {
		m.Header = make(map[string][]string, nh)
		for range nh {
			k := d.str()
			vs := make([]string, d.count())
			for i := range vs {
				vs[i] = d.str()
			}
			m.Header[k] = vs
		}
	}
	m.Data = d.bytes()
	return m
}

// Restore installs a snapshot's retired jobs and workload into s. Call
// it after the snapshot's JOB_EVENTS messages were replayed (they pin
// what its live jobs depend on) and before the stream's tail is.
func (s *Store) Restore(snap *Snapshot) {
	r := s.retention()
	r.forgotBefore = r.forgotBefore || snap.Meta.Forgot || r.retired.Forgotten() > 0
	r.retired = windowFrom(s.cfg.RememberEnded, r.retired, snap, s.cfg.Now())
	r.swept = -1 // sweep why at the next retirement
	for k, v := range snap.why {
		r.why[k] = v
	}
	s.workload = workload{reqs: slices.Clone(snap.work.reqs), next: snap.work.next}
}

// ---- encoding ----

var snapshotMagic = []byte("gpuplane-scheduler-snapshot\n")

// Encode writes the snapshot: a magic line, its meta as JSON, the
// messages, the retired records and the workload, then the SHA-256 of
// all that.
func (s *Snapshot) Encode(w io.Writer) error {
	h := sha256.New()
	bw := bufio.NewWriterSize(io.MultiWriter(w, h), 1<<16)
	var scratch [binary.MaxVarintLen64]byte
	uv := func(v uint64) { bw.Write(scratch[:binary.PutUvarint(scratch[:], v)]) }
	bytes := func(b []byte) { uv(uint64(len(b))); bw.Write(b) }
	str := func(v string) { uv(uint64(len(v))); bw.WriteString(v) }
	bw.Write(snapshotMagic)
	meta, err := json.Marshal(s.Meta)
	if err != nil {
		return err
	}
	bytes(meta)
	if s.recs != nil {
		uv(uint64(len(s.recs)))
		for _, r := range s.recs {
			bw.Write(r)
		}
	} else {
		uv(uint64(len(s.Msgs)))
		for _, m := range s.Msgs {
			bw.Write(encodeMsg(m))
		}
	}
	uv(uint64(len(s.retired)))
	for _, b := range s.retired {
		uv(uint64(b.N))
		uv(uint64(b.Records))
	}
	eachRetired(bucketPieces(s.retired), func(k retiredKey, v retiredJob) {
		bw.Write(k[:])
		uv(v.hash)
		uv(uint64(v.attempt))
		bw.WriteByte(v.state)
		str(string(s.why[k]))
	})
	work, err := json.Marshal(s.work.reqs)
	if err != nil {
		return err
	}
	bytes(work)
	uv(uint64(s.work.next))
	if err := bw.Flush(); err != nil {
		return err
	}
	_, err = w.Write(h.Sum(nil))
	return err
}

// ErrBadSnapshot says a snapshot cannot be used: corrupt, truncated, or
// of another schema.
var ErrBadSnapshot = errors.New("unusable snapshot")

// DecodeSnapshot reads what Encode wrote, checking its hash and schema.
func DecodeSnapshot(data []byte) (*Snapshot, error) {
	if len(data) < sha256.Size+len(snapshotMagic) {
		return nil, fmt.Errorf("%w: %d bytes", ErrBadSnapshot, len(data))
	}
	body, sum := data[:len(data)-sha256.Size], data[len(data)-sha256.Size:]
	if got := sha256.Sum256(body); string(got[:]) != string(sum) {
		return nil, fmt.Errorf("%w: checksum mismatch", ErrBadSnapshot)
	}
	if string(body[:len(snapshotMagic)]) != string(snapshotMagic) {
		return nil, fmt.Errorf("%w: not a scheduler snapshot", ErrBadSnapshot)
	}
	d := &decoder{b: body[len(snapshotMagic):]}
	s := &Snapshot{why: map[retiredKey]contracts.Reason{}}
	if err := json.Unmarshal(d.bytes(), &s.Meta); err != nil {
		return nil, fmt.Errorf("%w: meta: %w", ErrBadSnapshot, err)
	}
	if s.Meta.Schema != SnapshotSchema {
		return nil, fmt.Errorf("%w: schema %d, want %d", ErrBadSnapshot, s.Meta.Schema, SnapshotSchema)
	}
	n := d.count()
	s.Msgs = make([]*LogMsg, 0, n)
	for range n {
		s.Msgs = append(s.Msgs, d.msg())
	}
	nb := d.count()
	s.retired = make([]recset.Bucket, 0, nb)
	total := 0
	for i := range nb {
		b := recset.Bucket{N: int64(d.uv()), Records: d.count()}
		if i > 0 && b.N <= s.retired[i-1].N {
			d.err = errors.New("retired buckets out of order")
		}
		total += b.Records
		s.retired = append(s.retired, b)
	}
	if total > 0 && s.Meta.Span <= 0 {
		d.err = errors.New("retired records without their window's span")
	}
	var retired []byte
	for i := 0; i < total && d.err == nil; i++ {
		var k retiredKey
		copy(k[:], d.take(len(k)))
		rec := retiredJob{hash: d.uv(), attempt: uint32(d.uv())}
		if st := d.take(1); len(st) == 1 {
			rec.state = st[0]
		}
		if int(rec.state) >= len(terminalStates) {
			d.err = errors.New("bad state")
		}
		if why := d.str(); why != "" {
			s.why[k] = contracts.Reason(why)
		}
		retired = appendRetired(retired, k, rec)
	}
	if len(s.retired) > 0 {
		// The buckets' records, in order, as one piece: every reader goes
		// through bucketPieces, which does not care which bucket holds a
		// piece.
		s.retired[0].Chunks = [][]byte{retired}
	}
	if err := json.Unmarshal(d.bytes(), &s.work.reqs); err != nil && d.err == nil {
		d.err = err
	}
	s.work.next = int(d.uv())
	if d.err == nil && len(d.b) != 0 {
		d.err = fmt.Errorf("%d bytes left over", len(d.b))
	}
	if d.err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadSnapshot, d.err)
	}
	return s, nil
}

type decoder struct {
	b   []byte
	err error
}

func (d *decoder) uv() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.err = errors.New("truncated")
		return 0
	}
	d.b = d.b[n:]
	return v
}

// count reads a length, bounded by what is left (a corrupt count must not
// allocate gigabytes).
func (d *decoder) count() int {
	v := d.uv()
	if v > uint64(len(d.b)) {
		if d.err == nil {
			d.err = errors.New("count past the end")
		}
		return 0
	}
	return int(v)
}

func (d *decoder) take(n int) []byte {
	if d.err != nil {
		return nil
	}
	if n > len(d.b) {
		d.err = errors.New("truncated")
		return nil
	}
	out := d.b[:n:n]
	d.b = d.b[n:]
	return out
}

func (d *decoder) bytes() []byte { return d.take(d.count()) }
func (d *decoder) str() string   { return string(d.bytes()) }
