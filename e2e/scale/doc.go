// Package scale is gpuplane's whole-platform scale benchmark (issue 17):
// BenchmarkScale runs a NATS JetStream server, every service and the
// simulated fleet as processes of their own on this machine, submits jobs
// at a steady rate with heavy-tailed durations drawn from the Alibaba GPU
// trace, and reports the scheduling cycle, submit→scheduled latency,
// completions, and each process's memory over time (does anything grow
// with history?). See scale_bench_test.go.
package scale
