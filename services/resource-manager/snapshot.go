package resourcemanager

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
	"github.com/gpuplane/gpuplane/libs/recset"
	"github.com/gpuplane/gpuplane/services/resource-manager/internal/ledger"
)

// Snapshots (issue 17: restart with a million jobs in the streams ≤ 30 s).
// The leader writes what ALLOCATIONS and RUNS made of its state to
// contracts.BucketSnapshots now and then: the ledger (each node's last
// sequence, the live allocations in commit order, the retired records),
// the refusals, the start times of live runs, and the sequence of each
// stream it covers. A new term loads it and reads each stream only after
// the sequence covered; NODES is read whole as before (it grows with the
// fleet, not with jobs). The streams stay the truth: a snapshot missing,
// corrupt, truncated, of another schema, ahead of a stream or from before
// a stream was recreated is ignored and both are read whole.
//
// What makes a snapshot a state the log itself leads to: everything in it
// was applied from a stored message (the ledger applies a write only once
// JetStream acknowledged it). ALLOCATIONS' covered sequence is the
// position of the follow that reads the stream in order: every entry up to
// it is applied; entries after it that the manager applied itself (its
// own writes, catch-ups) are read again and skipped by their node's
// sequence, as the follow skips them. RUNS' covered sequence is that of
// the last run fact whose handling finished: a run's end is covered only
// once its allocation's release is stored, so a crash between the fact
// and the release leaves the fact to the next term, as a full replay
// would.

// snapshotSchema is the version of the encoding and of the rules above.
// 2: retired records and refusals in dated buckets (a snapshot of 1 has
// no dates: the streams are read whole once, dating them by their
// stamps).
const snapshotSchema = 2

// snapshotMagic starts every snapshot's payload.
const snapshotMagic = "gpuplane-rm-snapshot\n"

// snapshotEvery is how many stream messages read since the last snapshot
// make the next one due before its interval: at thousands of jobs a
// second a minute's tail would be most of a restart's work.
const snapshotEvery = 200_000

// snapshotStreams are the streams a snapshot covers.
var snapshotStreams = []string{contracts.StreamAllocations, contracts.StreamRuns}

// snapshotStore is the resource manager's snapshot in kv. Every replica
// writes the same keys; with several active (no lease) two may write at
// once, and the head's checksum then makes the next term read the
// streams whole. It is written in parts (kvsnap's parts.go): a write puts
// only what changed since the writer's last one.
func snapshotStore(kv jetstream.KeyValue) kvsnap.Store {
	return kvsnap.Store{KV: kv, HeadKey: contracts.RMSnapshotHeadKey(), ChunkKey: contracts.RMSnapshotChunkKey,
		Parts: kvsnap.NewParts()}
}

// snapshotMeta is the JSON part of a snapshot.
type snapshotMeta struct {
	Schema int `json:"schema"`
	// Seqs is the last sequence covered per stream; Created each stream's
	// creation time (RFC 3339), so one recreated since is noticed.
	Seqs    map[string]uint64 `json:"seqs"`
	Created map[string]string `json:"created"`
	Ledger  ledger.State      `json:"ledger"`
	// Started are the start times of live allocations' runs.
	Started map[string]time.Time `json:"started"`
	// RetiredBytes and RefusedBytes are the sizes of the binary parts
	// that follow the JSON: the ledger's retired records, then the
	// refusals' keys (refusalKeySize bytes each).
	RetiredBytes int `json:"retiredBytes"`
	RefusedBytes int `json:"refusedBytes"`
	// RefusedBuckets, RefusedSpan and RefusedClock are the refusals'
	// window (recset.Window): which bucket the keys are in, in order, a
	// bucket's length and its clock.
	RefusedBuckets []recset.Bucket `json:"refusedBuckets,omitempty"`
	RefusedSpan    int64           `json:"refusedSpan,omitempty"`
	RefusedClock   time.Time       `json:"refusedClock,omitzero"`
}

