package nvmlgpu

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"

	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
)

// fakeMachine is go-nvml's 8×A100 40GB fake (dgxa100) with the calls the
// backend reads filled in from state a test changes: readings, faults,
// NVLink wiring, MIG devices and an event queue. It keeps state, so tests
// check what the backend makes of a GPU, not which calls it made.
type fakeMachine struct {
	*dgxa100.Server
	gpus   []*fakeGPU
	events chan nvml.EventData

	mu sync.Mutex
	// clocksEvent is whether the driver has the clocks-event-reasons call.
	clocksEvent bool
	eventSets   int // created and not freed
}

// fakeGPU is one GPU's state. Fields are read under fakeMachine.mu.
type fakeGPU struct {
	*dgxa100.Device
	m *fakeMachine

	util                        nvml.Utilization
	usedMiB                     uint64
	tempC, slowdownC            uint32
	powerMW, limitMW, smMHz     uint32
	sbe, dbe                    uint64
	clocksEvent, clocksThrottle uint64
	procs                       []nvml.ProcessInfo
	// fail makes a field's call return a code: "utilization", "memory",
	// "temperature", "power", "power_limit", "sm_clock", "ecc",
	// "clocks", "processes", "events", "gi".
	fail map[string]nvml.Return
	lost bool
	// links are the NVLink links: the remote bus ID, "" for a link down.
	links []string
	// topo is the common ancestor with each other GPU, by index.
	topo     map[int]nvml.GpuTopologyLevel
	migMode  int
	migs     []*mock.Device
	gis      map[int]*mock.GpuInstance
	cis      map[int]map[int]nvml.ComputeInstance // by GPU instance, then compute instance ID
	eventReg uint64
}

const (
	gpuBytes   = 40960 * mib // dgxa100's framebuffer
	a100Name   = "NVIDIA A100-SXM4-40GB"
	slowdownC  = 90
	switchBus0 = "00000000:c%d:00.0" // NVSwitch ports
)

func newFakeMachine(t *testing.T) *fakeMachine {
	t.Helper()
	m := &fakeMachine{Server: dgxa100.New(), events: make(chan nvml.EventData, 64), clocksEvent: true}
	m.LookupSymbolFunc = func(sym string) error {
		m.mu.Lock()
		defer m.mu.Unlock()
		if sym == "nvmlDeviceGetCurrentClocksEventReasons" && !m.clocksEvent {
			return fmt.Errorf("%s: undefined symbol", sym)
		}
		return nil
	}
	m.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) {
		m.mu.Lock()
		m.eventSets++
		m.mu.Unlock()
		var once sync.Once
		return &mock.EventSet{
			WaitFunc: func(ms uint32) (nvml.EventData, nvml.Return) {
				select {
				case e := <-m.events:
					return e, nvml.SUCCESS
				case <-time.After(time.Duration(ms) * time.Millisecond):
					return nvml.EventData{}, nvml.ERROR_TIMEOUT
				}
			},
			FreeFunc: func() nvml.Return {
				once.Do(func() { m.mu.Lock(); m.eventSets--; m.mu.Unlock() })
				return nvml.SUCCESS
			},
		}, nvml.SUCCESS
	}
	for i, d := range m.Devices {
		g := &fakeGPU{Device: d.(*dgxa100.Device), m: m,
			util: nvml.Utilization{Gpu: 10, Memory: 5}, usedMiB: 1024, tempC: 40, slowdownC: slowdownC,
			powerMW: 61500, limitMW: 400000, smMHz: 1410, clocksEvent: reasonIdle,
			fail: map[string]nvml.Return{}, topo: map[int]nvml.GpuTopologyLevel{}, gis: map[int]*mock.GpuInstance{},
			cis:      map[int]map[int]nvml.ComputeInstance{},
			eventReg: nvml.EventTypeXidCriticalError | nvml.EventTypeDoubleBitEccError | nvml.EventTypeSingleBitEccError,
		}
		g.Name = a100Name
		// DGX A100: 12 NVLinks per GPU to 6 NVSwitches; pairs of GPUs
		// share a PCIe switch, four GPUs a CPU socket.
		for l := range 12 {
			g.links = append(g.links, fmt.Sprintf(switchBus0, l/2))
		}
		for j := range 8 {
			switch {
			case j == i:
			case j/2 == i/2:
				g.topo[j] = nvml.TOPOLOGY_MULTIPLE
			case j/4 == i/4:
				g.topo[j] = nvml.TOPOLOGY_NODE
			default:
				g.topo[j] = nvml.TOPOLOGY_SYSTEM
			}
		}
		g.wire()
		m.gpus = append(m.gpus, g)
	}
	return m
}

