package state

import (
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// BenchmarkCycle measures whole cycles as the scheduler runs them under its
// lock: snapshot, fair-share order, quota checks, placement, plan items,
// pending reasons, preemption and backfill searches, and pool demand. One op
// is one cycle over the whole queue; placements/s is jobs placed per second
// of cycle (a gang counts once).
//
//   - whole: 1,000 empty machines of 8 H100s, 3,000 queued jobs of 1-8
//     GPUs, no quotas (the cycle's floor).
//   - mixed: the placement benchmarks' fleet (four pools, A100 machines
//     with NVLink pairs and MIG cards, zones, tainted spot machines) filled
//     through the store itself: cycles, ledger commits and run starts, then
//     a random fifth of the jobs ends, leaving scattered free devices. The
//     measured queue mixes whole GPUs, gangs, MIG instances and shares, of
//     any model or pool, in three priority classes, over 20 tenants of
//     which some are capped, some guaranteed and weighted.
func BenchmarkCycle(b *testing.B) {
	b.Run("nodes=1000/whole", func(b *testing.B) {
		benchCycle(b, func() *Store {
			st := newBenchStore()
			for i := range 1000 {
				inv := contracts.NodeInventory{NodeID: fmt.Sprintf("n%04d", i), Pool: []string{"east", "west"}[i%2]}
				for g := range 8 {
					inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: g, UUID: fmt.Sprintf("n%04d-%d", i, g), Model: h100,
						MemoryMiB: 81920, Healthy: true})
				}
				st.ApplyInventory(inv)
			}
			st.GoLive()
			for i := range 3000 {
				r := contracts.JobRequest{ID: fmt.Sprintf("j%05d", i), Resources: contracts.Resources{GPU: contracts.GPURequest{
					Count: []int{1, 1, 2, 4, 8}[i%5], Model: h100}}, Run: contracts.RunSpec{Duration: contracts.Duration(time.Minute)}}
				benchSubmit(b, st, fmt.Sprintf("t%d", i%8), r, uint64(i+1))
			}
			return st
		})
	})
	for _, size := range []struct{ nodes, queue int }{{1000, 500}, {10000, 5000}} {
		b.Run(fmt.Sprintf("nodes=%d/mixed", size.nodes), func(b *testing.B) {
			benchCycle(b, func() *Store { return benchMixed(b, size.nodes, size.queue) })
		})
	}
	// The scale point: the mixed fleet and workload with a deep
	// queue (the fill's batches are the mixed one's; then queued jobs wait).
	b.Run("nodes=10000/queued=100000", func(b *testing.B) {
		benchCycle(b, func() *Store { return benchDeep(b, 10000, 100000) })
	})
}

// benchDeep is benchMixed's store (filled with batches of 5,000) with
// queued more jobs of the same mix waiting for the measured cycle.
func benchDeep(b testing.TB, nodes, queued int) *Store {
	st := benchMixed(b, nodes, 5000)
	rng := rand.New(rand.NewPCG(uint64(queued), 11))
	for i := range queued {
		seq := uint64(1_000_000 + i)
		benchSubmit(b, st, benchTenant(rng.IntN(benchTenants)), benchRequest(rng, fmt.Sprintf("q%06d", i)), seq)
	}
	return st
}

// benchCycle times one Cycle per op on a store that setup builds outside
// the timer (a cycle changes the store, so each op needs a fresh one).
func benchCycle(b *testing.B, setup func() *Store) {
	placed, waiting, queued := 0, 0, 0
	var cpu time.Duration
	for range b.N {
		b.StopTimer()
		st := setup()
		queued += st.Queued()
		runtime.GC() // keep the setup's garbage out of the measured cycle
		b.StartTimer()
		cpu0 := processCPU()
		res := st.Cycle()
		cpu += processCPU() - cpu0
		placed += res.Placed
		waiting += res.Waiting
	}
	if placed == 0 {
		b.Fatal("nothing placed")
	}
	perCycle := b.Elapsed().Seconds() / float64(b.N)
	b.ReportMetric(float64(placed)/float64(b.N)/perCycle, "placements/s")
	b.ReportMetric(float64(placed)/float64(b.N), "placed/cycle")
	b.ReportMetric(float64(waiting)/float64(b.N), "waiting/cycle")
	b.ReportMetric(float64(queued)/float64(b.N), "queued")
	b.ReportMetric(perCycle*1000, "ms/cycle")
	// CPU time (every thread of the process, the collector's included):
	// on a shared machine wall time mostly measures the neighbours.
	b.ReportMetric(cpu.Seconds()*1000/float64(b.N), "cpu-ms/cycle")
}

// processCPU is the CPU time the process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

var benchT0 = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

func newBenchStore() *Store {
	return New(Config{Scheduler: "bench", Boot: "b", Now: func() time.Time { return benchT0 },
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)), MaxReservations: 4})
}

