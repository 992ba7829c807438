package billing_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/billing"
)

// A run on a machine whose agent went away (issue 13, finding 3): it
// started at 09:00:00.3; the resource manager gave up on the node and
// released it node_lost at 09:00:22.8; the agent, back, reported the run's
// real end. Billing must bill what the agent observed, whatever the order
// in which the release and the ended fact reach it, however often each
// comes, and across restarts.
var (
	lostStart   = t0.Add(300 * time.Millisecond)
	lostRelease = t0.Add(22*time.Second + 800*time.Millisecond)
)

// lostEnds are the agent's ends tried against that release.
var lostEnds = map[string]struct {
	end     time.Time
	outcome contracts.RunOutcome
	reason  contracts.Reason
	secs    int64 // whole seconds the run touched: [09:00:00, ceil(end))
}{
	// Re-adopted, then stopped because its allocation had been released.
	"agent ends it after the release": {t0.Add(31*time.Second + 700*time.Millisecond), contracts.OutcomeFailed, contracts.ReasonNodeLost, 32},
	// It ended on its own while no agent ran; the shim kept its end.
	"it ended before the release": {t0.Add(10*time.Second + 200*time.Millisecond), contracts.OutcomeSucceeded, "", 11},
	// Lost with the agent (a simulated run), reported at the restart.
	"in the release's second": {t0.Add(22*time.Second + 100*time.Millisecond), contracts.OutcomeFailed, contracts.ReasonAgentRestart, 23},
}

// lostOrders are the orders of arrival: release and fact, their
// redeliveries (as copies beyond JetStream's duplicate window), and
// billing stopped (down) and started again (up) in between.
var lostOrders = [][]string{
	{"release", "fact"},
	{"fact", "release"},
	{"release", "fact", "release again", "fact again"},
	{"fact", "release", "fact again", "release again"},
	{"release", "down", "fact", "up"},
	{"fact", "down", "release", "up"},
	{"down", "release", "fact", "up"},
	{"down", "fact", "release", "up"},
	{"release", "down", "up", "fact"},
	{"release", "fact", "down", "up", "release again", "fact again"},
}

// TestLostRunIsBilledToTheAgentsEnd: every order of arrival, on the
// in-memory store and on a real Redis, ends with USAGE and the store
// billing exactly the seconds of the agent's ended fact.
func TestLostRunIsBilledToTheAgentsEnd(t *testing.T) {
	stores := map[string]func(t *testing.T) func() billing.Store{
		"memory": func(*testing.T) func() billing.Store {
			return func() billing.Store { return billing.NewMemoryStore() }
		},
		"redis": func(t *testing.T) func() billing.Store {
			r := startRedis(t, false)
			// One store per start, as a restarted process opens its own.
			return func() billing.Store { return newRedisStore(t, r, billing.RedisConfig{}) }
		},
	}
	for storeName, newStore := range stores {
		t.Run(storeName, func(t *testing.T) {
			h := newLostHarness(t, newStore(t))
			n := 0
			for _, order := range lostOrders {
				for endName, end := range lostEnds {
					n++
					t.Run(fmt.Sprintf("%s/%s", strings.Join(order, ","), endName), func(t *testing.T) {
						a := alloc("acme", fmt.Sprintf("lost%d", n), 1, "n1", 2)
						fact := endedFact(a, end.end, end.outcome, end.reason)
						h.play(t, order, releaseLost(a), fact)
						h.checkBilled(t, a, end.secs, !slices.Contains(order, "fact") || end.secs == 23)
					})
				}
			}
			t.Run("the agent never comes back", func(t *testing.T) {
				a := alloc("acme", "gone", 1, "n1", 2)
				h.play(t, []string{"release", "down", "up", "release again"}, releaseLost(a), contracts.RunEvent{})
				// Provisional, it stands: the release is all that is known.
				h.checkBilled(t, a, 23, true)
			})
			t.Run("the release knew no start", func(t *testing.T) {
				// The resource manager never saw the started fact (the agent
				// died right after the launch): the release bills nothing,
				// the agent's end bills it all.
				a := alloc("acme", "nostart", 1, "n1", 2)
				rel := releaseLost(a)
				rel.Run.StartedAt = time.Time{}
				end := lostEnds["agent ends it after the release"]
				h.play(t, []string{"release", "fact", "release again"}, rel, endedFact(a, end.end, end.outcome, end.reason))
				h.checkBilled(t, a, 32, false)
			})
			t.Run("an ordinary run is billed once by either input", func(t *testing.T) {
				for i, order := range [][]string{{"fact", "release"}, {"release", "fact"}, {"down", "fact", "release", "up"}} {
					a := alloc("acme", fmt.Sprintf("ok%d", i), 1, "n1", 2)
					fact := endedFact(a, t0.Add(41*time.Second+500*time.Millisecond), contracts.OutcomeSucceeded, "")
					rel := released(a, 0)
					rel.Run = fact.Result
					h.play(t, order, rel, fact)
					h.checkBilled(t, a, 42, false)
					if recs := h.records(t, a); len(recs) != 1 {
						t.Errorf("%v: %d records, want 1: %+v", order, len(recs), recs)
					}
				}
			})
		})
	}
}

