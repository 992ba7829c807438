package billing_test

import (
	"context"
	"encoding/json"
	"slices"
	"sync"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/billing"
	"github.com/gpuplane/gpuplane/services/billing/internal/biller"
	"github.com/gpuplane/gpuplane/services/billing/internal/catalog"
)

// TestAnswerAskedOutsideTheLockStandsOnlyIfNothingMoved: the biller asks
// the store about the allocations of a batch it does not hold before it
// takes its lock (internal/biller, forget.go). Taken as it came, a "not
// billed" would be a second bill of a run the biller forgot (its bill
// older than USAGE's duplicate window, as a forgotten one usually is) in
// two cases; in each the biller asks again under its lock, and USAGE
// ends with the run's bill once.
//   - billed and forgotten meanwhile: between the release's question and
//     the lock, the other consumer bills the run (its agent's fact), the
//     store applies the bill and the biller forgets it.
//   - the store lost its content: Redis restarted (the memory store: a
//     new one) after the biller forgot the run, and answers in a new
//     generation, rebuilt from USAGE, that does not hold the run yet.
func TestAnswerAskedOutsideTheLockStandsOnlyIfNothingMoved(t *testing.T) {
	for name, newStore := range askStores() {
		t.Run(name, func(t *testing.T) {
			t.Run("billed and forgotten meanwhile", func(t *testing.T) {
				h := newAskHarness(t, newStore(t))
				h.forgetOne("before") // the biller has forgotten something: it asks the store
				r := forgetRunOf(alloc("t0", "raced", 1, "n1", 2), 7)
				h.idx.holdBack(biller.KeyOf(r.a.ID), func() {
					// The question of the release's batch is on its way.
					h.bill(h.bl.HandleRun, r.fact)
					h.apply()
					h.forget()
					h.pastDuplicateWindow()
				})
				h.bill(h.bl.Handle, r.rel)
				if h.idx.pending() {
					t.Fatal("the release's batch never asked about the run: nothing raced its question")
				}
				h.billedOnce(r)
			})
			t.Run("the store lost its content", func(t *testing.T) {
				h := newAskHarness(t, newStore(t))
				r := h.forgetOne("gone")
				h.idx.restart(t)
				h.pastDuplicateWindow()
				h.bill(h.bl.Handle, r.rel)
				h.bill(h.bl.HandleRun, r.fact)
				h.billedOnce(r)
			})
		})
	}
}

// askStore is a store the biller asks, and how to make it lose its
// content (restart: a store of a new generation that holds nothing yet).
type askStore struct {
	billing.Store
	restart func() billing.Store
}

func askStores() map[string]func(*testing.T) askStore {
	return map[string]func(*testing.T) askStore{
		"memory": func(*testing.T) askStore {
			return askStore{Store: billing.NewMemoryStore(),
				restart: func() billing.Store { return billing.NewMemoryStore() }}
		},
		"redis": func(t *testing.T) askStore {
			r := startRedis(t, false)
			s := newRedisStore(t, r, billing.RedisConfig{})
			return askStore{Store: s, restart: func() billing.Store {
				r.kill()
				r.start()
				return s
			}}
		},
	}
}

// heldIndex is the biller's index: the store, one of whose answers can
// be held back (holdBack) while something else happens.
type heldIndex struct {
	mu    sync.Mutex
	store askStore
	key   biller.Key
	race  func()
}

var _ biller.Index = (*heldIndex)(nil)

// holdBack makes the next question about key take the store's answer,
// then run race, then answer.
func (x *heldIndex) holdBack(key biller.Key, race func()) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.key, x.race = key, race
}

// pending reports whether the question held back was not asked yet.
func (x *heldIndex) pending() bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.race != nil
}

