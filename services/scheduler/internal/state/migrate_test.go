package state

import (
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// placeRunning places a one-GPU job on n1 (the only node), commits and
// starts it, then adds n2 as the place it can move to.
func placeRunning(h *harness, id string, checkpoint bool) contracts.Allocation {
	h.t.Helper()
	h.inventory("n1", "p", "H100-80GB", 81920, 2)
	req := job(id, 1, "any")
	req.Run.Checkpoint = checkpoint
	h.submit("a", req)
	h.cycle()
	a := h.item("a", id)
	h.commit(a)
	h.started(a, h.now)
	h.inventory("n2", "p", "H100-80GB", 81920, 2)
	return a
}

func kinds(cmds []contracts.NodeCommand) []string {
	var out []string
	for _, c := range cmds {
		out = append(out, string(c.Kind)+":"+string(c.Reason))
	}
	return out
}

// TestMigrationCheckpointsThenMovesAndAnnounces follows every trigger the
// platform moves a job for through the whole protocol: migrating, a
// checkpoint request and nothing else, the stop once the checkpoint is
// reported, the release, the requeue as the next attempt on another node,
// and migrated naming the checkpoint restored.
func TestMigrationCheckpointsThenMovesAndAnnounces(t *testing.T) {
	deadline := time.Date(2026, 1, 2, 3, 6, 5, 0, time.UTC) // the harness clock + 2 min
	tests := []struct {
		name      string
		trigger   func(h *harness, a contracts.Allocation)
		reason    contracts.Reason
		deadline  bool
		wantGrace time.Duration
	}{
		{"spot notice", func(h *harness, a contracts.Allocation) {
			h.st.ApplyNodeAdmin("n1", &contracts.NodeAdmin{NodeID: "n1", Cordoned: true, Drain: true,
				Cause: contracts.ReasonSpotInterruption, Deadline: &deadline, Reason: "reclaimed at 03:06:05", Time: h.now})
		}, contracts.ReasonSpotInterruption, true, 20 * time.Second},
		{"hot GPU", func(h *harness, a contracts.Allocation) {
			h.st.ApplyNodeAdmin("n1", &contracts.NodeAdmin{NodeID: "n1", GPUs: map[string]contracts.GPUHold{
				a.Devices[0].UUID: {Cordoned: true, Drain: true, Cause: contracts.ReasonOverheating, Since: h.now}}})
		}, contracts.ReasonOverheating, false, 20 * time.Second},
		{"unhealthy GPU", func(h *harness, a contracts.Allocation) {
			inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: "n1", Pool: "p", Incarnation: "i1", Time: h.now}
			for i, uuid := range []string{"n1-gpu0", "n1-gpu1"} {
				inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: uuid, Model: "H100-80GB",
					MemoryMiB: 81920, Healthy: uuid != a.Devices[0].UUID})
			}
			h.fact(func(s *Store) []Publish { s.ApplyInventory(inv); return nil })
		}, contracts.ReasonGPUUnhealthy, false, 20 * time.Second},
		{"administrator's drain", func(h *harness, a contracts.Allocation) {
			h.st.ApplyNodeAdmin("n1", &contracts.NodeAdmin{NodeID: "n1", Cordoned: true, Drain: true, Reason: "maintenance"})
		}, contracts.ReasonDrained, false, 20 * time.Second},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(c *Config) { c.PreemptGrace = 20 * time.Second })
			a := placeRunning(h, "j", true)
			h.checkpointed(a, "ckpt-own", false) // one it wrote on its own before
			tc.trigger(h, a)
			h.cycle()
			ev := h.last("a", "j")
			if ev.Type != contracts.EventMigrating || ev.Reason != tc.reason || ev.Migration == nil ||
				!ev.Migration.Checkpoint || ev.Migration.FromAttempt != 1 || len(ev.Migration.From) != 1 ||
				ev.Migration.From[0].NodeID != "n1" || (ev.Migration.Deadline != nil) != tc.deadline {
				t.Fatalf("after the trigger: %+v (migration %+v)", ev, ev.Migration)
			}
			if got := kinds(h.commandsFor(a.ID)); !slices.Equal(got, []string{"checkpoint_run:" + string(tc.reason)}) {
				t.Fatalf("commands before the checkpoint: %v", got)
			}
			h.now = h.now.Add(3 * time.Second)
			h.cycle()
			if n := len(h.commandsFor(a.ID)); n != 1 {
				t.Fatalf("%d commands while the checkpoint is written", n)
			}
			h.checkpointed(a, "ckpt-7", true)
			cmds := h.commandsFor(a.ID)
			if got := kinds(cmds); !slices.Equal(got, []string{"checkpoint_run:" + string(tc.reason), "stop_run:" + string(tc.reason)}) {
				t.Fatalf("commands after the checkpoint: %v", got)
			}
			if g := cmds[1].GracePeriod.D(); g != tc.wantGrace {
				t.Fatalf("stop grace %s, want %s", g, tc.wantGrace)
			}
			h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: tc.reason, StartedAt: h.now, EndedAt: h.now})
			h.release(a, tc.reason, nil)
			if ev := h.last("a", "j"); ev.Type != contracts.EventRequeued || ev.Attempt != 2 || ev.Reason != tc.reason {
				t.Fatalf("after the stop: %+v", ev)
			}
			h.cycle()
			next := h.items("a", "j", 2)
			if len(next) != 1 {
				t.Fatalf("attempt 2 not planned: %+v", next)
			}
			if next[0].Devices[0].UUID == a.Devices[0].UUID {
				t.Fatalf("attempt 2 planned on the device it left: %+v", next[0])
			}
			h.commit(next[0])
			h.started(next[0], h.now)
			ev = h.last("a", "j")
			if ev.Type != contracts.EventMigrated || ev.Reason != tc.reason || ev.Migration == nil ||
				ev.Migration.RestoredFrom != "ckpt-7" || !ev.Migration.Checkpointed || ev.Migration.From[0].NodeID != "n1" {
				t.Fatalf("after the next attempt started: %+v (migration %+v)", ev, ev.Migration)
			}
			if st := h.status[Key("a", "j")]; st.State != contracts.StateRunning || st.Attempt != 2 {
				t.Fatalf("readers see %s attempt %d", st.State, st.Attempt)
			}
			if got := strings.Join(h.types("a", "j"), ","); got != "queued,scheduled,running,migrating,requeued,scheduled,running,migrated" {
				t.Fatalf("events %s", got)
			}
			h.noDuplicates()
		})
	}
}