const reasonIdle = 0x1 // nvmlClocksEventReasonGpuIdle

// set changes a GPU's state under the machine's lock.
func (m *fakeMachine) set(i int, f func(g *fakeGPU)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	f(m.gpus[i])
}

// call runs a field's call: the failure set for it, GPU_IS_LOST when the
// GPU is lost, else SUCCESS with what value returns.
func call[T any](g *fakeGPU, field string, value func() T) (T, nvml.Return) {
	g.m.mu.Lock()
	defer g.m.mu.Unlock()
	var zero T
	if g.lost {
		return zero, nvml.ERROR_GPU_IS_LOST
	}
	if ret, ok := g.fail[field]; ok {
		return zero, ret
	}
	return value(), nvml.SUCCESS
}

func (g *fakeGPU) wire() {
	g.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
		var p nvml.PciInfo
		copy(p.BusId[:], fmt.Sprintf("0000%s", g.PciBusID)) // 8-digit domain, as NVML gives it
		return p, nvml.SUCCESS
	}
	g.GetTemperatureThresholdFunc = func(th nvml.TemperatureThresholds) (uint32, nvml.Return) {
		return call(g, "threshold", func() uint32 {
			if th != nvml.TEMPERATURE_THRESHOLD_SLOWDOWN {
				return 0
			}
			return g.slowdownC
		})
	}
	g.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
		return call(g, "utilization", func() nvml.Utilization { return g.util })
	}
	g.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) {
		return call(g, "memory", func() nvml.Memory {
			return nvml.Memory{Total: gpuBytes, Used: g.usedMiB * mib, Free: gpuBytes - g.usedMiB*mib}
		})
	}
	g.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) {
		return call(g, "temperature", func() uint32 { return g.tempC })
	}
	g.GetPowerUsageFunc = func() (uint32, nvml.Return) {
		return call(g, "power", func() uint32 { return g.powerMW })
	}
	g.GetEnforcedPowerLimitFunc = func() (uint32, nvml.Return) {
		return call(g, "power_limit", func() uint32 { return g.limitMW })
	}
	g.GetClockInfoFunc = func(c nvml.ClockType) (uint32, nvml.Return) {
		return call(g, "sm_clock", func() uint32 { return g.smMHz })
	}
	g.GetTotalEccErrorsFunc = func(kind nvml.MemoryErrorType, _ nvml.EccCounterType) (uint64, nvml.Return) {
		return call(g, "ecc", func() uint64 {
			if kind == nvml.MEMORY_ERROR_TYPE_UNCORRECTED {
				return g.dbe
			}
			return g.sbe
		})
	}
	g.GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) {
		return call(g, "clocks", func() uint64 { return g.clocksEvent })
	}
	g.GetCurrentClocksThrottleReasonsFunc = func() (uint64, nvml.Return) {
		return call(g, "clocks", func() uint64 { return g.clocksThrottle })
	}
	g.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
		return call(g, "processes", func() []nvml.ProcessInfo { return g.procs })
	}
	g.GetNvLinkStateFunc = func(link int) (nvml.EnableState, nvml.Return) {
		g.m.mu.Lock()
		defer g.m.mu.Unlock()
		if link >= len(g.links) {
			return 0, nvml.ERROR_INVALID_ARGUMENT
		}
		if g.links[link] == "" {
			return nvml.FEATURE_DISABLED, nvml.SUCCESS
		}
		return nvml.FEATURE_ENABLED, nvml.SUCCESS
	}
	g.GetNvLinkRemotePciInfoFunc = func(link int) (nvml.PciInfo, nvml.Return) {
		g.m.mu.Lock()
		defer g.m.mu.Unlock()
		var p nvml.PciInfo
		if link >= len(g.links) || g.links[link] == "" {
			return p, nvml.ERROR_INVALID_ARGUMENT
		}
		copy(p.BusId[:], g.links[link])
		return p, nvml.SUCCESS
	}
	g.GetTopologyCommonAncestorFunc = func(other nvml.Device) (nvml.GpuTopologyLevel, nvml.Return) {
		return call(g, "topology", func() nvml.GpuTopologyLevel { return g.topo[other.(*dgxa100.Device).Index] })
	}
	g.GetMigModeFunc = func() (int, int, nvml.Return) {
		g.m.mu.Lock()
		defer g.m.mu.Unlock()
		return g.migMode, g.migMode, nvml.SUCCESS
	}
	g.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) { return 7, nvml.SUCCESS }
	g.GetMigDeviceHandleByIndexFunc = func(i int) (nvml.Device, nvml.Return) {
		g.m.mu.Lock()
		defer g.m.mu.Unlock()
		if i >= len(g.migs) {
			return nil, nvml.ERROR_NOT_FOUND
		}
		return g.migs[i], nvml.SUCCESS
	}
	g.GetGpuInstanceByIdFunc = func(id int) (nvml.GpuInstance, nvml.Return) {
		gi, ret := call(g, "gi", func() *mock.GpuInstance { return g.gis[id] })
		if ret != nvml.SUCCESS {
			return nil, ret
		}
		if gi == nil {
			return nil, nvml.ERROR_NOT_FOUND
		}
		return gi, nvml.SUCCESS
	}
	g.GetGpuInstanceProfileInfoFunc = func(idx int) (nvml.GpuInstanceProfileInfo, nvml.Return) {
		p, ok := a100Profiles[idx]
		if !ok {
			return nvml.GpuInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
		}
		return p, nvml.SUCCESS
	}
	g.GetSupportedEventTypesFunc = func() (uint64, nvml.Return) {
		return call(g, "events", func() uint64 { return g.eventReg })
	}
	g.RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return {
		_, ret := call(g, "events", func() uint64 { return 0 })
		return ret
	}
}

