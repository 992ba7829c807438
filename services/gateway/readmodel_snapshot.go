package gateway

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
)

// Snapshots of the read model (issue 17: the gateway's restart with a
// million jobs in JOB_EVENTS ≤ 30 s). The ingester copies the model now
// and then (every Retention.SnapshotInterval, or after snapshotEvery
// events) at the JOB_EVENTS sequence it has folded, and a goroutine of
// its own encodes the copy and writes it to BucketSnapshots in chunks,
// into the slot the head does not name, then switches the head. A
// starting gateway loads it, installs it and follows JOB_EVENTS from the
// sequence after the one it covers. The stream stays the truth: a
// snapshot that is missing, corrupt (its SHA-256 is in the head and at
// its end), truncated, of another schema, ahead of the stream or from
// another life of the stream (created, first sequence) is ignored and the
// stream is read whole (TestUnusableReadModelSnapshotFallsBackToTheLog).
// Every replica writes the same keys: the model is a pure fold of the
// stream, so any replica's snapshot is every replica's; two replicas
// writing at once may spoil a slot, which the checksum then refuses.

// snapshotEvery is how many job events folded since the last snapshot make
// the next one due before its interval.
const snapshotEvery = 200_000

// snapshotMagic starts every encoded snapshot; its version changes with
// the encoding (another version is ignored).
// Version 6: the usage record digests by the day USAGE stored them (the
// duplicate window); a version 5 snapshot is replayed instead, once.
// Version 5: a retired record's end (the list window). Version 4 wrote
// the field as a job sequence in some builds, then 0, so it is not read
// as an end: a gateway replays the log instead, once.
const snapshotMagic = "gpuplane gateway read model 6\n"

// modelSnap is a copy of the read model at JOB_EVENTS sequence seq.
type modelSnap struct {
	seq uint64
	// created and first identify the stream's life the snapshot is of:
	// its creation time (RFC 3339) and first sequence.
	created string
	first   uint64
	live    []*contracts.JobStatus
	retired map[string][]retiredJob // tenant -> records in store order
	// ops are the ops view's last job events (ingester.opsEvents).
	ops []contracts.JobEvent
	// usage is the folded usage (usage_agg.go) of every record USAGE
	// held up to usageSeq at least (records are folded once per ID, so
	// one read again is harmless; 0 when the model keeps the records
	// themselves, which a start then reads whole), and usageCreated,
	// usageFirst that stream's life.
	usageSeq     uint64
	usageCreated string
	usageFirst   uint64
	usage        map[string]*tenantUsage
	usageIDs     usageWindow
	usageCut     int64
}

// snapshotStore is the read model's snapshot in kv: every replica writes
// the same keys, so the head is switched by compare-and-set, and a write
// that would not go further than the head's JOB_EVENTS sequence is
// skipped (another replica got as far). It is written whole, not in parts
// (kvsnap's parts.go): replicas without a lease take turns, and a writer
// reuses only the parts of a head it wrote itself, so parts would save
// nothing, while two racing writers would choose the same free part keys.
func snapshotStore(kv jetstream.KeyValue) kvsnap.Store {
	return kvsnap.Store{KV: kv, HeadKey: contracts.GatewaySnapshotHeadKey(), ChunkKey: contracts.GatewaySnapshotChunkKey,
		CompareAndSet: true}
}

// snapshot copies the model. Statuses are never changed in place (Apply
// works on a copy), so the copy shares them; the retired records are
// copied.
func (m *memoryModel) snapshot(seq uint64) *modelSnap { return m.snapshotWithUsage(seq, 0) }

// snapshotWithUsage is snapshot with the usage records, which cover USAGE
// up to usageSeq (read before the call: every record up to it is in).
func (m *memoryModel) snapshotWithUsage(seq, usageSeq uint64) *modelSnap {
	m.mu.RLock()
	defer m.mu.RUnlock()
	s := &modelSnap{seq: seq, retired: make(map[string][]retiredJob, len(m.retired)), usage: map[string]*tenantUsage{}}
	if a := m.usageAgg; a != nil {
		s.usageSeq, s.usageCut = usageSeq, a.cut
		for tenant, tu := range a.tenants {
			s.usage[tenant] = tu.clone()
		}
		s.usageIDs = a.ids.clone()
	}
	for _, jobs := range m.jobs {
		for _, st := range jobs {
			s.live = append(s.live, st)
		}
	}
	for tenant, rs := range m.retired {
		s.retired[tenant] = rs.records()
	}
	return s
}

