package state

import (
	"slices"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// The tests of this file are the reproductions of issue 18, sections 1
// and 2: a preemption respects other tenants' guarantees, its victims'
// devices go to the preemptor and nobody else, and its victims' next
// attempts do not evict what the decision chose to keep.

// preempted lists, in the order first sent, the allocations that got a
// command (checkpoint or stop) because they were preempted.
func (h *harness) preempted() []string {
	var out []string
	for _, c := range h.commands {
		if c.Reason == contracts.ReasonPreempted && !slices.Contains(out, c.AllocationID) {
			out = append(out, c.AllocationID)
		}
	}
	return out
}

// running commits a plan item and starts its run.
func (h *harness) running(a contracts.Allocation) {
	h.commit(a)
	h.started(a, h.now)
}

// stopped ends a preempted run and releases its allocation.
func (h *harness) stopped(a contracts.Allocation) {
	h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonPreempted, StartedAt: h.now, EndedAt: h.now})
	h.release(a, contracts.ReasonPreempted, nil)
}

func devicesOf(as ...contracts.Allocation) []string {
	var out []string
	for _, a := range as {
		for _, d := range a.Devices {
			out = append(out, d.UUID)
		}
	}
	slices.Sort(out)
	return out
}

// Issue 18, section 1: on one machine of 4 L4s, tenants qa and qb each
// hold their guarantee of 2 GPUs. qb's high job of 2 GPUs evicts qb's own
// two jobs, never qa's (within its guarantee); the devices freed stay
// held for it while the second victim stops, though qb3's next attempt
// and another tenant's job wait for a GPU; it runs on exactly them: two
// evictions for one 2-GPU job.
func TestPreemptionKeepsOtherTenantsGuaranteesAndHoldsTheFreedDevices(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MinRuntime = 0 })
	h.inventory("l4-1", "l4", "L4", 23034, 4)
	four := 4.0
	for _, tn := range []string{"qa", "qb"} {
		h.st.ApplyQuota(tn, &contracts.TenantQuota{Pools: map[string]contracts.PoolQuota{"l4": {Guarantee: 2, Max: &four}}})
	}
	jobs := []struct{ tenant, id string }{{"qb", "qb3"}, {"qb", "qb4"}, {"qa", "qa3"}, {"qa", "qa4"}}
	for _, j := range jobs {
		r := job(j.id, 1, "any")
		r.Pool = "l4"
		r.Run.Duration = contracts.Duration(20 * time.Minute)
		r.Run.Checkpoint = j.id == "qa3"
		h.submit(j.tenant, r)
	}
	h.cycle()
	allocs := map[string]contracts.Allocation{}
	for _, j := range jobs {
		allocs[j.id] = h.item(j.tenant, j.id)
		h.running(allocs[j.id])
	}
	// A job of a third tenant waits for a GPU.
	other := job("qc1", 1, "any")
	other.Pool = "l4"
	h.submit("qc", other)
	h.cycle()

	h.now = h.now.Add(time.Minute)
	qbh := job("qbh2", 2, "any")
	qbh.Pool, qbh.Priority = "l4", contracts.PriorityHigh
	qbh.Run.Duration = contracts.Duration(20 * time.Minute)
	h.submit("qb", qbh)
	h.cycle()
	want := []string{allocs["qb3"].ID, allocs["qb4"].ID}
	if got := h.preempted(); !slices.Equal(slices.Sorted(slices.Values(got)), want) {
		t.Fatalf("evicted %v, want qb's own jobs %v", got, want)
	}

	// The first victim stops: its GPU is held for qbh2, not given to
	// qb3's next attempt nor to qc1.
	h.stopped(allocs["qb3"])
	if ev := h.last("qb", "qb3"); ev.Type != contracts.EventRequeued {
		t.Fatalf("qb3 after its stop: %+v", ev)
	}
	if res := h.cycle(); res.Placed != 0 {
		t.Fatalf("the freed GPU went to another job: %+v", res.Plans)
	}
	h.stopped(allocs["qb4"])
	h.cycle()
	items := h.items("qb", "qbh2", 1)
	if len(items) != 1 {
		t.Fatalf("qbh2 not placed once its victims stopped: %v; pending %+v", items, h.st.jobs[Key("qb", "qbh2")].Pending)
	}
	if got, want := devicesOf(items[0]), devicesOf(allocs["qb3"], allocs["qb4"]); !slices.Equal(got, want) {
		t.Fatalf("qbh2 runs on %v, want its victims' devices %v", got, want)
	}
	h.running(items[0])
	for range 3 {
		h.cycle()
	}
	if got := h.preempted(); len(got) != 2 {
		t.Fatalf("%d evictions for one 2-GPU job: %v", len(got), got)
	}
	h.noDuplicates()
}

