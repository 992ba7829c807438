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
//   - Billing equals the run facts (CheckBillingMatchesRuns): per run, the
//     GPU-seconds billed, net of voided provisional records, are the GPUs ×
//     the whole seconds between the start and the end its agent reported,
//     whatever order the release and the ended fact came in.
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
// its allocation's records are numbered 0..n-1; what stands of them (the
// records neither voiding nor voided: a provisional bill replaced by the
// agent's end) is contiguous, its last record final, together covering the
// whole seconds the run touched (BilledSpan of RunSpan), each billing GPUs ×
// its own seconds; and that nothing else is billed. It returns the billed
// (net of voids) and the expected GPU-milliseconds.
func (r *Report) CheckMetering() (billed, expected int64) {
	for id, run := range r.Runs {
		start, end, ok := r.RunSpan(id)
		if !ok {
			continue
		}
		// A node_lost release's end is the resource manager's, not the
		// agent's: billing corrects it when the agent reports.
		if rel, released := r.Released[id]; released && run.Ended > 0 && rel.Run != nil && rel.Reason != contracts.ReasonNodeLost &&
			!rel.Run.EndedAt.Equal(run.EndedAt) {
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
			if u.Segment != i {
				r.violate("metering: run %s: record %d of %d is segment %d (billed twice, or a segment missing)", id, i, len(recs), u.Segment)
			}
			got += u.GPUMillis
		}
		standing := Standing(recs)
		for i, u := range standing {
			secs := int64(u.End.Sub(u.Start) / time.Second)
			switch {
			case i > 0 && !u.Start.Equal(standing[i-1].End):
				r.violate("metering: run %s: segment %d starts at %s, the previous ended at %s", id, u.Segment, u.Start, standing[i-1].End)
			case u.Final != (i == len(standing)-1):
				r.violate("metering: run %s: segment %d of %d standing final=%v", id, u.Segment, len(standing), u.Final)
			case u.Seconds != secs || u.GPUMillis != int64(run.GPUs)*secs*1000:
				r.violate("metering: run %s: segment %d bills %d s and %d GPU-ms over %s..%s with %d GPUs", id, u.Segment, u.Seconds, u.GPUMillis, u.Start, u.End, run.GPUs)
			}
		}
		switch {
		case len(standing) == 0:
			if want > 0 {
				r.violate("metering: run %s: every record voided, nothing bills its %d GPU-ms", id, want)
			}
		case !standing[0].Start.Equal(from) || !standing[len(standing)-1].End.Equal(to):
			r.violate("metering: run %s billed %s..%s, it held its devices %s..%s (billed span %s..%s)", id,
				standing[0].Start, standing[len(standing)-1].End, start, end, from, to)
		}
		if got != want {
			r.violate("metering: run %s billed %d GPU-ms, ran %d", id, got, want)
		}
	}
	for id, recs := range r.Usage {
		var net int64
		for _, u := range recs {
			net += u.GPUMillis
		}
		billed += net
		if _, _, ok := r.RunSpan(id); !ok && net != 0 {
			r.violate("metering: %s billed but never ran (or never ended)", id)
		}
	}
	return billed, expected
}

// Standing are the records of one allocation that stand, in segment
// order: neither a void nor voided by one. A provisional bill that the
// agent's end replaced is voided record by record.
func Standing(recs []contracts.UsageRecord) []contracts.UsageRecord {
	voided := map[string]bool{}
	for _, u := range recs {
		if u.Voids != "" {
			voided[u.Voids] = true
		}
	}
	var out []contracts.UsageRecord
	for _, u := range recs {
		if u.Voids == "" && !voided[u.ID] {
			out = append(out, u)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Segment < out[j].Segment })
	return out
}

// BillingMismatch is a run whose bill is not what its run facts say.
type BillingMismatch struct {
	AllocationID string
	// Billed is the GPU-milliseconds USAGE bills, net of voids; Ran is
	// GPUs × the whole seconds of the run's span.
	Billed, Ran int64
	// Start and End are the run's span; From is "ended fact" when its
	// agent reported the end, "release" when only the release tells it (a
	// machine that never came back).
	Start, End time.Time
	From       string
	// Why says what is wrong when the sums agree but the bill does not
	// stand on the facts (a provisional bill of other seconds left
	// standing, a void of something that was not provisional).
	Why string
}

// CheckBillingMatchesRuns checks billing against the run facts, run by
// run, exactly: net of voids, each run is billed its GPUs × the whole
// seconds [floor(start), ceil(end)) of the start and end its agent
// reported (the release's end only for a run whose agent never reported
// one); a provisional bill (to a node_lost release) stands only when no
// ended fact says otherwise; each void cancels one provisional record
// exactly; nothing is billed for a run that never ran. It adds a
// "billing:" violation per mismatch and returns the mismatches; the chaos
// suite counts them. Call it once USAGE has caught up (the release and
// the ended fact of every run are in).
func (r *Report) CheckBillingMatchesRuns() []BillingMismatch {
	var out []BillingMismatch
	ids := make([]string, 0, len(r.Runs)+len(r.Usage))
	for id := range r.Runs {
		ids = append(ids, id)
	}
	for id := range r.Usage {
		if r.Runs[id] == nil {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	for _, id := range ids {
		recs := r.Usage[id]
		var billed int64
		byID := map[string]contracts.UsageRecord{}
		why := ""
		for _, u := range recs {
			billed += u.GPUMillis
			if u.Voids != "" {
				v, ok := byID[u.Voids]
				switch {
				case !ok || !v.Provisional:
					why = fmt.Sprintf("%s voids %s, not an earlier provisional record", u.ID, u.Voids)
				case u.GPUMillis != -v.GPUMillis || u.CostMicros != -v.CostMicros || !u.Start.Equal(v.Start) || !u.End.Equal(v.End):
					why = fmt.Sprintf("%s does not negate %s", u.ID, u.Voids)
				}
			}
			byID[u.ID] = u
		}
		run := r.Runs[id]
		start, end, ok := r.RunSpan(id)
		m := BillingMismatch{AllocationID: id, Billed: billed, Start: start, End: end, From: "release"}
		if run != nil && run.Ended > 0 {
			m.From = "ended fact"
		}
		if ok {
			from, to := BilledSpan(start, end)
			m.Ran = int64(run.GPUs) * int64(to.Sub(from)/time.Second) * 1000
		}
		if m.From == "ended fact" && why == "" {
			for _, u := range Standing(recs) {
				if from, to := BilledSpan(start, end); u.Provisional && (u.Start.Before(from) || u.End.After(to)) {
					why = fmt.Sprintf("provisional %s (%s..%s) stands against the agent's end %s", u.ID, u.Start, u.End, end)
				}
			}
		}
		if m.Billed == m.Ran && why == "" {
			continue
		}
		m.Why = why
		out = append(out, m)
		suffix := ""
		if why != "" {
			suffix = ": " + why
		}
		r.violate("billing: run %s billed %d GPU-ms, its run facts (%s, %s..%s) say %d%s", id, m.Billed, m.From,
			start.Format(time.RFC3339Nano), end.Format(time.RFC3339Nano), m.Ran, suffix)
	}
	return out
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