// install replaces the model's jobs with the snapshot's. Ended jobs kept
// whole retire in the order they ended: that of their last event.
func (m *memoryModel) install(s *modelSnap) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.jobs = map[string]map[string]*contracts.JobStatus{}
	m.ended, m.endedHead = nil, 0
	m.retired = map[string]*retiredSet{}
	// The list window starts over from the events after the snapshot.
	m.newest, m.pruned = time.Time{}, time.Time{}
	var ended []*contracts.JobStatus
	for _, st := range s.live {
		if m.jobs[st.Tenant] == nil {
			m.jobs[st.Tenant] = map[string]*contracts.JobStatus{}
		}
		m.jobs[st.Tenant][st.JobID] = st
		if endedIndex(st.State) >= 0 {
			ended = append(ended, st)
		}
	}
	slices.SortFunc(ended, func(a, b *contracts.JobStatus) int { return cmpUint(a.LastSeq, b.LastSeq) })
	for _, st := range ended {
		m.ended = append(m.ended, jobKey{st.Tenant, st.JobID})
	}
	if a := m.usageAgg; a != nil {
		a.tenants, a.cut = s.usage, s.usageCut
		// The window is this gateway's: the snapshot's writer may have
		// kept a longer one.
		a.ids = s.usageIDs.clone()
		a.ids.window = a.cfg.DuplicateWindow
		a.ids.merge()
		m.usageSeq.Store(s.usageSeq)
	} else {
		s.usageSeq = 0 // a model keeping the records reads USAGE whole
	}
	n := 0
	for _, recs := range s.retired {
		n += len(recs)
	}
	// The keys sorted at once into one array of their size.
	keys := make([]retiredID, 0, n)
	for tenant, recs := range s.retired {
		size := 0
		for _, r := range recs {
			size += 1 + len(r.id)
		}
		// Decoded records are in store order and in range: each packs.
		rs := &retiredSet{recs: make([]retiredRec, 0, len(recs)), ids: make([]byte, 0, size), sorted: true}
		for _, r := range recs {
			rs.add(r)
			keys = append(keys, retiredKey(tenant, r.id))
		}
		m.retired[tenant] = rs
	}
	slices.SortFunc(keys, cmpDigest)
	m.retiredKeys = usageDigests{sorted: slices.CompactFunc(keys, func(a, b retiredID) bool { return a == b })}
}

func cmpUint(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// counts returns the jobs kept whole and the retired ones (tests, logs).
func (m *memoryModel) counts() (live, retired int) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	for _, jobs := range m.jobs {
		live += len(jobs)
	}
	for _, rs := range m.retired {
		retired += rs.len()
	}
	return live, retired
}

// encode writes s: the magic, the sequences, each live status as JSON,
// each tenant's retired records in binary, and the SHA-256 of all that.
func (s *modelSnap) encode() ([]byte, error) {
	var buf bytes.Buffer
	buf.Grow(64 + len(s.live)*700 + len(s.retired)*64)
	var tmp [binary.MaxVarintLen64]byte
	uv := func(v uint64) { buf.Write(tmp[:binary.PutUvarint(tmp[:], v)]) }
	str := func(v string) { uv(uint64(len(v))); buf.WriteString(v) }
	buf.WriteString(snapshotMagic)
	uv(s.seq)
	uv(s.first)
	str(s.created)
	uv(uint64(len(s.live)))
	for _, st := range s.live {
		data, err := json.Marshal(st)
		if err != nil {
			return nil, fmt.Errorf("job %s/%s: %w", st.Tenant, st.JobID, err)
		}
		uv(uint64(len(data)))
		buf.Write(data)
	}
	uv(uint64(len(s.ops)))
	for _, ev := range s.ops {
		data, err := json.Marshal(ev)
		if err != nil {
			return nil, fmt.Errorf("ops event of job %s/%s: %w", ev.Tenant, ev.JobID, err)
		}
		uv(uint64(len(data)))
		buf.Write(data)
	}
	tenants := slices.Sorted(maps.Keys(s.retired))
	uv(uint64(len(tenants)))
	for _, t := range tenants {
		str(t)
		recs := s.retired[t]
		uv(uint64(len(recs)))
		for _, r := range recs {
			buf.Write(tmp[:binary.PutVarint(tmp[:], r.sec)])
			uv(uint64(r.nsec))
			buf.WriteByte(r.state)
			uv(uint64(r.endMin)) // where version 4 wrote a sequence, then 0

			str(r.id)
		}
	}
	uv(s.usageSeq)
	uv(s.usageFirst)
	str(s.usageCreated)
	s.encodeUsage(&buf)
	sum := sha256.Sum256(buf.Bytes())
	buf.Write(sum[:])
	return buf.Bytes(), nil
}

// errBadSnapshot says a snapshot cannot be decoded.
var errBadSnapshot = errors.New("unusable read model snapshot")

// cursor reads an encoded snapshot; the first error sticks.
type cursor struct {
	b   []byte
	err error
}

