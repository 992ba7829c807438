package scheduler

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
	"github.com/gpuplane/gpuplane/libs/lease"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

// rebuildOnce rebuilds a store from the streams as a new leader would,
// with cfg (snapshots or not), and returns its digest and whether a
// snapshot was used.
func (e *env) rebuildOnce(cfg Config) (string, bool) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: e.url, Name: cfg.Name, Logger: testLogger(e.t), CredsFile: cfg.Bus.Creds})
	if err != nil {
		e.t.Fatal(err)
	}
	defer func() { _ = b.Close(context.Background()) }()
	s := newScheduler(cfg, b, testLogger(e.t), lease.Term{Epoch: 1})
	s.rebuildBound = time.Minute
	g, gctx := errgroup.WithContext(ctx)
	if err := s.rebuild(gctx, g); err != nil {
		e.t.Fatalf("rebuild: %v", err)
	}
	s.mu.Lock()
	d := s.st.Digest()
	s.mu.Unlock()
	loaded := s.snap != nil && s.snap.loaded
	cancel()
	_ = g.Wait()
	return d, loaded
}

// lastSeqs returns each snapshot stream's last sequence.
func (e *env) lastSeqs() map[string]uint64 {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	out := map[string]uint64{}
	for _, name := range snapshotStreams {
		st, err := e.bus.JetStream().Stream(ctx, name)
		if err != nil {
			e.t.Fatal(err)
		}
		out[name] = st.CachedInfo().State.LastSeq
	}
	return out
}

// snapshotEnv runs a random workload (seed) on a scheduler that writes
// snapshots often and retires ended jobs at once: jobs that succeed,
// fail, are cancelled queued or running, are rejected, depend on others,
// keep running or never fit. Once a snapshot covers all of it, the
// scheduler stops and the log moves on without it (runs end, a cancel
// arrives): a restart then has a snapshot and a tail to read.
func snapshotEnv(t *testing.T, seed uint64) *env {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 17))
	e := newEnv(t)
	e.cfg.SnapshotInterval = 20 * time.Millisecond
	e.cfg.RetainEnded, e.cfg.RetainEndedMax = time.Nanosecond, 0
	written := make(chan state.SnapshotMeta, 1024)
	e.cfg.snapshotWritten = func(m state.SnapshotMeta) {
		select {
		case written <- m:
		default:
		}
	}
	for i := range 4 {
		e.inventory(fmt.Sprintf("n%d", i), "default", h100, 8)
	}
	e.autoCommit()
	e.start()
	const jobs = 40
	for i := range jobs {
		r := request(fmt.Sprintf("j%02d", i), 1+rng.IntN(3), h100)
		switch rng.IntN(8) {
		case 0:
			r.Resources.GPU.Count = 64 // never fits
		case 1:
			r.Priority = "urgent" // rejected
		case 2:
			if i > 0 {
				r.DependsOn = []string{fmt.Sprintf("j%02d", rng.IntN(i))}
			}
		}
		e.submit(fmt.Sprintf("t%d", i%3), r)
	}
	e.barrier("t0")
	// Every placed job starts; about half end (succeeded or failed), some
	// are cancelled.
	seen := map[string]bool{}
	var running []contracts.Allocation
	for _, m := range e.plans.all() {
		for _, a := range decode[contracts.Plan](t, m).Items {
			if !seen[a.ID] {
				seen[a.ID] = true
				e.runStarted(a, time.Now().UTC())
				running = append(running, a)
			}
		}
	}
	var still []contracts.Allocation
	for _, a := range running {
		switch rng.IntN(4) {
		case 0, 1:
			out := contracts.OutcomeSucceeded
			if rng.IntN(3) == 0 {
				out = contracts.OutcomeFailed
			}
			res := contracts.RunResult{Outcome: out, StartedAt: time.Now().UTC(), EndedAt: time.Now().UTC()}
			e.runEnded(a, res)
			e.release(a, contracts.ReasonRunEnded, &res)
		case 2:
			e.cancel(a.Tenant, a.JobID)
		default:
			still = append(still, a)
		}
	}
	e.cancel("t1", "j01")
	e.barrier("t0")
	// A snapshot that covers everything so far.
	want := e.lastSeqs()
	eventually(t, "a snapshot covering the workload", func() bool {
		for {
			select {
			case m := <-written:
				covers := true
				for name, seq := range want {
					if m.Seqs[name] < seq && name != contracts.StreamJobs {
						covers = false
					}
				}
				if covers {
					return true
				}
			default:
				return false
			}
		}
	})
	e.stop()
	// The log moves on while no scheduler runs.
	for i, a := range still {
		if i%2 == 0 {
			res := contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: time.Now().UTC(), EndedAt: time.Now().UTC()}
			e.runEnded(a, res)
			e.release(a, contracts.ReasonRunEnded, &res)
		}
	}
	e.cancel("t2", "j02")
	return e
}

