package state

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	segjson "github.com/segmentio/encoding/json"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestCompactorSnapshotKeepsMessagesWhole: the compactor keeps each
// message encoded, and its snapshot, encoded and decoded again, gives
// back every kept message as it was fed (stream, sequence, subject,
// every header value, body), each once, by stream then sequence, for
// bare and labelled logs of several seeds.
func TestCompactorSnapshotKeepsMessagesWhole(t *testing.T) {
	for _, c := range []struct {
		seed uint64
		bare bool
	}{{1, true}, {2, false}, {3, false}} {
		t.Run(fmt.Sprint(c.seed, c.bare), func(t *testing.T) {
			log := compactorLog(t, 400, c.seed, c.bare)
			// Headers of several values and keys, as a message may carry.
			for i, m := range log {
				if i%7 == 0 {
					m.Header["traceparent"] = []string{"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
					m.Header["tracestate"] = []string{"a=1", "b=2"}
				}
			}
			fed := map[string]*LogMsg{}
			comp := NewCompactor("s1", 0, nil)
			for _, m := range log {
				fed[fmt.Sprintf("%s/%d", m.Stream, m.Seq)] = m
				comp.Observe(m)
			}
			snap := comp.Snapshot()
			var buf bytes.Buffer
			if err := snap.Encode(&buf); err != nil {
				t.Fatal(err)
			}
			got, err := DecodeSnapshot(buf.Bytes())
			if err != nil {
				t.Fatal(err)
			}
			if got.Meta.Msgs != len(got.Msgs) || len(got.Msgs) != len(snap.messages()) || len(got.Msgs) == 0 {
				t.Fatalf("meta says %d messages, decoded %d, the compactor's snapshot holds %d",
					got.Meta.Msgs, len(got.Msgs), len(snap.messages()))
			}
			for i, m := range got.Msgs {
				want := fed[fmt.Sprintf("%s/%d", m.Stream, m.Seq)]
				if want == nil {
					t.Fatalf("message %s/%d was never fed", m.Stream, m.Seq)
				}
				if m.Subject != want.Subject || !bytes.Equal(m.Data, want.Data) ||
					!maps.EqualFunc(m.Header, want.Header, slices.Equal[[]string]) {
					t.Fatalf("message %s/%d: got %q %v %q, fed %q %v %q", m.Stream, m.Seq, m.Subject, m.Header, m.Data,
						want.Subject, want.Header, want.Data)
				}
				if i > 0 {
					p := got.Msgs[i-1]
					if p.Stream > m.Stream || p.Stream == m.Stream && p.Seq >= m.Seq {
						t.Fatalf("message %s/%d after %s/%d", m.Stream, m.Seq, p.Stream, p.Seq)
					}
				}
			}
			// A decoded snapshot encodes to the same bytes (a new term's
			// compactor starts from it).
			var again bytes.Buffer
			if err := NewCompactor("s1", 0, got).Snapshot().Encode(&again); err != nil {
				t.Fatal(err)
			}
			if d, err := DecodeSnapshot(again.Bytes()); err != nil || !slices.EqualFunc(d.Msgs, got.Msgs, func(a, b *LogMsg) bool {
				return a.Stream == b.Stream && a.Seq == b.Seq && bytes.Equal(a.Data, b.Data)
			}) {
				t.Fatalf("a compactor started from the snapshot snapshots other messages (err %v)", err)
			}
		})
	}
}

// TestCompactorKeepsTheLastPendingEventOfAnAttempt: a waiting job's
// pending events (one a minute for as long as it waits, more when its
// reason changes) are kept as the last of each attempt, and a store
// replaying what the snapshot keeps ends exactly where one replaying
// every event does: the reason published and when, and the pending
// sequence the next event's ID goes on from.
func TestCompactorKeepsTheLastPendingEventOfAnAttempt(t *testing.T) {
	w := &waitingJob{t: t}
	ev := w.event
	pending := func(attempt, seq int, code contracts.Reason) {
		ev(contracts.EventPending, attempt, seq, func(e *contracts.JobEvent) {
			e.Reason, e.Message = code, fmt.Sprintf("%s, %d ahead", code, 100-seq)
		})
	}
	w.queued()
	for s := 1; s <= 5; s++ {
		pending(1, s, []contracts.Reason{contracts.PendingInsufficientGPUs, contracts.PendingQuotaExceeded}[s%2])
	}
	ev(contracts.EventRequeued, 2, 0, nil)
	for s := 1; s <= 3; s++ {
		pending(2, s, contracts.PendingInsufficientGPUs)
	}

	comp := NewCompactor("s1", 0, nil)
	for _, m := range w.log {
		comp.Observe(m)
	}
	var kept []uint64
	for _, m := range comp.Snapshot().messages() {
		kept = append(kept, m.Seq)
	}
	// queued, the fifth pending of attempt 1, requeued, the third of 2.
	if want := []uint64{1, 6, 7, 10}; !slices.Equal(kept, want) {
		t.Fatalf("kept sequences %v, want %v", kept, want)
	}

	checkPrefixes(t, w.log)
}

// TestCompactorPendingRunsReplayAsTheLog: random lives of a waiting job
// (pending events in and out of order, repeated, of another attempt, with
// IDs that carry no sequence or bodies the rebuild cannot decode, between
// requeues and placements):
// every prefix's snapshot replays to what the prefix does.
func TestCompactorPendingRunsReplayAsTheLog(t *testing.T) {
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 99))
		w := &waitingJob{t: t, legacy: true, corrupt: func() bool { return rng.IntN(12) == 0 }}
		ev := w.event
		attempt, next := 1, 1
		w.queued()
		for range 5 + rng.IntN(25) {
			a, seq := attempt, next
			switch k := rng.IntN(20); {
			case k == 0:
				attempt++
				next = 1
				ev(contracts.EventRequeued, attempt, 0, nil)
				continue
			case k == 1:
				ev(contracts.EventScheduled, attempt, 0, nil)
				continue
			case k == 2:
				seq = rng.IntN(next + 1) // lower, repeated, or none (0)
			case k == 3:
				a = attempt + rng.IntN(3) - 1 // another attempt's
			default:
				next++
			}
			ev(contracts.EventPending, a, seq, func(e *contracts.JobEvent) {
				e.Reason = []contracts.Reason{contracts.PendingInsufficientGPUs, contracts.PendingQuotaExceeded}[rng.IntN(2)]
				e.Message = fmt.Sprintf("%s, %d ahead", e.Reason, rng.IntN(100))
			})
		}
		checkPrefixes(t, w.log)
	}
}

