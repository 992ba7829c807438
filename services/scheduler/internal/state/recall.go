package state

import (
	"maps"
	"slices"

	"github.com/gpuplane/gpuplane/contracts"
)

// Recalling a forgotten job. The store keeps a retired job's record for
// Config.RememberEnded after its end (retention.go); past that, only
// JOB_EVENTS knows the job. Three things still ask about such a job:
//
//   - a submit of its ID (the same body is unchanged, another a
//     duplicate_job_id), which must never make a second job of an ID;
//   - a submit that depends on it (unknown_dependency or
//     dependency_rejected, else accepted);
//   - a cancel of it, which changes nothing either way (the caller logs
//     it) and so reads nothing.
//
// A late commit of one of its allocations cannot come once the record is
// gone (RememberEnded ≥ 2×PlansMaxAge: the resource manager refuses an
// older plan), and a queued dependent pins its dependencies' records
// (pins). So only submits read the log: SubmitParsed answers
// Submission.Recall with the keys it does not hold, the caller reads
// each job's subject of JOB_EVENTS outside the lock (FoldRecalled),
// hands the answers back (ParsedSubmit.Recall), and submits again. Until
// the store has forgotten anything (Forgetting) no submit reads the log.

// Recalled is what JOB_EVENTS says of one job (FoldRecalled).
type Recalled struct {
	// Found is set when the job's subject holds a job that ended; the
	// rest is then its record.
	Found bool
	rec   retiredJob
	why   contracts.Reason
}

// State is the state the job ended in (the zero state when not found).
func (r Recalled) State() contracts.JobState {
	if !r.Found {
		return ""
	}
	return terminalStates[r.rec.state]
}

// FoldRecalled folds the events of one job's subject of JOB_EVENTS, in
// stream order, into what the store would have kept of it, the way a
// replay folds them (ReplayJobEvent): events for another job, events the
// state machine refuses and duplicate_job_id answers change nothing.
//
// A job the log holds but not as ended is not found: the store holds
// every live job the log holds (a rebuild replays them all) but one
// whose queued event was stored while its publish reported a failure
// (Submission.Abandoned), and a store that never forgets treats that one
// as unknown too: its redelivered request is decided again, and its
// queued event, published under the same message ID, is the same event.
func FoldRecalled(tenant, id string, events []contracts.JobEvent) Recalled {
	f := NewRecallFold(tenant, id)
	for _, ev := range events {
		if f.Add(ev) {
			break
		}
	}
	return f.Recalled()
}

// RecallFold is FoldRecalled one event at a time, for a reader that
// stops once the job ended: no later event can change what it says
// (Transition refuses every event after an end).
type RecallFold struct {
	tenant, id string
	state      contracts.JobState
	r          Recalled
}

// NewRecallFold starts a fold of tenant's job id.
func NewRecallFold(tenant, id string) *RecallFold {
	return &RecallFold{tenant: tenant, id: id, state: contracts.StateNew}
}

// Add folds ev in and reports whether the job has ended.
func (f *RecallFold) Add(ev contracts.JobEvent) (ended bool) {
	if ev.Tenant != f.tenant || ev.JobID != f.id || (f.state == contracts.StateNew && ev.AnswersDuplicate()) {
		return f.state.Terminal()
	}
	to, err := contracts.Transition(f.state, ev.Type)
	if err != nil {
		return f.state.Terminal()
	}
	switch ev.Type {
	case contracts.EventQueued:
		// Without its request (hand-made), a replay still makes the job,
		// with no hash and attempt: so does the fold.
		if ev.Request != nil {
			f.r.rec.hash, f.r.rec.attempt = hash64(hashRequest(*ev.Request)), uint32(max(ev.Attempt, 1))
		}
	case contracts.EventRejected:
		f.r.rec.hash, f.r.why = hash64(rejectionHash(ev.Reason, ev.Errors)), ev.Reason
	case contracts.EventRequeued:
		f.r.rec.attempt = uint32(max(ev.Attempt, 0))
	}
	f.state = to
	return to.Terminal()
}

