package kvsnap_test

import (
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// BenchmarkGrowingSnapshot writes a scheduler's snapshot after a minute
// of a million-job history: records of 29 bytes for every job ever
// retired (1,000,000, then 1,000 more per write: 1,000 jobs a minute),
// between a header and a live part (2 MB) that change at every write.
// One op is one write after the first; put-MB/op is what it put into the
// bucket, whole (every chunk, as before parts) and in parts.
func BenchmarkGrowingSnapshot(b *testing.B) {
	for _, mode := range []string{"whole", "parts"} {
		b.Run(mode, func(b *testing.B) {
			srv := natstest.Start(b)
			op := connectAs(b, srv, natstest.Operator(b, srv))
			kv := bucket(b, op)
			s := kvsnap.Store{KV: kv, HeadKey: contracts.RMSnapshotHeadKey(), ChunkKey: contracts.RMSnapshotChunkKey}
			if mode == "parts" {
				s.Parts = kvsnap.NewParts()
			}
			n := 1_000_000
			write := func(seq int) kvsnap.Head {
				data := history(uint64(seq), n, 2<<20)
				h, err := s.Write(b.Context(), uint64(seq), func() ([]byte, error) { return data, nil })
				if err != nil {
					b.Fatal(err)
				}
				return h
			}
			write(0)
			put := 0
			b.ResetTimer()
			for i := range b.N {
				n += 1000
				put += write(i + 1).Put
			}
			b.ReportMetric(float64(put)/float64(b.N)/1e6, "put-MB/op")
			b.ReportMetric(float64(n*29+2<<20)/1e6, "snapshot-MB")
		})
	}
}