// restart has the store lose its content and open a new generation.
func (x *heldIndex) restart(t *testing.T) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.store.Store = x.store.restart()
	if _, err := x.store.Open(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func (x *heldIndex) current() billing.Store {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.store.Store
}

func (x *heldIndex) Billed(ctx context.Context, keys []biller.Key) (string, []bool, error) {
	gen, billed, err := x.current().Billed(ctx, keys)
	x.mu.Lock()
	var race func()
	if x.race != nil && slices.Contains(keys, x.key) {
		race, x.race = x.race, nil
	}
	x.mu.Unlock()
	if race != nil {
		race()
	}
	return gen, billed, err
}

// askHarness is one biller over a real NATS and a real store, fed by the
// test: its messages are handed to its handlers directly, and USAGE is
// applied to the store when the test says so (apply).
type askHarness struct {
	t   *testing.T
	ctx context.Context
	b   *bus.Bus
	idx *heldIndex
	bl  *biller.Biller
	seq uint64
}

func newAskHarness(t *testing.T, store askStore) *askHarness {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	srv := natstest.Start(t)
	b := connect(t, srv)
	if err := b.EnsureStreams(ctx); err != nil {
		t.Fatal(err)
	}
	inventory(t, b, "n1", "h100", "on-demand")
	nodes := catalog.NewNodes(b, quietLog())
	done := make(chan struct{})
	go func() { defer close(done); _ = nodes.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-nodes.Ready()
	kv, err := b.KeyValue(ctx, contracts.BucketPriceBook)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.Open(ctx); err != nil {
		t.Fatal(err)
	}
	idx := &heldIndex{store: store}
	bl := biller.New(biller.Config{Bus: b, Prices: catalog.NewBook(kv), Nodes: nodes,
		Requests: catalog.NewRequests(b.JetStream()), Watermark: catalog.NewWatermark(kv, quietLog()), Index: idx,
		Log: quietLog()})
	if err := bl.Rebuild(ctx); err != nil {
		t.Fatal(err)
	}
	return &askHarness{t: t, ctx: ctx, b: b, idx: idx, bl: bl}
}

// bill hands input (a ledger entry or a run fact) to handle as a batch of
// one, and fails the test unless it is handled.
func (h *askHarness) bill(handle func(context.Context, []*bus.Msg) []error, input any) {
	h.t.Helper()
	var subj string
	switch v := input.(type) {
	case contracts.LedgerEntry:
		subj = contracts.SubjectLedger(v.Allocation.NodeID)
	case contracts.RunEvent:
		subj = contracts.SubjectRuns(v.NodeID)
	default:
		h.t.Fatalf("not an input: %T", input)
	}
	data, err := json.Marshal(input)
	if err != nil {
		h.t.Fatal(err)
	}
	h.seq++
	if errs := handle(h.ctx, []*bus.Msg{{Subject: subj, Data: data, StreamSeq: h.seq}}); errs[0] != nil {
		h.t.Fatalf("%T of %s: %v", input, subj, errs[0])
	}
}

// apply applies all of USAGE to the store (again: it counts a record
// once).
func (h *askHarness) apply() {
	h.t.Helper()
	var recs []contracts.UsageRecord
	if _, err := h.b.Replay(h.ctx, bus.FollowSpec{Stream: contracts.StreamUsage}, func(_ context.Context, m *bus.Msg) error {
		var r contracts.UsageRecord
		if err := m.Decode(&r); err != nil {
			return err
		}
		recs = append(recs, r)
		return nil
	}); err != nil {
		h.t.Fatal(err)
	}
	if _, err := h.idx.current().Apply(h.ctx, recs); err != nil {
		h.t.Fatal(err)
	}
}

// forget runs the biller's Forget until it holds no settled allocation.
func (h *askHarness) forget() {
	h.t.Helper()
	for range 10 {
		if _, err := h.bl.Forget(h.ctx); err != nil {
			h.t.Fatal(err)
		}
		if _, settled := h.bl.Retained(); settled == 0 {
			return
		}
	}
	_, settled := h.bl.Retained()
	h.t.Fatalf("%d settled allocations still held after 10 rounds of Forget", settled)
}

// forgetOne bills a run of job on both its inputs, has the store apply
// it and the biller forget it, and returns it.
func (h *askHarness) forgetOne(job string) forgetRun {
	h.t.Helper()
	r := forgetRunOf(alloc("t0", job, 1, "n1", 1), 3)
	h.bill(h.bl.HandleRun, r.fact)
	h.bill(h.bl.Handle, r.rel)
	h.apply()
	h.forget()
	return r
}

// pastDuplicateWindow lets USAGE's duplicate window pass over what it
// holds: a record published again under its ID is stored again.
func (h *askHarness) pastDuplicateWindow() {
	h.t.Helper()
	natstest.ForgetMsgIDs(h.t, h.b.JetStream(), contracts.StreamUsage)
}

// billedOnce fails the test unless USAGE holds r's bill once.
func (h *askHarness) billedOnce(r forgetRun) {
	h.t.Helper()
	var got []contracts.UsageRecord
	for _, rec := range usage(h.t, h.b, 0) {
		if rec.AllocationID == r.a.ID {
			got = append(got, rec)
		}
	}
	if len(got) != 1 || got[0].GPUMillis != int64(len(r.a.Devices))*r.secs*1000 {
		h.t.Fatalf("USAGE holds %d records of %s: %s; want its bill once", len(got), r.a.ID, show(got))
	}
}
