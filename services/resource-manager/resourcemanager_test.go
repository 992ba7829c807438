package resourcemanager_test

import (
	"flag"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	resourcemanager "github.com/gpuplane/gpuplane/services/resource-manager"
)

const (
	h100 = "H100-80GB"
	a100 = "A100-80GB"
)

func TestPlanCommitsFittingItemsAndRefusesTheRest(t *testing.T) {
	h := newHarness(t)
	h.start(h.config("rm-a"))
	h.ready(h100, 4, "n1")
	h.ready(a100, 2, "n2")

	// A poison plan first: dead-lettered, and the next plan still flows.
	if _, err := h.bus.PublishRaw(t.Context(), contracts.SubjectPlan("sched-test"), "plan/garbage", []byte("{not json")); err != nil {
		t.Fatal(err)
	}
	forged := item("forged", 1, "n1", h100, 3)
	forged.ID = "acme/someone-else/1"
	p1 := []contracts.Allocation{
		item("j1", 1, "n1", h100, 0, 1),
		item("j2", 1, "n1", h100, 1),                  // GPU 1 just went to j1
		item("j3", 1, "n9", h100, 0),                  // no such node
		item("j4", 1, "n1", h100, 7),                  // no such GPU
		item("j5", 1, "n2", h100, 0),                  // n2 has A100s
		item("j6", 1, "n2", a100, 0),                  // fits
		forged,                                        // ID not derived from tenant/job/attempt
		item("j7", 1, "n1", h100, 2),                  // fits after refusals
		{ID: "x", Tenant: "Bad.Tenant", NodeID: "n1"}, // unanswerable: refused in the log only
	}
	h.plan("p1", p1...)
	want := map[string]contracts.Reason{
		"acme/j2/1":           contracts.RefusedDeviceTaken,
		"acme/j3/1":           contracts.RefusedUnknownNode,
		"acme/j4/1":           contracts.RefusedUnknownDevice,
		"acme/j5/1":           contracts.RefusedModelMismatch,
		"acme/someone-else/1": contracts.RefusedInvalidPlan,
	}
	// Items on different nodes are settled independently, in no set
	// order: wait for every answer, refusals included.
	h.eventually("p1 settled", func() bool {
		for id := range want {
			if _, ok := h.refusal("p1", id); !ok {
				return false
			}
		}
		return h.has("acme/j1/1", contracts.LedgerCommitted) && h.has("acme/j6/1", contracts.LedgerCommitted) &&
			h.has("acme/j7/1", contracts.LedgerCommitted) && h.deadPlans == 1
	})
	h.locked(func() {
		got := map[string]contracts.Reason{}
		for _, r := range h.refusals {
			if r.PlanID == "p1" {
				got[r.AllocationID] = r.Reason
				if r.Tenant != "acme" || r.NodeID == "" || r.Message == "" {
					t.Errorf("refusal %+v lacks tenant, node or message", r)
				}
			}
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("refusals of p1 (-want +got):\n%s", diff)
		}
		j1 := h.entriesFor("acme/j1/1", contracts.LedgerCommitted)[0].entry
		if j1.Allocation.PlanID != "p1" || j1.Allocation.Scheduler != "sched-test" || j1.Allocation.NodeID != "n1" {
			t.Errorf("committed entry %+v does not carry plan, scheduler and node", j1.Allocation)
		}
	})

	// A redelivered (here: republished) item is a no-op; another attempt of
	// a live job and the same allocation ID elsewhere are refused.
	h.plan("p2",
		item("j1", 1, "n1", h100, 1, 0), // identical to the committed one, devices reordered
		item("j1", 2, "n1", h100, 3),    // attempt 1 is live
		item("j6", 1, "n1", h100, 3),    // acme/j6/1 is committed on n2
		item("j8", 1, "n1", h100, 3),
	)
	h.eventually("p2 settled", func() bool { return h.has("acme/j8/1", contracts.LedgerCommitted) })
	h.locked(func() {
		if n := len(h.entriesFor("acme/j1/1", contracts.LedgerCommitted)); n != 1 {
			t.Errorf("acme/j1/1 committed %d times, want once", n)
		}
		if r, ok := h.refusal("p2", "acme/j1/1"); ok {
			t.Errorf("identical re-commit refused: %+v", r)
		}
		for id, want := range map[string]contracts.Reason{"acme/j1/2": contracts.RefusedAlreadyPlaced, "acme/j6/1": contracts.RefusedAlreadyPlaced} {
			if r, ok := h.refusal("p2", id); !ok || r.Reason != want {
				t.Errorf("p2 %s: refusal %+v (found %v), want %s", id, r, ok, want)
			}
		}
		// Ledger entries sit on their node's subject with a CAS chain:
		// sequences strictly grow per node.
		last := map[string]uint64{}
		for _, r := range h.entries {
			n := r.entry.Allocation.NodeID
			if r.seq <= last[n] {
				t.Errorf("ledger of %s goes back: %d after %d", n, r.seq, last[n])
			}
			last[n] = r.seq
		}
	})
}