func releaseLost(a contracts.Allocation) contracts.LedgerEntry {
	return contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerReleased, Allocation: a, Time: lostRelease,
		Reason: contracts.ReasonNodeLost, Run: &contracts.RunResult{Outcome: contracts.OutcomeFailed, StartedAt: lostStart,
			EndedAt: lostRelease, Reason: contracts.ReasonNodeLost, Message: "node n1 stopped sending heartbeats"}}
}

func endedFact(a contracts.Allocation, end time.Time, outcome contracts.RunOutcome, reason contracts.Reason) contracts.RunEvent {
	return contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunEnded, AllocationID: a.ID, Tenant: a.Tenant,
		JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Devices: a.Devices, Time: end,
		Result: &contracts.RunResult{Outcome: outcome, StartedAt: lostStart, EndedAt: end, Reason: reason}}
}

// lostHarness runs billing over one server and one store backend, and
// stops and starts it on demand.
type lostHarness struct {
	// t is the test billing runs for: it outlives every case's subtest.
	t        *testing.T
	srv      *natsserver.Server
	b        *bus.Bus
	newStore func() billing.Store
	store    billing.Store
	stop     func()
	// published is, per stream, the sequence of the last message play
	// published there.
	published map[string]uint64
}

func newLostHarness(t *testing.T, newStore func() billing.Store) *lostHarness {
	srv := natstest.Start(t)
	h := &lostHarness{t: t, srv: srv, b: connect(t, srv), newStore: newStore, published: map[string]uint64{}}
	inventory(t, h.b, "n1", "h100", "on-demand")
	h.up()
	return h
}

func (h *lostHarness) up() {
	h.store = h.newStore()
	// Billing forgets what it settled as soon as the store holds it, so
	// that the later steps of an order often meet a forgotten run.
	h.stop = start(h.t, h.srv, h.store, func(c *billing.Config) { c.ForgetInterval = 5 * time.Millisecond })
}

// play publishes rel and fact in order; "again" publishes a copy under
// another message ID after JetStream forgot the first (a redelivery beyond
// its window). Billing is let settle after every step while it runs.
func (h *lostHarness) play(t *testing.T, order []string, rel contracts.LedgerEntry, fact contracts.RunEvent) {
	t.Helper()
	ctx := context.Background()
	running := true
	for _, step := range order {
		prefix := ""
		if strings.HasSuffix(step, " again") {
			natstest.ForgetMsgIDs(t, h.b.JetStream(), contracts.StreamAllocations)
			natstest.ForgetMsgIDs(t, h.b.JetStream(), contracts.StreamRuns)
			prefix = "again-"
		}
		switch strings.TrimSuffix(step, " again") {
		case "release":
			id := prefix + contracts.LedgerEntryID(rel.Kind, rel.Allocation.ID)
			ack, err := h.b.Publish(ctx, contracts.SubjectLedger(rel.Allocation.NodeID), id, rel)
			if err != nil {
				t.Fatal(err)
			}
			h.published[contracts.StreamAllocations] = ack.Sequence
		case "fact":
			id := prefix + contracts.RunEventID(contracts.RunEnded, fact.AllocationID)
			ack, err := h.b.Publish(ctx, contracts.SubjectRuns(fact.NodeID), id, fact)
			if err != nil {
				t.Fatal(err)
			}
			h.published[contracts.StreamRuns] = ack.Sequence
		case "down":
			h.stop()
			running = false
		case "up":
			h.up()
			running = true
		default:
			t.Fatalf("unknown step %q", step)
		}
		if running {
			h.settle(t)
		}
	}
}

