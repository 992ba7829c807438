// Package fragsim measures placement quality on GPU-sharing workloads: it
// replays a task trace (the Alibaba "openb" format of the FGD paper, USENIX
// ATC '23) onto a cluster, one task at a time with no departures, and reports
// how much GPU capacity is left unallocated as the arrived demand grows.
//
// The pipeline:
//
//	node list CSV ─ LoadNodes ─┐
//	                           ├─ Replay(seed) ── shuffle + resample to 130% ── for each task:
//	pod list CSV ── LoadPods ──┘                  filter (Fits) → Policy.Score per node →
//	                                              best score, ties broken at random →
//	                                              Cluster.Place → (arrived, allocated) sample
//
// It holds a cluster model with per-node CPU, memory and per-device milli-GPU
// capacity and the GPU-model constraints of the trace; the measure of
// fragmentation the paper defines (Workload.Frag); the paper's baselines
// (Random, BestFit, Packing, DotProd), FGD itself (so that the paper's
// published figures check this simulator) and our fragmentation-aware policy
// (FragAware).
//
// A Policy is a pure scoring function over (node state, task request): the
// live scheduler can call the same function on its own snapshot, with a
// Workload built from the recent task mix as the typical distribution.
package fragsim
