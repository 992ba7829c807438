package scheduler

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

// Snapshots (issue 17: restart with a million jobs in the streams ≤ 30 s).
// The leader folds every message of the streams it rebuilds from into a
// state.Compactor (the messages the rebuild and its follows apply, then
// its own follows of JOB_EVENTS, the cancels in JOBS and its PLANS) and
// every SnapshotInterval writes what it holds to BucketSnapshots. A new
// leader loads it, replays its messages with the rebuild's own code, and
// replays each stream from the sequence after the one the snapshot
// covers. The streams stay the truth: a snapshot that is missing,
// corrupt, of another schema, of another scheduler, ahead of a stream or
// from before a stream was recreated is ignored, and the rebuild reads
// the streams whole (the compactor then starts empty).

// snapshotStreams are the streams a snapshot covers, in rebuild order.
var snapshotStreams = []string{contracts.StreamJobEvents, contracts.StreamJobs, contracts.StreamPlans,
	contracts.StreamAllocations, contracts.StreamRuns}

// snapshotEvery is how many messages folded since the last snapshot make
// the next one due before its interval.
const snapshotEvery = 200_000

// snapshotChunk is the most snapshot bytes in one KV value (the bucket's
// values are at most contracts.MaxMessageBytes, headers included).
const snapshotChunk = contracts.MaxMessageBytes - 4096

// snapshotHead is the value of contracts.SnapshotHeadKey.
type snapshotHead struct {
	Slot    int       `json:"slot"`
	Chunks  int       `json:"chunks"`
	Bytes   int       `json:"bytes"`
	Written time.Time `json:"written"`
}

// keptHeaders are the headers a snapshot keeps of each message: the ID
// (pending events' sequence, rejected events' dedup) and the trace
// context (a live job's trace continues after a restart).
var keptHeaders = []string{contracts.HeaderMsgID, "traceparent", "tracestate"}

func logMsg(m *bus.Msg) *state.LogMsg {
	lm := &state.LogMsg{Stream: m.Stream, Seq: m.StreamSeq, Subject: m.Subject, Data: m.Data}
	for _, h := range keptHeaders {
		if v := m.Header.Values(h); len(v) > 0 {
			if lm.Header == nil {
				lm.Header = map[string][]string{}
			}
			lm.Header[h] = v
		}
	}
	return lm
}

func busMsg(lm *state.LogMsg) *bus.Msg {
	return &bus.Msg{Stream: lm.Stream, StreamSeq: lm.Seq, Subject: lm.Subject, Data: lm.Data, Header: lm.Header}
}

// snapshotter owns the compactor: one goroutine (run) folds what arrives
// on in and writes the snapshots.
type snapshotter struct {
	name     string
	interval time.Duration
	bus      *bus.Bus
	kv       jetstream.KeyValue
	log      *slog.Logger
	in       chan *state.LogMsg
	comp     *state.Compactor
	created  map[string]string
	slot     int // the slot the current head names
	// written is called after each snapshot is written (tests, bench).
	written func(state.SnapshotMeta)
	// loaded is set when this term's rebuild started from a snapshot.
	loaded bool
}

// writeNow, sent on in, asks for a snapshot once what came before it is
// folded.
var writeNow = &state.LogMsg{}

// observe passes m to the compactor (nil-safe: no snapshots).
func (sn *snapshotter) observe(ctx context.Context, m *bus.Msg) {
	if sn == nil {
		return
	}
	select {
	case sn.in <- logMsg(m):
	case <-ctx.Done():
	}
}

func (sn *snapshotter) run(ctx context.Context) error {
	tick := time.NewTicker(sn.interval)
	defer tick.Stop()
	var lastSeqs map[string]uint64
	// A snapshot is taken here (a copy of what the compactor holds) and
	// written by a goroutine of its own, one at a time: the follows that
	// feed the compactor (under the scheduler's lock) never wait for the
	// bucket.
	type result struct {
		seqs map[string]uint64
		slot int
		err  error
	}
	results := make(chan result, 1)
	writing := false
	since := 0 // messages folded since the last snapshot was taken
	write := func() {
		if writing || sn.interval <= 0 {
			return
		}
		seqs := sn.comp.Seqs()
		if equalSeqs(seqs, lastSeqs) {
			return
		}
		writing, since = true, 0
		snap, slot := sn.comp.Snapshot(), 1-sn.slot
		go func() {
			err := sn.write(ctx, snap, slot)
			results <- result{seqs: seqs, slot: slot, err: err}
		}()
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case r := <-results:
			writing = false
			switch {
			case errors.Is(r.err, errRecreated):
				sn.log.Warn("snapshots stop for this term", "err", r.err)
				sn.interval = 0
			case r.err != nil:
				if ctx.Err() == nil {
					sn.log.Warn("snapshot not written; the next one will be", "err", r.err)
				}
			default:
				sn.slot, lastSeqs = r.slot, r.seqs
			}
		case m := <-sn.in:
			if m == writeNow {
				write()
				continue
			}
			sn.comp.Observe(m)
			// A busy log is snapshotted sooner: the tail a restart reads
			// stays short at any rate of jobs.
			if since++; since >= snapshotEvery {
				write()
			}
		case <-tick.C:
			write()
		}
	}
}

