package resourcemanager

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/recset"
)

// signals counts log records by message, for a test to wait on them.
type signals struct {
	mu     sync.Mutex
	counts map[string]int
	next   slog.Handler
}

func (h *signals) Enabled(context.Context, slog.Level) bool { return true }
func (h *signals) Handle(ctx context.Context, r slog.Record) error {
	h.mu.Lock()
	h.counts[r.Message]++
	h.mu.Unlock()
	return nil
}
func (h *signals) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *signals) WithGroup(string) slog.Handler      { return h }

func (h *signals) count(msg string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.counts[msg]
}

// eventually waits, bounded, for cond.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// snapEnv is a NATS server, the operator's client (playing the scheduler's
// commits, the node agents' run facts and other replicas) and a way to
// start resource managers on it.
type snapEnv struct {
	t   *testing.T
	srv *natsserver.Server
	op  *bus.Bus
	rng *rand.Rand
	// the workload's model: live allocations by ID, free GPUs per node.
	live  map[string]contracts.Allocation
	free  map[string][]int
	ended []contracts.Allocation
	// endedAt is when each of ended ended; resent counts the commits of
	// ended allocations sent again.
	endedAt []time.Time
	resent  int
	// released are the allocations whose release the workload wrote (a
	// manager writes the others when it gets to them, perhaps a term
	// later), in order.
	released []contracts.Allocation
	next     int
	// clock is the managers' clock (unix ns) at step next, a minute a
	// step. It dates nothing (stream stamps do): it is what liveness and
	// entries' own times read.
	clock atomic.Int64
}

// snapStep is the managers' clock's step, snapPause the real time a step
// takes at least, and snapPlanMaxAge and snapSkew the managers' plan age
// and clock skew margin: records are forgotten two seconds of stream time
// after they are stored, more than once in a workload. The margin is
// also what a writer's date may lag its entry's stamp and still be
// read as written (dateOf): a second, under -race on a busy machine.
const (
	snapStep       = time.Minute
	snapPause      = 8 * time.Millisecond
	snapPlanMaxAge = time.Second
	snapSkew       = time.Second
)

// now is the log's time at the current step.
func (e *snapEnv) now() time.Time { return time.Unix(0, e.clock.Load()).UTC() }

var snapNodes = []string{"n1", "n2", "n3", "n4"}

func newSnapEnv(t *testing.T, seed uint64) *snapEnv {
	srv := natstest.Start(t)
	ctx := t.Context()
	op, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "operator", Logger: slog.New(slog.DiscardHandler),
		CredsFile: natstest.Operator(t, srv)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = op.Close(context.Background()) })
	if err := op.EnsureStreams(ctx); err != nil {
		t.Fatal(err)
	}
	e := &snapEnv{t: t, srv: srv, op: op, rng: rand.New(rand.NewPCG(seed, seed^0x5eed)),
		live: map[string]contracts.Allocation{}, free: map[string][]int{}}
	for _, n := range snapNodes {
		e.free[n] = []int{0, 1, 2, 3}
	}
	e.clock.Store(time.Date(2026, 11, 27, 0, 0, 0, 0, time.UTC).UnixNano())
	return e
}

// rm is one running resource manager of a test.
type rm struct {
	s    *server
	log  *signals
	stop func()
}

// start runs a resource manager until it is ready (or, with wait false,
// only starts it).
func (e *snapEnv) start(interval time.Duration, wait bool) *rm {
	t := e.t
	t.Helper()
	b, err := bus.Connect(t.Context(), bus.Config{URL: e.srv.URL(), Name: "rm", Logger: slog.New(slog.DiscardHandler),
		CredsFile: natstest.Service(t, e.srv, contracts.BusResourceManager)})
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.HeartbeatTimeout = time.Hour // no heartbeats here: no node is lost
	cfg.LeaseTTL = 0
	cfg.SnapshotInterval = interval
	cfg.Now = e.now
	cfg.PlanMaxAge, cfg.ClockSkew = snapPlanMaxAge, snapSkew
	h := &signals{counts: map[string]int{}}
	s := newServer(cfg, b, slog.New(h))
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- s.run(ctx) }()
	r := &rm{s: s, log: h}
	var once sync.Once
	r.stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("resource manager: %v", err)
			}
			_ = b.Close(context.Background())
		})
	}
	t.Cleanup(r.stop)
	if wait {
		eventually(t, "ready", func() bool { return h.count("ready: consuming plans") > 0 })
	}
	return r
}

