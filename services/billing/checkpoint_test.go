package billing_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/billing"
	"github.com/gpuplane/gpuplane/services/billing/internal/biller"
)

// TestAStartFromTheCheckpointBillsAsAFullReplay: billing writes a
// checkpoint of what USAGE holds (issue 17: a start no longer reads USAGE
// whole), and a restart on the same Redis starts from it, reading nothing
// of USAGE before it, then bills every input as a start that read USAGE
// whole would: the agents of a lost node come back and void their runs'
// provisional bills (allocations the checkpoint kept whole), and every
// input comes again past the duplicate window and through consumers
// created again (allocations the checkpoint forgot). On a memory store a
// restart is a new generation, which does not hold what the checkpoint
// forgot: USAGE is read whole, and the bills are the same.
func TestAStartFromTheCheckpointBillsAsAFullReplay(t *testing.T) {
	for _, storeName := range []string{"redis", "memory"} {
		t.Run(storeName, func(t *testing.T) {
			f := newForgetFixture(t, storeName, 2)
			rng, srv, b, redisSrv, newStore := f.rng, f.srv, f.b, f.redis, f.newStore
			fast := func(c *billing.Config) {
				c.ForgetInterval, c.CheckpointInterval = 20*time.Millisecond, 50*time.Millisecond
			}
			tap := &logTap{}
			store := newStore()
			stop := startLogged(t, srv, store, tap.logger(), fast)
			bill := func(runs []forgetRun) {
				for _, r := range shuffled(rng, runs) {
					if r.lost {
						publishInputs(t, b, r.rel) // the agent is away: billed provisionally
						continue
					}
					publishInputs(t, b, r.fact, r.rel)
				}
				settleConsumers(t, b)
			}
			runs := forgetRuns(60)
			first, tail := runs[:40], runs[40:]
			bill(first)
			waitFor(t, "the runs billed", func() (bool, string) { return billedAsRun(b, first, false) })
			waitFor(t, "billing to forget the settled runs", func() (bool, string) {
				n := tap.sum("forgot billed allocations the store holds", "forgotten")
				return n >= int64(len(first)-countLost(first)), fmt.Sprintf("%d forgotten", n)
			})
			checkpointed := usageLast(t, b)
			waitFor(t, "a checkpoint of all of USAGE, with the settled runs forgotten", func() (bool, string) {
				cp := readCheckpoint(t, b)
				return cp.State.Seq >= checkpointed && cp.State.Forgot != "" && len(cp.State.Settled) <= 1,
					fmt.Sprintf("checkpoint covers %d of %d, forgot in %q, %d epochs", cp.State.Seq, checkpointed,
						cp.State.Forgot, len(cp.State.Settled))
			})
			stop()
			// More runs billed, by a billing that writes no checkpoint
			// meanwhile: a tail of USAGE after the checkpoint.
			stop = startLogged(t, srv, store, quietLog(), fast, func(c *billing.Config) { c.CheckpointInterval = time.Hour })
			bill(tail)
			waitFor(t, "the tail billed", func() (bool, string) { return billedAsRun(b, runs, false) })
			stop()
			last := usageLast(t, b)

			if storeName == "memory" {
				store = newStore()
			}
			tap = &logTap{}
			stop = startLogged(t, srv, store, tap.logger(), fast)
			defer stop()
			waitFor(t, "the restarted billing to serve", func() (bool, string) {
				n := tap.count("billing rebuilt from USAGE")
				return n > 0, fmt.Sprintf("%d", n)
			})
			from, to := tap.sum("billing started from its checkpoint", "checkpoint_seq"), tap.sum("billing started from its checkpoint", "usage_seq")
			switch {
			case storeName == "redis" && (from != int64(checkpointed) || to != int64(last)):
				t.Fatalf("the restart did not start from the checkpoint of USAGE up to %d and read the tail to %d: from %d to %d (%d starts from it)",
					checkpointed, last, from, to, tap.count("billing started from its checkpoint"))
			case storeName == "memory" && tap.count("billing started from its checkpoint") > 0:
				t.Fatal("a restart on a new store generation started from a checkpoint that forgot what only the old one held")
			}

			check := func(what string, agentBack bool) {
				t.Helper()
				settleConsumers(t, b)
				waitFor(t, what+": each run billed once, as the agent saw it", func() (bool, string) {
					return billedAsRun(b, runs, agentBack)
				})
				if agentBack { // the totals storeHoldsRuns knows are the agents'
					waitFor(t, what+": the store's job totals", func() (bool, string) { return storeHoldsRuns(store, runs) })
				}
			}
			// First, before the restarted biller forgets anything itself:
			// the settled runs' inputs again, past the duplicate window.
			// Only what the checkpoint forgot, and in which generation,
			// tells them apart from new runs.
			natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamAllocations)
			natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamRuns)
			natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamUsage)
			for _, r := range shuffled(rng, runs) {
				if !r.lost {
					publishInputs(t, b, r.rel, r.fact)
				}
			}
			check("copies past the duplicate window after the restart", false)
			// The lost node's agents come back: their ends void the
			// provisional bills, which only the checkpoint kept whole.
			for _, r := range runs {
				if r.lost {
					publishInputs(t, b, r.fact)
				}
			}
			check("the lost runs' ends after the restart", true)
			ctx := context.Background()
			for stream, name := range map[string]string{contracts.StreamAllocations: billing.Consumer,
				contracts.StreamRuns: billing.RunsConsumer} {
				if err := b.JetStream().DeleteConsumer(ctx, stream, name); err != nil {
					t.Fatal(err)
				}
			}
			check("consumers created again after the restart", true)
			if redisSrv == nil {
				return
			}

			// Redis restarts empty: a new generation, which holds none of
			// what the fold forgot. The fold reads USAGE back (it asks the
			// store nothing else that would make it), and a restart
			// starts from a checkpoint of it.
			old := readCheckpoint(t, b).State.Forgot
			redisSrv.kill()
			redisSrv.start()
			fresh := forgetRunOf(alloc("t0", "fresh", 1, "n1", 2), 5)
			runs = append(runs, fresh)
			publishInputs(t, b, fresh.fact, fresh.rel) // the store notices its lost content at this write
			check("a run billed while Redis rebuilds", true)
			waitFor(t, "a checkpoint that holds what the new generation does not", func() (bool, string) {
				// Read back, it forgets nothing for a minute (forgetHold):
				// until then its checkpoints forget nothing either.
				cp := readCheckpoint(t, b)
				return cp.State.Forgot != old && cp.State.Seq >= usageLast(t, b),
					fmt.Sprintf("forgot in %q (before: %q), covers %d", cp.State.Forgot, old, cp.State.Seq)
			})
			stop()
			tap = &logTap{}
			stop = startLogged(t, srv, store, tap.logger(), fast)
			waitFor(t, "the billing restarted after Redis to serve", func() (bool, string) {
				n := tap.count("billing rebuilt from USAGE")
				return n > 0, fmt.Sprintf("%d", n)
			})
			if tap.count("billing started from its checkpoint") == 0 {
				t.Error("after Redis restarted, no checkpoint of the new generation was used")
			}
			check("after Redis restarted and billing too", true)
		})
	}
}

