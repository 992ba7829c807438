package nvmlgpu

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
)

// busy puts a GPU under load; busySample is what it then reads as.
func busy(g *fakeGPU) {
	g.util = nvml.Utilization{Gpu: 97, Memory: 61}
	g.usedMiB = 30000
	g.tempC, g.powerMW, g.limitMW, g.smMHz = 71, 388250, 400000, 1410
	g.sbe, g.clocksEvent, g.clocksThrottle = 3, contracts.ThrottleSWPowerCap, contracts.ThrottleHWThermal
	g.procs = []nvml.ProcessInfo{{Pid: 4242, UsedGpuMemory: 20000 * mib}, {Pid: 17, UsedGpuMemory: ^uint64(0)}}
}

func busySample(uuid string) contracts.GPUSample {
	return contracts.GPUSample{
		Index: 0, UUID: uuid, Model: "A100-40GB", GPUUtil: 97, MemCopyUtil: 61,
		FBUsedMiB: 30000, FBFreeMiB: 40960 - 30000, TempC: 71, PowerW: 388.25, SMClockMHz: 1410,
		PowerLimitW: 400, ECCSBE: 3, ThrottleReasons: contracts.ThrottleSWPowerCap,
		Processes: []contracts.GPUProcess{{PID: 17, UsedMiB: 0}, {PID: 4242, UsedMiB: 20000}},
		Healthy:   true,
	}
}

func TestSampleReadsEveryField(t *testing.T) {
	tests := []struct {
		name   string
		setup  func(m *fakeMachine)
		want   func(uuid string) contracts.GPUSample
		logged string // a warning the sample must log once
	}{
		{"all fields", func(*fakeMachine) {}, busySample, ""},
		{"old driver: throttle reasons", func(m *fakeMachine) { m.clocksEvent = false }, func(uuid string) contracts.GPUSample {
			s := busySample(uuid)
			s.ThrottleReasons = contracts.ThrottleHWThermal
			return s
		}, ""},
		{"fields not supported read as zero", func(m *fakeMachine) {
			m.set(0, func(g *fakeGPU) {
				for _, f := range []string{"utilization", "ecc", "clocks", "power_limit", "processes"} {
					g.fail[f] = nvml.ERROR_NOT_SUPPORTED
				}
			})
		}, func(uuid string) contracts.GPUSample {
			s := busySample(uuid)
			s.GPUUtil, s.MemCopyUtil, s.ECCSBE, s.ThrottleReasons, s.PowerLimitW, s.Processes = 0, 0, 0, 0, 0, nil
			return s
		}, ""},
		{"a failing field reads as zero and is logged", func(m *fakeMachine) {
			m.set(0, func(g *fakeGPU) { g.fail["power"] = nvml.ERROR_UNKNOWN })
		}, func(uuid string) contracts.GPUSample {
			s := busySample(uuid)
			s.PowerW = 0
			return s
		}, "field=power"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := newFakeMachine(t)
			m.set(0, busy)
			tc.setup(m)
			b, _, logs := open(t, m)
			for range 3 {
				got, err := b.Sample(context.Background(), time.Now(), nil)
				if err != nil {
					t.Fatalf("Sample: %v", err)
				}
				if len(got) != 8 {
					t.Fatalf("%d samples; want 8", len(got))
				}
				if diff := cmp.Diff(tc.want(m.gpus[0].UUID), got[0]); diff != "" {
					t.Fatalf("GPU 0 (-want +got):\n%s", diff)
				}
				if got[1].GPUUtil != 10 || got[1].FBUsedMiB != 1024 || !got[1].Healthy {
					t.Fatalf("GPU 1 %+v; want its idle readings", got[1])
				}
			}
			if tc.logged != "" {
				if n := strings.Count(logs.String(), tc.logged); n != 1 {
					t.Errorf("%q logged %d times in 3 samples; want once:\n%s", tc.logged, n, logs)
				}
			} else if strings.Contains(logs.String(), "not readable") {
				t.Errorf("unexpected warning:\n%s", logs)
			}
		})
	}
}

func TestLostGPUIsUnhealthyAndReportedOnce(t *testing.T) {
	m := newFakeMachine(t)
	b, _, _ := open(t, m)
	w := watch(t, b)
	if _, err := b.Sample(context.Background(), time.Now(), nil); err != nil {
		t.Fatal(err)
	}
	m.set(3, func(g *fakeGPU) { g.lost = true })
	for range 5 {
		got, err := b.Sample(context.Background(), time.Now(), nil)
		if err != nil {
			t.Fatalf("Sample with a lost GPU: %v", err)
		}
		want := contracts.GPUSample{Index: 3, UUID: m.gpus[3].UUID, Model: "A100-40GB", Healthy: false}
		if diff := cmp.Diff(want, got[3]); diff != "" {
			t.Fatalf("lost GPU (-want +got):\n%s", diff)
		}
		if !got[2].Healthy || !got[4].Healthy || got[4].FBUsedMiB != 1024 {
			t.Fatalf("the other GPUs changed: %+v %+v", got[2], got[4])
		}
	}
	inv, err := b.Discover(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if inv.GPUs[3].Healthy || !inv.GPUs[2].Healthy {
		t.Errorf("inventory health %v/%v; want GPU 3 unhealthy, GPU 2 healthy", inv.GPUs[3].Healthy, inv.GPUs[2].Healthy)
	}
	// A sentinel fact from another GPU, raised after everything above.
	m.event(7, nvml.EventTypeXidCriticalError, 13)
	facts := w.waitFor(t, "sentinel XID", func(h device.Health) bool { return h.GPUIndex == 7 })
	var lost []device.Health
	for _, f := range facts {
		if f.GPUIndex == 3 {
			lost = append(lost, f)
		}
	}
	if len(lost) != 1 || lost[0].Kind != contracts.HealthFellOffBus || lost[0].Healthy || lost[0].GPUUUID != m.gpus[3].UUID {
		t.Fatalf("facts of the lost GPU %+v; want one fell_off_bus, unhealthy", lost)
	}
}

func TestSampleAfterClose(t *testing.T) {
	m := newFakeMachine(t)
	b, _, _ := open(t, m)
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if n := len(m.ShutdownCalls()); n != 1 {
		t.Errorf("Shutdown called %d times; want once", n)
	}
	if _, err := b.Sample(context.Background(), time.Now(), nil); !errors.Is(err, ErrClosed) {
		t.Errorf("Sample after Close: %v; want ErrClosed", err)
	}
	if _, err := b.Discover(context.Background()); !errors.Is(err, ErrClosed) {
		t.Errorf("Discover after Close: %v; want ErrClosed", err)
	}
}

func TestSampleHonoursContext(t *testing.T) {
	m := newFakeMachine(t)
	b, _, _ := open(t, m)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := b.Sample(ctx, time.Now(), nil); !errors.Is(err, context.Canceled) {
		t.Errorf("Sample with an ended context: %v; want context.Canceled", err)
	}
}