func (e *snapEnv) pub(subject, id string, v any) {
	e.t.Helper()
	if _, err := e.op.Publish(e.t.Context(), subject, id, v); err != nil {
		e.t.Fatal(err)
	}
}

func (e *snapEnv) entry(kind contracts.LedgerKind, a contracts.Allocation) {
	e.pub(contracts.SubjectLedger(a.NodeID), contracts.LedgerEntryID(kind, a.ID),
		contracts.LedgerEntry{SchemaVersion: 1, Kind: kind, Allocation: a, Time: e.now()})
}

func (e *snapEnv) fact(kind contracts.RunKind, a contracts.Allocation) {
	ev := contracts.RunEvent{SchemaVersion: 1, Kind: kind, AllocationID: a.ID, Tenant: a.Tenant, JobID: a.JobID,
		Attempt: a.Attempt, NodeID: a.NodeID, Devices: a.Devices, Time: e.now()}
	if kind == contracts.RunEnded {
		ev.Result = &contracts.RunResult{Outcome: contracts.OutcomeSucceeded}
	}
	e.pub(contracts.SubjectRuns(a.NodeID), contracts.RunEventID(kind, a.ID), ev)
}

// workload publishes n random steps: commits (with or without their
// run's start), run ends whose release is left to the resource manager,
// run ends with their release, releases before any commit, refusals,
// double commits of a held GPU (a conflict the log holds), and old
// entries and facts sent again.
func (e *snapEnv) workload(n int) {
	for range n {
		e.next++
		e.clock.Add(int64(snapStep))
		time.Sleep(snapPause)
		node := snapNodes[e.rng.IntN(len(snapNodes))]
		job := fmt.Sprintf("j%05d", e.next)
		a := contracts.Allocation{ID: contracts.AllocationID("acme", job, 1), Tenant: "acme", JobID: job, Attempt: 1, NodeID: node}
		switch p := e.rng.IntN(100); {
		case p < 40 && len(e.free[node]) > 0:
			i := e.rng.IntN(len(e.free[node]))
			g := e.free[node][i]
			e.free[node] = append(e.free[node][:i], e.free[node][i+1:]...)
			a.Devices = []contracts.DeviceRef{{Index: g, UUID: gpu(node, g), Model: "L4"}}
			e.entry(contracts.LedgerCommitted, a)
			e.live[a.ID] = a
			if e.rng.IntN(4) > 0 {
				e.fact(contracts.RunStarted, a)
			}
		case p < 75 && len(e.live) > 0:
			ids := sortedIDs(e.live)
			a = e.live[ids[e.rng.IntN(len(ids))]]
			delete(e.live, a.ID)
			g := a.Devices[0].Index
			e.free[a.NodeID] = append(e.free[a.NodeID], g)
			e.fact(contracts.RunEnded, a)
			if e.rng.IntN(2) == 0 {
				e.entry(contracts.LedgerReleased, a) // else the resource manager writes it
				e.released = append(e.released, a)
			}
			e.ended, e.endedAt = append(e.ended, a), append(e.endedAt, time.Now())
		case p < 80:
			a.Devices = []contracts.DeviceRef{{Index: 0, UUID: gpu(node, 0), Model: "L4"}}
			e.entry(contracts.LedgerReleased, a)
		case p < 90:
			plan := fmt.Sprintf("p%d", e.next)
			e.pub(contracts.SubjectRefused("acme"), contracts.RefusalID(plan, a.ID),
				contracts.Refusal{SchemaVersion: 1, PlanID: plan, AllocationID: a.ID, Tenant: "acme", JobID: job,
					Attempt: 1, NodeID: node, Reason: contracts.RefusedDeviceTaken, Time: e.now()})
		case p < 93:
			// A second writer commits a GPU someone holds: the log is the
			// truth, and the claim order decides who holds it.
			g := e.rng.IntN(4)
			a.Devices = []contracts.DeviceRef{{Index: g, UUID: gpu(node, g), Model: "L4"}}
			e.entry(contracts.LedgerCommitted, a)
			e.fact(contracts.RunEnded, a) // and it ends at once
		case len(e.ended) > 0:
			// Of the last 200 ms: an older one may be forgotten, and a
			// commit of it in the log (which no manager writes: its plan
			// is expired) would make it live again, outside the model
			// (resent bounds how far).
			i := e.rng.IntN(len(e.ended))
			if time.Since(e.endedAt[i]) > snapPlanMaxAge/5 {
				break
			}
			e.resent++
			old := e.ended[i]
			e.entry(contracts.LedgerCommitted, old) // deduplicated, or a late commit
			e.fact(contracts.RunStarted, old)
		}
	}
}

