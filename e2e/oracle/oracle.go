// Package oracle checks gpuplane's invariants from the outside. It replays
// the streams from sequence 1 with its own ordered consumer (plain nats.go,
// not libs/bus) and shares nothing with the services but contracts/:
//
//   - G1, exclusivity: over the ledger's timeline, a device is committed to
//     at most one allocation at a time.
//   - J1, no lost or doubled jobs: every accepted job's events follow the
//     state machine, end in at most one terminal state, and a job never has
//     two live allocations; every run started at most once.
//   - Metering: each run that ran is billed exactly once, for GPUs × the
//     whole seconds it held its devices, in contiguous segments.
package oracle

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// Job is what the oracle knows of one job.
type Job struct {
	Tenant, ID string
	State      contracts.JobState
	Events     []contracts.JobEventType
	Attempt    int
	Reason     contracts.Reason
	Errors     []contracts.FieldError
	Request    *contracts.JobRequest
	ExitCode   *int
}

// Run is what the oracle knows of one allocation's run.
type Run struct {
	AllocationID string
	GPUs         int
	Started      int // count of started facts (distinct publishes)
	Ended        int
	StartedAt    time.Time
	EndedAt      time.Time
	Outcome      contracts.RunOutcome
}

// Report is the result of a check.
type Report struct {
	Jobs       map[string]*Job // by tenant/id
	Runs       map[string]*Run // by allocation ID
	Usage      map[string][]contracts.UsageRecord
	Violations []string
	// LedgerEntries and JobEvents counted, for the log.
	LedgerEntries, JobEvents, RunEvents int
	// Refusals are the resource manager's refused plan items, in order.
	Refusals []contracts.Refusal
	// Released is each allocation's release entry: a run whose node was
	// lost has no ended fact, only the release's times.
	Released map[string]contracts.LedgerEntry
}

// Err returns the violations as one error, or nil.
func (r *Report) Err() error {
	if len(r.Violations) == 0 {
		return nil
	}
	v := r.Violations
	if len(v) > 30 {
		v = append(v[:30:30], fmt.Sprintf("... and %d more", len(r.Violations)-30))
	}
	return errors.New("invariant violations:\n  " + strings.Join(v, "\n  "))
}

func (r *Report) violate(format string, args ...any) {
	r.Violations = append(r.Violations, fmt.Sprintf(format, args...))
}

// Check replays JOB_EVENTS, ALLOCATIONS, RUNS and USAGE from the start and
// checks the invariants. It reads each stream up to its last message at the
// time of the call.
func Check(ctx context.Context, nc *nats.Conn) (*Report, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	r := &Report{Jobs: map[string]*Job{}, Runs: map[string]*Run{}, Usage: map[string][]contracts.UsageRecord{},
		Released: map[string]contracts.LedgerEntry{}}

	if err := replay(ctx, js, contracts.StreamJobEvents, func(m jetstream.Msg) error {
		var ev contracts.JobEvent
		if err := json.Unmarshal(m.Data(), &ev); err != nil {
			r.violate("undecodable job event on %s: %v", m.Subject(), err)
			return nil
		}
		r.JobEvents++
		r.applyJobEvent(m.Subject(), ev)
		return nil
	}); err != nil {
		return nil, err
	}
	if err := replay(ctx, js, contracts.StreamAllocations, r.ledgerChecker()); err != nil {
		return nil, err
	}
	if err := replay(ctx, js, contracts.StreamRuns, func(m jetstream.Msg) error {
		var ev contracts.RunEvent
		if err := json.Unmarshal(m.Data(), &ev); err != nil {
			r.violate("undecodable run event on %s: %v", m.Subject(), err)
			return nil
		}
		r.RunEvents++
		run := r.run(ev.AllocationID)
		run.GPUs = len(ev.Devices)
		switch ev.Kind {
		case contracts.RunStarted:
			run.Started++
			run.StartedAt = ev.Time
		case contracts.RunEnded:
			run.Ended++
			if ev.Result != nil {
				run.Outcome = ev.Result.Outcome
				run.EndedAt = ev.Result.EndedAt
				if !ev.Result.StartedAt.IsZero() {
					run.StartedAt = ev.Result.StartedAt
				}
			}
		}
		return nil
	}); err != nil {
		return nil, err
	}
	if err := replay(ctx, js, contracts.StreamUsage, func(m jetstream.Msg) error {
		var u contracts.UsageRecord
		if err := json.Unmarshal(m.Data(), &u); err != nil {
			r.violate("undecodable usage record on %s: %v", m.Subject(), err)
			return nil
		}
		r.Usage[u.AllocationID] = append(r.Usage[u.AllocationID], u)
		return nil
	}); err != nil {
		return nil, err
	}
	for id, run := range r.Runs {
		if run.Started > 1 {
			r.violate("J1: allocation %s started %d times", id, run.Started)
		}
		if run.Ended > 1 {
			r.violate("J1: allocation %s ended %d times", id, run.Ended)
		}
	}
	return r, nil
}

