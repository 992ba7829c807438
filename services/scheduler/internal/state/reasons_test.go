package state

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// The tests of this file are issue 18's "reasons that are true": what a
// waiting or refused job is told must be current, name the real cause and
// count only what concerns it.

// pendings lists the messages of a job's pending events, in order.
func (h *harness) pendings(tenant, jobID string) []string {
	var out []string
	for _, p := range h.events {
		if p.ev.Tenant == tenant && p.ev.JobID == jobID && p.ev.Type == contracts.EventPending {
			out = append(out, string(p.ev.Reason)+": "+p.ev.Message)
		}
	}
	return out
}

// TestPendingMessageStaysCurrent: a reservation's "in 2m" must not be
// read long after; a message whose facts changed is published again with
// the same code, at most once per PendingRefreshInterval, and a wait
// already over never reads "in 0s".
func TestPendingMessageStaysCurrent(t *testing.T) {
	h := newHarness(t)
	h.inventory("l4-1", "l4", "L4", 23034, 4)
	runFor(h, "qa", "lmid", 2, 3*time.Minute)
	h.submit("qa", job("BIGL", 4, "any"))
	h.cycle()
	first := h.pendings("qa", "BIGL")
	if len(first) != 1 || !strings.Contains(first[0], "(in 3m)") {
		t.Fatalf("first pending events %q, want one with the reservation in 3m", first)
	}
	h.now = h.now.Add(30 * time.Second)
	h.cycle()
	if got := h.pendings("qa", "BIGL"); len(got) != 1 {
		t.Fatalf("republished inside the refresh interval: %q", got)
	}
	h.now = h.now.Add(PendingRefreshInterval)
	h.cycle()
	got := h.pendings("qa", "BIGL")
	if len(got) != 2 || !strings.HasPrefix(got[1], string(contracts.PendingInsufficientGPUs)) || !strings.Contains(got[1], "(in 2m)") {
		t.Fatalf("after the refresh interval %q, want a second event saying in 2m", got)
	}
	h.now = h.now.Add(5 * time.Minute) // lmid is past its expected end
	h.cycle()
	got = h.pendings("qa", "BIGL")
	if last := got[len(got)-1]; strings.Contains(last, "in 0s") || !strings.Contains(last, "from now") {
		t.Errorf("a reservation due now reads %q", last)
	}
	h.cycle()
	if again := h.pendings("qa", "BIGL"); len(again) != len(got) {
		t.Errorf("an unchanged reason was published again: %q", again[len(got):])
	}
}

// TestAheadCountsOnlyJobsOfTheSamePool: an L4 share job is not behind the
// same tenant's MIG jobs, which can only run in another pool.
func TestAheadCountsOnlyJobsOfTheSamePool(t *testing.T) {
	h := newHarness(t)
	migNode(h, "a100-1", "a100", 8)
	h.inventory("l4-1", "l4", "L4", 23034, 1)
	runFor(h, "other", "hog", 1, time.Hour)
	for i := range 5 {
		req := job(fmt.Sprintf("m%d", i), 1, "any")
		req.Resources.GPU.MIGProfile = "1g.10gb"
		h.submit("qa", req)
	}
	sh := job("share", 1, "any")
	sh.Resources.GPU.Share = &contracts.GPUShare{MemoryMiB: 8192, ComputePercent: 30}
	h.submit("qa", sh)
	wl := job("whole", 1, "L4")
	h.submit("qa", wl)
	h.cycle()
	j, _ := h.st.Job("qa", "share")
	if !strings.Contains(j.Pending.Message, "; 0 jobs ahead in queue qa") {
		t.Errorf("share job: %q, want 0 jobs ahead (the 5 MIG jobs are elsewhere)", j.Pending.Message)
	}
	j, _ = h.st.Job("qa", "whole")
	if !strings.Contains(j.Pending.Message, "; 1 job ahead in queue qa") {
		t.Errorf("whole L4 job: %q, want 1 job ahead (the share)", j.Pending.Message)
	}
}

// TestImpossibleRequestsAreSaidAtOnce: host capacity no machine has is
// unsatisfiable in the first pending event; a share larger than any card
// is rejected at submit with its own reason; a dependency on a rejected
// job says so.
func TestImpossibleRequestsAreSaidAtOnce(t *testing.T) {
	h := newHarness(t)
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: "l4-1", Pool: "l4", Incarnation: "i1", Time: h.now,
		CPUMilli: 48_000, MemoryMiB: 192 << 10}
	for i := range 4 {
		inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: fmt.Sprintf("l4-1-gpu%d", i), Model: "L4", MemoryMiB: 23034, Healthy: true})
	}
	h.fact(func(s *Store) []Publish { s.ApplyInventory(inv); return nil })

	cores := job("cores", 1, "any")
	cores.Resources.CPUMilli = 100_000
	h.submit("qa", cores)
	h.cycle()
	if got := h.types("qa", "cores"); !slices.Equal(got, []string{"queued", "pending:" + string(contracts.ReasonUnsatisfiable)}) {
		t.Errorf("100 cores on 48-core hosts: events %v, want unsatisfiable at once", got)
	}

	big := job("big-share", 1, "any")
	big.Resources.GPU.Share = &contracts.GPUShare{MemoryMiB: 30 << 10, ComputePercent: 50}
	h.submit("qa", big)
	ev := h.last("qa", "big-share")
	if ev.Type != contracts.EventRejected || ev.Reason != contracts.ReasonShareTooLarge || !strings.Contains(ev.Message, "L4 with 23034 MiB") {
		t.Errorf("a 30 GiB share on 23 GiB L4s: %+v", ev)
	}
	fits := job("fits", 1, "any")
	fits.Resources.GPU.Share = &contracts.GPUShare{MemoryMiB: 20 << 10, ComputePercent: 50}
	if sub := h.submit("qa", fits); sub.Outcome != "queued" {
		t.Errorf("a 20 GiB share on 23 GiB L4s: %s", sub.Outcome)
	}

	bad := job("bad", 1, "any")
	bad.Priority = "urgent"
	h.submit("qa", bad)
	dep := job("after", 1, "any")
	dep.DependsOn = []string{"bad"}
	h.submit("qa", dep)
	ev = h.last("qa", "after")
	if ev.Type != contracts.EventRejected || ev.Reason != contracts.ReasonDependencyRejected || !strings.Contains(ev.Message, "was rejected (unknown_priority)") {
		t.Errorf("a dependency on a rejected job: %+v", ev)
	}
}

