package billing_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/billing"
)

// TestForgottenRunsAreNeverBilledAgain: billing forgets the runs it
// billed to their end once the store holds them (issue 17), and then
// every input of those runs comes again, as each really can: the agent's
// ended fact and the release stored again under their own message IDs
// past JetStream's duplicate window (an agent whose publish landed, lost
// its ack, and got through again after a partition), both durable
// consumers deleted and created again (every message once more, at its
// old sequence), a restart, and on Redis a restart of Redis (a new
// generation, rebuilt from USAGE while the inputs come). Some runs are on
// a lost node: billed provisionally, kept whole while the others are
// forgotten, then voided by the agent's end, forgotten, and sent again
// too. USAGE ends with each run's bill once, and the store agrees.
func TestForgottenRunsAreNeverBilledAgain(t *testing.T) {
	for _, storeName := range []string{"memory", "redis"} {
		t.Run(storeName, func(t *testing.T) {
			f := newForgetFixture(t, storeName, 1)
			rng, srv, b, redisSrv, newStore := f.rng, f.srv, f.b, f.redis, f.newStore
			tap := &logTap{}
			store := newStore()
			fast := func(c *billing.Config) { c.ForgetInterval = 20 * time.Millisecond }
			stop := startLogged(t, srv, store, tap.logger(), fast)

			runs := forgetRuns(80)
			// The resource manager's release follows the agent's fact; which
			// billing reads first is a race: both orders.
			for _, r := range shuffled(rng, runs) {
				if r.lost {
					publishInputs(t, b, r.rel) // the agent is away: no fact yet
					continue
				}
				if rng.IntN(2) == 0 {
					publishInputs(t, b, r.fact, r.rel)
				} else {
					publishInputs(t, b, r.rel, r.fact)
				}
			}
			settleConsumers(t, b)
			waitFor(t, "the runs billed", func() (bool, string) { return billedAsRun(b, runs, false) })
			waitFor(t, "billing to forget the settled runs", func() (bool, string) {
				n := tap.sum("forgot billed allocations the store holds", "forgotten")
				return n >= int64(len(runs)-countLost(runs)), fmt.Sprintf("%d forgotten", n)
			})
			// The agents of the lost node come back: their ends void the
			// provisional bills.
			for _, r := range runs {
				if r.lost {
					publishInputs(t, b, r.fact)
				}
			}
			settleConsumers(t, b)
			check := func(what string) {
				t.Helper()
				settleConsumers(t, b)
				waitFor(t, what+": each run billed once, as the agent saw it", func() (bool, string) { return billedAsRun(b, runs, true) })
				waitFor(t, what+": the store's job totals", func() (bool, string) { return storeHoldsRuns(store, runs) })
			}
			check("the lost runs' ends")
			waitFor(t, "billing to forget the lost runs too", func() (bool, string) {
				n := tap.sum("forgot billed allocations the store holds", "forgotten")
				return n >= int64(len(runs)), fmt.Sprintf("%d forgotten", n)
			})

			// Stored again past the duplicate window, under their own IDs
			// (USAGE's window past too: the bills are older than it).
			again := func() {
				natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamAllocations)
				natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamRuns)
				natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamUsage)
				for _, r := range shuffled(rng, runs) {
					if rng.IntN(2) == 0 {
						publishInputs(t, b, r.fact, r.rel)
					} else {
						publishInputs(t, b, r.rel, r.fact)
					}
				}
			}
			again()
			check("copies past the duplicate window")

			// The consumers created again: every message once more.
			ctx := context.Background()
			natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamUsage)
			for stream, name := range map[string]string{contracts.StreamAllocations: billing.Consumer,
				contracts.StreamRuns: billing.RunsConsumer} {
				if err := b.JetStream().DeleteConsumer(ctx, stream, name); err != nil {
					t.Fatal(err)
				}
			}
			check("consumers created again")

			// A restart: rebuilt from USAGE, forgotten again, then copies.
			stop()
			store, tap = newStore(), &logTap{}
			stop = startLogged(t, srv, store, tap.logger(), fast)
			waitFor(t, "the restarted billing to forget", func() (bool, string) {
				n := tap.sum("forgot billed allocations the store holds", "forgotten")
				return n >= int64(len(runs)), fmt.Sprintf("%d forgotten", n)
			})
			again()
			check("copies after a restart")

			if redisSrv == nil {
				return
			}
			// Redis restarts empty: a new generation, fed from USAGE again,
			// knows nothing yet of what billing forgot. The copies come at
			// once: billing reads USAGE back rather than trust it.
			redisSrv.kill()
			redisSrv.start()
			again()
			// The store notices its lost content at its next write: a new
			// run's record.
			fresh := forgetRunOf(alloc("t0", "fresh", 1, "n1", 2), 5)
			runs = append(runs, fresh)
			publishInputs(t, b, fresh.fact, fresh.rel)
			check("copies while Redis rebuilds")
			if n := tap.count("the store cannot tell what billing forgot; reading USAGE back"); n == 0 {
				t.Error("billing never read back what it forgot: the copies did not reach the new generation's question")
			}
			stop()
		})
	}
}

