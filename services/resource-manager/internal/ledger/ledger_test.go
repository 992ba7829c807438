package ledger

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
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

// The MIG instances of fixture node n4's GPU 0 (H100-80GB in MIG mode):
// a 3g.40gb held by acme/mig-held, a free 2g.20gb and a free 1g.10gb.
var (
	migHeld = contracts.MIGInstance{UUID: "MIG-n4-0-a", Profile: "3g.40gb", GIID: 1, Start: 0, Size: 4, MemoryMiB: 40448}
	migB    = contracts.MIGInstance{UUID: "MIG-n4-0-b", Profile: "2g.20gb", GIID: 2, Start: 4, Size: 2, MemoryMiB: 20096}
	migC    = contracts.MIGInstance{UUID: "MIG-n4-0-c", Profile: "1g.10gb", GIID: 3, Start: 6, Size: 1, MemoryMiB: 9984}
)

// migDev asks for instance m of GPU i of node.
func migDev(node string, i int, m contracts.MIGInstance) contracts.DeviceRef {
	d := dev(node, i, "H100-80GB")
	d.MIG = &m
	return d
}

// shareDev asks for a share of GPU i of node.
func shareDev(node string, i int, model string, mib int64, pct int) contracts.DeviceRef {
	d := dev(node, i, model)
	d.Share = &contracts.GPUShare{MemoryMiB: mib, ComputePercent: pct}
	return d
}

// n4GPUs: GPU 0 in MIG mode with migHeld, migB and migC; GPU 1 shared
// (40000 MiB and 50% held by acme/share-held); GPU 2 in MIG mode with two
// instances on the same memory slices (an inconsistent report); GPU 3
// free.
func n4GPUs() []contracts.GPUInfo {
	g := gpus("n4", 4, "H100-80GB")
	for i := range g {
		g[i].MemoryMiB = 81559
	}
	g[0].MIGEnabled, g[0].MIGInstances = true, []contracts.MIGInstance{migHeld, migB, migC}
	g[2].MIGEnabled = true
	g[2].MIGInstances = []contracts.MIGInstance{
		{UUID: "MIG-n4-2-a", Profile: "4g.40gb", Start: 0, Size: 4},
		{UUID: "MIG-n4-2-b", Profile: "3g.40gb", Start: 0, Size: 4},
	}
	return g
}

func committed(a contracts.Allocation) contracts.LedgerEntry {
	return contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a}
}

func released(a contracts.Allocation) contracts.LedgerEntry {
	return contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerReleased, Allocation: a, Reason: contracts.ReasonRunEnded}
}

