package state

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// The tests of this file are issue 18's reproductions of reservations:
// they hold across cycles and releases, a backfilled job that overruns its
// promise is stopped when the reservation comes due, and a reservation
// holds only the devices its job needs.

// runFor submits a 1-machine job of gpus GPUs that runs d, places it, and
// commits and starts it; it returns its allocation.
func runFor(h *harness, tenant, id string, gpus int, d time.Duration) contracts.Allocation {
	h.t.Helper()
	req := job(id, gpus, "any")
	req.Run.Duration = contracts.Duration(d)
	h.submit(tenant, req)
	h.cycle()
	a := h.item(tenant, id)
	h.commit(a)
	h.started(a, h.now)
	return a
}

// TestReservationHoldsWhenABackfilledJobEnds is issue 18's reproduction on
// pool l4 (4 × L4): lmid (2 GPUs, 2 m) runs, BIGL (4 GPUs) is reserved for
// lmid's end, lok (1 GPU, 1 m) backfills, lno (1 GPU, 10 m) waits. When lok
// ends, lno must keep waiting: it would run 8 minutes into BIGL's
// reservation. It must also when its run fact comes before its release
// (the finished job's allocation is then no longer running anything), and
// when fair share ranks lno's tenant ahead of BIGL's once lok is gone.
func TestReservationHoldsWhenABackfilledJobEnds(t *testing.T) {
	tests := map[string]struct {
		tenants            [4]string // lmid, BIGL, lok, lno
		cycleBeforeRelease bool
	}{
		"one tenant": {[4]string{"qa", "qa", "qa", "qa"}, false},
		"one tenant, a cycle between end and release": {[4]string{"qa", "qa", "qa", "qa"}, true},
		"lno's tenant ranks first after the release":  {[4]string{"qa", "qa", "qb", "qb"}, false},
		"both": {[4]string{"qa", "qa", "qb", "qb"}, true},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			h := newHarness(t)
			h.inventory("l4-1", "l4", "L4", 23034, 4)
			runFor(h, tc.tenants[0], "lmid", 2, 2*time.Minute)
			big := job("BIGL", 4, "any")
			big.Run.Duration = contracts.Duration(5 * time.Minute)
			h.submit(tc.tenants[1], big)
			h.cycle()
			if j, _ := h.st.Job(tc.tenants[1], "BIGL"); !strings.Contains(j.Pending.Message, "capacity reserved on l4-1") {
				t.Fatalf("BIGL has no reservation: %+v", j.Pending)
			}
			lok := runFor(h, tc.tenants[2], "lok", 1, time.Minute)
			lno := job("lno", 1, "any")
			lno.Run.Duration = contracts.Duration(10 * time.Minute)
			h.submit(tc.tenants[3], lno)
			h.cycle()
			if j, _ := h.st.Job(tc.tenants[3], "lno"); j.Pending.Code != contracts.PendingReservedForOther {
				t.Fatalf("lno pending %+v, want %s", j.Pending, contracts.PendingReservedForOther)
			}
			h.now = h.now.Add(time.Minute)
			h.ended(lok, contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now.Add(-time.Minute), EndedAt: h.now})
			if tc.cycleBeforeRelease {
				h.cycle()
			}
			h.release(lok, contracts.ReasonRunEnded, nil)
			h.cycle()
			h.now = h.now.Add(10 * time.Second)
			h.cycle()
			if got := h.items(tc.tenants[3], "lno", 1); len(got) != 0 {
				t.Fatalf("lno was placed on %s, into BIGL's reservation", got[0].NodeID)
			}
			if j, _ := h.st.Job(tc.tenants[3], "lno"); j.Pending.Code != contracts.PendingReservedForOther {
				t.Errorf("lno pending %+v, want %s", j.Pending, contracts.PendingReservedForOther)
			}
		})
	}
}