func equalSeqs(a, b map[string]uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// errRecreated says a stream was recreated during the term.
var errRecreated = errors.New("stream recreated during this term")

// write encodes snap into slot (the one the head does not name), then
// points the head at it. One runs at a time (run).
func (sn *snapshotter) write(ctx context.Context, snap *state.Snapshot, slot int) error {
	start := time.Now()
	// The streams' creation times, looked up once per term: a stream
	// recreated since makes this term's snapshots wrong, so it writes no
	// more (the next term reads the streams whole).
	created, _, _, err := streamsNow(ctx, sn.bus)
	if err != nil {
		return err
	}
	if len(sn.created) == 0 {
		sn.created = created
	}
	for name, c := range created {
		if sn.created[name] != c {
			return fmt.Errorf("%w: %s", errRecreated, name)
		}
	}
	snap.Meta.Created = sn.created
	var buf bytes.Buffer
	if err := snap.Encode(&buf); err != nil {
		return err
	}
	data := buf.Bytes()
	chunks := 0
	for off := 0; off < len(data); off += snapshotChunk {
		end := min(off+snapshotChunk, len(data))
		if _, err := sn.kv.Put(ctx, contracts.SnapshotChunkKey(sn.name, slot, chunks), data[off:end]); err != nil {
			return fmt.Errorf("chunk %d: %w", chunks, err)
		}
		chunks++
	}
	head, err := json.Marshal(snapshotHead{Slot: slot, Chunks: chunks, Bytes: len(data), Written: time.Now().UTC()})
	if err != nil {
		return err
	}
	if _, err := sn.kv.Put(ctx, contracts.SnapshotHeadKey(sn.name), head); err != nil {
		return fmt.Errorf("head: %w", err)
	}
	sn.log.Info("snapshot written", "bytes", len(data), "chunks", chunks, "open_jobs", snap.Meta.Jobs,
		"retired_jobs", snap.Meta.Retired, "messages", snap.Meta.Msgs, "seqs", snap.Meta.Seqs, "took", time.Since(start))
	if sn.written != nil {
		sn.written(snap.Meta)
	}
	return nil
}

// errStaleSnapshot says a snapshot does not fit the streams as they are.
var errStaleSnapshot = errors.New("snapshot does not fit the streams")

// streamsNow returns each snapshot stream's creation time (RFC 3339),
// first and last sequence.
func streamsNow(ctx context.Context, b *bus.Bus) (created map[string]string, first, last map[string]uint64, err error) {
	created, first, last = map[string]string{}, map[string]uint64{}, map[string]uint64{}
	for _, name := range snapshotStreams {
		st, err := b.JetStream().Stream(ctx, name)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("stream %s: %w", name, err)
		}
		info := st.CachedInfo()
		created[name] = info.Created.UTC().Format(time.RFC3339Nano)
		first[name], last[name] = info.State.FirstSeq, info.State.LastSeq
	}
	return created, first, last, nil
}

