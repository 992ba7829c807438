package ledger

import (
	"errors"
	"fmt"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

func gpus(node string, n int, model string) []contracts.GPUInfo {
	out := make([]contracts.GPUInfo, n)
	for i := range out {
		out[i] = contracts.GPUInfo{Index: i, UUID: fmt.Sprintf("GPU-%s-%d", node, i), Model: model, Healthy: true}
	}
	return out
}

func dev(node string, i int, model string) contracts.DeviceRef {
	return contracts.DeviceRef{Index: i, UUID: fmt.Sprintf("GPU-%s-%d", node, i), Model: model}
}

func alloc(tenant, job string, attempt int, node string, devs ...contracts.DeviceRef) contracts.Allocation {
	return contracts.Allocation{ID: contracts.AllocationID(tenant, job, attempt), Tenant: tenant, JobID: job,
		Attempt: attempt, NodeID: node, Pool: "default", Devices: devs}
}

func committed(a contracts.Allocation) contracts.LedgerEntry {
	return contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a}
}

func released(a contracts.Allocation) contracts.LedgerEntry {
	return contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerReleased, Allocation: a, Reason: contracts.ReasonRunEnded}
}

// fixture: n1 ready with 4 H100s, GPU 0 held by acme/held; n2 known but
// lost; n3 ready with 2 A100s; acme/live-job holds n3 GPU 1 on attempt 1.
func fixture(t *testing.T) *Ledger {
	t.Helper()
	l := New()
	n1 := gpus("n1", 4, "H100-80GB")
	n1[3].Healthy = false // an XID made it unusable
	l.SetInventory(contracts.NodeInventory{NodeID: "n1", GPUs: n1})
	l.SetReady("n1", true)
	l.SetInventory(contracts.NodeInventory{NodeID: "n2", GPUs: gpus("n2", 4, "H100-80GB")})
	l.SetReady("n2", false)
	l.SetInventory(contracts.NodeInventory{NodeID: "n3", GPUs: gpus("n3", 2, "A100-80GB")})
	l.SetReady("n3", true)
	for i, e := range []contracts.LedgerEntry{
		committed(alloc("acme", "held", 1, "n1", dev("n1", 0, "H100-80GB"))),
		committed(alloc("acme", "live-job", 1, "n3", dev("n3", 1, "A100-80GB"))),
		committed(alloc("acme", "done", 1, "n3", dev("n3", 0, "A100-80GB"))),
		released(alloc("acme", "done", 1, "n3", dev("n3", 0, "A100-80GB"))),
	} {
		if err := l.Apply(e, uint64(i+1)); err != nil {
			t.Fatal(err)
		}
	}
	return l
}