// snapshot is a snapshot in memory.
type snapshot struct {
	meta snapshotMeta
	// refusedKeys are the refusals' keys, refusalKeySize bytes each, in
	// pieces whose concatenation is the keys (taken: views of the
	// server's; decoded: one piece).
	refusedKeys [][]byte
}

// errBadSnapshot says a snapshot cannot be decoded.
var errBadSnapshot = errors.New("snapshot unreadable")

// encode writes the snapshot's payload: the magic, the SHA-256 of the
// rest, the JSON's length (4 bytes), the JSON, the retired records, the
// refusals' keys.
func (sn *snapshot) encode() ([]byte, error) {
	refused := 0
	for _, p := range sn.refusedKeys {
		refused += len(p)
	}
	sn.meta.RetiredBytes, sn.meta.RefusedBytes = sn.meta.Ledger.RetiredLen(), refused
	js, err := json.Marshal(sn.meta)
	if err != nil {
		return nil, fmt.Errorf("encode snapshot: %w", err)
	}
	// One buffer, the checksum filled in last: at a million ended jobs a
	// snapshot is tens of megabytes, written once a minute.
	head := len(snapshotMagic) + sha256.Size
	out := make([]byte, head, head+4+len(js)+sn.meta.RetiredBytes+refused)
	copy(out, snapshotMagic)
	out = binary.BigEndian.AppendUint32(out, uint32(len(js)))
	out = append(out, js...)
	for _, p := range sn.meta.Ledger.Retired {
		out = append(out, p...)
	}
	for _, p := range sn.refusedKeys {
		out = append(out, p...)
	}
	sum := sha256.Sum256(out[head:])
	copy(out[len(snapshotMagic):head], sum[:])
	return out, nil
}

// decodeSnapshot reads what encode wrote; any damage is errBadSnapshot.
func decodeSnapshot(data []byte) (*snapshot, error) {
	rest, ok := bytes.CutPrefix(data, []byte(snapshotMagic))
	if !ok || len(rest) < sha256.Size+4 {
		return nil, fmt.Errorf("%w: no snapshot header", errBadSnapshot)
	}
	body := rest[sha256.Size:]
	if sum := sha256.Sum256(body); !bytes.Equal(sum[:], rest[:sha256.Size]) {
		return nil, fmt.Errorf("%w: checksum mismatch (%d bytes)", errBadSnapshot, len(body))
	}
	n := int(binary.BigEndian.Uint32(body[:4]))
	if n > len(body)-4 {
		return nil, fmt.Errorf("%w: JSON of %d bytes in %d", errBadSnapshot, n, len(body)-4)
	}
	sn := &snapshot{}
	if err := json.Unmarshal(body[4:4+n], &sn.meta); err != nil {
		return nil, fmt.Errorf("%w: %w", errBadSnapshot, err)
	}
	if sn.meta.Schema != snapshotSchema {
		return nil, fmt.Errorf("%w: schema %d, want %d", errBadSnapshot, sn.meta.Schema, snapshotSchema)
	}
	bin := body[4+n:]
	r, f := sn.meta.RetiredBytes, sn.meta.RefusedBytes
	if r < 0 || f < 0 || r+f != len(bin) || f%refusalKeySize != 0 {
		return nil, fmt.Errorf("%w: %d binary bytes, header says %d + %d", errBadSnapshot, len(bin), r, f)
	}
	sn.meta.Ledger.Retired, sn.refusedKeys = [][]byte{bin[:r]}, [][]byte{bin[r:]}
	return sn, nil
}

