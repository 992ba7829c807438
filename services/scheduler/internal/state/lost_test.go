package state

import (
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestLostRunRequeuesWhateverTheTiming: one fault, a node agent dying with
// its runs, reaches the scheduler in two shapes depending only on how long
// the agent was away. Longer than the heartbeat timeout: the resource
// manager releases the allocation node_lost (and the agent, back, may
// report the run with that reason). Shorter: the new agent reports the run
// ended, failed with reason agent_restarted, and the resource manager
// releases it run_ended carrying that result, before or after the fact
// reaches the scheduler. Every shape must requeue the job as the next
// attempt (the agent restores its latest checkpoint there), never fail it,
// and the next attempt must be placed once.
func TestLostRunRequeuesWhateverTheTiming(t *testing.T) {
	restarted := func(h *harness, a contracts.Allocation) contracts.RunResult {
		return contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: -1, StartedAt: h.now, EndedAt: h.now,
			Reason: contracts.ReasonAgentRestart, Message: "the node agent restarted while the run was running"}
	}
	lost := func(h *harness, a contracts.Allocation) contracts.RunResult {
		return contracts.RunResult{Outcome: contracts.OutcomeFailed, StartedAt: h.now, EndedAt: h.now,
			Reason: contracts.ReasonNodeLost, Message: "node " + a.NodeID + " stopped sending heartbeats"}
	}
	tests := map[string]struct {
		facts  func(h *harness, a contracts.Allocation)
		reason contracts.Reason
	}{
		"agent away longer than the heartbeat timeout": {func(h *harness, a contracts.Allocation) {
			r := lost(h, a)
			h.release(a, contracts.ReasonNodeLost, &r)
			h.ended(a, r)
		}, contracts.ReasonNodeLost},
		"agent back sooner, run fact first": {func(h *harness, a contracts.Allocation) {
			r := restarted(h, a)
			h.ended(a, r)
			h.release(a, contracts.ReasonRunEnded, &r)
		}, contracts.ReasonAgentRestart},
		"agent back sooner, release first": {func(h *harness, a contracts.Allocation) {
			r := restarted(h, a)
			h.release(a, contracts.ReasonRunEnded, &r)
			h.ended(a, r)
		}, contracts.ReasonAgentRestart},
		"agent back sooner, release without its result": {func(h *harness, a contracts.Allocation) {
			h.release(a, contracts.ReasonRunEnded, nil)
			h.ended(a, restarted(h, a))
		}, contracts.ReasonAgentRestart},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			h := newHarness(t)
			h.inventory("n1", "p", h100, 81920, 1)
			h.inventory("n2", "p", h100, 81920, 1)
			req := job("j1", 1, h100)
			req.Run.Checkpoint = true
			h.submit("acme", req)
			a := h.cycle().Plans[0].Items[0]
			h.commit(a)
			h.started(a, h.now)
			h.checkpointed(a, "step-100", false)
			tc.facts(h, a)
			e := h.last("acme", "j1")
			if e.Type != contracts.EventRequeued || e.Attempt != 2 || e.Reason != tc.reason {
				t.Fatalf("after the run was lost: %s attempt %d reason %s; want requeued attempt 2 for %s (events %v)",
					e.Type, e.Attempt, e.Reason, tc.reason, h.types("acme", "j1"))
			}
			b := h.cycle().Plans[0].Items[0]
			if b.ID != "acme/j1/2" || b.Attempt != 2 {
				t.Fatalf("next attempt planned as %+v", b)
			}
			h.commit(b)
			if diff := cmp.Diff([]string{"queued", "scheduled", "running", "requeued", "scheduled"}, h.types("acme", "j1")); diff != "" {
				t.Fatalf("events (-want +got):\n%s", diff)
			}
			h.noDuplicates()
		})
	}
}

// TestLostRunOfACancelledJobIsCancelled: a job cancelled while its agent
// was away ends cancelled whichever way the loss is reported, not failed.
func TestLostRunOfACancelledJobIsCancelled(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", h100, 81920, 1)
	h.submit("acme", job("j1", 1, h100))
	a := h.cycle().Plans[0].Items[0]
	h.commit(a)
	h.started(a, h.now)
	if err := h.cancel("acme", "j1"); err != nil {
		t.Fatal(err)
	}
	r := contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: -1, StartedAt: h.now, EndedAt: h.now,
		Reason: contracts.ReasonAgentRestart}
	h.ended(a, r)
	h.release(a, contracts.ReasonRunEnded, &r)
	if e := h.last("acme", "j1"); e.Type != contracts.EventCancelled {
		t.Fatalf("cancelled job whose run was lost ended %s (%s), want cancelled (events %v)", e.Type, e.Reason, h.types("acme", "j1"))
	}
}

// TestLostGangPartRequeuesTheGang: one machine of a gang loses its run to
// an agent restart; the other part is stopped (gang_incomplete) and the
// whole gang is requeued as the next attempt, as for a lost node.
func TestLostGangPartRequeuesTheGang(t *testing.T) {
	h := newHarness(t)
	parts := gangOf2(h)
	for _, p := range parts {
		h.commit(p)
		h.started(p, h.now)
	}
	lost := contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: -1, StartedAt: h.now, EndedAt: h.now,
		Reason: contracts.ReasonAgentRestart}
	h.ended(parts[0], lost)
	h.release(parts[0], contracts.ReasonRunEnded, &lost)
	if stops := h.commandsFor(parts[1].ID); len(stops) != 1 || stops[0].Reason != contracts.ReasonGangIncomplete {
		t.Fatalf("the surviving part got %+v, want one gang_incomplete stop", stops)
	}
	h.ended(parts[1], contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonGangIncomplete, StartedAt: h.now, EndedAt: h.now})
	h.release(parts[1], contracts.ReasonGangIncomplete, nil)
	if e := h.last("a", "g"); e.Type != contracts.EventRequeued || e.Attempt != 2 || e.Reason != contracts.ReasonAgentRestart {
		t.Fatalf("gang after a part was lost: %s attempt %d reason %s (events %v)", e.Type, e.Attempt, e.Reason, h.types("a", "g"))
	}
}
