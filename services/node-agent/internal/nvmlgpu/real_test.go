package nvmlgpu

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
)

// loadScript holds 4 GiB of framebuffer and runs 8192² fp32 matmuls for
// 15 s on the one GPU CUDA_VISIBLE_DEVICES shows it.
const loadScript = `
import os, time, torch
assert torch.cuda.is_available(), "CUDA is not available"
d = torch.device("cuda")
hold = torch.ones(4 * 2**30, dtype=torch.uint8, device=d)
a = torch.randn(8192, 8192, device=d)
b = torch.randn(8192, 8192, device=d)
torch.cuda.synchronize()
print("load started on", torch.cuda.get_device_name(0), "pid", os.getpid(), flush=True)
end, n = time.time() + 15, 0
while time.time() < end:
    c = a @ b
    n += 1
    if n % 16 == 0:
        torch.cuda.synchronize()
torch.cuda.synchronize()
print("load done:", n, "matmuls", flush=True)
`

// TestMain lets the test binary be a run's shim, as the agent's binary
// is: TestRealGPU launches a command through the runner.
func TestMain(m *testing.M) {
	runner.MaybeRunShim()
	os.Exit(m.Run())
}

// TestRealGPU runs on real hardware only: it discovers the GPUs, samples
// one while a torch job loads it and checks that utilisation and
// framebuffer rise and fall back, and launches a run through the agent's
// runner that must see exactly its GPU. Build it with
// `go test -c -o nvmlgpu.test ./internal/nvmlgpu/` and run it on the GPU
// machine with `GPUPLANE_NVML_REAL=1 ./nvmlgpu.test -test.run Real -test.v`
// (python3 with torch must be there).
func TestRealGPU(t *testing.T) {
	if os.Getenv("GPUPLANE_NVML_REAL") != "1" {
		t.Skip("set GPUPLANE_NVML_REAL=1 on a machine with an NVIDIA GPU")
	}
	if _, err := exec.LookPath("python3"); err != nil {
		t.Fatalf("python3 with torch is needed for the load: %v", err)
	}
	b, err := Open(Config{NodeID: "real", Log: slog.New(slog.NewTextHandler(t.Output(), nil))})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer b.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	m, err := b.Discover(ctx)
	if err != nil {
		t.Fatalf("Discover: %v", err)
	}
	logMachine(t, m)
	if m.DriverVersion == "" || len(m.GPUs) == 0 {
		t.Fatalf("driver %q, %d GPUs; want a driver version and at least one GPU", m.DriverVersion, len(m.GPUs))
	}
	target := -1
	for i, g := range m.GPUs {
		if !strings.HasPrefix(g.UUID, "GPU-") || g.MemoryMiB <= 0 || g.ComputeCapability == "" {
			t.Errorf("GPU %d: %+v; want a GPU- UUID, memory and compute capability", g.Index, g)
		}
		if target < 0 && g.Healthy && !g.MIGEnabled {
			target = i
		}
	}
	if target < 0 {
		t.Fatal("no healthy GPU without MIG to put the load on")
	}
	gpu, info := b.gpus[target], m.GPUs[target]
	t.Logf("load goes on GPU %d %s (%s)", info.Index, info.UUID, gpu.name)

	// Health is watched for the whole test: registering the events must
	// work on real hardware, and a healthy GPU under load raises nothing
	// but, maybe, a thermal fact.
	var hmu sync.Mutex
	var health []device.Health
	wctx, wcancel := context.WithCancel(ctx)
	wdone := make(chan error, 1)
	go func() {
		wdone <- b.WatchHealth(wctx, func(h device.Health) {
			hmu.Lock()
			health = append(health, h)
			hmu.Unlock()
		})
	}()

	rows := loadAndSample(ctx, t, b, target, info.UUID)
	t.Log("samples of GPU " + info.UUID + " (" + gpu.name + "), one a second:\n" + table(rows))
	checkLoad(t, rows)

	wcancel()
	if err := <-wdone; err != nil {
		t.Errorf("WatchHealth: %v", err)
	}
	hmu.Lock()
	for _, h := range health {
		t.Logf("health fact: %+v", h)
		if !h.Healthy {
			t.Errorf("a healthy GPU under load was reported unhealthy: %+v", h)
		}
	}
	hmu.Unlock()

	runSeesOnlyItsDevice(ctx, t, contracts.DeviceRef{Index: info.Index, UUID: info.UUID, Model: info.Model}, gpu.name)
}

