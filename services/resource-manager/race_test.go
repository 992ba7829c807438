package resourcemanager_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	resourcemanager "github.com/gpuplane/gpuplane/services/resource-manager"
)

// TestTwoReplicasNeverHoldADeviceTwice runs two active resource managers
// (no lease) on one server, sharing the plans consumer, on a burst of plans that fight over
// few GPUs while an agent ends every run it is given at once, so devices are
// released and re-committed all the time and both replicas race on commits
// and releases. The ledger, replayed independently at the end, must show no
// device held by two allocations at any point of its timeline, every plan
// item answered exactly once, and each replica having committed some.
func TestTwoReplicasNeverHoldADeviceTwice(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))

	h := newHarness(t)
	nodes := []string{"n0", "n1", "n2", "n3"}
	const gpus = 4
	// Without election (LeaseTTL 0) both replicas are active: the ledger's
	// compare-and-set alone must keep them exclusive. It is also the
	// fence behind the lease: a deposed leader that slips a write past
	// its term check is one such racing writer.
	active := func(name string) resourcemanager.Config {
		cfg := h.config(name)
		cfg.LeaseTTL = 0
		return cfg
	}
	a := h.start(active("rm-a"))
	b := h.start(active("rm-b"))
	h.ready(h100, gpus, nodes...)

	// The agent: every committed allocation's run ends at once, reported
	// on its node's subject.
	ctx, stop := context.WithCancel(context.Background())
	var agent sync.WaitGroup
	agent.Go(func() {
		_ = h.bus.Follow(ctx, bus.FollowSpec{Stream: contracts.StreamAllocations, FilterSubjects: []string{contracts.SubjectLedgerAll}},
			func(ctx context.Context, m *bus.Msg) error {
				var e contracts.LedgerEntry
				if err := m.Decode(&e); err != nil || e.Kind != contracts.LedgerCommitted {
					return nil
				}
				al := e.Allocation
				ev := contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunEnded, AllocationID: al.ID, Tenant: al.Tenant,
					JobID: al.JobID, Attempt: al.Attempt, NodeID: al.NodeID, Devices: al.Devices, Time: h.clock.Now(),
					Result: &contracts.RunResult{Outcome: contracts.OutcomeSucceeded}}
				_, err := h.bus.Publish(ctx, contracts.SubjectRuns(al.NodeID), contracts.RunEventID(contracts.RunEnded, al.ID), ev)
				if err != nil && ctx.Err() == nil {
					t.Errorf("agent: %v", err)
				}
				return nil
			}, nil)
	})
	t.Cleanup(func() { stop(); agent.Wait() })

	// The burst: plans of 1-3 items, each 1-2 GPUs of a random node.
	const plans = 300
	type key struct{ plan, alloc string }
	var items []key
	for p := range plans {
		planID := fmt.Sprintf("p%03d", p)
		var its []contracts.Allocation
		for i := range 1 + rng.IntN(3) {
			node := nodes[rng.IntN(len(nodes))]
			first := rng.IntN(gpus)
			devs := []int{first}
			if rng.IntN(2) == 0 {
				devs = append(devs, (first+1+rng.IntN(gpus-1))%gpus)
			}
			it := item(fmt.Sprintf("j%03d-%d", p, i), 1, node, h100, devs...)
			its = append(its, it)
			items = append(items, key{planID, it.ID})
		}
		h.plan(planID, its...)
	}

	answered := func() int {
		n := 0
		for _, k := range items {
			_, refused := h.refusal(k.plan, k.alloc)
			if refused || h.has(k.alloc, contracts.LedgerCommitted) {
				n++
			}
		}
		return n
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		var done int
		var pending []string
		h.locked(func() {
			done = answered()
			for _, r := range h.entries {
				if r.entry.Kind == contracts.LedgerCommitted && !h.has(r.entry.Allocation.ID, contracts.LedgerReleased) {
					pending = append(pending, r.entry.Allocation.ID)
				}
			}
		})
		if done == len(items) && len(pending) == 0 {
			break
		}
		if time.Now().After(deadline) {
			// Still run the oracle: its findings say why.
			t.Errorf("after 30 s: %d of %d items answered, not released: %v", done, len(items), pending)
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	a.stop()
	b.stop()

	violations, stats := checkLedger(t, h.srv.URL(), natstest.Operator(t, h.srv))
	for _, v := range violations {
		t.Error(v)
	}

	// Every item has exactly one answer: committed, or refused for a
	// reason a race can give.
	h.locked(func() {
		for _, k := range items {
			r, refused := h.refusal(k.plan, k.alloc)
			committed := h.has(k.alloc, contracts.LedgerCommitted)
			switch {
			case refused && committed:
				t.Errorf("%s both committed and refused (%s)", k.alloc, r.Reason)
			case refused && r.Reason != contracts.RefusedDeviceTaken && r.Reason != contracts.RefusedCommitConflict:
				t.Errorf("%s refused with %s", k.alloc, r.Reason)
			}
		}
	})
	conflicts := h.logs.count("ledger compare-and-set conflict")
	t.Logf("%d items: %d committed (rm-a %d, rm-b %d), %d released, %d refused; %d CAS conflicts, %d writes found already stored",
		len(items), stats.committed, stats.bySource["/gpuplane/rm-a"], stats.bySource["/gpuplane/rm-b"],
		stats.released, len(items)-stats.committed, conflicts, h.logs.count("ledger entry already stored"))
	if stats.bySource["/gpuplane/rm-a"] == 0 || stats.bySource["/gpuplane/rm-b"] == 0 {
		t.Errorf("one replica committed nothing (%v): the race was not run", stats.bySource)
	}
	if stats.committed < len(nodes)*gpus {
		t.Errorf("only %d commits: devices were not reused", stats.committed)
	}
}

type ledgerStats struct {
	committed, released int
	bySource            map[string]int
}

// checkLedger is an independent oracle: it replays ALLOCATIONS from
// sequence 1 with a plain nats.go ordered consumer (nothing of the
// resource manager, not libs/bus) and checks G1 over the timeline: a device
// committed while another live allocation holds it is a violation; so is an
// allocation committed twice, or released when not live.
func checkLedger(t *testing.T, url, creds string) ([]string, ledgerStats) {
	t.Helper()
	nc, err := nats.Connect(url, nats.UserCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	stream, err := js.Stream(ctx, contracts.StreamAllocations)
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := js.OrderedConsumer(ctx, contracts.StreamAllocations, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	type dev struct{ node, uuid string }
	holder := map[dev]string{}
	live := map[string]contracts.Allocation{}
	everCommitted := map[string]bool{}
	stats := ledgerStats{bySource: map[string]int{}}
	var violations []string
	for seq := uint64(0); seq < info.State.LastSeq; {
		m, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
		if err != nil {
			t.Fatalf("oracle read after seq %d of %d: %v", seq, info.State.LastSeq, err)
		}
		md, _ := m.Metadata()
		seq = md.Sequence.Stream
		if !strings.HasPrefix(m.Subject(), "gp.alloc.ledger.") {
			continue
		}
		var e contracts.LedgerEntry
		if err := json.Unmarshal(m.Data(), &e); err != nil {
			violations = append(violations, fmt.Sprintf("seq %d: undecodable: %v", seq, err))
			continue
		}
		al := e.Allocation
		if m.Subject() != contracts.SubjectLedger(al.NodeID) {
			violations = append(violations, fmt.Sprintf("seq %d: %s on %s", seq, al.ID, m.Subject()))
		}
		switch e.Kind {
		case contracts.LedgerCommitted:
			stats.committed++
			stats.bySource[m.Headers().Get(contracts.HeaderCESource)]++
			if everCommitted[al.ID] {
				violations = append(violations, fmt.Sprintf("seq %d: %s committed twice", seq, al.ID))
			}
			everCommitted[al.ID] = true
			for _, d := range al.Devices {
				k := dev{al.NodeID, d.UUID}
				if other, held := holder[k]; held {
					violations = append(violations, fmt.Sprintf("G1 at seq %d: %s/%s given to %s while %s holds it", seq, k.node, k.uuid, al.ID, other))
				}
				holder[k] = al.ID
			}
			live[al.ID] = al
		case contracts.LedgerReleased:
			stats.released++
			held, ok := live[al.ID]
			if !ok {
				violations = append(violations, fmt.Sprintf("seq %d: %s released while not live", seq, al.ID))
				continue
			}
			for _, d := range held.Devices {
				delete(holder, dev{held.NodeID, d.UUID})
			}
			delete(live, al.ID)
		}
	}
	return violations, stats
}