func TestVerifyReasons(t *testing.T) {
	h := func(i int) contracts.DeviceRef { return dev("n1", i, "H100-80GB") }
	badID := alloc("acme", "j", 1, "n1", h(1))
	badID.ID = "acme/other/1"
	tests := map[string]struct {
		item contracts.Allocation
		want contracts.Reason
		dup  bool
	}{
		"fits":                     {item: alloc("acme", "j", 1, "n1", h(1), h(2))},
		"id not derived":           {item: badID, want: contracts.RefusedInvalidPlan},
		"no devices":               {item: alloc("acme", "j", 1, "n1"), want: contracts.RefusedInvalidPlan},
		"device twice":             {item: alloc("acme", "j", 1, "n1", h(1), h(1)), want: contracts.RefusedInvalidPlan},
		"node token":               {item: alloc("acme", "j", 1, "n1.x", h(1)), want: contracts.RefusedInvalidPlan},
		"tenant token":             {item: alloc("Acme!", "j", 1, "n1", h(1)), want: contracts.RefusedInvalidPlan},
		"attempt zero":             {item: alloc("acme", "j", 0, "n1", h(1)), want: contracts.RefusedInvalidPlan},
		"identical commit":         {item: alloc("acme", "held", 1, "n1", h(0)), dup: true},
		"identical after release":  {item: alloc("acme", "done", 1, "n3", dev("n3", 0, "A100-80GB")), dup: true},
		"same id elsewhere":        {item: alloc("acme", "held", 1, "n1", h(1)), want: contracts.RefusedAlreadyPlaced},
		"same id after release":    {item: alloc("acme", "done", 1, "n1", h(1)), want: contracts.RefusedAlreadyPlaced},
		"other attempt live":       {item: alloc("acme", "live-job", 2, "n1", h(1)), want: contracts.RefusedAlreadyPlaced},
		"next attempt after end":   {item: alloc("acme", "done", 2, "n1", h(1))},
		"unknown node":             {item: alloc("acme", "j", 1, "n9", h(1)), want: contracts.RefusedUnknownNode},
		"lost node":                {item: alloc("acme", "j", 1, "n2", dev("n2", 1, "H100-80GB")), want: contracts.RefusedNodeNotReady},
		"unknown uuid":             {item: alloc("acme", "j", 1, "n1", h(1), dev("n1", 7, "H100-80GB")), want: contracts.RefusedUnknownDevice},
		"uuid of another node":     {item: alloc("acme", "j", 1, "n1", dev("n3", 1, "A100-80GB")), want: contracts.RefusedUnknownDevice},
		"index mismatch":           {item: alloc("acme", "j", 1, "n1", contracts.DeviceRef{Index: 3, UUID: "GPU-n1-1", Model: "H100-80GB"}), want: contracts.RefusedUnknownDevice},
		"model mismatch":           {item: alloc("acme", "j", 1, "n1", dev("n1", 1, "A100-80GB")), want: contracts.RefusedModelMismatch},
		"taken":                    {item: alloc("acme", "j", 1, "n1", h(1), h(0)), want: contracts.RefusedDeviceTaken},
		"unhealthy":                {item: alloc("acme", "j", 1, "n1", h(1), h(3)), want: contracts.RefusedDeviceUnhealthy},
		"released device is free":  {item: alloc("acme", "j", 1, "n3", dev("n3", 0, "A100-80GB"))},
		"unknown beats taken":      {item: alloc("acme", "j", 1, "n1", h(0), dev("n1", 9, "H100-80GB")), want: contracts.RefusedUnknownDevice},
		"already placed beats bad": {item: alloc("acme", "held", 1, "n9", h(0)), want: contracts.RefusedAlreadyPlaced},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			l := fixture(t)
			v := l.Verify(tc.item)
			if v.Reason != tc.want || v.Duplicate != tc.dup {
				t.Fatalf("Verify = %+v, want reason %q duplicate %v", v, tc.want, tc.dup)
			}
			if v.Refused() && v.Message == "" {
				t.Errorf("refusal %q without a message", v.Reason)
			}
			if v.OK() != (tc.want == "" && !tc.dup) {
				t.Errorf("OK() = %v", v.OK())
			}
		})
	}
}

