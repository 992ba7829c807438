package state

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

func remember(d time.Duration) func(*Config) {
	return func(c *Config) { c.RememberEnded = d }
}

// TestForgettingDecidesAsRemembering runs one random workload on two
// stores in step: one that keeps every retired job's record for ever, and
// one that forgets a record an hour after its job ended and reads the job
// back from the log when a submit names it (Recall, FoldRecalled). Jobs
// succeed, fail, are cancelled or rejected; new submits depend on old
// jobs (some long forgotten, some rejected, some never submitted), old
// IDs come back with the same body or another, and jobs too big to fit
// wait for days on dependencies that ended long ago (pins). Time moves by
// minutes to days, and both restart now and then. Every decision must be
// the same: each submit's outcome, and every event both publish (ID,
// type, state, reason and message, so a "not recorded yet" in a waiting
// job's reason shows). At the end, once every job has ended, the
// forgetting store holds nothing while the other holds every record.
func TestForgettingDecidesAsRemembering(t *testing.T) {
	for seed := range uint64(6) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 41))
			hs := [2]*harness{
				newHarness(t, retain(time.Minute, 0)),
				newHarness(t, retain(time.Minute, 0), remember(time.Hour)),
			}
			both := func(f func(h *harness)) {
				for _, h := range hs {
					f(h)
				}
			}
			both(func(h *harness) { h.inventory("n1", "p", h100, 81920, 8) })
			bodies := map[string]contracts.JobRequest{}
			var ids []string
			var running [2][]contracts.Allocation
			seen := 0
			step := 0
			same := func(what string) {
				t.Helper()
				a, b := hs[0].events[seen:], hs[1].events[seen:]
				if len(a) != len(b) {
					t.Fatalf("step %d (%s): %d events remembering, %d forgetting:\n%v\n%v", step, what, len(a), len(b), evLines(a), evLines(b))
				}
				if la, lb := evLines(a), evLines(b); !slices.Equal(la, lb) {
					t.Fatalf("step %d (%s): events differ:\nremembering %v\nforgetting  %v", step, what, la, lb)
				}
				seen = len(hs[0].events)
			}
			// agree runs decide on both stores and requires the same
			// outcome, then the same events.
			agree := func(what string, decide func(h *harness) string) {
				t.Helper()
				var out [2]string
				for i, h := range hs {
					out[i] = decide(h)
				}
				if out[0] != out[1] {
					t.Fatalf("step %d: %s: %s remembering, %s forgetting", step, what, out[0], out[1])
				}
				same(what)
			}
			pick := func() string {
				if len(ids) == 0 || rng.IntN(12) == 0 {
					return "never"
				}
				return ids[rng.IntN(len(ids))]
			}
			for step = range 600 {
				switch op := rng.IntN(20); {
				case op < 7: // a new job
					id := fmt.Sprintf("j%03d", len(ids))
					r := job(id, 1+rng.IntN(4), h100)
					switch rng.IntN(10) {
					case 0:
						r.Priority = "urgent" // rejected
					case 1:
						r.Resources.GPU.Count = 16 // never fits: waits on its dependencies for ever
						r.DependsOn = []string{pick()}
					case 2, 3, 4:
						r.DependsOn = []string{pick()}
						if rng.IntN(3) == 0 {
							r.DependsOn = append(r.DependsOn, pick())
						}
						slices.Sort(r.DependsOn)
						r.DependsOn = slices.Compact(r.DependsOn)
					}
					ids = append(ids, id)
					bodies[id] = r
					agree("submit "+id, func(h *harness) string { return h.submit("acme", r).Outcome })
				case op < 8: // a new job whose queued event is stored but whose ack is lost: redelivered
					id := fmt.Sprintf("j%03d", len(ids))
					r := job(id, 1+rng.IntN(4), h100)
					ids = append(ids, id)
					bodies[id] = r
					agree("redelivered "+id, func(h *harness) string {
						h.jobsSeq++
						p := ParseSubmit(contracts.SubjectSubmit("acme"), h.body(r))
						if sub := h.decide(p, h.jobsSeq); sub.Publish != nil {
							h.collect([]Publish{*sub.Publish})
							sub.Abandoned()
						}
						sub := h.decide(p, h.jobsSeq)
						if sub.Publish != nil {
							// JetStream drops the same message ID: acked
							// with the stored event's sequence.
							sub.Published(h.seq)
						}
						return sub.Outcome
					})
				case op < 10: // an old ID again: its body, or another
					id := pick()
					r, ok := bodies[id]
					if !ok || rng.IntN(2) == 0 {
						r = job(id, 5, h100)
					}
					agree("resubmit "+id, func(h *harness) string { return h.submit("acme", r).Outcome })
				case op < 11: // a cancel
					id := pick()
					var errs [2]error
					for i, h := range hs {
						errs[i] = h.cancel("acme", id)
					}
					if (errs[0] == nil) != (errs[1] == nil) || (errs[0] != nil && !errors.Is(errs[1], ErrUnknownJob) && !errors.Is(errs[1], ErrTerminalJob)) {
						t.Fatalf("step %d: cancel %s: %v remembering, %v forgetting", step, id, errs[0], errs[1])
					}
					same("cancel " + id)
				case op < 15: // a cycle; what it places starts, and some of it ends
					var items [2][]contracts.Allocation
					for i, h := range hs {
						for _, p := range h.cycle().Plans {
							items[i] = append(items[i], p.Items...)
						}
					}
					if a, b := allocLines(items[0]), allocLines(items[1]); !slices.Equal(a, b) {
						t.Fatalf("step %d: placed\n%v remembering\n%v forgetting", step, a, b)
					}
					for i, h := range hs {
						for _, a := range items[i] {
							h.commit(a)
							h.started(a, h.now)
						}
						running[i] = append(running[i], items[i]...)
					}
					same("cycle")
					fallthrough
				case op < 17: // some runs end
					for len(running[0]) > 0 && rng.IntN(3) != 0 {
						k := rng.IntN(len(running[0]))
						out := contracts.OutcomeSucceeded
						if rng.IntN(4) == 0 {
							out = contracts.OutcomeFailed
						}
						for i, h := range hs {
							a := running[i][k]
							res := contracts.RunResult{Outcome: out, StartedAt: h.now, EndedAt: h.now}
							h.ended(a, res)
							h.release(a, contracts.ReasonRunEnded, &res)
							running[i] = slices.Delete(running[i], k, k+1)
						}
					}
					same("runs end")
				case op < 19: // time passes: minutes, hours, or days
					d := time.Duration(1+rng.IntN(10)) * time.Minute
					switch rng.IntN(10) {
					case 0:
						d = time.Duration(24+rng.IntN(48)) * time.Hour
					case 1, 2, 3, 4:
						d = time.Duration(10+rng.IntN(120)) * time.Minute
					}
					both(func(h *harness) { h.now = h.now.Add(d); h.st.RetireTerminal() })
				default:
					if rng.IntN(4) == 0 {
						both(func(h *harness) { h.restart() })
						same("restart")
					}
				}
			}
			if hs[1].recalledFound == 0 {
				t.Fatalf("the forgetting store read back %d jobs from the log, none found: the test proves little", hs[1].recalls)
			}
			// Everything ends; two days later the forgetting store holds
			// nothing, and answers as the other still.
			for _, id := range ids {
				both(func(h *harness) { _ = h.cancel("acme", id) })
			}
			for i, h := range hs {
				for _, a := range running[i] {
					res := contracts.RunResult{Outcome: contracts.OutcomeFailed, StartedAt: h.now, EndedAt: h.now}
					h.ended(a, res)
					h.release(a, contracts.ReasonRunEnded, &res)
				}
			}
			same("cancel all")
			both(func(h *harness) { h.now = h.now.Add(48 * time.Hour); h.st.RetireTerminal() })
			whole, retired := hs[1].st.Retained()
			for k, j := range hs[1].st.jobs {
				t.Logf("whole: %s %s parts %d", k, j.State, len(j.parts))
			}
			if whole != 0 || retired != 0 || len(hs[1].st.ret.pins) != 0 || len(hs[1].st.ret.why) != 0 {
				t.Fatalf("two days after the last end the forgetting store holds %d whole jobs, %d records, %d pins, %d reasons",
					whole, retired, len(hs[1].st.ret.pins), len(hs[1].st.ret.why))
			}
			if _, r := hs[0].st.Retained(); r == 0 {
				t.Fatal("the remembering store holds no record")
			}
			for _, id := range ids[:min(len(ids), 40)] {
				r := bodies[id]
				agree("after all: resubmit "+id, func(h *harness) string { return h.submit("acme", r).Outcome })
			}
			t.Logf("%d jobs, %d read back from the log (%d found)", len(ids), hs[1].recalls, hs[1].recalledFound)
		})
	}
}