// fixture: n1 ready with 4 H100s (memory unknown), GPU 0 held by
// acme/held; n2 known but lost; n3 ready with 2 A100s; acme/live-job
// holds n3 GPU 1 on attempt 1; n4 ready with n4GPUs.
func fixture(t *testing.T) *Ledger {
	t.Helper()
	l := New(testKeep)
	n1 := gpus("n1", 4, "H100-80GB")
	n1[3].Healthy = false // an XID made it unusable
	for _, inv := range []contracts.NodeInventory{
		{NodeID: "n1", GPUs: n1},
		{NodeID: "n2", GPUs: gpus("n2", 4, "H100-80GB")},
		{NodeID: "n3", GPUs: gpus("n3", 2, "A100-80GB")},
	} {
		if err := l.SetInventory(inv); err != nil {
			t.Fatal(err)
		}
	}
	l.SetReady("n1", true)
	l.SetReady("n2", false)
	l.SetReady("n3", true)
	if err := l.SetInventory(contracts.NodeInventory{NodeID: "n4", GPUs: n4GPUs()}); err == nil || !strings.Contains(err.Error(), "GPU-n4-2") {
		t.Fatalf("SetInventory of a MIG layout with overlapping instances = %v, want an error naming GPU-n4-2", err)
	}
	l.SetReady("n4", true)
	for i, e := range []contracts.LedgerEntry{
		committed(alloc("acme", "held", 1, "n1", dev("n1", 0, "H100-80GB"))),
		committed(alloc("acme", "live-job", 1, "n3", dev("n3", 1, "A100-80GB"))),
		committed(alloc("acme", "done", 1, "n3", dev("n3", 0, "A100-80GB"))),
		released(alloc("acme", "done", 1, "n3", dev("n3", 0, "A100-80GB"))),
		committed(alloc("acme", "mig-held", 1, "n4", migDev("n4", 0, migHeld))),
		committed(alloc("acme", "share-held", 1, "n4", shareDev("n4", 1, "H100-80GB", 40000, 50))),
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

		// MIG instances.
		"mig fits":                 {item: alloc("acme", "j", 1, "n4", migDev("n4", 0, migB))},
		"two instances of one gpu": {item: alloc("acme", "j", 1, "n4", migDev("n4", 0, migB), migDev("n4", 0, migC))},
		"mig with whole and share": {item: alloc("acme", "j", 1, "n4", migDev("n4", 0, migB), dev("n4", 3, "H100-80GB"), shareDev("n4", 1, "H100-80GB", 1000, 10))},
		"mig instance twice":       {item: alloc("acme", "j", 1, "n4", migDev("n4", 0, migB), migDev("n4", 0, migB)), want: contracts.RefusedInvalidPlan},
		"mig without uuid":         {item: alloc("acme", "j", 1, "n4", migDev("n4", 0, contracts.MIGInstance{Profile: "2g.20gb", Start: 4, Size: 2})), want: contracts.RefusedInvalidPlan},
		"mig and share in one ref": {item: alloc("acme", "j", 1, "n4", func() contracts.DeviceRef {
			d := migDev("n4", 0, migB)
			d.Share = &contracts.GPUShare{MemoryMiB: 1, ComputePercent: 1}
			return d
		}()), want: contracts.RefusedInvalidPlan},
		"mig and whole of one gpu":     {item: alloc("acme", "j", 1, "n4", migDev("n4", 0, migB), dev("n4", 0, "H100-80GB")), want: contracts.RefusedInvalidPlan},
		"mig taken":                    {item: alloc("acme", "j", 1, "n4", migDev("n4", 0, migHeld)), want: contracts.RefusedMIGInstanceTaken},
		"mig unknown uuid":             {item: alloc("acme", "j", 1, "n4", migDev("n4", 0, contracts.MIGInstance{UUID: "MIG-nope", Profile: "2g.20gb", Start: 4, Size: 2})), want: contracts.RefusedMIGInstanceUnknown},
		"mig wrong profile":            {item: alloc("acme", "j", 1, "n4", migDev("n4", 0, contracts.MIGInstance{UUID: migB.UUID, Profile: "1g.20gb", Start: 4, Size: 2})), want: contracts.RefusedMIGInstanceUnknown},
		"mig wrong placement":          {item: alloc("acme", "j", 1, "n4", migDev("n4", 0, contracts.MIGInstance{UUID: migB.UUID, Profile: "2g.20gb", Start: 2, Size: 2})), want: contracts.RefusedMIGInstanceUnknown},
		"mig on a gpu not in mig mode": {item: alloc("acme", "j", 1, "n4", migDev("n4", 3, migB)), want: contracts.RefusedMIGDisabled},
		"whole of a mig gpu":           {item: alloc("acme", "j", 1, "n4", dev("n4", 0, "H100-80GB")), want: contracts.RefusedMIGEnabled},
		"share of a mig gpu":           {item: alloc("acme", "j", 1, "n4", shareDev("n4", 0, "H100-80GB", 1000, 10)), want: contracts.RefusedMIGEnabled},
		"inconsistent mig gpu":         {item: alloc("acme", "j", 1, "n4", migDev("n4", 2, contracts.MIGInstance{UUID: "MIG-n4-2-a", Profile: "4g.40gb", Start: 0, Size: 4})), want: contracts.RefusedMIGInventoryInvalid},
		"whole of an inconsistent gpu": {item: alloc("acme", "j", 1, "n4", dev("n4", 2, "H100-80GB")), want: contracts.RefusedMIGInventoryInvalid},
		"identical mig commit":         {item: alloc("acme", "mig-held", 1, "n4", migDev("n4", 0, migHeld)), dup: true},
		"same mig id, other instance":  {item: alloc("acme", "mig-held", 1, "n4", migDev("n4", 0, migB)), want: contracts.RefusedAlreadyPlaced},
		"unhealthy beats mig mode":     {item: alloc("acme", "j", 1, "n1", migDev("n1", 3, migB)), want: contracts.RefusedDeviceUnhealthy},
		"mig invalid beats taken":      {item: alloc("acme", "j", 1, "n4", migDev("n4", 0, migHeld), dev("n4", 2, "H100-80GB")), want: contracts.RefusedMIGInventoryInvalid},
		"mig taken in item order":      {item: alloc("acme", "j", 1, "n4", dev("n4", 1, "H100-80GB"), migDev("n4", 0, migHeld)), want: contracts.RefusedGPUShared},

		// Shares.
		"share fits the rest":         {item: alloc("acme", "j", 1, "n4", shareDev("n4", 1, "H100-80GB", 41559, 50))},
		"share of a free gpu":         {item: alloc("acme", "j", 1, "n4", shareDev("n4", 3, "H100-80GB", 81559, 100))},
		"share past memory":           {item: alloc("acme", "j", 1, "n4", shareDev("n4", 1, "H100-80GB", 41560, 10)), want: contracts.RefusedShareExceedsGPU},
		"share past compute":          {item: alloc("acme", "j", 1, "n4", shareDev("n4", 1, "H100-80GB", 1000, 51)), want: contracts.RefusedShareExceedsGPU},
		"share bigger than the card":  {item: alloc("acme", "j", 1, "n4", shareDev("n4", 3, "H100-80GB", 81560, 10)), want: contracts.RefusedShareExceedsGPU},
		"share of overflowing memory": {item: alloc("acme", "j", 1, "n4", shareDev("n4", 1, "H100-80GB", math.MaxInt64, 1)), want: contracts.RefusedShareExceedsGPU},
		"share of unknown memory":     {item: alloc("acme", "j", 1, "n1", shareDev("n1", 1, "H100-80GB", 1, 1)), want: contracts.RefusedShareExceedsGPU},
		"share of a held gpu":         {item: alloc("acme", "j", 1, "n1", shareDev("n1", 0, "H100-80GB", 1, 1)), want: contracts.RefusedDeviceTaken},
		"whole of a shared gpu":       {item: alloc("acme", "j", 1, "n4", dev("n4", 1, "H100-80GB")), want: contracts.RefusedGPUShared},
		"share of zero memory":        {item: alloc("acme", "j", 1, "n4", shareDev("n4", 3, "H100-80GB", 0, 10)), want: contracts.RefusedInvalidPlan},
		"share of zero compute":       {item: alloc("acme", "j", 1, "n4", shareDev("n4", 3, "H100-80GB", 10, 0)), want: contracts.RefusedInvalidPlan},
		"share past 100%":             {item: alloc("acme", "j", 1, "n4", shareDev("n4", 3, "H100-80GB", 10, 101)), want: contracts.RefusedInvalidPlan},
		"two shares of one gpu":       {item: alloc("acme", "j", 1, "n4", shareDev("n4", 3, "H100-80GB", 10, 10), shareDev("n4", 3, "H100-80GB", 10, 10)), want: contracts.RefusedInvalidPlan},
		"share and whole of one gpu":  {item: alloc("acme", "j", 1, "n4", shareDev("n4", 3, "H100-80GB", 10, 10), dev("n4", 3, "H100-80GB")), want: contracts.RefusedInvalidPlan},
		"identical share commit":      {item: alloc("acme", "share-held", 1, "n4", shareDev("n4", 1, "H100-80GB", 40000, 50)), dup: true},
		"same share id, other amount": {item: alloc("acme", "share-held", 1, "n4", shareDev("n4", 1, "H100-80GB", 40000, 40)), want: contracts.RefusedAlreadyPlaced},
		"same share id, whole gpu":    {item: alloc("acme", "share-held", 1, "n4", dev("n4", 1, "H100-80GB")), want: contracts.RefusedAlreadyPlaced},
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
	l := New(testKeep)
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

func TestMIGModeChangeKeepsHolders(t *testing.T) {
	l := fixture(t)
	// An administrator turns MIG off on GPU 0 (its instances go) while
	// acme/mig-held still holds one, turns it on for GPU 1 (shared by
	// acme/share-held) and fixes GPU 2's layout.
	g := n4GPUs()
	g[0].MIGEnabled, g[0].MIGInstances = false, nil
	g[1].MIGEnabled, g[1].MIGInstances = true, []contracts.MIGInstance{{UUID: "MIG-n4-1-a", Profile: "7g.80gb", Size: 8}}
	fixed := contracts.MIGInstance{UUID: "MIG-n4-2-a", Profile: "4g.40gb", Start: 0, Size: 4}
	g[2].MIGInstances = []contracts.MIGInstance{fixed}
	if err := l.SetInventory(contracts.NodeInventory{NodeID: "n4", GPUs: g}); err != nil {
		t.Fatal(err)
	}
	if h := l.Holder("n4", migHeld.UUID); h != "acme/mig-held/1" {
		t.Fatalf("holder of a MIG instance gone from the inventory = %q", h)
	}
	if used, holders := l.Shared("n4", "GPU-n4-1"); used.ComputePercent != 50 || len(holders) != 1 {
		t.Fatalf("Shared(GPU-n4-1) = %+v %v, want 50%% by acme/share-held", used, holders)
	}
	tests := map[string]struct {
		item contracts.Allocation
		want contracts.Reason
	}{
		"whole while an instance is held": {item: alloc("acme", "j", 1, "n4", dev("n4", 0, "H100-80GB")), want: contracts.RefusedGPUShared},
		"share while an instance is held": {item: alloc("acme", "j", 1, "n4", shareDev("n4", 0, "H100-80GB", 10, 10)), want: contracts.RefusedDeviceTaken},
		"instance while shares are held":  {item: alloc("acme", "j", 1, "n4", migDev("n4", 1, g[1].MIGInstances[0])), want: contracts.RefusedDeviceTaken},
		"gone instance":                   {item: alloc("acme", "j", 1, "n4", migDev("n4", 0, migB)), want: contracts.RefusedMIGDisabled},
		"fixed layout":                    {item: alloc("acme", "j", 1, "n4", migDev("n4", 2, fixed))},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			if v := l.Verify(tc.item); v.Reason != tc.want || v.Duplicate {
				t.Fatalf("Verify = %+v, want %q", v, tc.want)
			}
		})
	}
	// Once the instance's allocation ends, the GPU is whole again.
	if err := l.Apply(released(alloc("acme", "mig-held", 1, "n4", migDev("n4", 0, migHeld))), 20); err != nil {
		t.Fatal(err)
	}
	if v := l.Verify(alloc("acme", "j", 1, "n4", dev("n4", 0, "H100-80GB"))); !v.OK() {
		t.Fatalf("Verify of the freed GPU = %+v", v)
	}
}