// Recalled is what the events folded so far say.
func (f *RecallFold) Recalled() Recalled {
	if !f.state.Terminal() {
		return Recalled{}
	}
	r := f.r
	r.Found, r.rec.state = true, stateCode(f.state)
	if f.state != contracts.StateRejected {
		r.why = ""
	}
	return r
}

// Recall hands SubmitParsed what the log says of the job with store key
// key, one of those its Submission.Recall listed.
func (p *ParsedSubmit) Recall(key string, r Recalled) {
	if p.recalled == nil {
		p.recalled = map[string]Recalled{}
	}
	p.recalled[key] = r
}

// toRecall lists the jobs a submit asks about (its own ID and those it
// depends on) that the store neither holds nor has a log answer for,
// once it may have forgotten some; those with an answer found in the log
// are remembered again, dated now, for the cycles after (a dependency
// read back stays known while its dependent lives: pins).
func (s *Store) toRecall(p ParsedSubmit, tenant string, streamSeq uint64) []string {
	if !s.Forgetting() {
		return nil
	}
	id := p.req.ID
	if p.err != nil && contracts.ValidateID(id) != nil {
		id = contracts.RejectedJobID(streamSeq) // reject's ID
	}
	keys := []string{Key(tenant, id)}
	if p.err == nil {
		for _, d := range p.norm.DependsOn {
			keys = append(keys, Key(tenant, d))
		}
	}
	var need []string
	for _, key := range keys {
		if s.jobs[key] != nil || s.isRetired(key) {
			continue
		}
		if _, ok := s.acceptingJobs[key]; ok {
			continue
		}
		r, ok := p.recalled[key]
		switch {
		case !ok:
			need = append(need, key)
		default:
			s.Remember(key, r)
		}
	}
	return need
}

// MissingDependencies lists the store keys of the jobs a live job
// depends on that the store does not hold. After a rebuild there may be
// some: a dependency the intake read back from the log (it had been
// forgotten) is, in the log, older than its dependent, and a replay that
// retires as it goes can forget it again before the dependent's queued
// event pins it. The scheduler reads each from the log and hands it to
// Remember before it goes live; without that the dependent would wait on
// it for ever.
func (s *Store) MissingDependencies() []string {
	var out []string
	seen := map[string]bool{}
	for _, j := range s.jobs {
		if j.State.Terminal() || j.Request == nil {
			continue
		}
		for _, d := range j.Request.DependsOn {
			key := Key(j.Tenant, d)
			if !seen[key] && s.jobs[key] == nil && !s.isRetired(key) {
				seen[key] = true
				out = append(out, key)
			}
		}
	}
	slices.Sort(out)
	return out
}

// TakeMissing returns, and forgets, the dependencies the cycles found
// missing (dependencies: "not recorded yet") while the store forgets: the
// scheduler reads them back now and then. Cheaper than
// MissingDependencies, which walks every job: the cycle looks at each
// waiting job's dependencies anyway.
func (s *Store) TakeMissing() []string {
	if len(s.missing) == 0 {
		return nil
	}
	out := slices.Sorted(maps.Keys(s.missing))
	clear(s.missing)
	return out
}

// Remember keeps what the log says of the job with store key key (one
// MissingDependencies listed), dated now; a job the log does not hold
// changes nothing.
func (s *Store) Remember(key string, r Recalled) {
	if !r.Found || s.jobs[key] != nil {
		return
	}
	k := retiredKeyOf(key)
	var b [retiredSize]byte
	rt := s.retention()
	if rt.retired.Add(appendRetired(b[:0], k, r.rec), s.cfg.Now()) && r.why != "" {
		rt.why[k] = r.why
	}
}

// NeedsLog lists what SubmitParsed would ask to read for p now
// (Submission.Recall) without deciding it: the intake starts those reads
// for a request it must decide after others (scheduler's intake.go).
func (s *Store) NeedsLog(p ParsedSubmit, streamSeq uint64) []string {
	if p.invalid != nil {
		return nil
	}
	return s.toRecall(p, s.names.of(p.tenant), streamSeq)
}
