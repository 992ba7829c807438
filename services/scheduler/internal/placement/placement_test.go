package placement

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// run places reqs in order on a fresh placer and renders each decision.
func run(snap Snapshot, opt Options, reqs ...Request) []string {
	p := NewPlacer(snap, opt)
	out := make([]string, len(reqs))
	for i, r := range reqs {
		out[i] = placed(p.Place(r))
	}
	return out
}

func withGPU(r Request, f func(*contracts.GPURequest)) Request {
	f(&r.GPU)
	return r
}

func models(r Request, m ...string) Request {
	r.GPU.Models = m
	return r
}

func usePolicy(p contracts.PlacementPolicy) Options {
	return Options{Policy: func(string) contracts.PlacementPolicy { return p }}
}

func TestPlaceWholeGPUs(t *testing.T) {
	mixed := Node{ID: "mix", Pool: "p", CPUMilliFree: 1000, MemoryMiBFree: 1000,
		GPUs: append(gpus("mix", a100, 81920, 2, "", 0), gpus("mix", h100, 81920, 2, "", 0)...)}
	for i := range mixed.GPUs {
		mixed.GPUs[i].Index = i
	}
	twoDomains := mk("nv", "p", 8, 0)
	for i := range twoDomains.GPUs {
		twoDomains.GPUs[i].NVLinkDomain = []string{"A", "B"}[i/4]
	}
	twoDomains.GPUs[4].Held, twoDomains.GPUs[5].Held = true, true // B has 2 free, A has 4
	small := mk("s1", "p", 8, 0)
	for i := range small.GPUs {
		small.GPUs[i].MemoryMiB = 40960
	}
	shared := mk("sh", "p", 4, 0)
	shared.GPUs[0].SharePercent, shared.GPUs[0].ShareMemMiB = 10, 1024
	shared.GPUs[1].MIG = true
	shared.GPUs[2].ShareMemMiB = 1 // framebuffer held by a share: not whole
	a := mk("a1", "p", 8, 0)
	for i := range a.GPUs {
		a.GPUs[i].Model = a100
	}
	pcie := mk("pc", "p", 8, 0)
	for i := range pcie.GPUs {
		pcie.GPUs[i].NVLinkDomain = ""
	}
	tests := map[string]struct {
		nodes []Node
		reqs  []Request
		want  []string
	}{
		"lowest free indices": {[]Node{mk("n1", "p", 8, 3)}, []Request{whole(2), whole(3), whole(1)},
			[]string{"n1[3 4]", "n1[5 6 7]", "queued_behind_higher_priority"}},
		"shares and MIG make a card not whole": {[]Node{shared}, []Request{whole(1), whole(1)},
			[]string{"sh[3]", "queued_behind_higher_priority"}},
		"model": {[]Node{a, mk("h1", "p", 8, 0)}, []Request{withGPU(whole(1), func(g *contracts.GPURequest) { g.Model = h100 })},
			[]string{"h1[0]"}},
		"models list": {[]Node{mk("h1", "p", 8, 0), a}, []Request{models(whole(1), "L4", a100)}, []string{"a1[0]"}},
		"framebuffer": {[]Node{small, mk("s2", "p", 8, 0)}, []Request{withGPU(whole(2), func(g *contracts.GPURequest) { g.MemoryMiB = 81920 })},
			[]string{"s2[0 1]"}},
		"one model per machine": {[]Node{mixed}, []Request{whole(3), whole(2), whole(2)},
			[]string{"no_machine", "mix[0 1]", "mix[2 3]"}},
		"nvlink takes the tightest domain": {[]Node{twoDomains},
			[]Request{withGPU(whole(2), func(g *contracts.GPURequest) { g.Topology = contracts.TopologyNVLink }), whole(2)},
			[]string{"nv[6 7]", "nv[0 1]"}},
		"nvlink never spans domains": {[]Node{twoDomains}, []Request{withGPU(whole(5), func(g *contracts.GPURequest) { g.Topology = contracts.TopologyNVLink })},
			[]string{"unsatisfiable"}},
		"nvlink needs a domain": {[]Node{pcie}, []Request{withGPU(whole(1), func(g *contracts.GPURequest) { g.Topology = contracts.TopologyNVLink })},
			[]string{"unsatisfiable"}},
		"pool": {[]Node{mk("n1", "a", 8, 0), mk("n2", "b", 8, 0)}, []Request{{GPU: contracts.GPURequest{Count: 1}, Pool: "b"}},
			[]string{"n2[0]"}},
		"host cpu and memory per machine": {[]Node{mk("n1", "p", 8, 0), mk("n2", "p", 8, 0)},
			[]Request{{GPU: contracts.GPURequest{Count: 1}, CPUMilli: 40000}, {GPU: contracts.GPURequest{Count: 1}, CPUMilli: 40000},
				{GPU: contracts.GPURequest{Count: 1}, MemoryMiB: 600 << 10}},
			[]string{"n1[0]", "n2[0]", "no_schedulable_node"}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			got := run(Snapshot{Nodes: tt.nodes}, usePolicy(contracts.PolicyBinpack), tt.reqs...)
			for i := range got {
				if got[i] == "unsatisfiable" && tt.want[i] == "no_machine" {
					got[i] = "no_machine"
				}
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("decisions (-want +got):\n%s", diff)
			}
		})
	}
}