func TestApplyReleasesExactlyWhatWasHeld(t *testing.T) {
	l := fixture(t)
	a := alloc("acme", "j", 1, "n4", migDev("n4", 0, migB), migDev("n4", 0, migC), shareDev("n4", 1, "H100-80GB", 20000, 25),
		dev("n4", 3, "H100-80GB"))
	if v := l.Verify(a); !v.OK() {
		t.Fatalf("Verify = %+v", v)
	}
	snapshot := func() map[string]any {
		used, holders := l.Shared("n4", "GPU-n4-1")
		var live []string
		for _, x := range l.Live("n4") {
			live = append(live, x.ID)
		}
		return map[string]any{"live": live, "b": l.Holder("n4", migB.UUID), "c": l.Holder("n4", migC.UUID),
			"held": l.Holder("n4", migHeld.UUID), "used": used, "holders": holders, "gpu3": l.Holder("n4", "GPU-n4-3")}
	}
	before := snapshot()
	if err := l.Apply(committed(a), 10); err != nil {
		t.Fatal(err)
	}
	held := snapshot()
	want := map[string]any{"live": []string{a.ID, "acme/mig-held/1", "acme/share-held/1"},
		"b": a.ID, "c": a.ID, "held": "acme/mig-held/1", "used": contracts.GPUShare{MemoryMiB: 60000, ComputePercent: 75},
		"holders": []string{"acme/share-held/1", a.ID}, "gpu3": a.ID}
	if diff := cmp.Diff(want, held); diff != "" {
		t.Fatalf("after commit (-want +got):\n%s", diff)
	}
	for _, seq := range []uint64{10, 0} {
		if err := l.Apply(committed(a), seq); err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(held, snapshot()); diff != "" {
			t.Fatalf("re-applying at seq %d changed the ledger (-before +after):\n%s", seq, diff)
		}
	}
	for _, seq := range []uint64{11, 12, 0} {
		if err := l.Apply(released(a), seq); err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(before, snapshot()); diff != "" {
			t.Fatalf("after release at seq %d (-before commit +after):\n%s", seq, diff)
		}
	}
}