func evLines(ps []published) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		e := p.ev
		out[i] = fmt.Sprintf("%s %s %s %s %q", p.id, e.Type, e.State, e.Reason, e.Message)
	}
	return out
}

func allocLines(as []contracts.Allocation) []string {
	out := make([]string, len(as))
	for i, a := range as {
		out[i] = strings.Join([]string{a.Tenant, a.JobID, a.NodeID, fmt.Sprint(a.Devices, a.Attempt)}, " ")
	}
	return out
}

// TestCompactorForgetsButWhatLiveJobsNeed: the snapshot's compactor
// forgets an ended job's record RememberEnded after its end (by the log's
// time), but for one a live job depends on, however long that job waits;
// the pin goes with the dependent's end. A compactor started from its
// snapshot (with a shorter keep, even) keeps the pinned record, and a
// snapshot says that it forgot, so a store restored from it reads the
// log for what it does not hold.
func TestCompactorForgetsButWhatLiveJobsNeed(t *testing.T) {
	t0 := time.Date(2026, 11, 27, 11, 0, 0, 0, time.UTC)
	var log []*LogMsg
	ev := func(id string, at time.Duration, typ contracts.JobEventType, deps ...string) {
		e := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: typ, Tenant: "t1", JobID: id,
			Attempt: 1, Time: t0.Add(at)}
		if typ == contracts.EventQueued {
			e.Request = &contracts.JobRequest{SchemaVersion: 1, ID: id, Tenant: "t1", DependsOn: deps,
				Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 64, Model: "h100"}}}
		}
		log = append(log, &LogMsg{Stream: contracts.StreamJobEvents, Seq: uint64(len(log) + 1),
			Subject: contracts.SubjectJobEvents("t1", id), Header: map[string][]string{
				contracts.HeaderMsgID: {contracts.JobEventID("t1", id, typ, 1, len(log))}}, Data: mustJSON(t, e)})
	}
	const keep = time.Hour
	// The compactors' now: after every event here, whatever the day the
	// test runs (they never move their window past now).
	clock := func() time.Time { return t0.Add(365 * 24 * time.Hour) }
	ev("dep", 0, contracts.EventQueued)
	ev("other", 0, contracts.EventQueued)
	ev("dep", time.Minute, contracts.EventCancelled)
	ev("other", time.Minute, contracts.EventCancelled)
	ev("waiter", 2*time.Minute, contracts.EventQueued, "dep")
	has := func(c *Compactor, id string) bool { return c.isRetired(Key("t1", id)) }
	// Half an hour on, read back with a keep of 10 minutes: dep's bucket
	// is past that, but the waiter pins it.
	ev("tick", 30*time.Minute, contracts.EventQueued)
	early := newCompactor("s1", keep, nil, clock)
	for _, m := range log {
		early.Observe(m)
	}
	var eb bytes.Buffer
	if err := early.Snapshot().Encode(&eb); err != nil {
		t.Fatal(err)
	}
	esnap, err := DecodeSnapshot(eb.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	if short := newCompactor("s1", 10*time.Minute, esnap, clock); !has(short, "dep") || has(short, "other") {
		t.Fatalf("read back with a shorter keep: dep kept %v (pinned), other kept %v", has(short, "dep"), has(short, "other"))
	}
	ev("tick2", 10*time.Hour, contracts.EventQueued) // the log's clock moves on
	c := newCompactor("s1", keep, nil, clock)
	for _, m := range log {
		c.Observe(m)
	}
	if !has(c, "dep") || has(c, "other") || !c.Snapshot().Meta.Forgot {
		t.Fatalf("ten hours on: dep kept %v (pinned), other kept %v (not), snapshot says forgot %v",
			has(c, "dep"), has(c, "other"), c.Snapshot().Meta.Forgot)
	}
	var buf bytes.Buffer
	if err := c.Snapshot().Encode(&buf); err != nil {
		t.Fatal(err)
	}
	snap, err := DecodeSnapshot(buf.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	again := newCompactor("s1", keep/4, snap, clock)
	if !has(again, "dep") || !again.Snapshot().Meta.Forgot {
		t.Fatalf("from the snapshot, with a shorter keep: dep kept %v, forgot %v", has(again, "dep"), again.Snapshot().Meta.Forgot)
	}
	// The store restored from it: what the snapshot's live job pins is
	// held, and the store knows it may have forgotten the rest.
	st := New(Config{Scheduler: "s1", RememberEnded: keep, Now: func() time.Time { return t0.Add(10 * time.Hour) },
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Wake: func() {}})
	for _, m := range snap.Msgs {
		var e contracts.JobEvent
		if err := json.Unmarshal(m.Data, &e); err != nil {
			t.Fatal(err)
		}
		st.ReplayJobEvent(e, m.Seq, m.Header[contracts.HeaderMsgID][0])
	}
	st.Restore(snap)
	st.RetireTerminal()
	if !st.isRetired(Key("t1", "dep")) || !st.Forgetting() || len(st.MissingDependencies()) != 0 {
		t.Fatalf("restored store: dep held %v, forgetting %v, missing %v", st.isRetired(Key("t1", "dep")), st.Forgetting(),
			st.MissingDependencies())
	}
	// The waiter ends: its pin goes, and so does dep once the log moves.
	ev("waiter", 10*time.Hour+time.Minute, contracts.EventCancelled)
	ev("tick3", 20*time.Hour, contracts.EventQueued)
	for _, m := range log[len(log)-2:] {
		again.Observe(m)
	}
	if has(again, "dep") || has(again, "waiter") {
		t.Fatalf("after the waiter ended: dep kept %v, waiter kept %v", has(again, "dep"), has(again, "waiter"))
	}
}

// TestAnEventDatedAheadForgetsNothingEarly: the windows' clocks follow
// the log's times, but never past now: a terminal event dated a month
// ahead (a leader's clock off) must not make the store, or the
// compactor, forget the records of the last RememberEnded.
func TestAnEventDatedAheadForgetsNothingEarly(t *testing.T) {
	t0 := time.Date(2026, 11, 27, 11, 0, 0, 0, time.UTC)
	now := t0.Add(2 * time.Hour)
	mk := func(id string, at time.Time, typ contracts.JobEventType) contracts.JobEvent {
		e := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: typ, Tenant: "t1", JobID: id, Attempt: 1, Time: at}
		if typ == contracts.EventQueued {
			e.Request = &contracts.JobRequest{SchemaVersion: 1, ID: id, Tenant: "t1",
				Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "h100"}}}
		}
		return e
	}
	// "ahead" ends first, so the store retires it first (by count: it
	// ended "later" than now).
	evs := []contracts.JobEvent{
		mk("ahead", t0, contracts.EventQueued), mk("ahead", t0.Add(30*24*time.Hour), contracts.EventCancelled),
		mk("recent", t0, contracts.EventQueued), mk("recent", t0.Add(time.Hour), contracts.EventCancelled),
	}
	st := New(Config{Scheduler: "s1", RememberEnded: 48 * time.Hour, RetainTerminal: time.Minute, RetainTerminalMax: 1,
		Now: func() time.Time { return now }, Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Wake: func() {}})
	c := newCompactor("s1", 48*time.Hour, nil, func() time.Time { return now })
	for i, e := range evs {
		st.ReplayJobEvent(e, uint64(i+1), "")
		c.Observe(&LogMsg{Stream: contracts.StreamJobEvents, Seq: uint64(i + 1), Subject: contracts.SubjectJobEvents("t1", e.JobID),
			Header: map[string][]string{}, Data: mustJSON(t, e)})
	}
	st.RetireTerminal()
	if !st.isRetired(Key("t1", "recent")) || st.Forgetting() {
		t.Fatalf("store: recent held %v, forgetting %v", st.isRetired(Key("t1", "recent")), st.Forgetting())
	}
	if !c.isRetired(Key("t1", "recent")) || c.Snapshot().Meta.Forgot {
		t.Fatalf("compactor: recent held %v, forgot %v", c.isRetired(Key("t1", "recent")), c.Snapshot().Meta.Forgot)
	}
}

