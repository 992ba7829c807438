package state

import (
	"encoding/json"
	"fmt"
	"maps"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"

	segjson "github.com/segmentio/encoding/json"

	"github.com/gpuplane/gpuplane/contracts"
)

// compactorLog is a log of the streams a compactor reads, in the order a
// scheduler would observe them (each stream in sequence order, streams
// interleaved as the jobs' lives interleave): jobs queued and run to an
// end, rejected, cancelled, requeued, left running, refused, plans, other
// schedulers' allocations, and bodies no decoder reads as what they
// claim to be. Bare requests are shaped as BenchmarkBurst's (no labels,
// environment or command), else each has some.
func compactorLog(tb testing.TB, jobs int, seed uint64, bare bool) []*LogMsg {
	tb.Helper()
	rng := rand.New(rand.NewPCG(seed, seed^0x5eed))
	seqs := map[string]uint64{}
	var log []*LogMsg
	add := func(stream, subject string, v any) {
		var data []byte
		switch b := v.(type) {
		case []byte:
			data = b
		default:
			var err error
			if data, err = json.Marshal(v); err != nil {
				tb.Fatal(err)
			}
		}
		seqs[stream]++
		log = append(log, &LogMsg{Stream: stream, Seq: seqs[stream], Subject: subject,
			Header: map[string][]string{contracts.HeaderMsgID: {fmt.Sprintf("%s-%d", stream, seqs[stream])}}, Data: data})
	}
	now := time.Date(2026, 11, 27, 5, 0, 0, 0, time.UTC)
	for i := range jobs {
		tenant, id := fmt.Sprintf("t%d", i%3), fmt.Sprintf("job-%d", i)
		node := fmt.Sprintf("n%d", rng.IntN(50))
		ev := func(typ contracts.JobEventType, attempt int, fill func(*contracts.JobEvent)) {
			e := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: typ, Tenant: tenant, JobID: id,
				Attempt: attempt, Time: now.Add(time.Duration(i) * time.Millisecond)}
			if fill != nil {
				fill(&e)
			}
			add(contracts.StreamJobEvents, contracts.SubjectJobEvents(tenant, id), e)
		}
		req := contracts.JobRequest{SchemaVersion: 1, ID: id, Tenant: tenant, Name: "train <&> " + id,
			Priority:  []contracts.Priority{"critical", "high", "normal", "best-effort"}[rng.IntN(4)],
			Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1 + rng.IntN(8), Model: "h100", MemoryMiB: int64(rng.IntN(3)) * 40960}},
			Run:       contracts.RunSpec{Duration: contracts.Duration(time.Duration(1+rng.IntN(600)) * time.Second), Command: []string{"python", "train.py", "--lr=0.1"}, Env: map[string]string{"A": "1", "ÜNICODE": "é\u2028"}},
			Labels:    map[string]string{"team": fmt.Sprintf("team-%d", i%7)}}
		if bare {
			req.Name, req.Run.Command, req.Run.Env, req.Labels = "", nil, nil, nil
		}
		scheduler := "s1"
		if rng.IntN(10) == 0 {
			scheduler = "s2" // another scheduler's allocation
		}
		alloc := contracts.Allocation{ID: contracts.AllocationID(tenant, id, 1), Tenant: tenant, JobID: id, Attempt: 1,
			NodeID: node, Pool: "default", Devices: []contracts.DeviceRef{{Index: rng.IntN(8), UUID: fmt.Sprintf("GPU-%d", i), Model: "h100"}},
			Run: req.Run, Scheduler: scheduler, TraceParent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
		ledger := func(kind contracts.LedgerKind) {
			add(contracts.StreamAllocations, contracts.SubjectLedger(node),
				contracts.LedgerEntry{SchemaVersion: 1, Kind: kind, Allocation: alloc, Time: now})
		}
		run := func(kind contracts.RunKind) {
			add(contracts.StreamRuns, contracts.SubjectRuns(node), contracts.RunEvent{SchemaVersion: 1, Kind: kind,
				AllocationID: alloc.ID, Tenant: tenant, JobID: id, Attempt: 1, NodeID: node, Time: now})
		}
		switch k := rng.IntN(10); {
		case k == 0:
			ev(contracts.EventRejected, 0, func(e *contracts.JobEvent) {
				e.Reason = contracts.Reason("invalid_request")
				e.Errors = []contracts.FieldError{{Field: "resources.gpu.count", Reason: "out_of_range", Message: "too many"}}
			})
		case k == 1:
			ev(contracts.EventQueued, 1, func(e *contracts.JobEvent) { e.Request = &req })
			add(contracts.StreamJobs, contracts.SubjectCancel(tenant), contracts.CancelRequest{SchemaVersion: 1, JobID: id, Reason: "user"})
			ev(contracts.EventCancelled, 1, nil)
		case k == 2:
			// Refused, requeued, left queued.
			ev(contracts.EventQueued, 1, func(e *contracts.JobEvent) { e.Request = &req })
			add(contracts.StreamPlans, contracts.SubjectPlan("s1"), contracts.Plan{SchemaVersion: 1, ID: "p-" + id, Scheduler: "s1", Items: []contracts.Allocation{alloc}})
			add(contracts.StreamAllocations, contracts.SubjectRefused(tenant), contracts.Refusal{Tenant: tenant, JobID: id})
			ev(contracts.EventRequeued, 2, nil)
		case k == 3:
			// Malformed bodies in every stream (no decoder reads them).
			for _, body := range [][]byte{[]byte("{"), []byte(`{"type":5}`), []byte(`{"tenant":["x"]}`), []byte("")} {
				add(contracts.StreamJobEvents, contracts.SubjectJobEvents(tenant, id), body)
				add(contracts.StreamAllocations, contracts.SubjectLedger(node), body)
				add(contracts.StreamRuns, contracts.SubjectRuns(node), body)
				add(contracts.StreamPlans, contracts.SubjectPlan("s1"), body)
				add(contracts.StreamJobs, contracts.SubjectCancel(tenant), body)
			}
			// Queued events whose request is not one, or null, or has
			// maps null or empty.
			for _, r := range []string{`5`, `null`, `{"labels":5}`, `{"id":"x","labels":null,"nodeSelector":{},"run":{"env":{}},"resources":{"gpu":{"count":2}}}`} {
				add(contracts.StreamJobEvents, contracts.SubjectJobEvents(tenant, id),
					[]byte(fmt.Sprintf(`{"type":"queued","tenant":%q,"jobId":%q,"attempt":1,"request":%s}`, tenant, id, r)))
			}
			ev(contracts.EventCancelled, 1, nil)
		default:
			ev(contracts.EventQueued, 1, func(e *contracts.JobEvent) { e.Request = &req; e.SubmitSeq = uint64(i) })
			add(contracts.StreamPlans, contracts.SubjectPlan("s1"), contracts.Plan{SchemaVersion: 1, ID: "p-" + id, Scheduler: "s1", Items: []contracts.Allocation{alloc}})
			ledger(contracts.LedgerCommitted)
			ev(contracts.EventScheduled, 1, func(e *contracts.JobEvent) { p := contracts.Placement{NodeID: node}; e.Placement = &p })
			run(contracts.RunStarted)
			ev(contracts.EventRunning, 1, nil)
			if k == 4 {
				break // still running
			}
			run(contracts.RunEnded)
			ev(contracts.EventSucceeded, 1, func(e *contracts.JobEvent) { code := 0; e.ExitCode = &code })
			if k != 5 {
				ledger(contracts.LedgerReleased) // k == 5: ended, allocation still held
			}
		}
	}
	return log
}

