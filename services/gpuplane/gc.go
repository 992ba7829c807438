package gpuplane

import "github.com/gpuplane/gpuplane/libs/gctune"

// DefaultGCPercent is gctune.DefaultPercent, the collector's target of
// every gpuplane process (the all-in-one's among them).
const DefaultGCPercent = gctune.DefaultPercent

// TuneGC is gctune.Tune: the benchmarks that run the platform in their
// own process call it to run it as the binaries do.
func TuneGC(percent int) (restore func()) { return gctune.Tune(percent) }
