package fragsim

import (
	"math"
	"testing"
)

// reserveCluster is 4 machines of 8 GPUs and 128 cores (32 of the 80
// GPUs: 40%) and 6 of 8 GPUs and 96 cores, described per machine or per
// class (Machines).
func reserveCluster(perClass bool) []NodeSpec {
	big := NodeSpec{Name: "big", CPUMilli: 128000, MemoryMiB: 1 << 20, GPUs: 8}
	small := NodeSpec{Name: "small", CPUMilli: 96000, MemoryMiB: 1 << 20, GPUs: 8}
	if perClass {
		big.Machines, small.Machines = 4, 6
		return []NodeSpec{big, small}
	}
	var out []NodeSpec
	for range 4 {
		out = append(out, big)
	}
	for range 6 {
		out = append(out, small)
	}
	return out
}

// reserveList asks for 160 GPUs: one 8-GPU task of 120 cores (only the big
// machines fit it), four of 64 cores (every machine does), one of 200
// cores (none does) and 112 single GPUs.
func reserveList() []Pod {
	return append(append(append(pods(1, whole(120000, 8)), pods(4, whole(64000, 8))...),
		pods(1, whole(200000, 8))...), pods(112, whole(8000, 1))...)
}

func TestReserveKinds(t *testing.T) {
	// The 120-core kind: 8,000 of 160,000 milli-GPU demanded, a home of
	// 32 of 80 GPUs: pressure 0.05 × (80/32)² = 0.3125, cost 0.3125 × 8,000.
	// The 64-core kind's home is all 80 GPUs, over maxHome; the 200-core
	// kind has none.
	for name, perClass := range map[string]bool{"a spec per machine": false, "a spec per class": true} {
		t.Run(name, func(t *testing.T) {
			got := reserveKinds(reserveCluster(perClass), reserveList(), 1, 0.5)
			if len(got) != 1 || got[0].CPUMilli != 120000 || math.Abs(got[0].cost-2500) > 1e-9 {
				t.Fatalf("reserveKinds = %+v, want the 120-core kind alone at cost 2500", got)
			}
			if got := reserveKinds(reserveCluster(perClass), reserveList(), 1, 1); len(got) != 2 {
				t.Errorf("maxHome 1: %d kinds, want the 64- and 120-core ones", len(got))
			}
		})
	}
}

// TestReserveLost checks when a placement is charged for a machine that
// stops being able to host the reserved kind: only when it could before
// and cannot after, whatever took the GPU or the CPU.
func TestReserveLost(t *testing.T) {
	p := NewFragAwareWith(reserveCluster(false), reserveList(), FragAwareOptions{Workload: FGDWorkloadOptions, Reserve: 1, ReserveHome: 0.5})
	idleBig := newNodeState(reserveCluster(false)[0])
	usedBig := idleBig
	if err := usedBig.Assign(whole(8000, 1), -1); err != nil {
		t.Fatal(err)
	}
	idleSmall := newNodeState(reserveCluster(false)[4])
	tests := map[string]struct {
		n    NodeState
		r    Request
		gpu  int
		want float64
	}{
		"a GPU from an idle big machine":       {n: idleBig, r: whole(8000, 1), gpu: -1, want: 2500},
		"a share of an idle big machine":       {n: idleBig, r: share(1000, 300), gpu: 3, want: 2500},
		"CPU alone below the kind's 120 cores": {n: idleBig, r: Request{CPUMilli: 10000, Models: AnyModel}, gpu: -1, want: 2500},
		"CPU alone, 120 cores left":            {n: idleBig, r: Request{CPUMilli: 8000, Models: AnyModel}, gpu: -1, want: 0},
		"the reserved kind itself":             {n: idleBig, r: whole(120000, 8), gpu: -1, want: 2500},
		"a big machine already in use":         {n: usedBig, r: whole(8000, 1), gpu: -1, want: 0},
		"an idle small machine":                {n: idleSmall, r: whole(8000, 1), gpu: -1, want: 0},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			if got := p.reserveLost(&tc.n, tc.r, tc.gpu); math.Abs(got-tc.want) > 1e-9 {
				t.Errorf("reserveLost = %v, want %v", got, tc.want)
			}
		})
	}
	// So a single GPU goes to the small machine, though the big one has
	// more CPU to spare.
	big, small := idleBig, idleSmall
	if sb, ss := p.Score(&big, whole(24000, 1)).Score, p.Score(&small, whole(24000, 1)).Score; sb >= ss {
		t.Errorf("idle big machine scores %v, idle small %v: the reserve did not keep the big one", sb, ss)
	}
}