// A job that never reports the checkpoint it was asked for is stopped once
// the wait runs out; a spot deadline shortens the wait and the grace.
func TestMigrationCheckpointWaitEnds(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.PreemptGrace = 30 * time.Second; c.CheckpointTimeout = 40 * time.Second })
	a := placeRunning(h, "j", true)
	deadline := h.now.Add(50 * time.Second)
	h.st.ApplyNodeAdmin("n1", &contracts.NodeAdmin{NodeID: "n1", Cordoned: true, Drain: true,
		Cause: contracts.ReasonSpotInterruption, Deadline: &deadline})
	h.cycle()
	// Grace: min(30s, 50s/2) = 25s; the wait ends 25s + 5s before the
	// deadline, 20s from now, not after the 40s timeout.
	h.now = h.now.Add(19 * time.Second)
	h.cycle()
	if n := len(h.commandsFor(a.ID)); n != 1 {
		t.Fatalf("%d commands before the wait ended", n)
	}
	h.now = h.now.Add(time.Second)
	h.cycle()
	cmds := h.commandsFor(a.ID)
	if got := kinds(cmds); !slices.Equal(got, []string{"checkpoint_run:spot_interruption", "stop_run:spot_interruption"}) {
		t.Fatalf("commands: %v", got)
	}
	if g := cmds[1].GracePeriod.D(); g != 25*time.Second {
		t.Fatalf("grace %s, want 25s (30s left, 5s margin)", g)
	}
	h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonSpotInterruption, StartedAt: h.now, EndedAt: h.now})
	h.release(a, contracts.ReasonSpotInterruption, nil)
	h.cycle()
	next := h.items("a", "j", 2)
	h.commit(next[0])
	h.started(next[0], h.now)
	if ev := h.last("a", "j"); ev.Type != contracts.EventMigrated || ev.Migration.Checkpointed || ev.Migration.RestoredFrom != "" {
		t.Fatalf("migrated without a checkpoint: %+v %+v", ev, ev.Migration)
	}
}