// TestADependencyIsPinnedFromItsDecision: a submit that depends on an
// ended job pins the job's record when it is decided, not when its queued
// event is stored: the record must not be forgotten while the event is in
// flight, and a publish that fails gives the pin back. (From a review: the
// pin came with the commit, and a retirement in between left the
// dependent waiting for ever.)
func TestADependencyIsPinnedFromItsDecision(t *testing.T) {
	h := newHarness(t, retain(time.Minute, 0), remember(time.Hour))
	h.inventory("n1", "p", h100, 81920, 8)
	h.submit("acme", job("dep", 1, h100))
	if err := h.cancel("acme", "dep"); err != nil {
		t.Fatal(err)
	}
	h.now = h.now.Add(2 * time.Minute)
	h.st.RetireTerminal()
	r := job("waiter", 1, h100)
	r.DependsOn = []string{"dep"}
	decide := func() Submission {
		h.jobsSeq++
		sub := h.decide(ParseSubmit(contracts.SubjectSubmit("acme"), mustJSON(t, r)), h.jobsSeq)
		if sub.Outcome != "queued" {
			t.Fatalf("outcome %s", sub.Outcome)
		}
		return sub
	}
	// A publish that fails gives the pin back: dep is forgotten in time.
	decide().Abandoned()
	h.now = h.now.Add(2 * time.Hour)
	h.st.RetireTerminal()
	if h.st.isRetired(Key("acme", "dep")) || len(h.st.ret.pins) != 0 {
		t.Fatalf("after an abandoned submit: dep held %v, pins %d", h.st.isRetired(Key("acme", "dep")), len(h.st.ret.pins))
	}
	// Read back (the store forgot it), decided, and the retirement runs
	// hours later, before the queued event is stored.
	sub := decide()
	h.now = h.now.Add(3 * time.Hour)
	h.st.RetireTerminal()
	h.published(sub)
	if m := h.st.MissingDependencies(); len(m) != 0 {
		t.Fatalf("the queued job lost its dependency %v: it would wait for ever", m)
	}
}