func sortedIDs(m map[string]contracts.Allocation) []string {
	ids := make([]string, 0, len(m))
	for id := range m {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// rmState is what a rebuild decides, to compare two of them.
type rmState struct {
	digest  [32]byte
	refused map[refusalHash]int64
	started map[string]time.Time
	records int
}

func (r *rm) state() rmState {
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	return rmState{digest: r.s.led.Digest(), refused: refusalSet(r.s.refused), started: maps.Clone(r.s.started),
		records: r.s.led.Records()}
}

// refusalSet is the refusals' keys as a map to their window bucket, to
// compare.
func refusalSet(s *recset.Window) map[refusalHash]int64 {
	out := make(map[refusalHash]int64, s.Len())
	for _, b := range s.Buckets() {
		for _, c := range b.Chunks {
			for off := 0; off < len(c); off += refusalKeySize {
				out[refusalHash(c[off:off+refusalKeySize])] = b.N
			}
		}
	}
	return out
}

func (a rmState) diff(b rmState) string {
	switch {
	case a.digest != b.digest:
		return "ledger digests differ"
	case !maps.Equal(a.refused, b.refused):
		return fmt.Sprintf("refusals differ: %d and %d", len(a.refused), len(b.refused))
	case !maps.Equal(a.started, b.started):
		return fmt.Sprintf("run starts differ: %v and %v", a.started, b.started)
	}
	return ""
}

// settled waits until the server has released every allocation whose run
// ended in the workload and read every message published so far.
func (e *snapEnv) settled(r *rm) {
	e.t.Helper()
	last := func(stream string) uint64 {
		st, err := e.op.JetStream().Stream(e.t.Context(), stream)
		if err != nil {
			e.t.Fatal(err)
		}
		return st.CachedInfo().State.LastSeq
	}
	eventually(e.t, "the streams read", func() bool {
		a, runs := last(contracts.StreamAllocations), last(contracts.StreamRuns)
		r.s.mu.Lock()
		defer r.s.mu.Unlock()
		return r.s.allocSeq >= a && r.s.runsSeq >= runs
	})
}

// A rebuild from a snapshot and the streams' tail holds what a rebuild
// from the streams' beginning holds: random workloads that go on while the
// snapshots are written (every 20 ms, at whatever point the reads are)
// and after the last one, with run ends whose releases a crash left
// unwritten.
func TestSnapshotRebuildEqualsFullReplay(t *testing.T) {
	for seed := range uint64(3) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			e := newSnapEnv(t, seed)
			e.workload(150)
			a := e.start(20*time.Millisecond, true)
			e.workload(150) // while a reads and snapshots
			eventually(t, "a snapshot", func() bool { return a.log.count("snapshot written") > 1 })
			a.stop() // a crash: what it was doing is cut off
			e.workload(100)

			b := e.start(time.Hour, true)
			if !b.s.snapLoaded {
				t.Fatal("the rebuild did not start from the snapshot")
			}
			e.settled(b)
			fromSnap := b.state()
			b.stop()
			c := e.start(0, true)
			e.settled(c)
			full := c.state()
			// The workload spans several windows: the first allocations
			// released are forgotten, the last is remembered.
			c.s.mu.Lock()
			_, _, firstKnown := c.s.led.Allocation(e.released[0].ID)
			_, _, lastKnown := c.s.led.Allocation(e.released[len(e.released)-1].ID)
			c.s.mu.Unlock()
			if firstKnown || !lastKnown {
				t.Fatalf("the first allocation released known: %v, the last: %v", firstKnown, lastKnown)
			}
			c.stop()
			if d := fromSnap.diff(full); d != "" {
				t.Fatalf("rebuild from the snapshot differs from the full replay: %s", d)
			}
			// Ended history leaves no whole record: the ledger's are
			// its live allocations alone.
			if full.records > len(e.live)+len(snapNodes)*4+e.resent || fromSnap.records != full.records {
				t.Fatalf("whole records: %d from the snapshot, %d from the log; live allocations %d", fromSnap.records,
					full.records, len(e.live))
			}
		})
	}
}