func TestApplyReportsMIGAndShareConflicts(t *testing.T) {
	tests := map[string]struct {
		intruder contracts.DeviceRef
		// check says whether the intruder still holds its claim after
		// the fixture's holder is released.
		check func(l *Ledger) bool
	}{
		"mig instance twice": {intruder: migDev("n4", 0, migHeld),
			check: func(l *Ledger) bool { return l.Holder("n4", migHeld.UUID) == "other/x/1" }},
		"shares past the card": {intruder: shareDev("n4", 1, "H100-80GB", 50000, 10),
			check: func(l *Ledger) bool {
				used, h := l.Shared("n4", "GPU-n4-1")
				return used.MemoryMiB == 50000 && slices.Equal(h, []string{"other/x/1"})
			}},
		"whole of a shared gpu": {intruder: dev("n4", 1, "H100-80GB"),
			check: func(l *Ledger) bool { return l.Holder("n4", "GPU-n4-1") == "other/x/1" }},
		"whole of a mig gpu with an instance held": {intruder: dev("n4", 0, "H100-80GB"),
			check: func(l *Ledger) bool { return l.Holder("n4", "GPU-n4-0") == "other/x/1" }},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			l := fixture(t)
			if err := l.Apply(committed(alloc("other", "x", 1, "n4", tc.intruder)), 20); !errors.Is(err, ErrConflict) {
				t.Fatalf("Apply = %v, want ErrConflict", err)
			}
			for _, a := range []contracts.Allocation{
				alloc("acme", "mig-held", 1, "n4", migDev("n4", 0, migHeld)),
				alloc("acme", "share-held", 1, "n4", shareDev("n4", 1, "H100-80GB", 40000, 50)),
			} {
				if err := l.Apply(released(a), 0); err != nil {
					t.Fatal(err)
				}
			}
			if !tc.check(l) {
				t.Fatal("the intruder's claim was lost when the first holder was released")
			}
		})
	}
}

