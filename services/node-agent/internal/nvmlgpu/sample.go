package nvmlgpu

import (
	"cmp"
	"context"
	"slices"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpuplane/gpuplane/contracts"
)

// Sample reads every GPU now, one sample per GPU in index order. busy is
// ignored: real GPUs show real load. A field a GPU cannot report reads as
// zero; a lost GPU gives a sample with Healthy false and no readings. It
// fails only when ctx ends or the backend is closed.
func (b *Backend) Sample(ctx context.Context, _ time.Time, _ map[string]string) ([]contracts.GPUSample, error) {
	if err := b.enter(); err != nil {
		return nil, err
	}
	defer b.leave()
	out := make([]contracts.GPUSample, 0, len(b.gpus))
	for _, g := range b.gpus {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		out = append(out, b.sample(g))
	}
	return out, nil
}

func (b *Backend) sample(g *gpu) contracts.GPUSample {
	s := contracts.GPUSample{Index: g.index, UUID: g.uuid, Model: g.model}
	if !b.lost(g) {
		b.readFields(g, &s)
	}
	b.mu.Lock()
	s.Healthy, s.LastXID = g.healthy, g.lastXID
	b.mu.Unlock()
	return s
}

func (b *Backend) readFields(g *gpu, s *contracts.GPUSample) {
	d := g.dev
	if u, ret := d.GetUtilizationRates(); b.read(g, "utilization", ret) {
		s.GPUUtil, s.MemCopyUtil = float64(u.Gpu), float64(u.Memory)
	}
	if m, ret := d.GetMemoryInfo(); b.read(g, "memory", ret) {
		s.FBUsedMiB, s.FBFreeMiB = int64(m.Used/mib), int64(m.Free/mib)
	}
	if t, ret := d.GetTemperature(nvml.TEMPERATURE_GPU); b.read(g, "temperature", ret) {
		s.TempC = float64(t)
		b.noteTemperature(g, t)
	}
	if mw, ret := d.GetPowerUsage(); b.read(g, "power", ret) {
		s.PowerW = float64(mw) / 1000
	}
	if mw, ret := d.GetEnforcedPowerLimit(); b.read(g, "power_limit", ret) {
		s.PowerLimitW = float64(mw) / 1000
	}
	if mhz, ret := d.GetClockInfo(nvml.CLOCK_SM); b.read(g, "sm_clock", ret) {
		s.SMClockMHz = float64(mhz)
	}
	if n, ret := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.VOLATILE_ECC); b.read(g, "ecc_sbe", ret) {
		s.ECCSBE = int64(n)
	}
	// The count is also how a double-bit error is seen on a GPU that does
	// not deliver ECC events; noteDBE reports a rise once, whoever sees it.
	if n, ret := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC); b.read(g, "ecc_dbe", ret) {
		s.ECCDBE = int64(n)
		b.noteDBE(g, n, false)
	}
	var reasons uint64
	var ret nvml.Return
	if b.eventReasons {
		reasons, ret = d.GetCurrentClocksEventReasons()
	} else {
		reasons, ret = d.GetCurrentClocksThrottleReasons()
	}
	if b.read(g, "clocks_event_reasons", ret) {
		s.ThrottleReasons = reasons
	}
	if procs, ret := d.GetComputeRunningProcesses(); b.read(g, "processes", ret) {
		s.Processes = processes(procs)
	}
}

// processes converts NVML's process list, sorted by PID. NVML reports
// "not available" memory (inside some containers) as all ones: it reads
// as 0.
func processes(procs []nvml.ProcessInfo) []contracts.GPUProcess {
	if len(procs) == 0 {
		return nil
	}
	out := make([]contracts.GPUProcess, 0, len(procs))
	for _, p := range procs {
		used := int64(0)
		if p.UsedGpuMemory != ^uint64(0) {
			used = int64(p.UsedGpuMemory / mib)
		}
		out = append(out, contracts.GPUProcess{PID: int(p.Pid), UsedMiB: used})
	}
	slices.SortFunc(out, func(a, b contracts.GPUProcess) int { return cmp.Compare(a.PID, b.PID) })
	return out
}