func TestPlaceMIG(t *testing.T) {
	layouts := []string{"3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"}
	starts := []int{0, 4, 6, 7}
	n := Node{ID: "m1", Pool: "p", CPUMilliFree: 64000, MemoryMiBFree: 1 << 20, GPUs: []GPU{
		migGPU("m1", 0, layouts, starts),
		migGPU("m1", 1, layouts, starts, 0, 1), // fewer free instances: tighter
		{Index: 2, UUID: "m1-g2", Model: a100, MemoryMiB: 81920},
	}}
	heldCard := Node{ID: "m2", Pool: "p", CPUMilliFree: 64000, MemoryMiBFree: 1 << 20, GPUs: []GPU{migGPU("m2", 0, layouts, starts)}}
	heldCard.GPUs[0].Held = true
	tests := map[string]struct {
		nodes []Node
		reqs  []Request
		want  []string
	}{
		"tightest card, lowest start": {[]Node{n}, []Request{mig("1g.10gb"), mig("1g.10gb"), mig("1g.10gb")},
			[]string{"m1[1:1g.10gb@6]", "m1[1:1g.10gb@7]", "m1[0:1g.10gb@6]"}},
		"held instances skipped": {[]Node{n}, []Request{mig("3g.40gb"), mig("3g.40gb")},
			[]string{"m1[0:3g.40gb@0]", "queued_behind_higher_priority"}},
		"no such profile": {[]Node{n}, []Request{mig("7g.80gb")}, []string{"no_matching_gpu_model"}},
		"instance framebuffer": {[]Node{n}, []Request{withGPU(mig("2g.20gb"), func(g *contracts.GPURequest) { g.MemoryMiB = 20000 })},
			[]string{"unsatisfiable"}},
		"model": {[]Node{n}, []Request{withGPU(mig("1g.10gb"), func(g *contracts.GPURequest) { g.Model = h100 })},
			[]string{"no_matching_gpu_model"}},
		"a held MIG card offers nothing": {[]Node{heldCard}, []Request{mig("1g.10gb")}, []string{"insufficient_free_gpus"}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			for _, pol := range contracts.PlacementPolicies {
				if diff := cmp.Diff(tt.want, run(Snapshot{Nodes: tt.nodes}, usePolicy(pol), tt.reqs...)); diff != "" {
					t.Errorf("%s: decisions (-want +got):\n%s", pol, diff)
				}
			}
		})
	}
}

func TestPlaceShare(t *testing.T) {
	n := mk("n1", "p", 4, 0)
	n.GPUs[1].SharePercent, n.GPUs[1].ShareMemMiB = 50, 40960
	n.GPUs[2].SharePercent, n.GPUs[2].ShareMemMiB = 80, 20480
	n.GPUs[3].Held = true
	tests := map[string]struct {
		reqs []Request
		want []string
	}{
		"tightest card":                  {[]Request{share(10240, 20), share(10240, 25)}, []string{"n1[2:20%]", "n1[1:25%]"}},
		"compute bound":                  {[]Request{share(1024, 60), share(1024, 41)}, []string{"n1[0:60%]", "n1[1:41%]"}},
		"framebuffer bound":              {[]Request{share(61440, 10), share(40960, 10)}, []string{"n1[2:10%]", "n1[1:10%]"}},
		"whole card left for whole jobs": {[]Request{share(1024, 10), whole(1)}, []string{"n1[2:10%]", "n1[0]"}},
		"too big for any card":           {[]Request{share(90000, 10)}, []string{"unsatisfiable"}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			got := run(Snapshot{Nodes: []Node{n}}, usePolicy(contracts.PolicyBinpack), tt.reqs...)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("decisions (-want +got):\n%s", diff)
			}
		})
	}
}

