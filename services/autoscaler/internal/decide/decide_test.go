package decide

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

var (
	now   = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	h100x = Machine{Type: "a3-highgpu-8g", GPUs: 8, Model: "H100-80GB"}
)

func demand(nodes int, waiting ...contracts.Shape) contracts.PoolDemand {
	return contracts.PoolDemand{Pool: "h100", Nodes: nodes, Waiting: waiting}
}

func shape(count, gpus int) contracts.Shape {
	return contracts.Shape{Model: "H100-80GB", GPUs: gpus, Count: count}
}

func up(current, desired int, reason string) *contracts.ScaleDecision {
	return &contracts.ScaleDecision{SchemaVersion: 1, ID: ID("h100", 42, contracts.ScaleUp, desired), Pool: "h100",
		Direction: contracts.ScaleUp, CurrentNodes: current, DesiredNodes: desired, Reason: reason, Time: now}
}

func TestDecideSizesTheScaleUp(t *testing.T) {
	tests := map[string]struct {
		in   Input
		want *contracts.ScaleDecision
	}{
		"three 8-GPU jobs on 8-GPU machines: +3": {
			in:   Input{Demand: demand(2, shape(3, 8)), Machine: h100x, Max: 10},
			want: up(2, 5, "3 jobs waiting (3×8 GPUs H100-80GB) need 3 more a3-highgpu-8g machines of 8 GPUs"),
		},
		"three 8-GPU jobs, capped by the pool maximum": {
			in: Input{Demand: demand(2, shape(3, 8)), Machine: h100x, Max: 4},
			want: up(2, 4, "3 jobs waiting (3×8 GPUs H100-80GB) need 3 more a3-highgpu-8g machines of 8 GPUs; "+
				"capped at the pool maximum of 4 nodes"),
		},
		"small shapes are bin-packed, not one machine each": {
			// 3×4 + 5×2 = 22 GPUs: first-fit decreasing gives [4 4] [4 2 2] [2 2 2].
			in: Input{Demand: demand(1, shape(5, 2), shape(3, 4)), Machine: h100x, Max: 10},
			want: up(1, 4, "8 jobs waiting (5×2 GPUs H100-80GB, 3×4 GPUs H100-80GB) need 3 more a3-highgpu-8g "+
				"machines of 8 GPUs"),
		},
		"a shape larger than one machine is not helped, and the reason says so": {
			in: Input{Demand: demand(2, shape(1, 16), shape(1, 8)), Machine: h100x, Max: 10},
			want: up(2, 3, "1 job waiting (1×8 GPUs H100-80GB) need 1 more a3-highgpu-8g machine of 8 GPUs; "+
				"not helped by scaling: 1 job of 16 GPUs (more than one a3-highgpu-8g machine has)"),
		},
		"any model fits; another model is not helped": {
			in: Input{Demand: demand(2, contracts.Shape{Model: "any", GPUs: 1, Count: 1},
				contracts.Shape{Model: "A100-80GB", GPUs: 1, Count: 2}), Machine: h100x, Max: 10},
			want: up(2, 3, "1 job waiting (1×1 GPU) need 1 more a3-highgpu-8g machine of 8 GPUs; "+
				"not helped by scaling: 2 jobs wanting A100-80GB (the pool's machines have H100-80GB)"),
		},
		"demand without a node count uses the inventory's live nodes": {
			in:   Input{Demand: demand(0, shape(1, 8)), Machine: h100x, LiveNodes: 3, Max: 10},
			want: up(3, 4, "1 job waiting (1×8 GPUs H100-80GB) need 1 more a3-highgpu-8g machine of 8 GPUs"),
		},
		"a huge count is bounded and said so": {
			in: Input{Demand: demand(2, shape(1_000_000_000, 1)), Machine: h100x, Max: 5},
			want: up(2, 5, "1000000000 jobs waiting (1000000000×1 GPU H100-80GB) need more than 1003 more "+
				"a3-highgpu-8g machines of 8 GPUs; capped at the pool maximum of 5 nodes"),
		},
		"cooldown over: decide again": {
			in: Input{Demand: demand(2, shape(4, 8)), Machine: h100x, Max: 10, Cooldown: 30 * time.Second,
				Last: &Previous{ID: "scale/h100/41/up-5", Current: 2, Desired: 5, Time: now.Add(-30 * time.Second)}},
			want: up(2, 6, "4 jobs waiting (4×8 GPUs H100-80GB) need 4 more a3-highgpu-8g machines of 8 GPUs"),
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			tc.in.Now, tc.in.DemandSeq = now, 42
			got := Decide(tc.in)
			if diff := cmp.Diff(tc.want, got.Decision); diff != "" {
				t.Errorf("decision (-want +got):\n%s", diff)
			}
			if got.Why != tc.want.Reason {
				t.Errorf("Why = %q, want the reason", got.Why)
			}
		})
	}
}

