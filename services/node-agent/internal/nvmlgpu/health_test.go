package nvmlgpu

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
)

func TestClassifyXID(t *testing.T) {
	tests := []struct {
		xid     int
		kind    contracts.HealthKind
		healthy bool
	}{
		{79, contracts.HealthFellOffBus, false},
		{48, contracts.HealthXID, false},
		{94, contracts.HealthXID, false},
		{95, contracts.HealthXID, false},
		{63, contracts.HealthXID, true},
		{64, contracts.HealthXID, true},
		{92, contracts.HealthXID, true},
		{13, contracts.HealthXID, true},
		{31, contracts.HealthXID, true},
		{43, contracts.HealthXID, true},
		{45, contracts.HealthXID, true},
		{74, contracts.HealthXID, false},  // NVLink error
		{119, contracts.HealthXID, false}, // GSP timeout
	}
	for _, tc := range tests {
		c := ClassifyXID(tc.xid)
		if c.Kind != tc.kind || c.Healthy != tc.healthy || c.What == "" {
			t.Errorf("XID %d: %+v; want kind %s, healthy %v, a description", tc.xid, c, tc.kind, tc.healthy)
		}
	}
}

// fact is the part of a health fact a test compares.
type fact struct {
	GPU     int
	Kind    contracts.HealthKind
	Code    int
	Healthy bool
}

func facts(hs []device.Health) []fact {
	var out []fact
	for _, h := range hs {
		out = append(out, fact{h.GPUIndex, h.Kind, h.Code, h.Healthy})
	}
	return out
}

// collect delivers the facts found so far.
func collect(b *Backend) []device.Health {
	var out []device.Health
	b.deliver(func(h device.Health) { out = append(out, h) })
	return out
}

// TestXIDsOncePerTransition feeds XID events to GPU 1 and checks the
// facts reported and the GPU's health in samples.
func TestXIDsOncePerTransition(t *testing.T) {
	type step struct {
		xid     int
		advance time.Duration
	}
	xids := func(codes ...int) []step {
		var s []step
		for _, c := range codes {
			s = append(s, step{xid: c})
		}
		return s
	}
	tests := []struct {
		name    string
		steps   []step
		want    []fact
		healthy bool
	}{
		{"fell off the bus", xids(79, 79), []fact{{1, contracts.HealthFellOffBus, 79, false}}, false},
		{"double-bit ECC repeated", xids(48, 48, 48), []fact{{1, contracts.HealthXID, 48, false}}, false},
		{"contained then uncontained ECC", xids(94, 95, 94), []fact{
			{1, contracts.HealthXID, 94, false}, {1, contracts.HealthXID, 95, false}}, false},
		{"row remapping and SBE rate leave the GPU usable", xids(63, 64, 92, 63), []fact{
			{1, contracts.HealthXID, 63, true}, {1, contracts.HealthXID, 64, true}, {1, contracts.HealthXID, 92, true}}, true},
		{"application faults, repeats within a window dropped", []step{
			{xid: 13}, {xid: 13}, {xid: 31}, {advance: 30 * time.Second}, {xid: 13},
			{advance: XIDRepeatWindow}, {xid: 13}, {xid: 43}, {xid: 45}}, []fact{
			{1, contracts.HealthXID, 13, true}, {1, contracts.HealthXID, 31, true}, {1, contracts.HealthXID, 13, true},
			{1, contracts.HealthXID, 43, true}, {1, contracts.HealthXID, 45, true}}, true},
		{"application fault on an unhealthy GPU", xids(48, 13), []fact{
			{1, contracts.HealthXID, 48, false}, {1, contracts.HealthXID, 13, false}}, false},
		{"other critical XID", xids(119, 119), []fact{{1, contracts.HealthXID, 119, false}}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := newFakeMachine(t)
			b, clk, _ := open(t, m)
			var got []device.Health
			for _, s := range tc.steps {
				clk.Add(s.advance)
				if s.xid != 0 {
					b.onEvent(nvml.EventData{Device: m.gpus[1], EventType: nvml.EventTypeXidCriticalError, EventData: uint64(s.xid)})
				}
				if _, err := b.Sample(context.Background(), clk.Now(), nil); err != nil {
					t.Fatal(err)
				}
				got = append(got, collect(b)...)
			}
			if diff := cmp.Diff(tc.want, facts(got)); diff != "" {
				t.Errorf("facts (-want +got):\n%s", diff)
			}
			for _, h := range got {
				if h.GPUUUID != m.gpus[1].UUID || !strings.HasPrefix(h.Message, "XID ") {
					t.Errorf("fact %+v: want GPU 1's UUID and an XID message", h)
				}
			}
			s, err := b.Sample(context.Background(), clk.Now(), nil)
			if err != nil {
				t.Fatal(err)
			}
			last := tc.steps[len(tc.steps)-1].xid
			if s[1].Healthy != tc.healthy || s[1].LastXID != last || !s[0].Healthy {
				t.Errorf("GPU 1 healthy %v, last XID %d; want %v, %d (GPU 0 healthy %v)",
					s[1].Healthy, s[1].LastXID, tc.healthy, last, s[0].Healthy)
			}
		})
	}
}