// TestFoldAgreesWithReplayOnARequestlessQueuedEvent: a queued event
// without its request (hand-made) still makes a job in a replay; the fold
// must find the same job, or a forgetting store would accept a second job
// under its ID. (From a review.)
func TestFoldAgreesWithReplayOnARequestlessQueuedEvent(t *testing.T) {
	evs := []contracts.JobEvent{
		{Type: contracts.EventQueued, Tenant: "acme", JobID: "y", Attempt: 1},
		{Type: contracts.EventCancelled, Tenant: "acme", JobID: "y", Attempt: 1},
	}
	h := newHarness(t)
	for i, e := range evs {
		h.st.ReplayJobEvent(e, uint64(i+1), "")
	}
	j := h.st.lookup("acme", "y")
	r := FoldRecalled("acme", "y", evs)
	if j == nil || !r.Found || r.State() != j.State || r.rec.hash != hash64(j.hash) {
		t.Fatalf("replay holds %+v; fold found %v in state %s", j, r.Found, r.State())
	}
}

// TestCyclesReportMissingDependencies: a waiting job whose dependency the
// store does not hold ("not recorded yet") is reported, once a cycle saw
// it and while the store forgets, for the scheduler to read back
// (TakeMissing: a net under the pins, cheaper than walking every job).
// And a snapshot whose clock is ahead (its leader's clock was off) is
// read back at now, not ahead.
func TestCyclesReportMissingDependencies(t *testing.T) {
	h := newHarness(t, retain(time.Minute, 0), remember(time.Hour))
	h.inventory("n1", "p", h100, 81920, 8)
	h.submit("acme", job("old", 1, h100))
	_ = h.cancel("acme", "old")
	for range 4 {
		h.now = h.now.Add(time.Hour)
		h.st.RetireTerminal()
	}
	if !h.st.Forgetting() {
		t.Fatal("setup: the store forgot nothing")
	}
	r := job("w", 1, h100).Normalized("acme")
	r.DependsOn = []string{"ghost"} // a stream edited by hand
	ev := contracts.JobEvent{SchemaVersion: 1, Type: contracts.EventQueued, Tenant: "acme", JobID: "w",
		Attempt: 1, State: contracts.StateQueued, Time: h.now, Request: &r}
	h.collect([]Publish{{Subject: contracts.SubjectJobEvents("acme", "w"), ID: "hand-made", Msg: ev}})
	h.st.ReplayJobEvent(ev, h.seq, "hand-made")
	if got := h.st.TakeMissing(); len(got) != 0 {
		t.Fatalf("reported %v before any cycle", got)
	}
	h.cycle()
	if got := h.st.TakeMissing(); !slices.Equal(got, []string{"acme/ghost"}) {
		t.Fatalf("after a cycle: %v, want [acme/ghost]", got)
	}
	if got := h.st.TakeMissing(); len(got) != 0 {
		t.Fatalf("taken twice: %v", got)
	}

	c := newCompactor("s1", time.Hour, nil, func() time.Time { return h.now })
	snap := c.Snapshot()
	snap.Meta.Clock = h.now.Add(30 * 24 * time.Hour)
	h.st.Restore(snap)
	if got := h.st.ret.retired.Clock(); got.After(h.now) {
		t.Fatalf("restored a window at %v, ahead of now %v", got, h.now)
	}
}
