package state

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// harness drives a Store the way the scheduler does and plays the bus: it
// "publishes" what the store returns, keeping every job event with its
// stream sequence, and folds each job's events with contracts.JobStatus to
// prove the sequence is one readers accept.
type harness struct {
	t        *testing.T
	st       *Store
	now      time.Time
	seq      uint64 // JOB_EVENTS sequence
	jobsSeq  uint64 // JOBS sequence
	wakes    int
	events   []published
	ids      map[string]int
	commands []contracts.NodeCommand
	status   map[string]*contracts.JobStatus
	plans    []contracts.Plan
	// facts and cancels are every fact and cancel request given to the
	// store, kept so restart can rebuild a new store from them.
	facts      []func(*Store) []Publish
	cancels    [][2]string
	cancelSeqs []uint64
	// opts configure every store, the rebuilt ones too.
	opts []func(*Config)
	// recalls counts the jobs read back from the log (recall), and
	// recalledFound those the log held.
	recalls, recalledFound int
}

type published struct {
	seq uint64
	id  string
	ev  contracts.JobEvent
}

func newHarness(t *testing.T, opts ...func(*Config)) *harness {
	t.Helper()
	h := &harness{t: t, now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), ids: map[string]int{},
		status: map[string]*contracts.JobStatus{}, opts: opts}
	h.st = h.newStore(opts...)
	h.collect(h.st.GoLive())
	// Jobs without moves read a shared zero record (jobmoves.go): a write
	// through moves() instead of movesW() would give every job its fields.
	t.Cleanup(func() {
		if !reflect.ValueOf(noMoves).IsZero() {
			t.Errorf("the shared empty jobMoves was written: %+v", noMoves)
		}
	})
	return h
}

func (h *harness) newStore(opts ...func(*Config)) *Store {
	cfg := Config{Scheduler: "sched", Boot: fmt.Sprintf("b%d", len(h.plans)), Now: func() time.Time { return h.now },
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Wake: func() { h.wakes++ },
		MaxReservations: 4}
	for _, o := range opts {
		o(&cfg)
	}
	return New(cfg)
}

func (h *harness) collect(pubs []Publish) {
	h.t.Helper()
	for _, p := range pubs {
		h.ids[p.ID]++
		switch m := p.Msg.(type) {
		case contracts.JobEvent:
			h.seq++
			h.events = append(h.events, published{seq: h.seq, id: p.ID, ev: m})
			if p.Subject != contracts.SubjectJobEvents(m.Tenant, m.JobID) {
				h.t.Fatalf("event %s on subject %s", p.ID, p.Subject)
			}
			st := h.status[Key(m.Tenant, m.JobID)]
			if st == nil {
				st = &contracts.JobStatus{}
				h.status[Key(m.Tenant, m.JobID)] = st
			}
			if err := st.Apply(m, h.seq); err != nil && m.Reason != contracts.ReasonDuplicateJobID {
				h.t.Fatalf("event %s is not a valid transition for readers: %v", p.ID, err)
			}
		case contracts.NodeCommand:
			h.commands = append(h.commands, m)
		default:
			h.t.Fatalf("unexpected message %T", p.Msg)
		}
	}
}

func (h *harness) submit(tenant string, body any) Submission {
	h.t.Helper()
	h.jobsSeq++
	return h.published(h.decide(ParseSubmit(contracts.SubjectSubmit(tenant), h.body(body)), h.jobsSeq))
}

// decide is SubmitParsed as the intake calls it: a Recall is answered
// from the log the harness holds (recall), and the request decided again.
func (h *harness) decide(p ParsedSubmit, seq uint64) Submission {
	h.t.Helper()
	sub := h.st.SubmitParsed(p, seq)
	for tries := 0; len(sub.Recall) > 0; tries++ {
		if tries == 2 {
			h.t.Fatalf("request %d still asks for %v after two reads of the log", seq, sub.Recall)
		}
		h.recall(&p, sub.Recall)
		sub = h.st.SubmitParsed(p, seq)
	}
	return sub
}

