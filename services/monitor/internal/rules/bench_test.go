package rules

import (
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// BenchmarkIngest measures the monitor's pure path: a fleet of machines of
// 8 GPUs each sends one telemetry message per second; every message goes
// into the windows (GPU, machine, pool, tenant) and the default rules are
// evaluated once per simulated second, as the monitor's ticker does. The
// figure is GPU samples per second of CPU, evaluation included.
func BenchmarkIngest(b *testing.B) {
	for _, machines := range []int{125, 1250} {
		b.Run(fmt.Sprintf("gpus=%d", machines*8), func(b *testing.B) {
			e, err := New(DefaultConfig())
			if err != nil {
				b.Fatal(err)
			}
			type msg struct {
				m    Machine
				gpus []contracts.GPUSample
			}
			fleet := make([]msg, machines)
			for i := range fleet {
				fleet[i].m = Machine{Node: fmt.Sprintf("n%d", i), Hostname: fmt.Sprintf("h%d", i), Pool: fmt.Sprintf("pool%d", i%4)}
				for j := range 8 {
					fleet[i].gpus = append(fleet[i].gpus, contracts.GPUSample{Index: j, UUID: fmt.Sprintf("GPU-%d-%d", i, j),
						Model: "H100-80GB", GPUUtil: float64((i + j) % 100), FBUsedMiB: 40000, FBFreeMiB: 40000, TempC: 60,
						PowerW: 400, Healthy: true, AllocationID: fmt.Sprintf("a%d", (i*8+j)%50)})
				}
			}
			tenants := map[string]string{}
			for i := range 50 {
				tenants[fmt.Sprintf("a%d", i)] = fmt.Sprintf("t%d", i%7)
			}
			tenantOf := func(id string) string { return tenants[id] }
			at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
			transitions := 0
			b.ReportAllocs()
			b.ResetTimer()
			samples := 0
			for i := 0; samples < b.N; i++ {
				f := &fleet[i%machines]
				if i%machines == 0 {
					at = at.Add(time.Second)
					transitions += len(e.Evaluate(at))
				}
				// Vary the readings a little so rings see changing values.
				f.gpus[0].TempC = 60 + float64(i%7)
				e.Ingest(f.m, at, f.gpus, tenantOf)
				samples += len(f.gpus)
			}
			b.StopTimer()
			b.ReportMetric(float64(samples)/b.Elapsed().Seconds(), "samples/s")
			b.ReportMetric(0, "ns/op")
			if len(e.series[scopeIndex(ScopeGPU)]) != machines*8 && b.N >= machines*8 {
				b.Fatalf("tracked %d GPUs, want %d", len(e.series[scopeIndex(ScopeGPU)]), machines*8)
			}
		})
	}
}