func TestApplyIsIdempotent(t *testing.T) {
	l := fixture(t)
	a := alloc("acme", "j", 1, "n1", dev("n1", 1, "H100-80GB"), dev("n1", 2, "H100-80GB"))
	if err := l.Apply(committed(a), 10); err != nil {
		t.Fatal(err)
	}
	snapshot := func() any {
		return map[string]any{"live": l.Live("n1"), "seq": l.LastSeq("n1"), "h1": l.Holder("n1", "GPU-n1-1"), "h2": l.Holder("n1", "GPU-n1-2")}
	}
	before := snapshot()
	// The same entry again: redelivered at the same sequence, replayed at
	// an older one, and re-published (deduplicated) with no sequence.
	for _, seq := range []uint64{10, 3, 0} {
		if err := l.Apply(committed(a), seq); err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(before, snapshot()); diff != "" {
			t.Fatalf("re-applying at seq %d changed the ledger (-before +after):\n%s", seq, diff)
		}
	}
	// A committed ID already present at a newer sequence moves only the
	// sequence.
	if err := l.Apply(committed(a), 11); err != nil {
		t.Fatal(err)
	}
	if got := l.LastSeq("n1"); got != 11 {
		t.Fatalf("LastSeq = %d, want 11", got)
	}
	if err := l.Apply(released(a), 12); err != nil {
		t.Fatal(err)
	}
	if err := l.Apply(released(a), 13); err != nil {
		t.Fatal(err)
	}
	if h := l.Holder("n1", "GPU-n1-1"); h != "" {
		t.Fatalf("GPU-n1-1 held by %q after release", h)
	}
	// A commit of a released ID never brings it back.
	if err := l.Apply(committed(a), 14); err != nil {
		t.Fatal(err)
	}
	if _, live, _ := l.Allocation(a.ID); live {
		t.Fatal("released allocation live again after a late commit")
	}
	if l.LiveCount("n1") != 1 {
		t.Fatalf("n1 live = %v, want only acme/held/1", l.Live("n1"))
	}
}

func TestApplyReportsConflictAndKeepsDeviceHeld(t *testing.T) {
	l := fixture(t)
	intruder := alloc("other", "x", 1, "n1", dev("n1", 0, "H100-80GB"))
	if err := l.Apply(committed(intruder), 20); !errors.Is(err, ErrConflict) {
		t.Fatalf("Apply of a double commit = %v, want ErrConflict", err)
	}
	// The first holder ends: the device must stay held by the intruder.
	if err := l.Apply(released(alloc("acme", "held", 1, "n1", dev("n1", 0, "H100-80GB"))), 21); err != nil {
		t.Fatal(err)
	}
	if h := l.Holder("n1", "GPU-n1-0"); h != intruder.ID {
		t.Fatalf("holder = %q, want %q", h, intruder.ID)
	}
	if v := l.Verify(alloc("acme", "j", 1, "n1", dev("n1", 0, "H100-80GB"))); v.Reason != contracts.RefusedDeviceTaken {
		t.Fatalf("Verify = %+v, want device_taken", v)
	}
}

func TestApplyRejectsInvalidEntryAndAdvance(t *testing.T) {
	l := New()
	if err := l.Apply(contracts.LedgerEntry{Kind: contracts.LedgerCommitted}, 1); !errors.Is(err, ErrInvalidEntry) {
		t.Fatalf("err = %v, want ErrInvalidEntry", err)
	}
	if err := l.Apply(contracts.LedgerEntry{Kind: "bogus", Allocation: alloc("a", "j", 1, "n1", dev("n1", 0, "L4"))}, 1); !errors.Is(err, ErrInvalidEntry) {
		t.Fatalf("err = %v, want ErrInvalidEntry", err)
	}
	if l.LastSeq("n1") != 0 {
		t.Fatal("an invalid entry moved the sequence")
	}
	l.Advance("n1", 5)
	l.Advance("n1", 2)
	if l.LastSeq("n1") != 5 {
		t.Fatalf("LastSeq = %d, want 5", l.LastSeq("n1"))
	}
}

func TestInventoryChangeKeepsHolders(t *testing.T) {
	l := fixture(t)
	// n1 comes back with only GPUs 2 and 3: GPU 0 stays held by its
	// allocation, GPU 1 is now unknown.
	inv := gpus("n1", 4, "H100-80GB")[2:]
	l.SetInventory(contracts.NodeInventory{NodeID: "n1", GPUs: inv})
	if h := l.Holder("n1", "GPU-n1-0"); h != "acme/held/1" {
		t.Fatalf("holder of a vanished GPU = %q", h)
	}
	if v := l.Verify(alloc("acme", "j", 1, "n1", dev("n1", 1, "H100-80GB"))); v.Reason != contracts.RefusedUnknownDevice {
		t.Fatalf("Verify = %+v, want unknown_device", v)
	}
}
