package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/e2e/oracle"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
	"github.com/gpuplane/gpuplane/services/scheduler"
)

// The scheduling end-to-end tests: gangs across machines, preemption,
// quotas and drains, through the real services of startStack, on small
// fleets of 4-GPU machines where every decision has one right answer.

// fourGPUFleet is n machines of 4×H100 in one NVLink domain each, in pool
// h100: nodes h100-01 ... h100-0n.
func fourGPUFleet(n int) *fleet.Fleet {
	return &fleet.Fleet{
		MachineTypes: map[string]fleet.MachineType{
			"hgx-h100-4": {GPUModel: "H100-80GB", GPUCount: 4, NVLink: true},
		},
		Pools: []fleet.Pool{{Name: "h100", MachineType: "hgx-h100-4", Count: n, Zone: "zone-a", PriceClass: "on-demand"}},
	}
}

// withScheduler runs the stack's scheduler with a short -min-runtime and
// -preempt-grace, so preemption and drains happen within a test.
func withScheduler(minRuntime, grace time.Duration) func(*gpuplane.Config) {
	return func(c *gpuplane.Config) {
		c.Scheduler = func(sc *scheduler.Config) {
			sc.MinRuntime, sc.PreemptGrace = minRuntime, grace
		}
	}
}

// history follows JOB_EVENTS and keeps every event of every job, in
// stream order (one ordered consumer).
type history struct {
	mu  sync.Mutex
	evs map[string][]contracts.JobEvent // tenant/job -> events
}

func (s *stack) watchHistory(t testing.TB) *history {
	t.Helper()
	h := &history{evs: map[string][]contracts.JobEvent{}}
	s.tail(t, contracts.StreamJobEvents, nil, func(m jetstream.Msg) {
		var ev contracts.JobEvent
		if json.Unmarshal(m.Data(), &ev) != nil {
			return
		}
		h.mu.Lock()
		defer h.mu.Unlock()
		key := ev.Tenant + "/" + ev.JobID
		h.evs[key] = append(h.evs[key], ev)
	})
	return h
}

// of returns a copy of the job's events so far.
func (h *history) of(key string) []contracts.JobEvent {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.evs[key])
}

// last is the job's latest event.
func (h *history) last(key string) (contracts.JobEvent, bool) {
	evs := h.of(key)
	if len(evs) == 0 {
		return contracts.JobEvent{}, false
	}
	return evs[len(evs)-1], true
}

// count counts the job's events of type typ.
func (h *history) count(key string, typ contracts.JobEventType) int {
	n := 0
	for _, ev := range h.of(key) {
		if ev.Type == typ {
			n++
		}
	}
	return n
}

// types lists the job's event types, for failure messages.
func (h *history) types(key string) string {
	var out []string
	for _, ev := range h.of(key) {
		s := fmt.Sprintf("%s#%d", ev.Type, ev.Attempt)
		if ev.Reason != "" {
			s += "(" + string(ev.Reason) + ")"
		}
		out = append(out, s)
	}
	return strings.Join(out, " ")
}

// await polls until the job has an event matching match and returns the
// first one.
func (h *history) await(t testing.TB, d time.Duration, key, what string, match func(contracts.JobEvent) bool) contracts.JobEvent {
	t.Helper()
	var found contracts.JobEvent
	waitFor(t, d, key+" "+what, func() (bool, string) {
		for _, ev := range h.of(key) {
			if match(ev) {
				found = ev
				return true, ""
			}
		}
		return false, "events: " + h.types(key)
	})
	return found
}

// awaitState polls until the job's latest event is in state st.
func (h *history) awaitState(t testing.TB, d time.Duration, key string, st contracts.JobState) contracts.JobEvent {
	t.Helper()
	var ev contracts.JobEvent
	waitFor(t, d, key+" "+string(st), func() (bool, string) {
		var ok bool
		ev, ok = h.last(key)
		return ok && ev.State == st, "events: " + h.types(key)
	})
	return ev
}

// isType matches events of type typ and attempt.
func isType(typ contracts.JobEventType, attempt int) func(contracts.JobEvent) bool {
	return func(ev contracts.JobEvent) bool { return ev.Type == typ && ev.Attempt == attempt }
}

// submitJob submits req for tenant through the gateway; it must be
// accepted.
func (s *stack) submitJob(t testing.TB, ctx context.Context, tenant string, req contracts.JobRequest) {
	t.Helper()
	body, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	code, resp, err := s.submitAPI(ctx, tenant, body)
	if err != nil || code != http.StatusAccepted {
		t.Fatalf("submit %s/%s: %d %s %v", tenant, req.ID, code, resp, err)
	}
}

// callAPI sends a JSON body (nil: none) to the gateway and decodes a 2xx
// answer into out (when not nil). It returns the status and the raw body.
func (s *stack) callAPI(t testing.TB, method, path string, body, out any) (int, []byte) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, s.ep.GatewayURL+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := authClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading the answer: %v", method, path, err)
	}
	if out != nil && resp.StatusCode/100 == 2 {
		if err := json.Unmarshal(b, out); err != nil {
			t.Fatalf("%s %s: decoding %s: %v", method, path, b, err)
		}
	}
	return resp.StatusCode, b
}

// streamMsgs returns every message stream holds now, in order.
func (s *stack) streamMsgs(t testing.TB, stream string) []jetstream.Msg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := s.js.Stream(ctx, stream)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	last := info.State.LastSeq
	if info.State.Msgs == 0 {
		return nil
	}
	cons, err := s.js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var out []jetstream.Msg
	for seq := uint64(0); seq < last; {
		m, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
		if err != nil {
			t.Fatalf("reading %s at %d of %d: %v", stream, seq, last, err)
		}
		md, err := m.Metadata()
		if err != nil {
			t.Fatal(err)
		}
		seq = md.Sequence.Stream
		out = append(out, m)
	}
	return out
}