// a100Profiles are the A100 40GB GPU instance profiles by index, with
// their real IDs (which differ from the indexes) and sizes.
var a100Profiles = map[int]nvml.GpuInstanceProfileInfo{
	nvml.GPU_INSTANCE_PROFILE_1_SLICE: {Id: 19, SliceCount: 1, MemorySizeMB: 4864},
	nvml.GPU_INSTANCE_PROFILE_2_SLICE: {Id: 14, SliceCount: 2, MemorySizeMB: 9856},
	nvml.GPU_INSTANCE_PROFILE_3_SLICE: {Id: 9, SliceCount: 3, MemorySizeMB: 19968},
	nvml.GPU_INSTANCE_PROFILE_4_SLICE: {Id: 5, SliceCount: 4, MemorySizeMB: 19968},
	nvml.GPU_INSTANCE_PROFILE_7_SLICE: {Id: 0, SliceCount: 7, MemorySizeMB: 40192},
}

// ciSlices are the compute instance profiles' slice counts by index.
var ciSlices = map[int]uint32{
	nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE: 1, nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE: 2,
	nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE: 3, nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE: 4,
	nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE: 7,
}

// migSpec is one MIG device to create on a fake GPU.
type migSpec struct {
	uuid         string
	gi, ci       int
	giProfileIdx int // index into a100Profiles
	ciProfileIdx int // COMPUTE_INSTANCE_PROFILE_*
	start, size  uint32
}

