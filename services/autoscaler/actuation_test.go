package autoscaler_test

import (
	"context"
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/autoscaler"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/autoscaler/internal/actuate"
	"github.com/gpuplane/gpuplane/services/autoscaler/simcloud"
)

// Demand on the bus becomes a decision, the decision becomes machines at
// the simulated provider; then the idle one is drained through the
// NodeAdmin bucket and deleted, while the one the ledger shows busy stays.
func TestDecisionsAreActedOn(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	publish(t, b, contracts.SubjectInventory("h0"), "inv-h0", inventory("h0", "h100", "a3-highgpu-8g", 8, "H100-80GB"))

	clk := &clock{now: time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)}
	sim, err := simcloud.New(simcloud.Config{Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	cfg := autoscaler.DefaultConfig()
	cfg.Bus = busConfig(t, srv)
	cfg.Now = clk.Now
	cfg.Provider = sim
	// Min counts the provider's machines (h0 is not one): 0 here, so no
	// refill mixes with the decision's machines.
	cfg.Pools = map[string]actuate.Pool{"h100": {Min: 0, Max: 4, MachineType: "a3-highgpu-8g", PriceClass: cloud.OnDemand}}
	start(t, cfg)

	seq := publish(t, b, contracts.SubjectDemand("h100"), "d1", contracts.PoolDemand{SchemaVersion: 1, Pool: "h100",
		Nodes: 1, Waiting: []contracts.Shape{{Model: "H100-80GB", GPUs: 8, Count: 2}}})
	id := "scale/h100/" + itoa(seq) + "/up-3"
	eventually(t, "two machines created", func() bool { return len(sim.Machines()) == 2 })
	if diff := cmp.Diff([]string{id + "#0", id + "#1"}, tokens(sim.Machines())); diff != "" {
		t.Fatalf("tokens (-want +got):\n%s", diff)
	}

	// Both boot; the ledger shows work on the first.
	sim.Advance()
	publish(t, b, contracts.SubjectLedger("h100-1"), "l1", contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted,
		Allocation: contracts.Allocation{ID: "t/j/1", Tenant: "t", JobID: "j", Attempt: 1, NodeID: "h100-1", Pool: "h100",
			Priority: contracts.PriorityNormal}})
	clk.Advance(time.Minute)
	eventually(t, "idle machine deleted", func() bool {
		ms := sim.Machines()
		return len(ms) == 2 && ms[1].State == cloud.Deleted
	})
	if st := sim.Machines()[0].State; st != cloud.Running {
		t.Errorf("busy machine h100-1 is %s; want running", st)
	}

	// The hold was written (cordon + drain, by the autoscaler), then lifted.
	kv, err := b.KeyValue(context.Background(), contracts.BucketNodeAdmin)
	if err != nil {
		t.Fatal(err)
	}
	hist, err := kv.History(context.Background(), "h100-2")
	if err != nil {
		t.Fatal(err)
	}
	if len(hist) != 2 {
		t.Fatalf("hold history of h100-2: %d entries; want put then delete", len(hist))
	}
	var na contracts.NodeAdmin
	if err := json.Unmarshal(hist[0].Value(), &na); err != nil {
		t.Fatal(err)
	}
	if !na.Cordoned || !na.Drain || na.NodeID != "h100-2" {
		t.Errorf("hold = %+v; want cordon and drain of h100-2", na)
	}
	if _, err := kv.Get(context.Background(), "h100-1"); err == nil {
		t.Error("busy h100-1 has a hold")
	}
}

func tokens(ms []cloud.Machine) []string {
	var out []string
	for _, m := range ms {
		out = append(out, m.Token)
	}
	slices.Sort(out)
	return out
}

func itoa(n uint64) string { b, _ := json.Marshal(n); return string(b) }

// eventually polls cond until it holds, failing after a bounded wait.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