// recall answers a Recall from the events the harness published, each
// read back from its JSON as the scheduler reads JOB_EVENTS, and folded
// by FoldRecalled.
func (h *harness) recall(p *ParsedSubmit, keys []string) {
	h.t.Helper()
	for _, key := range keys {
		tenant, id, _ := strings.Cut(key, "/")
		var evs []contracts.JobEvent
		for _, e := range h.events {
			if e.ev.Tenant == tenant && e.ev.JobID == id {
				var ev contracts.JobEvent
				if err := json.Unmarshal(mustJSON(h.t, e.ev), &ev); err != nil {
					h.t.Fatal(err)
				}
				evs = append(evs, ev)
			}
		}
		r := FoldRecalled(tenant, id, evs)
		p.Recall(key, r)
		h.recalls++
		if r.Found {
			h.recalledFound++
		}
	}
}

// body is a request body: a string as it is, anything else encoded.
func (h *harness) body(body any) []byte {
	h.t.Helper()
	if b, ok := body.(string); ok {
		return []byte(b)
	}
	data, err := json.Marshal(body)
	if err != nil {
		h.t.Fatal(err)
	}
	return data
}

// submitParsed is submit of a request parsed earlier (ParseSubmit), as
// the intake parses it outside the scheduler's lock.
func (h *harness) submitParsed(p ParsedSubmit) Submission {
	h.t.Helper()
	h.jobsSeq++
	return h.published(h.decide(p, h.jobsSeq))
}

// published collects sub's event, if any, and records it stored.
func (h *harness) published(sub Submission) Submission {
	h.t.Helper()
	if sub.Publish != nil {
		h.collect([]Publish{*sub.Publish})
		sub.Published(h.seq)
	}
	return sub
}

func (h *harness) cancel(tenant, jobID string) error {
	h.t.Helper()
	data, _ := json.Marshal(contracts.CancelRequest{JobID: jobID, Reason: "no longer needed"})
	h.jobsSeq++
	h.cancels = append(h.cancels, [2]string{contracts.SubjectCancel(tenant), string(data)})
	h.cancelSeqs = append(h.cancelSeqs, h.jobsSeq)
	pubs, err := h.st.Cancel(contracts.SubjectCancel(tenant), data)
	h.collect(pubs)
	return err
}

func (h *harness) cycle() CycleResult {
	h.t.Helper()
	res := h.st.Cycle()
	h.collect(res.Publish)
	h.plans = append(h.plans, res.Plans...)
	return res
}

// fact applies f to the store and remembers it for restart.
func (h *harness) fact(f func(*Store) []Publish) {
	h.t.Helper()
	h.facts = append(h.facts, f)
	h.collect(f(h.st))
}

func (h *harness) inventory(id, pool, model string, mem int64, n int) {
	inv := contracts.NodeInventory{SchemaVersion: 1, NodeID: id, Pool: pool, Incarnation: "i1", Time: h.now}
	for i := range n {
		inv.GPUs = append(inv.GPUs, contracts.GPUInfo{Index: i, UUID: fmt.Sprintf("%s-gpu%d", id, i), Model: model,
			MemoryMiB: mem, Healthy: true})
	}
	h.fact(func(s *Store) []Publish { s.ApplyInventory(inv); return nil })
}

func (h *harness) nodeEvent(id string, kind contracts.NodeLifecycleKind) {
	h.fact(func(s *Store) []Publish {
		s.ApplyNodeEvent(contracts.NodeEvent{SchemaVersion: 1, Kind: kind, NodeID: id})
		return nil
	})
}

func (h *harness) commit(a contracts.Allocation) {
	h.t.Helper()
	e := contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerCommitted, Allocation: a, Time: h.now}
	h.fact(func(s *Store) []Publish { return s.ApplyLedger(e) })
}

func (h *harness) release(a contracts.Allocation, reason contracts.Reason, run *contracts.RunResult) {
	h.t.Helper()
	e := contracts.LedgerEntry{SchemaVersion: 1, Kind: contracts.LedgerReleased, Allocation: a, Time: h.now,
		Reason: reason, Run: run}
	h.fact(func(s *Store) []Publish { return s.ApplyLedger(e) })
}

func (h *harness) refuse(a contracts.Allocation, reason contracts.Reason) {
	h.t.Helper()
	r := contracts.Refusal{SchemaVersion: 1, PlanID: a.PlanID, AllocationID: a.ID, Tenant: a.Tenant,
		JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Reason: reason, Message: "test refusal", Time: h.now}
	h.fact(func(s *Store) []Publish { return s.ApplyRefusal(r) })
}

