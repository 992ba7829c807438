package preempt_test

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/preempt"
)

// fleet is n busy machines of 8 H100s (two NVLink domains of 4): jobs of
// 1, 2, 4 and 8 GPUs and shares of every class, every card taken, so that
// nothing fits without eviction.
func fleet(n int) (placement.Snapshot, []preempt.Running) {
	rng := rand.New(rand.NewPCG(uint64(n), 1))
	pris := []contracts.Priority{be, be, norm, norm, norm, high}
	var nodes []placement.Node
	var running []preempt.Running
	for k := range n {
		id := fmt.Sprintf("node-%05d", k)
		nd := node(id, 8, nvlink("a", "a", "a", "a", "b", "b", "b", "b"), zone(fmt.Sprintf("z%d", k%4)))
		nodes = append(nodes, nd)
		for i := 0; i < 8; {
			size := []int{1, 1, 2, 2, 4, 8}[rng.IntN(6)]
			if i%size != 0 || i+size > 8 {
				size = 1
			}
			r := job(fmt.Sprintf("%s-%d", id, i), id, pris[rng.IntN(len(pris))],
				started(time.Duration(rng.Int64N(int64(48*time.Hour)))), host(int64(size)*4000, int64(size)*32<<10))
			r.Checkpointable = rng.IntN(2) == 0
			if rng.IntN(12) == 0 { // shares of one card
				for s := range 3 {
					sh := r
					sh.AllocationID = fmt.Sprintf("%s-%d.%d", id, i, s)
					sh.Priority = pris[rng.IntN(len(pris))]
					sh.CPUMilli, sh.MemoryMiB = 1000, 8<<10
					share(i, 16<<10, 25)(&sh)
					running = append(running, sh)
				}
				i++
				continue
			}
			for j := range size {
				cards(i + j)(&r)
			}
			running = append(running, r)
			i += size
		}
	}
	return cluster(nodes, running), running
}

func BenchmarkChoose(b *testing.B) {
	preemptors := []struct {
		name string
		p    preempt.Preemptor
	}{
		{"whole-8", wants(high, 8)},
		{"whole-2-nvlink", wants(high, 2, topo(contracts.TopologyNVLink))},
		{"share", wants(high, 1, shareOf(40<<10, 50))},
		{"reclaim-4", wants(norm, 4, reclaim())},
		{"gang-4x8", wants(crit, 32, machines(4, contracts.TopologyAny))},
		{"gang-4x8-zone", wants(crit, 32, machines(4, contracts.TopologyZone))},
	}
	for _, size := range []int{1000, 10000} {
		snap, running := fleet(size)
		// Priority may evict any lower class of this fleet (no tenant of
		// it has a guarantee); a reclaim only a third of it, the borrowed.
		reclaimable := slices.Clone(running)
		for i := range reclaimable {
			reclaimable[i].Borrowing = i%3 == 0
		}
		// Baseline: one FitNode pass over the fleet, the least any
		// what-if search has to do.
		b.Run(fmt.Sprintf("nodes=%d/baseline-fitnode-scan", size), func(b *testing.B) {
			r := perMachine(wants(high, 8))
			for b.Loop() {
				for i := range snap.Nodes {
					placement.FitNode(&snap.Nodes[i], r)
				}
			}
		})
		for _, pc := range preemptors {
			b.Run(fmt.Sprintf("nodes=%d/%s", size, pc.name), func(b *testing.B) {
				var ch preempt.Choice
				var ok bool
				rs := running
				if pc.p.Reclaim {
					rs = reclaimable
				}
				for b.Loop() {
					ch, ok = preempt.Choose(snap, rs, pc.p, preempt.Options{Now: t0, MinRuntime: time.Hour})
				}
				if !ok {
					b.Fatal("no choice")
				}
				var milli int64
				for _, v := range ch.Victims {
					for _, d := range v.Devices {
						milli += d.MilliGPUs()
					}
				}
				b.ReportMetric(float64(len(ch.Victims)), "victims")
				b.ReportMetric(float64(milli)/1000, "GPUs-evicted")
			})
		}
	}
}