// Every snapshot that cannot be used is ignored: the rebuild reads the
// streams whole and holds what a rebuild without snapshots holds.
func TestUnusableSnapshotFallsBackToTheLog(t *testing.T) {
	e := newSnapEnv(t, 7)
	e.workload(200)
	a := e.start(time.Hour, true)
	e.settled(a)
	eventually(t, "a snapshot", func() bool { return a.log.count("snapshot written") > 0 })
	a.stop()
	kv, err := e.op.KeyValue(t.Context(), contracts.BucketSnapshots)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	saved := map[string][]byte{}
	keys, err := kv.Keys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		v, err := kv.Get(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		saved[k] = v.Value()
	}
	var head kvsnap.Head
	if err := json.Unmarshal(saved[contracts.RMSnapshotHeadKey()], &head); err != nil {
		t.Fatal(err)
	}
	chunk0 := contracts.RMSnapshotChunkKey(head.Slot, 0)
	put := func(k string, v []byte) {
		if _, err := kv.Put(ctx, k, v); err != nil {
			t.Fatal(err)
		}
	}
	// store writes a payload whole (its checksum in the head): what the
	// cases that use it spoil is the manager's encoding, not the store's.
	store := func(payload func() ([]byte, error)) {
		if _, err := snapshotStore(kv).Write(ctx, 0, payload); err != nil {
			t.Fatal(err)
		}
	}
	// rewrite decodes the snapshot, changes it and writes it back whole.
	rewrite := func(change func(*snapshot)) {
		var data []byte
		for i := range head.Chunks {
			data = append(data, saved[contracts.RMSnapshotChunkKey(head.Slot, i)]...)
		}
		sn, err := decodeSnapshot(data)
		if err != nil {
			t.Fatal(err)
		}
		change(sn)
		store(sn.encode)
	}
	ref := e.start(0, true)
	want := ref.state()
	ref.stop()
	// The good snapshot is used (the cases below differ from it only by
	// what they spoil).
	for k, v := range saved {
		put(k, v)
	}
	good := e.start(time.Hour, true)
	if !good.s.snapLoaded {
		t.Fatal("the good snapshot was not used")
	}
	if d := good.state().diff(want); d != "" {
		t.Fatalf("rebuild from the good snapshot: %s", d)
	}
	good.stop()

	for _, tc := range []struct {
		name  string
		spoil func()
	}{
		{"missing", func() {
			if err := kv.Delete(ctx, contracts.RMSnapshotHeadKey()); err != nil {
				t.Fatal(err)
			}
		}},
		{"head unreadable", func() { put(contracts.RMSnapshotHeadKey(), []byte("{")) }},
		{"corrupt", func() {
			c := append([]byte(nil), saved[chunk0]...)
			c[len(c)/2] ^= 0xff
			put(chunk0, c)
		}},
		{"truncated", func() { put(chunk0, saved[chunk0][:len(saved[chunk0])/2]) }},
		{"chunk missing", func() {
			h := head
			h.Chunks++
			b, _ := json.Marshal(h)
			put(contracts.RMSnapshotHeadKey(), b)
		}},
		{"payload corrupt under its head's checksum", func() {
			var data []byte
			for i := range head.Chunks {
				data = append(data, saved[contracts.RMSnapshotChunkKey(head.Slot, i)]...)
			}
			data[len(data)-1] ^= 0xff
			store(func() ([]byte, error) { return data, nil })
		}},
		{"other schema", func() { rewrite(func(sn *snapshot) { sn.meta.Schema = snapshotSchema + 1 }) }},
		{"ahead of a stream", func() {
			rewrite(func(sn *snapshot) { sn.meta.Seqs[contracts.StreamRuns] += 1000 })
		}},
		{"node ahead of the stream", func() {
			rewrite(func(sn *snapshot) { sn.meta.Ledger.Nodes[0].LastSeq += 1000 })
		}},
		{"ledger state broken", func() {
			rewrite(func(sn *snapshot) {
				rec := make([]byte, 28)
				rec[27] = 0xff // names no node
				sn.meta.Ledger.Retired = append(sn.meta.Ledger.Retired, rec)
			})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range saved {
				put(k, v)
			}
			tc.spoil()
			r := e.start(time.Hour, true)
			defer r.stop()
			if r.s.snapLoaded || r.log.count("rebuilding from the streams' beginning") != 1 {
				t.Fatalf("the spoiled snapshot was used (loaded %v)", r.s.snapLoaded)
			}
			if d := r.state().diff(want); d != "" {
				t.Fatalf("rebuild past a spoiled snapshot: %s", d)
			}
		})
	}

	t.Run("stream recreated", func(t *testing.T) {
		for k, v := range saved {
			put(k, v)
		}
		// RUNS deleted and created again with as many facts as before:
		// the snapshot's sequences fit, but not its stream.
		var n uint64
		if st, err := e.op.JetStream().Stream(ctx, contracts.StreamRuns); err == nil {
			n = st.CachedInfo().State.LastSeq
		}
		if err := e.op.JetStream().DeleteStream(ctx, contracts.StreamRuns); err != nil {
			t.Fatal(err)
		}
		if err := e.op.EnsureStreams(ctx); err != nil {
			t.Fatal(err)
		}
		for i := range n {
			a := contracts.Allocation{ID: fmt.Sprintf("acme/other-%d/1", i), Tenant: "acme", JobID: "x", NodeID: "n1"}
			e.fact(contracts.RunStarted, a)
		}
		ref := e.start(0, true)
		want := ref.state()
		ref.stop()
		for k, v := range saved {
			put(k, v)
		}
		r := e.start(time.Hour, true)
		defer r.stop()
		if r.s.snapLoaded {
			t.Fatal("a snapshot of a recreated stream was used")
		}
		if d := r.state().diff(want); d != "" {
			t.Fatalf("rebuild past a recreated stream: %s", d)
		}
	})
}

