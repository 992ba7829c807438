package sim

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
)

// watcher collects the facts a backend reports through WatchHealth.
type watcher struct {
	mu    sync.Mutex
	facts []device.Health
}

func watch(t *testing.T, b *Backend) *watcher {
	t.Helper()
	w := &watcher{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- b.WatchHealth(ctx, func(h device.Health) {
			w.mu.Lock()
			w.facts = append(w.facts, h)
			w.mu.Unlock()
		})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("WatchHealth: %v", err)
		}
	})
	return w
}

// wait returns the first n facts, failing after a bound.
func (w *watcher) wait(t *testing.T, n int) []device.Health {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		w.mu.Lock()
		got := append([]device.Health(nil), w.facts...)
		w.mu.Unlock()
		if len(got) >= n {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d health facts, want %d: %+v", len(got), n, got)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// machine is an 8×H100 with every GPU busy, sampled from t0 on.
type machine struct {
	b    *Backend
	busy map[string]string
	now  time.Time
}

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func newMachine(t *testing.T) *machine {
	t.Helper()
	b, err := New(Config{NodeID: "h100-07", Model: model(t, "H100-80GB"), Count: 8, NVLink: true})
	if err != nil {
		t.Fatal(err)
	}
	busy := map[string]string{}
	for i := range 8 {
		busy[UUID("h100-07", i)] = "acme/train/1"
	}
	return &machine{b: b, busy: busy, now: t0}
}

// run samples every second for d and returns the last samples.
func (m *machine) run(t *testing.T, d time.Duration) []contracts.GPUSample {
	t.Helper()
	var out []contracts.GPUSample
	for end := m.now.Add(d); !m.now.After(end); m.now = m.now.Add(time.Second) {
		var err error
		if out, err = m.b.Sample(context.Background(), m.now, m.busy); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

func TestXIDFaults(t *testing.T) {
	for name, c := range map[string]struct {
		fault   contracts.Fault
		gpu     int
		kind    contracts.HealthKind
		code    int
		healthy bool
	}{
		"79 by default, by index": {contracts.Fault{ID: "a", Kind: contracts.FaultXID, GPU: "3"}, 3, contracts.HealthFellOffBus, 79, false},
		"48 by UUID":              {contracts.Fault{ID: "b", Kind: contracts.FaultXID, GPU: UUID("h100-07", 5), Code: 48}, 5, contracts.HealthXID, 48, false},
		"94 contained ECC":        {contracts.Fault{ID: "c", Kind: contracts.FaultXID, GPU: "1", Code: 94}, 1, contracts.HealthXID, 94, false},
		"95 uncontained ECC":      {contracts.Fault{ID: "d", Kind: contracts.FaultXID, GPU: "1", Code: 95}, 1, contracts.HealthXID, 95, false},
		"13, the application's":   {contracts.Fault{ID: "e", Kind: contracts.FaultXID, GPU: "2", Code: 13}, 2, contracts.HealthXID, 13, true},
		"31 page fault, healthy":  {contracts.Fault{ID: "f", Kind: contracts.FaultXID, GPU: "2", Code: 31}, 2, contracts.HealthXID, 31, true},
		"43 stopped, healthy":     {contracts.Fault{ID: "g", Kind: contracts.FaultXID, GPU: "2", Code: 43}, 2, contracts.HealthXID, 43, true},
		"45 preempted, healthy":   {contracts.Fault{ID: "h", Kind: contracts.FaultXID, GPU: "2", Code: 45}, 2, contracts.HealthXID, 45, true},
		"empty GPU is the first":  {contracts.Fault{ID: "i", Kind: contracts.FaultXID, Code: 79}, 0, contracts.HealthFellOffBus, 79, false},
	} {
		m := newMachine(t)
		w := watch(t, m.b)
		m.run(t, 10*time.Second)
		if err := m.b.InjectFault(c.fault); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		h := w.wait(t, 1)[0]
		if h.GPUIndex != c.gpu || h.GPUUUID != UUID("h100-07", c.gpu) || h.Kind != c.kind || h.Code != c.code ||
			h.Healthy != c.healthy || !strings.Contains(h.Message, "XID") {
			t.Errorf("%s: fact %+v; want GPU %d %s code %d healthy %v", name, h, c.gpu, c.kind, c.code, c.healthy)
		}
		s := m.run(t, 2*time.Second)[c.gpu]
		if s.Healthy != c.healthy || s.LastXID != c.code {
			t.Errorf("%s: sample healthy %v, last XID %d", name, s.Healthy, s.LastXID)
		}
		switch {
		case c.code == 79 && (s.GPUUtil != 0 || s.PowerW != 0 || s.FBUsedMiB != 0 || len(s.Processes) != 0):
			t.Errorf("%s: a GPU off the bus reports %+v", name, s)
		case c.code != 79 && s.GPUUtil < 85:
			t.Errorf("%s: the GPU stopped working: util %v", name, s.GPUUtil)
		}
		disc, _ := m.b.Discover(context.Background())
		if disc.GPUs[c.gpu].Healthy != c.healthy {
			t.Errorf("%s: Discover says healthy %v", name, disc.GPUs[c.gpu].Healthy)
		}

		// A reset (clear of that GPU) makes it whole again.
		if err := m.b.InjectFault(contracts.Fault{ID: "clear", Kind: contracts.FaultClear, GPU: h.GPUUUID}); err != nil {
			t.Fatal(err)
		}
		if !c.healthy {
			r := w.wait(t, 2)[1]
			if r.Kind != contracts.HealthRecovered || !r.Healthy || r.GPUIndex != c.gpu {
				t.Errorf("%s: after clear %+v, want recovered", name, r)
			}
		}
		if s := m.run(t, time.Second)[c.gpu]; !s.Healthy || s.LastXID != 0 || s.GPUUtil < 85 {
			t.Errorf("%s: after clear %+v", name, s)
		}
	}
}

func TestECCDoubleBitFault(t *testing.T) {
	m := newMachine(t)
	w := watch(t, m.b)
	m.run(t, time.Second)
	for range 2 {
		if err := m.b.InjectFault(contracts.Fault{ID: "x", Kind: contracts.FaultECCDBE, GPU: "6"}); err != nil {
			t.Fatal(err)
		}
	}
	facts := w.wait(t, 2)
	for i, h := range facts {
		if h.Kind != contracts.HealthECCDBE || h.Healthy || h.GPUIndex != 6 || h.Code != 48 {
			t.Errorf("fact %d: %+v", i, h)
		}
	}
	s := m.run(t, time.Second)
	if g := s[6]; g.ECCDBE != 2 || g.Healthy || g.LastXID != 48 {
		t.Errorf("GPU 6 after two double-bit errors: DBE %d, healthy %v, XID %d", g.ECCDBE, g.Healthy, g.LastXID)
	}
	if g := s[5]; g.ECCDBE != 0 || !g.Healthy {
		t.Errorf("GPU 5 caught the fault: %+v", g)
	}
	// Clearing the whole machine resets the counts and reports the GPU.
	if err := m.b.InjectFault(contracts.Fault{ID: "y", Kind: contracts.FaultClear}); err != nil {
		t.Fatal(err)
	}
	if r := w.wait(t, 3)[2]; r.Kind != contracts.HealthRecovered || r.GPUIndex != 6 {
		t.Errorf("after clear: %+v", r)
	}
	if g := m.run(t, time.Second)[6]; g.ECCDBE != 0 || !g.Healthy {
		t.Errorf("after clear: %+v", g)
	}
	if got := len(w.wait(t, 3)); got != 3 {
		t.Errorf("%d facts; clearing healthy GPUs must report nothing", got)
	}
}

func TestOverheatThrottlesAndRecovers(t *testing.T) {
	for name, c := range map[string]struct {
		duration time.Duration // 0: cleared after a minute
	}{
		"for 45 s":      {45 * time.Second},
		"until cleared": {0},
	} {
		m := newMachine(t)
		mod := m.b.model
		w := watch(t, m.b)
		before := m.run(t, 5*time.Minute)[4]
		if err := m.b.InjectFault(contracts.Fault{ID: "hot", Kind: contracts.FaultOverheat, GPU: "4",
			Duration: contracts.Duration(c.duration)}); err != nil {
			t.Fatal(err)
		}
		h := w.wait(t, 1)[0]
		if h.Kind != contracts.HealthThermal || !h.Healthy || h.GPUIndex != 4 || float64(h.Code) < mod.SlowdownTempC {
			t.Fatalf("%s: fact %+v; want thermal, healthy, at or above %v °C", name, h, mod.SlowdownTempC)
		}
		for s := range 40 {
			g := m.run(t, 0)[4]
			if g.TempC < mod.SlowdownTempC-1 || g.TempC >= mod.ShutdownTempC {
				t.Fatalf("%s: %ds into the overheat at %v °C; want between slowdown %v and shutdown %v", name, s, g.TempC, mod.SlowdownTempC, mod.ShutdownTempC)
			}
			if g.ThrottleReasons&contracts.ThrottleHWThermal == 0 || g.ThrottleReasons&contracts.ThrottleHWSlowdown == 0 ||
				g.SMClockMHz > 0.55*mod.MaxSMClockMHz || g.PowerW >= before.PowerW || !g.Healthy || g.GPUUtil < 85 {
				t.Fatalf("%s: %ds into the overheat: throttle %v, %v MHz, %v W (before %v W), healthy %v",
					name, s, contracts.ThrottleReasonNames(g.ThrottleReasons), g.SMClockMHz, g.PowerW, before.PowerW, g.Healthy)
			}
		}
		if c.duration == 0 {
			m.run(t, 20*time.Second)
			if len(w.wait(t, 1)) != 1 {
				t.Fatalf("%s: the overheat ended on its own", name)
			}
			if err := m.b.InjectFault(contracts.Fault{ID: "cool", Kind: contracts.FaultClear, GPU: "4"}); err != nil {
				t.Fatal(err)
			}
		}
		end := m.run(t, 30*time.Second)[4]
		back := w.wait(t, 2)[1]
		if back.Kind != contracts.HealthThermal || !back.Healthy || back.GPUIndex != 4 || float64(back.Code) >= mod.SlowdownTempC {
			t.Errorf("%s: end fact %+v; want thermal, back below %v °C", name, back, mod.SlowdownTempC)
		}
		if end.ThrottleReasons&(contracts.ThrottleHWThermal|contracts.ThrottleHWSlowdown) != 0 || end.SMClockMHz < 0.95*mod.MaxSMClockMHz ||
			end.TempC >= mod.SlowdownTempC {
			t.Errorf("%s: after the overheat: %v °C, throttle %v, %v MHz", name, end.TempC, contracts.ThrottleReasonNames(end.ThrottleReasons), end.SMClockMHz)
		}
		if got := w.wait(t, 2); len(got) != 2 {
			t.Errorf("%s: %d facts, want the overheat and its end: %+v", name, len(got), got)
		}
	}
}

func TestInjectFaultRefusesWhatItCannotApply(t *testing.T) {
	b, err := New(Config{NodeID: "l4-01", Model: model(t, "L4"), Count: 4})
	if err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]struct {
		f    contracts.Fault
		want string
	}{
		"index past the machine": {contracts.Fault{ID: "1", Kind: contracts.FaultXID, GPU: "4"}, "no GPU 4 on node l4-01; it has GPUs 0 to 3"},
		"negative index":         {contracts.Fault{ID: "2", Kind: contracts.FaultECCDBE, GPU: "-1"}, "no GPU -1"},
		"another node's UUID":    {contracts.Fault{ID: "3", Kind: contracts.FaultOverheat, GPU: UUID("l4-02", 0)}, "want an index 0 to 3 or one of its GPU UUIDs"},
		"machine death":          {contracts.Fault{ID: "4", Kind: contracts.FaultMachineDeath}, "the agent's"},
		"agent pause":            {contracts.Fault{ID: "5", Kind: contracts.FaultAgentPause}, "the agent's"},
		"invalid fault":          {contracts.Fault{Kind: contracts.FaultXID}, "fault ID is empty"},
	} {
		if err := b.InjectFault(c.f); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v; want an error saying %q", name, err, c.want)
		}
	}
	m, _ := b.Discover(context.Background())
	for _, g := range m.GPUs {
		if !g.Healthy {
			t.Errorf("a refused fault made GPU %d unhealthy", g.Index)
		}
	}
}

// TestMIGWorkScalesWithBusySlices: a MIG GPU works in proportion to the
// compute slices of its busy instances, one process per instance, and a
// GPU drawing more power settles hotter.
func TestMIGWorkScalesWithBusySlices(t *testing.T) {
	mod := model(t, "A100-80GB")
	b, err := New(Config{NodeID: "mig-01", Model: mod, Count: 3, NVLink: true,
		MIG: MIG{Enabled: true, Layout: []string{"3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"}}})
	if err != nil {
		t.Fatal(err)
	}
	m, _ := b.Discover(context.Background())
	inst := func(gpu, k int) string { return m.GPUs[gpu].MIGInstances[k].UUID }
	busy := map[string]string{
		inst(0, 0): "t/a/1", inst(0, 1): "t/b/1", inst(0, 2): "t/c/1", inst(0, 3): "t/d/1", // all 7 slices
		inst(1, 2): "t/e/1", // one slice of seven
	}
	var s []contracts.GPUSample
	for sec := range 900 {
		if s, err = b.Sample(context.Background(), t0.Add(time.Duration(sec)*time.Second), busy); err != nil {
			t.Fatal(err)
		}
	}
	full, one, idle := s[0], s[1], s[2]
	if full.GPUUtil < 85 || one.GPUUtil < 85.0/7-1 || one.GPUUtil > 98.0/7+1 || idle.GPUUtil != 0 {
		t.Errorf("utilisation: all slices %v %%, one slice %v %%, idle %v %%", full.GPUUtil, one.GPUUtil, idle.GPUUtil)
	}
	if len(full.Processes) != 4 || len(one.Processes) != 1 || len(idle.Processes) != 0 {
		t.Errorf("processes: %d, %d, %d; want one per busy instance", len(full.Processes), len(one.Processes), len(idle.Processes))
	}
	var used int64
	for _, p := range full.Processes {
		used += p.UsedMiB
	}
	if used > full.FBUsedMiB || one.Processes[0].UsedMiB > 9728 || one.FBUsedMiB > 9728 {
		t.Errorf("memory: processes %d MiB of %d used; one-slice GPU %d MiB", used, full.FBUsedMiB, one.FBUsedMiB)
	}
	if !(idle.PowerW < one.PowerW && one.PowerW < full.PowerW && full.PowerW <= mod.TDPWatts) {
		t.Errorf("power: idle %v W, one slice %v W, all %v W", idle.PowerW, one.PowerW, full.PowerW)
	}
	if !(idle.TempC < one.TempC && one.TempC < full.TempC) {
		t.Errorf("temperature: idle %v °C, one slice %v °C, all %v °C", idle.TempC, one.TempC, full.TempC)
	}
	if full.AllocationID != "" {
		t.Errorf("a GPU shared by MIG allocations reports allocation %q", full.AllocationID)
	}
}

// BenchmarkSample samples an 8×H100 machine with half its GPUs busy, as
// the fleet simulator does for each machine every second.
func BenchmarkSample(b *testing.B) {
	m, _ := New(Config{NodeID: "h100-01", Model: model(b, "H100-80GB"), Count: 8, NVLink: true})
	busy := map[string]string{}
	for i := range 4 {
		busy[UUID("h100-01", i)] = "acme/train/1"
	}
	now := t0
	b.ReportAllocs()
	gpus := 0
	for b.Loop() {
		now = now.Add(time.Second)
		s, err := m.Sample(context.Background(), now, busy)
		if err != nil || s[0].GPUUtil == 0 {
			b.Fatalf("sample: %v, %+v", err, s[0])
		}
		gpus += len(s)
	}
	b.ReportMetric(float64(gpus)/b.Elapsed().Seconds(), "gpu-samples/s")
}