func TestPolicies(t *testing.T) {
	// full has 2 free, half 4, idle 8; dom 6 in two NVLink domains (4 and 2).
	dom := mk("dom", "p", 8, 0)
	for i := range dom.GPUs {
		dom.GPUs[i].NVLinkDomain = []string{"dA", "dB"}[i/4]
	}
	dom.GPUs[4].Held, dom.GPUs[5].Held = true, true
	nodes := []Node{mk("idle", "p", 8, 0), mk("full", "p", 8, 6), mk("half", "p", 8, 4), dom}
	// spanned has 4 free across two domains: fullest, but not one domain.
	spanned := mk("spanned", "p", 8, 0)
	for i := range spanned.GPUs {
		spanned.GPUs[i].NVLinkDomain = []string{"sA", "sB"}[i/4]
		spanned.GPUs[i].Held = i == 0 || i == 1 || i == 4 || i == 5
	}
	tight := mk("tight", "p", 8, 2)
	tests := map[string]struct {
		pol   contracts.PlacementPolicy
		nodes []Node
		reqs  []Request
		want  []string
	}{
		"binpack: the fullest": {contracts.PolicyBinpack, nodes, []Request{whole(2), whole(2), whole(8)},
			[]string{"full[6 7]", "half[4 5]", "idle[0 1 2 3 4 5 6 7]"}},
		"spread: the emptiest": {contracts.PolicySpread, nodes, []Request{whole(2), whole(2)}, []string{"idle[0 1]", "dom[0 1]"}},
		"topology: one NVLink domain before packing": {contracts.PolicyTopology, []Node{spanned, tight}, []Request{whole(4)},
			[]string{"tight[2 3 4 5]"}},
		"binpack ignores domains": {contracts.PolicyBinpack, []Node{spanned, tight}, []Request{whole(4)},
			[]string{"spanned[2 3 6 7]"}},
		"topology: the tightest domain, then packing": {contracts.PolicyTopology, nodes, []Request{whole(2), whole(4), whole(1)},
			[]string{"full[6 7]", "half[4 5 6 7]", "dom[0]"}},
		"fragaware keeps whole machines whole": {contracts.PolicyFragAware, nodes, []Request{whole(2), whole(8), whole(4)},
			[]string{"full[6 7]", "idle[0 1 2 3 4 5 6 7]", "half[4 5 6 7]"}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			if diff := cmp.Diff(tt.want, run(Snapshot{Nodes: tt.nodes}, usePolicy(tt.pol), tt.reqs...)); diff != "" {
				t.Errorf("decisions (-want +got):\n%s", diff)
			}
		})
	}
	t.Run("ties go to the first node", func(t *testing.T) {
		for _, pol := range contracts.PlacementPolicies {
			got := run(Snapshot{Nodes: []Node{mk("n3", "p", 8, 2), mk("n1", "p", 8, 2), mk("n2", "p", 8, 2)}}, usePolicy(pol), whole(1))
			if got[0] != "n1[2]" {
				t.Errorf("%s: %v, want n1[2]", pol, got)
			}
		}
	})
	t.Run("policy per pool", func(t *testing.T) {
		opt := Options{Policy: func(pool string) contracts.PlacementPolicy {
			return map[string]contracts.PlacementPolicy{"a": contracts.PolicyBinpack, "b": contracts.PolicySpread}[pool]
		}}
		snap := Snapshot{Nodes: []Node{mk("a1", "a", 8, 0), mk("a2", "a", 8, 6), mk("b1", "b", 8, 6), mk("b2", "b", 8, 0)}}
		got := run(snap, opt, Request{GPU: contracts.GPURequest{Count: 1}, Pool: "a"}, Request{GPU: contracts.GPURequest{Count: 1}, Pool: "b"})
		if diff := cmp.Diff([]string{"a2[6]", "b2[0]"}, got); diff != "" {
			t.Errorf("decisions (-want +got):\n%s", diff)
		}
	})
}