// hostLedger: n1 ready with 4 H100s, 16 CPUs and 64 GiB of host memory,
// of which acme/held holds GPU 0, 12 CPUs and 48 GiB; n2 ready with 4
// H100s and a host of unknown size (an inventory that declares 0).
func hostLedger(t *testing.T) *Ledger {
	t.Helper()
	l := New(testKeep)
	for _, inv := range []contracts.NodeInventory{
		{NodeID: "n1", GPUs: gpus("n1", 4, "H100-80GB"), CPUMilli: 16000, MemoryMiB: 65536},
		{NodeID: "n2", GPUs: gpus("n2", 4, "H100-80GB")},
	} {
		if err := l.SetInventory(inv); err != nil {
			t.Fatal(err)
		}
		l.SetReady(inv.NodeID, true)
	}
	held := alloc("acme", "held", 1, "n1", dev("n1", 0, "H100-80GB"))
	held.CPUMilli, held.MemoryMiB = 12000, 49152
	if err := l.Apply(committed(held), 1); err != nil {
		t.Fatal(err)
	}
	return l
}

func TestVerifyHostCapacity(t *testing.T) {
	item := func(node string, cpu, mem int64) contracts.Allocation {
		a := alloc("acme", "j", 1, node, dev(node, 1, "H100-80GB"))
		a.CPUMilli, a.MemoryMiB = cpu, mem
		return a
	}
	tests := map[string]struct {
		item contracts.Allocation
		want contracts.Reason
	}{
		"nothing asked":          {item: item("n1", 0, 0)},
		"exactly what is left":   {item: item("n1", 4000, 16384)},
		"one milli-CPU too many": {item: item("n1", 4001, 0), want: contracts.RefusedHostCapacity},
		"one MiB too many":       {item: item("n1", 0, 16385), want: contracts.RefusedHostCapacity},
		"unknown host takes any": {item: item("n2", contracts.MaxCPUMilli, contracts.MaxHostMemoryMiB)},
		"negative cpu":           {item: item("n1", -1, 0), want: contracts.RefusedInvalidPlan},
		"more than any machine":  {item: item("n2", 0, contracts.MaxHostMemoryMiB+1), want: contracts.RefusedInvalidPlan},
		"device checks come first": {item: func() contracts.Allocation {
			a := item("n1", 99000, 0)
			a.Devices[0] = dev("n1", 0, "H100-80GB")
			return a
		}(), want: contracts.RefusedDeviceTaken},
		"overflow does not wrap":    {item: item("n1", contracts.MaxCPUMilli, contracts.MaxHostMemoryMiB), want: contracts.RefusedHostCapacity},
		"cordon comes before hosts": {item: item("n3", 99000, 0), want: contracts.RefusedNodeCordoned},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			l := hostLedger(t)
			if err := l.SetInventory(contracts.NodeInventory{NodeID: "n3", GPUs: gpus("n3", 2, "H100-80GB"), CPUMilli: 1000}); err != nil {
				t.Fatal(err)
			}
			l.SetReady("n3", true)
			l.SetAdmin("n3", contracts.NodeAdmin{NodeID: "n3", Cordoned: true})
			v := l.Verify(tc.item)
			if v.Reason != tc.want || v.Duplicate {
				t.Fatalf("Verify = %+v, want reason %q", v, tc.want)
			}
			if v.Refused() && v.Message == "" {
				t.Errorf("refusal %q without a message", v.Reason)
			}
		})
	}
}

