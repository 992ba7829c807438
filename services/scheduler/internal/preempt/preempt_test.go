package preempt_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/preempt"
)

type ruleCase struct {
	nodes      []placement.Node
	running    []preempt.Running
	p          preempt.Preemptor
	minRuntime time.Duration
	spare      map[preempt.TenantPool]int64
	// victims are the allocation IDs evicted and on the nodes the
	// preemptor goes to; nil victims with nil on: no choice.
	victims []string
	on      []string
}

func TestChooseRules(t *testing.T) {
	tests := map[string]ruleCase{
		"picks the lowest priority": {
			nodes:   []placement.Node{node("n1", 2)},
			running: []preempt.Running{job("normal", "n1", norm, cards(0)), job("besteffort", "n1", be, cards(1))},
			p:       wants(crit, 1),
			victims: []string{"besteffort"}, on: []string{"n1"},
		},
		"priority before fewest GPUs": {
			nodes:   []placement.Node{node("n1", 4)},
			running: []preempt.Running{job("big-be", "n1", be, cards(0, 1, 2)), job("small-normal", "n1", norm, cards(3))},
			p:       wants(high, 1),
			victims: []string{"big-be"}, on: []string{"n1"},
		},
		"priority before fewest jobs": {
			nodes: []placement.Node{node("n1", 4)},
			running: []preempt.Running{job("pair-normal", "n1", norm, cards(0, 1)),
				job("be-a", "n1", be, cards(2)), job("be-b", "n1", be, cards(3))},
			p:       wants(high, 2),
			victims: []string{"be-a", "be-b"}, on: []string{"n1"},
		},
		"priority before fewest jobs, across nodes (issue 18)": {
			nodes: []placement.Node{node("n1", 8), node("n2", 8)},
			running: []preempt.Running{job("high-8", "n1", high, cards(0, 1, 2, 3, 4, 5, 6, 7)),
				job("normal-4", "n2", norm, cards(0, 1, 2, 3)), job("be-4", "n2", be, cards(4, 5, 6, 7))},
			p:       wants(crit, 8),
			victims: []string{"normal-4", "be-4"}, on: []string{"n2"},
		},
		"fewest GPUs within the lowest class": {
			nodes:   []placement.Node{node("n1", 4)},
			running: []preempt.Running{job("be-3", "n1", be, cards(0, 1, 2)), job("be-1", "n1", be, cards(3))},
			p:       wants(high, 1),
			victims: []string{"be-1"}, on: []string{"n1"},
		},
		"priority never reaches another tenant's work within its guarantee": {
			nodes: []placement.Node{node("n1", 4)},
			running: []preempt.Running{job("qa3", "n1", norm, cards(0), withinGuarantee()), job("qa4", "n1", norm, cards(1), withinGuarantee()),
				job("qb3", "n1", norm, cards(2), tenant("research")), job("qb4", "n1", norm, cards(3), tenant("research"))},
			p:       wants(high, 2),
			victims: []string{"qb3", "qb4"}, on: []string{"n1"},
		},
		"priority reaches another tenant's borrowed work only": {
			nodes: []placement.Node{node("n1", 2)},
			running: []preempt.Running{job("within", "n1", be, cards(0), withinGuarantee()),
				job("borrowed", "n1", norm, cards(1))},
			p:       wants(high, 1),
			victims: []string{"borrowed"}, on: []string{"n1"},
		},
		"spare keeps a borrowing tenant at its guarantee": {
			// "other" holds 3 GPUs, 1 beyond its guarantee of 2: two of its
			// single-GPU jobs may not both go.
			nodes: []placement.Node{node("n1", 4)},
			running: []preempt.Running{job("o1", "n1", be, cards(0), inQuotaPool("h100")), job("o2", "n1", be, cards(1), inQuotaPool("h100")),
				job("o3", "n1", be, cards(2), inQuotaPool("h100")), job("own", "n1", norm, cards(3), tenant("research"))},
			spare:   map[preempt.TenantPool]int64{{Tenant: "other", Pool: "h100"}: 1000},
			p:       wants(high, 2),
			victims: []string{"o1", "own"}, on: []string{"n1"},
		},
		"spare bounds reclaim too": {
			nodes:   []placement.Node{node("n1", 2)},
			running: []preempt.Running{job("o1", "n1", norm, cards(0, 1), inQuotaPool("h100"))},
			spare:   map[preempt.TenantPool]int64{{Tenant: "other", Pool: "h100"}: 1000},
			p:       wants(norm, 1, reclaim()),
		},
		"spare is per tenant and pool, summed over a multi-machine choice": {
			nodes: []placement.Node{node("n1", 1), node("n2", 1), node("n3", 1)},
			running: []preempt.Running{job("o1", "n1", be, cards(0), inQuotaPool("h100")), job("o2", "n2", be, cards(0), inQuotaPool("h100")),
				job("own", "n3", norm, cards(0), tenant("research"))},
			spare:   map[preempt.TenantPool]int64{{Tenant: "other", Pool: "h100"}: 1000},
			p:       wants(high, 2, machines(2, contracts.TopologyAny)),
			victims: []string{"o1", "own"}, on: []string{"n1", "n3"},
		},
		"fewest GPUs across nodes": {
			nodes: []placement.Node{node("n1", 4), node("n2", 4)},
			running: []preempt.Running{job("n1-all", "n1", be, cards(0, 1, 2, 3)),
				job("n2-half", "n2", be, cards(0, 1)), job("n2-rest", "n2", crit, cards(2, 3))},
			p:       wants(high, 2),
			victims: []string{"n2-half"}, on: []string{"n2"},
		},
		"least progress lost": {
			nodes: []placement.Node{node("n1", 2)},
			running: []preempt.Running{job("old", "n1", be, cards(0), started(3*time.Hour)),
				job("young", "n1", be, cards(1), started(time.Hour))},
			p:       wants(high, 1),
			victims: []string{"young"}, on: []string{"n1"},
		},
		"least progress lost counts from the last checkpoint": {
			nodes: []placement.Node{node("n1", 2)},
			running: []preempt.Running{job("old-checkpointed", "n1", be, cards(0), started(3*time.Hour), checkpointed(10*time.Minute)),
				job("young", "n1", be, cards(1), started(time.Hour))},
			p:       wants(high, 1),
			victims: []string{"old-checkpointed"}, on: []string{"n1"},
		},
		"a job not started loses nothing": {
			nodes: []placement.Node{node("n1", 2)},
			running: []preempt.Running{job("running", "n1", be, cards(0), started(time.Minute)),
				job("starting", "n1", be, cards(1), notStarted())},
			p:       wants(high, 1),
			victims: []string{"starting"}, on: []string{"n1"},
		},
		"checkpointable first": {
			nodes: []placement.Node{node("n1", 2)},
			running: []preempt.Running{job("plain", "n1", be, cards(0)),
				job("resumable", "n1", be, cards(1), checkpointable())},
			p:       wants(high, 1),
			victims: []string{"resumable"}, on: []string{"n1"},
		},
		"min runtime protects a lower priority job": {
			nodes: []placement.Node{node("n1", 2)},
			running: []preempt.Running{job("fresh-be", "n1", be, cards(0), started(30*time.Minute)),
				job("old-normal", "n1", norm, cards(1), started(2*time.Hour))},
			p: wants(high, 1), minRuntime: time.Hour,
			victims: []string{"old-normal"}, on: []string{"n1"},
		},
		"min runtime protects: no choice when only young jobs": {
			nodes:   []placement.Node{node("n1", 1)},
			running: []preempt.Running{job("fresh", "n1", be, cards(0), started(59*time.Minute))},
			p:       wants(high, 1), minRuntime: time.Hour,
		},
		"min runtime does not protect a job not started": {
			nodes:   []placement.Node{node("n1", 1)},
			running: []preempt.Running{job("starting", "n1", be, cards(0), notStarted())},
			p:       wants(high, 1), minRuntime: time.Hour,
			victims: []string{"starting"}, on: []string{"n1"},
		},
		"never evicts when it still would not fit": {
			nodes:   []placement.Node{node("n1", 4)},
			running: []preempt.Running{job("be", "n1", be, cards(0, 1)), job("crit", "n1", crit, cards(2, 3))},
			p:       wants(high, 4),
		},
		"never evicts when a card is held by a plan in flight": {
			nodes:   []placement.Node{node("n1", 2, heldCard(1))},
			running: []preempt.Running{job("be", "n1", be, cards(0))},
			p:       wants(high, 2),
		},
		"never evicts when host CPU stays short": {
			nodes:   []placement.Node{node("n1", 2, cpuFree(8000))},
			running: []preempt.Running{job("be", "n1", be, cards(0), host(4000, 0)), job("crit", "n1", crit, host(3000, 0))},
			p:       wants(high, 1, needsCPU(8000)),
		},
		"evicts for host CPU": {
			nodes:   []placement.Node{node("n1", 2, cpuFree(8000))},
			running: []preempt.Running{job("cpu-hog", "n1", be, cards(0), host(7000, 0))},
			p:       wants(high, 1, needsCPU(4000)),
			victims: []string{"cpu-hog"}, on: []string{"n1"},
		},
		"equal priority is not evicted without reclaim": {
			nodes: []placement.Node{node("n1", 2)},
			running: []preempt.Running{job("borrower", "n1", norm, cards(0), borrowing()),
				job("other", "n1", norm, cards(1), withinGuarantee())},
			p: wants(norm, 1),
		},
		"reclaim evicts another tenant's borrower": {
			nodes: []placement.Node{node("n1", 4)},
			running: []preempt.Running{
				job("own-borrower", "n1", norm, cards(0), tenant("research"), borrowing()),
				job("within-guarantee", "n1", norm, cards(1), withinGuarantee()),
				job("borrower", "n1", norm, cards(2), borrowing()),
				job("higher-borrower", "n1", high, cards(3), borrowing()),
			},
			p:       wants(norm, 1, reclaim()),
			victims: []string{"borrower"}, on: []string{"n1"},
		},
		"reclaim spares its own jobs and non-borrowing tenants": {
			nodes: []placement.Node{node("n1", 4)},
			running: []preempt.Running{
				job("own-borrower", "n1", norm, cards(0), tenant("research"), borrowing()),
				job("within-guarantee", "n1", norm, cards(1), withinGuarantee()),
				job("borrower", "n1", norm, cards(2), borrowing()),
				job("higher-borrower", "n1", high, cards(3), borrowing()),
			},
			p: wants(norm, 2, reclaim()),
		},
		"reclaim also evicts lower priority": {
			nodes: []placement.Node{node("n1", 2)},
			running: []preempt.Running{job("borrower", "n1", norm, cards(0), borrowing()),
				job("own-be", "n1", be, cards(1), tenant("research"))},
			p:       wants(norm, 2, reclaim()),
			victims: []string{"borrower", "own-be"}, on: []string{"n1"},
		},
		"gang victim evicted whole": {
			nodes: []placement.Node{node("n1", 2), node("n2", 2)},
			running: []preempt.Running{job("g-0", "n1", be, cards(0, 1), gang("g")),
				job("g-1", "n2", be, cards(0, 1), gang("g"))},
			p:       wants(high, 2),
			victims: []string{"g-0", "g-1"}, on: []string{"n1"},
		},
		"gang victim costs all its parts": {
			nodes: []placement.Node{node("n1", 2), node("n2", 2), node("n3", 2)},
			running: []preempt.Running{job("g-0", "n1", be, cards(0, 1), gang("g")),
				job("g-1", "n2", be, cards(0, 1), gang("g")),
				job("single", "n3", be, cards(0, 1))},
			p:       wants(high, 2),
			victims: []string{"single"}, on: []string{"n3"},
		},
		"gang with one protected part is not evicted": {
			nodes: []placement.Node{node("n1", 2), node("n2", 2)},
			running: []preempt.Running{job("g-0", "n1", be, cards(0, 1), gang("g")),
				job("g-1", "n2", be, cards(0, 1), gang("g"), started(time.Minute))},
			p: wants(high, 2), minRuntime: time.Hour,
		},
		"MIG preemptor evicts a slot of its profile": {
			nodes: []placement.Node{migNode("m1", "1g.10gb", "3g.40gb", "3g.40gb")},
			running: []preempt.Running{job("small-be", "m1", be, mig(0, "1g.10gb")),
				job("mid-be", "m1", be, mig(1, "3g.40gb")), job("mid-normal", "m1", norm, mig(2, "3g.40gb"))},
			p:       wants(high, 1, migOf("3g.40gb")),
			victims: []string{"mid-be"}, on: []string{"m1"},
		},
		"MIG preemptor: no slot of its profile to free": {
			nodes:   []placement.Node{migNode("m1", "1g.10gb", "3g.40gb")},
			running: []preempt.Running{job("small-be", "m1", be, mig(0, "1g.10gb")), job("mid-crit", "m1", crit, mig(1, "3g.40gb"))},
			p:       wants(high, 1, migOf("3g.40gb")),
		},
		"share preemptor evicts the share that makes room": {
			nodes: []placement.Node{node("n1", 1)},
			running: []preempt.Running{job("share-40", "n1", be, share(0, 40<<10, 40)),
				job("share-30", "n1", be, share(0, 20<<10, 30)),
				job("share-30-normal", "n1", norm, share(0, 20<<10, 30))},
			p:       wants(norm, 1, shareOf(20<<10, 30)),
			victims: []string{"share-30"}, on: []string{"n1"},
		},
		"share preemptor evicts a whole card when no share frees enough": {
			nodes: []placement.Node{node("n1", 2)},
			running: []preempt.Running{job("share-90", "n1", crit, share(0, 70<<10, 90)),
				job("whole", "n1", be, cards(1))},
			p:       wants(high, 1, shareOf(20<<10, 50)),
			victims: []string{"whole"}, on: []string{"n1"},
		},
		"whole preemptor evicts the shares of one card": {
			nodes: []placement.Node{node("n1", 2)},
			running: []preempt.Running{job("share-a", "n1", be, share(0, 8<<10, 10)),
				job("share-b", "n1", be, share(0, 8<<10, 10)), job("whole", "n1", be, cards(1))},
			p:       wants(high, 1),
			victims: []string{"share-a", "share-b"}, on: []string{"n1"},
		},
		"NVLink preemptor evicts within one domain": {
			nodes: []placement.Node{node("n1", 4, nvlink("a", "a", "b", "b"))},
			running: []preempt.Running{job("a0", "n1", be, cards(0)), job("b3", "n1", be, cards(3)),
				job("a1", "n1", norm, cards(1))},
			p:       wants(high, 2, topo(contracts.TopologyNVLink)),
			victims: []string{"b3"}, on: []string{"n1"},
		},
		"multi-machine preemptor uses free nodes then the cheapest": {
			nodes: []placement.Node{node("n1", 4), node("n2", 4), node("n3", 4)},
			running: []preempt.Running{job("n2-all", "n2", be, cards(0, 1, 2, 3)),
				job("n3-half-be", "n3", be, cards(0, 1)), job("n3-half-normal", "n3", norm, cards(2, 3))},
			p:       wants(high, 8, machines(2, contracts.TopologyAny)),
			victims: []string{"n2-all"}, on: []string{"n1", "n2"},
		},
		"multi-machine preemptor evicts on every machine": {
			nodes: []placement.Node{node("n1", 2), node("n2", 2), node("n3", 2)},
			running: []preempt.Running{job("a", "n1", be, cards(0)), job("b", "n2", norm, cards(1)),
				job("c", "n3", crit, cards(0))},
			p:       wants(high, 4, machines(2, contracts.TopologyAny)),
			victims: []string{"a", "b"}, on: []string{"n1", "n2"},
		},
		"multi-machine preemptor: a gang victim frees both machines": {
			nodes: []placement.Node{node("n1", 2), node("n2", 2), node("n3", 2)},
			running: []preempt.Running{job("g-0", "n1", be, cards(0, 1), gang("g")),
				job("g-1", "n2", be, cards(0, 1), gang("g")), job("c", "n3", norm, cards(0, 1))},
			p:       wants(high, 4, machines(2, contracts.TopologyAny)),
			victims: []string{"g-0", "g-1"}, on: []string{"n1", "n2"},
		},
		"multi-machine preemptor keeps to one zone": {
			nodes:   []placement.Node{node("n1", 4, zone("z1")), node("n2", 4, zone("z2")), node("n3", 4, zone("z2"))},
			running: []preempt.Running{job("n2-all", "n2", be, cards(0, 1, 2, 3))},
			p:       wants(high, 8, machines(2, contracts.TopologyZone)),
			victims: []string{"n2-all"}, on: []string{"n2", "n3"},
		},
		"multi-machine preemptor: not enough machines": {
			nodes:   []placement.Node{node("n1", 4), node("n2", 4)},
			running: []preempt.Running{job("crit", "n2", crit, cards(0))},
			p:       wants(high, 8, machines(2, contracts.TopologyAny)),
		},
		"fits without eviction": {
			nodes:   []placement.Node{node("n1", 2), node("n2", 2)},
			running: []preempt.Running{job("be", "n1", be, cards(0))},
			p:       wants(high, 2),
			victims: []string{}, on: []string{"n2"},
		},
		"ties go to the first node": {
			nodes:   []placement.Node{node("n2", 1), node("n1", 1)},
			running: []preempt.Running{job("on-n2", "n2", be, cards(0)), job("on-n1", "n1", be, cards(0))},
			p:       wants(high, 1),
			victims: []string{"on-n1"}, on: []string{"n1"},
		},
		"cards listed out of index order": {
			nodes:   []placement.Node{reversed(node("n1", 3))},
			running: []preempt.Running{job("be", "n1", be, cards(2)), job("normal", "n1", norm, cards(0, 1))},
			p:       wants(high, 1),
			victims: []string{"be"}, on: []string{"n1"},
		},
		"devices named by index only": {
			nodes:   []placement.Node{noUUIDs(node("n1", 2)), noUUIDs(migNode("m1", "1g.10gb"))},
			running: []preempt.Running{job("be", "n1", be, cards(1), noDeviceUUIDs()), job("crit", "n1", crit, cards(0), noDeviceUUIDs())},
			p:       wants(high, 1),
			victims: []string{"be"}, on: []string{"n1"},
		},
		"MIG devices named by instance IDs only": {
			nodes:   []placement.Node{noUUIDs(migNode("m1", "1g.10gb", "1g.10gb"))},
			running: []preempt.Running{job("be", "m1", be, mig(1, "1g.10gb"), noDeviceUUIDs()), job("crit", "m1", crit, mig(0, "1g.10gb"), noDeviceUUIDs())},
			p:       wants(high, 1, migOf("1g.10gb")),
			victims: []string{"be"}, on: []string{"m1"},
		},
		"respects pool, cordon and exclude": {
			nodes: []placement.Node{node("n1", 1, pool("other")), node("n2", 1, cordoned()), node("n3", 1), node("n4", 1)},
			running: []preempt.Running{job("wrong-pool", "n1", be, cards(0)), job("cordoned", "n2", be, cards(0)),
				job("excluded", "n3", be, cards(0)), job("normal", "n4", norm, cards(0))},
			p:       wants(high, 1, inPool("h100"), exclude("n3")),
			victims: []string{"normal"}, on: []string{"n4"},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			snap := cluster(tc.nodes, tc.running)
			before := cloneNodes(snap.Nodes)
			ch, ok := preempt.Choose(snap, tc.running, tc.p, preempt.Options{Now: t0, MinRuntime: tc.minRuntime, Spare: tc.spare})
			if diff := cmp.Diff(before, snap.Nodes); diff != "" {
				t.Fatalf("Choose modified the snapshot (-before +after):\n%s", diff)
			}
			if tc.on == nil {
				if ok {
					t.Fatalf("Choose = %+v, want no choice", ch)
				}
				return
			}
			if !ok {
				t.Fatalf("Choose found no choice, want victims %v on %v", tc.victims, tc.on)
			}
			got := make([]string, 0, len(ch.Victims))
			for _, v := range ch.Victims {
				got = append(got, v.AllocationID)
			}
			var on []string
			for _, p := range ch.Parts {
				on = append(on, p.NodeID)
			}
			if diff := cmp.Diff(struct{ Victims, On []string }{tc.victims, tc.on}, struct{ Victims, On []string }{got, on}); diff != "" {
				t.Errorf("choice (-want +got):\n%s\nreason: %s", diff, ch.Reason)
			}
			checkChoice(t, snap, tc.running, tc.p, ch)
		})
	}
}