// benchSubmit queues r as the scheduler does (decide, publish, record).
func benchSubmit(b testing.TB, st *Store, tenant string, r contracts.JobRequest, seq uint64) {
	sub := st.Submit(contracts.SubjectSubmit(tenant), mustJSON(b, r), seq)
	if sub.Outcome != "queued" {
		ev, _ := sub.Publish.Msg.(contracts.JobEvent)
		b.Fatalf("bench job %s/%s not queued: %s %s", tenant, r.ID, sub.Outcome, ev.Message)
	}
	sub.Published(seq)
}

const a100 = "A100-80GB"

// benchPools are the machines per 10: H100 with one NVLink domain (two
// pools), A100 with two domains of four, A100 with two MIG cards.
var benchPools = []struct {
	name, model string
	share       int
	domains     int
	migCards    int
}{
	{"h100-train", h100, 4, 1, 0},
	{"h100-infer", h100, 2, 1, 0},
	{"a100", a100, 3, 2, 0},
	{"a100-mig", a100, 1, 2, 2},
}

// benchMIG are the two MIG layouts (7×1g, or 3g+2g+1g+1g) with their
// starting slices and memory.
var benchMIG = [][]contracts.MIGInstance{
	{{Profile: "1g.10gb", Start: 0}, {Profile: "1g.10gb", Start: 1}, {Profile: "1g.10gb", Start: 2},
		{Profile: "1g.10gb", Start: 3}, {Profile: "1g.10gb", Start: 4}, {Profile: "1g.10gb", Start: 5},
		{Profile: "1g.10gb", Start: 6}},
	{{Profile: "3g.40gb", Start: 0}, {Profile: "2g.20gb", Start: 4}, {Profile: "1g.10gb", Start: 6},
		{Profile: "1g.10gb", Start: 7}},
}

func benchInventory(i int) contracts.NodeInventory {
	bp := benchPools[0]
	for j, cum := 0, 0; j < len(benchPools); j++ {
		cum += benchPools[j].share
		if i%10 < cum {
			bp = benchPools[j]
			break
		}
	}
	id := fmt.Sprintf("%s-%05d", bp.name, i)
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: id, Pool: bp.name, Zone: fmt.Sprintf("zone-%d", i%3),
		Labels: map[string]string{"rack": fmt.Sprintf("r%d", i%40)}, CPUMilli: 128000, MemoryMiB: 1 << 20,
		Incarnation: "i1", Time: benchT0}
	if i%20 == 7 {
		inv.Taints = []contracts.Taint{{Key: "spot", Value: "true", Effect: contracts.TaintPreferNoSchedule}}
	}
	for g := range 8 {
		gpu := contracts.GPUInfo{Index: g, UUID: fmt.Sprintf("%s-%d", id, g), Model: bp.model, MemoryMiB: 81920,
			Healthy: true, NVLinkDomain: fmt.Sprintf("%s/nvl%d", id, g*bp.domains/8)}
		if g >= 8-bp.migCards {
			gpu.MIGEnabled = true
			for s, mi := range benchMIG[g%2] {
				mi.UUID = fmt.Sprintf("MIG-%s-%d-%d", id, g, s)
				mi.GIID, mi.Size = s+1, 1
				mi.MemoryMiB = map[string]int64{"1g.10gb": 9728, "2g.20gb": 19968, "3g.40gb": 40192}[mi.Profile]
				gpu.MIGInstances = append(gpu.MIGInstances, mi)
			}
		}
		inv.GPUs = append(inv.GPUs, gpu)
	}
	return inv
}

const benchTenants = 20

// benchQuotas: t00-t03 capped in h100-train at 0.5% of the fleet's GPUs
// (a twentieth of the work there would take more: they hit it while the
// fleet fills), t04-t07 guaranteed 2% there with weight 2, the rest
// weight 1 and no quota.
func benchQuotas(st *Store, nodes int) {
	for i := range 8 {
		q := contracts.TenantQuota{Tenant: benchTenant(i)}
		if i < 4 {
			limit := float64(nodes) * 8 * 0.5 / 100
			q.Pools = map[string]contracts.PoolQuota{"h100-train": {Max: &limit}}
		} else {
			q.Weight = 2
			q.Pools = map[string]contracts.PoolQuota{"h100-train": {Guarantee: float64(nodes) * 8 * 2 / 100}}
		}
		st.ApplyQuota(q.Tenant, &q)
	}
}

func benchTenant(i int) string { return fmt.Sprintf("t%02d", i) }