func TestFilters(t *testing.T) {
	noSched := mk("t1", "p", 8, 6)
	noSched.Taints = []contracts.Taint{{Key: "dedicated", Value: "ml", Effect: contracts.TaintNoSchedule}}
	prefer := mk("t2", "p", 8, 6) // fullest: binpack would pick it first
	prefer.Taints = []contracts.Taint{{Key: "spot", Value: "true", Effect: contracts.TaintPreferNoSchedule}}
	cordoned := mk("c1", "p", 8, 6)
	cordoned.Cordoned = true
	labelled := mk("l1", "p", 8, 0)
	labelled.Labels = map[string]string{"rack": "r7"}
	plain := mk("n1", "p", 8, 0)
	tolerate := func(key string) []contracts.Toleration {
		return []contracts.Toleration{{Key: key, Operator: contracts.TolerationExists}}
	}
	tests := map[string]struct {
		nodes []Node
		reqs  []Request
		want  []string
	}{
		"NoSchedule keeps untolerating jobs off": {[]Node{noSched, plain}, []Request{whole(2), {GPU: contracts.GPURequest{Count: 2}, Tolerations: tolerate("dedicated")}},
			[]string{"n1[0 1]", "t1[6 7]"}},
		"NoSchedule alone": {[]Node{noSched}, []Request{whole(1)}, []string{"no_schedulable_node"}},
		"PreferNoSchedule is a last resort": {[]Node{prefer, plain}, []Request{whole(6), whole(2), whole(2), {GPU: contracts.GPURequest{Count: 1}, Tolerations: tolerate("spot")}},
			[]string{"n1[0 1 2 3 4 5]", "n1[6 7]", "t2[6 7]", "queued_behind_higher_priority"}},
		"cordoned never": {[]Node{cordoned}, []Request{whole(1)}, []string{"no_schedulable_node"}},
		"selector": {[]Node{plain, labelled}, []Request{{GPU: contracts.GPURequest{Count: 1}, Selector: map[string]string{"rack": "r7"}},
			{GPU: contracts.GPURequest{Count: 1}, Selector: map[string]string{"rack": "r8"}}},
			[]string{"l1[0]", "no_schedulable_node"}},
		"exclude": {[]Node{plain, labelled}, []Request{{GPU: contracts.GPURequest{Count: 1}, Exclude: map[string]bool{"l1": true}},
			{GPU: contracts.GPURequest{Count: 1}, Exclude: map[string]bool{"l1": true, "n1": true}}},
			[]string{"n1[0]", "reserved_for_job_ahead"}},
		"quota headroom": {[]Node{mk("a1", "a", 8, 6), mk("b1", "b", 8, 0)},
			[]Request{{GPU: contracts.GPURequest{Count: 1}, AllowPool: func(p string) bool { return p != "a" }},
				{GPU: contracts.GPURequest{Count: 1}, AllowPool: func(string) bool { return false }}},
			[]string{"b1[0]", "quota_exceeded"}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			if diff := cmp.Diff(tt.want, run(Snapshot{Nodes: tt.nodes}, usePolicy(contracts.PolicyBinpack), tt.reqs...)); diff != "" {
				t.Errorf("decisions (-want +got):\n%s", diff)
			}
		})
	}
	t.Run("AllowPool is asked once per pool", func(t *testing.T) {
		var nodes []Node
		for _, id := range []string{"a1", "a2", "b1", "b2"} {
			nodes = append(nodes, mk(id, id[:1], 8, 8))
		}
		calls := map[string]int{}
		p := NewPlacer(Snapshot{Nodes: nodes}, Options{})
		p.Place(Request{GPU: contracts.GPURequest{Count: 1}, AllowPool: func(pool string) bool { calls[pool]++; return true }})
		if diff := cmp.Diff(map[string]int{"a": 1, "b": 1}, calls); diff != "" {
			t.Errorf("calls (-want +got):\n%s", diff)
		}
	})
}