// TestHostCapacityFollowsCommitsAndReleases: what a release gives back is
// what its commit took, and a shrunken inventory refuses until enough is
// released.
func TestHostCapacityFollowsCommitsAndReleases(t *testing.T) {
	l := hostLedger(t)
	a := alloc("acme", "a", 1, "n1", dev("n1", 1, "H100-80GB"))
	a.CPUMilli, a.MemoryMiB = 4000, 16384
	if v := l.Verify(a); !v.OK() {
		t.Fatalf("Verify(a) = %+v", v)
	}
	if err := l.Apply(committed(a), 2); err != nil {
		t.Fatal(err)
	}
	if cpu, mem := l.HostUsed("n1"); cpu != 16000 || mem != 65536 {
		t.Fatalf("HostUsed = %d, %d; want the whole host", cpu, mem)
	}
	b := alloc("acme", "b", 1, "n1", dev("n1", 2, "H100-80GB"))
	b.CPUMilli = 1
	if v := l.Verify(b); v.Reason != contracts.RefusedHostCapacity || !strings.Contains(v.Message, "16000 of 16000 milli-CPUs") {
		t.Fatalf("Verify(b) on a full host = %+v", v)
	}
	// The machine comes back smaller: what is held stays held.
	if err := l.SetInventory(contracts.NodeInventory{NodeID: "n1", GPUs: gpus("n1", 4, "H100-80GB"), CPUMilli: 8000, MemoryMiB: 65536}); err != nil {
		t.Fatal(err)
	}
	if err := l.Apply(released(a), 3); err != nil {
		t.Fatal(err)
	}
	if v := l.Verify(b); v.Reason != contracts.RefusedHostCapacity {
		t.Fatalf("Verify(b) with 12000 of 8000 held = %+v", v)
	}
	b.CPUMilli = 0
	if v := l.Verify(b); !v.OK() {
		t.Fatalf("Verify(b) asking no CPU = %+v", v)
	}
	if err := l.Apply(released(alloc("acme", "held", 1, "n1", dev("n1", 0, "H100-80GB"))), 4); err != nil {
		t.Fatal(err)
	}
	if cpu, mem := l.HostUsed("n1"); cpu != 0 || mem != 0 {
		t.Fatalf("HostUsed after every release = %d, %d", cpu, mem)
	}
}