// TestBackfilledJobPastItsPromiseIsStopped: expectedRunTime is a promise.
// lok said it runs 1 minute and took a GPU held for BIGL on that promise;
// it still runs when lmid ends and BIGL's reservation comes due, so it is
// checkpointed (it can), stopped and requeued with a reason that says so,
// and BIGL starts on the whole machine.
func TestBackfilledJobPastItsPromiseIsStopped(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.PreemptGrace = 20 * time.Second })
	h.inventory("l4-1", "l4", "L4", 23034, 4)
	lmid := runFor(h, "qa", "lmid", 2, 2*time.Minute)
	big := job("BIGL", 4, "any")
	big.Run.Duration = contracts.Duration(5 * time.Minute)
	h.submit("qa", big)
	h.cycle()
	lokReq := job("lok", 1, "any")
	lokReq.ExpectedRunTime = contracts.Duration(time.Minute)
	lokReq.Run.Duration = contracts.Duration(30 * time.Minute) // the promise is wrong
	lokReq.Run.Checkpoint = true
	h.submit("qa", lokReq)
	ok := job("early", 1, "any") // ends on time: never stopped
	ok.ExpectedRunTime = contracts.Duration(time.Minute)
	h.submit("qa", ok)
	h.cycle()
	lok, early := h.item("qa", "lok"), h.item("qa", "early")
	for _, a := range []contracts.Allocation{lok, early} {
		h.commit(a)
		h.started(a, h.now)
	}
	h.now = h.now.Add(90 * time.Second)
	h.cycle()
	if len(h.commandsFor(lok.ID)) != 0 {
		t.Fatal("lok was stopped before the reservation came due")
	}
	h.ended(early, contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now, EndedAt: h.now})
	h.release(early, contracts.ReasonRunEnded, nil)
	h.now = h.now.Add(30 * time.Second)
	h.ended(lmid, contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now, EndedAt: h.now})
	h.release(lmid, contracts.ReasonRunEnded, nil)
	h.cycle()
	cmds := h.commandsFor(lok.ID)
	if len(cmds) != 1 || cmds[0].Kind != contracts.CommandCheckpointRun || cmds[0].Reason != contracts.ReasonRunTimeExceeded {
		t.Fatalf("lok commands when BIGL's reservation came due: %+v", cmds)
	}
	h.checkpointed(lok, "ckpt-1", true)
	cmds = h.commandsFor(lok.ID)
	if len(cmds) != 2 || cmds[1].Kind != contracts.CommandStopRun || cmds[1].Reason != contracts.ReasonRunTimeExceeded ||
		cmds[1].GracePeriod.D() != 20*time.Second {
		t.Fatalf("lok commands after its checkpoint: %+v", cmds)
	}
	h.ended(lok, contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonRunTimeExceeded, StartedAt: h.now, EndedAt: h.now})
	h.release(lok, contracts.ReasonRunTimeExceeded, nil)
	ev := h.last("qa", "lok")
	if ev.Type != contracts.EventRequeued || ev.Reason != contracts.ReasonRunTimeExceeded ||
		!strings.Contains(ev.Message, "ran past its expected run time of 1m0s") || !strings.Contains(ev.Message, "BIGL") {
		t.Fatalf("lok's event: %+v", ev)
	}
	h.cycle()
	if got := h.items("qa", "BIGL", 1); len(got) != 1 || len(got[0].Devices) != 4 {
		t.Fatalf("BIGL not placed on the whole machine: %+v", got)
	}
	if len(h.commandsFor(early.ID)) != 0 {
		t.Error("a job that kept its promise was stopped")
	}
	h.noDuplicates()
}