func gang(count, nodes int, topo contracts.Topology) Request {
	return Request{GPU: contracts.GPURequest{Count: count, Nodes: nodes, Topology: topo}}
}

func TestGangs(t *testing.T) {
	zoned := func(id, zone string, busy int) Node { n := mk(id, "p", 8, busy); n.Zone = zone; return n }
	a := mk("a1", "p", 8, 0)
	for i := range a.GPUs {
		a.GPUs[i].Model = a100
	}
	tests := map[string]struct {
		nodes []Node
		reqs  []Request
		want  []string
	}{
		"split evenly over machines": {[]Node{mk("n1", "p", 8, 0), mk("n2", "p", 8, 0), mk("n3", "p", 8, 4)},
			[]Request{gang(8, 2, ""), gang(8, 2, "")},
			[]string{"n1[0 1 2 3] n3[4 5 6 7]", "n1[4 5 6 7] n2[0 1 2 3]"}},
		"all or nothing": {[]Node{mk("n1", "p", 8, 0), mk("n2", "p", 8, 0), mk("n3", "p", 8, 0), mk("n4", "p", 8, 1)},
			[]Request{gang(32, 4, ""), whole(8), whole(8), whole(8)},
			[]string{"insufficient_free_gpus", "n1[0 1 2 3 4 5 6 7]", "n2[0 1 2 3 4 5 6 7]", "n3[0 1 2 3 4 5 6 7]"}},
		"one zone": {[]Node{zoned("n1", "z1", 0), zoned("n2", "z2", 0), zoned("n3", "z2", 0)},
			[]Request{gang(16, 2, contracts.TopologyZone)}, []string{"n2[0 1 2 3 4 5 6 7] n3[0 1 2 3 4 5 6 7]"}},
		"no zone has enough machines": {[]Node{zoned("n1", "z1", 0), zoned("n2", "z2", 0), zoned("n3", "z2", 4)},
			[]Request{gang(16, 2, contracts.TopologyZone), gang(24, 3, contracts.TopologyZone)},
			[]string{"insufficient_free_gpus", "unsatisfiable"}},
		"one model for the whole gang": {[]Node{mk("h1", "p", 8, 0), a, mk("h2", "p", 8, 4)},
			[]Request{models(gang(16, 2, ""), a100, h100), models(gang(8, 2, ""), a100, h100)},
			[]string{"insufficient_free_gpus", "h1[0 1 2 3] h2[4 5 6 7]"}},
		"never one machine twice": {[]Node{mk("n1", "p", 16, 0)}, []Request{gang(2, 2, "")}, []string{"unsatisfiable"}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			if diff := cmp.Diff(tt.want, run(Snapshot{Nodes: tt.nodes}, usePolicy(contracts.PolicyBinpack), tt.reqs...)); diff != "" {
				t.Errorf("decisions (-want +got):\n%s", diff)
			}
		})
	}
}

