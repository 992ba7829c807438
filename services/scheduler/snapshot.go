package scheduler

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
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

// snapshotStore is scheduler name's snapshot in kv (its own keys; a
// scheduler writes under its lease, alone). It is written in parts: most
// of a snapshot is retired jobs' records, appended to, which a write puts
// again only where they changed (kvsnap's parts.go).
func snapshotStore(kv jetstream.KeyValue, name string) kvsnap.Store {
	return kvsnap.Store{KV: kv, HeadKey: contracts.SnapshotHeadKey(name),
		ChunkKey: func(slot, i int) string { return contracts.SnapshotChunkKey(name, slot, i) }, Parts: kvsnap.NewParts()}
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
	store    kvsnap.Store
	log      *slog.Logger
	in       chan *state.LogMsg
	comp     *state.Compactor
	created  map[string]string
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
		if maps.Equal(seqs, lastSeqs) {
			return
		}
		writing, since = true, 0
		snap := sn.comp.Snapshot()
		go func() {
			err := sn.write(ctx, snap)
			results <- result{seqs: seqs, err: err}
		}()
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case r := <-results:
			writing = false
			switch {
			case errors.Is(r.err, kvsnap.ErrRecreated):
				sn.log.Warn("snapshots stop for this term", "err", r.err)
				sn.interval = 0
			case r.err != nil:
				if ctx.Err() == nil {
					sn.log.Warn("snapshot not written; the next one will be", "err", r.err)
				}
			default:
				lastSeqs = r.seqs
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

// write encodes snap into the slot the head does not name, then points
// the head at it. One runs at a time (run).
func (sn *snapshotter) write(ctx context.Context, snap *state.Snapshot) error {
	start := time.Now()
	// The streams' creation times, looked up once per term: a stream
	// recreated since makes this term's snapshots wrong, so it writes no
	// more (the next term reads the streams whole).
	lives, err := kvsnap.Lives(ctx, sn.bus.JetStream(), snapshotStreams...)
	if err != nil {
		return err
	}
	if len(sn.created) == 0 {
		sn.created = kvsnap.Created(lives)
	}
	if err := kvsnap.Recreated(sn.created, lives); err != nil {
		return err
	}
	snap.Meta.Created = sn.created
	head, err := sn.store.Write(ctx, 0, func() ([]byte, error) {
		var buf bytes.Buffer
		err := snap.Encode(&buf)
		return buf.Bytes(), err
	})
	if err != nil {
		return err
	}
	sn.log.Info("snapshot written", "bytes", head.Bytes, "put_bytes", head.Put, "parts", head.Chunks, "open_jobs", snap.Meta.Jobs,
		"retired_jobs", snap.Meta.Retired, "messages", snap.Meta.Msgs, "seqs", snap.Meta.Seqs, "took", time.Since(start))
	if sn.written != nil {
		sn.written(snap.Meta)
	}
	return nil
}

// loadSnapshot reads the scheduler's snapshot and checks it against the
// streams (whose creation times it returns, for the next snapshot; empty
// when there is no snapshot: the writer looks them up). It returns a nil
// snapshot, with the reason, when there is none or it cannot be used; a
// nil created map too when the streams could not be looked at.
func (s *scheduler) loadSnapshot(ctx context.Context, store kvsnap.Store) (*state.Snapshot, map[string]string, error) {
	data, _, err := store.Read(ctx)
	if errors.Is(err, kvsnap.ErrNone) {
		return nil, map[string]string{}, err
	}
	if err != nil && !errors.Is(err, kvsnap.ErrBad) {
		return nil, nil, err
	}
	lives, lerr := kvsnap.Lives(ctx, s.bus.JetStream(), snapshotStreams...)
	if lerr != nil {
		return nil, nil, lerr
	}
	created := kvsnap.Created(lives)
	if err != nil {
		return nil, created, fmt.Errorf("%w: %w", state.ErrBadSnapshot, err)
	}
	snap, err := state.DecodeSnapshot(data)
	if err != nil {
		return nil, created, err
	}
	if snap.Meta.Scheduler != s.cfg.Name {
		return nil, created, fmt.Errorf("%w: scheduler %q's", kvsnap.ErrStale, snap.Meta.Scheduler)
	}
	for _, name := range snapshotStreams {
		if err := kvsnap.Stale(name, lives[name], snap.Meta.Created[name], snap.Meta.Seqs[name]); err != nil {
			return nil, created, err
		}
	}
	// Messages a stream no longer holds (PLANS ages) are not replayed: a
	// full replay would not see them either.
	kept := snap.Msgs[:0]
	for _, m := range snap.Msgs {
		if m.Seq >= lives[m.Stream].First {
			kept = append(kept, m)
		}
	}
	snap.Msgs = kept
	return snap, created, nil
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
	store := snapshotStore(kv, s.cfg.Name)
	snap, created, err := s.loadSnapshot(bctx, store)
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
	s.snap = &snapshotter{name: s.cfg.Name, interval: s.cfg.SnapshotInterval, bus: s.bus, store: store, log: s.log,
		in: make(chan *state.LogMsg, 1<<14), comp: state.NewCompactor(s.cfg.Name, s.cfg.RememberEnded, snap), created: created,
		written: s.cfg.snapshotWritten, loaded: snap != nil}
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
	t := time.NewTicker(cmp.Or(s.cfg.retireEvery, 5*time.Second))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		s.mu.Lock()
		s.st.RetireTerminal()
		forgetting := s.st.Forgetting()
		s.mu.Unlock()
		if forgetting {
			// No live job's dependency should be missing (pins keep
			// them); should one be, a job would wait on it for ever.
			// Those the cycles found are read back.
			if err := s.recallMissing(ctx, false); err != nil {
				s.log.Warn("reading back a live job's dependency", "err", err)
			}
		}
	}
}