var _ jetstream.KeyValue // the bucket's client type, used through bus.KeyValue

// A run's end is covered by a snapshot only once its allocation's release
// is stored: a term cut off before (ctx ended) leaves the fact to the
// next one, which a snapshot must not skip. Releases written one at a
// time by the follow and beside it (ReleaseParallelism).
func TestRunEndCoveredOnlyOnceReleased(t *testing.T) {
	cut, cancel := context.WithCancel(t.Context())
	cancel()
	for _, parallel := range []int{1, 64} {
		for _, tc := range []struct {
			name string
			ctx  context.Context
			live bool
		}{
			{"cut off before the release", cut, true},
			{"released", t.Context(), false},
		} {
			t.Run(fmt.Sprintf("%s/parallel=%d", tc.name, parallel), func(t *testing.T) {
				s, _ := writeServer(t)
				s.cfg.ReleaseParallelism = parallel
				a := alloc("ends", "n1", 0)
				if v, err := s.commit(t.Context(), a); err != nil || !v.OK() {
					t.Fatalf("commit = %+v, %v", v, err)
				}
				if err := s.onRunFact(tc.ctx, runEnded(t, a, 42)); err != nil {
					t.Fatal(err)
				}
				s.releasesDone(t.Context())
				_, live, _ := s.allocation(a.ID)
				s.mu.Lock()
				covered := s.runsSeq
				s.mu.Unlock()
				if live != tc.live || live && covered >= 42 || !live && covered != 42 {
					t.Fatalf("live %v, RUNS covered to %d; want live %v, covered below 42 while live, to 42 once released", live, covered, tc.live)
				}
			})
		}
	}
}

// runEnded is the ended run fact of a at RUNS sequence seq.
func runEnded(t *testing.T, a contracts.Allocation, seq uint64) *bus.Msg {
	t.Helper()
	data, err := json.Marshal(contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunEnded, AllocationID: a.ID,
		Tenant: a.Tenant, JobID: a.JobID, Attempt: 1, NodeID: a.NodeID, Result: &contracts.RunResult{Outcome: contracts.OutcomeSucceeded}})
	if err != nil {
		t.Fatal(err)
	}
	return &bus.Msg{Stream: contracts.StreamRuns, StreamSeq: seq, Subject: contracts.SubjectRuns(a.NodeID), Data: data}
}

