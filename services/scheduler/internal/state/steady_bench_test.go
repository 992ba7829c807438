package state

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/gctune"
)

// BenchmarkSteadyCycle measures the cycle a scheduler runs most: the
// cluster is full, a deep queue waits, and between two cycles only a delta
// happened. Setup (outside the timer) is BenchmarkCycle's queued=100000
// store; one cold cycle is run and its plans committed and started. Each op
// then applies a delta (the clock moves on a second, 1% of running jobs end,
// 300 jobs arrive, one node is cordoned and the one before uncordoned, the
// last cycle's preemption victims stop) and times one cycle; its plans are
// committed and started outside the timer. GPUPLANE_STEADY_NODES and
// GPUPLANE_STEADY_QUEUED change the size (10,000 and 100,000 by default:
// issue 17's "cycle ≤ 50 ms at 10,000 machines and 100,000 queued").
// GPUPLANE_CYCLE_CPUPROFILE names a file for a CPU profile of the timed
// cycles. The collector runs as in the scheduler's binary (gctune: GOGC
// 300 unless the environment sets GOGC): at the runtime's default of 100
// collection was ~30 % of a steady cycle's CPU, a cost the scheduler
// does not pay.
func BenchmarkSteadyCycle(b *testing.B) {
	b.Cleanup(gctune.Tune(gctune.DefaultPercent))
	nodes, queued := envInt("GPUPLANE_STEADY_NODES", 10000), envInt("GPUPLANE_STEADY_QUEUED", 100000)
	b.Run(fmt.Sprintf("nodes=%d/queued=%d/steady", nodes, queued), func(b *testing.B) {
		st := benchDeep(b, nodes, queued)
		sd := newSteady(nodes, st)
		sd.apply(st.Cycle())
		for range 2 { // the cycles right after the cold one still publish its reasons
			sd.delta(300, 100)
			sd.apply(st.Cycle())
		}
		faultIn() // and collects
		placed, waiting, events := 0, 0, 0
		var cpu time.Duration
		if f := os.Getenv("GPUPLANE_CYCLE_CPUPROFILE"); f != "" {
			// The timed cycles only, without the setup.
			out, err := os.Create(f)
			if err != nil {
				b.Fatal(err)
			}
			if err := pprof.StartCPUProfile(out); err != nil {
				b.Fatal(err)
			}
			defer func() { pprof.StopCPUProfile(); _ = out.Close() }()
		}
		if f := os.Getenv("GPUPLANE_CYCLE_MEMPROFILE"); f != "" {
			write := func(name string) {
				out, err := os.Create(name)
				if err != nil {
					b.Fatal(err)
				}
				defer out.Close()
				runtime.GC() // the profile is as of the last collection
				if err := pprof.Lookup("allocs").WriteTo(out, 0); err != nil {
					b.Fatal(err)
				}
			}
			write(f + ".base")
			defer func() { b.StopTimer(); write(f) }() // its collection is not a cycle's
		}
		b.ResetTimer()
		for range b.N {
			b.StopTimer()
			sd.delta(300, 100)
			b.StartTimer()
			cpu0 := processCPU()
			res := st.Cycle()
			cpu += processCPU() - cpu0
			b.StopTimer()
			placed += res.Placed
			waiting += res.Waiting
			events += len(res.Publish)
			sd.apply(res)
			b.StartTimer()
		}
		perCycle := b.Elapsed().Seconds() / float64(b.N)
		b.ReportMetric(float64(placed)/float64(b.N), "placed/cycle")
		b.ReportMetric(float64(waiting)/float64(b.N), "waiting/cycle")
		b.ReportMetric(float64(events)/float64(b.N), "events/cycle")
		b.ReportMetric(perCycle*1000, "ms/cycle")
		b.ReportMetric(cpu.Seconds()*1000/float64(b.N), "cpu-ms/cycle")
	})
}