func TestRunEndReleases(t *testing.T) {
	h := newHarness(t)
	h.start(h.config("rm-a"))
	h.ready(h100, 4, "n1", "n2")
	a1, a2, a3 := item("j1", 1, "n1", h100, 0, 1), item("j2", 1, "n1", h100, 2), item("j3", 1, "n2", h100, 0)
	h.plan("p1", a1, a2, a3)
	h.eventually("commits", func() bool { return h.has(a3.ID, contracts.LedgerCommitted) })

	start := h.clock.Now()
	h.runEvent("n1", contracts.RunStarted, a1, nil, "")
	ok1 := &contracts.RunResult{Outcome: contracts.OutcomeSucceeded, StartedAt: start, EndedAt: start.Add(time.Minute)}
	h.runEvent("n1", contracts.RunEnded, a1, ok1, "")
	// The same fact again under another message ID: released once.
	h.runEvent("n1", contracts.RunEnded, a1, ok1, "again")
	cancelled := &contracts.RunResult{Outcome: contracts.OutcomeCancelled, ExitCode: 143, EndedAt: start.Add(time.Second),
		Reason: contracts.ReasonCancelled}
	h.runEvent("n1", contracts.RunEnded, a2, cancelled, "")
	// A node reporting the end of another node's allocation is ignored;
	// the real end follows on the holder's subject.
	h.runEvent("n1", contracts.RunEnded, a3, &contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: 66}, "forged")
	h.runEvent("n2", contracts.RunEnded, a3, &contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: 1}, "")
	// Releases run beside the follow, n1's one after the other and n2's
	// beside them (ReleaseParallelism): a3's, on n2, may be stored before
	// a2's, so each is waited for.
	h.eventually("releases", func() bool {
		return h.has(a1.ID, contracts.LedgerReleased) && h.has(a2.ID, contracts.LedgerReleased) &&
			h.has(a3.ID, contracts.LedgerReleased)
	})

	h.locked(func() {
		for id, want := range map[string]struct {
			reason contracts.Reason
			run    *contracts.RunResult
		}{
			a1.ID: {contracts.ReasonRunEnded, ok1},
			a2.ID: {contracts.ReasonCancelled, cancelled},
			a3.ID: {contracts.ReasonRunEnded, &contracts.RunResult{Outcome: contracts.OutcomeFailed, ExitCode: 1}},
		} {
			rel := h.entriesFor(id, contracts.LedgerReleased)
			if len(rel) != 1 {
				t.Errorf("%s released %d times, want once", id, len(rel))
				continue
			}
			e := rel[0].entry
			if e.Reason != want.reason {
				t.Errorf("%s released with reason %q, want %q", id, e.Reason, want.reason)
			}
			if diff := cmp.Diff(want.run, e.Run); diff != "" {
				t.Errorf("%s release run result (-want +got):\n%s", id, diff)
			}
			if len(e.Allocation.Devices) == 0 || e.Allocation.NodeID == "" {
				t.Errorf("%s release does not carry the allocation: %+v", id, e.Allocation)
			}
		}
	})

	// The released GPUs are free again.
	h.plan("p2", item("j9", 1, "n1", h100, 0, 1, 2))
	h.eventually("reuse", func() bool { return h.has("acme/j9/1", contracts.LedgerCommitted) })
}