// usageLast is USAGE's last sequence.
func usageLast(t *testing.T, b *bus.Bus) uint64 {
	t.Helper()
	st, err := b.JetStream().Stream(context.Background(), contracts.StreamUsage)
	if err != nil {
		t.Fatal(err)
	}
	return st.CachedInfo().State.LastSeq
}

// storedCheckpoint is what billing's checkpoint says of itself (its
// encoding: services/billing/checkpoint.go, internal/biller/checkpoint.go).
type storedCheckpoint struct {
	State struct {
		Seq     uint64            `json:"seq"`
		Forgot  string            `json:"forgot"`
		Settled []json.RawMessage `json:"settled"`
	} `json:"state"`
}

// readCheckpoint reads billing's checkpoint (zero: none yet).
func readCheckpoint(t *testing.T, b *bus.Bus) storedCheckpoint {
	t.Helper()
	ctx := context.Background()
	var cp storedCheckpoint
	kv, err := b.JetStream().KeyValue(ctx, contracts.BucketSnapshots)
	if err != nil {
		return cp
	}
	data, _, err := kvsnap.Store{KV: kv, HeadKey: contracts.BillingSnapshotHeadKey(),
		ChunkKey: contracts.BillingSnapshotChunkKey}.Read(ctx)
	if err != nil {
		return cp
	}
	if err := json.Unmarshal(data, &cp); err != nil {
		t.Fatalf("billing's checkpoint: %v", err)
	}
	return cp
}