// checkChoice checks what every choice must be: victims taken from
// running, whole gangs, one part per machine on distinct nodes, each part
// exactly what FitNode gives once the victims are gone.
func checkChoice(t *testing.T, snap placement.Snapshot, running []preempt.Running, p preempt.Preemptor, ch preempt.Choice) {
	t.Helper()
	ids := map[string]bool{}
	for _, v := range ch.Victims {
		if !slices.ContainsFunc(running, func(r preempt.Running) bool { return r.AllocationID == v.AllocationID }) {
			t.Errorf("victim %s is not running", v.AllocationID)
		}
		ids[v.AllocationID] = true
	}
	for _, v := range ch.Victims {
		for _, r := range running {
			if v.Gang != "" && r.Gang == v.Gang && !ids[r.AllocationID] {
				t.Errorf("victim %s of gang %s evicted without its part %s", v.AllocationID, v.Gang, r.AllocationID)
			}
		}
	}
	if len(ch.Parts) != p.Request.Machines() {
		t.Fatalf("%d parts, want %d", len(ch.Parts), p.Request.Machines())
	}
	seen := map[string]bool{}
	for _, part := range ch.Parts {
		if seen[part.NodeID] {
			t.Errorf("node %s used twice", part.NodeID)
		}
		seen[part.NodeID] = true
		n := release(snap, part.NodeID, ch.Victims)
		devs, ok := placement.FitNode(&n, perMachine(p))
		if !ok {
			t.Errorf("preemptor does not fit %s once the victims are gone", part.NodeID)
			continue
		}
		if diff := cmp.Diff(devs, part.Devices); diff != "" {
			t.Errorf("part on %s (-FitNode +part):\n%s", part.NodeID, diff)
		}
	}
	if p.Request.GPU.Topology == contracts.TopologyZone {
		zones := map[string]bool{}
		for _, part := range ch.Parts {
			zones[part.Zone] = true
		}
		if len(zones) > 1 {
			t.Errorf("zone topology spans zones %v", zones)
		}
	}
	if ch.Reason == "" {
		t.Error("empty reason")
	}
}

