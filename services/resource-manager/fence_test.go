package resourcemanager_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// plannedAt publishes a plan of scheduler "sched-test" stamped with epoch.
func (h *harness) plannedAt(id string, epoch uint64, items ...contracts.Allocation) {
	h.t.Helper()
	h.publish(contracts.SubjectPlan("sched-test"), "plan/"+id, contracts.Plan{SchemaVersion: 1, ID: id,
		Scheduler: "sched-test", Epoch: epoch, Time: h.clock.Now(), Items: items})
}

func TestStaleEpochPlansAreRefused(t *testing.T) {
	h := newHarness(t)
	h.start(h.config("rm-a"))
	h.ready(h100, 4, "n1")

	// No lease has ever existed: an epoch-0 plan (a single scheduler
	// without election) still commits.
	h.plan("p0", item("j0", 1, "n1", h100, 0))
	h.eventually("p0 committed", func() bool { return h.has("acme/j0/1", contracts.LedgerCommitted) })

	// Epoch 3 leads: its first plan commits and fences out the rest, in
	// order (each is answered before the next is sent).
	tests := []struct {
		plan  string
		epoch uint64
		job   string
		gpu   int
		want  contracts.Reason // "" = committed
	}{
		{"current", 3, "j3", 3, ""},
		{"stale", 2, "j1", 1, contracts.RefusedStaleEpoch},
		{"no-epoch", 0, "j2", 2, contracts.RefusedStaleEpoch},
	}
	for _, tc := range tests {
		h.plannedAt(tc.plan, tc.epoch, item(tc.job, 1, "n1", h100, tc.gpu))
		id := contracts.AllocationID("acme", tc.job, 1)
		h.eventually(tc.plan+" answered", func() bool {
			_, refused := h.refusal(tc.plan, id)
			return refused || h.has(id, contracts.LedgerCommitted)
		})
		r, refused := h.refusal(tc.plan, id)
		switch {
		case tc.want == "" && refused:
			t.Errorf("plan %s (epoch %d) refused: %s", tc.plan, tc.epoch, r.Message)
		case tc.want != "" && !refused:
			t.Errorf("plan %s (epoch %d) committed; want %s", tc.plan, tc.epoch, tc.want)
		case tc.want != "" && (r.Reason != tc.want || r.Message == ""):
			t.Errorf("plan %s refused with %s %q; want %s and a message", tc.plan, r.Reason, r.Message, tc.want)
		}
	}

	// A newer epoch takes over: epoch 3 is stale from then on.
	h.plannedAt("newer", 5, item("j4", 1, "n1", h100, 2))
	h.eventually("newer committed", func() bool { return h.has("acme/j4/1", contracts.LedgerCommitted) })
	h.plannedAt("older", 3, item("j5", 1, "n1", h100, 1))
	h.eventually("older refused", func() bool {
		r, ok := h.refusal("older", "acme/j5/1")
		return ok && r.Reason == contracts.RefusedStaleEpoch
	})
}

func TestLeaseInBucketFencesBeforeFirstPlan(t *testing.T) {
	// The lease exists before the RM starts: it reads the bucket before
	// it consumes any plan, so the first epoch-1 and epoch-0 plans are
	// already refused.
	h := newHarness(t)
	kv, err := h.bus.KeyValue(t.Context(), contracts.BucketLeases)
	if err != nil {
		t.Fatal(err)
	}
	lease, _ := json.Marshal(contracts.Lease{SchemaVersion: 1, Holder: "b", Epoch: 2, Expires: time.Now().Add(time.Minute)})
	if _, err := kv.Put(t.Context(), contracts.LeaseKeyScheduler("sched-test"), lease); err != nil {
		t.Fatal(err)
	}
	h.start(h.config("rm-a"))
	h.ready(h100, 2, "n1")
	h.plannedAt("deposed", 1, item("j1", 1, "n1", h100, 0))
	h.plannedAt("unelected", 0, item("j2", 1, "n1", h100, 1))
	h.plannedAt("leader", 2, item("j3", 1, "n1", h100, 0))
	h.eventually("leader's plan committed", func() bool { return h.has("acme/j3/1", contracts.LedgerCommitted) })
	for plan, id := range map[string]string{"deposed": "acme/j1/1", "unelected": "acme/j2/1"} {
		h.eventually(plan+" refused", func() bool {
			r, ok := h.refusal(plan, id)
			return ok && r.Reason == contracts.RefusedStaleEpoch
		})
		if h.has(id, contracts.LedgerCommitted) {
			t.Errorf("plan %s committed %s", plan, id)
		}
	}
	// A deposed leader's plan for a device its successor holds now is
	// refused as stale too, not as a device in use: plans are decided at
	// once (PlanWorkers), and the answer must not depend on which came
	// first.
	h.plannedAt("deposed-late", 1, item("j4", 1, "n1", h100, 0))
	h.eventually("deposed-late refused", func() bool {
		_, ok := h.refusal("deposed-late", "acme/j4/1")
		return ok
	})
	if r, _ := h.refusal("deposed-late", "acme/j4/1"); r.Reason != contracts.RefusedStaleEpoch {
		t.Errorf("a deposed leader's plan for a held device refused with %s %q; want %s", r.Reason, r.Message, contracts.RefusedStaleEpoch)
	}
}