// TestEveryPreemptorShowsItsPreemptingStep: the preempting step is
// published when it begins, even right after another pending event of the
// same cycle (the spacing of pending events hid it for some preemptors).
func TestEveryPreemptorShowsItsPreemptingStep(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MinRuntime = 0 })
	h.inventory("n1", "p", "H100-80GB", 81920, 4)
	low := job("low", 4, "any")
	low.Priority = contracts.PriorityBestEffort
	h.submit("a", low)
	h.cycle()
	la := h.item("a", "low")
	h.commit(la)
	h.started(la, h.now)
	high := job("high", 4, "any")
	high.Priority = contracts.PriorityHigh
	h.submit("b", high)
	h.cycle()
	if len(h.commandsFor(la.ID)) == 0 {
		t.Fatal("no victim was stopped")
	}
	if got := h.types("b", "high"); !slices.Contains(got, "pending:"+string(contracts.PendingPreempting)) {
		t.Errorf("preemptor events %v: no preempting step", got)
	}
}

// TestWaitingJobSaysWhenPreemptionMakesRoom: a job that preemption will
// serve once its victim passes the minimum run time is told so, and when,
// at once; a job whose tenant holds its guarantee is told it cannot
// reclaim from other tenants.
func TestWaitingJobSaysWhenPreemptionMakesRoom(t *testing.T) {
	t.Run("minimum run time", func(t *testing.T) {
		h := newHarness(t, func(c *Config) { c.MinRuntime = 5 * time.Minute })
		h.inventory("n1", "p", "H100-80GB", 81920, 4)
		low := job("low", 4, "any")
		low.Priority = contracts.PriorityBestEffort
		low.Run.Duration = contracts.Duration(time.Hour)
		h.submit("a", low)
		h.cycle()
		la := h.item("a", "low")
		h.commit(la)
		h.started(la, h.now)
		h.now = h.now.Add(time.Minute)
		high := job("high", 4, "any")
		high.Priority = contracts.PriorityHigh
		h.submit("b", high)
		h.cycle()
		want := "preemption makes room when a/low passes the minimum run time of 5m0s, at 2026-01-02T03:09:05Z (in 4m)"
		got := h.pendings("b", "high")
		if len(got) == 0 || !strings.Contains(got[len(got)-1], want) {
			t.Fatalf("high's pending events %q, want the last to say %q", got, want)
		}
		h.now = h.now.Add(4 * time.Minute)
		h.cycle()
		if len(h.commandsFor(la.ID)) == 0 {
			t.Fatal("the victim was not stopped once past its minimum run time")
		}
		if j, _ := h.st.Job("b", "high"); j.Pending.Code != contracts.PendingPreempting || strings.Contains(j.Pending.Message, "makes room when") {
			t.Errorf("high once preempting: %+v", j.Pending)
		}
	})
	// The note names the pool whether the quota names it or is "*" (every
	// pool) and whether the job names its pool or not.
	for _, tc := range []struct{ name, quotaPool, jobPool string }{
		{"at its guarantee", "l4", "l4"},
		{"at its guarantee, quota for every pool", contracts.QuotaAllPools, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(c *Config) { c.MinRuntime = 0 })
			h.inventory("l4-1", "l4", "L4", 23034, 4)
			h.st.ApplyQuota("qa", &contracts.TenantQuota{Pools: map[string]contracts.PoolQuota{tc.quotaPool: {Guarantee: 2}}})
			runFor(h, "qa", "qa1", 2, time.Hour)
			runFor(h, "qb", "qb1", 2, time.Hour) // borrowed: qb has no guarantee
			more := job("qa2", 1, "any")
			more.Priority = contracts.PriorityBestEffort
			more.Pool = tc.jobPool
			h.submit("qa", more)
			h.cycle()
			j, _ := h.st.Job("qa", "qa2")
			if want := "tenant qa cannot reclaim from other tenants (2 GPUs held of a guarantee of 2 in pool l4"; !strings.Contains(j.Pending.Message, want) {
				t.Errorf("qa2 pending %q, want it to say %q", j.Pending.Message, want)
			}
		})
	}
}