func (h *harness) started(a contracts.Allocation, at time.Time) {
	h.t.Helper()
	r := contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunStarted, AllocationID: a.ID,
		Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Devices: a.Devices, Time: at}
	h.fact(func(s *Store) []Publish { return s.ApplyRun(r) })
}

func (h *harness) checkpointed(a contracts.Allocation, name string, requested bool) {
	h.t.Helper()
	r := contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunCheckpointed, AllocationID: a.ID,
		Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Devices: a.Devices, Time: h.now,
		Checkpoint: &contracts.Checkpoint{Name: name, Dir: "/ckpt/" + name, Requested: requested, Time: h.now}}
	h.fact(func(s *Store) []Publish { return s.ApplyRun(r) })
}

func (h *harness) ended(a contracts.Allocation, res contracts.RunResult) {
	h.t.Helper()
	r := contracts.RunEvent{SchemaVersion: 1, Kind: contracts.RunEnded, AllocationID: a.ID,
		Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID, Devices: a.Devices, Time: res.EndedAt,
		Result: &res}
	h.fact(func(s *Store) []Publish { return s.ApplyRun(r) })
}

// restart replaces the store with a new one rebuilt the way the scheduler
// does after a restart: its own events, the cancels, its plans, then every
// fact from the beginning, then GoLive.
func (h *harness) restart() {
	h.t.Helper()
	st := h.newStore(h.opts...)
	for i, p := range h.events {
		st.ReplayJobEvent(p.ev, p.seq, p.id)
		if i%50 == 49 {
			// As the scheduler's replay retires as it goes (every 64k
			// messages there): a job may be retired, or forgotten, before
			// the last of its subject's events is read.
			st.RetireTerminal()
		}
	}
	for i, c := range h.cancels {
		st.ReplayCancel(c[0], []byte(c[1]), h.cancelSeqs[i])
	}
	for _, p := range h.plans {
		st.ReplayPlan(p)
	}
	for _, f := range h.facts {
		if pubs := f(st); len(pubs) > 0 {
			h.t.Fatalf("a store that is not live published %d messages", len(pubs))
		}
	}
	if missing := st.MissingDependencies(); len(missing) > 0 {
		var p ParsedSubmit // the scheduler's rebuild reads them as its intake does
		h.recall(&p, missing)
		for key, r := range p.recalled {
			st.Remember(key, r)
		}
	}
	h.st = st
	h.collect(st.GoLive())
}

// types lists the event types published for one job, in order.
func (h *harness) types(tenant, jobID string) []string {
	var out []string
	for _, p := range h.events {
		if p.ev.Tenant == tenant && p.ev.JobID == jobID {
			s := string(p.ev.Type)
			if p.ev.Reason != "" && (p.ev.Type == contracts.EventPending || p.ev.Type == contracts.EventRejected) {
				s += ":" + string(p.ev.Reason)
			}
			out = append(out, s)
		}
	}
	return out
}

// last returns the last event of a job.
func (h *harness) last(tenant, jobID string) contracts.JobEvent {
	h.t.Helper()
	for i := len(h.events) - 1; i >= 0; i-- {
		if e := h.events[i].ev; e.Tenant == tenant && e.JobID == jobID {
			return e
		}
	}
	h.t.Fatalf("no event for %s/%s", tenant, jobID)
	return contracts.JobEvent{}
}

// item finds the latest plan item of a job.
func (h *harness) item(tenant, jobID string) contracts.Allocation {
	h.t.Helper()
	for i := len(h.plans) - 1; i >= 0; i-- {
		for _, it := range h.plans[i].Items {
			if it.Tenant == tenant && it.JobID == jobID {
				return it
			}
		}
	}
	h.t.Fatalf("no plan item for %s/%s", tenant, jobID)
	return contracts.Allocation{}
}

// noDuplicates fails when any message ID was published twice.
func (h *harness) noDuplicates() {
	h.t.Helper()
	for id, n := range h.ids {
		if n > 1 {
			h.t.Errorf("message %s published %d times", id, n)
		}
	}
}

func job(id string, gpus int, model string) contracts.JobRequest {
	return contracts.JobRequest{ID: id, Resources: contracts.Resources{GPU: contracts.GPURequest{Count: gpus, Model: model}},
		Run: contracts.RunSpec{Duration: contracts.Duration(time.Minute)}}
}

func mustJSON(tb testing.TB, v any) []byte {
	tb.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		tb.Fatal(err)
	}
	return b
}