// loadSnapshot reads the scheduler's snapshot and checks it against the
// streams (whose creation times it returns, for the next snapshot; nil
// when there is no snapshot: the writer looks them up). It returns a nil
// snapshot, with the reason, when there is none or it cannot be used; a
// nil created map too when the streams could not be looked at.
func (s *scheduler) loadSnapshot(ctx context.Context, kv jetstream.KeyValue) (*state.Snapshot, map[string]string, int, error) {
	e, err := kv.Get(ctx, contracts.SnapshotHeadKey(s.cfg.Name))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, map[string]string{}, 0, errors.New("no snapshot")
	}
	if err != nil {
		return nil, nil, 0, fmt.Errorf("snapshot head: %w", err)
	}
	created, first, last, err := streamsNow(ctx, s.bus)
	if err != nil {
		return nil, nil, 0, err
	}
	var head snapshotHead
	if err := json.Unmarshal(e.Value(), &head); err != nil || head.Slot < 0 || head.Slot > 1 || head.Chunks < 1 {
		return nil, created, 0, fmt.Errorf("%w: head %q", state.ErrBadSnapshot, e.Value())
	}
	data := make([]byte, 0, head.Bytes)
	for i := range head.Chunks {
		c, err := kv.Get(ctx, contracts.SnapshotChunkKey(s.cfg.Name, head.Slot, i))
		if err != nil {
			return nil, created, head.Slot, fmt.Errorf("%w: chunk %d: %w", state.ErrBadSnapshot, i, err)
		}
		data = append(data, c.Value()...)
	}
	snap, err := state.DecodeSnapshot(data)
	if err != nil {
		return nil, created, head.Slot, err
	}
	if snap.Meta.Scheduler != s.cfg.Name {
		return nil, created, head.Slot, fmt.Errorf("%w: scheduler %q's", errStaleSnapshot, snap.Meta.Scheduler)
	}
	for _, name := range snapshotStreams {
		if snap.Meta.Created[name] != created[name] {
			return nil, created, head.Slot, fmt.Errorf("%w: stream %s was created at %s, the snapshot's at %s",
				errStaleSnapshot, name, created[name], snap.Meta.Created[name])
		}
		if seq := snap.Meta.Seqs[name]; seq > last[name] {
			return nil, created, head.Slot, fmt.Errorf("%w: it covers %s up to %d, the stream ends at %d",
				errStaleSnapshot, name, seq, last[name])
		}
	}
	// Messages a stream no longer holds (PLANS ages) are not replayed: a
	// full replay would not see them either.
	kept := snap.Msgs[:0]
	for _, m := range snap.Msgs {
		if m.Seq >= first[m.Stream] {
			kept = append(kept, m)
		}
	}
	snap.Msgs = kept
	return snap, created, head.Slot, nil
}

// startSnapshots loads the snapshot (nil when there is none or it cannot
// be used) and starts the snapshotter, seeded from it, under g.
func (s *scheduler) startSnapshots(ctx, bctx context.Context, goFn func(func() error)) (*state.Snapshot, error) {
	if s.cfg.SnapshotInterval <= 0 {
		return nil, nil
	}
	kv, err := s.bus.KeyValue(bctx, contracts.BucketSnapshots)
	if err != nil {
		return nil, fmt.Errorf("bucket %s: %w", contracts.BucketSnapshots, err)
	}
	start := time.Now()
	snap, created, slot, err := s.loadSnapshot(bctx, kv)
	if created == nil {
		// The streams could not be looked at: rebuild as without
		// snapshots; the next term tries again.
		s.log.Warn("snapshots off for this term", "err", err)
		return nil, nil
	}
	if err != nil {
		s.log.Info("rebuilding from the streams' beginning", "why", err)
	} else {
		s.log.Info("snapshot loaded", "seqs", snap.Meta.Seqs, "open_jobs", snap.Meta.Jobs,
			"retired_jobs", snap.Meta.Retired, "messages", len(snap.Msgs), "took", time.Since(start))
	}
	s.snap = &snapshotter{name: s.cfg.Name, interval: s.cfg.SnapshotInterval, bus: s.bus, kv: kv, log: s.log,
		in: make(chan *state.LogMsg, 1<<14), comp: state.NewCompactor(s.cfg.Name, snap), created: created,
		slot: slot, written: s.cfg.snapshotWritten, loaded: snap != nil}
	goFn(func() error { return s.snap.run(ctx) })
	return snap, nil
}

// followForSnapshot follows spec from after seq for the compactor alone
// (streams the scheduler writes and does not follow once live).
func (s *scheduler) followForSnapshot(ctx context.Context, spec bus.FollowSpec, after uint64) error {
	last := after
	delay := 100 * time.Millisecond
	for {
		spec.StartSeq = last + 1
		err := s.bus.Follow(ctx, spec, func(ctx context.Context, m *bus.Msg) error {
			s.snap.observe(ctx, m)
			last = m.StreamSeq
			return nil
		}, nil)
		if ctx.Err() != nil {
			return nil
		}
		s.log.Warn("snapshot follow interrupted; resuming", "stream", spec.Stream, "after_seq", last, "err", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

// retireEnded retires the ended jobs past their retention now and then.
func (s *scheduler) retireEnded(ctx context.Context) error {
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		s.mu.Lock()
		s.st.RetireTerminal()
		s.mu.Unlock()
	}
}