func TestDecideHoldsWhenScalingIsWrong(t *testing.T) {
	last := &Previous{ID: "scale/h100/41/up-5", Current: 2, Desired: 5, Time: now.Add(-10 * time.Second)}
	tests := map[string]struct {
		in  Input
		why string
	}{
		"nothing waits (the demand fits already)": {
			in:  Input{Demand: demand(2), Machine: h100x, Max: 10},
			why: "nothing waits for pool h100",
		},
		"empty shapes are ignored": {
			in:  Input{Demand: demand(2, shape(0, 8), shape(3, 0)), Machine: h100x, Max: 10},
			why: "nothing waits for pool h100",
		},
		"machine type unknown": {
			in:  Input{Demand: demand(2, shape(1, 8)), Max: 10},
			why: "pool h100: machine type unknown (no inventory with GPUs); cannot size a scale-up",
		},
		"only shapes larger than a machine": {
			in:  Input{Demand: demand(2, shape(2, 16)), Machine: h100x, Max: 10},
			why: "more machines would not help: 2 jobs of 16 GPUs (more than one a3-highgpu-8g machine has)",
		},
		"pool at its maximum": {
			in:  Input{Demand: demand(4, shape(3, 8)), Machine: h100x, Max: 4},
			why: "pool h100 has 4 nodes, at or above its maximum of 4",
		},
		"in cooldown": {
			in:  Input{Demand: demand(2, shape(4, 8)), Machine: h100x, Max: 10, Cooldown: 30 * time.Second, Last: last},
			why: "in cooldown until 2025-03-01T12:00:20Z after decision scale/h100/41/up-5",
		},
		"the same decision again, even after the cooldown": {
			in: Input{Demand: demand(2, shape(3, 8)), Machine: h100x, Max: 10, Cooldown: time.Second,
				Last: &Previous{ID: "scale/h100/41/up-5", Current: 2, Desired: 5, Time: now.Add(-time.Hour)}},
			why: "already decided: 2 to 5 nodes (scale/h100/41/up-5)",
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			tc.in.Now, tc.in.DemandSeq = now, 42
			got := Decide(tc.in)
			if diff := cmp.Diff(Outcome{Why: tc.why}, got); diff != "" {
				t.Errorf("outcome (-want +got):\n%s", diff)
			}
		})
	}
}