func (r *Report) run(id string) *Run {
	run, ok := r.Runs[id]
	if !ok {
		run = &Run{AllocationID: id}
		r.Runs[id] = run
	}
	return run
}

func (r *Report) applyJobEvent(subject string, ev contracts.JobEvent) {
	key := ev.Tenant + "/" + ev.JobID
	if want := contracts.SubjectJobEvents(ev.Tenant, ev.JobID); subject != want {
		r.violate("job event for %s published on %s", key, subject)
	}
	j, ok := r.Jobs[key]
	if !ok {
		j = &Job{Tenant: ev.Tenant, ID: ev.JobID}
		r.Jobs[key] = j
	}
	to, err := contracts.Transition(j.State, ev.Type)
	if err != nil {
		// A rejected duplicate submission of an accepted job is documented
		// as harmless to the job (contracts/FLOWS.md); anything else is a
		// broken lifecycle.
		if ev.Type == contracts.EventRejected && ev.Reason == contracts.ReasonDuplicateJobID {
			return
		}
		r.violate("J1: job %s: %v (events so far %v)", key, err, j.Events)
		return
	}
	if ev.Attempt < j.Attempt {
		r.violate("J1: job %s attempt went back from %d to %d", key, j.Attempt, ev.Attempt)
	}
	j.State, j.Attempt = to, ev.Attempt
	j.Events = append(j.Events, ev.Type)
	if ev.Reason != "" {
		j.Reason = ev.Reason
	}
	if ev.Errors != nil {
		j.Errors = ev.Errors
	}
	if ev.Request != nil {
		j.Request = ev.Request
	}
	if ev.ExitCode != nil {
		j.ExitCode = ev.ExitCode
	}
}

type deviceKey struct{ node, uuid string }