// forgetFixture is what the tests of forgetting start from: a seeded
// random source (logged), a NATS server with billing's node n1 in it, and
// stores of one kind (memory, or Redis on a server of the test's).
type forgetFixture struct {
	rng      *rand.Rand
	srv      *natsserver.Server
	b        *bus.Bus
	redis    *redisServer // nil for memory
	newStore func() billing.Store
}

func newForgetFixture(t *testing.T, storeName string, stream uint64) forgetFixture {
	t.Helper()
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	f := forgetFixture{rng: rand.New(rand.NewPCG(seed, stream)), srv: natstest.Start(t)}
	f.b = connect(t, f.srv)
	inventory(t, f.b, "n1", "h100", "on-demand")
	f.newStore = func() billing.Store { return billing.NewMemoryStore() }
	if storeName == "redis" {
		f.redis = startRedis(t, false)
		f.newStore = func() billing.Store { return newRedisStore(t, f.redis, billing.RedisConfig{}) }
	}
	return f
}

// forgetRun is a run and its two inputs: the agent's ended fact and the
// resource manager's release (node_lost for a lost one, with the
// manager's end).
type forgetRun struct {
	a    contracts.Allocation
	fact contracts.RunEvent
	rel  contracts.LedgerEntry
	lost bool
	secs int64 // whole seconds of the agent's span, from t0
}

func forgetRuns(n int) []forgetRun {
	var runs []forgetRun
	for i := range n {
		a := alloc(fmt.Sprintf("t%d", i%3), fmt.Sprintf("fg%03d", i), 1+i%2, "n1", 1+i%4)
		if i%7 == 3 {
			end := lostEnds["agent ends it after the release"]
			runs = append(runs, forgetRun{a: a, fact: endedFact(a, end.end, end.outcome, end.reason), rel: releaseLost(a),
				lost: true, secs: end.secs})
			continue
		}
		runs = append(runs, forgetRunOf(a, int64(1+i%9)))
	}
	return runs
}

// forgetRunOf is an ordinary run of a, secs seconds from t0.
func forgetRunOf(a contracts.Allocation, secs int64) forgetRun {
	rel := released(a, time.Duration(secs)*time.Second)
	fact := endedFact(a, rel.Run.EndedAt, contracts.OutcomeSucceeded, "")
	fact.Result.StartedAt = t0
	return forgetRun{a: a, fact: fact, rel: rel, secs: secs}
}

func countLost(runs []forgetRun) int {
	n := 0
	for _, r := range runs {
		if r.lost {
			n++
		}
	}
	return n
}

func shuffled(rng *rand.Rand, runs []forgetRun) []forgetRun {
	out := append([]forgetRun(nil), runs...)
	rng.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}