// TestAFoldThatReadsUSAGEBackHoldsWhatAReplayHolds: a fold that forgot in
// one generation of the store reads USAGE back when the store starts
// another (Redis restarted empty), while a record it has not applied yet
// waits in its follow. Followed on from where it stands, it holds what a
// replay of USAGE holds: that record once. (From a review: the read-back
// did not move the fold's position, so the follow applied the record
// again, and a provisional bill held twice would be voided twice.)
func TestAFoldThatReadsUSAGEBackHoldsWhatAReplayHolds(t *testing.T) {
	ctx := context.Background()
	srv := natstest.Start(t)
	b := connect(t, srv)
	r := startRedis(t, false)
	store := newRedisStore(t, r, billing.RedisConfig{})
	if _, err := store.Open(ctx); err != nil {
		t.Fatal(err)
	}
	at := func(alloc string, provisional bool) contracts.UsageRecord {
		return contracts.UsageRecord{SchemaVersion: 1, ID: contracts.UsageSegmentID(alloc, 0), AllocationID: alloc,
			Tenant: "t0", JobID: "j", NodeID: "n1", Pool: "h100", GPUModel: "H100-80GB", GPUs: 1, Start: t0,
			End: t0.Add(time.Minute), GPUMillis: 60_000,
			UsageSegment: contracts.UsageSegment{Final: true, Provisional: provisional}}
	}
	publish := func(rec contracts.UsageRecord) {
		t.Helper()
		if _, err := b.Publish(ctx, contracts.SubjectUsage(rec.Tenant), rec.ID, rec); err != nil {
			t.Fatal(err)
		}
	}
	settled := at("t0/settled/1", false)
	publish(settled)
	if _, err := store.Apply(ctx, []contracts.UsageRecord{settled}); err != nil {
		t.Fatal(err)
	}
	cfg := biller.Config{Bus: b, Index: store, Log: quietLog()}
	fold := biller.New(cfg)
	if err := fold.ReplayFrom(ctx, 0); err != nil {
		t.Fatal(err)
	}
	for range 5 { // closes the settled run's epoch and forgets it, keepRounds later
		if _, err := fold.Forget(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if whole, kept := fold.Retained(); whole != 0 || kept != 0 {
		t.Fatalf("the fold did not forget the settled run: %d whole, %d settled", whole, kept)
	}
	provisional := at("t0/lost/1", true)
	publish(provisional) // on its way to the fold's follow
	r.kill()
	r.start()
	var err error
	for range 3 { // as the projector: its next write finds the generation gone, and it opens a new one
		if _, err = store.Open(ctx); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	if recalled, err := fold.RecallIfStale(ctx); !recalled || err != nil {
		t.Fatalf("the fold did not read USAGE back for the new generation: %v, %v", recalled, err)
	}
	if _, err := b.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamUsage, FilterSubjects: []string{contracts.SubjectUsageAll},
		StartSeq: fold.Seq() + 1}, fold.ApplyFolded); err != nil {
		t.Fatal(err)
	}
	replayed := biller.New(biller.Config{Bus: b, Log: quietLog()})
	if err := replayed.Rebuild(ctx); err != nil {
		t.Fatal(err)
	}
	if got, want := openRecords(t, fold, provisional.AllocationID), openRecords(t, replayed, provisional.AllocationID); got != want || want != 1 {
		t.Fatalf("the fold holds %d open records of the lost run, a replay %d; want 1", got, want)
	}
}

// openRecords is how many open (provisional) records bl holds of alloc,
// as its checkpoint says.
func openRecords(t *testing.T, bl *biller.Biller, alloc string) int {
	t.Helper()
	data, _, err := bl.Checkpoint()
	if err != nil {
		t.Fatal(err)
	}
	var cp struct {
		Allocs map[string]struct {
			Open []json.RawMessage `json:"open"`
		} `json:"allocs"`
	}
	if err := json.Unmarshal(data, &cp); err != nil {
		t.Fatal(err)
	}
	return len(cp.Allocs[alloc].Open)
}