func TestPendingMessages(t *testing.T) {
	h03 := mk("h100-03", "h100", 8, 2)
	h01 := mk("h100-01", "h100", 8, 8)
	cordoned := mk("c1", "h100", 8, 0)
	cordoned.Cordoned = true
	tainted := mk("t1", "h100", 8, 0)
	tainted.Taints = []contracts.Taint{{Key: "dedicated", Value: "ml", Effect: contracts.TaintNoSchedule}}
	migNode := Node{ID: "m1", Pool: "mig", CPUMilliFree: 1000, MemoryMiBFree: 1000,
		GPUs: []GPU{migGPU("m1", 0, []string{"1g.10gb", "1g.10gb"}, []int{0, 1}, 0, 1)}}
	shareNode := mk("s1", "s", 2, 0)
	shareNode.GPUs[0].SharePercent, shareNode.GPUs[0].ShareMemMiB = 80, 10240
	shareNode.GPUs[1].Held = true
	research := func(r Request) Request {
		r.Tenant, r.Ahead, r.Extra = "research", 2, "quota research/h100 at 16 of 16"
		return r
	}
	h100x := func(n int) Request {
		return Request{GPU: contracts.GPURequest{Count: n, Model: h100}}
	}
	nvl := func(r Request) Request { r.GPU.Topology = contracts.TopologyNVLink; return r }
	tests := map[string]struct {
		nodes []Node
		req   Request
		want  Pending
	}{
		"no nodes": {nil, whole(1), Pending{contracts.PendingNoNodes, "needs 1×GPU on one machine; no nodes are registered"}},
		"no such pool": {[]Node{h01}, Request{GPU: contracts.GPURequest{Count: 1}, Pool: "x"},
			Pending{contracts.PendingNoNodes, "needs 1×GPU on one machine in pool x; no nodes in pool x"}},
		"no such model": {[]Node{h01}, Request{GPU: contracts.GPURequest{Count: 1, Model: "L4"}},
			Pending{contracts.PendingNoMatchingModel, "needs 1×L4 on one machine; no node has L4 GPUs out of MIG mode"}},
		"never fits": {[]Node{h01, h03}, h100x(16),
			Pending{contracts.ReasonUnsatisfiable, "needs 16×H100-80GB on one machine; no machine could ever hold it: the largest machine has 8 (h100-01)"}},
		"largest free block": {[]Node{h01, h03}, research(nvl(h100x(8))),
			Pending{contracts.PendingInsufficientGPUs, "needs 8×H100-80GB in one NVLink domain; largest free block in one NVLink domain is 6 on h100-03; 2 jobs ahead in queue research; quota research/h100 at 16 of 16"}},
		"nothing free": {[]Node{h01}, h100x(1),
			Pending{contracts.PendingInsufficientGPUs, "needs 1×H100-80GB on one machine; no matching GPU is free on a usable machine"}},
		"unusable machines": {[]Node{h01, cordoned, tainted}, h100x(8),
			Pending{contracts.PendingInsufficientGPUs, "needs 8×H100-80GB on one machine; no matching GPU is free on a usable machine; not usable: 1 cordoned, 1 tainted NoSchedule (not tolerated)"}},
		"no usable machine": {[]Node{cordoned, tainted}, h100x(8),
			Pending{contracts.PendingNoSchedulableNode, "needs 8×H100-80GB on one machine; none of the 2 machines that could hold it are usable: 1 cordoned, 1 tainted NoSchedule (not tolerated)"}},
		"host capacity": {[]Node{h03}, Request{GPU: contracts.GPURequest{Count: 2}, CPUMilli: 96000, MemoryMiB: 1024},
			Pending{contracts.PendingNoSchedulableNode, "needs 2×GPU on one machine; its GPUs are free on 1 machine but none has 96000 milli-CPU and 1024 MiB host memory free (most: 64000 milli-CPU and 524288 MiB on h100-03)"}},
		"reserved": {[]Node{h03}, Request{GPU: contracts.GPURequest{Count: 2}, Exclude: map[string]bool{"h100-03": true}},
			Pending{contracts.PendingReservedForOther, "needs 2×GPU on one machine; none of the 1 machine that could hold it is usable: 1 reserved for jobs ahead"}},
		"quota": {[]Node{h03}, Request{GPU: contracts.GPURequest{Count: 2}, AllowPool: func(string) bool { return false }},
			Pending{contracts.PendingQuotaExceeded, "needs 2×GPU on one machine; none of the 1 machine that could hold it is usable: 1 in a pool without quota headroom"}},
		"MIG instances held": {[]Node{migNode}, mig("1g.10gb"),
			Pending{contracts.PendingInsufficientGPUs, "needs a 1g.10gb MIG instance; 0 of the 2 1g.10gb instances on usable machines are free"}},
		"share room": {[]Node{shareNode}, share(10240, 30),
			Pending{contracts.PendingInsufficientGPUs, "needs 30% and 10240 MiB of one GPU; the most room on one card is 20% and 71680 MiB on s1"}},
		"gang machines": {[]Node{h01, h03}, Request{GPU: contracts.GPURequest{Count: 24, Nodes: 3}},
			Pending{contracts.ReasonUnsatisfiable, "needs 8×GPU on each of 3 machines; no job can ever get 3 such machines: 2 machines could hold its part"}},
		"gang free": {[]Node{h01, h03}, Request{GPU: contracts.GPURequest{Count: 12, Nodes: 2}},
			Pending{contracts.PendingInsufficientGPUs, "needs 6×GPU on each of 2 machines; 1 machine has 6 free"}},
		"invalid": {[]Node{h03}, whole(0), Pending{contracts.ReasonUnsatisfiable, "invalid request: gpu count 0; want 1 to 1024"}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			d := NewPlacer(Snapshot{Nodes: tt.nodes}, Options{}).Place(tt.req)
			if diff := cmp.Diff(tt.want, d.Pending); diff != "" {
				t.Errorf("pending (-want +got):\n%s", diff)
			}
			if d.Pending.Unsatisfiable() != (tt.want.Code == contracts.ReasonUnsatisfiable) {
				t.Error("Unsatisfiable disagrees with the code")
			}
		})
	}
	t.Run("queued behind jobs placed this cycle", func(t *testing.T) {
		p := NewPlacer(Snapshot{Nodes: []Node{h03}}, Options{})
		p.Place(whole(4))
		d := p.Place(whole(4))
		want := Pending{contracts.PendingQueuedBehind, "needs 4×GPU on one machine; the free capacity went to 1 job placed ahead of it this cycle; largest free block is now 2 on h100-03"}
		if diff := cmp.Diff(want, d.Pending); diff != "" {
			t.Errorf("pending (-want +got):\n%s", diff)
		}
	})
}