func TestChooseReason(t *testing.T) {
	tests := map[string]struct {
		nodes   []placement.Node
		running []preempt.Running
		p       preempt.Preemptor
		want    string
	}{
		"evictions": {
			nodes:   []placement.Node{node("n7", 3)},
			running: []preempt.Running{job("a", "n7", be, cards(0, 1)), job("b", "n7", norm, cards(2))},
			p:       wants(crit, 3),
			want:    "evicts 2 jobs (3 GPUs) of best-effort, normal on n7",
		},
		"share": {
			nodes:   []placement.Node{node("n1", 1)},
			running: []preempt.Running{job("a", "n1", be, share(0, 70<<10, 50))},
			p:       wants(crit, 1, shareOf(20<<10, 60)),
			want:    "evicts 1 job (0.5 GPUs) of best-effort on n1",
		},
		"reclaim": {
			nodes:   []placement.Node{node("n1", 1)},
			running: []preempt.Running{job("a", "n1", norm, cards(0), borrowing())},
			p:       wants(norm, 1, reclaim()),
			want:    "evicts 1 job (1 GPUs) of normal on n1; reclaiming guarantee from borrowing tenants",
		},
		"no eviction": {
			nodes: []placement.Node{node("n1", 1)},
			p:     wants(crit, 1),
			want:  "fits without eviction on n1",
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			ch, ok := preempt.Choose(cluster(tc.nodes, tc.running), tc.running, tc.p, preempt.Options{Now: t0})
			if !ok {
				t.Fatal("no choice")
			}
			if ch.Reason != tc.want {
				t.Errorf("reason %q, want %q", ch.Reason, tc.want)
			}
		})
	}
}