// Releases written beside the follow of RUNS: every ended run is released,
// and RUNS is never covered past a fact whose release is not stored, even
// when the term ends with releases in flight (each fact below the
// coverage has its allocation released).
func TestReleasesBesideTheFollowCoverOnlyWhatIsStored(t *testing.T) {
	for _, c := range []struct {
		name     string
		parallel int
		cutAfter int // facts handed over before the term ends; 0: never
	}{
		{"all released", 64, 0},
		{"two at a time", 2, 0},
		{"term ends midway", 64, 5},
		{"term ends after the first", 3, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, _ := writeServer(t)
			s.cfg.ReleaseParallelism = c.parallel
			s.releases = make(chan struct{}, c.parallel)
			var allocs []contracts.Allocation
			for _, n := range []string{"n1", "n2"} {
				for i := range 4 {
					a := alloc(fmt.Sprintf("job-%s-%d", n, i), n, i)
					if v, err := s.commit(t.Context(), a); err != nil || !v.OK() {
						t.Fatalf("commit %s = %+v, %v", a.ID, v, err)
					}
					allocs = append(allocs, a)
				}
			}
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			// Facts of both nodes interleaved, as RUNS holds them.
			order := []int{0, 4, 1, 5, 2, 6, 3, 7}
			for k, i := range order {
				if c.cutAfter > 0 && k == c.cutAfter {
					cancel()
				}
				if err := s.onRunFact(ctx, runEnded(t, allocs[i], uint64(k+1))); err != nil {
					t.Fatal(err)
				}
			}
			s.releasesDone(t.Context())
			s.mu.Lock()
			covered := s.runsSeq
			s.mu.Unlock()
			for k, i := range order {
				_, live, _ := s.allocation(allocs[i].ID)
				if uint64(k+1) <= covered && live {
					t.Errorf("RUNS covered to %d, but the run ended at %d (%s) is not released", covered, k+1, allocs[i].ID)
				}
				if c.cutAfter == 0 && live {
					t.Errorf("%s not released", allocs[i].ID)
				}
			}
			if c.cutAfter == 0 && covered != uint64(len(order)) {
				t.Errorf("RUNS covered to %d, want %d", covered, len(order))
			}
		})
	}
}

// ALLOCATIONS and RUNS are read unfiltered: a message on a subject of
// neither family is skipped, as the filtered read never delivered it.
func TestOtherSubjectsInTheStreamsAreSkipped(t *testing.T) {
	e := newSnapEnv(t, 11)
	a := alloc("stray", "n9", 0)
	e.pub("gp.alloc.other.n9", "stray-ledger", contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a})
	e.pub("gp.alloc.ledger.n9.more", "stray-ledger-deep", contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a})
	e.workload(30)
	r := e.start(0, true)
	e.settled(r)
	r.s.mu.Lock()
	_, _, known := r.s.led.Allocation(a.ID)
	seq := r.s.led.LastSeq("n9")
	r.s.mu.Unlock()
	if known || seq != 0 {
		t.Fatalf("a message outside the ledger's subjects was applied: allocation known %v, n9 at %d", known, seq)
	}
}

// The follow of RUNS hands ended runs' releases beside it under the term's
// context: a read whose context ends (the bus replacing a stalled
// consumer) while the term goes on still gets the release stored and the
// fact covered.
func TestReleaseOutlivesAReplacedRead(t *testing.T) {
	s, _ := writeServer(t)
	s.cfg.ReleaseParallelism = 64
	a := alloc("ends", "n1", 0)
	if v, err := s.commit(t.Context(), a); err != nil || !v.OK() {
		t.Fatalf("commit = %+v, %v", v, err)
	}
	read, cancel := context.WithCancel(t.Context())
	cancel()
	if err := s.runFactHandler(t.Context())(read, runEnded(t, a, 42)); err != nil {
		t.Fatal(err)
	}
	s.releasesDone(t.Context())
	_, live, _ := s.allocation(a.ID)
	s.mu.Lock()
	covered := s.runsSeq
	s.mu.Unlock()
	if live || covered != 42 {
		t.Fatalf("live %v, RUNS covered to %d; want released and covered to 42", live, covered)
	}
}