// A job that does not checkpoint is stopped at once and restarts.
func TestMigrationOfAJobWithoutCheckpoints(t *testing.T) {
	h := newHarness(t)
	a := placeRunning(h, "j", false)
	h.st.ApplyNodeAdmin("n1", &contracts.NodeAdmin{NodeID: "n1", Cordoned: true, Drain: true})
	h.cycle()
	if ev := h.last("a", "j"); ev.Type != contracts.EventMigrating || ev.Migration.Checkpoint {
		t.Fatalf("%+v %+v", ev, ev.Migration)
	}
	if got := kinds(h.commandsFor(a.ID)); !slices.Equal(got, []string{"stop_run:node_drained"}) {
		t.Fatalf("commands: %v", got)
	}
}

// A scheduler restarted mid-migration goes on with it: the migrating event
// it published is its memory of the move, the checkpoint request is sent
// again under the same ID (JetStream drops it), and the stop follows the
// checkpoint reported after the restart.
func TestMigrationSurvivesARestart(t *testing.T) {
	h := newHarness(t)
	a := placeRunning(h, "j", true)
	hold := &contracts.NodeAdmin{NodeID: "n1", GPUs: map[string]contracts.GPUHold{
		a.Devices[0].UUID: {Cordoned: true, Drain: true, Cause: contracts.ReasonOverheating, Since: h.now}}}
	h.fact(func(s *Store) []Publish { s.ApplyNodeAdmin("n1", hold); return nil })
	h.cycle()
	h.restart()
	// The hold is lifted meanwhile (the GPU cooled down): the move goes on.
	h.fact(func(s *Store) []Publish { s.ApplyNodeAdmin("n1", nil); return nil })
	h.cycle()
	h.checkpointed(a, "ckpt-1", true)
	cmds := h.commandsFor(a.ID)
	if got := kinds(cmds); got[len(got)-1] != "stop_run:overheating" {
		t.Fatalf("commands: %v", got)
	}
	h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: contracts.ReasonOverheating, StartedAt: h.now, EndedAt: h.now})
	h.release(a, contracts.ReasonOverheating, nil)
	h.restart()
	h.cycle()
	next := h.items("a", "j", 2)
	h.commit(next[0])
	h.started(next[0], h.now)
	if ev := h.last("a", "j"); ev.Type != contracts.EventMigrated || ev.Migration.RestoredFrom != "ckpt-1" {
		t.Fatalf("%+v %+v", ev, ev.Migration)
	}
	for id, n := range h.ids {
		if n > 1 && !strings.HasPrefix(id, "cmd/checkpoint_run/") {
			t.Errorf("message %s published %d times", id, n)
		}
	}
}

// A GPU held by a monitor alert takes no new work; the node's other GPU
// still does.
func TestHeldGPUTakesNoNewWork(t *testing.T) {
	h := newHarness(t)
	h.inventory("n1", "p", "H100-80GB", 81920, 2)
	h.st.ApplyNodeAdmin("n1", &contracts.NodeAdmin{NodeID: "n1", GPUs: map[string]contracts.GPUHold{
		"n1-gpu0": {Cordoned: true, Cause: contracts.ReasonGPUUnhealthy}}})
	h.submit("a", job("one", 1, "any"))
	h.submit("a", job("two", 1, "any"))
	h.cycle()
	one := h.items("a", "one", 1)
	if len(one) != 1 || one[0].Devices[0].UUID != "n1-gpu1" {
		t.Fatalf("first job on %+v, want n1-gpu1", one)
	}
	if len(h.items("a", "two", 1)) != 0 {
		t.Fatal("a job was placed on the held GPU")
	}
}

