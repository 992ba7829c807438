package fragsim

import (
	"math/rand/v2"
	"testing"
)

// BenchmarkReplay130 is one replay of the default openb pod list on the
// 1,213-node, 6,212-GPU cluster, tasks resampled to 130% of GPU capacity
// (about 10,800 tasks), per policy. It reports the unallocated GPU share at
// 100% arrived and the placement rate; the paper's simulator needed 33
// minutes for one such replay on a 2-core machine.
func BenchmarkReplay130(b *testing.B) {
	nodes, list := loadDefault(b)
	seq := Sequence(list, GPUCapacity(nodes), DefaultInflation, rand.New(rand.NewPCG(42, streamSequence)))
	for _, name := range PolicyNames {
		b.Run(name, func(b *testing.B) {
			var res *Result
			for b.Loop() {
				pol, err := NewPolicy(name, nodes, list, rand.New(rand.NewPCG(42, streamPolicy)))
				if err != nil {
					b.Fatal(err)
				}
				if res, err = Replay(nodes, seq, pol, rand.New(rand.NewPCG(42, streamNodes))); err != nil {
					b.Fatal(err)
				}
			}
			if res.Placed == 0 {
				b.Fatal("nothing placed")
			}
			b.ReportMetric(res.Curve.Unallocated(100), "unalloc%@100")
			b.ReportMetric(float64(len(seq))*float64(b.N)/b.Elapsed().Seconds(), "tasks/s")
		})
	}
}