// takeSnapshot takes what a snapshot keeps, under s.mu: copies of what
// is live, and the prefixes of the append-only logs of what ended
// (retired allocations, refusals), shared. The plans wait for it, so it
// must not be O(history).
func (s *server) takeSnapshot() *snapshot {
	s.mu.Lock()
	defer s.mu.Unlock()
	sn := &snapshot{meta: snapshotMeta{Schema: snapshotSchema,
		Seqs:           map[string]uint64{contracts.StreamAllocations: s.allocSeq, contracts.StreamRuns: s.runsSeq},
		Ledger:         s.led.Export(),
		Started:        make(map[string]time.Time, len(s.started)),
		RefusedBuckets: s.refused.Buckets(), RefusedSpan: s.refused.Span(), RefusedClock: s.refused.Clock()}}
	for i, b := range sn.meta.RefusedBuckets {
		sn.refusedKeys = append(sn.refusedKeys, b.Chunks...)
		sn.meta.RefusedBuckets[i].Chunks = nil
	}
	for k, v := range s.started {
		sn.meta.Started[k] = v
	}
	return sn
}

// addRefusal records a refusal's key once, dated t (the refusal's
// time). Under s.mu.
func (s *server) addRefusal(h refusalHash, t time.Time) {
	s.refused.Add(h[:], t)
}

// snapshots is this term's snapshot writer.
type snapshots struct {
	store kvsnap.Store
	// created are the streams' creation times when the term started: a
	// stream recreated since makes this term's state wrong for it, so it
	// writes no more snapshots.
	created map[string]string
	// seqs are the sequences the last snapshot written or loaded covers.
	seqs map[string]uint64
}

// loadSnapshot reads the snapshot and checks it against the streams as
// they are (lives). It returns nil and why when there is none or it
// cannot be used.
func (s *server) loadSnapshot(ctx context.Context, store kvsnap.Store, lives map[string]kvsnap.Life) (*snapshot, error) {
	data, _, err := store.Read(ctx)
	if err != nil {
		return nil, err
	}
	sn, err := decodeSnapshot(data)
	if err != nil {
		return nil, err
	}
	for _, name := range snapshotStreams {
		if err := kvsnap.Stale(name, lives[name], sn.meta.Created[name], sn.meta.Seqs[name]); err != nil {
			return nil, err
		}
	}
	last := lives[contracts.StreamAllocations].Last
	for _, n := range sn.meta.Ledger.Nodes {
		if n.LastSeq > last {
			return nil, fmt.Errorf("%w: node %s's ledger at %d, the stream ends at %d", kvsnap.ErrStale, n.ID, n.LastSeq, last)
		}
	}
	return sn, nil
}

// startSnapshots loads the snapshot into the server, which must be fresh,
// and returns the writer of this term's snapshots: nil when snapshots are
// off or the streams could not be looked at (the term runs without).
// A snapshot that cannot be used leaves the server as it was.
func (s *server) startSnapshots(ctx context.Context) *snapshots {
	if s.cfg.SnapshotInterval <= 0 {
		return nil
	}
	kv, err := s.bus.KeyValue(ctx, contracts.BucketSnapshots)
	if err != nil {
		s.log.Warn("snapshots off for this term", "err", err)
		return nil
	}
	lives, err := s.streamLives(ctx)
	if err != nil {
		s.log.Warn("snapshots off for this term", "err", err)
		return nil
	}
	w := &snapshots{store: snapshotStore(kv), created: kvsnap.Created(lives)}
	start := time.Now()
	sn, err := s.loadSnapshot(ctx, w.store, lives)
	if err == nil {
		err = s.install(sn)
	}
	if err != nil {
		s.log.Info("rebuilding from the streams' beginning", "why", err)
		return w
	}
	w.seqs = sn.meta.Seqs
	s.log.Info("snapshot loaded", "seqs", sn.meta.Seqs, "live_allocations", len(sn.meta.Ledger.Live),
		"retired_allocations", sn.meta.Ledger.RetiredLen()/ledger.RetiredRecordSize, "refusals", sn.meta.RefusedBytes/refusalKeySize,
		"took", time.Since(start))
	return w
}

// livesTries is how many times streamLives looks, each look bounded by
// probeTimeout.
const livesTries = 3