// addMIG enables MIG on GPU i with the given MIG devices, as an
// administrator would have made them.
func (m *fakeMachine) addMIG(i int, specs ...migSpec) {
	m.set(i, func(g *fakeGPU) {
		g.migMode = nvml.DEVICE_MIG_ENABLE
		for _, s := range specs {
			p := a100Profiles[s.giProfileIdx]
			gi, ok := g.gis[s.gi]
			if !ok {
				info := nvml.GpuInstanceInfo{Device: g, Id: uint32(s.gi), ProfileId: p.Id,
					Placement: nvml.GpuInstancePlacement{Start: s.start, Size: s.size}}
				gi = &mock.GpuInstance{
					GetInfoFunc: func() (nvml.GpuInstanceInfo, nvml.Return) { return info, nvml.SUCCESS },
					GetComputeInstanceProfileInfoFunc: func(idx, eng int) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
						n, ok := ciSlices[idx]
						if !ok || eng != nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
							return nvml.ComputeInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
						}
						return nvml.ComputeInstanceProfileInfo{Id: uint32(idx), SliceCount: n}, nvml.SUCCESS
					},
				}
				cis := map[int]nvml.ComputeInstance{}
				gi.GetComputeInstanceByIdFunc = func(id int) (nvml.ComputeInstance, nvml.Return) {
					ci, ok := cis[id]
					if !ok {
						return nil, nvml.ERROR_NOT_FOUND
					}
					return ci, nvml.SUCCESS
				}
				g.gis[s.gi], g.cis[s.gi] = gi, cis
			}
			ciInfo := nvml.ComputeInstanceInfo{Device: g, GpuInstance: gi, Id: uint32(s.ci), ProfileId: uint32(s.ciProfileIdx)}
			g.cis[s.gi][s.ci] = &mock.ComputeInstance{
				GetInfoFunc: func() (nvml.ComputeInstanceInfo, nvml.Return) { return ciInfo, nvml.SUCCESS },
			}
			memMB := p.MemorySizeMB
			g.migs = append(g.migs, &mock.Device{
				GetUUIDFunc:              func() (string, nvml.Return) { return s.uuid, nvml.SUCCESS },
				GetGpuInstanceIdFunc:     func() (int, nvml.Return) { return s.gi, nvml.SUCCESS },
				GetComputeInstanceIdFunc: func() (int, nvml.Return) { return s.ci, nvml.SUCCESS },
				GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) {
					return nvml.Memory{Total: memMB * mib, Free: memMB * mib}, nvml.SUCCESS
				},
				GetAttributesFunc: func() (nvml.DeviceAttributes, nvml.Return) {
					return nvml.DeviceAttributes{GpuInstanceSliceCount: p.SliceCount,
						ComputeInstanceSliceCount: ciSlices[s.ciProfileIdx], MemorySizeMB: memMB}, nvml.SUCCESS
				},
			})
		}
	})
}

// event queues an NVML event of GPU i.
func (m *fakeMachine) event(i int, typ uint64, data uint64) {
	m.events <- nvml.EventData{Device: m.gpus[i], EventType: typ, EventData: data}
}

// logBuffer is a slog logger writing to a buffer a test can read.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// clock is a settable clock.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// open opens a backend on m with a fast event wait, a settable clock and a
// log a test can read.
func open(t *testing.T, m *fakeMachine) (*Backend, *clock, *logBuffer) {
	t.Helper()
	c := &clock{t: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)}
	logs := &logBuffer{}
	b, err := Open(Config{NodeID: "node-1", Lib: m, Now: c.Now, EventWait: 10 * time.Millisecond,
		Log: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b, c, logs
}

// watcher runs WatchHealth and collects its facts.
type watcher struct {
	mu    sync.Mutex
	facts []device.Health
	done  chan error
	stop  func()
}

func watch(t *testing.T, b *Backend) *watcher {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w := &watcher{done: make(chan error, 1)}
	go func() {
		w.done <- b.WatchHealth(ctx, func(h device.Health) {
			w.mu.Lock()
			w.facts = append(w.facts, h)
			w.mu.Unlock()
		})
	}()
	var once sync.Once
	w.stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-w.done:
				if err != nil {
					t.Errorf("WatchHealth: %v", err)
				}
			case <-time.After(limit):
				t.Errorf("WatchHealth did not return after its context ended")
			}
		})
	}
	t.Cleanup(w.stop)
	return w
}

const limit = 10 * time.Second // bound of every wait

// waitFor waits until the watcher has a fact matching ok, and returns
// every fact so far.
func (w *watcher) waitFor(t *testing.T, what string, ok func(device.Health) bool) []device.Health {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		w.mu.Lock()
		facts := append([]device.Health(nil), w.facts...)
		w.mu.Unlock()
		for _, f := range facts {
			if ok(f) {
				return facts
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s; facts so far: %+v", what, facts)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// openEventSets counts event sets created and not freed.
func (m *fakeMachine) openEventSets() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.eventSets
}