// settle waits until billing has handled everything on both of its
// consumers, up to the last message play published on each. Pending
// counts alone are not enough: the server counts a stored message as
// pending for a consumer asynchronously, so right after a publish a
// consumer may show nothing pending and nothing unacknowledged while
// the message is still to be delivered (CI caught records read between
// a void and the bill that replaces it).
func (h *lostHarness) settle(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	waitFor(t, "billing to handle the ledger and the run facts", func() (bool, string) {
		for _, c := range []struct{ stream, name string }{
			{contracts.StreamAllocations, billing.Consumer}, {contracts.StreamRuns, billing.RunsConsumer}} {
			info, err := consumerInfo(ctx, h.b.JetStream(), c.stream, c.name)
			if err != nil {
				return false, err.Error()
			}
			if want := h.published[c.stream]; info.AckFloor.Stream < want || info.NumPending != 0 || info.NumAckPending != 0 {
				return false, fmt.Sprintf("%s: acked to stream seq %d of %d, %d pending, %d unacknowledged",
					c.name, info.AckFloor.Stream, want, info.NumPending, info.NumAckPending)
			}
		}
		return true, ""
	})
}

func consumerInfo(ctx context.Context, js jetstream.JetStream, stream, name string) (*jetstream.ConsumerInfo, error) {
	c, err := js.Consumer(ctx, stream, name)
	if err != nil {
		return nil, err
	}
	return c.Info(ctx)
}