func logMachine(t *testing.T, m device.Machine) {
	t.Logf("driver %s, CUDA %s, %d GPUs", m.DriverVersion, m.CUDAVersion, len(m.GPUs))
	for _, g := range m.GPUs {
		t.Logf("GPU %d %s model=%s memory=%d MiB pci=%s cc=%s nvlink_domain=%q healthy=%v mig=%v",
			g.Index, g.UUID, g.Model, g.MemoryMiB, g.PCIBusID, g.ComputeCapability, g.NVLinkDomain, g.Healthy, g.MIGEnabled)
		for _, mi := range g.MIGInstances {
			t.Logf("  MIG %s %s gi=%d ci=%d placement=%d:%d memory=%d MiB", mi.UUID, mi.Profile, mi.GIID, mi.CIID, mi.Start, mi.Size, mi.MemoryMiB)
		}
	}
	for _, l := range m.Topology {
		t.Logf("GPU %d - GPU %d: %s, %d NVLinks", l.A, l.B, l.Path, l.NVLinks)
	}
}

// row is one sample and what the load was doing then.
type row struct {
	at    time.Duration
	phase string // idle, load, after
	s     contracts.GPUSample
}

// loadAndSample samples GPU target every second: 3 s idle, while the
// load runs, and 6 s after it ended.
func loadAndSample(ctx context.Context, t *testing.T, b *Backend, target int, uuid string) []row {
	t.Helper()
	start := time.Now()
	var rows []row
	sample := func(phase string) {
		s, err := b.Sample(ctx, time.Now(), nil)
		if err != nil {
			t.Fatalf("Sample: %v", err)
		}
		rows = append(rows, row{time.Since(start).Round(100 * time.Millisecond), phase, s[target]})
	}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for range 3 {
		sample("idle")
		<-tick.C
	}
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, "python3", "-c", loadScript)
	cmd.Env = append(os.Environ(), "CUDA_VISIBLE_DEVICES="+uuid)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start the load: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var loadErr error
	for running := true; running; {
		select {
		case loadErr = <-done:
			running = false
		case <-tick.C:
			sample("load")
		case <-ctx.Done():
			t.Fatalf("load still running at the test's deadline; output:\n%s", out.String())
		}
	}
	t.Logf("load (pid %d) output:\n%s", cmd.Process.Pid, out.String())
	if loadErr != nil {
		t.Fatalf("load failed: %v", loadErr)
	}
	for range 6 {
		<-tick.C
		sample("after")
	}
	return rows
}

// checkLoad asserts that utilisation and framebuffer rose under the load
// and fell back after it.
func checkLoad(t *testing.T, rows []row) {
	t.Helper()
	var idleFB, peakFB int64
	var peakUtil float64
	for _, r := range rows {
		switch r.phase {
		case "idle":
			idleFB = max(idleFB, r.s.FBUsedMiB)
		case "load":
			peakFB = max(peakFB, r.s.FBUsedMiB)
			peakUtil = max(peakUtil, r.s.GPUUtil)
		}
	}
	last := rows[len(rows)-1].s
	t.Logf("framebuffer used: idle %d MiB, peak %d MiB, after %d MiB; utilisation: peak %.0f%%, after %.0f%%",
		idleFB, peakFB, last.FBUsedMiB, peakUtil, last.GPUUtil)
	if peakUtil < 50 {
		t.Errorf("peak utilisation %.0f%% under a matmul loop; want >= 50%%", peakUtil)
	}
	if peakFB-idleFB < 4096 {
		t.Errorf("framebuffer rose by %d MiB under a load holding 4 GiB; want >= 4096", peakFB-idleFB)
	}
	if peakFB-last.FBUsedMiB < 4096 {
		t.Errorf("framebuffer fell by %d MiB after the load ended; want >= 4096", peakFB-last.FBUsedMiB)
	}
	if last.GPUUtil > peakUtil/2 {
		t.Errorf("utilisation %.0f%% after the load; want it back under half the peak %.0f%%", last.GPUUtil, peakUtil)
	}
	for _, r := range rows {
		if !r.s.Healthy {
			t.Errorf("at %s the GPU read unhealthy: %+v", r.at, r.s)
		}
	}
}

