package billing_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/libs/service"
	"github.com/gpuplane/gpuplane/services/billing"
)

var t0 = time.Date(2025, 5, 1, 9, 0, 0, 0, time.UTC)

func TestValidateReportsTheBus(t *testing.T) {
	cfg := billing.DefaultConfig()
	cfg.Bus.NATSURL, cfg.Bus.Replicas = "", 2
	err := cfg.Validate()
	if err == nil || !strings.Contains(err.Error(), "nats URL") || !strings.Contains(err.Error(), "replicas") {
		t.Errorf("Validate() = %v, want both bus problems", err)
	}
}

func TestEveryRunIsBilledExactlyOnce(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv.URL())

	a := alloc("acme", "j1", 1, "n1", 2)
	bb := alloc("acme", "j2", 1, "n1", 1)
	never := alloc("acme", "j3", 1, "n2", 4)
	c := alloc("beta", "j4", 1, "n2", 4)
	e := alloc("acme", "j5", 1, "n2", 1)
	d := alloc("acme", "j1", 2, "n3", 8)

	store1 := billing.NewMemoryStore()
	stop := start(t, srv.URL(), store1)

	publishLedger(t, b, "", committed(a), released(a, 90*time.Second+500*time.Millisecond),
		committed(bb), released(bb, 1234*time.Millisecond+900*time.Microsecond),
		committed(never), releasedNeverStarted(never))
	waitUsage(t, b, []contracts.UsageRecord{
		record(a, 2*90500, 90*time.Second+500*time.Millisecond),
		record(bb, 1234, 1234*time.Millisecond+900*time.Microsecond),
	})

	// Another writer (a second replica) bills e before this one sees it.
	eRec := record(e, 3000, 3*time.Second)
	if _, err := b.Publish(context.Background(), contracts.SubjectUsage("acme"), eRec.ID, eRec); err != nil {
		t.Fatal(err)
	}
	// Beyond JetStream's duplicate window, the same entries come again
	// under other message IDs, then a poison entry, then c as a barrier.
	natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamUsage)
	backwards := released(c, time.Second)
	backwards.Allocation.ID = "beta/bad/1"
	backwards.Run.EndedAt = t0.Add(-time.Second)
	publishLedger(t, b, "again-", released(a, 90*time.Second+500*time.Millisecond), released(e, 3*time.Second), backwards)
	publishLedger(t, b, "", committed(c), released(c, 10*time.Second))
	want := []contracts.UsageRecord{
		record(a, 181000, 90*time.Second+500*time.Millisecond),
		record(bb, 1234, 1234*time.Millisecond+900*time.Microsecond),
		eRec,
		record(c, 40000, 10*time.Second),
	}
	waitUsage(t, b, want)
	wantTotals := map[string]billing.Totals{
		"acme": {Records: 3, GPUMillis: 181000 + 1234 + 3000}, "beta": {Records: 1, GPUMillis: 40000},
		"acme/j1": {Records: 1, GPUMillis: 181000}, "acme/j3": {},
	}
	checkTotals(t, store1, wantTotals)
	if dl := deadLetters(t, b); len(dl) != 1 || !strings.Contains(dl[0], "beta/bad/1") {
		t.Errorf("dead letters = %q, want the backwards entry", dl)
	}

	// Restart with a new store and no consumer state: the whole ledger is
	// delivered again, plus a' duplicate published while billing was down.
	stop()
	ctx := context.Background()
	if err := b.JetStream().DeleteConsumer(ctx, contracts.StreamAllocations, billing.Consumer); err != nil {
		t.Fatal(err)
	}
	natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamUsage)
	publishLedger(t, b, "down-", released(a, 90*time.Second+500*time.Millisecond))
	publishLedger(t, b, "", committed(d), released(d, 2*time.Millisecond+700*time.Microsecond))
	store2 := billing.NewMemoryStore()
	stop = start(t, srv.URL(), store2)
	want = append(want, record(d, 16, 2*time.Millisecond+700*time.Microsecond))
	waitUsage(t, b, want)
	wantTotals["acme"] = billing.Totals{Records: 4, GPUMillis: 181000 + 1234 + 3000 + 16}
	wantTotals["acme/j1"] = billing.Totals{Records: 2, GPUMillis: 181000 + 16}
	checkTotals(t, store2, wantTotals)

	// Restart again, consumer intact: nothing is redelivered, so the totals
	// of acme and beta can only come from replaying USAGE.
	stop()
	store3 := billing.NewMemoryStore()
	start(t, srv.URL(), store3)
	g := alloc("gamma", "j1", 1, "n1", 1)
	publishLedger(t, b, "", committed(g), released(g, time.Second))
	want = append(want, record(g, 1000, time.Second))
	waitUsage(t, b, want)
	wantTotals["gamma"] = billing.Totals{Records: 1, GPUMillis: 1000}
	checkTotals(t, store3, wantTotals)
}