// records are a's records in USAGE, in order.
func (h *lostHarness) records(t *testing.T, a contracts.Allocation) []contracts.UsageRecord {
	t.Helper()
	var out []contracts.UsageRecord
	_, err := h.b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamUsage,
		FilterSubjects: []string{contracts.SubjectUsage(a.Tenant)}}, func(_ context.Context, m *bus.Msg) error {
		var r contracts.UsageRecord
		if err := m.Decode(&r); err != nil {
			return err
		}
		if r.AllocationID == a.ID {
			out = append(out, r)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// checkBilled checks that a's records bill exactly its GPUs × secs from t0
// (sums, voids included), that what stands after the voids is one bill
// numbered without gaps, contiguous from t0, final at its end, and
// provisional only when it may be; and that the store agrees.
func (h *lostHarness) checkBilled(t *testing.T, a contracts.Allocation, secs int64, mayBeProvisional bool) {
	t.Helper()
	want := int64(len(a.Devices)) * secs * 1000
	recs := h.records(t, a)
	var sum int64
	voided := map[string]bool{}
	byID := map[string]contracts.UsageRecord{}
	for i, r := range recs {
		sum += r.GPUMillis
		if r.Segment != i || r.ID != contracts.UsageSegmentID(a.ID, i) {
			t.Errorf("record %d is %s (segment %d): segments billed twice or missing", i, r.ID, r.Segment)
		}
		byID[r.ID] = r
		if r.Voids == "" {
			continue
		}
		v, ok := byID[r.Voids]
		switch {
		case !ok || !v.Provisional:
			t.Errorf("%s voids %s, which is no earlier provisional record", r.ID, r.Voids)
		case voided[r.Voids]:
			t.Errorf("%s voided twice", r.Voids)
		case r.GPUMillis != -v.GPUMillis || r.Seconds != -v.Seconds || r.CostMicros != -v.CostMicros || !r.Start.Equal(v.Start):
			t.Errorf("%s does not negate %s: %+v", r.ID, r.Voids, r)
		}
		voided[r.Voids] = true
	}
	if sum != want {
		t.Errorf("billed %d GPU-ms, the agent's run held %d (%d s × %d GPUs); records %s", sum, want, secs, len(a.Devices), show(recs))
	}
	var standing []contracts.UsageRecord
	for _, r := range recs {
		if r.Voids == "" && !voided[r.ID] {
			standing = append(standing, r)
		}
	}
	at := t0
	for i, r := range standing {
		if !r.Start.Equal(at) || r.Final != (i == len(standing)-1) || (r.Provisional && !mayBeProvisional) {
			t.Errorf("standing record %s: %s..%s final=%v provisional=%v; records %s", r.ID, r.Start, r.End, r.Final, r.Provisional, show(recs))
		}
		at = r.End
	}
	if !at.Equal(t0.Add(time.Duration(secs) * time.Second)) {
		t.Errorf("what stands ends at %s, want %s; records %s", at, t0.Add(time.Duration(secs)*time.Second), show(recs))
	}
	waitFor(t, "the store's job total", func() (bool, string) {
		tot, err := h.store.Job(context.Background(), a.Tenant, a.JobID)
		if err != nil {
			return false, err.Error()
		}
		return tot.GPUMillis == want, fmt.Sprintf("store has %d GPU-ms, want %d", tot.GPUMillis, want)
	})
}

func show(recs []contracts.UsageRecord) string {
	var b strings.Builder
	for _, r := range recs {
		fmt.Fprintf(&b, "\n  %s %s..%s %d GPU-ms final=%v provisional=%v voids=%q", r.ID, r.Start.Format("15:04:05"),
			r.End.Format("15:04:05"), r.GPUMillis, r.Final, r.Provisional, r.Voids)
	}
	return b.String()
}

// TestLostRunsBilledByTwoReplicas: two billing replicas share the
// consumers, so the release of a run and its ended fact are often handled
// by different replicas at the same moment; the compare-and-set on the
// tenant's usage subject still leaves one net bill per run, the agent's.
func TestLostRunsBilledByTwoReplicas(t *testing.T) {
	h := newLostHarness(t, func() billing.Store { return billing.NewMemoryStore() })
	second := billing.NewMemoryStore()
	start(t, h.srv, second)
	ctx := context.Background()
	var allocs []contracts.Allocation
	for i := range 12 {
		a := alloc("acme", fmt.Sprintf("pair%d", i), 1, "n1", 2)
		allocs = append(allocs, a)
		end := lostEnds["agent ends it after the release"]
		if i%2 == 1 {
			end = lostEnds["it ended before the release"]
		}
		fact := endedFact(a, end.end, end.outcome, end.reason)
		// Alternate the order; nothing waits in between.
		if i%3 == 0 {
			if _, err := h.b.Publish(ctx, contracts.SubjectRuns("n1"), contracts.RunEventID(contracts.RunEnded, a.ID), fact); err != nil {
				t.Fatal(err)
			}
		}
		publishLedger(t, h.b, "", releaseLost(a))
		if i%3 != 0 {
			if _, err := h.b.Publish(ctx, contracts.SubjectRuns("n1"), contracts.RunEventID(contracts.RunEnded, a.ID), fact); err != nil {
				t.Fatal(err)
			}
		}
	}
	// Only this test publishes on both streams: their last messages are
	// what billing must have handled.
	for _, stream := range []string{contracts.StreamAllocations, contracts.StreamRuns} {
		st, err := h.b.JetStream().Stream(ctx, stream)
		if err != nil {
			t.Fatal(err)
		}
		h.published[stream] = st.CachedInfo().State.LastSeq
	}
	h.settle(t)
	for i, a := range allocs {
		secs := int64(32)
		if i%2 == 1 {
			secs = 11
		}
		h.checkBilled(t, a, secs, false)
		waitFor(t, "the second replica's store", func() (bool, string) {
			tot, err := second.Job(ctx, a.Tenant, a.JobID)
			if err != nil {
				return false, err.Error()
			}
			return tot.GPUMillis == int64(len(a.Devices))*secs*1000, fmt.Sprintf("%s: %+v", a.ID, tot)
		})
	}
}
