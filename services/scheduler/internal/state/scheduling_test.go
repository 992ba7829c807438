package state

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// The tests of this file drive the cycle's scheduling rules through the
// store: gangs all or nothing, dependencies, preemption, quotas and
// reclaim, backfill reservations, drain and cordon.

func (h *harness) commandsFor(allocID string) []contracts.NodeCommand {
	var out []contracts.NodeCommand
	for _, c := range h.commands {
		if c.AllocationID == allocID {
			out = append(out, c)
		}
	}
	return out
}

func (h *harness) items(tenant, jobID string, attempt int) []contracts.Allocation {
	var out []contracts.Allocation
	for _, p := range h.plans {
		for _, it := range p.Items {
			if it.Tenant == tenant && it.JobID == jobID && it.Attempt == attempt {
				out = append(out, it)
			}
		}
	}
	return out
}

func (h *harness) expectState(tenant, jobID string, want contracts.JobState) {
	h.t.Helper()
	st := h.status[Key(tenant, jobID)]
	if st == nil || st.State != want {
		h.t.Fatalf("%s/%s: state %v, want %s; events %v", tenant, jobID, st, want, h.types(tenant, jobID))
	}
}

// succeed commits a and runs it to success.
func succeed(h *harness, a contracts.Allocation) {
	h.commit(a)
	runToSuccess(h, a)
}

// runToSuccess starts a committed allocation's run, ends it succeeded and
// releases it.
func runToSuccess(h *harness, a contracts.Allocation) {
	h.started(a, h.now)
	h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now, EndedAt: h.now})
	h.release(a, contracts.ReasonRunEnded, nil)
}

// twoMachineGang has two nodes of perNode GPUs of model and submits job g
// of tenant a over both; it returns the parts of the first cycle's plan.
func twoMachineGang(h *harness, model string, perNode int) []contracts.Allocation {
	h.t.Helper()
	h.inventory("n1", "p", model, 81920, perNode)
	h.inventory("n2", "p", model, 81920, perNode)
	req := job("g", 2*perNode, model)
	req.Resources.GPU.Nodes = 2
	h.submit("a", req)
	h.cycle()
	return h.items("a", "g", 1)
}

func TestGangIsAllOrNothing(t *testing.T) {
	h := newHarness(t)
	parts := twoMachineGang(h, "H100-80GB", 4)
	if len(parts) != 2 || parts[0].NodeID == parts[1].NodeID {
		t.Fatalf("gang of 2 machines planned as %+v", parts)
	}
	for i, p := range parts {
		if p.ID != contracts.AllocationPartID("a", "g", 1, i) || p.Gang == nil || p.Gang.Rank != i || p.Gang.Size != 2 || len(p.Devices) != 4 {
			t.Fatalf("part %d: %+v", i, p)
		}
	}
	// One part committed, the other refused: no scheduled event; the
	// committed part is stopped and released, then the gang is retried as
	// attempt 2.
	h.commit(parts[0])
	h.refuse(parts[1], contracts.RefusedDeviceTaken)
	if slices.Contains(h.types("a", "g"), "scheduled") {
		t.Fatalf("a gang committed in part was scheduled: %v", h.types("a", "g"))
	}
	stops := h.commandsFor(parts[0].ID)
	if len(stops) != 1 || stops[0].Kind != contracts.CommandStopRun || stops[0].Reason != contracts.ReasonGangIncomplete {
		t.Fatalf("stops for the committed part: %+v", stops)
	}
	if res := h.cycle(); res.Placed != 0 {
		t.Fatal("retried before the committed part was released")
	}
	h.ended(parts[0], contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonGangIncomplete, EndedAt: h.now})
	h.release(parts[0], contracts.ReasonGangIncomplete, nil)
	if ev := h.last("a", "g"); ev.Type != contracts.EventRequeued || ev.Attempt != 2 || ev.Reason != contracts.ReasonGangIncomplete {
		t.Fatalf("after the release: %+v", ev)
	}
	h.cycle()
	parts = h.items("a", "g", 2)
	if len(parts) != 2 {
		t.Fatalf("attempt 2 planned %d parts", len(parts))
	}
	h.commit(parts[0])
	if slices.Contains(h.types("a", "g"), "scheduled") {
		t.Fatal("scheduled before every part committed")
	}
	h.commit(parts[1])
	ev := h.last("a", "g")
	if ev.Type != contracts.EventScheduled || len(ev.Placements) != 2 {
		t.Fatalf("scheduled event: %+v", ev)
	}
	// One machine fails: the other is stopped and the job fails with the
	// failing part's result.
	h.started(parts[0], h.now)
	h.started(parts[1], h.now)
	h.ended(parts[1], contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: 3, StartedAt: h.now, EndedAt: h.now})
	if stops := h.commandsFor(parts[0].ID); len(stops) != 1 || stops[0].Reason != contracts.ReasonGangIncomplete {
		t.Fatalf("the surviving part was not stopped: %+v", stops)
	}
	h.ended(parts[0], contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonGangIncomplete, StartedAt: h.now, EndedAt: h.now})
	if ev := h.last("a", "g"); ev.Type != contracts.EventFailed || ev.ExitCode == nil || *ev.ExitCode != 3 {
		t.Fatalf("gang end: %+v", ev)
	}
	h.noDuplicates()
}