// publishInputs publishes ledger entries and run facts under the IDs their
// writers use.
func publishInputs(t *testing.T, b *bus.Bus, inputs ...any) {
	t.Helper()
	ctx := context.Background()
	for _, in := range inputs {
		var err error
		switch v := in.(type) {
		case contracts.LedgerEntry:
			_, err = b.Publish(ctx, contracts.SubjectLedger(v.Allocation.NodeID), contracts.LedgerEntryID(v.Kind, v.Allocation.ID), v)
		case contracts.RunEvent:
			_, err = b.Publish(ctx, contracts.SubjectRuns(v.NodeID), contracts.RunEventID(v.Kind, v.AllocationID), v)
		default:
			t.Fatalf("not an input: %T", in)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// settleConsumers waits until billing's two consumers have handled every
// message their streams hold now.
func settleConsumers(t *testing.T, b *bus.Bus) {
	t.Helper()
	ctx := context.Background()
	last := map[string]uint64{}
	for _, stream := range []string{contracts.StreamAllocations, contracts.StreamRuns} {
		s, err := b.JetStream().Stream(ctx, stream)
		if err != nil {
			t.Fatal(err)
		}
		info, err := s.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		last[stream] = info.State.LastSeq
	}
	waitFor(t, "billing to handle the ledger and the run facts", func() (bool, string) {
		for stream, name := range map[string]string{contracts.StreamAllocations: billing.Consumer, contracts.StreamRuns: billing.RunsConsumer} {
			info, err := consumerInfo(ctx, b.JetStream(), stream, name)
			if err != nil {
				return false, err.Error()
			}
			if info.AckFloor.Stream < last[stream] || info.NumPending != 0 || info.NumAckPending != 0 {
				return false, fmt.Sprintf("%s: acked to %d of %d, %d pending, %d unacknowledged", name,
					info.AckFloor.Stream, last[stream], info.NumPending, info.NumAckPending)
			}
		}
		return true, ""
	})
}

// billedAsRun reports whether USAGE bills each run once: one record for an
// ordinary run; for a lost one its provisional record alone (agentBack
// false) or that record, its void and the agent's span; segments numbered
// without gaps, nothing else in USAGE.
func billedAsRun(b *bus.Bus, runs []forgetRun, agentBack bool) (bool, string) {
	byAlloc := map[string][]contracts.UsageRecord{}
	n := 0
	if _, err := b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamUsage}, func(_ context.Context, m *bus.Msg) error {
		var r contracts.UsageRecord
		if err := m.Decode(&r); err != nil {
			return err
		}
		byAlloc[r.AllocationID] = append(byAlloc[r.AllocationID], r)
		n++
		return nil
	}); err != nil {
		return false, err.Error()
	}
	want := 0
	for _, r := range runs {
		recs := byAlloc[r.a.ID]
		var gms int64
		for i, rec := range recs {
			if rec.Segment != i {
				return false, fmt.Sprintf("%s: segment %d at %d: %s", r.a.ID, rec.Segment, i, show(recs))
			}
			gms += rec.GPUMillis
		}
		wantRecs, wantGMS := 1, int64(len(r.a.Devices))*r.secs*1000
		if r.lost {
			wantRecs = 3
			if !agentBack {
				wantRecs, wantGMS = 1, int64(len(r.a.Devices))*23*1000
			}
		}
		want += wantRecs
		if len(recs) != wantRecs || gms != wantGMS {
			return false, fmt.Sprintf("%s: %d records, %d GPU-ms; want %d, %d: %s", r.a.ID, len(recs), gms, wantRecs, wantGMS, show(recs))
		}
	}
	return n == want, fmt.Sprintf("%d records in USAGE, want %d", n, want)
}

// storeHoldsRuns reports whether the store's job totals are the runs'.
func storeHoldsRuns(s billing.Store, runs []forgetRun) (bool, string) {
	for _, r := range runs {
		tot, err := s.Job(context.Background(), r.a.Tenant, r.a.JobID)
		if err != nil {
			return false, err.Error()
		}
		var want int64
		for _, o := range runs {
			if o.a.Tenant == r.a.Tenant && o.a.JobID == r.a.JobID {
				want += int64(len(o.a.Devices)) * o.secs * 1000
			}
		}
		if tot.GPUMillis != want {
			return false, fmt.Sprintf("job %s/%s: %d GPU-ms, want %d", r.a.Tenant, r.a.JobID, tot.GPUMillis, want)
		}
	}
	return true, ""
}

// logTap counts billing's log messages and sums their integer attributes.
type logTap struct {
	mu   sync.Mutex
	n    map[string]int
	sums map[string]int64
}

func (l *logTap) logger() *slog.Logger { return slog.New(tapHandler{l}) }

func (l *logTap) count(msg string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.n[msg]
}

func (l *logTap) sum(msg, attr string) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.sums[msg+"/"+attr]
}