// checkPrefixes checks, for every prefix of log (JOB_EVENTS only), that a
// store replaying a compactor's snapshot of the prefix ends where one
// replaying the prefix does, and so does one replaying what a compactor
// started from that snapshot (encoded and decoded: a new term) holds
// after the rest of the log.
func checkPrefixes(t *testing.T, log []*LogMsg) {
	t.Helper()
	whole := replayEvents(log)
	for cut := 1; cut <= len(log); cut++ {
		comp := NewCompactor("s1", 0, nil)
		for _, m := range log[:cut] {
			comp.Observe(m)
		}
		snap := comp.Snapshot()
		if got, want := replayEvents(snap.messages()), replayEvents(log[:cut]); got != want {
			t.Fatalf("after %d events, replaying the snapshot:\n%s\nreplaying every event:\n%s", cut, got, want)
		}
		var buf bytes.Buffer
		if err := snap.Encode(&buf); err != nil {
			t.Fatal(err)
		}
		decoded, err := DecodeSnapshot(buf.Bytes())
		if err != nil {
			t.Fatal(err)
		}
		next := NewCompactor("s1", 0, decoded)
		for _, m := range log { // the whole log again: what the snapshot covers is not read twice
			next.Observe(m)
		}
		if got := replayEvents(next.Snapshot().messages()); got != whole {
			t.Fatalf("cut %d, then the rest in a new term's compactor:\n%s\nreplaying every event:\n%s", cut, got, whole)
		}
	}
}

// replayEvents replays JOB_EVENTS messages into a new store as the
// rebuild does (bus.Msg.Decode's decoder; a message that does not decode
// is skipped) and returns its digest.
func replayEvents(msgs []*LogMsg) string {
	st := newBenchStore()
	for _, m := range msgs {
		var e contracts.JobEvent
		if segjson.Unmarshal(m.Data, &e) != nil {
			continue
		}
		st.ReplayJobEvent(e, m.Seq, m.Header[contracts.HeaderMsgID][0])
	}
	return st.Digest()
}