func TestDoubleBitECCOncePerTransition(t *testing.T) {
	tests := []struct {
		name   string
		setup  func(m *fakeMachine)
		counts []uint64 // GPU 2's volatile DBE count before each sample
		events []int    // sample numbers before which a DBE event arrives
		want   []fact
	}{
		{"no error", nil, []uint64{0, 0, 0}, nil, nil},
		{"count rises, then rises again", nil, []uint64{0, 1, 1, 3}, nil,
			[]fact{{2, contracts.HealthECCDBE, 0, false}}},
		{"count already above zero at start", nil, []uint64{2, 2}, nil,
			[]fact{{2, contracts.HealthECCDBE, 0, false}}},
		{"event and count see the same error", nil, []uint64{0, 1, 1}, []int{1},
			[]fact{{2, contracts.HealthECCDBE, 0, false}}},
		{"event where the count cannot be read", func(m *fakeMachine) {
			m.set(2, func(g *fakeGPU) { g.fail["ecc"] = nvml.ERROR_NOT_SUPPORTED })
		}, []uint64{0, 0, 0}, []int{1, 2}, []fact{{2, contracts.HealthECCDBE, 0, false}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := newFakeMachine(t)
			if tc.setup != nil {
				tc.setup(m)
			}
			b, _, _ := open(t, m)
			var got []device.Health
			var healthy bool
			for i, n := range tc.counts {
				m.set(2, func(g *fakeGPU) { g.dbe = n })
				for _, e := range tc.events {
					if e == i {
						b.onEvent(nvml.EventData{Device: m.gpus[2], EventType: nvml.EventTypeDoubleBitEccError})
					}
				}
				s, err := b.Sample(context.Background(), time.Now(), nil)
				if err != nil {
					t.Fatal(err)
				}
				if n > 0 && s[2].ECCDBE != int64(n) {
					t.Errorf("sample %d: ECCDBE %d; want %d", i, s[2].ECCDBE, n)
				}
				healthy = s[2].Healthy
				got = append(got, collect(b)...)
			}
			if diff := cmp.Diff(tc.want, facts(got)); diff != "" {
				t.Errorf("facts (-want +got):\n%s", diff)
			}
			if healthy != (len(tc.want) == 0) {
				t.Errorf("GPU 2 healthy %v after %d facts", healthy, len(tc.want))
			}
		})
	}
}

func TestThermalOncePerTransition(t *testing.T) {
	tests := []struct {
		name  string
		temps []uint32 // GPU 5's temperature before each sample; slowdown at 90 °C
		want  []bool   // healthy of each thermal fact, one per transition
		hot   []int    // which facts say "at or above" (the others "back below")
	}{
		{"stays cool", []uint32{40, 85, 89, 60}, nil, nil},
		{"reaches slowdown and stays", []uint32{80, 90, 95, 92, 90}, []bool{true}, []int{0}},
		{"hovers at the threshold", []uint32{90, 89, 88, 90, 89}, []bool{true}, []int{0}},
		{"cools down and heats again", []uint32{91, 87, 80, 93}, []bool{true, true, true}, []int{0, 2}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := newFakeMachine(t)
			b, _, _ := open(t, m)
			var got []device.Health
			for _, temp := range tc.temps {
				m.set(5, func(g *fakeGPU) { g.tempC = temp })
				s, err := b.Sample(context.Background(), time.Now(), nil)
				if err != nil {
					t.Fatal(err)
				}
				if !s[5].Healthy {
					t.Fatalf("a hot GPU reads unhealthy; it works, slowly")
				}
				got = append(got, collect(b)...)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("%d thermal facts %+v; want %d", len(got), got, len(tc.want))
			}
			for i, h := range got {
				hot := strings.Contains(h.Message, "at or above")
				wantHot := false
				for _, j := range tc.hot {
					wantHot = wantHot || j == i
				}
				if h.Kind != contracts.HealthThermal || h.Healthy != tc.want[i] || hot != wantHot || h.GPUIndex != 5 {
					t.Errorf("fact %d %+v; want thermal on GPU 5, healthy %v, hot %v", i, h, tc.want[i], wantHot)
				}
			}
		})
	}
}

