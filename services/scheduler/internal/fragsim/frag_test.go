package fragsim

import (
	"math"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// pods repeats a request n times, to give a kind weight n in a Workload.
func pods(n int, r Request) []Pod {
	out := make([]Pod, n)
	for i := range out {
		out[i] = Pod{Request: r}
	}
	return out
}

func share(cpu, milli int64) Request {
	return Request{CPUMilli: cpu, GPUs: 1, GPUMilli: milli, Models: AnyModel}
}

func whole(cpu int64, gpus int) Request {
	return Request{CPUMilli: cpu, GPUs: gpus, GPUMilli: MilliGPU, Models: AnyModel}
}

// node4 is a 4-GPU node of model 0 with 8 CPUs and 64 GiB free and devices
// (in index order) 300, 1000, 0 and 600 milli-GPU free: 1,900 idle.
func node4() NodeState {
	n := NodeState{Model: 0, GPUs: 4, CPUCap: 32000, MemCap: 262144, CPULeft: 8000, MemLeft: 65536}
	copy(n.GPULeft[:], []int64{300, 1000, 0, 600})
	n.wholeFree = 1
	return n
}

// TestFrag checks the measure on hand-computed cases, one per quadrant of
// the FGD paper's definition: a task that can run on the node (Q-III) sees
// as fragments the devices with less room than it asks; one that cannot
// (lacks GPU: Q-II, lacks CPU: Q-IV, CPU-only: the x-axis, or a model it
// may not use) sees all idle GPU as fragments.
func TestFrag(t *testing.T) {
	onModel1 := share(2000, 500)
	onModel1.Models = 1 << 1
	bigMem := share(2000, 500)
	bigMem.MemoryMiB = 131072
	tests := map[string]struct {
		pods []Pod
		opt  WorkloadOptions
		node func() NodeState
		want float64
	}{
		"Q-III share: devices below 500":     {pods: pods(1, share(2000, 500)), node: node4, want: 300},
		"Q-III share: devices below 700":     {pods: pods(1, share(2000, 700)), node: node4, want: 300 + 600},
		"Q-III one whole GPU":                {pods: pods(1, whole(2000, 1)), node: node4, want: 300 + 600},
		"Q-II two whole GPUs, one idle":      {pods: pods(1, whole(2000, 2)), node: node4, want: 1900},
		"Q-IV lacks CPU":                     {pods: pods(1, share(9000, 500)), node: node4, want: 1900},
		"x-axis CPU-only task":               {pods: pods(1, Request{CPUMilli: 1000, Models: AnyModel}), node: node4, want: 1900},
		"model it may not use":               {pods: pods(1, onModel1), node: node4, want: 1900},
		"mixture 3:1 of Q-III and Q-II":      {pods: append(pods(3, share(2000, 500)), pods(1, whole(2000, 2))...), node: node4, want: 0.75*300 + 0.25*1900},
		"memory ignored, as FGD does":        {pods: pods(1, bigMem), node: node4, want: 300},
		"memory counted with ByMemory":       {pods: pods(1, bigMem), opt: WorkloadOptions{ByMemory: true}, node: node4, want: 1900},
		"no idle GPU, no fragment":           {pods: pods(1, whole(2000, 2)), node: func() NodeState { n := node4(); n.GPULeft = [MaxGPUsPerNode]int64{}; return n }, want: 0},
		"idle node, one-GPU task: none lost": {pods: pods(1, whole(2000, 1)), node: func() NodeState { return newNodeState(NodeSpec{CPUMilli: 8000, GPUs: 2}) }, want: 0},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			w := NewWorkload(tc.pods, tc.opt)
			n := tc.node()
			if got := w.Frag(&n); math.Abs(got-tc.want) > 1e-9 {
				t.Errorf("Frag = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestFragAfter(t *testing.T) {
	w := NewWorkload(pods(1, share(2000, 500)), WorkloadOptions{})
	n := node4()
	before := w.Frag(&n)
	// 500 on the 600 device leaves 100: fragments 300 + 100.
	if got := w.FragAfter(&n, share(1000, 500), 3); got != 400 {
		t.Errorf("FragAfter(share on device 3) = %v, want 400", got)
	}
	// The whole GPU taken leaves 300 and 600: 300 is a fragment.
	if got := w.FragAfter(&n, whole(1000, 1), -1); got != 300 {
		t.Errorf("FragAfter(whole) = %v, want 300", got)
	}
	// 7.5 of 8 CPUs taken: the kind no longer fits, all 1,900 idle.
	if got := w.FragAfter(&n, Request{CPUMilli: 7500, Models: AnyModel}, -1); got != 1900 {
		t.Errorf("FragAfter(CPU-only) = %v, want 1900", got)
	}
	if n.GPULeft[3] != 600 || w.Frag(&n) != before {
		t.Errorf("FragAfter changed the node: %+v", n)
	}
	// The cache is dropped on Assign.
	if err := n.Assign(share(1000, 500), 3); err != nil {
		t.Fatal(err)
	}
	if got := w.Frag(&n); got != 400 {
		t.Errorf("Frag after Assign = %v, want 400", got)
	}
}

func TestNewWorkload(t *testing.T) {
	a, b, c := share(1000, 500), whole(4000, 1), Request{CPUMilli: 8000, Models: AnyModel}
	list := append(append(pods(6, a), pods(3, b)...), pods(1, c)...)
	tests := map[string]struct {
		opt  WorkloadOptions
		want []TypicalTask
	}{
		"coverage 90% keeps the two most frequent": {opt: WorkloadOptions{Coverage: 0.9},
			want: []TypicalTask{{Request: a, Weight: 6.0 / 9}, {Request: b, Weight: 3.0 / 9}}},
		"coverage 95% (FGD) needs the third": {opt: FGDWorkloadOptions,
			want: []TypicalTask{{Request: a, Weight: 0.6}, {Request: b, Weight: 0.3}, {Request: c, Weight: 0.1}}},
		"GPUWeight counts whole-GPU tasks more": {opt: WorkloadOptions{GPUWeight: 1},
			want: []TypicalTask{{Request: b, Weight: 6.0 / 13}, {Request: a, Weight: 6.0 / 13}, {Request: c, Weight: 1.0 / 13}}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			got := NewWorkload(list, tc.opt).Tasks
			if diff := cmp.Diff(tc.want, got, cmp.Comparer(func(x, y float64) bool { return math.Abs(x-y) < 1e-12 })); diff != "" {
				t.Errorf("tasks (-want +got):\n%s", diff)
			}
		})
	}
	// Memory splits kinds only when asked to.
	m1, m2 := a, a
	m1.MemoryMiB, m2.MemoryMiB = 1024, 2048
	split := append(pods(1, m1), pods(1, m2)...)
	if n := len(NewWorkload(split, WorkloadOptions{}).Tasks); n != 1 {
		t.Errorf("without ByMemory: %d kinds, want 1", n)
	}
	if n := len(NewWorkload(split, WorkloadOptions{ByMemory: true}).Tasks); n != 2 {
		t.Errorf("with ByMemory: %d kinds, want 2", n)
	}
}

func TestRoomWaste(t *testing.T) {
	list := append(append(append(pods(10, share(0, 470)), pods(5, share(0, 320))...), pods(10, share(0, 810))...), pods(1, share(0, 160))...)
	tests := map[string]struct {
		share float64
		want  map[int64]int64
	}{
		// 160 is 1 of 26 sharing tasks (3.8%): rare at 5%.
		"160 rare": {share: 0.05, want: map[int64]int64{
			530:  60,  // a 470 leaves 60
			190:  190, // nothing frequent fits
			790:  0,   // 470 + 320
			680:  40,  // 320 + 320
			1000: 40,  // 320 + 320 + 320
			0:    0,
		}},
		"160 frequent": {share: 0.03, want: map[int64]int64{190: 30, 1000: 30 /* 810 + 160 */, 210: 50}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			v := roomWaste(list, tc.share)
			for room, want := range tc.want {
				if v[room] != want {
					t.Errorf("roomWaste[%d] = %d, want %d", room, v[room], want)
				}
			}
		})
	}
}

func TestModelPressure(t *testing.T) {
	// Model 0: 10 GPUs, model 1: 30 GPUs. Demand 40 GPUs, of which 4
	// restricted to model 0 and 6 to either model.
	nodes := []NodeSpec{{GPUs: 10, Model: 0}, {GPUs: 10, Model: 1}, {GPUs: 10, Model: 1}, {GPUs: 10, Model: 1}}
	only0, either := whole(0, 1), whole(0, 1)
	only0.Models, either.Models = 1<<0, 1<<0|1<<1
	list := append(append(pods(4, only0), pods(6, either)...), pods(30, whole(0, 1))...)
	got := modelPressure(nodes, list)
	// Model 0 keeps 4 + 6·10/40 = 5.5 GPUs of 10; model 1 keeps 6·30/40 = 4.5 of 30.
	if math.Abs(got[0]-0.55) > 1e-12 || math.Abs(got[1]-0.15) > 1e-12 {
		t.Errorf("pressure = %v, %v; want 0.55, 0.15", got[0], got[1])
	}
}

// TestFragAwareDevice checks the device choice for sharing tasks: the room
// the frequent sizes can still fill is kept.
func TestFragAwareDevice(t *testing.T) {
	list := append(append(pods(10, share(1000, 470)), pods(5, share(1000, 320))...), pods(10, share(1000, 810))...)
	p := NewFragAwareWith([]NodeSpec{{GPUs: 4}}, list, DefaultFragAwareOptions)
	n := NodeState{GPUs: 4, CPUCap: 64000, MemCap: 1 << 20, CPULeft: 64000, MemLeft: 1 << 20}
	copy(n.GPULeft[:], []int64{1000, 680, 530, 1000})
	tests := map[string]struct {
		r    Request
		want int
	}{
		"470 completes the 530 gap":           {r: share(1000, 470), want: 2},
		"320 into 680 leaves a fillable 360":  {r: share(1000, 320), want: 1},
		"810 fits only an idle device, first": {r: share(1000, 810), want: 0},
		"a whole GPU takes no device choice":  {r: whole(1000, 1), want: -1},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			if got := p.Score(&n, tc.r).GPU; got != tc.want {
				t.Errorf("GPU = %d, want %d", got, tc.want)
			}
		})
	}
}