// --- helpers ---

func connect(t *testing.T, url string) *bus.Bus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: url, Name: "test", Logger: quietLog()})
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	return b
}

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// start runs billing until stop is called or the test ends, and checks that
// it stops cleanly within a bounded time.
func start(t *testing.T, url string, store billing.Store) (stop func()) {
	t.Helper()
	cfg := billing.DefaultConfig()
	cfg.Bus = service.BusConfig{NATSURL: url, Replicas: 1}
	cfg.Store = store
	return natstest.RunService(t, "billing", func(ctx context.Context) error { return billing.Run(ctx, cfg, quietLog()) })
}

func alloc(tenant, job string, attempt int, node string, gpus int) contracts.Allocation {
	a := contracts.Allocation{ID: contracts.AllocationID(tenant, job, attempt), Tenant: tenant, JobID: job,
		Attempt: attempt, NodeID: node, Pool: "h100"}
	for i := range gpus {
		a.Devices = append(a.Devices, contracts.DeviceRef{Index: i, UUID: fmt.Sprintf("GPU-%s-%d", node, i), Model: "H100-80GB"})
	}
	return a
}

func committed(a contracts.Allocation) contracts.LedgerEntry {
	return contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a, Time: t0}
}

func released(a contracts.Allocation, ran time.Duration) contracts.LedgerEntry {
	return contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerReleased, Allocation: a, Time: t0.Add(ran + time.Second),
		Reason: contracts.ReasonRunEnded, Run: &contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: t0, EndedAt: t0.Add(ran)}}
}

func releasedNeverStarted(a contracts.Allocation) contracts.LedgerEntry {
	e := released(a, 0)
	e.Reason, e.Run.StartedAt, e.Run.Outcome = contracts.ReasonCancelled, time.Time{}, contracts.OutcomeCancelled
	return e
}

func record(a contracts.Allocation, millis int64, ran time.Duration) contracts.UsageRecord {
	return contracts.UsageRecord{SchemaVersion: 1, ID: contracts.UsageID(a.ID), AllocationID: a.ID, Tenant: a.Tenant,
		JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Pool: a.Pool, GPUModel: "H100-80GB", GPUs: len(a.Devices),
		Start: t0, End: t0.Add(ran), GPUMillis: millis, GPUSeconds: float64(millis) / 1000, Time: t0.Add(ran + time.Second)}
}

// publishLedger publishes entries on their node's ledger subject; prefix
// makes the message IDs differ from the resource manager's, as a second
// copy of an entry would.
func publishLedger(t *testing.T, b *bus.Bus, prefix string, entries ...contracts.LedgerEntry) {
	t.Helper()
	for _, e := range entries {
		id := prefix + contracts.LedgerEntryID(e.Kind, e.Allocation.ID)
		if _, err := b.Publish(context.Background(), contracts.SubjectLedger(e.Allocation.NodeID), id, e); err != nil {
			t.Fatalf("publish %s: %v", id, err)
		}
	}
}

// waitUsage waits until USAGE holds exactly want, in order, each record
// under its UsageID as Nats-Msg-Id.
func waitUsage(t *testing.T, b *bus.Bus, want []contracts.UsageRecord) {
	t.Helper()
	var got []contracts.UsageRecord
	deadline := time.Now().Add(15 * time.Second)
	for {
		got = got[:0]
		_, err := b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamUsage}, func(_ context.Context, m *bus.Msg) error {
			var r contracts.UsageRecord
			if err := m.Decode(&r); err != nil {
				return err
			}
			if m.ID() != r.ID || m.Subject != contracts.SubjectUsage(r.Tenant) {
				return fmt.Errorf("record %s came as %s on %s", r.ID, m.ID(), m.Subject)
			}
			got = append(got, r)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(got) >= len(want) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("usage records (-want +got):\n%s", diff)
	}
}

// checkTotals compares a store's totals; keys are "tenant" or "tenant/job".
func checkTotals(t *testing.T, s billing.Store, want map[string]billing.Totals) {
	t.Helper()
	ctx := context.Background()
	got := map[string]billing.Totals{}
	for k := range want {
		var err error
		if tenant, job, ok := strings.Cut(k, "/"); ok {
			got[k], err = s.Job(ctx, tenant, job)
		} else {
			got[k], err = s.Tenant(ctx, k)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("totals (-want +got):\n%s", diff)
	}
}

func deadLetters(t *testing.T, b *bus.Bus) []string {
	t.Helper()
	var out []string
	_, err := b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamDeadLetters,
		FilterSubjects: []string{contracts.SubjectDeadLetter(contracts.StreamAllocations, billing.Consumer)}},
		func(_ context.Context, m *bus.Msg) error {
			out = append(out, m.Header.Get(contracts.HeaderDeadLetterReason))
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	return out
}