// Issue 18, section 2: a critical job of 8 GPUs evicts a normal and a
// best-effort job (priority class first) rather than one high job, and
// the requeued normal job does not then evict the best-effort job the
// decision kept: two evictions, not three.
func TestPreemptionPrefersLowerClassesAndDoesNotCascade(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MinRuntime = 0 })
	h.inventory("n1", "p", h100, 81920, 8)
	h.inventory("n2", "p", h100, 81920, 8)
	h.inventory("n3", "p", h100, 81920, 8)
	type spec struct {
		id   string
		gpus int
		pri  contracts.Priority
	}
	// n1: one high job of 8; n2: a normal and a best-effort job of 4;
	// n3: a best-effort job of 4 beside a critical one of 4.
	specs := []spec{{"h", 8, contracts.PriorityHigh}, {"nrm", 4, contracts.PriorityNormal}, {"be", 4, contracts.PriorityBestEffort},
		{"be2", 4, contracts.PriorityBestEffort}, {"crit0", 4, contracts.PriorityCritical}}
	allocs := map[string]contracts.Allocation{}
	for _, s := range specs {
		r := job(s.id, s.gpus, "any")
		r.Priority = s.pri
		r.Run.Duration = contracts.Duration(time.Hour)
		h.submit("a", r)
		h.cycle()
		allocs[s.id] = h.item("a", s.id)
		h.running(allocs[s.id])
	}
	nodeOf := func(id string) string { return allocs[id].NodeID }
	if nodeOf("nrm") != nodeOf("be") || nodeOf("be2") != nodeOf("crit0") || nodeOf("h") == nodeOf("nrm") || nodeOf("h") == nodeOf("be2") {
		t.Fatalf("setup: placements %v", allocs)
	}

	h.now = h.now.Add(time.Minute)
	c := job("c", 8, "any")
	c.Priority = contracts.PriorityCritical
	c.Run.Duration = contracts.Duration(time.Hour)
	h.submit("b", c)
	h.cycle()
	want := []string{allocs["be"].ID, allocs["nrm"].ID}
	slices.Sort(want)
	if got := h.preempted(); !slices.Equal(slices.Sorted(slices.Values(got)), want) {
		t.Fatalf("evicted %v, want the normal and best-effort jobs %v", got, want)
	}
	h.stopped(allocs["nrm"])
	h.cycle()
	h.stopped(allocs["be"])
	h.cycle()
	items := h.items("b", "c", 1)
	if len(items) != 1 || !slices.Equal(devicesOf(items[0]), devicesOf(allocs["nrm"], allocs["be"])) {
		t.Fatalf("c placed %v, want on its victims' devices", items)
	}
	h.running(items[0])
	for range 3 {
		h.cycle()
	}
	// nrm's next attempt (normal) could evict be2 (best-effort) on n3:
	// the decision kept be2, so it waits.
	if got := h.preempted(); len(got) != 2 {
		t.Fatalf("%d evictions, want 2: %v", len(got), got)
	}
	if j, _ := h.st.Job("a", "nrm"); j.State != contracts.StateQueued || j.Attempt != 2 {
		t.Fatalf("nrm: %s attempt %d", j.State, j.Attempt)
	}
	// Once c ends, nrm gets its devices back without evicting anyone.
	h.ended(items[0], contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now, EndedAt: h.now})
	h.release(items[0], contracts.ReasonRunEnded, nil)
	h.cycle()
	if len(h.items("a", "nrm", 2)) != 1 {
		t.Fatalf("nrm not placed after c ended: %+v", h.st.jobs[Key("a", "nrm")].Pending)
	}
	if got := h.preempted(); len(got) != 2 {
		t.Fatalf("%d evictions, want 2: %v", len(got), got)
	}
	h.noDuplicates()
}

// A preemptor that gives up (cancelled) or whose claim can no longer be
// used (its node cordoned) releases what was held for it: the devices go
// to the next job, and nothing is held for nobody.
func TestPreemptionClaimEndsWhenThePreemptorGivesUp(t *testing.T) {
	for _, how := range []string{"cancelled", "node cordoned"} {
		t.Run(how, func(t *testing.T) {
			h := newHarness(t, func(c *Config) { c.MinRuntime = 0 })
			h.inventory("n1", "p", h100, 81920, 4)
			low := job("low", 4, "any")
			low.Priority = contracts.PriorityBestEffort
			h.submit("a", low)
			h.cycle()
			la := h.item("a", "low")
			h.running(la)
			high := job("high", 4, "any")
			high.Priority = contracts.PriorityHigh
			h.submit("b", high)
			h.cycle()
			if got := h.preempted(); !slices.Equal(got, []string{la.ID}) {
				t.Fatalf("evicted %v, want %s", got, la.ID)
			}
			if len(h.st.cluster.claims) != 1 {
				t.Fatalf("claims %v, want high's", h.st.cluster.claims)
			}
			w := job("w", 2, "any")
			h.submit("c", w)
			h.cycle()
			if len(h.items("c", "w", 1)) != 0 {
				t.Fatal("w was placed on devices claimed for high")
			}
			switch how {
			case "cancelled":
				if err := h.cancel("b", "high"); err != nil {
					t.Fatal(err)
				}
			default:
				h.st.ApplyNodeAdmin("n1", &contracts.NodeAdmin{NodeID: "n1", Cordoned: true})
			}
			h.stopped(la)
			h.cycle()
			if len(h.st.cluster.claims) != 0 {
				t.Fatalf("claims %v held after the preemptor gave up", h.st.cluster.claims)
			}
			if how == "cancelled" {
				if len(h.items("c", "w", 1)) != 1 {
					t.Fatalf("w not placed once high was cancelled: %+v", h.st.jobs[Key("c", "w")].Pending)
				}
				return
			}
			if len(h.items("b", "high", 1)) != 0 {
				t.Fatal("high placed on a cordoned node")
			}
			h.st.ApplyNodeAdmin("n1", nil)
			h.cycle()
			if len(h.items("b", "high", 1)) != 1 {
				t.Fatalf("high not placed once n1 took work again: %+v", h.st.jobs[Key("b", "high")].Pending)
			}
			if got := h.preempted(); len(got) != 1 {
				t.Fatalf("evicted %v, want only low", got)
			}
		})
	}
}