// AllowPool is the caller's quota check: asked once per pool at most,
// however many what-ifs the search runs.
func TestChooseAsksAllowPoolOncePerPool(t *testing.T) {
	var nodes []placement.Node
	var running []preempt.Running
	for _, id := range []string{"n1", "n2", "n3", "n4"} {
		pl := "h100"
		if id == "n4" {
			pl = "spare"
		}
		nodes = append(nodes, node(id, 4, pool(pl)))
		running = append(running, job(id+"-a", id, be, cards(0, 1)), job(id+"-b", id, be, cards(2)), job(id+"-c", id, be, cards(3)))
	}
	asked := map[string]int{}
	p := wants(high, 4)
	p.Request.AllowPool = func(pool string) bool { asked[pool]++; return pool == "h100" }
	ch, ok := preempt.Choose(cluster(nodes, running), running, p, preempt.Options{Now: t0})
	if !ok || ch.Parts[0].Pool != "h100" {
		t.Fatalf("Choose = %+v, %v; want a choice in pool h100", ch, ok)
	}
	if diff := cmp.Diff(map[string]int{"h100": 1, "spare": 1}, asked); diff != "" {
		t.Errorf("AllowPool calls (-want +got):\n%s", diff)
	}
}

func TestChooseBadInput(t *testing.T) {
	nodes := []placement.Node{node("n1", 4)}
	running := []preempt.Running{job("a", "n1", be, cards(0, 1, 2, 3)), job("ghost", "n9", be, cards(0))}
	tests := map[string]preempt.Preemptor{
		"count not split evenly":   wants(high, 3, machines(2, contracts.TopologyAny)),
		"negative count":           wants(high, -1),
		"zero count":               wants(high, 0),
		"share without share":      {Priority: high, Request: placement.Request{GPU: contracts.GPURequest{Count: 1, Share: &contracts.GPUShare{}}}},
		"more machines than nodes": wants(high, 8, machines(2, contracts.TopologyAny)),
	}
	for name, p := range tests {
		t.Run(name, func(t *testing.T) {
			if ch, ok := preempt.Choose(cluster(nodes, running), running, p, preempt.Options{Now: t0}); ok {
				t.Errorf("Choose = %+v, want no choice", ch)
			}
		})
	}
	t.Run("victim on a node not in the snapshot", func(t *testing.T) {
		ch, ok := preempt.Choose(cluster(nodes, running), running, wants(high, 4), preempt.Options{Now: t0})
		if !ok || len(ch.Victims) != 1 || ch.Victims[0].AllocationID != "a" {
			t.Errorf("Choose = %+v, %v; want victim a", ch, ok)
		}
	})
	t.Run("empty snapshot", func(t *testing.T) {
		if _, ok := preempt.Choose(placement.Snapshot{}, nil, wants(high, 1), preempt.Options{Now: t0}); ok {
			t.Error("a choice on an empty snapshot")
		}
	})
}