// ledgerChecker checks G1 over the timeline and that a job never holds two
// live allocations, the parts of one attempt of a multi-machine job
// (Allocation.Gang) excepted: those are one allocation per machine.
func (r *Report) ledgerChecker() func(jetstream.Msg) error {
	holder := map[deviceKey]string{}          // device -> allocation holding it
	live := map[string]contracts.Allocation{} // allocation ID -> allocation
	liveByJob := map[string][]string{}        // tenant/job -> live allocation IDs
	return func(m jetstream.Msg) error {
		if strings.HasPrefix(m.Subject(), "gp.alloc.refused.") {
			var rf contracts.Refusal
			if err := json.Unmarshal(m.Data(), &rf); err == nil {
				r.Refusals = append(r.Refusals, rf)
			}
			return nil
		}
		if !strings.HasPrefix(m.Subject(), "gp.alloc.ledger.") {
			return nil
		}
		var e contracts.LedgerEntry
		if err := json.Unmarshal(m.Data(), &e); err != nil {
			r.violate("undecodable ledger entry on %s: %v", m.Subject(), err)
			return nil
		}
		r.LedgerEntries++
		a := e.Allocation
		if m.Subject() != contracts.SubjectLedger(a.NodeID) {
			r.violate("ledger entry for node %s on %s", a.NodeID, m.Subject())
		}
		job := a.Tenant + "/" + a.JobID
		switch e.Kind {
		case contracts.LedgerCommitted:
			if _, dup := live[a.ID]; dup {
				r.violate("G1: allocation %s committed twice while live", a.ID)
				return nil
			}
			for _, other := range liveByJob[job] {
				o := live[other]
				if a.Gang == nil || o.Gang == nil || o.Attempt != a.Attempt {
					r.violate("J1: job %s has two live allocations %s and %s", job, other, a.ID)
				}
			}
			for _, d := range a.Devices {
				k := deviceKey{a.NodeID, d.UUID}
				if other, taken := holder[k]; taken {
					r.violate("G1: device %s/%s given to %s while held by %s (seq %d)", a.NodeID, d.UUID, a.ID, other, seqOf(m))
				}
				holder[k] = a.ID
			}
			live[a.ID] = a
			liveByJob[job] = append(liveByJob[job], a.ID)
		case contracts.LedgerReleased:
			held, ok := live[a.ID]
			if !ok {
				r.violate("ledger releases %s which is not live (seq %d)", a.ID, seqOf(m))
				return nil
			}
			for _, d := range held.Devices {
				delete(holder, deviceKey{held.NodeID, d.UUID})
			}
			delete(live, a.ID)
			if rest := slices.DeleteFunc(liveByJob[job], func(id string) bool { return id == a.ID }); len(rest) > 0 {
				liveByJob[job] = rest
			} else {
				delete(liveByJob, job)
			}
			r.Released[a.ID] = e
		default:
			r.violate("unknown ledger kind %q", e.Kind)
		}
		return nil
	}
}

func seqOf(m jetstream.Msg) uint64 {
	md, err := m.Metadata()
	if err != nil {
		return 0
	}
	return md.Sequence.Stream
}

// replay delivers every message of stream up to its last sequence now.
func replay(ctx context.Context, js jetstream.JetStream, stream string, fn func(jetstream.Msg) error) error {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return fmt.Errorf("oracle: stream %s: %w", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return fmt.Errorf("oracle: stream %s info: %w", stream, err)
	}
	if info.State.Msgs == 0 {
		return nil
	}
	last := info.State.LastSeq
	cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverAllPolicy})
	if err != nil {
		return fmt.Errorf("oracle: consumer on %s: %w", stream, err)
	}
	it, err := cons.Messages()
	if err != nil {
		return err
	}
	defer it.Stop()
	for {
		m, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			return fmt.Errorf("oracle: read %s: %w", stream, err)
		}
		if err := fn(m); err != nil {
			return err
		}
		md, err := m.Metadata()
		if err != nil {
			return err
		}
		if md.Sequence.Stream >= last {
			return nil
		}
	}
}

// RunSpan is the time a run held its devices: from its start to its ended
// fact, or to its release when it has none (its node was lost). ok is
// false for a run that never started or is not over yet.
func (r *Report) RunSpan(id string) (start, end time.Time, ok bool) {
	run := r.Runs[id]
	rel, released := r.Released[id]
	switch {
	case run == nil || run.StartedAt.IsZero():
		return time.Time{}, time.Time{}, false
	case run.Ended > 0:
		return run.StartedAt, run.EndedAt, true
	case released && rel.Run != nil && !rel.Run.EndedAt.IsZero():
		return run.StartedAt, rel.Run.EndedAt, true
	}
	return time.Time{}, time.Time{}, false
}

// BilledSpan is the whole seconds billing must bill for [start, end):
// [floor(start), ceil(end)), UTC (the rule of services/billing/README.md).
func BilledSpan(start, end time.Time) (time.Time, time.Time) {
	s, e := start.UTC().Truncate(time.Second), end.UTC().Truncate(time.Second)
	if e.Before(end) {
		e = e.Add(time.Second)
	}
	return s, e
}

