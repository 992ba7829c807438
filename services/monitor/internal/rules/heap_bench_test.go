package rules

import (
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"strconv"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// BenchmarkEngineHeap reports the engine's live heap per machine (8 GPUs
// each) once every ring has been written for longer than the longest
// window, with the default rules: the memory the monitor holds per machine
// of a 10,000-machine fleet (issue 17). Each op builds and fills a fresh
// engine; MONITOR_HEAP_MACHINES sets the fleet (default 1000),
// MONITOR_HEAP_PROFILE a file for the heap profile taken while it is alive. Heap is
// measured as HeapAlloc after two GCs, the engine kept alive, minus the
// same before it was built.
func BenchmarkEngineHeap(b *testing.B) {
	machines := 1000
	if s := os.Getenv("MONITOR_HEAP_MACHINES"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			b.Fatalf("MONITOR_HEAP_MACHINES=%q", s)
		}
		machines = n
	}
	var perMachine float64
	for range b.N {
		perMachine = float64(engineHeap(b, machines)) / float64(machines)
	}
	b.ReportMetric(perMachine, "B/machine")
}

func engineHeap(b *testing.B, machines int) uint64 {
	b.Helper()
	type msg struct {
		m    Machine
		gpus []contracts.GPUSample
	}
	fleet := make([]msg, machines)
	for i := range fleet {
		fleet[i].m = Machine{Node: fmt.Sprintf("node-%06d", i), Hostname: fmt.Sprintf("host-%06d.example", i), Pool: fmt.Sprintf("pool%d", i%4)}
		for j := range 8 {
			fleet[i].gpus = append(fleet[i].gpus, contracts.GPUSample{Index: j,
				UUID:  fmt.Sprintf("GPU-%08x-%04x-%04x-%04x-%012x", i, j, i, j, i*8+j),
				Model: "NVIDIA H100 80GB HBM3", GPUUtil: float64((i + j) % 100), FBUsedMiB: 40000, FBFreeMiB: 40000, TempC: 60,
				PowerW: 400, Healthy: true, AllocationID: fmt.Sprintf("a%d", (i*8+j)%50)})
		}
	}
	tenants := map[string]string{}
	for i := range 50 {
		tenants[fmt.Sprintf("a%d", i)] = fmt.Sprintf("t%d", i%7)
	}
	tenantOf := func(id string) string { return tenants[id] }
	var before, after runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&before)
	e, err := New(DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	// Six minutes of one message per machine every 5 s: past the longest
	// window (5 min), so every ring has wrapped. Each message carries
	// fresh strings, as a decoded one does.
	for step := range 72 {
		at = at.Add(5 * time.Second)
		for i := range fleet {
			f := &fleet[i]
			m := f.m
			m.Node, m.Hostname, m.Pool = clone(m.Node), clone(m.Hostname), clone(m.Pool)
			gpus := make([]contracts.GPUSample, len(f.gpus))
			copy(gpus, f.gpus)
			for j := range gpus {
				gpus[j].UUID, gpus[j].Model = clone(gpus[j].UUID), clone(gpus[j].Model)
				gpus[j].TempC = 60 + float64((step+j)%7)
				gpus[j].ECCSBE = int64(step / 10)
			}
			e.Ingest(m, at, gpus, tenantOf)
		}
		for n := range machines {
			e.IngestNode(fleet[n].m.Node, fleet[n].m.Pool, at, NodeValues{HeartbeatAge: time.Second})
		}
		e.Evaluate(at)
	}
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&after)
	if path := os.Getenv("MONITOR_HEAP_PROFILE"); path != "" {
		// The engine is alive here: go tool pprof -sample_index=inuse_space.
		f, err := os.Create(path)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		if err := pprof.WriteHeapProfile(f); err != nil {
			b.Fatal(err)
		}
	}
	runtime.KeepAlive(e)
	runtime.KeepAlive(fleet)
	return after.HeapAlloc - before.HeapAlloc
}

func clone(s string) string { return string([]byte(s)) }
