package gateway

import (
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// benchUsageModel makes m fold usage as the gateway does (buckets, the
// records read from USAGE): BenchmarkReadModelRebuild's retaining modes.
func benchUsageModel(m *memoryModel, b *bus.Bus) {
	m.aggregateUsage(DefaultUsageConfig(), streamUsage(b, DefaultUsageConfig()))
}

// BenchmarkUsageDigestHistory folds a history of usage records, 20,000 a
// day stored evenly, into the usage read model, with the default
// duplicate window and with one that keeps every digest (the model before
// the window, the baseline), and reports the digests kept: with the
// window they stay those of the window and a day however long the
// history (issue 17: nothing grows with history).
func BenchmarkUsageDigestHistory(b *testing.B) {
	const perDay = 20_000
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, days := range []int{10, 30, 90} {
		for _, w := range []struct {
			name   string
			window time.Duration
		}{{"window=7d", DefaultUsageConfig().DuplicateWindow}, {"window=forever", 1 << 62}} {
			b.Run(fmt.Sprintf("days=%d/%s", days, w.name), func(b *testing.B) {
				var kept int
				for range b.N {
					agg := newUsageAgg(UsageConfig{DuplicateWindow: w.window})
					for i := range days * perDay {
						at := t0.Add(time.Duration(i) * (24 * time.Hour / perDay))
						agg.add("acme", contracts.UsageRecord{SchemaVersion: 1, ID: fmt.Sprintf("usage/%d", i), Tenant: "acme",
							Pool: "east", Start: at.Add(-time.Hour), End: at, GPUMillis: 1000, Time: at}, at)
					}
					kept = agg.ids.len()
				}
				// A digest held is 16 bytes and its day 4 (usageWindow).
				b.ReportMetric(float64(kept), "digests")
				b.ReportMetric(float64(kept*20)/float64(days*perDay), "digest-B/record")
				b.ReportMetric(float64(days*perDay), "records")
			})
		}
	}
}