// snapshotView is what a compactor's snapshot holds, comparable.
type snapshotView struct {
	Meta    SnapshotMeta
	Msgs    []string
	Retired map[retiredKey]retiredJob
	Why     map[retiredKey]contracts.Reason
	Work    workload
}

func viewOf(s *Snapshot) snapshotView {
	v := snapshotView{Meta: s.Meta, Retired: map[retiredKey]retiredJob{}, Why: s.why, Work: s.work}
	eachRetired(bucketPieces(s.retired), func(k retiredKey, r retiredJob) { v.Retired[k] = r })
	for _, m := range s.messages() {
		v.Msgs = append(v.Msgs, fmt.Sprintf("%s/%d", m.Stream, m.Seq))
	}
	return v
}

// TestCompactorDecodesAsEncodingJSON: the compactor reading with the
// bus's decoder (segmentio's) keeps, retires and counts exactly what it
// did with encoding/json, on a log of every kind of message it reads,
// malformed bodies included, snapshotted midway and at the end.
func TestCompactorDecodesAsEncodingJSON(t *testing.T) {
	defer func(d func([]byte, any) error) { decodeMsg = d }(decodeMsg)
	for _, seed := range []uint64{1, 2, 3} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			log := compactorLog(t, 1000, seed, seed == 3)
			views := map[string][]snapshotView{}
			for name, dec := range map[string]func([]byte, any) error{"encoding/json": json.Unmarshal, "segmentio": segjson.Unmarshal} {
				decodeMsg = dec
				c := NewCompactor("s1", 0, nil)
				for i, m := range log {
					c.Observe(m)
					if i == len(log)/2 {
						views[name] = append(views[name], viewOf(c.Snapshot()))
					}
				}
				views[name] = append(views[name], viewOf(c.Snapshot()))
			}
			want, got := views["encoding/json"], views["segmentio"]
			if last := want[len(want)-1]; last.Meta.Retired == 0 || last.Meta.Jobs == 0 || len(last.Why) == 0 || len(last.Work.reqs) == 0 {
				t.Fatalf("the log exercises too little: %+v", last.Meta)
			}
			for i := range want {
				if !slices.Equal(want[i].Msgs, got[i].Msgs) || !maps.Equal(want[i].Retired, got[i].Retired) ||
					!maps.Equal(want[i].Why, got[i].Why) || !reflect.DeepEqual(want[i].Work.reqs, got[i].Work.reqs) ||
					want[i].Work.next != got[i].Work.next || want[i].Meta.Jobs != got[i].Meta.Jobs ||
					want[i].Meta.Retired != got[i].Meta.Retired || !maps.Equal(want[i].Meta.Seqs, got[i].Meta.Seqs) {
					t.Errorf("snapshot %d differs: encoding/json %+v (%d msgs), segmentio %+v (%d msgs)",
						i, want[i].Meta, len(want[i].Msgs), got[i].Meta, len(got[i].Msgs))
				}
			}
		})
	}
}

// BenchmarkCompactorObserve folds a burst's log (per job: its events,
// plan, ledger entries and run facts) into a compactor, with each
// decoder: the compactor's share of a burst beside the live scheduler.
func BenchmarkCompactorObserve(b *testing.B) {
	defer func(d func([]byte, any) error) { decodeMsg = d }(decodeMsg)
	for _, shape := range []string{"bare", "labelled"} {
		log := compactorLog(b, 5000, 1, shape == "bare")
		for _, c := range []struct {
			name string
			dec  func([]byte, any) error
		}{{"encoding-json", json.Unmarshal}, {"segmentio", segjson.Unmarshal}} {
			b.Run(shape+"/"+c.name, func(b *testing.B) {
				decodeMsg = c.dec
				b.ReportAllocs()
				for b.Loop() {
					comp := NewCompactor("s1", 0, nil)
					for _, m := range log {
						comp.Observe(m)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(log)), "ns/msg")
			})
		}
	}
}