func TestNodeLostReleasesAndReturns(t *testing.T) {
	h := newHarness(t)
	h.start(h.config("rm-a"))
	h.ready(h100, 2, "n1")
	a0, a1 := item("j0", 1, "n1", h100, 1), item("j1", 1, "n1", h100, 0)
	h.plan("p1", a0, a1)
	h.eventually("commit", func() bool { return h.has(a1.ID, contracts.LedgerCommitted) })
	startedAt := h.clock.Now()
	h.runEvent("n1", contracts.RunStarted, a1, nil, "")
	// Run facts are handled in order: once a0's end is released, a1's
	// start has been seen.
	h.runEvent("n1", contracts.RunEnded, a0, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded}, "")
	h.eventually("a0 released", func() bool { return h.has(a0.ID, contracts.LedgerReleased) })

	// n2 registers 2 s later than n1 and keeps sending heartbeats: the
	// feed flows (a gap of the whole feed would restart n1's clock, see
	// liveness), only n1 is silent.
	h.clock.Advance(2 * time.Second)
	h.ready(h100, 2, "n2")
	h.plan("p1b", item("j2", 1, "n2", h100, 0))
	h.eventually("commit on n2", func() bool { return h.has("acme/j2/1", contracts.LedgerCommitted) })
	for range 10 {
		h.clock.Advance(500 * time.Millisecond)
		h.heartbeatFed("n2", "i1")
	}
	h.clock.Advance(time.Second) // n1 silent 8 s > 6 s; n2 1 s
	// A probe of the stream that fails under load holds judgment, and the
	// feed's return restarts every clock (judgeFeed): time must go on, n2
	// heartbeating, until n1 is judged.
	h.eventuallyAdvancing("n1 lost and its allocation released", func() { h.heartbeatFed("n2", "i1") }, func() bool {
		return h.hasNodeEvent("n1", contracts.NodeLost, "i1") && h.has(a1.ID, contracts.LedgerReleased)
	})
	h.locked(func() {
		e := h.entriesFor(a1.ID, contracts.LedgerReleased)[0].entry
		if e.Reason != contracts.ReasonNodeLost || e.Run == nil || e.Run.Outcome != contracts.OutcomeFailed ||
			e.Run.Reason != contracts.ReasonNodeLost || !e.Run.StartedAt.Equal(startedAt) || e.Run.EndedAt.IsZero() {
			t.Errorf("node_lost release = %+v run %+v; want reason node_lost, outcome failed, started %v", e, e.Run, startedAt)
		}
		if h.hasNodeEvent("n2", contracts.NodeLost, "") {
			t.Error("n2 declared lost although it sent a heartbeat 1 s ago")
		}
		if h.has("acme/j2/1", contracts.LedgerReleased) {
			t.Error("n2's allocation released")
		}
	})

	// A lost node takes no new allocation.
	h.plan("p2", item("j4", 1, "n1", h100, 1))
	h.eventually("refusal", func() bool { _, ok := h.refusal("p2", "acme/j4/1"); return ok })
	h.locked(func() {
		if r, _ := h.refusal("p2", "acme/j4/1"); r.Reason != contracts.RefusedNodeNotReady {
			t.Errorf("plan on a lost node refused with %q, want node_not_ready", r.Reason)
		}
	})

	// The same agent comes back: returned, and usable.
	h.heartbeat("n1", "i1")
	h.eventually("returned", func() bool { return h.hasNodeEvent("n1", contracts.NodeReturned, "i1") })
	h.plan("p3", item("j4", 1, "n1", h100, 0, 1))
	h.eventually("commit on the returned node", func() bool { return h.has("acme/j4/1", contracts.LedgerCommitted) })

	// Lost again, then a new agent process: registered with its incarnation.
	h.clock.Advance(7 * time.Second)
	h.eventuallyAdvancing("lost again", func() { h.heartbeatFed("n2", "i1") }, func() bool {
		return h.countNodeEvents("n1", contracts.NodeLost, "") == 2 && h.has("acme/j4/1", contracts.LedgerReleased)
	})
	h.heartbeat("n1", "i2")
	h.eventually("registered i2", func() bool { return h.hasNodeEvent("n1", contracts.NodeRegistered, "i2") })
	h.locked(func() {
		if n := h.countNodeEvents("n1", contracts.NodeRegistered, "i1"); n != 1 {
			t.Errorf("n1 registered %d times with i1, want once", n)
		}
	})
}