func (c *cursor) fail(err error) {
	if c.err == nil {
		c.err = err
	}
}

func (c *cursor) uvarint() uint64 {
	if c.err != nil {
		return 0
	}
	v, n := binary.Uvarint(c.b)
	if n <= 0 {
		c.fail(io.ErrUnexpectedEOF)
		return 0
	}
	c.b = c.b[n:]
	return v
}

func (c *cursor) varint() int64 {
	if c.err != nil {
		return 0
	}
	v, n := binary.Varint(c.b)
	if n <= 0 {
		c.fail(io.ErrUnexpectedEOF)
		return 0
	}
	c.b = c.b[n:]
	return v
}

func (c *cursor) byte1() byte {
	if c.err != nil || len(c.b) == 0 {
		c.fail(io.ErrUnexpectedEOF)
		return 0
	}
	v := c.b[0]
	c.b = c.b[1:]
	return v
}

// bytes returns the next length-prefixed bytes, a slice of the snapshot.
func (c *cursor) bytes() []byte {
	n := c.uvarint()
	if c.err != nil {
		return nil
	}
	if n > uint64(len(c.b)) {
		c.fail(io.ErrUnexpectedEOF)
		return nil
	}
	v := c.b[:n:n]
	c.b = c.b[n:]
	return v
}

// count reads a number of items, each at least one byte long.
func (c *cursor) count() uint64 {
	n := c.uvarint()
	if n > uint64(len(c.b)) {
		c.fail(io.ErrUnexpectedEOF)
		return 0
	}
	return n
}

// decodeModelSnap is encode's inverse; any damage is an errBadSnapshot.
func decodeModelSnap(data []byte) (*modelSnap, error) {
	if len(data) < len(snapshotMagic)+sha256.Size || string(data[:len(snapshotMagic)]) != snapshotMagic {
		return nil, fmt.Errorf("%w: not a snapshot of this version", errBadSnapshot)
	}
	body := data[:len(data)-sha256.Size]
	if sum := sha256.Sum256(body); !bytes.Equal(sum[:], data[len(body):]) {
		return nil, fmt.Errorf("%w: checksum mismatch", errBadSnapshot)
	}
	c := &cursor{b: body[len(snapshotMagic):]}
	s := &modelSnap{retired: map[string][]retiredJob{}, usage: map[string]*tenantUsage{}}
	s.seq, s.first = c.uvarint(), c.uvarint()
	s.created = string(c.bytes())
	for range c.count() {
		data := c.bytes()
		if c.err != nil {
			break
		}
		st := &contracts.JobStatus{}
		if err := json.Unmarshal(data, st); err != nil {
			c.fail(err)
		} else if st.Tenant == "" || st.JobID == "" {
			c.fail(errors.New("a status without tenant or job"))
		}
		s.live = append(s.live, st)
	}
	for range c.count() {
		data := c.bytes()
		if c.err != nil {
			break
		}
		var ev contracts.JobEvent
		c.fail(json.Unmarshal(data, &ev))
		s.ops = append(s.ops, ev)
	}
	for range c.count() {
		tenant := string(c.bytes())
		n := c.count()
		recs := make([]retiredJob, 0, n)
		for range n {
			rec := retiredJob{sec: c.varint(), nsec: int32(c.uvarint()), state: c.byte1()}
			end := c.uvarint()
			rec.endMin = uint32(min(end, maxEndMin+1))
			rec.id = string(c.bytes())
			if c.err != nil {
				break
			}
			if !rec.packs() {
				c.fail(errors.New("a retired record out of range"))
			}
			recs = append(recs, rec)
		}
		if c.err == nil && !slices.IsSortedFunc(recs, storeOrder) {
			c.fail(errors.New("retired records out of order"))
		}
		s.retired[tenant] = recs
	}
	s.usageSeq, s.usageFirst = c.uvarint(), c.uvarint()
	s.usageCreated = string(c.bytes())
	s.decodeUsage(c)
	if c.err == nil && len(c.b) > 0 {
		c.fail(errors.New("trailing bytes"))
	}
	if c.err != nil {
		return nil, fmt.Errorf("%w: %w", errBadSnapshot, c.err)
	}
	return s, nil
}

// modelSnapshotter writes the snapshots the ingester takes, one at a
// time, never holding up the ingester: a snapshot taken while the last is
// being written is dropped (the next one comes).
type modelSnapshotter struct {
	bus      *bus.Bus
	log      *slog.Logger
	interval time.Duration
	// pending takes the next snapshot to write (capacity 1).
	pending chan *modelSnap
	// taken and since are the ingester's: when the last snapshot was
	// taken, and events folded since.
	taken time.Time
	since int
	// written, if set, is called after each snapshot is written (tests).
	written func(kvsnap.Head)
}