// Machines already asked for (booting) take waiting shapes before new ones
// are sized: a cooldown ending before they register must not ask for the
// same shapes again.
func TestDecideCountsBootingMachines(t *testing.T) {
	h100x4 := Machine{Type: "hgx-h100-4", GPUs: 4, Model: "H100-80GB"}
	tests := map[string]struct {
		in   Input
		want *contracts.ScaleDecision
		why  string
	}{
		"2 booting absorb 2 waiting 4-GPU shapes: no new machine": {
			in:  Input{Demand: demand(1, shape(2, 4)), Machine: h100x4, Booting: 2, Max: 10},
			why: "pool h100: 2 jobs waiting (2×4 GPUs H100-80GB) fit on the 2 hgx-h100-4 machines already booting",
		},
		"2 booting, 3 waiting 4-GPU shapes: 1 more": {
			in: Input{Demand: demand(1, shape(3, 4)), Machine: h100x4, Booting: 2, Max: 10},
			want: up(3, 4, "3 jobs waiting (3×4 GPUs H100-80GB) need 1 more hgx-h100-4 machine of 4 GPUs "+
				"beyond the 2 machines booting"),
		},
		"small shapes share a booting machine": {
			in:  Input{Demand: demand(1, shape(4, 2)), Machine: h100x, Booting: 1, Max: 10},
			why: "pool h100: 4 jobs waiting (4×2 GPUs H100-80GB) fit on the 1 a3-highgpu-8g machine already booting",
		},
		"booting count against the maximum": {
			in: Input{Demand: demand(1, shape(5, 4)), Machine: h100x4, Booting: 2, Max: 4},
			want: up(3, 4, "5 jobs waiting (5×4 GPUs H100-80GB) need 3 more hgx-h100-4 machines of 4 GPUs "+
				"beyond the 2 machines booting; capped at the pool maximum of 4 nodes"),
		},
		"at the maximum with booting machines": {
			in:  Input{Demand: demand(2, shape(3, 4)), Machine: h100x4, Booting: 2, Max: 4},
			why: "pool h100 has 4 nodes (2 booting), at or above its maximum of 4",
		},
		"the decision that made them is not repeated": {
			in: Input{Demand: demand(1, shape(3, 4)), Machine: h100x4, Booting: 2, Max: 10, Cooldown: time.Second,
				Last: &Previous{ID: "scale/h100/41/up-4", Current: 3, Desired: 4, Time: now.Add(-time.Hour)}},
			why: "already decided: 3 to 4 nodes (scale/h100/41/up-4)",
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			tc.in.Now, tc.in.DemandSeq = now, 42
			got := Decide(tc.in)
			want := Outcome{Decision: tc.want, Why: tc.why}
			if tc.want != nil {
				want.Why = tc.want.Reason
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("outcome (-want +got):\n%s", diff)
			}
		})
	}
}

func TestPack(t *testing.T) {
	tests := map[string]struct {
		shapes   []contracts.Shape
		capacity int
		booting  int
		limit    int
		want     int
		complete bool
	}{
		"nothing":                         {nil, 8, 0, 10, 0, true},
		"exact fit":                       {[]contracts.Shape{shape(2, 4)}, 8, 0, 10, 1, true},
		"odd sizes leave holes":           {[]contracts.Shape{shape(3, 5)}, 8, 0, 10, 3, true},
		"decreasing fills holes":          {[]contracts.Shape{shape(3, 3), shape(3, 5)}, 8, 0, 10, 3, true},
		"stops at the limit":              {[]contracts.Shape{shape(5, 8)}, 8, 0, 3, 3, false},
		"exactly at the limit":            {[]contracts.Shape{shape(3, 8)}, 8, 0, 3, 3, true},
		"one-GPU jobs share hosts":        {[]contracts.Shape{shape(17, 1)}, 8, 0, 10, 3, true},
		"booting machines fill first":     {[]contracts.Shape{shape(3, 4)}, 8, 1, 10, 1, true},
		"the limit counts new ones only":  {[]contracts.Shape{shape(5, 8)}, 8, 2, 3, 3, true},
		"holes on booting ones are used":  {[]contracts.Shape{shape(2, 5), shape(2, 3)}, 8, 2, 10, 0, true},
		"booting absorb all, none needed": {[]contracts.Shape{shape(2, 4)}, 4, 2, 10, 0, true},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			got, complete := pack(tc.shapes, Machine{GPUs: tc.capacity}, tc.booting, tc.limit)
			if got != tc.want || complete != tc.complete {
				t.Errorf("pack = %d, %v; want %d, %v", got, complete, tc.want, tc.complete)
			}
		})
	}
}

var (
	// h100mig is 8 H100s in MIG mode, each cut into 7 × 1g.10gb.
	h100mig = Machine{Type: "a3-mig", GPUs: 8, Model: "H100-80GB", MemoryMiB: 81920, MIGGPUs: 8,
		MIG: map[string]int{"1g.10gb": 56}}
	// h100half has 4 GPUs in MIG mode (7 × 1g.10gb each) and 4 whole.
	h100half = Machine{Type: "a3-half", GPUs: 8, Model: "H100-80GB", MemoryMiB: 81920, MIGGPUs: 4,
		MIG: map[string]int{"1g.10gb": 28}}
	l4x1 = Machine{Type: "g2-standard-4", GPUs: 1, Model: "L4", MemoryMiB: 23034}
)