func TestDeterministicAndPure(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	snap := randomCluster(rng, 40)
	reqs := make([]Request, 200)
	for i := range reqs {
		reqs[i] = randomRequest(rng, nil)
		reqs[i].AllowPool = nil
	}
	before := newMirror(snap).snapshot()
	first := run(snap, Options{}, reqs...)
	if diff := cmp.Diff(before, newMirror(snap).snapshot()); diff != "" {
		t.Fatalf("NewPlacer or Place modified the snapshot:\n%s", diff)
	}
	shuffled := Snapshot{Nodes: slices.Clone(snap.Nodes)}
	rng.Shuffle(len(shuffled.Nodes), func(i, j int) { shuffled.Nodes[i], shuffled.Nodes[j] = shuffled.Nodes[j], shuffled.Nodes[i] })
	if diff := cmp.Diff(first, run(shuffled, Options{}, reqs...)); diff != "" {
		t.Errorf("decisions depend on the snapshot's node order (-first +shuffled):\n%s", diff)
	}
}

func TestFitNode(t *testing.T) {
	n := mk("n1", "p", 4, 1)
	n.GPUs[3].SharePercent, n.GPUs[3].ShareMemMiB = 50, 1024
	n.Labels = map[string]string{"rack": "r1"}
	tests := map[string]struct {
		node Node
		req  Request
		want string // devices, or "" for no fit
	}{
		"whole":            {n, whole(2), "1 2"},
		"too many":         {n, whole(3), ""},
		"share, tightest":  {n, share(1024, 40), "3"},
		"cpu":              {n, Request{GPU: contracts.GPURequest{Count: 1}, CPUMilli: 64001}, ""},
		"selector":         {n, Request{GPU: contracts.GPURequest{Count: 1}, Selector: map[string]string{"rack": "r2"}}, ""},
		"pool":             {n, Request{GPU: contracts.GPURequest{Count: 1}, Pool: "q"}, ""},
		"excluded":         {n, Request{GPU: contracts.GPURequest{Count: 1}, Exclude: map[string]bool{"n1": true}}, ""},
		"quota":            {n, Request{GPU: contracts.GPURequest{Count: 1}, AllowPool: func(string) bool { return false }}, ""},
		"gang part":        {n, Request{GPU: contracts.GPURequest{Count: 4, Nodes: 2}}, "1 2"},
		"invalid":          {n, Request{GPU: contracts.GPURequest{Count: 3, Nodes: 2}}, ""},
		"no MIG instances": {n, mig("1g.10gb"), ""},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			devs, ok := FitNode(&tt.node, tt.req)
			got := ""
			for i, d := range devs {
				if i > 0 {
					got += " "
				}
				got += string(rune('0' + d.Index))
			}
			if ok != (tt.want != "") || got != tt.want {
				t.Errorf("FitNode = %q, %v; want %q", got, ok, tt.want)
			}
		})
	}
	if _, ok := FitNode(nil, whole(1)); ok {
		t.Error("FitNode(nil) fits")
	}
}