// migNode is a machine of 8 A100-80GB: the first mig of them in MIG mode
// with seven 1g.10gb instances each.
func migNode(h *harness, id, pool string, mig int) {
	h.t.Helper()
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: id, Pool: pool, Incarnation: "i1", Time: h.now}
	for i := range 8 {
		g := contracts.GPUInfo{Index: i, UUID: fmt.Sprintf("%s-gpu%d", id, i), Model: "A100-80GB", MemoryMiB: 81920, Healthy: true}
		if i < mig {
			g.MIGEnabled = true
			for s := range 7 {
				g.MIGInstances = append(g.MIGInstances, contracts.MIGInstance{UUID: fmt.Sprintf("MIG-%s-%d-%d", id, i, s),
					Profile: "1g.10gb", GIID: s + 1, Start: s, Size: 1, MemoryMiB: 9728})
			}
		}
		inv.GPUs = append(inv.GPUs, g)
	}
	h.fact(func(s *Store) []Publish { s.ApplyInventory(inv); return nil })
}

// TestReservationHoldsOnlyWhatItsJobNeeds is issue 18's MIG reproduction:
// with a job reserved for all the whole cards of a MIG machine, waiting
// 1g.10gb jobs of unknown run time take the idle MIG slices rather than
// wait behind reserved_for_job_ahead; and a long whole-card job takes a
// card the reserved job does not need, but none that it does.
func TestReservationHoldsOnlyWhatItsJobNeeds(t *testing.T) {
	h := newHarness(t)
	migNode(h, "a100-1", "a100", 2) // 14 1g slices, 6 whole cards
	long := job("long", 4, "any")
	long.Run.Duration = contracts.Duration(10 * time.Minute)
	h.submit("qa", long)
	h.cycle()
	la := h.item("qa", "long")
	h.commit(la)
	h.started(la, h.now)
	h.submit("qa", job("wide", 5, "any")) // reserved: 2 free cards + 3 of long's
	h.cycle()
	if j, _ := h.st.Job("qa", "wide"); !strings.Contains(j.Pending.Message, "capacity reserved on a100-1") {
		t.Fatalf("wide has no reservation: %+v", j.Pending)
	}
	for i := range 10 {
		req := job(fmt.Sprintf("slice%d", i), 1, "any")
		req.Resources.GPU.MIGProfile = "1g.10gb"
		req.Run.Duration = 0 // unknown run time: respects every reservation
		req.Run.Command = []string{"train"}
		req.Run.Image = "acme/train:v1" // a container: the default pool runs images only
		if sub := h.submit("qa", req); sub.Outcome != "queued" {
			t.Fatalf("slice%d: %s %+v", i, sub.Outcome, h.last("qa", req.ID))
		}
	}
	// greedy would fit the two free cards but for the one held; hog, after
	// it, takes the other.
	greedy := job("greedy", 2, "any")
	greedy.Run.Duration = contracts.Duration(time.Hour)
	h.submit("qa", greedy)
	hog := job("hog", 1, "any")
	hog.Run.Duration = contracts.Duration(time.Hour)
	h.submit("qa", hog)
	h.cycle()
	for i := range 10 {
		if len(h.items("qa", fmt.Sprintf("slice%d", i), 1)) != 1 {
			j, _ := h.st.Job("qa", fmt.Sprintf("slice%d", i))
			t.Fatalf("slice%d not placed on a free MIG slice: %+v", i, j.Pending)
		}
	}
	hogItems := h.items("qa", "hog", 1)
	if len(hogItems) != 1 {
		j, _ := h.st.Job("qa", "hog")
		t.Fatalf("hog not placed on the card wide does not need: %+v", j.Pending)
	}
	if len(h.items("qa", "greedy", 1)) != 0 {
		t.Fatal("greedy took a card held for wide")
	}
	j, _ := h.st.Job("qa", "greedy")
	if j.Pending.Code != contracts.PendingReservedForOther {
		t.Errorf("greedy pending %+v, want %s", j.Pending, contracts.PendingReservedForOther)
	}
	// wide still starts when long ends: its five cards are free then.
	h.ended(la, contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: h.now, EndedAt: h.now})
	h.release(la, contracts.ReasonRunEnded, nil)
	h.cycle()
	if len(h.items("qa", "wide", 1)) != 1 {
		j, _ := h.st.Job("qa", "wide")
		t.Fatalf("wide not placed when long ended: %+v", j.Pending)
	}
}