func TestVerifyCordon(t *testing.T) {
	tests := map[string]struct {
		admin   contracts.NodeAdmin
		item    contracts.Allocation
		want    contracts.Reason
		dup     bool
		message string
	}{
		"cordoned, with a reason": {admin: contracts.NodeAdmin{Cordoned: true, Reason: "replacing a fan"},
			item: alloc("acme", "j", 1, "n1", dev("n1", 1, "H100-80GB")), want: contracts.RefusedNodeCordoned,
			message: "node n1 is cordoned by an administrator: replacing a fan"},
		"draining": {admin: contracts.NodeAdmin{Cordoned: true, Drain: true, Reason: "kernel upgrade"},
			item: alloc("acme", "j", 1, "n1", dev("n1", 1, "H100-80GB")), want: contracts.RefusedNodeCordoned,
			message: "node n1 is being drained by an administrator: kernel upgrade"},
		"drain alone cordons": {admin: contracts.NodeAdmin{Drain: true},
			item: alloc("acme", "j", 1, "n1", dev("n1", 1, "H100-80GB")), want: contracts.RefusedNodeCordoned,
			message: "no reason given"},
		"uncordoned":               {admin: contracts.NodeAdmin{Reason: "back"}, item: alloc("acme", "j", 1, "n1", dev("n1", 1, "H100-80GB"))},
		"a redelivered commit":     {admin: contracts.NodeAdmin{Cordoned: true}, item: alloc("acme", "held", 1, "n1", dev("n1", 0, "H100-80GB")), dup: true},
		"not ready beats cordoned": {admin: contracts.NodeAdmin{Cordoned: true}, item: alloc("acme", "j", 1, "n2", dev("n2", 1, "H100-80GB")), want: contracts.RefusedNodeNotReady},
		"drained by the platform": {admin: contracts.NodeAdmin{Cordoned: true, Drain: true, Cause: contracts.ReasonSpotInterruption, Reason: "reclaim at 12:00"},
			item: alloc("acme", "j", 1, "n1", dev("n1", 1, "H100-80GB")), want: contracts.RefusedNodeCordoned,
			message: "node n1 is being drained for spot_interruption: reclaim at 12:00"},
		"a held GPU": {admin: gpuHeld("GPU-n1-1", contracts.GPUHold{Cordoned: true, Cause: contracts.ReasonGPUUnhealthy, Reason: "XID 79"}),
			item: alloc("acme", "j", 1, "n1", dev("n1", 2, "H100-80GB"), dev("n1", 1, "H100-80GB")), want: contracts.RefusedNodeCordoned,
			message: "GPU GPU-n1-1 on node n1 is cordoned for gpu_unhealthy: XID 79"},
		"a draining GPU, held by hand": {admin: gpuHeld("GPU-n1-1", contracts.GPUHold{Drain: true}),
			item: alloc("acme", "j", 1, "n1", dev("n1", 1, "H100-80GB")), want: contracts.RefusedNodeCordoned,
			message: "GPU GPU-n1-1 on node n1 is being drained by an administrator: no reason given"},
		"a share of a held GPU": {admin: gpuHeld("GPU-n1-1", contracts.GPUHold{Cordoned: true, Drain: true, Cause: contracts.ReasonOverheating}),
			item: alloc("acme", "j", 1, "n1", shareDev("n1", 1, "H100-80GB", 20480, 25)), want: contracts.RefusedNodeCordoned,
			message: "GPU GPU-n1-1 on node n1 is being drained for overheating"},
		"a MIG instance of a held GPU": {admin: gpuHeld("GPU-n4-0", contracts.GPUHold{Cordoned: true, Cause: contracts.ReasonGPUUnhealthy, Reason: "double-bit ECC"}),
			item: alloc("acme", "j", 1, "n4", migDev("n4", 0, migB)), want: contracts.RefusedNodeCordoned,
			message: "GPU GPU-n4-0 on node n4 is cordoned for gpu_unhealthy: double-bit ECC"},
		"a free MIG instance of the node": {admin: gpuHeld("GPU-n4-1", contracts.GPUHold{Cordoned: true}),
			item: alloc("acme", "j", 1, "n4", migDev("n4", 0, migB))},
		"another GPU of the node": {admin: gpuHeld("GPU-n1-1", contracts.GPUHold{Cordoned: true, Cause: contracts.ReasonGPUUnhealthy}),
			item: alloc("acme", "j", 1, "n1", dev("n1", 2, "H100-80GB"))},
		"a lifted GPU hold": {admin: gpuHeld("GPU-n1-1", contracts.GPUHold{Reason: "fixed"}),
			item: alloc("acme", "j", 1, "n1", dev("n1", 1, "H100-80GB"))},
		"an unknown device beats a hold": {admin: gpuHeld("GPU-n1-9", contracts.GPUHold{Cordoned: true}),
			item: alloc("acme", "j", 1, "n1", dev("n1", 9, "H100-80GB")), want: contracts.RefusedUnknownDevice},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			l := fixture(t)
			l.SetAdmin("n1", tc.admin)
			l.SetAdmin("n2", tc.admin)
			l.SetAdmin("n4", tc.admin)
			v := l.Verify(tc.item)
			if v.Reason != tc.want || v.Duplicate != tc.dup {
				t.Fatalf("Verify = %+v, want reason %q duplicate %v", v, tc.want, tc.dup)
			}
			if !strings.Contains(v.Message, tc.message) {
				t.Errorf("message %q does not say %q", v.Message, tc.message)
			}
		})
	}
}

// gpuHeld is a node admin record that holds one GPU only.
func gpuHeld(uuid string, h contracts.GPUHold) contracts.NodeAdmin {
	return contracts.NodeAdmin{GPUs: map[string]contracts.GPUHold{uuid: h}}
}

// part is rank of a gang of job over nodes, one GPU on its node.
func part(job string, attempt, rank int, nodes ...string) contracts.Allocation {
	node := nodes[rank]
	a := alloc("acme", job, attempt, node, dev(node, 1, "H100-80GB"))
	a.ID = contracts.AllocationPartID("acme", job, attempt, rank)
	a.Gang = &contracts.GangPart{Rank: rank, Size: len(nodes), Nodes: nodes}
	return a
}