// allocations is what ALLOCATIONS and PLANS hold now.
type allocations struct {
	ledger    []contracts.LedgerEntry
	refusals  []contracts.Refusal
	planItems []contracts.Allocation
}

func (s *stack) allocations(t testing.TB) allocations {
	t.Helper()
	var a allocations
	for _, m := range s.streamMsgs(t, contracts.StreamAllocations) {
		switch {
		case strings.HasPrefix(m.Subject(), "gp.alloc.ledger."):
			var e contracts.LedgerEntry
			if err := json.Unmarshal(m.Data(), &e); err != nil {
				t.Fatalf("ledger entry on %s: %v", m.Subject(), err)
			}
			a.ledger = append(a.ledger, e)
		case strings.HasPrefix(m.Subject(), "gp.alloc.refused."):
			var r contracts.Refusal
			if err := json.Unmarshal(m.Data(), &r); err != nil {
				t.Fatalf("refusal on %s: %v", m.Subject(), err)
			}
			a.refusals = append(a.refusals, r)
		}
	}
	for _, m := range s.streamMsgs(t, contracts.StreamPlans) {
		var p contracts.Plan
		if err := json.Unmarshal(m.Data(), &p); err != nil {
			t.Fatalf("plan on %s: %v", m.Subject(), err)
		}
		a.planItems = append(a.planItems, p.Items...)
	}
	return a
}

// ofJob keeps what names tenant/job.
func (a allocations) ofJob(tenant, job string) allocations {
	var out allocations
	for _, e := range a.ledger {
		if e.Allocation.Tenant == tenant && e.Allocation.JobID == job {
			out.ledger = append(out.ledger, e)
		}
	}
	for _, r := range a.refusals {
		if r.Tenant == tenant && r.JobID == job {
			out.refusals = append(out.refusals, r)
		}
	}
	for _, it := range a.planItems {
		if it.Tenant == tenant && it.JobID == job {
			out.planItems = append(out.planItems, it)
		}
	}
	return out
}

// nodeCommands is every command NODE_COMMANDS holds now.
func (s *stack) nodeCommands(t testing.TB) []contracts.NodeCommand {
	t.Helper()
	var out []contracts.NodeCommand
	for _, m := range s.streamMsgs(t, contracts.StreamNodeCommands) {
		var c contracts.NodeCommand
		if err := json.Unmarshal(m.Data(), &c); err != nil {
			t.Fatalf("node command on %s: %v", m.Subject(), err)
		}
		out = append(out, c)
	}
	return out
}

// runOutput is each allocation's output of tenant/job, reassembled from
// the LOGS stream by offset (a chunk republished after a restart counts
// once), and whether its EOF chunk came.
func (s *stack) runOutput(t testing.TB, tenant, job string) (out map[string]string, eof map[string]bool) {
	t.Helper()
	chunks := map[string]map[int64]string{}
	eof = map[string]bool{}
	for _, m := range s.streamMsgs(t, contracts.StreamLogs) {
		if !strings.HasPrefix(m.Subject(), contracts.SubjectLogs(tenant, job, "")) {
			continue
		}
		var c contracts.LogChunk
		if err := json.Unmarshal(m.Data(), &c); err != nil {
			t.Fatalf("log chunk on %s: %v", m.Subject(), err)
		}
		if chunks[c.AllocationID] == nil {
			chunks[c.AllocationID] = map[int64]string{}
		}
		if len(c.Data) >= len(chunks[c.AllocationID][c.Offset]) {
			chunks[c.AllocationID][c.Offset] = c.Data
		}
		eof[c.AllocationID] = eof[c.AllocationID] || c.EOF
	}
	out = map[string]string{}
	for id, byOff := range chunks {
		offs := make([]int64, 0, len(byOff))
		for off := range byOff {
			offs = append(offs, off)
		}
		slices.Sort(offs)
		var b strings.Builder
		for _, off := range offs {
			if int64(b.Len()) != off {
				t.Fatalf("output of %s: chunk at %d follows %d bytes", id, off, b.Len())
			}
			b.WriteString(byOff[off])
		}
		out[id] = b.String()
	}
	return out, eof
}

// checkOracle replays the streams and fails the test on any violation of
// G1 or J1.
func (s *stack) checkOracle(t testing.TB) *oracle.Report {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rep, err := oracle.Check(ctx, s.nc)
	if err != nil {
		t.Fatalf("oracle: %v", err)
	}
	if err := rep.Err(); err != nil {
		t.Fatal(err)
	}
	t.Logf("oracle: %s", rep.Summary())
	return rep
}

func uuidsOf(devs []contracts.DeviceRef) []string {
	out := make([]string, len(devs))
	for i, d := range devs {
		out[i] = d.VisibleUUID()
	}
	return out
}

func sortedUUIDs(devs []contracts.DeviceRef) []string {
	out := uuidsOf(devs)
	sort.Strings(out)
	return out
}