func TestRestartRebuildsAndKeepsRefusing(t *testing.T) {
	h := newHarness(t)
	first := h.start(h.config("rm-a"))
	h.ready(h100, 4, "n1")
	a1, a2 := item("j1", 1, "n1", h100, 0, 1), item("j2", 1, "n1", h100, 2)
	h.plan("p1", a1, a2)
	h.eventually("commits", func() bool { return h.has(a2.ID, contracts.LedgerCommitted) })
	first.stop()

	// While no manager runs: a2's run ends, a new plan arrives, and an
	// hour passes without heartbeats being heard.
	h.runEvent("n1", contracts.RunEnded, a2, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded}, "")
	h.plan("p2",
		item("k1", 1, "n1", h100, 1),    // a1 still holds GPU 1
		item("k2", 1, "n1", h100, 2),    // a2's GPU, released by the rebuild before plans
		a1,                              // already committed: no-op
		item("j1", 1, "n1", h100, 3),    // a1's ID elsewhere
		item("k3", 1, "n1", h100, 3, 0), // GPU 0 is a1's
	)
	h.clock.Advance(time.Hour)

	h.start(h.config("rm-a"))
	h.eventually("p2 settled", func() bool {
		_, ok := h.refusal("p2", "acme/k3/1")
		return ok && h.has("acme/k2/1", contracts.LedgerCommitted)
	})
	h.locked(func() {
		want := map[string]contracts.Reason{"acme/k1/1": contracts.RefusedDeviceTaken,
			"acme/j1/1": contracts.RefusedAlreadyPlaced, "acme/k3/1": contracts.RefusedDeviceTaken}
		got := map[string]contracts.Reason{}
		for _, r := range h.refusals {
			if r.PlanID == "p2" {
				got[r.AllocationID] = r.Reason
			}
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("refusals after restart (-want +got):\n%s", diff)
		}
		if n := len(h.entriesFor(a1.ID, contracts.LedgerCommitted)); n != 1 {
			t.Errorf("a1 committed %d times", n)
		}
		if n := len(h.entriesFor(a2.ID, contracts.LedgerReleased)); n != 1 {
			t.Errorf("a2 released %d times, want once", n)
		}
		// k2 committed proves n1 was still ready after an hour of
		// silence: the new life gave it a grace period, and the check
		// it ran before the first plan found nothing lost.
		if h.hasNodeEvent("n1", contracts.NodeLost, "") {
			t.Error("n1 declared lost right after the restart")
		}
		if n := h.countNodeEvents("n1", contracts.NodeRegistered, ""); n != 1 {
			t.Errorf("n1 registered %d times across the restart, want once", n)
		}
	})
	// The grace period ends like any other.
	h.clock.Advance(7 * time.Second)
	h.eventually("lost after the grace period", func() bool {
		return h.hasNodeEvent("n1", contracts.NodeLost, "i1") && h.has(a1.ID, contracts.LedgerReleased)
	})
}

// A previous life declared n1 lost and stopped before releasing its
// allocations: the next one finishes the job before handling plans.
func TestRestartReleasesWhatALostNodeStillHolds(t *testing.T) {
	h := newHarness(t)
	first := h.start(h.config("rm-a"))
	h.ready(h100, 2, "n1")
	a1 := item("j1", 1, "n1", h100, 0)
	h.plan("p1", a1)
	h.eventually("commit", func() bool { return h.has(a1.ID, contracts.LedgerCommitted) })
	first.stop()
	h.publish(contracts.SubjectNodeLifecycle("n1"), "node/lost/n1/crashed",
		contracts.NodeEvent{SchemaVersion: 1, Kind: contracts.NodeLost, NodeID: "n1", Pool: "default", Incarnation: "i1", Time: h.clock.Now()})
	h.plan("p2", item("j2", 1, "n1", h100, 1))

	h.start(h.config("rm-a"))
	h.eventually("p2 answered", func() bool { _, ok := h.refusal("p2", "acme/j2/1"); return ok })
	h.locked(func() {
		rel := h.entriesFor(a1.ID, contracts.LedgerReleased)
		if len(rel) != 1 || rel[0].entry.Reason != contracts.ReasonNodeLost {
			t.Errorf("a1 releases = %+v, want one with node_lost before the next plan", rel)
		}
		if r, _ := h.refusal("p2", "acme/j2/1"); r.Reason != contracts.RefusedNodeNotReady {
			t.Errorf("plan on the lost node refused with %q, want node_not_ready", r.Reason)
		}
	})
}

func TestConfigValidateReportsEverything(t *testing.T) {
	if err := resourcemanager.DefaultConfig().Validate(); err != nil {
		t.Fatalf("defaults invalid: %v", err)
	}
	c := resourcemanager.DefaultConfig()
	c.Bus.NATSURL = ""
	c.Name = "a.b"
	c.HeartbeatTimeout = time.Second
	c.LivenessInterval = 2 * time.Second
	c.CommitAttempts = 0
	c.PlanBatch = -1
	err := c.Validate()
	if err == nil {
		t.Fatal("invalid config accepted")
	}
	for _, want := range []string{"nats URL", "name", "liveness interval", "commit attempts", "plan batch"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Validate() = %q, missing %q", err, want)
		}
	}
	if err := resourcemanager.Run(t.Context(), c, nil); err == nil || !strings.Contains(err.Error(), "invalid config") {
		t.Errorf("Run with an invalid config = %v", err)
	}
	var zero resourcemanager.Config
	if errs := zero.Validate(); errs == nil || len(unwrapAll(errs)) < 4 {
		t.Errorf("zero config: %v, want every problem", errs)
	}
}

