package gateway

import "github.com/gpuplane/gpuplane/libs/bus"

// benchUsageModel makes m fold usage as the gateway does (buckets, the
// records read from USAGE): BenchmarkReadModelRebuild's retaining modes.
func benchUsageModel(m *memoryModel, b *bus.Bus) {
	m.aggregateUsage(DefaultUsageConfig(), streamUsage(b))
}