// TestGangAcrossMachines runs an 8-GPU job over two 4-GPU machines with a
// real command per machine: one `scheduled` event with both placements,
// one committed allocation per machine carrying its rank, each command
// seeing its own rank, the gang's size and nodes and exactly its GPUs,
// and the job succeeding. A second gang that only half fits meanwhile
// stays pending with nothing proposed, committed or refused for it, and
// runs once the first is done.
func TestGangAcrossMachines(t *testing.T) {
	s := startStack(t, fourGPUFleet(3))
	h := s.watchHistory(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// The command holds its machines until the test lets it go, so the
	// second gang is submitted while the first certainly runs.
	release := filepath.Join(t.TempDir(), "release")
	script := fmt.Sprintf(`echo "rank=$GPUPLANE_GANG_RANK size=$GPUPLANE_GANG_SIZE nodes=$GPUPLANE_GANG_NODES gpus=$CUDA_VISIBLE_DEVICES"
while [ ! -e '%s' ]; do sleep 0.05; done
echo "rank $GPUPLANE_GANG_RANK done"`, release)
	s.submitJob(t, ctx, "acme", contracts.JobRequest{
		ID:        "gang-a",
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 8, Model: "H100-80GB", Nodes: 2}},
		Run:       contracts.RunSpec{Command: []string{"sh", "-c", script}, Duration: contracts.Duration(time.Minute)},
	})
	running := h.awaitState(t, time.Minute, "acme/gang-a", contracts.StateRunning)

	// One scheduled event, with a placement per machine by rank.
	if n := h.count("acme/gang-a", contracts.EventScheduled); n != 1 {
		t.Fatalf("gang-a has %d scheduled events, want 1: %s", n, h.types("acme/gang-a"))
	}
	sched := h.await(t, time.Second, "acme/gang-a", "scheduled", isType(contracts.EventScheduled, 1))
	pl := sched.Placements
	if len(pl) != 2 || pl[0].NodeID == pl[1].NodeID {
		t.Fatalf("gang-a scheduled with placements %+v, want 2 on different nodes", pl)
	}
	nodes := []string{pl[0].NodeID, pl[1].NodeID}
	for rank, p := range pl {
		if want := contracts.AllocationPartID("acme", "gang-a", 1, rank); p.AllocationID != want || len(p.Devices) != 4 {
			t.Errorf("placement %d is %s with %d devices, want %s with 4", rank, p.AllocationID, len(p.Devices), want)
		}
	}
	if len(running.Placements) != 2 || running.Placements[0].NodeID != nodes[0] || running.Placements[1].NodeID != nodes[1] {
		t.Errorf("running event placements %+v, want those of scheduled on %v", running.Placements, nodes)
	}

	// The ledger holds one committed part per machine, as placed.
	a := s.allocations(t).ofJob("acme", "gang-a")
	if len(a.ledger) != 2 || len(a.refusals) != 0 {
		t.Fatalf("gang-a: %d ledger entries and %d refusals while it runs, want 2 and 0: %+v %+v", len(a.ledger), len(a.refusals), a.ledger, a.refusals)
	}
	for _, e := range a.ledger {
		al := e.Allocation
		if e.Kind != contracts.LedgerCommitted || al.Gang == nil {
			t.Fatalf("gang-a ledger entry %s %s without its gang part", e.Kind, al.ID)
		}
		r := al.Gang.Rank
		if r < 0 || r > 1 || al.ID != pl[r].AllocationID || al.NodeID != pl[r].NodeID ||
			!slices.Equal(sortedUUIDs(al.Devices), sortedUUIDs(pl[r].Devices)) ||
			al.Gang.Size != 2 || !slices.Equal(al.Gang.Nodes, nodes) {
			t.Errorf("committed part %+v (gang %+v) does not match placement %d %+v", al, al.Gang, r, pl)
		}
	}

	// A second gang that fits only on the one free machine: pending, and
	// nothing of it proposed, committed or refused, not even in part.
	s.submitJob(t, ctx, "acme", contracts.JobRequest{
		ID:        "gang-b",
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 8, Model: "H100-80GB", Nodes: 2}},
		Run:       contracts.RunSpec{Duration: contracts.Duration(300 * time.Millisecond)},
	})
	pend := h.await(t, 30*time.Second, "acme/gang-b", "pending", isType(contracts.EventPending, 1))
	if pend.Reason != contracts.PendingInsufficientGPUs {
		t.Errorf("gang-b pending with %s (%s), want %s", pend.Reason, pend.Message, contracts.PendingInsufficientGPUs)
	}
	t.Logf("gang-b pending: %s: %s", pend.Reason, pend.Message)
	if last, _ := h.last("acme/gang-a"); last.State != contracts.StateRunning {
		t.Fatalf("gang-a is %s, want still running while gang-b waits", last.State)
	}
	if b := s.allocations(t).ofJob("acme", "gang-b"); len(b.ledger)+len(b.refusals)+len(b.planItems) != 0 {
		t.Fatalf("gang-b, which cannot fit in full, has %d plan items, %d ledger entries and %d refusals: %+v %+v %+v",
			len(b.planItems), len(b.ledger), len(b.refusals), b.planItems, b.ledger, b.refusals)
	}
	if n := h.count("acme/gang-b", contracts.EventScheduled); n != 0 {
		t.Fatalf("gang-b scheduled while gang-a holds two of three machines: %s", h.types("acme/gang-b"))
	}

	// Let gang-a finish: it succeeds, each part having printed its rank.
	if err := os.WriteFile(release, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	done := h.awaitState(t, time.Minute, "acme/gang-a", contracts.StateSucceeded)
	if done.ExitCode == nil || *done.ExitCode != 0 {
		t.Errorf("gang-a succeeded with exit code %v, want 0", done.ExitCode)
	}
	var out map[string]string
	waitFor(t, 30*time.Second, "the output of both parts of gang-a", func() (bool, string) {
		var eof map[string]bool
		out, eof = s.runOutput(t, "acme", "gang-a")
		return eof[pl[0].AllocationID] && eof[pl[1].AllocationID], fmt.Sprintf("output so far %q", out)
	})
	for rank, p := range pl {
		want := fmt.Sprintf("rank=%d size=2 nodes=%s gpus=%s\nrank %d done\n",
			rank, strings.Join(nodes, ","), strings.Join(uuidsOf(p.Devices), ","), rank)
		if got := out[p.AllocationID]; got != want {
			t.Errorf("output of rank %d (%s) = %q, want %q", rank, p.AllocationID, got, want)
		}
	}
	if len(out) != 2 {
		t.Errorf("gang-a has output from %d allocations, want 2 (events %s)", len(out), h.types("acme/gang-a"))
	}

	// The machines are free: gang-b now runs, in one piece.
	h.awaitState(t, time.Minute, "acme/gang-b", contracts.StateSucceeded)
	b := h.await(t, time.Second, "acme/gang-b", "scheduled", isType(contracts.EventScheduled, 1))
	if len(b.Placements) != 2 || b.Placements[0].NodeID == b.Placements[1].NodeID {
		t.Errorf("gang-b scheduled with %+v, want 2 machines", b.Placements)
	}
	if n := h.count("acme/gang-b", contracts.EventRequeued); n != 0 {
		t.Errorf("gang-b was requeued: %s", h.types("acme/gang-b"))
	}

	rep := s.checkOracle(t)
	for _, id := range []string{pl[0].AllocationID, pl[1].AllocationID} {
		r := rep.Runs[id]
		if r == nil || r.Started != 1 || r.Ended != 1 || r.Outcome != contracts.OutcomeSucceeded || r.GPUs != 4 {
			t.Errorf("run of %s: %+v, want started and ended once, succeeded, 4 GPUs", id, r)
		}
	}
	if len(rep.Refusals) != 0 {
		t.Errorf("the resource manager refused %d items: %+v", len(rep.Refusals), rep.Refusals)
	}
}

