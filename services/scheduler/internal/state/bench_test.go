package state

import (
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// BenchmarkCycle measures a whole cycle as the scheduler runs it under its
// lock: snapshot of 1,000 nodes × 8 GPUs, 3,000 queued jobs of 1-8 GPUs,
// placement, plan items, pending reasons and pool demand.
func BenchmarkCycle(b *testing.B) {
	placed := 0
	for range b.N {
		b.StopTimer()
		st := New(Config{Scheduler: "bench", Boot: "b", Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
		for i := range 1000 {
			inv := contracts.NodeInventory{NodeID: fmt.Sprintf("n%04d", i), Pool: []string{"east", "west"}[i%2]}
			for g := range 8 {
				inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: g, UUID: fmt.Sprintf("n%04d-%d", i, g), Model: h100,
					MemoryMiB: 81920, Healthy: true})
			}
			st.ApplyInventory(inv)
		}
		st.GoLive()
		for i := range 3000 {
			r := contracts.JobRequest{ID: fmt.Sprintf("j%05d", i), Resources: contracts.Resources{GPU: contracts.GPURequest{
				Count: []int{1, 1, 2, 4, 8}[i%5], Model: h100}}, Run: contracts.RunSpec{Duration: contracts.Duration(time.Minute)}}
			sub := st.Submit(contracts.SubjectSubmit(fmt.Sprintf("t%d", i%8)), mustJSON(b, r), uint64(i+1))
			sub.Published(uint64(i + 1))
		}
		runtime.GC() // keep the setup's garbage out of the measured cycle
		b.StartTimer()
		res := st.Cycle()
		placed += res.Placed
	}
	if placed == 0 {
		b.Fatal("nothing placed")
	}
	perCycle := b.Elapsed().Seconds() / float64(b.N)
	b.ReportMetric(float64(placed)/float64(b.N)/perCycle, "placements/s")
	b.ReportMetric(float64(placed)/float64(b.N), "placed/cycle")
}