// CheckMetering verifies that every run that ran is billed exactly once:
// its allocation's records are segments 0..n-1, contiguous, the last one
// final, together covering the whole seconds the run touched (BilledSpan
// of RunSpan), each billing GPUs × its own seconds; and that nothing else
// is billed. It returns the billed and the expected GPU-milliseconds.
func (r *Report) CheckMetering() (billed, expected int64) {
	for id, run := range r.Runs {
		start, end, ok := r.RunSpan(id)
		if !ok {
			continue
		}
		if rel, released := r.Released[id]; released && run.Ended > 0 && rel.Run != nil && !rel.Run.EndedAt.Equal(run.EndedAt) {
			r.violate("metering: run %s ended at %s, its release says %s", id, run.EndedAt, rel.Run.EndedAt)
		}
		from, to := BilledSpan(start, end)
		want := int64(run.GPUs) * int64(to.Sub(from)/time.Second) * 1000
		expected += want
		recs := append([]contracts.UsageRecord(nil), r.Usage[id]...)
		sort.Slice(recs, func(i, j int) bool { return recs[i].Segment < recs[j].Segment })
		if len(recs) == 0 {
			if want > 0 {
				r.violate("metering: run %s (%d GPU-ms) was not billed", id, want)
			}
			continue
		}
		var got int64
		for i, u := range recs {
			secs := int64(u.End.Sub(u.Start) / time.Second)
			switch {
			case u.Segment != i:
				r.violate("metering: run %s: record %d of %d is segment %d (billed twice, or a segment missing)", id, i, len(recs), u.Segment)
			case i > 0 && !u.Start.Equal(recs[i-1].End):
				r.violate("metering: run %s: segment %d starts at %s, the previous ended at %s", id, i, u.Start, recs[i-1].End)
			case u.Final != (i == len(recs)-1):
				r.violate("metering: run %s: segment %d of %d final=%v", id, i, len(recs), u.Final)
			case u.Seconds != secs || u.GPUMillis != int64(run.GPUs)*secs*1000:
				r.violate("metering: run %s: segment %d bills %d s and %d GPU-ms over %s..%s with %d GPUs", id, i, u.Seconds, u.GPUMillis, u.Start, u.End, run.GPUs)
			}
			got += u.GPUMillis
		}
		if !recs[0].Start.Equal(from) || !recs[len(recs)-1].End.Equal(to) {
			r.violate("metering: run %s billed %s..%s, it held its devices %s..%s (billed span %s..%s)", id,
				recs[0].Start, recs[len(recs)-1].End, start, end, from, to)
		}
		if got != want {
			r.violate("metering: run %s billed %d GPU-ms, ran %d", id, got, want)
		}
	}
	for id, recs := range r.Usage {
		for _, u := range recs {
			billed += u.GPUMillis
		}
		if _, _, ok := r.RunSpan(id); !ok {
			r.violate("metering: %s billed but never ran (or never ended)", id)
		}
	}
	return billed, expected
}

// Summary counts jobs by state, for logs.
func (r *Report) Summary() string {
	counts := map[contracts.JobState]int{}
	for _, j := range r.Jobs {
		counts[j.State]++
	}
	keys := make([]string, 0, len(counts))
	for s := range counts {
		keys = append(keys, string(s))
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s=%d", k, counts[contracts.JobState(k)]))
	}
	refused := map[contracts.Reason]int{}
	for _, rf := range r.Refusals {
		refused[rf.Reason]++
	}
	return fmt.Sprintf("jobs: %s; job events %d, ledger entries %d, run events %d, usage records %d, refusals %v",
		strings.Join(parts, " "), r.JobEvents, r.LedgerEntries, r.RunEvents, len(r.Usage), refused)
}