// TestPreemptionEndToEnd fills two 4-GPU machines with best-effort work,
// one 4-GPU job on one and four 1-GPU jobs on the other, then submits a
// critical 4-GPU job. Either set frees 4 GPUs; the cheapest is one victim,
// so exactly the 4-GPU job is stopped (stop_run, reason preempted, the
// configured grace), requeued as attempt 2, and the critical job takes
// its very GPUs; the 1-GPU jobs run on untouched. The victim runs again
// once the critical job is done, and the oracle finds G1 and J1 intact.
func TestPreemptionEndToEnd(t *testing.T) {
	const minRuntime, grace = time.Second, 2 * time.Second
	s := startStack(t, fourGPUFleet(2), withScheduler(minRuntime, grace))
	h := s.watchHistory(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	long := contracts.RunSpec{Duration: contracts.Duration(10 * time.Minute)}
	s.submitJob(t, ctx, "acme", contracts.JobRequest{ID: "be-big", Priority: contracts.PriorityBestEffort,
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 4, Model: "H100-80GB"}}, Run: long})
	big := h.awaitState(t, time.Minute, "acme/be-big", contracts.StateRunning)
	small := []string{"be-1", "be-2", "be-3", "be-4"}
	for _, id := range small {
		s.submitJob(t, ctx, "globex", contracts.JobRequest{ID: id, Priority: contracts.PriorityBestEffort,
			Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB"}}, Run: long})
	}
	latest := *big.StartedAt
	for _, id := range small {
		ev := h.awaitState(t, time.Minute, "globex/"+id, contracts.StateRunning)
		if ev.Placement == nil || ev.Placement.NodeID == big.Placement.NodeID {
			t.Fatalf("%s runs on %+v, want the machine be-big leaves free", id, ev.Placement)
		}
		if ev.StartedAt.After(latest) {
			latest = *ev.StartedAt
		}
	}
	// Every candidate is past -min-runtime, so cost alone decides: the
	// 1-GPU jobs lost less progress, but they are four jobs against one.
	waitFor(t, 10*time.Second, "every best-effort run past -min-runtime", func() (bool, string) {
		return time.Since(latest) > minRuntime+100*time.Millisecond, ""
	})

	s.submitJob(t, ctx, "initech", contracts.JobRequest{ID: "crit", Priority: contracts.PriorityCritical,
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 4, Model: "H100-80GB"}},
		Run:       contracts.RunSpec{Duration: contracts.Duration(500 * time.Millisecond)}})

	req := h.await(t, 30*time.Second, "acme/be-big", "requeued", isType(contracts.EventRequeued, 2))
	if req.Reason != contracts.ReasonPreempted || req.State != contracts.StateQueued {
		t.Errorf("be-big requeued with %s into %s, want %s into queued", req.Reason, req.State, contracts.ReasonPreempted)
	}
	// (crit's `preempting` reason is not asserted: a pending event is
	// published at most every 5 s, and it said insufficient_free_gpus
	// a moment before.)
	crit := h.await(t, 30*time.Second, "initech/crit", "scheduled", isType(contracts.EventScheduled, 1))
	if crit.Placement == nil || crit.Placement.NodeID != big.Placement.NodeID ||
		!slices.Equal(sortedUUIDs(crit.Placement.Devices), sortedUUIDs(big.Placement.Devices)) {
		t.Errorf("crit placed on %+v, want the GPUs be-big held: %+v", crit.Placement, big.Placement)
	}
	h.awaitState(t, 30*time.Second, "initech/crit", contracts.StateSucceeded)

	// The victim runs again as attempt 2, once the critical job is done.
	again := h.await(t, 30*time.Second, "acme/be-big", "scheduled again", isType(contracts.EventScheduled, 2))
	if again.Placement == nil || again.Placement.AllocationID != contracts.AllocationID("acme", "be-big", 2) {
		t.Errorf("be-big attempt 2 placed as %+v", again.Placement)
	}

	// Fewest victims: only be-big was stopped, the 1-GPU jobs never.
	for _, id := range small {
		if n := h.count("globex/"+id, contracts.EventRequeued); n != 0 {
			t.Errorf("globex/%s was requeued: %s", id, h.types("globex/"+id))
		}
		if last, _ := h.last("globex/" + id); last.State != contracts.StateRunning || last.Attempt != 1 {
			t.Errorf("globex/%s is %s attempt %d, want running attempt 1", id, last.State, last.Attempt)
		}
	}
	var stops []contracts.NodeCommand
	for _, c := range s.nodeCommands(t) {
		if c.Kind == contracts.CommandStopRun {
			stops = append(stops, c)
		}
	}
	if len(stops) != 1 || stops[0].AllocationID != contracts.AllocationID("acme", "be-big", 1) ||
		stops[0].Reason != contracts.ReasonPreempted || stops[0].GracePeriod.D() != grace {
		t.Errorf("stop commands %+v, want one for acme/be-big/1 with reason %s and grace %s", stops, contracts.ReasonPreempted, grace)
	}
	for _, e := range s.allocations(t).ofJob("acme", "be-big").ledger {
		if e.Kind == contracts.LedgerReleased && e.Allocation.Attempt == 1 && (e.Run == nil || e.Run.Reason != contracts.ReasonPreempted) {
			t.Errorf("be-big attempt 1 released with run %+v, want its run's reason %s", e.Run, contracts.ReasonPreempted)
		}
	}

	rep := s.checkOracle(t)
	if j := rep.Jobs["acme/be-big"]; j == nil || j.Attempt != 2 {
		t.Errorf("the oracle sees be-big at %+v, want attempt 2", j)
	}
	if len(rep.Refusals) != 0 {
		t.Errorf("the resource manager refused %d items: %+v", len(rep.Refusals), rep.Refusals)
	}
}