// TestCompactorPendingRunEdges: the review's counter-examples to the
// first version of pendingRun. A pending event the rebuild cannot decode
// (a message that is not a string; the compactor reads only a few
// fields) took the place of its run's top or last, which the replay
// applied; a message observed twice counted twice in its run.
func TestCompactorPendingRunEdges(t *testing.T) {
	type step struct {
		seq     int
		corrupt bool
	}
	for _, c := range []struct {
		name  string
		steps []step
		again int // index+1 of a message observed a second time at the end
	}{
		{name: "undecodable after the top", steps: []step{{1, false}, {2, false}, {3, true}}},
		{name: "undecodable after the last", steps: []step{{5, false}, {3, false}, {4, true}}},
		{name: "undecodable first", steps: []step{{1, true}, {2, false}, {3, false}}},
		{name: "observed twice", steps: []step{{5, false}, {3, false}}, again: 2},
		{name: "out of order", steps: []step{{1, false}, {2, false}, {5, false}, {3, false}, {4, false}, {4, false}, {6, false}, {2, false}, {7, false}, {1, false}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			log := waitLog(t, func(pending func(seq int, corrupt bool)) {
				for _, s := range c.steps {
					pending(s.seq, s.corrupt)
				}
			})
			comp := NewCompactor("s1", 0, nil)
			for _, m := range log {
				comp.Observe(m)
			}
			if c.again > 0 {
				comp.Observe(log[c.again-1])
			}
			if got, want := replayEvents(comp.Snapshot().messages()), replayEvents(log); got != want {
				t.Fatalf("replaying the snapshot:\n%s\nreplaying every event:\n%s", got, want)
			}
			checkPrefixes(t, log)
		})
	}
}

// waitLog is the log of a job queued once and then waiting: pending
// events of attempt 1 with the sequences add gives, a corrupt one's
// message a number (the rebuild cannot decode it).
func waitLog(t *testing.T, add func(pending func(seq int, corrupt bool))) []*LogMsg {
	bad := false
	w := &waitingJob{t: t, corrupt: func() bool { return bad }}
	w.queued()
	add(func(seq int, corrupt bool) {
		bad = corrupt
		w.event(contracts.EventPending, 1, seq, func(e *contracts.JobEvent) {
			e.Reason = []contracts.Reason{contracts.PendingInsufficientGPUs, contracts.PendingQuotaExceeded}[len(w.log)%2]
			e.Message = string(e.Reason)
		})
	})
	return w.log
}

// waitingJob writes the JOB_EVENTS log of one job that never fits (t1/wait,
// 64 H100s), an event a minute.
type waitingJob struct {
	t   *testing.T
	log []*LogMsg
	// legacy gives a pending event of sequence 0 an ID that carries none;
	// corrupt, when set and true for a pending event, makes its message a
	// number (the rebuild cannot decode it; the compactor reads only a
	// few fields).
	legacy  bool
	corrupt func() bool
}

func (w *waitingJob) queued() {
	req := contracts.JobRequest{SchemaVersion: 1, ID: "wait", Tenant: "t1",
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 64, Model: "h100"}}}
	w.event(contracts.EventQueued, 1, 0, func(e *contracts.JobEvent) { e.Request = &req; e.SubmitSeq = 1 })
}

func (w *waitingJob) event(typ contracts.JobEventType, attempt, seq int, fill func(*contracts.JobEvent)) {
	const tenant, id = "t1", "wait"
	e := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: typ, Tenant: tenant, JobID: id,
		Attempt: attempt, Time: time.Date(2026, 11, 27, 11, 0, 0, 0, time.UTC).Add(time.Duration(len(w.log)) * time.Minute)}
	if fill != nil {
		fill(&e)
	}
	data, err := json.Marshal(e)
	if err != nil {
		w.t.Fatal(err)
	}
	msgID := contracts.JobEventID(tenant, id, typ, attempt, seq)
	if typ == contracts.EventPending {
		if w.corrupt != nil && w.corrupt() {
			data = bytes.Replace(data, []byte(`"message":"`), []byte(`"message":7,"x":"`), 1)
		}
		if w.legacy && seq == 0 {
			msgID = "legacy-" + fmt.Sprint(len(w.log))
		}
	}
	w.log = append(w.log, &LogMsg{Stream: contracts.StreamJobEvents, Seq: uint64(len(w.log) + 1),
		Subject: contracts.SubjectJobEvents(tenant, id),
		Header:  map[string][]string{contracts.HeaderMsgID: {msgID}}, Data: data})
}

// messages returns the snapshot's messages decoded (a compactor's
// snapshot holds them encoded): what the tests compare.
func (s *Snapshot) messages() []*LogMsg {
	if s.recs == nil {
		return s.Msgs
	}
	out := make([]*LogMsg, 0, len(s.recs))
	for _, r := range s.recs {
		out = append(out, (&decoder{b: r}).msg())
	}
	return out
}