// TestSnapshotRebuildEqualsFullReplay: a store rebuilt from the snapshot
// and the streams' tail after it decides from exactly what one rebuilt
// from the streams' beginning does (same digest: live jobs, parts,
// queue, plans in flight, cluster, ended jobs), on random workloads that
// went on after the snapshot was written (a crash between the snapshot
// and the log).
func TestSnapshotRebuildEqualsFullReplay(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			e := snapshotEnv(t, seed)
			full := e.cfg
			full.SnapshotInterval = 0
			want, _ := e.rebuildOnce(full)
			got, loaded := e.rebuildOnce(e.cfg)
			if !loaded {
				t.Fatal("the snapshot was not used")
			}
			t.Logf("digest: %d live jobs, %d ended, %d lines", strings.Count(want, "\njob ")+strings.Count(want[:min(4, len(want))], "job "),
				strings.Count(want, "ended "), strings.Count(want, "\n"))
			if got != want {
				t.Fatalf("rebuilt from the snapshot:\n%s\nfrom the streams:\n%s", got, want)
			}
		})
	}
}

// TestUnusableSnapshotFallsBackToTheLog: a snapshot that is missing,
// corrupt, of another schema or scheduler, ahead of a stream, or from
// before a stream was recreated is ignored, and the rebuild reads the
// streams whole (same digest). A next snapshot written halfway (a crash
// in the middle of writing it) leaves the last whole one in use.
func TestUnusableSnapshotFallsBackToTheLog(t *testing.T) {
	e := snapshotEnv(t, 4)
	full := e.cfg
	full.SnapshotInterval = 0
	want, _ := e.rebuildOnce(full)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	kv, err := e.bus.KeyValue(ctx, contracts.BucketSnapshots)
	if err != nil {
		t.Fatal(err)
	}
	name := e.cfg.Name
	// The cases write whole snapshots (slots 0 and 1), as a scheduler
	// before parts did: those must still read. The scheduler's own
	// writes, and the last case's, are in parts.
	store := snapshotStore(kv, name)
	store.Parts = nil
	headOf := func() kvsnap.Head {
		_, h, err := store.Read(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	read := func() []byte {
		data, _, err := store.Read(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
	// write stores data as a snapshot whole (its checksum in the head):
	// what the cases spoil is the scheduler's encoding, not the store's.
	write := func(data []byte) {
		if _, err := store.Write(ctx, 0, func() ([]byte, error) { return data, nil }); err != nil {
			t.Fatal(err)
		}
	}
	good := read()
	reencode := func(edit func(*state.Snapshot)) []byte {
		snap, err := state.DecodeSnapshot(good)
		if err != nil {
			t.Fatal(err)
		}
		edit(snap)
		var buf bytes.Buffer
		if err := snap.Encode(&buf); err != nil {
			t.Fatal(err)
		}
		return buf.Bytes()
	}
	if _, loaded := e.rebuildOnce(e.cfg); !loaded {
		t.Fatal("the whole snapshot was not used")
	}
	tests := []struct {
		name   string
		break_ func()
		used   bool
	}{
		{"corrupt", func() {
			bad := bytes.Clone(good)
			bad[len(bad)/2] ^= 0x40
			write(bad)
		}, false},
		{"truncated", func() { write(good[:len(good)-100]) }, false},
		{"a chunk spoiled under the head", func() {
			write(good)
			h := headOf()
			bad := bytes.Clone(good[:min(len(good), kvsnap.ChunkBytes)])
			bad[len(bad)/2] ^= 0x40
			if _, err := kv.Put(ctx, contracts.SnapshotChunkKey(name, h.Slot, 0), bad); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"another schema", func() { write(reencode(func(s *state.Snapshot) { s.Meta.Schema = state.SnapshotSchema + 1 })) }, false},
		{"another scheduler", func() { write(reencode(func(s *state.Snapshot) { s.Meta.Scheduler = "other" })) }, false},
		{"ahead of the stream", func() {
			write(reencode(func(s *state.Snapshot) { s.Meta.Seqs[contracts.StreamRuns] += 1000 }))
		}, false},
		{"stream recreated since", func() {
			write(reencode(func(s *state.Snapshot) { s.Meta.Created[contracts.StreamJobEvents] = "2020-01-01T00:00:00Z" }))
		}, false},
		{"next one half written", func() {
			write(good)
			h := headOf()
			if _, err := kv.Put(ctx, contracts.SnapshotChunkKey(name, 1-h.Slot, 0), []byte("half")); err != nil {
				t.Fatal(err)
			}
		}, true},
		{"a part spoiled under the head", func() {
			parts := snapshotStore(kv, name)
			if _, err := parts.Write(ctx, 0, func() ([]byte, error) { return good, nil }); err != nil {
				t.Fatal(err)
			}
			// After a whole head, the first part goes to index 0.
			if _, err := kv.Put(ctx, contracts.SnapshotChunkKey(name, kvsnap.PartSlot, 0), []byte("spoiled")); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"missing", func() {
			if err := kv.Delete(ctx, contracts.SnapshotHeadKey(name)); err != nil {
				t.Fatal(err)
			}
		}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.break_()
			cfg := e.cfg
			cfg.SnapshotInterval = time.Hour // read it; write none over it
			got, loaded := e.rebuildOnce(cfg)
			if loaded != tt.used {
				t.Fatalf("snapshot used: %t, want %t", loaded, tt.used)
			}
			if got != want {
				t.Fatalf("rebuilt:\n%s\nfrom the streams:\n%s", got, want)
			}
		})
	}
}