// TestQuotaAndDrainThroughGateway sets pool h100 to spread and a quota of
// at most 2 GPUs through the gateway, and submits three 1-GPU jobs: the third waits with
// quota_exceeded (and `describe` says so) until the quota is raised, a
// write at a stale revision being refused on the way. Then it drains the
// node holding most of them: its jobs are requeued with node_drained and
// placed on the other machine, the others untouched, and the resource
// manager refuses nothing.
func TestQuotaAndDrainThroughGateway(t *testing.T) {
	s := startStack(t, fourGPUFleet(2), withScheduler(time.Second, 2*time.Second))
	h := s.watchHistory(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	maxGPUs := func(n float64) contracts.TenantQuota {
		return contracts.TenantQuota{Pools: map[string]contracts.PoolQuota{contracts.QuotaAllPools: {Guarantee: 0, Max: &n}}}
	}
	// Spread, so the jobs land on both machines and the drain below
	// moves some and leaves others.
	var pool contracts.PoolDoc
	if code, b := s.callAPI(t, http.MethodPut, "/v1/pools/h100", contracts.PoolConfig{Policy: contracts.PolicySpread}, &pool); code != http.StatusOK ||
		pool.Config == nil || pool.Config.Policy != contracts.PolicySpread {
		t.Fatalf("PUT pool: %d %s", code, b)
	}
	var doc contracts.QuotaDoc
	if code, b := s.callAPI(t, http.MethodPut, "/v1/quotas/acme?revision=0", maxGPUs(2), &doc); code != http.StatusOK {
		t.Fatalf("PUT quota: %d %s", code, b)
	}
	if doc.Quota == nil || doc.Revision == 0 || *doc.Quota.Pools[contracts.QuotaAllPools].Max != 2 {
		t.Fatalf("PUT quota answered %+v", doc)
	}

	jobs := []string{"q-1", "q-2", "q-3"}
	for _, id := range jobs {
		s.submitJob(t, ctx, "acme", contracts.JobRequest{ID: id,
			Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB"}},
			Run:       contracts.RunSpec{Duration: contracts.Duration(10 * time.Minute)}})
	}
	h.awaitState(t, time.Minute, "acme/q-1", contracts.StateRunning)
	h.awaitState(t, time.Minute, "acme/q-2", contracts.StateRunning)
	pend := h.await(t, 30*time.Second, "acme/q-3", "pending", isType(contracts.EventPending, 1))
	if pend.Reason != contracts.PendingQuotaExceeded {
		t.Fatalf("q-3 pending with %s (%s), want %s", pend.Reason, pend.Message, contracts.PendingQuotaExceeded)
	}
	t.Logf("q-3 pending: %s", pend.Message)
	var desc contracts.JobDescription
	waitFor(t, 10*time.Second, "describe of q-3 to show the quota", func() (bool, string) {
		desc = contracts.JobDescription{} // a field the answer omits must not survive from the last one
		if code, b := s.callAPI(t, http.MethodGet, "/v1/tenants/acme/jobs/q-3/describe", nil, &desc); code != http.StatusOK {
			return false, fmt.Sprintf("%d %s", code, b)
		}
		return desc.State == contracts.StateQueued && desc.Pending != nil && desc.Pending.Reason == contracts.PendingQuotaExceeded,
			fmt.Sprintf("%s pending %+v", desc.State, desc.Pending)
	})
	if desc.Pending.Message != pend.Message || desc.Attempt != 1 || len(desc.Placements) != 0 {
		t.Errorf("describe of q-3: pending %+v attempt %d placements %+v; want the event's message %q, attempt 1, no placements",
			desc.Pending, desc.Attempt, desc.Placements, pend.Message)
	}
	if b := s.allocations(t).ofJob("acme", "q-3"); len(b.planItems)+len(b.ledger) != 0 {
		t.Fatalf("q-3 has %d plan items and %d ledger entries while over quota", len(b.planItems), len(b.ledger))
	}

	// Raise the quota, at the revision read; a write at a revision gone
	// stale is refused.
	rev := doc.Revision
	if code, b := s.callAPI(t, http.MethodPut, fmt.Sprintf("/v1/quotas/acme?revision=%d", rev), maxGPUs(3), &doc); code != http.StatusOK {
		t.Fatalf("PUT quota at revision %d: %d %s", rev, code, b)
	}
	if code, b := s.callAPI(t, http.MethodPut, fmt.Sprintf("/v1/quotas/acme?revision=%d", rev), maxGPUs(8), nil); code != http.StatusConflict {
		t.Errorf("PUT quota at stale revision %d: %d %s, want 409", rev, code, b)
	}
	h.awaitState(t, 30*time.Second, "acme/q-3", contracts.StateRunning)
	waitFor(t, 10*time.Second, "describe of q-3 to show it running", func() (bool, string) {
		desc = contracts.JobDescription{} // a field the answer omits must not survive from the last one
		if code, b := s.callAPI(t, http.MethodGet, "/v1/tenants/acme/jobs/q-3/describe", nil, &desc); code != http.StatusOK {
			return false, fmt.Sprintf("%d %s", code, b)
		}
		return desc.State == contracts.StateRunning && desc.Pending == nil && len(desc.Placements) == 1,
			fmt.Sprintf("%s pending %+v placements %+v", desc.State, desc.Pending, desc.Placements)
	})

	// Drain the node holding most of the jobs (ties: the first by ID).
	where := map[string]string{} // job -> node
	count := map[string]int{}
	for _, id := range jobs {
		ev, _ := h.last("acme/" + id)
		where[id] = ev.Placement.NodeID
		count[ev.Placement.NodeID]++
	}
	drained, other := "h100-01", "h100-02"
	if count["h100-02"] > count["h100-01"] {
		drained, other = other, drained
	}
	var moved, stayed []string
	for _, id := range jobs {
		if where[id] == drained {
			moved = append(moved, id)
		} else {
			stayed = append(stayed, id)
		}
	}
	t.Logf("jobs on %s: %v; on %s: %v", drained, moved, other, stayed)
	if len(stayed) == 0 {
		t.Fatalf("every job is on %s although pool h100 spreads", drained)
	}
	var st contracts.NodeStatus
	if code, b := s.callAPI(t, http.MethodPost, "/v1/nodes/"+drained+"/drain", contracts.NodeAdminRequest{Reason: "e2e maintenance"}, &st); code != http.StatusOK {
		t.Fatalf("drain %s: %d %s", drained, code, b)
	}
	if st.Admin == nil || !st.Admin.Drain || !st.Admin.Cordoned {
		t.Errorf("drain answered hold %+v, want cordoned and draining", st.Admin)
	}
	for _, id := range moved {
		key := "acme/" + id
		ev := h.await(t, 30*time.Second, key, "requeued", isType(contracts.EventRequeued, 2))
		if ev.Reason != contracts.ReasonDrained {
			t.Errorf("%s requeued with %s, want %s", key, ev.Reason, contracts.ReasonDrained)
		}
		ev = h.await(t, 30*time.Second, key, "running again", isType(contracts.EventRunning, 2))
		if ev.Placement == nil || ev.Placement.NodeID != other {
			t.Errorf("%s runs as attempt 2 on %+v, want %s", key, ev.Placement, other)
		}
		// A drain migrates: announced before, and after on the new node.
		ev = h.await(t, 30*time.Second, key, "migrated", isType(contracts.EventMigrated, 2))
		if ev.Reason != contracts.ReasonDrained || ev.Migration == nil || len(ev.Migration.From) != 1 ||
			ev.Migration.From[0].NodeID != drained || h.count(key, contracts.EventMigrating) != 1 {
			t.Errorf("%s: migrated %+v (%+v); events %s", key, ev, ev.Migration, h.types(key))
		}
	}
	for _, id := range stayed {
		if last, _ := h.last("acme/" + id); last.State != contracts.StateRunning || last.Attempt != 1 || h.count("acme/"+id, contracts.EventRequeued) != 0 {
			t.Errorf("acme/%s on %s: %s; want running attempt 1, never requeued", id, other, h.types("acme/"+id))
		}
	}

	// Each moved job got one stop (node_drained, the scheduler's grace);
	// nothing committed on the drained node after the drain; no refusals.
	wantStops := map[string]bool{}
	for _, id := range moved {
		wantStops[contracts.AllocationID("acme", id, 1)] = true
	}
	for _, c := range s.nodeCommands(t) {
		if c.Kind != contracts.CommandStopRun {
			continue
		}
		if !wantStops[c.AllocationID] || c.Reason != contracts.ReasonDrained || c.GracePeriod.D() != 2*time.Second {
			t.Errorf("unexpected stop command %+v", c)
		}
		delete(wantStops, c.AllocationID)
	}
	if len(wantStops) != 0 {
		t.Errorf("no stop command for %v", wantStops)
	}
	all := s.allocations(t)
	live := 0
	for _, e := range all.ledger {
		if e.Kind == contracts.LedgerCommitted {
			live++
			if e.Allocation.NodeID == drained && e.Allocation.Attempt > 1 {
				t.Errorf("%s committed on drained %s", e.Allocation.ID, drained)
			}
		} else {
			live--
		}
	}
	if live != len(jobs) {
		t.Errorf("%d allocations live, want %d (the quota's 3)", live, len(jobs))
	}
	if len(all.refusals) != 0 {
		t.Errorf("the resource manager refused %d items: %+v", len(all.refusals), all.refusals)
	}
	waitFor(t, 10*time.Second, "GET /v1/nodes to show the drain", func() (bool, string) {
		var list contracts.NodeList
		if code, b := s.callAPI(t, http.MethodGet, "/v1/nodes", nil, &list); code != http.StatusOK {
			return false, fmt.Sprintf("%d %s", code, b)
		}
		for _, n := range list.Nodes {
			if n.NodeID == drained {
				return n.Admin != nil && n.Admin.Drain && n.Admin.Reason == "e2e maintenance", fmt.Sprintf("%+v", n.Admin)
			}
		}
		return false, "node not listed"
	})
	s.checkOracle(t)
}

// TestXIDMovesTheRunsOfThatGPU injects an XID 79 (fell off the bus) into
// the GPU a long checkpointable job runs on: the agent reports the GPU
// unhealthy, the scheduler announces the migration, asks for a checkpoint,
// stops the job once it is written (gpu_unhealthy) and requeues it as
// attempt 2 on healthy devices, which restores the checkpoint (migrated)
// and succeeds. The monitor's XID alert makes the scheduler hold the GPU
// in gp-node-admin, visible through the gateway. A job on another GPU is
// untouched.
func TestXIDMovesTheRunsOfThatGPU(t *testing.T) {
	s := startStack(t, fourGPUFleet(1), withScheduler(time.Second, time.Second))
	h := s.watchHistory(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	one := contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB"}}
	s.submitJob(t, ctx, "acme", contracts.JobRequest{ID: "victim", Resources: one,
		Run: contracts.RunSpec{Duration: contracts.Duration(6 * time.Second), Checkpoint: true}})
	s.submitJob(t, ctx, "acme", contracts.JobRequest{ID: "bystander", Resources: one,
		Run: contracts.RunSpec{Duration: contracts.Duration(5 * time.Second)}})
	run := h.awaitState(t, time.Minute, "acme/victim", contracts.StateRunning)
	h.awaitState(t, time.Minute, "acme/bystander", contracts.StateRunning)
	node, gpu := run.Placement.NodeID, run.Placement.Devices[0]
	time.Sleep(2 * time.Second) // progress worth keeping

	injectFault(t, ctx, s, node, contracts.Fault{ID: "e2e-xid", Kind: contracts.FaultXID, GPU: gpu.UUID, Code: contracts.DefaultFaultXID})
	mig := h.await(t, 30*time.Second, "acme/victim", "migrating", isType(contracts.EventMigrating, 1))
	if mig.Reason != contracts.ReasonGPUUnhealthy || mig.Migration == nil || !mig.Migration.Checkpoint {
		t.Errorf("migrating %+v (%+v), want gpu_unhealthy with a checkpoint first", mig, mig.Migration)
	}
	req := h.await(t, 30*time.Second, "acme/victim", "requeued", isType(contracts.EventRequeued, 2))
	if req.Reason != contracts.ReasonGPUUnhealthy {
		t.Errorf("victim requeued with %s, want %s", req.Reason, contracts.ReasonGPUUnhealthy)
	}
	again := h.await(t, 30*time.Second, "acme/victim", "scheduled again", isType(contracts.EventScheduled, 2))
	if again.Placement == nil || again.Placement.Devices[0].UUID == gpu.UUID {
		t.Errorf("attempt 2 placed on %+v, want a GPU other than the unhealthy %s", again.Placement, gpu.UUID)
	}
	moved := h.await(t, 30*time.Second, "acme/victim", "migrated", isType(contracts.EventMigrated, 2))
	if m := moved.Migration; m == nil || m.RestoredFrom == "" || !m.Checkpointed || m.FromAttempt != 1 {
		t.Errorf("migrated %+v (%+v), want a restored checkpoint written on request", moved, moved.Migration)
	}
	end := h.awaitState(t, time.Minute, "acme/victim", contracts.StateSucceeded)
	// Restored, attempt 2 runs only what was left of the 6 s.
	if end.StartedAt != nil && end.EndedAt != nil && end.EndedAt.Sub(*end.StartedAt) > 5500*time.Millisecond {
		t.Errorf("attempt 2 ran %s: it did not resume from its checkpoint", end.EndedAt.Sub(*end.StartedAt))
	}
	h.awaitState(t, time.Minute, "acme/bystander", contracts.StateSucceeded)
	if n := h.count("acme/bystander", contracts.EventRequeued); n != 0 {
		t.Errorf("the job on a healthy GPU was moved: %s", h.types("acme/bystander"))
	}
	waitFor(t, 30*time.Second, "the unhealthy GPU held in GET /v1/nodes/"+node, func() (bool, string) {
		var st contracts.NodeStatus
		if code, b := s.callAPI(t, http.MethodGet, "/v1/nodes/"+node, nil, &st); code != http.StatusOK {
			return false, fmt.Sprintf("%d %s", code, b)
		}
		if st.Admin == nil {
			return false, "no hold"
		}
		h, ok := st.Admin.GPUs[gpu.UUID]
		return ok && h.Cordoned && h.Cause == contracts.ReasonGPUUnhealthy, fmt.Sprintf("%+v", st.Admin)
	})
	s.checkOracle(t)
}

// injectFault sends a fault command to a simulated node.
func injectFault(t testing.TB, ctx context.Context, s *stack, node string, f contracts.Fault) {
	t.Helper()
	cmd := contracts.NodeCommand{SchemaVersion: 1, Kind: contracts.CommandInjectFault, Fault: &f, Time: time.Now().UTC()}
	body, _ := json.Marshal(cmd)
	if _, err := s.js.Publish(ctx, contracts.SubjectNodeCommands(node), body,
		jetstream.WithMsgID(contracts.FaultCommandID(node, f.ID))); err != nil {
		t.Fatal(err)
	}
}

// TestMachineDeathRequeuesItsJobs kills a machine under a running job: the
// resource manager declares it lost after three missed heartbeats, the job
// is requeued as attempt 2 (node_lost) and finishes on the other machine.
func TestMachineDeathRequeuesItsJobs(t *testing.T) {
	s := startStack(t, fourGPUFleet(2), withScheduler(time.Second, time.Second))
	h := s.watchHistory(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	four := contracts.Resources{GPU: contracts.GPURequest{Count: 4, Model: "H100-80GB"}}
	s.submitJob(t, ctx, "acme", contracts.JobRequest{ID: "doomed", Resources: four,
		Run: contracts.RunSpec{Duration: contracts.Duration(20 * time.Second), Checkpoint: true}})
	run := h.awaitState(t, time.Minute, "acme/doomed", contracts.StateRunning)
	node := run.Placement.NodeID
	injectFault(t, ctx, s, node, contracts.Fault{ID: "e2e-death", Kind: contracts.FaultMachineDeath})
	req := h.await(t, 40*time.Second, "acme/doomed", "requeued", isType(contracts.EventRequeued, 2))
	if req.Reason != contracts.ReasonNodeLost {
		t.Errorf("requeued with %s, want node_lost", req.Reason)
	}
	again := h.await(t, 30*time.Second, "acme/doomed", "scheduled again", isType(contracts.EventScheduled, 2))
	if again.Placement == nil || again.Placement.NodeID == node {
		t.Errorf("attempt 2 placed on %+v, want the surviving machine", again.Placement)
	}
	h.awaitState(t, time.Minute, "acme/doomed", contracts.StateSucceeded)
	s.checkOracle(t)
}

// checkpoints lists the checkpoints the runs of a job reported, in order.
func (s *stack) checkpoints(t testing.TB, tenant, job string) []string {
	t.Helper()
	var out []string
	for _, m := range s.streamMsgs(t, contracts.StreamRuns) {
		var r contracts.RunEvent
		if json.Unmarshal(m.Data(), &r) == nil && r.Kind == contracts.RunCheckpointed && r.Tenant == tenant &&
			r.JobID == job && r.Checkpoint != nil {
			out = append(out, r.Checkpoint.Name)
		}
	}
	return out
}

// TestMachineDeathMidMigrationKeepsTheJob drains a machine (a migration
// that asks the job for a checkpoint) and kills it at once, so the
// migration dies half way: the checkpoint may or may not have been
// written. The job is not lost: it is requeued, resumes on the other
// machine from its last complete checkpoint (one it reported), announces
// the move, and succeeds, running less than its full length again.
func TestMachineDeathMidMigrationKeepsTheJob(t *testing.T) {
	s := startStack(t, fourGPUFleet(2), withScheduler(time.Second, time.Second))
	h := s.watchHistory(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const length = 12 * time.Second
	s.submitJob(t, ctx, "acme", contracts.JobRequest{ID: "resilient",
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 4, Model: "H100-80GB"}},
		Run:       contracts.RunSpec{Duration: contracts.Duration(length), Checkpoint: true}})
	run := h.awaitState(t, time.Minute, "acme/resilient", contracts.StateRunning)
	node := run.Placement.NodeID
	time.Sleep(2 * time.Second) // progress worth keeping
	// A checkpoint the user asked for: the fallback if the migration's own
	// is never written.
	if code, b := s.callAPI(t, http.MethodPost, "/v1/tenants/acme/jobs/resilient/checkpoint", nil, nil); code != http.StatusAccepted {
		t.Fatalf("checkpoint: %d %s", code, b)
	}
	waitFor(t, 20*time.Second, "the requested checkpoint reported", func() (bool, string) {
		c := s.checkpoints(t, "acme", "resilient")
		return len(c) > 0, fmt.Sprint(c)
	})
	if code, b := s.callAPI(t, http.MethodPost, "/v1/nodes/"+node+"/drain", contracts.NodeAdminRequest{Reason: "e2e"}, nil); code != http.StatusOK {
		t.Fatalf("drain: %d %s", code, b)
	}
	injectFault(t, ctx, s, node, contracts.Fault{ID: "e2e-death-mid-move", Kind: contracts.FaultMachineDeath})

	moved := h.await(t, 60*time.Second, "acme/resilient", "migrated", isType(contracts.EventMigrated, 2))
	reported := s.checkpoints(t, "acme", "resilient")
	if moved.Migration == nil || moved.Migration.RestoredFrom == "" || !slices.Contains(reported, moved.Migration.RestoredFrom) {
		t.Fatalf("migrated %+v (%+v); checkpoints reported %v", moved, moved.Migration, reported)
	}
	again := h.await(t, 30*time.Second, "acme/resilient", "running again", isType(contracts.EventRunning, 2))
	if again.Placement == nil || again.Placement.NodeID == node {
		t.Fatalf("attempt 2 on %+v, want the other machine", again.Placement)
	}
	end := h.awaitState(t, time.Minute, "acme/resilient", contracts.StateSucceeded)
	if end.Attempt != 2 || end.StartedAt == nil || end.EndedAt == nil || end.EndedAt.Sub(*end.StartedAt) > length-time.Second {
		t.Errorf("ended %+v: attempt 2 should resume, not rerun all %s", end, length)
	}
	t.Logf("events: %s; restored %s of %v", h.types("acme/resilient"), moved.Migration.RestoredFrom, reported)
	s.checkOracle(t)
}