// faultIn has the heap's pages up to the collector's goal touched once.
// The heap grows to the goal (~4x what is live at GOGC 300) over the
// first cycles after the setup, and each new page's first touch is a
// fault (~10 µs on a VM: a 10-cycle run paid ~180 ms a cycle for 900 MB
// of them); a scheduler that has run a while has those pages, kept by
// the runtime up to the goal.
func faultIn() {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	var touched [][]byte
	for n := ms.HeapAlloc; n < ms.NextGC; n += 1 << 20 {
		b := make([]byte, 1<<20) // fresh pages come zeroed: nothing touches them but this
		for i := 0; i < len(b); i += 4096 {
			b[i] = 1
		}
		touched = append(touched, b)
	}
	runtime.KeepAlive(touched)
	touched = nil
	runtime.GC()
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// steady drives stores built alike through the same deltas: what their
// cycles placed is committed and started, victims stop, running jobs end,
// jobs arrive, nodes are cordoned and uncordoned, and the clock moves.
type steady struct {
	stores  []*Store
	rng     *rand.Rand
	nodes   int
	now     time.Time
	seq     uint64
	running []string // job keys with committed parts
	allocs  map[string][]contracts.Allocation
	victims []string // allocation IDs to stop before the next cycle
	cordon  int      // the node cordoned last, -1 none
	// extra, when set, runs after each delta on every store (the tests'
	// quota, reservation and cancel changes).
	extra func(rng *rand.Rand, st *Store)
}

func newSteady(nodes int, stores ...*Store) *steady {
	sd := &steady{stores: stores, rng: rand.New(rand.NewPCG(uint64(nodes), 23)), nodes: nodes, now: benchT0,
		seq: 2_000_000, allocs: map[string][]contracts.Allocation{}, cordon: -1}
	for _, st := range stores {
		st.cfg.Now = func() time.Time { return sd.now }
		// What the fill committed runs: it may end too.
		for _, a := range st.cluster.allocs {
			if _, ok := sd.allocs[Key(a.Tenant, a.JobID)]; !ok && st == stores[0] {
				sd.running = append(sd.running, Key(a.Tenant, a.JobID))
			}
			if st == stores[0] {
				sd.allocs[Key(a.Tenant, a.JobID)] = append(sd.allocs[Key(a.Tenant, a.JobID)], *a)
			}
		}
	}
	// Map order is random: sort for the same sequence every run.
	slices.Sort(sd.running)
	return sd
}

// apply commits and starts what a cycle placed, in every store, and notes
// its victims. Every store must have decided the same (the tests check).
func (sd *steady) apply(res CycleResult) {
	for _, p := range res.Plans {
		for _, a := range p.Items {
			k := Key(a.Tenant, a.JobID)
			if _, ok := sd.allocs[k]; !ok {
				sd.running = append(sd.running, k)
			}
			sd.allocs[k] = append(sd.allocs[k], a)
			for _, st := range sd.stores {
				st.ApplyLedger(contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a, Time: sd.now})
				st.ApplyRun(contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunStarted, AllocationID: a.ID,
					Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Devices: a.Devices, Time: sd.now})
			}
		}
	}
	for _, p := range res.Preempted {
		sd.victims = append(sd.victims, p.Victims...)
	}
}

// delta moves the clock on a second, stops the last cycle's victims, ends
// ends of the running jobs, queues arrivals new ones and moves the cordon
// to another node.
func (sd *steady) delta(arrivals, ends int) {
	sd.now = sd.now.Add(time.Second)
	st0 := sd.stores[0]
	for _, id := range sd.victims {
		a, ok := st0.cluster.allocs[id]
		if !ok {
			continue
		}
		run := contracts.RunResult{Outcome: contracts.OutcomeCancelled, StartedAt: sd.now.Add(-time.Hour), EndedAt: sd.now}
		for _, st := range sd.stores {
			st.ApplyLedger(contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerReleased, Allocation: *a,
				Time: sd.now, Reason: contracts.ReasonPreempted, Run: &run})
		}
	}
	sd.victims = sd.victims[:0]
	for range min(ends, len(sd.running)) {
		i := sd.rng.IntN(len(sd.running))
		k := sd.running[i]
		sd.running[i] = sd.running[len(sd.running)-1]
		sd.running = sd.running[:len(sd.running)-1]
		for _, a := range sd.allocs[k] {
			if _, held := st0.cluster.allocs[a.ID]; !held {
				continue // released already (a victim, or an earlier attempt)
			}
			run := contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: sd.now.Add(-time.Hour), EndedAt: sd.now}
			for _, st := range sd.stores {
				st.ApplyLedger(contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerReleased, Allocation: a,
					Time: sd.now, Reason: contracts.ReasonRunEnded, Run: &run})
			}
		}
		delete(sd.allocs, k)
	}
	for range arrivals {
		sd.seq++
		tenant, r := benchTenant(sd.rng.IntN(benchTenants)), benchRequest(sd.rng, fmt.Sprintf("s%07d", sd.seq))
		for _, st := range sd.stores {
			benchSubmitQuiet(st, tenant, r, sd.seq)
		}
	}
	if sd.nodes > 0 {
		next := sd.rng.IntN(sd.nodes)
		for _, st := range sd.stores {
			if sd.cordon >= 0 {
				st.ApplyNodeAdmin(benchInventory(sd.cordon).NodeID, nil)
			}
			st.ApplyNodeAdmin(benchInventory(next).NodeID, &contracts.NodeAdmin{NodeID: benchInventory(next).NodeID,
				Cordoned: true, Reason: "steady benchmark"})
		}
		sd.cordon = next
	}
	if sd.extra != nil {
		r := rand.New(rand.NewPCG(sd.seq, 1))
		for _, st := range sd.stores {
			*r = *rand.New(rand.NewPCG(sd.seq, 1)) // the same draws for every store
			sd.extra(r, st)
		}
	}
}

// benchSubmitQuiet is benchSubmit without a testing.TB: a request the store
// does not queue (an ID reused) is skipped.
func benchSubmitQuiet(st *Store, tenant string, r contracts.JobRequest, seq uint64) {
	b, err := json.Marshal(r)
	if err != nil {
		return
	}
	sub := st.Submit(contracts.SubjectSubmit(tenant), b, seq)
	sub.Published(seq)
}