// TestWatchHealthDeliversEventsAndSampleFacts runs the real event loop:
// facts from NVML events and from samples arrive, in order, once.
func TestWatchHealthDeliversEventsAndSampleFacts(t *testing.T) {
	m := newFakeMachine(t)
	b, _, _ := open(t, m)
	w := watch(t, b)
	m.set(2, func(g *fakeGPU) { g.dbe = 1 })
	m.event(1, nvml.EventTypeXidCriticalError, 48)
	m.event(2, nvml.EventTypeDoubleBitEccError, 0)
	m.event(1, nvml.EventTypeXidCriticalError, 48)
	w.waitFor(t, "ECC fact", func(h device.Health) bool { return h.Kind == contracts.HealthECCDBE })
	m.set(3, func(g *fakeGPU) { g.tempC = 99 })
	for range 3 {
		if _, err := b.Sample(context.Background(), time.Now(), nil); err != nil {
			t.Fatal(err)
		}
	}
	m.event(7, nvml.EventTypeXidCriticalError, 31) // sentinel
	got := w.waitFor(t, "sentinel", func(h device.Health) bool { return h.GPUIndex == 7 })
	want := []fact{
		{1, contracts.HealthXID, 48, false},
		{2, contracts.HealthECCDBE, 0, false},
		{3, contracts.HealthThermal, 0, true},
		{7, contracts.HealthXID, 31, true},
	}
	if diff := cmp.Diff(want, facts(got)); diff != "" {
		t.Errorf("facts (-want +got):\n%s", diff)
	}
	w.stop()
	if n := m.openEventSets(); n != 0 {
		t.Errorf("%d event sets left open after WatchHealth returned", n)
	}
}

// TestDoubleBitECCPolledWithoutEvents: GPUs that do not deliver events
// still report a double-bit error, from the count read by Sample.
func TestDoubleBitECCPolledWithoutEvents(t *testing.T) {
	m := newFakeMachine(t)
	for i := range m.gpus {
		m.set(i, func(g *fakeGPU) { g.fail["events"] = nvml.ERROR_NOT_SUPPORTED })
	}
	b, _, logs := open(t, m)
	w := watch(t, b)
	for _, n := range []uint64{0, 1, 2, 2} {
		m.set(4, func(g *fakeGPU) { g.dbe = n })
		if _, err := b.Sample(context.Background(), time.Now(), nil); err != nil {
			t.Fatal(err)
		}
	}
	m.set(5, func(g *fakeGPU) { g.tempC = 95 }) // sentinel
	if _, err := b.Sample(context.Background(), time.Now(), nil); err != nil {
		t.Fatal(err)
	}
	got := w.waitFor(t, "sentinel", func(h device.Health) bool { return h.GPUIndex == 5 })
	want := []fact{{4, contracts.HealthECCDBE, 0, false}, {5, contracts.HealthThermal, 0, true}}
	if diff := cmp.Diff(want, facts(got)); diff != "" {
		t.Errorf("facts (-want +got):\n%s", diff)
	}
	if !strings.Contains(logs.String(), "ECC comes from samples") {
		t.Errorf("no warning that events are unsupported:\n%s", logs)
	}
	w.stop()
	if n := m.openEventSets(); n != 0 {
		t.Errorf("%d event sets left open", n)
	}
}

func TestWatchHealthLifecycle(t *testing.T) {
	m := newFakeMachine(t)
	b, _, _ := open(t, m)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- b.WatchHealth(ctx, func(device.Health) {}) }()
	deadline := time.Now().Add(limit)
	for m.openEventSets() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("WatchHealth did not create its event set")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := b.WatchHealth(ctx, func(device.Health) {}); err == nil || !strings.Contains(err.Error(), "already running") {
		t.Errorf("second WatchHealth: %v; want already running", err)
	}
	// Close while watching frees the event set before Shutdown, and the
	// watcher stops with ErrClosed.
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if n := m.openEventSets(); n != 0 {
		t.Errorf("%d event sets open after Close", n)
	}
	select {
	case err := <-done:
		if !errors.Is(err, ErrClosed) {
			t.Errorf("WatchHealth after Close: %v; want ErrClosed", err)
		}
	case <-time.After(limit):
		t.Fatal("WatchHealth did not return after Close")
	}
}

func TestLostGPUFactSaysWhatFailed(t *testing.T) {
	m := newFakeMachine(t)
	b, _, _ := open(t, m)
	m.set(6, func(g *fakeGPU) { g.lost = true })
	if _, err := b.Sample(context.Background(), time.Now(), nil); err != nil {
		t.Fatal(err)
	}
	got := collect(b)
	want := []device.Health{{GPUIndex: 6, GPUUUID: m.gpus[6].UUID, Kind: contracts.HealthFellOffBus,
		Message: "NVML answers GPU_IS_LOST reading utilization"}}
	if diff := cmp.Diff(want, got, cmpopts.EquateEmpty()); diff != "" {
		t.Errorf("facts (-want +got):\n%s", diff)
	}
}