func TestGangSucceedsWhenEveryPartDoes(t *testing.T) {
	h := newHarness(t)
	parts := twoMachineGang(h, "A100-80GB", 2)
	h.commit(parts[0])
	h.commit(parts[1])
	runToSuccess(h, parts[0])
	if h.last("a", "g").Type != contracts.EventRunning {
		t.Fatalf("ended with one part still running: %v", h.types("a", "g"))
	}
	// A part that succeeded does not stop the others: they finish.
	if stops := h.commandsFor(parts[1].ID); len(stops) != 0 {
		t.Fatalf("the part still running was stopped when the other succeeded: %+v", stops)
	}
	runToSuccess(h, parts[1])
	h.expectState("a", "g", contracts.StateSucceeded)
}

func TestDependencies(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", "H100-80GB", 81920, 2)
	withDeps := func(id string, deps ...string) contracts.JobRequest {
		r := job(id, 1, "any")
		r.DependsOn = deps
		return r
	}
	h.submit("a", job("first", 1, "any"))
	h.submit("a", withDeps("second", "first"))
	h.submit("a", withDeps("ghost", "never-submitted"))
	h.submit("b", withDeps("other-tenant", "first"))
	for id, reason := range map[string]contracts.Reason{"ghost": contracts.ReasonUnknownDependency,
		"other-tenant": contracts.ReasonUnknownDependency} {
		tenant := "a"
		if id == "other-tenant" {
			tenant = "b"
		}
		if ev := h.last(tenant, id); ev.Type != contracts.EventRejected || ev.Reason != reason {
			t.Errorf("%s: %+v", id, ev)
		}
	}
	h.cycle()
	if got := h.items("a", "second", 1); len(got) != 0 {
		t.Fatal("a dependent job was placed before its dependency succeeded")
	}
	if j, _ := h.st.Job("a", "second"); j.Pending.Code != contracts.PendingDependencies || !strings.Contains(j.Pending.Message, "first") {
		t.Fatalf("pending: %+v", j.Pending)
	}
	succeed(h, h.item("a", "first"))
	h.cycle()
	if got := h.items("a", "second", 1); len(got) != 1 {
		j, _ := h.st.Job("a", "second")
		t.Fatalf("the dependent job was not placed after its dependency succeeded: %+v %v", j.Pending, h.types("a", "first"))
	}

	// A failed dependency cancels its dependents, transitively.
	h.submit("a", job("flaky", 1, "any"))
	h.submit("a", withDeps("child", "flaky"))
	h.submit("a", withDeps("grandchild", "child"))
	h.cycle()
	a := h.item("a", "flaky")
	h.commit(a)
	h.started(a, h.now)
	h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: 1, StartedAt: h.now, EndedAt: h.now})
	h.cycle()
	h.cycle()
	for _, id := range []string{"child", "grandchild"} {
		if ev := h.last("a", id); ev.Type != contracts.EventCancelled || ev.Reason != contracts.ReasonDependencyFailed {
			t.Errorf("%s: %+v", id, ev)
		}
	}
	h.noDuplicates()
}

