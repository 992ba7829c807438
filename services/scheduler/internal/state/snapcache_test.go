package state

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestNodeSnapshotsFollowEveryChange: nodeSnapshot keeps each node's last
// snapshot until the node changes. After each step that changes a node
// (a plan assumed, a refusal of an unknown device that sits out until its
// backoff expires, a commit, a release, a cordon, a lost and returned
// node, a new inventory) a cycle's snapshot equals one built afresh, and a
// device refused as unknown is offered again once the backoff passed (the
// expiry changes the node inside the snapshot itself).
func TestNodeSnapshotsFollowEveryChange(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", "A100-80GB", 81920, 2)
	h.inventory("n2", "p", "A100-80GB", 81920, 2)
	same := func(step string) {
		t.Helper()
		now := h.now
		cached := h.st.cluster.snapshot(now)
		h.st.cluster.noSnapCache = true
		fresh := h.st.cluster.snapshot(now)
		h.st.cluster.noSnapCache = false
		if diff := cmp.Diff(fresh, cached); diff != "" {
			t.Fatalf("%s: cached snapshot differs (-fresh +cached):\n%s", step, diff)
		}
	}
	same("inventories")
	h.submit("a", job("j1", 2, "A100-80GB"))
	h.cycle()
	same("assumed")
	items := h.items("a", "j1", 1)
	if len(items) != 1 {
		t.Fatalf("j1 planned as %+v", items)
	}
	refused := items[0]
	h.refuse(refused, contracts.RefusedUnknownDevice)
	same("refused as unknown")
	h.cycle()
	same("suspect devices")
	if got := h.items("a", "j1", 1); len(got) != 2 || got[1].NodeID == refused.NodeID {
		t.Fatalf("during the backoff j1 should go to the other node: %+v", got)
	}
	other := h.items("a", "j1", 1)[1]
	h.refuse(other, contracts.RefusedCommitConflict)
	h.now = h.now.Add(suspectBackoff + time.Second)
	h.cycle()
	same("backoff passed")
	if got := h.items("a", "j1", 1); len(got) != 3 {
		t.Fatalf("after the backoff j1 should be planned again: %+v", got)
	}
	last := h.items("a", "j1", 1)[2]
	h.commit(last)
	same("committed")
	h.release(last, contracts.ReasonRunEnded, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded, EndedAt: h.now})
	same("released")
	h.fact(func(s *Store) []Publish {
		s.ApplyNodeAdmin("n1", &contracts.NodeAdmin{NodeID: "n1", Cordoned: true, Reason: "test"})
		return nil
	})
	same("cordoned")
	h.nodeEvent("n2", contracts.NodeLost)
	same("lost")
	h.nodeEvent("n2", contracts.NodeReturned)
	same("returned")
	h.inventory("n2", "p", "A100-80GB", 81920, 4)
	same("new inventory")
	if snap := h.st.cluster.snapshot(h.now); len(snap.Nodes) != 2 || len(snap.Nodes[1].GPUs) != 4 {
		t.Fatalf("snapshot after a new inventory: %+v", snap.Nodes)
	}
}