func table(rows []row) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "%6s %-5s %4s %4s %8s %8s %5s %7s %6s %6s %4s %4s %-28s %s\n",
		"t", "phase", "gpu%", "mem%", "fb_used", "fb_free", "temp", "power", "limit", "sm_mhz", "sbe", "dbe", "throttle", "processes")
	for _, r := range rows {
		s := r.s
		var procs []string
		for _, p := range s.Processes {
			procs = append(procs, fmt.Sprintf("%d:%dMiB", p.PID, p.UsedMiB))
		}
		throttle := strings.Join(contracts.ThrottleReasonNames(s.ThrottleReasons), ",")
		fmt.Fprintf(&sb, "%6s %-5s %4.0f %4.0f %8d %8d %5.0f %7.1f %6.0f %6.0f %4d %4d %-28s %s\n",
			r.at, r.phase, s.GPUUtil, s.MemCopyUtil, s.FBUsedMiB, s.FBFreeMiB, s.TempC, s.PowerW, s.PowerLimitW,
			s.SMClockMHz, s.ECCSBE, s.ECCDBE, throttle, strings.Join(procs, " "))
	}
	return sb.String()
}

// runSeesOnlyItsDevice launches a command through the agent's runner on
// one GPU and checks that CUDA sees that GPU and no other.
func runSeesOnlyItsDevice(ctx context.Context, t *testing.T, dev contracts.DeviceRef, name string) {
	t.Helper()
	// The runner gives a run a minimal environment; the test machine's
	// library paths are passed as the run's own variables so python3 and
	// torch find CUDA there. Devices come from the runner alone.
	env := map[string]string{}
	for _, k := range []string{"LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CUDA_HOME"} {
		if v, ok := os.LookupEnv(k); ok {
			env[k] = v
		}
	}
	dir := t.TempDir()
	r := &runner.Local{LogDir: dir}
	const id = "real/nvml/1"
	p, err := r.Launch(ctx, runner.Launch{
		AllocationID: id, Tenant: "real", JobID: "nvml", Attempt: 1,
		Devices: []contracts.DeviceRef{dev},
		Spec: contracts.RunSpec{
			Command: []string{"sh", "-c", `echo "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"; ` +
				`python3 -c 'import torch;print(torch.cuda.device_count(), torch.cuda.get_device_name(0))'`},
			Env:      env,
			Duration: contracts.Duration(2 * time.Minute),
		},
		StopGrace: time.Second,
	})
	if err != nil {
		t.Fatalf("launch: %v", err)
	}
	var exit runner.Exit
	select {
	case <-p.Done():
		exit = p.Wait()
	case <-ctx.Done():
		p.Stop(0)
		t.Fatal("the run did not end before the test's deadline")
	}
	log, err := os.ReadFile(runner.LogPath(dir, id))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("run %s on %s exited %d; its log:\n%s", id, dev.UUID, exit.Code, log)
	if exit.Code != 0 || exit.Err != nil {
		t.Fatalf("run exited %d (%v)", exit.Code, exit.Err)
	}
	for _, want := range []string{"CUDA_VISIBLE_DEVICES=" + dev.UUID + "\n", "\n1 " + name + "\n"} {
		if !strings.Contains(string(log), want) {
			t.Errorf("run log does not contain %q", want)
		}
	}
}