// A spot machine reclaimed before the moved job's stop landed: the job is
// requeued as node_lost, and its next attempt still announces the move.
func TestMigrationCutShortByTheReclaim(t *testing.T) {
	h := newHarness(t)
	a := placeRunning(h, "j", true)
	deadline := h.now.Add(2 * time.Minute)
	h.st.ApplyNodeAdmin("n1", &contracts.NodeAdmin{NodeID: "n1", Cordoned: true, Drain: true,
		Cause: contracts.ReasonSpotInterruption, Deadline: &deadline})
	h.cycle()
	h.nodeEvent("n1", contracts.NodeLost)
	h.release(a, contracts.ReasonNodeLost, nil)
	if ev := h.last("a", "j"); ev.Type != contracts.EventRequeued || ev.Reason != contracts.ReasonNodeLost {
		t.Fatalf("after the reclaim: %+v", ev)
	}
	h.cycle()
	next := h.items("a", "j", 2)
	h.commit(next[0])
	h.started(next[0], h.now)
	if ev := h.last("a", "j"); ev.Type != contracts.EventMigrated || ev.Reason != contracts.ReasonSpotInterruption || ev.Migration.Checkpointed {
		t.Fatalf("%+v %+v", ev, ev.Migration)
	}
}

// TestMigratedSaysWhereTheJobWent: a move is decided per device, so a job
// moved off one hot GPU may run next on another GPU of the same machine.
// The migrated message named machines only and read "moved from n1 to n1";
// it names the devices, says a move within one machine is one, and says
// an attempt placed back on the devices it left (the hold was lifted
// before the next placement) is back there.
func TestMigratedSaysWhereTheJobWent(t *testing.T) {
	hotGPU0 := &contracts.NodeAdmin{NodeID: "n1", GPUs: map[string]contracts.GPUHold{
		"n1-gpu0": {Cordoned: true, Drain: true, Cause: contracts.ReasonOverheating}}}
	tests := []struct {
		name  string
		gpus  int  // GPUs of n1, the only node at first
		other bool // n2 joins before the move
		hold  *contracts.NodeAdmin
		lift  bool // the hold is lifted before the next placement
		want  func(next contracts.Allocation) string
	}{
		{"another GPU of the same machine", 2, false, hotGPU0, false, func(contracts.Allocation) string {
			return "moved within n1 from GPU 0 (attempt 1) to GPU 1 (overheating); restarted: no checkpoint"
		}},
		{"another machine", 1, true, &contracts.NodeAdmin{NodeID: "n1", Cordoned: true, Drain: true},
			false, func(next contracts.Allocation) string {
				return "moved from n1 GPU 0 (attempt 1) to n2 GPU " + strconv.Itoa(next.Devices[0].Index) +
					" (node_drained); restarted: no checkpoint"
			}},
		{"back on the same GPU", 1, false, hotGPU0, true, func(contracts.Allocation) string {
			return "back on n1 GPU 0, where attempt 1 ran (overheating); restarted: no checkpoint"
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			h.inventory("n1", "p", "H100-80GB", 81920, tc.gpus)
			h.submit("a", job("j", 1, "any"))
			h.cycle()
			a := h.item("a", "j")
			if a.NodeID != "n1" || a.Devices[0].UUID != "n1-gpu0" {
				t.Fatalf("attempt 1 on %s %+v, want n1-gpu0", a.NodeID, a.Devices)
			}
			h.commit(a)
			h.started(a, h.now)
			if tc.other {
				h.inventory("n2", "p", "H100-80GB", 81920, 2)
			}
			h.fact(func(s *Store) []Publish { s.ApplyNodeAdmin("n1", tc.hold); return nil })
			h.cycle()
			if ev := h.last("a", "j"); ev.Type != contracts.EventMigrating {
				t.Fatalf("after the hold: %+v", ev)
			}
			h.ended(a, contracts.RunResult{Outcome: contracts.OutcomeCancelled, Reason: h.last("a", "j").Reason,
				StartedAt: h.now, EndedAt: h.now})
			h.release(a, h.last("a", "j").Reason, nil)
			if tc.lift {
				h.fact(func(s *Store) []Publish { s.ApplyNodeAdmin("n1", nil); return nil })
			}
			h.cycle()
			next := h.items("a", "j", 2)
			if len(next) != 1 {
				t.Fatalf("attempt 2 not planned: %+v", next)
			}
			h.commit(next[0])
			h.started(next[0], h.now)
			ev := h.last("a", "j")
			if ev.Type != contracts.EventMigrated {
				t.Fatalf("after attempt 2 started: %+v", ev)
			}
			if want := tc.want(next[0]); ev.Message != want {
				t.Fatalf("migrated message\n got %q\nwant %q", ev.Message, want)
			}
		})
	}
}