// benchRequest is one job of the mixed workload: the placement
// benchmarks' mix, kept to requests some machine could hold (a pool or
// model named goes with the request's kind), so that what waits after a
// cycle waits for capacity, quota or order.
func benchRequest(rng *rand.Rand, id string) contracts.JobRequest {
	var g contracts.GPURequest
	x := rng.IntN(100)
	switch {
	case x < 30:
		g = contracts.GPURequest{Count: 1}
	case x < 40:
		g = contracts.GPURequest{Count: 2}
	case x < 48:
		g = contracts.GPURequest{Count: 4}
	case x < 55:
		g = contracts.GPURequest{Count: 8}
	case x < 60:
		m := 2 + rng.IntN(3)
		g = contracts.GPURequest{Count: 8 * m, Nodes: m}
		if rng.IntN(2) == 0 {
			g.Topology = contracts.TopologyZone
		}
	case x < 70:
		g = contracts.GPURequest{Count: 1, MIGProfile: []string{"1g.10gb", "1g.10gb", "3g.40gb"}[rng.IntN(3)]}
	default:
		pct := []int{10, 25, 25, 50}[rng.IntN(4)]
		g = contracts.GPURequest{Count: 1, Share: &contracts.GPUShare{MemoryMiB: int64(pct) * 800, ComputePercent: pct}}
	}
	switch rng.IntN(4) {
	case 0:
		g.Model = h100
	case 1:
		g.Model = a100
	}
	if g.MIGProfile != "" {
		g.Model = a100
	}
	// Eight GPUs in one NVLink domain: only the H100 machines have one.
	if g.Count == 8 && g.Nodes == 0 && g.Model != a100 && rng.IntN(2) == 0 {
		g.Topology = contracts.TopologyNVLink
	}
	r := contracts.JobRequest{ID: id, Resources: contracts.Resources{GPU: g},
		Priority: []contracts.Priority{contracts.PriorityHigh, contracts.PriorityNormal, contracts.PriorityNormal,
			contracts.PriorityNormal, contracts.PriorityBestEffort, contracts.PriorityBestEffort}[rng.IntN(6)],
		Run: contracts.RunSpec{Duration: contracts.Duration(time.Duration(10+rng.IntN(230)) * time.Minute)}}
	if rng.IntN(10) < 3 {
		var pools []string
		for _, bp := range benchPools {
			whole8 := g.Kind() == contracts.GPUKindWhole && g.Count/max(1, g.Nodes) == 8
			switch {
			case g.Model != "" && g.Model != bp.model,
				g.MIGProfile != "" && bp.migCards == 0,
				whole8 && bp.migCards > 0, // two of its eight cards are in MIG mode
				g.Topology == contracts.TopologyNVLink && bp.domains > 1:
				continue
			}
			pools = append(pools, bp.name)
		}
		r.Pool = pools[rng.IntN(len(pools))]
	}
	gpusPer := int64(max(1, g.Count/max(1, g.Nodes)))
	r.Resources.CPUMilli, r.Resources.MemoryMiB = gpusPer*12000, gpusPer*98304
	if g.Kind() != contracts.GPUKindWhole {
		r.Resources.CPUMilli, r.Resources.MemoryMiB = 4000, 32768
	}
	return r
}

// benchMixed is a store over nodes machines filled to about half by its own
// cycles (committed and started), a fifth of those jobs ended, and queue
// more jobs waiting for the measured cycle. The same every call.
func benchMixed(b testing.TB, nodes, queue int) *Store {
	st := newBenchStore()
	for i := range nodes {
		st.ApplyInventory(benchInventory(i))
	}
	benchQuotas(st, nodes)
	st.GoLive()
	rng := rand.New(rand.NewPCG(uint64(nodes), 7))
	seq := uint64(0)
	submit := func(n int) {
		for range n {
			seq++
			benchSubmit(b, st, benchTenant(rng.IntN(benchTenants)), benchRequest(rng, fmt.Sprintf("j%06d", seq)), seq)
		}
	}
	// Fill: cycles over batches until 55% of the GPUs are held (or a batch
	// places nothing), every item committed and started at once.
	var allocs [][]contracts.Allocation // by job
	held, total := int64(0), int64(nodes)*8*1000
	for held < total*55/100 {
		submit(queue)
		res := st.Cycle()
		if res.Placed == 0 {
			break
		}
		byJob := map[string]int{}
		for _, p := range res.Plans {
			for _, a := range p.Items {
				st.ApplyLedger(contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a, Time: benchT0})
				st.ApplyRun(contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunStarted, AllocationID: a.ID,
					Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Devices: a.Devices,
					Time: benchT0.Add(-time.Duration(rng.IntN(120)) * time.Minute)})
				held += milliOf(&a)
				k := Key(a.Tenant, a.JobID)
				if _, ok := byJob[k]; !ok {
					byJob[k] = len(allocs)
					allocs = append(allocs, nil)
				}
				allocs[byJob[k]] = append(allocs[byJob[k]], a)
			}
		}
	}
	// Departures: a random fifth of the placed jobs succeeds.
	for _, job := range allocs {
		if rng.IntN(5) != 0 {
			continue
		}
		for _, a := range job {
			run := contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: benchT0.Add(-time.Hour), EndedAt: benchT0}
			st.ApplyLedger(contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerReleased, Allocation: a,
				Time: benchT0, Reason: contracts.ReasonRunEnded, Run: &run})
		}
	}
	// Whatever the fill left queued stays; the measured queue comes after.
	submit(queue)
	return st
}