// streamLives is kvsnap.Lives of the snapshot streams, each try with its
// own bound. A stream info request sent to a NATS server that died with it
// is never answered, and nats.go bounds a request by its 5 s default only
// when the context has no deadline: under a term whose context had one
// (e2e's two minutes), one lost answer held a new term's start, before
// any plan, for as long (TestNATSNodeLossStopsNoRun).
func (s *server) streamLives(ctx context.Context) (map[string]kvsnap.Life, error) {
	var err error
	for range livesTries {
		tctx, cancel := context.WithTimeout(ctx, probeTimeout)
		var lives map[string]kvsnap.Life
		lives, err = kvsnap.Lives(tctx, s.bus.JetStream(), snapshotStreams...)
		cancel()
		if err == nil || ctx.Err() != nil {
			return lives, err
		}
	}
	return nil, err
}

// install makes sn the server's state.
func (s *server) install(sn *snapshot) error {
	keep := ledger.Keep(s.cfg.PlanMaxAge, s.cfg.ClockSkew)
	// A snapshot written with a shorter keep (a smaller -plan-max-age or
	// -clock-skew then) has dropped records this manager must still
	// hold: under its plan age a plan that old is young, and its ended
	// allocation would commit again. The streams, read whole, hold them
	// (ALLOCATIONS keeps everything). A longer keep is fine: its records
	// are read into this window's buckets by their ends (Rebucket).
	if want := recset.NewWindow(refusalKeySize, keep).Span(); sn.meta.Ledger.RetiredSpan < want || sn.meta.RefusedSpan < want {
		return fmt.Errorf("%w: written with a shorter plan age or clock skew (buckets of %v and %v, this manager's %v)",
			errBadSnapshot, time.Duration(sn.meta.Ledger.RetiredSpan), time.Duration(sn.meta.RefusedSpan), time.Duration(want))
	}
	led, err := ledger.FromState(sn.meta.Ledger, keep)
	if err != nil {
		return fmt.Errorf("%w: %w", errBadSnapshot, err)
	}
	// Copied into a window of their own: the decoded bytes are a slice
	// of the whole snapshot. A key listed twice is kept once.
	refused := recset.NewWindow(refusalKeySize, keep)
	if err := refused.Restore(sn.meta.RefusedClock, sn.meta.RefusedSpan, sn.meta.RefusedBuckets, sn.refusedKeys, nil); err != nil {
		return fmt.Errorf("%w: refusals: %w", errBadSnapshot, err)
	}
	// Its clocks are NATS time seen: a write before any message is read
	// is dated no earlier than what the snapshot covers.
	s.observe(led.Clock())
	s.observe(refused.Clock())
	s.mu.Lock()
	defer s.mu.Unlock()
	s.led, s.refused = led, refused
	s.started = make(map[string]time.Time, len(sn.meta.Started))
	for id, t := range sn.meta.Started {
		if _, live, _ := led.Allocation(id); live {
			s.started[id] = t
		}
	}
	s.allocSeq, s.runsSeq = sn.meta.Seqs[contracts.StreamAllocations], sn.meta.Seqs[contracts.StreamRuns]
	s.snapLoaded = true
	return nil
}

// write takes a snapshot and writes it into the slot the head does not
// name, then points the head at it; nothing when it would cover what the
// last one did. One runs at a time (runSnapshots).
func (w *snapshots) write(ctx context.Context, s *server) error {
	sn := s.takeSnapshot()
	if maps.Equal(sn.meta.Seqs, w.seqs) {
		return nil
	}
	start := time.Now()
	lives, err := s.streamLives(ctx)
	if err != nil {
		return err
	}
	if err := kvsnap.Recreated(w.created, lives); err != nil {
		return err
	}
	sn.meta.Created = w.created
	head, err := w.store.Write(ctx, 0, sn.encode)
	if err != nil {
		return err
	}
	w.seqs = sn.meta.Seqs
	s.mu.Lock()
	s.sinceSnapshot = 0
	s.mu.Unlock()
	s.log.Info("snapshot written", "bytes", head.Bytes, "put_bytes", head.Put, "parts", head.Chunks, "seqs", sn.meta.Seqs,
		"live_allocations", len(sn.meta.Ledger.Live), "retired_allocations", sn.meta.Ledger.RetiredLen()/ledger.RetiredRecordSize,
		"refusals", sn.meta.RefusedBytes/refusalKeySize, "took", time.Since(start))
	return nil
}