func TestPreemptionRequeuesTheVictimWithItsNextAttempt(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MinRuntime = time.Minute; c.PreemptGrace = 20 * time.Second })
	h.inventory("n1", "p", "H100-80GB", 81920, 4)
	low := job("low", 4, "any")
	low.Priority = contracts.PriorityBestEffort
	low.Run.Checkpoint = true
	h.submit("a", low)
	h.cycle()
	la := h.item("a", "low")
	h.commit(la)
	h.started(la, h.now)

	high := job("high", 4, "any")
	high.Priority = contracts.PriorityHigh
	h.submit("b", high)
	h.cycle()
	if len(h.commandsFor(la.ID)) != 0 {
		t.Fatal("a job was preempted before its minimum runtime")
	}
	h.now = h.now.Add(2 * time.Minute)
	h.cycle()
	// Checkpoint first: the stop waits for the checkpoint it asked for,
	// or SIGTERM would cut the checkpoint short.
	if cmds := h.commandsFor(la.ID); len(cmds) != 1 || cmds[0].Kind != contracts.CommandCheckpointRun {
		t.Fatalf("victim commands before its checkpoint: %+v", cmds)
	}
	h.checkpointed(la, "ckpt-1", true)
	cmds := h.commandsFor(la.ID)
	if len(cmds) != 2 || cmds[0].Kind != contracts.CommandCheckpointRun || cmds[1].Kind != contracts.CommandStopRun ||
		cmds[1].Reason != contracts.ReasonPreempted || cmds[1].GracePeriod.D() != 20*time.Second {
		t.Fatalf("victim commands: %+v", cmds)
	}
	if j, _ := h.st.Job("b", "high"); j.Pending.Code != contracts.PendingPreempting {
		t.Fatalf("preemptor pending: %+v", j.Pending)
	}
	// Nothing is placed on the victim's devices until it releases them,
	// and no second victim search happens meanwhile.
	if res := h.cycle(); res.Placed != 0 {
		t.Fatal("placed on devices still held")
	}
	h.ended(la, contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonPreempted, StartedAt: h.now, EndedAt: h.now})
	h.release(la, contracts.ReasonPreempted, nil)
	if ev := h.last("a", "low"); ev.Type != contracts.EventRequeued || ev.Attempt != 2 || ev.Reason != contracts.ReasonPreempted {
		t.Fatalf("victim after its end: %+v", ev)
	}
	h.cycle()
	if len(h.items("b", "high", 1)) != 1 || len(h.items("a", "low", 2)) != 0 {
		t.Fatal("the preemptor did not get the freed devices first")
	}
	h.noDuplicates()
}

func TestQuotaMaxAndReclaim(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.MinRuntime = 0 })
	h.inventory("n1", "p", "H100-80GB", 81920, 4)
	two := 2.0
	h.st.ApplyQuota("capped", &contracts.TenantQuota{Pools: map[string]contracts.PoolQuota{"p": {Max: &two}}})
	for _, id := range []string{"c1", "c2", "c3"} {
		h.submit("capped", job(id, 1, "any"))
	}
	h.cycle()
	placed := len(h.items("capped", "c1", 1)) + len(h.items("capped", "c2", 1)) + len(h.items("capped", "c3", 1))
	if placed != 2 {
		t.Fatalf("placed %d jobs of a tenant with max 2 GPUs", placed)
	}
	j, _ := h.st.Job("capped", "c3")
	if j.Pending.Code != contracts.PendingQuotaExceeded || !strings.Contains(j.Pending.Message, "quota capped/p at 2 of 2 GPUs") {
		t.Fatalf("pending: %+v", j.Pending)
	}
	// Another tenant borrows the rest; the owner of a guarantee reclaims.
	h.submit("borrower", job("bw", 2, "any"))
	h.cycle()
	bw := h.item("borrower", "bw")
	h.commit(bw)
	h.started(bw, h.now)
	for _, id := range []string{"c1", "c2"} {
		a := h.item("capped", id)
		h.commit(a)
		h.started(a, h.now)
	}
	h.st.ApplyQuota("owner", &contracts.TenantQuota{Pools: map[string]contracts.PoolQuota{"p": {Guarantee: 2}}})
	h.submit("owner", job("own", 2, "any"))
	h.cycle()
	cmds := h.commandsFor(bw.ID)
	if len(cmds) != 1 || cmds[0].Reason != contracts.ReasonPreempted {
		j, _ := h.st.Job("owner", "own")
		t.Fatalf("the borrower was not reclaimed from: %+v (all: %+v); owner: %+v", cmds, h.commands, j.Pending)
	}
	h.ended(bw, contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonPreempted, StartedAt: h.now, EndedAt: h.now})
	h.release(bw, contracts.ReasonPreempted, nil)
	h.cycle()
	if len(h.items("owner", "own", 1)) != 1 {
		t.Fatal("the owner did not get its guarantee back")
	}
}