func newModelSnapshotter(b *bus.Bus, interval time.Duration, log *slog.Logger) *modelSnapshotter {
	return &modelSnapshotter{bus: b, log: log, interval: interval, pending: make(chan *modelSnap, 1), taken: time.Now()}
}

// due reports whether a snapshot should be taken now (the ingester's
// goroutine calls it after each event folded).
func (sn *modelSnapshotter) due(now time.Time) bool {
	if sn == nil || sn.interval < 0 {
		return false
	}
	sn.since++
	return sn.since >= snapshotEvery || now.Sub(sn.taken) >= sn.interval
}

// offer hands s to the writer, or drops it when one is being written.
func (sn *modelSnapshotter) offer(s *modelSnap, now time.Time) {
	sn.taken, sn.since = now, 0
	select {
	case sn.pending <- s:
	default:
	}
}

// run writes the snapshots offered until ctx ends.
func (sn *modelSnapshotter) run(ctx context.Context) error {
	if sn == nil || sn.interval < 0 {
		return nil
	}
	var kv jetstream.KeyValue
	for {
		var s *modelSnap
		select {
		case <-ctx.Done():
			return nil
		case s = <-sn.pending:
		}
		if kv == nil {
			var err error
			if kv, err = sn.bus.KeyValue(ctx, contracts.BucketSnapshots); err != nil {
				sn.log.Warn("read model snapshot not written", "err", err)
				continue
			}
		}
		if err := sn.write(ctx, kv, s); err != nil && ctx.Err() == nil {
			sn.log.Warn("read model snapshot not written; the next one will be", "err", err)
		}
	}
}

// write encodes s into the slot the head does not name, then switches the
// head (only if no one switched it meanwhile).
func (sn *modelSnapshotter) write(ctx context.Context, kv jetstream.KeyValue, s *modelSnap) error {
	start := time.Now()
	lives, err := kvsnap.Lives(ctx, sn.bus.JetStream(), contracts.StreamJobEvents, contracts.StreamUsage)
	if err != nil {
		return err
	}
	ev, usage := lives[contracts.StreamJobEvents], lives[contracts.StreamUsage]
	s.created, s.first = ev.Created, ev.First
	s.usageCreated, s.usageFirst = usage.Created, usage.First
	head, err := snapshotStore(kv).Write(ctx, s.seq, s.encode)
	if errors.Is(err, kvsnap.ErrSuperseded) {
		sn.log.Debug("read model snapshot not written", "seq", s.seq, "why", err)
		return nil
	}
	if err != nil {
		return err
	}
	retired := 0
	for _, recs := range s.retired {
		retired += len(recs)
	}
	sn.log.Info("read model snapshot written", "seq", s.seq, "bytes", head.Bytes, "put_bytes", head.Put, "parts", head.Chunks, "live_jobs", len(s.live),
		"retired_jobs", retired, "took", time.Since(start))
	if sn.written != nil {
		sn.written(head)
	}
	return nil
}

// loadModelSnapshot reads the snapshot and checks it against JOB_EVENTS
// and USAGE as they are; an error says why it cannot be used (the stream
// is then read from its beginning).
func loadModelSnapshot(ctx context.Context, b *bus.Bus) (*modelSnap, error) {
	kv, err := b.KeyValue(ctx, contracts.BucketSnapshots)
	if err != nil {
		return nil, fmt.Errorf("bucket %s: %w", contracts.BucketSnapshots, err)
	}
	data, _, err := snapshotStore(kv).Read(ctx)
	if err != nil {
		return nil, err
	}
	s, err := decodeModelSnap(data)
	if err != nil {
		return nil, err
	}
	lives, err := kvsnap.Lives(ctx, b.JetStream(), contracts.StreamJobEvents, contracts.StreamUsage)
	if err != nil {
		return nil, err
	}
	ev, usage := lives[contracts.StreamJobEvents], lives[contracts.StreamUsage]
	if err := kvsnap.Stale(contracts.StreamJobEvents, ev, s.created, s.seq); err != nil {
		return nil, err
	}
	if s.first != ev.First {
		return nil, fmt.Errorf("%w: %s starts at %d, the snapshot's at %d", kvsnap.ErrStale, contracts.StreamJobEvents, ev.First, s.first)
	}
	if s.usageCreated != usage.Created || s.usageFirst != usage.First || s.usageSeq > usage.Last {
		return nil, fmt.Errorf("%w: %s created at %s, from %d to %d; the snapshot's created at %s, from %d, covering up to %d",
			kvsnap.ErrStale, contracts.StreamUsage, usage.Created, usage.First, usage.Last, s.usageCreated, s.usageFirst, s.usageSeq)
	}
	return s, nil
}