// snapshotPoll is how often the writer looks whether a snapshot is due.
const snapshotPoll = time.Second

// runSnapshots writes a snapshot at once (the term is ready: a restart
// soon after a long rebuild should not repeat it), then every
// SnapshotInterval, or sooner once snapshotEvery messages were read.
func (s *server) runSnapshots(ctx context.Context, w *snapshots) error {
	if w == nil {
		return nil
	}
	last := time.Now()
	t := time.NewTicker(min(snapshotPoll, s.cfg.SnapshotInterval))
	defer t.Stop()
	for first := true; ; first = false {
		if !first {
			select {
			case <-ctx.Done():
				return nil
			case <-t.C:
			}
			s.mu.Lock()
			busy := s.sinceSnapshot >= snapshotEvery
			s.mu.Unlock()
			if !busy && time.Since(last) < s.cfg.SnapshotInterval {
				continue
			}
		}
		last = time.Now()
		err := w.write(ctx, s)
		switch {
		case errors.Is(err, kvsnap.ErrRecreated):
			s.log.Warn("snapshots stop for this term", "err", err)
			return nil
		case err != nil && ctx.Err() == nil:
			s.log.Warn("snapshot not written; the next one will be", "err", err)
		}
	}
}

// refusalHash is a RefusalID's key in server.refused: the first 128 bits
// of its SHA-256 (they grow with history; a RefusalID is ~100 bytes).
type refusalHash [refusalKeySize]byte

const refusalKeySize = 16

func refusalHashOf(id string) refusalHash {
	h := sha256.Sum256([]byte(id))
	return refusalHash(h[:refusalKeySize])
}

// isLedgerSubject reports whether subject is gp.alloc.ledger.<node>.
func isLedgerSubject(subject string) bool {
	node, ok := strings.CutPrefix(subject, "gp.alloc.ledger.")
	return ok && node != "" && !strings.Contains(node, ".")
}

// onAllocMsg is onLedgerMsg for the in-order read of ALLOCATIONS (the
// rebuild and its follow): it also moves the position a snapshot covers.
func (s *server) onAllocMsg(ctx context.Context, m *bus.Msg) error {
	// The stream is read unfiltered (allocSubjects): only the ledger's
	// and refusals' subjects are applied.
	var err error
	if isLedgerSubject(m.Subject) || strings.HasPrefix(m.Subject, "gp.alloc.refused.") {
		err = s.onLedgerMsg(ctx, m)
	}
	s.mu.Lock()
	s.allocSeq = max(s.allocSeq, m.StreamSeq)
	s.sinceSnapshot++
	s.mu.Unlock()
	return err
}

// onRunFact is applyRunFact for the follow of RUNS: a fact is covered once
// handled, unless ctx ended first (its release may not be stored). With
// ReleaseParallelism above 1 a release runs beside the next facts, and
// RUNS is covered only below the first fact whose release is not stored
// yet (runs_pipeline.go).
func (s *server) onRunFact(ctx context.Context, m *bus.Msg) error {
	s.observe(m.Timestamp) // NATS time, for dates (observe)
	var release func()
	// RUNS is read unfiltered: it holds gp.runs.<node> alone.
	if strings.HasPrefix(m.Subject, "gp.runs.") && strings.Count(m.Subject, ".") == 2 {
		release = s.applyRunFact(ctx, m)
	}
	if release != nil && s.cfg.ReleaseParallelism > 1 {
		s.releaseBeside(ctx, m.StreamSeq, release)
		return nil
	}
	if release != nil {
		release()
	}
	if ctx.Err() != nil {
		return nil
	}
	s.mu.Lock()
	s.coverRuns(m.StreamSeq)
	s.sinceSnapshot++
	s.mu.Unlock()
	return nil
}