func migShape(count int, profile string) contracts.Shape {
	return contracts.Shape{Model: "H100-80GB", GPUs: 1, Count: count, MIGProfile: profile}
}

func shareShape(count int, model string, memMiB int64, pct int) contracts.Shape {
	return contracts.Shape{Model: model, GPUs: 1, Count: count, Share: &contracts.GPUShare{MemoryMiB: memMiB, ComputePercent: pct}}
}

// MIG shapes take one instance of their profile, shares a fraction of one
// GPU: neither counts as a whole GPU, and a machine type without the
// profile, or with GPUs too small for the share, is not helped by scaling.
func TestDecideSizesMIGAndShares(t *testing.T) {
	tests := map[string]struct {
		in   Input
		want *contracts.ScaleDecision
		why  string
	}{
		"56 × 1g.10gb fill one machine of 8 × 7 instances": {
			in:   Input{Demand: demand(1, migShape(56, "1g.10gb")), Machine: h100mig, Max: 10},
			want: up(1, 2, "56 jobs waiting (56×MIG 1g.10gb H100-80GB) need 1 more a3-mig machine of 8 GPUs"),
		},
		"57 × 1g.10gb need a second machine": {
			in:   Input{Demand: demand(1, migShape(57, "1g.10gb")), Machine: h100mig, Max: 10},
			want: up(1, 3, "57 jobs waiting (57×MIG 1g.10gb H100-80GB) need 2 more a3-mig machines of 8 GPUs"),
		},
		"a profile the machine type lacks: more machines would not help": {
			in:  Input{Demand: demand(1, migShape(3, "3g.40gb")), Machine: h100mig, Max: 10},
			why: "more machines would not help: 3 jobs wanting MIG 3g.40gb (a3-mig machines have none)",
		},
		"MIG shapes on a machine type without MIG": {
			in:  Input{Demand: demand(1, migShape(1, "1g.10gb")), Machine: h100x, Max: 10},
			why: "more machines would not help: 1 job wanting MIG 1g.10gb (a3-highgpu-8g machines have none)",
		},
		"3 shares of 40% on 1-GPU machines: 2 per GPU, 2 machines": {
			in:   Input{Demand: demand(1, shareShape(3, "L4", 8192, 40)), Machine: l4x1, Max: 10},
			want: up(1, 3, "3 jobs waiting (3×share 40%/8192 MiB L4) need 2 more g2-standard-4 machines of 1 GPU"),
		},
		"shares bounded by the GPU's memory": {
			// 10% compute each but 12000 MiB of 23034: one per GPU.
			in:   Input{Demand: demand(1, shareShape(3, "any", 12000, 10)), Machine: l4x1, Max: 10},
			want: up(1, 4, "3 jobs waiting (3×share 10%/12000 MiB) need 3 more g2-standard-4 machines of 1 GPU"),
		},
		"a share bigger than one GPU is not helped": {
			in: Input{Demand: demand(1, shareShape(1, "L4", 40960, 50), shareShape(2, "L4", 4096, 50)), Machine: l4x1, Max: 10},
			want: up(1, 2, "2 jobs waiting (2×share 50%/4096 MiB L4) need 1 more g2-standard-4 machine of 1 GPU; "+
				"not helped by scaling: 1 job wanting a share of 40960 MiB (more than a GPU of g2-standard-4 machines has)"),
		},
		"shares on a machine type whose GPUs are all in MIG mode": {
			in:  Input{Demand: demand(1, shareShape(1, "H100-80GB", 1024, 10)), Machine: h100mig, Max: 10},
			why: "more machines would not help: 1 job wanting a GPU share (a3-mig machines have every GPU in MIG mode)",
		},
		"mixed whole and MIG share machines but not GPUs": {
			// Whole 2×4 on the 4 whole GPUs of 2 machines, 30 MIG on their
			// 28 + 2 instances; 8 whole GPUs exceed the 4 outside MIG.
			in: Input{Demand: demand(1, shape(2, 4), migShape(30, "1g.10gb"), shape(1, 8)), Machine: h100half, Max: 10},
			want: up(1, 3, "32 jobs waiting (2×4 GPUs H100-80GB, 30×MIG 1g.10gb H100-80GB) need 2 more a3-half machines "+
				"of 8 GPUs; not helped by scaling: 1 job of 8 GPUs (more than the 4 GPUs outside MIG mode one a3-half machine has)"),
		},
		"whole GPUs and shares do not mix on one GPU": {
			// 7 whole GPUs, then 2 shares on the eighth; the third needs a
			// new machine.
			in: Input{Demand: demand(1, shareShape(3, "any", 1024, 40), shape(7, 1)), Machine: h100x, Max: 10},
			want: up(1, 3, "10 jobs waiting (3×share 40%/1024 MiB, 7×1 GPU H100-80GB) need 2 more a3-highgpu-8g "+
				"machines of 8 GPUs"),
		},
		"booting machines absorb MIG shapes": {
			in:  Input{Demand: demand(1, migShape(100, "1g.10gb")), Machine: h100mig, Booting: 2, Max: 10},
			why: "pool h100: 100 jobs waiting (100×MIG 1g.10gb H100-80GB) fit on the 2 a3-mig machines already booting",
		},
		"a huge MIG count is bounded": {
			in: Input{Demand: demand(1, migShape(1_000_000_000, "1g.10gb")), Machine: h100mig, Max: 3},
			want: up(1, 3, "1000000000 jobs waiting (1000000000×MIG 1g.10gb H100-80GB) need more than 1002 more a3-mig "+
				"machines of 8 GPUs; capped at the pool maximum of 3 nodes"),
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			tc.in.Now, tc.in.DemandSeq = now, 42
			got := Decide(tc.in)
			want := Outcome{Decision: tc.want, Why: tc.why}
			if tc.want != nil {
				want.Why = tc.want.Reason
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("outcome (-want +got):\n%s", diff)
			}
		})
	}
}