type tapHandler struct{ l *logTap }

func (h tapHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h tapHandler) Handle(ctx context.Context, r slog.Record) error {
	h.l.mu.Lock()
	if h.l.n == nil {
		h.l.n, h.l.sums = map[string]int{}, map[string]int64{}
	}
	h.l.n[r.Message]++
	r.Attrs(func(a slog.Attr) bool {
		switch a.Value.Kind() {
		case slog.KindInt64:
			h.l.sums[r.Message+"/"+a.Key] += a.Value.Int64()
		case slog.KindUint64:
			h.l.sums[r.Message+"/"+a.Key] += int64(a.Value.Uint64())
		}
		return true
	})
	h.l.mu.Unlock()
	if dbg := quietLog(); dbg.Enabled(ctx, r.Level) {
		return dbg.Handler().Handle(ctx, r)
	}
	return nil
}

func (h tapHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h tapHandler) WithGroup(string) slog.Handler      { return h }

// TestForgettingBillerReadsAnotherReplicasBill: once billing has forgotten
// runs, the store answers for allocations it does not hold; one it
// "billed" may be another replica's bill billing has not read yet, here a
// provisional one for a lost node, whose agent's end must void it. Billing
// reads the tenant's usage subject before it takes such an answer for a
// bill of its own it forgot.
func TestForgettingBillerReadsAnotherReplicasBill(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	inventory(t, b, "n1", "h100", "on-demand")
	tap := &logTap{}
	store := billing.NewMemoryStore()
	startLogged(t, srv, store, tap.logger(), func(c *billing.Config) { c.ForgetInterval = 20 * time.Millisecond })
	runs := billAndForget(t, b, tap)

	// The other replica's provisional bill, applied to the store before
	// the agent's end reaches this one.
	a := alloc("t0", "other", 1, "n1", 2)
	prov := record(a, 23)
	prov.Provisional, prov.Reason, prov.Time = true, contracts.ReasonNodeLost, t0.Add(23*time.Second)
	if _, err := b.Publish(context.Background(), contracts.SubjectUsage(a.Tenant), prov.ID, prov, bus.CESubject(a.ID)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the store to hold the other replica's bill", func() (bool, string) {
		tot, err := store.Job(context.Background(), a.Tenant, a.JobID)
		return err == nil && tot.Records == 1, fmt.Sprintf("%+v %v", tot, err)
	})
	end := lostEnds["agent ends it after the release"]
	publishInputs(t, b, endedFact(a, end.end, end.outcome, end.reason))
	settleConsumers(t, b)
	lost := forgetRun{a: a, lost: true, secs: end.secs}
	waitFor(t, "the provisional bill voided and the agent's end billed", func() (bool, string) {
		return billedAsRun(b, append(runs, lost), true)
	})
}

// billAndForget bills three ordinary runs and waits until the biller
// forgot them (the store confirmed them): the start of the tests of what
// a forgetting biller does next.
func billAndForget(t *testing.T, b *bus.Bus, tap *logTap) []forgetRun {
	t.Helper()
	runs := forgetRuns(6)[:3]
	for _, r := range runs {
		publishInputs(t, b, r.fact, r.rel)
	}
	waitFor(t, "billing to forget", func() (bool, string) {
		n := tap.sum("forgot billed allocations the store holds", "forgotten")
		return n >= int64(len(runs)), fmt.Sprintf("%d forgotten", n)
	})
	return runs
}