// A node with more candidates than the exact search takes, or whose
// cheapest set lies too deep, falls back to greedy-then-reprieve: a set
// none of whose victims can be spared.
func TestChooseManyCandidates(t *testing.T) {
	tests := map[string]struct {
		shares, want int // 1% shares on card 0; shares to evict
		pct          int // the preemptor's share
	}{
		"more candidates than masks hold": {shares: 70, pct: 40, want: 10},
		"cheapest set too deep to search": {shares: 60, pct: 80, want: 40},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			nodes := []placement.Node{node("n1", 2)}
			running := []preempt.Running{job("crit", "n1", crit, cards(1))}
			for i := range tc.shares {
				running = append(running, job(fmt.Sprintf("s%02d", i), "n1", be, share(0, 1<<10, 1), started(time.Duration(i)*time.Minute)))
			}
			p := wants(high, 1, shareOf(1<<10, tc.pct))
			snap := cluster(nodes, running)
			ch, ok := preempt.Choose(snap, running, p, preempt.Options{Now: t0})
			if !ok {
				t.Fatal("no choice")
			}
			checkChoice(t, snap, running, p, ch)
			if len(ch.Victims) != tc.want {
				t.Errorf("%d victims, want %d", len(ch.Victims), tc.want)
			}
			for i := range ch.Victims {
				spared := slices.Delete(slices.Clone(ch.Victims), i, i+1)
				n := release(snap, "n1", spared)
				if _, ok := placement.FitNode(&n, perMachine(p)); ok {
					t.Errorf("victim %s could be spared", ch.Victims[i].AllocationID)
				}
			}
		})
	}
}