// TestFailpointFromEnvironment: GPUPLANE_FAILPOINT arms one of the
// resource manager's failpoints; another service's value arms nothing; an
// "rm-" value that names none is a configuration error, not a drill that
// silently tests nothing.
func TestFailpointFromEnvironment(t *testing.T) {
	tests := map[string]struct {
		env     string
		want    resourcemanager.Failpoint
		invalid bool
	}{
		"unset":                  {env: ""},
		"after verify":           {env: "rm-after-verify", want: resourcemanager.FailAfterVerify},
		"after commit":           {env: "rm-after-commit", want: resourcemanager.FailAfterCommit},
		"another service's":      {env: "scheduler-after-plan"},
		"a misspelt one of ours": {env: "rm-after-verfy", want: "rm-after-verfy", invalid: true},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			t.Setenv(resourcemanager.EnvFailpoint, tc.env)
			c := resourcemanager.DefaultConfig()
			if c.Failpoint != tc.want {
				t.Errorf("Failpoint = %q, want %q", c.Failpoint, tc.want)
			}
			err := c.Validate()
			if (err != nil) != tc.invalid || tc.invalid && !strings.Contains(err.Error(), "failpoint") {
				t.Errorf("Validate() = %v, want invalid %v", err, tc.invalid)
			}
		})
	}
}

func unwrapAll(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

func TestConfigFlags(t *testing.T) {
	c := resourcemanager.DefaultConfig()
	fs := flag.NewFlagSet("rm", flag.ContinueOnError)
	c.RegisterFlags(fs)
	if err := fs.Parse([]string{"-heartbeat-timeout=9s", "-liveness-interval=1s", "-name=rm-2", "-nats=nats://x:4222"}); err != nil {
		t.Fatal(err)
	}
	if c.HeartbeatTimeout != 9*time.Second || c.LivenessInterval != time.Second || c.Name != "rm-2" || c.Bus.NATSURL != "nats://x:4222" {
		t.Errorf("flags not applied: %+v", c)
	}
	if err := c.Validate(); err != nil {
		t.Errorf("valid flags rejected: %v", err)
	}
}

// TestRedeliveredPlanKeepsItsRefusals: a plan redelivered after some of its
// items were refused (a crash after the refusal, a transient failure of
// another item) must not commit those items now that they would fit: the
// scheduler already took the refusal as the answer. Also after a restart.
func TestRedeliveredPlanKeepsItsRefusals(t *testing.T) {
	h := newHarness(t)
	first := h.start(h.config("rm-a"))
	h.ready(h100, 2, "n1")
	holder, late := item("j1", 1, "n1", h100, 0), item("j2", 1, "n1", h100, 0)
	h.plan("p1", holder)
	h.eventually("holder committed", func() bool { return h.has(holder.ID, contracts.LedgerCommitted) })
	h.plan("p2", late)
	h.eventually("late refused", func() bool { _, ok := h.refusal("p2", late.ID); return ok })
	h.runEvent("n1", contracts.RunEnded, holder, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded}, "")
	h.eventually("holder released", func() bool { return h.has(holder.ID, contracts.LedgerReleased) })

	redeliver := func(id, marker string) {
		t.Helper()
		// The same plan again under a new message ID (past the duplicate
		// window), then a marker plan: plans are handled in order, so once
		// the marker commits the redelivery has been handled.
		h.publish(contracts.SubjectPlan("sched-test"), id,
			contracts.Plan{SchemaVersion: 1, ID: "p2", Scheduler: "sched-test", Time: h.clock.Now(), Items: []contracts.Allocation{late}})
		m := item(marker, 1, "n1", h100, 1)
		h.plan(marker, m)
		h.eventually("marker "+marker, func() bool { return h.has(m.ID, contracts.LedgerCommitted) })
		h.locked(func() {
			if h.has(late.ID, contracts.LedgerCommitted) {
				t.Fatalf("%s: a refused item was committed on redelivery", id)
			}
		})
		h.runEvent("n1", contracts.RunEnded, m, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded}, "")
		h.eventually("marker released", func() bool { return h.has(m.ID, contracts.LedgerReleased) })
	}
	redeliver("plan/p2-again", "m1")
	first.stop()
	h.start(h.config("rm-a"))
	redeliver("plan/p2-after-restart", "m2")
}