// TestBackfillNeverDelaysTheReservedJob: with reservations, a job that
// would still run when the blocked job's devices free stays off them;
// with none (-max-reservations 0), backfill protects nothing and it runs.
func TestBackfillNeverDelaysTheReservedJob(t *testing.T) {
	tests := []struct {
		name         string
		reservations int
		lengthyRuns  bool
	}{
		{"four reservations", 4, false},
		{"none", 0, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(c *Config) { c.MaxReservations = tc.reservations })
			h.inventory("n1", "p", "H100-80GB", 81920, 4)
			long := job("running", 2, "any")
			long.Run.Duration = contracts.Duration(10 * time.Minute)
			h.submit("a", long)
			h.cycle()
			ra := h.item("a", "running")
			h.commit(ra)
			h.started(ra, h.now)

			big := job("big", 4, "any")
			h.submit("a", big)
			short := job("short", 1, "any")
			short.ExpectedRunTime = contracts.Duration(5 * time.Minute)
			lengthy := job("lengthy", 1, "any")
			lengthy.Run.Duration = contracts.Duration(time.Hour)
			h.submit("a", lengthy)
			h.submit("a", short)
			h.cycle()
			if got := len(h.items("a", "lengthy", 1)) == 1; got != tc.lengthyRuns {
				t.Fatalf("a job longer than the blocked job's wait placed: %v, want %v", got, tc.lengthyRuns)
			}
			if len(h.items("a", "short", 1)) != 1 {
				t.Fatal("a job that ends before the reserved start was not backfilled")
			}
			j, _ := h.st.Job("a", "big")
			if got := strings.Contains(j.Pending.Message, "reserved"); got != (tc.reservations > 0) {
				t.Fatalf("the big job's pending reason mentions a reservation: %v, want %v: %+v", got, tc.reservations > 0, j.Pending)
			}
		})
	}
}

func TestDrainMovesJobsAndCordonKeepsNodesEmpty(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", "H100-80GB", 81920, 2)
	h.submit("a", job("j", 1, "any"))
	h.cycle()
	a := h.item("a", "j")
	h.commit(a)
	h.started(a, h.now)
	h.st.ApplyNodeAdmin("n1", &contracts.NodeAdmin{NodeID: "n1", Cordoned: true, Drain: true, Reason: "maintenance"})
	h.cycle()
	cmds := h.commandsFor(a.ID)
	if len(cmds) != 1 || cmds[0].Reason != contracts.ReasonDrained {
		t.Fatalf("drain commands: %+v", cmds)
	}
	h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonDrained, StartedAt: h.now, EndedAt: h.now})
	h.release(a, contracts.ReasonDrained, nil)
	if ev := h.last("a", "j"); ev.Type != contracts.EventRequeued || ev.Reason != contracts.ReasonDrained {
		t.Fatalf("after drain: %+v", ev)
	}
	h.cycle()
	if len(h.items("a", "j", 2)) != 0 {
		t.Fatal("placed on a cordoned node")
	}
	h.st.ApplyNodeAdmin("n1", nil)
	h.cycle()
	if len(h.items("a", "j", 2)) != 1 {
		t.Fatal("not placed after uncordon")
	}
}

func TestJobsMoveOffAnUnhealthyGPU(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", "H100-80GB", 81920, 2)
	h.submit("a", job("j", 1, "any"))
	h.cycle()
	a := h.item("a", "j")
	h.commit(a)
	h.started(a, h.now)
	// The agent reports the job's GPU unhealthy (an XID): the job is
	// stopped and requeued, and its next attempt goes to the healthy GPU.
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: "n1", Pool: "p", Incarnation: "i1", Time: h.now}
	for i := range 2 {
		inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: fmt.Sprintf("n1-gpu%d", i), Model: "H100-80GB",
			MemoryMiB: 81920, Healthy: fmt.Sprintf("n1-gpu%d", i) != a.Devices[0].UUID})
	}
	h.fact(func(s *Store) []Publish { s.ApplyInventory(inv); return nil })
	h.cycle()
	cmds := h.commandsFor(a.ID)
	if len(cmds) != 1 || cmds[0].Kind != contracts.CommandStopRun || cmds[0].Reason != contracts.ReasonGPUUnhealthy {
		t.Fatalf("commands for the job on the unhealthy GPU: %+v", cmds)
	}
	h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonGPUUnhealthy, StartedAt: h.now, EndedAt: h.now})
	h.release(a, contracts.ReasonGPUUnhealthy, nil)
	if ev := h.last("a", "j"); ev.Type != contracts.EventRequeued || ev.Attempt != 2 || ev.Reason != contracts.ReasonGPUUnhealthy {
		t.Fatalf("after the stop: %+v", ev)
	}
	h.cycle()
	next := h.items("a", "j", 2)
	if len(next) != 1 || next[0].Devices[0].UUID == a.Devices[0].UUID {
		t.Fatalf("attempt 2 planned on %+v, want the healthy GPU", next)
	}
	h.noDuplicates()
}