func TestPackMIGAndShares(t *testing.T) {
	tests := map[string]struct {
		shapes   []contracts.Shape
		machine  Machine
		booting  int
		limit    int
		want     int
		complete bool
	}{
		"instances of two profiles are separate slots": {
			shapes:  []contracts.Shape{migShape(2, "3g.40gb"), migShape(4, "1g.10gb")},
			machine: Machine{GPUs: 1, MIGGPUs: 1, MIG: map[string]int{"3g.40gb": 1, "1g.10gb": 4}},
			limit:   10, want: 2, complete: true,
		},
		"shares fill the holes whole GPUs leave on booting machines": {
			shapes:  []contracts.Shape{shape(1, 6), shareShape(4, "any", 1024, 50)},
			machine: h100x, booting: 1, limit: 10, want: 0, complete: true,
		},
		"shares of different sizes first-fit decreasing": {
			// 60+40, 60+40, 60: three GPUs.
			shapes:  []contracts.Shape{shareShape(2, "L4", 1, 40), shareShape(3, "L4", 1, 60)},
			machine: l4x1, limit: 10, want: 3, complete: true,
		},
		"memory unknown: only compute counts": {
			shapes:  []contracts.Shape{shareShape(4, "L4", 1_000_000, 25)},
			machine: Machine{GPUs: 1}, limit: 10, want: 1, complete: true,
		},
		"a huge share count stops at the limit": {
			shapes:  []contracts.Shape{shareShape(1_000_000_000, "L4", 1, 1)},
			machine: l4x1, limit: 5, want: 5, complete: false,
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			got, complete := pack(tc.shapes, tc.machine, tc.booting, tc.limit)
			if got != tc.want || complete != tc.complete {
				t.Errorf("pack = %d, %v; want %d, %v", got, complete, tc.want, tc.complete)
			}
		})
	}
}
