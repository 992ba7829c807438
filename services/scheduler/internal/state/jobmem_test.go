package state

import (
	"encoding/json"
	"testing"
	"time"
	"unsafe"

	"github.com/gpuplane/gpuplane/contracts"
)

// decoded is a as the store reads it off the ALLOCATIONS stream: a copy
// of its own, no text shared with the plan's.
func decoded(t *testing.T, a contracts.Allocation) contracts.Allocation {
	t.Helper()
	var out contracts.Allocation
	if err := json.Unmarshal(mustJSON(t, a), &out); err != nil {
		t.Fatal(err)
	}
	return out
}

// A committed part shares the cluster's allocation, and that is the plan
// item the store assumed when the ledger's entry equals it (its own copy
// of what the ledger says otherwise); the values are the ledger's either
// way, and a release leaves the part's allocation as it was.
func TestCommittedPartSharesOneAllocation(t *testing.T) {
	tests := []struct {
		name    string
		change  func(*contracts.Allocation)
		assumed bool // the assumed item is kept
	}{
		{name: "as planned", change: func(*contracts.Allocation) {}, assumed: true},
		{name: "traced as published", change: func(a *contracts.Allocation) {
			a.TraceParent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
		}, assumed: true},
		{name: "ledger differs", change: func(a *contracts.Allocation) { a.CPUMilli++ }},
		{name: "other plan", change: func(a *contracts.Allocation) { a.PlanID = "another-plan" }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			h.inventory("n1", "p", h100, 81920, 8)
			h.submit("acme", job("j1", 2, h100))
			a := h.cycle().Plans[0].Items[0]
			assumed := h.st.cluster.plans[a.ID]
			if assumed == nil {
				t.Fatal("the plan item is not assumed")
			}
			e := decoded(t, a)
			tt.change(&e)
			h.commit(e)
			j := h.st.jobs[Key("acme", "j1")]
			held := h.st.cluster.allocs[a.ID]
			if held == nil || j.parts[0].alloc != held || h.st.cluster.nodes["n1"].held[a.ID] != held {
				t.Fatalf("part %p, cluster %p, node %p: want one allocation", j.parts[0].alloc, held,
					h.st.cluster.nodes["n1"].held[a.ID])
			}
			if (held == assumed) != tt.assumed {
				t.Errorf("kept the assumed item: %t, want %t", held == assumed, tt.assumed)
			}
			if got, want := mustJSON(t, *held), mustJSON(t, e); string(got) != string(want) {
				t.Errorf("committed %s\nwant the ledger's %s", got, want)
			}
			h.started(e, h.now)
			h.release(e, contracts.ReasonRunEnded, &contracts.RunResult{Outcome: contracts.OutcomeSucceeded,
				StartedAt: h.now, EndedAt: h.now.Add(time.Minute)})
			if _, ok := h.st.cluster.allocs[a.ID]; ok {
				t.Error("released allocation still held")
			}
			if e := h.last("acme", "j1"); e.Type != contracts.EventSucceeded {
				t.Errorf("last event %s, want succeeded", e.Type)
			}
		})
	}
}

// Jobs of one tenant share its name and their requests' repeated texts,
// and the request is the one decoded (same hash: a resubmit of the same
// body is still unchanged).
func TestRequestTextsAreInterned(t *testing.T) {
	h := newHarness(t)
	r := job("j1", 1, h100)
	r.Pool, r.Priority, r.Run.Image = "p", contracts.PriorityHigh, "registry.example/train:1"
	h.submit("acme", r)
	r2 := r
	r2.ID = "j2"
	h.submit("acme", r2)
	j1, j2 := h.st.jobs[Key("acme", "j1")], h.st.jobs[Key("acme", "j2")]
	same := func(a, b string) bool { return len(a) > 0 && unsafe.StringData(a) == unsafe.StringData(b) }
	for _, c := range []struct {
		what string
		a, b string
	}{
		{"tenant", j1.Tenant, j2.Tenant},
		{"request tenant", j1.Request.Tenant, j2.Tenant},
		{"pool", j1.Request.Pool, j2.Request.Pool},
		{"priority", string(j1.Request.Priority), string(j2.Request.Priority)},
		{"model", j1.Request.Resources.GPU.Model, j2.Request.Resources.GPU.Model},
		{"image", j1.Request.Run.Image, j2.Request.Run.Image},
	} {
		if !same(c.a, c.b) {
			t.Errorf("%s: %q and %q are two copies", c.what, c.a, c.b)
		}
	}
	if sub := h.submit("acme", r); sub.Outcome != "unchanged" {
		t.Errorf("resubmit of the same body: %s, want unchanged", sub.Outcome)
	}
	if n := len(h.st.names.m); n == 0 || n > 16 {
		t.Errorf("%d interned texts", n)
	}
	// The job's ID and its request's are its key's text, submitted and
	// rebuilt from the events alike.
	for _, phase := range []string{"submitted", "rebuilt"} {
		if phase == "rebuilt" {
			h.restart()
		}
		for _, j := range []*Job{h.st.jobs[Key("acme", "j1")], h.st.jobs[Key("acme", "j2")]} {
			if id := j.key[len(j.Tenant)+1:]; !same(j.ID, id) || !same(j.Request.ID, id) {
				t.Errorf("%s %s: ID and request ID are not the key's text", phase, j.key)
			}
		}
	}
	if sub := h.submit("acme", r); sub.Outcome != "unchanged" {
		t.Errorf("resubmit after the rebuild: %s, want unchanged", sub.Outcome)
	}
}

// A job's moves record goes with the attempt unless what it holds
// outlives it (the last move until migrated, nodes to avoid and kept work
// until the next attempt commits), and with the job's end.
func TestMovesRecordGoesWithTheAttempt(t *testing.T) {
	tests := []struct {
		name string
		set  func(*jobMoves)
		kept bool
	}{
		{"none", nil, false},
		{"evicted", func(m *jobMoves) { m.evictMsg, m.evictAt, m.victims = "x", time.Now(), []string{"v"} }, false},
		{"waiting note", func(m *jobMoves) { m.note = "soon" }, false},
		{"moved", func(m *jobMoves) { m.moved = &contracts.Migration{} }, true},
		{"avoid", func(m *jobMoves) { m.avoid = map[string]bool{"n1": true} }, true},
		{"kept", func(m *jobMoves) { m.kept = &kept{} }, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newBenchStore()
			j := &Job{Tenant: "acme", ID: "j1", key: Key("acme", "j1"), State: contracts.StateQueued, Attempt: 1}
			if tt.set != nil {
				tt.set(j.movesW())
			}
			s.resetAttempt(j, 2)
			if (j.mv != nil) != tt.kept {
				t.Fatalf("record kept: %t, want %t", j.mv != nil, tt.kept)
			}
			if j.mv != nil && (j.mv.evictMsg != "" || j.mv.victims != nil || j.mv.note != "" || !j.mv.evictAt.IsZero()) {
				t.Errorf("the attempt's fields stayed: %+v", *j.mv)
			}
			s.finish(j)
			if j.mv != nil {
				t.Error("an ended job keeps its moves record")
			}
			if j.moves() != &noMoves {
				t.Error("a job without a record reads another")
			}
		})
	}
}