func TestVerifyGangParts(t *testing.T) {
	l := New(testKeep)
	for _, n := range []string{"n1", "n2", "n3"} {
		if err := l.SetInventory(contracts.NodeInventory{NodeID: n, GPUs: gpus(n, 4, "H100-80GB")}); err != nil {
			t.Fatal(err)
		}
		l.SetReady(n, true)
	}
	// Rank 0 of acme/g attempt 1 over n1, n2 is live; so is a plain
	// allocation of acme/solo.
	if err := l.Apply(committed(part("g", 1, 0, "n1", "n2")), 1); err != nil {
		t.Fatal(err)
	}
	if err := l.Apply(committed(alloc("acme", "solo", 1, "n3", dev("n3", 0, "H100-80GB"))), 2); err != nil {
		t.Fatal(err)
	}
	with := func(a contracts.Allocation, f func(*contracts.Allocation)) contracts.Allocation {
		a.Gang = &contracts.GangPart{Rank: a.Gang.Rank, Size: a.Gang.Size, Nodes: slices.Clone(a.Gang.Nodes)}
		f(&a)
		return a
	}
	tests := map[string]struct {
		item contracts.Allocation
		want contracts.Reason
		dup  bool
	}{
		"the sibling part":         {item: part("g", 1, 1, "n1", "n2")},
		"rank 0 again":             {item: part("g", 1, 0, "n1", "n2"), dup: true},
		"another attempt's part":   {item: part("g", 2, 1, "n1", "n2"), want: contracts.RefusedAlreadyPlaced},
		"another gang of the job":  {item: part("g", 1, 1, "n3", "n2"), want: contracts.RefusedAlreadyPlaced},
		"a plain allocation of it": {item: alloc("acme", "g", 1, "n2", dev("n2", 1, "H100-80GB")), want: contracts.RefusedAlreadyPlaced},
		"a gang of a placed job":   {item: part("solo", 1, 0, "n1", "n2"), want: contracts.RefusedAlreadyPlaced},
		"a new gang":               {item: part("g2", 1, 2, "n1", "n2", "n3")},
		"plain id on a part":       {item: with(part("g2", 1, 0, "n1", "n2"), func(a *contracts.Allocation) { a.ID = contracts.AllocationID("acme", "g2", 1) }), want: contracts.RefusedInvalidPlan},
		"part id without gang":     {item: with(part("g2", 1, 0, "n1", "n2"), func(a *contracts.Allocation) { a.Gang = nil }), want: contracts.RefusedInvalidPlan},
		"rank past the size":       {item: with(part("g2", 1, 1, "n1", "n2"), func(a *contracts.Allocation) { a.Gang.Size = 1 }), want: contracts.RefusedInvalidPlan},
		"nodes short of the size":  {item: with(part("g2", 1, 1, "n1", "n2"), func(a *contracts.Allocation) { a.Gang.Size = 3 }), want: contracts.RefusedInvalidPlan},
		"rank on another node":     {item: with(part("g2", 1, 1, "n1", "n2"), func(a *contracts.Allocation) { a.Gang.Nodes[1] = "n3" }), want: contracts.RefusedInvalidPlan},
		"one machine twice":        {item: with(part("g2", 1, 1, "n1", "n2"), func(a *contracts.Allocation) { a.Gang.Nodes[0] = "n2" }), want: contracts.RefusedInvalidPlan},
		"an invalid gang node":     {item: with(part("g2", 1, 1, "n1", "n2"), func(a *contracts.Allocation) { a.Gang.Nodes[0] = "n.1" }), want: contracts.RefusedInvalidPlan},
		"a part's device is taken": {item: part("g2", 1, 0, "n1", "n2"), want: contracts.RefusedDeviceTaken},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			v := l.Verify(tc.item)
			if v.Reason != tc.want || v.Duplicate != tc.dup {
				t.Fatalf("Verify(%s) = %+v, want reason %q duplicate %v", tc.item.ID, v, tc.want, tc.dup)
			}
		})
	}
	// Both parts live, then released one by one: the job holds nothing
	// after, and its next attempt fits.
	p1 := part("g", 1, 1, "n1", "n2")
	for i, e := range []contracts.LedgerEntry{committed(p1), released(part("g", 1, 0, "n1", "n2")), released(p1)} {
		if err := l.Apply(e, uint64(3+i)); err != nil {
			t.Fatal(err)
		}
	}
	if v := l.Verify(part("g", 2, 0, "n1", "n2")); !v.OK() {
		t.Fatalf("next attempt after both parts released: %+v", v)
	}
}

// testKeep is how long the tests' ledgers keep retired records: as long
// as a resource manager with the default plan age does.
var testKeep = Keep(contracts.PlansMaxAge, DefaultMargin)
