// Package state is the scheduler's memory: every job it has accepted (folded
// from its own JOB_EVENTS), the cluster as the NODES and ALLOCATIONS streams
// describe it, and the plans in flight. It turns facts into decisions: which
// job events to publish, which stop commands to send, and, in a cycle, which
// plan to propose. It does no I/O: each method returns the messages to
// publish, and the caller publishes them in order (per job) and only then
// acknowledges whatever caused them.
//
// A Store is not safe for concurrent use; the scheduler holds one lock
// around it. Every job event it returns has passed contracts.Transition from
// the job's state, with one documented exception: the duplicate_job_id
// rejection of FLOWS.md, which readers ignore by design.
//
// Facts may arrive in any order across streams (a run may start before the
// scheduler sees its commit); each job keeps the facts of its current
// attempt and advance moves it as far as they allow, so the outcome is the
// same whatever the interleaving. Before GoLive (while rebuilding after a
// restart) facts are recorded but nothing is published; GoLive then
// publishes what the rebuilt state owes, once.
package state

import (
	"cmp"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/backfill"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/queue"
)

// Config configures a Store.
type Config struct {
	// Scheduler is this scheduler's name (plans' Scheduler field).
	Scheduler string
	// Boot is unique to this process start; plan IDs carry it so a plan of
	// a restarted scheduler is never taken for a duplicate of an older one.
	Boot string
	// MaxPlanBytes bounds one plan's encoded size; a cycle that places more
	// splits its plan (the PLANS stream refuses messages over 128 KiB).
	MaxPlanBytes int
	// Now is the clock; default time.Now.
	Now func() time.Time
	// Log; default slog.Default().
	Log *slog.Logger
	// Wake is called (under the caller's lock, so it must not block) when
	// something changed that a cycle could act on.
	Wake func()
	// Admit, when set, is asked about every new valid request before it
	// is queued (under the caller's lock, so it must not block); an error
	// (a *contracts.ValidationError) rejects the request with its reason.
	// Billing's budget policy comes in here (budget.go of the scheduler).
	Admit func(tenant string, req contracts.JobRequest) error
	// PreemptGrace is the time a preempted or drained job gets between
	// its stop (after a checkpoint request, when it can checkpoint) and
	// being killed.
	PreemptGrace time.Duration
	// MinRuntime protects a started job from preemption for this long.
	MinRuntime time.Duration
	// Policy is the placement policy of pools without a PoolConfig.
	Policy contracts.PlacementPolicy
	// AllowHostCommands is the runtime policy of pools without one of
	// their own (PoolConfig.Runtime): whether they run host commands.
	// False, the default, runs images only there (runtime.go).
	AllowHostCommands bool
	// MaxReservations bounds the backfill reservations one cycle makes;
	// 0 makes none (no backfill protection). It has no default here: the
	// service's flag has one, and a zero must mean what it says.
	MaxReservations int
	// CheckpointTimeout bounds how long a checkpointable job being moved
	// is waited for to report the checkpoint it was asked for before it is
	// stopped anyway (default 30s; a deadline, such as a spot reclaim,
	// shortens it).
	CheckpointTimeout time.Duration
	// RetainTerminal and RetainTerminalMax bound how long, and how many,
	// ended jobs stay whole before they are retired (retention.go); both
	// zero keeps every ended job whole.
	RetainTerminal    time.Duration
	RetainTerminalMax int
	// RememberEnded is how long the record of a retired job is kept after
	// its end (recset.Window: up to a quarter more); 0 keeps records for
	// ever. Past it, what is known of the job is read from JOB_EVENTS when
	// a request asks (Submission.Recall). Keep it at least 2×PlansMaxAge:
	// a late commit of an ended job's allocation must still find it.
	RememberEnded time.Duration
}

// Publish is one message to publish. Messages with the same Key (one job)
// must be published in the order returned.
type Publish struct {
	Subject string
	ID      string
	Msg     any
	Key     string
}

// Job is one job as the scheduler knows it.
type Job struct {
	Tenant, ID string
	key        string
	State      contracts.JobState
	Attempt    int
	// Request is the normalized request; dropped once the job is terminal.
	Request *contracts.JobRequest
	hash    [sha256.Size]byte
	// seq is the submit order: the JOBS sequence of the request.
	seq       uint64
	rejection *rejection

	// queuedAt is when the job was queued (stampOf; read through queued):
	// its placement timeout counts from there.
	queuedAt stamp

	// launchRetries counts the attempts requeued because their run could
	// not start for a reason that may pass (retriesLaunch).
	launchRetries int

	// cancel is set once a cancel request was accepted.
	cancel bool
	// stub marks the stand-in of a retired job (retention.go).
	stub         bool
	cancelReason string

	// evict is why the scheduler is moving the current attempt off its
	// machines (preempted, node_drained, gang_incomplete); the end of its
	// runs then requeues the job as the next attempt.
	evict contracts.Reason
	// lastCheckpoint names the last complete checkpoint any attempt
	// reported: what the next attempt restores (GPUPLANE_RESTORE_FROM).
	lastCheckpoint string
	// mv is what moves, preemption and backfill add to a job (jobmoves.go);
	// nil for most jobs. Read it through moves, change it through movesW.
	mv *jobMoves
	// later are facts about attempts after the current one, applied when
	// the job reaches that attempt (see Store.ahead).
	later []func()

	// parts are the current attempt's allocations by rank: one for a job
	// on one machine, one per machine for a gang. Nil while queued with
	// no plan in flight.
	parts []*part

	// memo is what cycles derive from Request alone (jobmemo.go).
	memo *jobMemo

	// Pending is the job's current reason for waiting; pubPending the code
	// of the last pending event published for this attempt, pubMessage
	// its message's msgKey, pendingSeq how many were published.
	Pending    placement.Pending
	pubPending contracts.Reason
	pubMessage uint64
	pendingSeq int
	// pubPendingAt is when the last pending event was published: a job
	// waiting for capacity flips between "no free GPUs" and "the free ones
	// went to jobs ahead" whenever a GPU frees, so events are spaced.
	pubPendingAt time.Time
}

// part is one allocation of a job's attempt and the facts about it.
type part struct {
	// alloc is never changed in place once the part has it (a fact
	// replaces the pointer): a committed part shares the cluster's copy
	// (committedAlloc), an in-flight one the cluster assumes (fly), so a
	// running job holds its allocation once, not twice (~370 bytes).
	alloc     *contracts.Allocation
	inFlight  bool // proposed in a plan, not answered yet
	committed bool
	started   *time.Time
	ended     *contracts.RunResult
	released  *contracts.LedgerEntry
	stopSent  contracts.Reason // the reason of the stop sent, "" when none
	// checkpointed is when the run last reported a complete checkpoint;
	// askedDone is set when one answered the move's checkpoint request.
	checkpointed *time.Time
	askedSent    bool
	askedDone    bool
	// pulls counts the pulling facts of its run (the seq of their events).
	pulls int
}

// done reports whether the part no longer runs: its run ended, or its
// allocation was released without a run fact to wait for (node lost).
func (p *part) done() bool {
	return p.ended != nil || (p.released != nil && !awaitsRunFact(p.released.Reason))
}

// live reports whether the part holds or may start a run.
func (p *part) live() bool { return p.committed && !p.done() }

// part returns the part of the current attempt with allocation ID id.
func (j *Job) part(id string) *part {
	for _, p := range j.parts {
		if p.alloc.ID == id {
			return p
		}
	}
	return nil
}

func (j *Job) count(pred func(*part) bool) int {
	n := 0
	for _, p := range j.parts {
		if pred(p) {
			n++
		}
	}
	return n
}

// PendingEventInterval is the least time between two pending events of one
// job. The current reason is always in the store; readers of events see it
// at most this late (plus a resync interval).
const PendingEventInterval = 5 * time.Second

// PendingRefreshInterval is the least time between two pending events of
// one job with the same code: a changed message alone waits this long.
const PendingRefreshInterval = time.Minute

type rejection struct {
	reason contracts.Reason
	errors []contracts.FieldError
}

// Store is the scheduler's state. See the package comment.
type Store struct {
	cfg  Config
	log  *slog.Logger
	live bool
	jobs map[string]*Job
	// missing are dependencies the cycles found missing while the store
	// forgets (TakeMissing).
	missing map[string]struct{}
	queue   *queue.Queue[*Job]
	flying  map[string]*Job     // allocation ID -> job with that plan item in flight
	seenIDs map[string]struct{} // rejected events already in JOB_EVENTS
	// accepting counts, by JOBS sequence, the requests whose queued event
	// is being published: jobs that arrived later wait for them.
	accepting map[uint64]int
	// acceptingJobs are the same requests by job key (with their JOBS
	// sequence): a later request may already depend on them.
	acceptingJobs map[string]uint64
	cluster       *cluster
	planSeq       uint64
	out           []Publish
	// Administrators' settings, from the KV buckets.
	quotas   map[string]contracts.TenantQuota
	pools    map[string]contracts.PoolConfig
	workload workload
	// served stamps, per tenant, the last cycle placement it got (on
	// servedSeq): fair share breaks ties in favour of the longest waiting.
	served    map[string]uint64
	servedSeq uint64
	// evicting are the jobs being moved, until their next attempt: a
	// cycle looks at them for checkpoint waits that timed out.
	evicting map[string]*Job
	// defrag are the pools whose free capacity the monitor reports
	// fragmented (a firing defragment alert), with the alert's key.
	defrag map[string]string
	// reservations are the last cycle's backfill reservations: the next
	// cycle starts from them (reserve.go).
	reservations []backfill.Reservation
	// ret is what is kept of retired jobs (retention.go).
	ret *retention
	// names interns what jobs' requests repeat (intern.go).
	names names

	// cycleRefs are committed()'s answer while a cycle runs
	// (cycleRefsOK).
	cycleRefs   []allocRef
	cycleRefsOK bool
	// cycleBufs are a cycle's per-job lists, kept for the next cycle
	// (emptied, so they hold no job): a deep queue's lists are tens of
	// megabytes a cycle that the collector would otherwise reclaim.
	cycleBufs cycleBufs
	// preemptBuf is preemption's victim list, kept likewise (preempt_inputs.go).
	preemptBuf preemptBufs

	// exhaustive has cycles place without the placer's failure memos
	// (the tests' reference for them).
	exhaustive bool
	// defragSearches counts defragment's victim searches (tests: the
	// searches shared among blocked jobs that ask the same).
	defragSearches int
}

// New returns an empty store.
func New(cfg Config) *Store {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Wake == nil {
		cfg.Wake = func() {}
	}
	if cfg.MaxPlanBytes <= 0 {
		cfg.MaxPlanBytes = 96 * 1024
	}
	if cfg.PreemptGrace <= 0 {
		cfg.PreemptGrace = 30 * time.Second
	}
	if !cfg.Policy.Valid() {
		cfg.Policy = contracts.PolicyFragAware
	}
	if cfg.CheckpointTimeout <= 0 {
		cfg.CheckpointTimeout = 30 * time.Second
	}
	return &Store{
		cfg:           cfg,
		log:           cfg.Log,
		jobs:          map[string]*Job{},
		queue:         queue.New[*Job](),
		flying:        map[string]*Job{},
		seenIDs:       map[string]struct{}{},
		accepting:     map[uint64]int{},
		acceptingJobs: map[string]uint64{},
		cluster:       newCluster(),
		quotas:        map[string]contracts.TenantQuota{},
		pools:         map[string]contracts.PoolConfig{},
		served:        map[string]uint64{},
		evicting:      map[string]*Job{},
		defrag:        map[string]string{},
	}
}

// Key is the store's key of a job.
func Key(tenant, jobID string) string { return tenant + "/" + jobID }

// idIn is the job ID in key, Key(tenant, id): a job's ID and its
// request's share their key's text instead of a copy each.
func idIn(key, tenant string) string { return key[len(tenant)+1:] }

// Job returns a copy of the job's public view, for tests and logs.
func (s *Store) Job(tenant, jobID string) (Job, bool) {
	j := s.lookup(tenant, jobID) // a retired job's stand-in too
	if j == nil {
		return Job{}, false
	}
	return *j, true
}

// Live reports whether GoLive was called.
func (s *Store) Live() bool { return s.live }

// Queued is the number of jobs waiting in the queue.
func (s *Store) Queued() int { return s.queue.Len() }

func (s *Store) take() []Publish {
	out := s.out
	s.out = nil
	return out
}

// ---- rebuilding after a restart ----

// ReplayJobEvent folds one event of JOB_EVENTS (at stream sequence seq,
// with Nats-Msg-Id msgID) into the store. Events the state machine refuses
// are skipped, as every reader does.
func (s *Store) ReplayJobEvent(ev contracts.JobEvent, seq uint64, msgID string) {
	if s.jobs[Key(ev.Tenant, ev.JobID)] == nil && (s.isRetired(Key(ev.Tenant, ev.JobID)) || ev.AnswersDuplicate()) {
		// It ended: no event applies to it any more. Or it ended so long
		// ago that only the log remembers it: a duplicate_job_id answer
		// is never a job's first event, so it must not make one.
		return
	}
	if ev.Type == contracts.EventRejected && msgID != "" {
		s.seenIDs[msgID] = struct{}{}
	}
	key := Key(ev.Tenant, ev.JobID)
	j := s.jobs[key]
	from := contracts.StateNew
	if j != nil {
		from = j.State
	}
	to, err := contracts.Transition(from, ev.Type)
	if err != nil {
		return
	}
	if j == nil {
		j = &Job{Tenant: s.names.of(ev.Tenant), ID: idIn(key, ev.Tenant), key: key}
		s.jobs[key] = j
	}
	j.State = to
	switch ev.Type {
	case contracts.EventQueued:
		if ev.Request == nil {
			s.log.Error("queued event without a request", "tenant", ev.Tenant, "job_id", ev.JobID, "stream_seq", seq)
			return
		}
		req := *ev.Request
		s.names.request(&req)
		if req.ID == j.ID {
			req.ID = j.ID // one text for the job's ID
		}
		order := ev.SubmitSeq
		if order == 0 {
			order = seq // written before queued events carried it
		}
		j.Request, j.hash, j.Attempt, j.seq, j.queuedAt = &req, hashRequest(req), max(ev.Attempt, 1), order, stampOf(ev.Time)
		s.pinDeps(j)
		s.workload.add(req.Resources.GPU)
		s.enqueue(j)
	case contracts.EventRejected:
		j.rejection = &rejection{reason: ev.Reason, errors: ev.Errors}
		s.noteEnded(j, ev.Time)
	case contracts.EventPending:
		if ev.Attempt == j.Attempt {
			j.pubPending, j.pubPendingAt, j.pubMessage = ev.Reason, ev.Time, msgKey(ev.Message)
			j.Pending = placement.Pending{Code: ev.Reason, Message: ev.Message}
			// The highest sequence its ID carries (order-free, so a
			// snapshot keeping the highest and the last of a run of them
			// replays to the same: snapshot.go's pendingRun); one more
			// for an event whose ID carries none.
			if seq := pendingSeqOf(msgID); seq > 0 {
				j.pendingSeq = max(j.pendingSeq, seq)
			} else {
				j.pendingSeq++
			}
		}
	case contracts.EventScheduled:
		s.queue.Remove(key)
	case contracts.EventMigrating:
		if ev.Attempt == j.Attempt && ev.Migration != nil {
			m := *ev.Migration
			mv := j.movesW()
			mv.migration, j.evict, mv.evictMsg, mv.evictAt = &m, m.Reason, ev.Message, ev.Time
			if len(m.KeepOff) > 0 {
				// Until the next attempt commits (a ledger fact, read after
				// the events): the move's nodes stay someone else's.
				mv.avoid = map[string]bool{}
				for _, n := range m.KeepOff {
					mv.avoid[n] = true
				}
			}
			if m.Deadline != nil {
				mv.evictBy = *m.Deadline
			}
			s.evicting[key] = j
		}
	case contracts.EventMigrated:
		if j.mv != nil {
			j.mv.moved = nil
			j.tidyMoves()
		}
	case contracts.EventRequeued:
		if retriesLaunch(ev.Reason) {
			j.launchRetries++
		}
		s.keepMove(j)
		s.resetAttempt(j, ev.Attempt)
		if from != contracts.StateQueued {
			j.queuedAt = stampOf(ev.Time) // placed once: a new wait (requeue)
		}
		s.enqueue(j)
	case contracts.EventSucceeded, contracts.EventFailed, contracts.EventCancelled:
		s.finish(j)
		s.endedAt(j, ev.Time)
	}
}

// pendingSeqOf reads the sequence from a pending event's ID
// (job/<tenant>/<job>/pending/<attempt>/<seq>), or 0.
func pendingSeqOf(id string) int {
	parts := strings.Split(id, "/")
	if len(parts) != 6 {
		return 0
	}
	n, _ := strconv.Atoi(parts[5])
	return n
}

// ReplayCancel records a cancel request found in JOBS, so that a cancel
// accepted before a restart (waiting on a plan in flight) is not
// forgotten. A cancel of an unknown or terminal job is ignored.
func (s *Store) ReplayCancel(subject string, data []byte, streamSeq uint64) {
	tenant, err := contracts.TenantFromSubject(subject)
	if err != nil {
		return
	}
	c, err := contracts.DecodeCancelRequest(data)
	if err != nil {
		return
	}
	// Only a cancel that arrived after the job's own submit (both are JOBS
	// sequences) applies: live, an earlier one found no job and changed
	// nothing, so a replay must not let it cancel the job now.
	if j := s.jobs[Key(tenant, c.JobID)]; j != nil && !j.State.Terminal() && streamSeq > j.seq {
		j.cancel, j.cancelReason = true, c.Reason
	}
}

// ReplayPlan records the items of one of this scheduler's past plans as in
// flight when they still concern a queued job's current attempt: the
// devices stay held until the ledger or a refusal answers (the ALLOCATIONS
// stream, followed next, says which already did).
func (s *Store) ReplayPlan(p contracts.Plan) {
	byJob := map[*Job][]*contracts.Allocation{}
	var order []*Job
	for _, item := range p.Items {
		j := s.jobs[Key(item.Tenant, item.JobID)]
		item := item
		item.PlanID = cmp.Or(item.PlanID, p.ID)
		if j != nil && !j.State.Terminal() && item.Attempt > j.Attempt {
			// The plan of an attempt whose requeued event was lost (see
			// Store.ahead): its devices stay held until the ledger or a
			// refusal answers, and the requeue takes it over. A later
			// plan of that attempt supersedes an earlier one.
			s.cluster.forget(item.ID, "")
			s.cluster.assume(&item)
			continue
		}
		if j == nil || j.State != contracts.StateQueued || item.Attempt != j.Attempt {
			continue
		}
		if _, ok := byJob[j]; !ok {
			order = append(order, j)
		}
		byJob[j] = append(byJob[j], &item)
	}
	for _, j := range order {
		// A later plan for the same attempt supersedes: the earlier one
		// was refused before the job was placed again.
		for _, old := range j.parts {
			s.cluster.forget(old.alloc.ID, old.alloc.PlanID)
		}
		s.landAll(j)
		s.fly(j, byJob[j])
	}
}

// GoLive ends the rebuild: from now on decisions are published. It returns
// what the rebuilt state owes (events the previous run did not get to
// publish, stop commands for accepted cancels).
func (s *Store) GoLive() []Publish {
	s.live = true
	keys := make([]string, 0, len(s.jobs))
	for k, j := range s.jobs {
		if !j.State.Terminal() {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		s.advance(s.jobs[k])
	}
	s.cfg.Wake()
	return s.take()
}

// ---- requests ----

// Submission is the decision on one job request.
type Submission struct {
	// Publish is the event to publish before acknowledging; nil when the
	// request changes nothing (an identical resubmit).
	Publish *Publish
	// Invalid is set when nothing can be published for the request (its
	// subject names no valid tenant): the caller dead-letters it.
	Invalid error
	// Outcome names the decision for logs: queued, rejected, duplicate,
	// unchanged, invalid, or recall.
	Outcome string
	// Recall, when set, is all there is: the store keys of jobs the
	// request asks about that the store may have forgotten. Read each
	// from JOB_EVENTS (FoldRecalled), hand the answers to the parsed
	// request (ParsedSubmit.Recall) and submit it again.
	Recall []string
	commit func(seq uint64)
	// abandoned undoes what the decision did beyond accepting (pins).
	abandoned func()
	// accepted drops the request from the set still being accepted.
	accepted func()
}

// Published records that the submission's event was stored at JOB_EVENTS
// sequence seq. Call it only after the publish succeeded.
func (sub Submission) Published(seq uint64) {
	if sub.commit != nil {
		sub.commit(seq)
	}
	if sub.accepted != nil {
		sub.accepted()
	}
}

// Abandoned says the answer could not be published: the request will be
// redelivered and decided again. Later arrivals no longer wait for it.
func (sub Submission) Abandoned() {
	if sub.abandoned != nil {
		sub.abandoned()
	}
	if sub.accepted != nil {
		sub.accepted()
	}
}

// Submit decides a job request received on subject at JOBS sequence
// streamSeq. Nothing changes until Published is called, so a publish that
// fails leaves the store as it was and a redelivery decides again.
func (s *Store) Submit(subject string, data []byte, streamSeq uint64) Submission {
	return s.SubmitParsed(ParseSubmit(subject, data), streamSeq)
}

// ParsedSubmit is a job request as ParseSubmit read it: what Submit
// derives from the message alone, before it asks the store anything.
type ParsedSubmit struct {
	tenant  string // a piece of the subject until SubmitParsed interns it
	invalid error  // the subject names no valid tenant
	req     contracts.JobRequest
	err     error // the request does not decode or validate
	norm    contracts.JobRequest
	hash    [sha256.Size]byte
	// recalled are the log's answers about jobs the store may have
	// forgotten (Recall), by store key.
	recalled map[string]Recalled
}

// ParseSubmit decodes, validates, normalizes and hashes a job request
// received on subject. It reads no store and may run outside the
// scheduler's lock, beside a cycle: it is ~80 % of what a submit costs
// (the schema check, the decode and the hash's encoding), which under
// the lock held back both the cycle and the requests behind it.
func ParseSubmit(subject string, data []byte) ParsedSubmit {
	tenant, err := contracts.TenantFromSubject(subject)
	if err != nil {
		return ParsedSubmit{invalid: err}
	}
	p := ParsedSubmit{tenant: tenant}
	if p.req, p.err = contracts.DecodeJobRequest(data, tenant); p.err != nil {
		return p
	}
	p.norm = p.req.Normalized(tenant)
	// Interning (SubmitParsed) shares equal texts and changes none, so
	// the hash is the interned request's.
	p.hash = hashRequest(p.norm)
	return p
}

// SubmitParsed is Submit of a request ParseSubmit read.
func (s *Store) SubmitParsed(p ParsedSubmit, streamSeq uint64) Submission {
	if p.invalid != nil {
		return Submission{Invalid: fmt.Errorf("job request: %w", p.invalid), Outcome: "invalid"}
	}
	tenant := s.names.of(p.tenant) // a piece of the subject: kept, it would keep the subject
	if need := s.toRecall(p, tenant, streamSeq); len(need) > 0 {
		return Submission{Recall: need, Outcome: "recall"}
	}
	req := p.req
	if p.err != nil {
		return s.reject(tenant, req.ID, streamSeq, p.err)
	}
	norm, h := p.norm, p.hash
	s.names.request(&norm)
	key := Key(tenant, req.ID)
	norm.ID = idIn(key, tenant) // the same text: the job keeps it in its key anyway
	if j := s.lookup(tenant, req.ID); j != nil {
		if j.rejection == nil && sameRequest(j, h) {
			return Submission{Outcome: "unchanged"}
		}
		return s.duplicate(j, streamSeq)
	}
	if err := s.checkDependencies(tenant, norm, streamSeq); err != nil {
		return s.reject(tenant, req.ID, streamSeq, err)
	}
	if err := s.checkShareFits(norm); err != nil {
		return s.reject(tenant, req.ID, streamSeq, err)
	}
	if err := s.checkRuntime(norm); err != nil {
		return s.reject(tenant, req.ID, streamSeq, err)
	}
	if s.cfg.Admit != nil {
		if err := s.cfg.Admit(tenant, norm); err != nil {
			return s.reject(tenant, req.ID, streamSeq, err)
		}
	}
	now := s.cfg.Now().UTC()
	ev := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: contracts.EventQueued, Tenant: tenant,
		JobID: req.ID, Attempt: 1, State: contracts.StateQueued, Time: now, Request: &norm, SubmitSeq: streamSeq}
	// Until its queued event is stored, this request holds back every job
	// that arrived after it (see Cycle): requests are answered in
	// parallel, and FIFO means arrival order on JOBS.
	s.accepting[streamSeq]++
	s.acceptingJobs[key] = streamSeq
	// Its dependencies are pinned from now, not from its commit: their
	// records must not be forgotten while its queued event is in flight
	// (the job, once committed, holds the pins until it ends: finish).
	s.pinKeys(tenant, norm.DependsOn, 1)
	return Submission{
		Publish: &Publish{Subject: contracts.SubjectJobEvents(tenant, req.ID), Key: key, Msg: ev,
			ID: contracts.JobEventID(tenant, req.ID, contracts.EventQueued, 1, 0)},
		Outcome:   "queued",
		abandoned: func() { s.pinKeys(tenant, norm.DependsOn, -1) },
		accepted: func() {
			if s.accepting[streamSeq]--; s.accepting[streamSeq] <= 0 {
				delete(s.accepting, streamSeq)
			}
			if s.acceptingJobs[key] == streamSeq {
				delete(s.acceptingJobs, key)
			}
			s.cfg.Wake()
		},
		// The queue orders by the request's JOBS sequence, not by when its
		// queued event was stored: requests are answered in parallel, so
		// queued events may be stored out of arrival order.
		commit: func(uint64) {
			j := &Job{Tenant: tenant, ID: norm.ID, key: key, State: contracts.StateQueued, Attempt: 1,
				Request: &norm, hash: h, seq: streamSeq, queuedAt: stampOf(now)}
			s.jobs[key] = j
			s.enqueue(j)
			s.workload.add(norm.Resources.GPU)
			s.cfg.Wake()
		},
	}
}

// reject answers an invalid request: on the job's own subject when its ID
// is usable, else on rej-<streamSeq>.
func (s *Store) reject(tenant, id string, streamSeq uint64, err error) Submission {
	var ve *contracts.ValidationError
	if !errors.As(err, &ve) {
		ve = &contracts.ValidationError{Reason: contracts.ReasonInvalidRequest,
			Fields: []contracts.FieldError{{Reason: contracts.ReasonInvalidRequest, Message: err.Error()}}}
	}
	if contracts.ValidateID(id) != nil {
		id = contracts.RejectedJobID(streamSeq)
	}
	key := Key(tenant, id)
	if j := s.lookup(tenant, id); j != nil {
		if sameRejection(j, ve.Reason, ve.Fields) {
			return Submission{Outcome: "unchanged"}
		}
		return s.duplicate(j, streamSeq)
	}
	evID := contracts.JobEventID(tenant, id, contracts.EventRejected, 0, 0)
	ev := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: contracts.EventRejected, Tenant: tenant,
		JobID: id, State: contracts.StateRejected, Time: s.cfg.Now().UTC(), Reason: ve.Reason,
		Message: ve.Error(), Errors: ve.Fields}
	return Submission{
		Publish: &Publish{Subject: contracts.SubjectJobEvents(tenant, id), ID: evID, Msg: ev, Key: key},
		Outcome: "rejected",
		commit: func(uint64) {
			j := &Job{Tenant: tenant, ID: id, key: key, State: contracts.StateRejected,
				rejection: &rejection{reason: ve.Reason, errors: ve.Fields}}
			s.jobs[key] = j
			s.noteEnded(j, s.cfg.Now())
			s.seenIDs[evID] = struct{}{}
		},
	}
}

// duplicate rejects a request that reuses job j's ID with another body.
// This is the one event published without a valid transition: FLOWS.md
// asks for it so the submitter gets an answer, and every reader's
// Transition ignores it, leaving the job unaffected. Its ID carries the
// request's stream sequence, so each offending request is answered once.
func (s *Store) duplicate(j *Job, streamSeq uint64) Submission {
	evID := contracts.JobEventID(j.Tenant, j.ID, contracts.EventRejected, 0, int(streamSeq))
	if _, seen := s.seenIDs[evID]; seen {
		return Submission{Outcome: "unchanged"}
	}
	msg := fmt.Sprintf("job ID %s is already taken by another request (state %s); resubmit the same body, or use a new ID", j.ID, j.State)
	ev := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: contracts.EventRejected, Tenant: j.Tenant,
		JobID: j.ID, State: contracts.StateRejected, Time: s.cfg.Now().UTC(), Reason: contracts.ReasonDuplicateJobID,
		Message: msg, Errors: []contracts.FieldError{{Field: "id", Reason: contracts.ReasonDuplicateJobID, Message: msg}}}
	return Submission{
		Publish: &Publish{Subject: contracts.SubjectJobEvents(j.Tenant, j.ID), ID: evID, Msg: ev, Key: j.key},
		Outcome: "duplicate",
		commit:  func(uint64) { s.seenIDs[evID] = struct{}{} },
	}
}

// ErrUnknownJob and ErrTerminalJob explain a cancel that changes nothing.
var (
	ErrUnknownJob  = errors.New("unknown job")
	ErrTerminalJob = errors.New("job already ended")
)

// Cancel applies a cancel request received on subject. It returns what to
// publish before acknowledging (a cancelled event, or a stop command), or
// an error: a bus-level invalid request (the caller dead-letters it), or
// ErrUnknownJob / ErrTerminalJob (the caller logs and acknowledges).
func (s *Store) Cancel(subject string, data []byte) ([]Publish, error) {
	tenant, err := contracts.TenantFromSubject(subject)
	if err != nil {
		return nil, fmt.Errorf("cancel request: %w", err)
	}
	c, err := contracts.DecodeCancelRequest(data)
	if err != nil {
		return nil, fmt.Errorf("cancel request: %w", err)
	}
	j := s.lookup(tenant, c.JobID)
	switch {
	case j == nil && s.Forgetting():
		return nil, fmt.Errorf("cancel %s/%s (never submitted, or ended longer ago than the scheduler remembers): %w",
			tenant, c.JobID, ErrUnknownJob)
	case j == nil:
		return nil, fmt.Errorf("cancel %s/%s: %w", tenant, c.JobID, ErrUnknownJob)
	case j.State.Terminal():
		return nil, fmt.Errorf("cancel %s/%s (%s): %w", tenant, c.JobID, j.State, ErrTerminalJob)
	}
	j.cancel, j.cancelReason = true, c.Reason
	// A redelivered cancel of a running job sends the same stop again
	// (same message ID), so the caller can wait on it.
	for _, p := range j.parts {
		p.stopSent = ""
	}
	s.advance(j)
	return s.take(), nil
}

// ---- helpers ----

func hashRequest(r contracts.JobRequest) [sha256.Size]byte {
	b, err := json.Marshal(r)
	if err != nil {
		// A decoded request always encodes; keep a distinct hash anyway.
		return sha256.Sum256([]byte(err.Error()))
	}
	return sha256.Sum256(b)
}

func (s *Store) enqueue(j *Job) {
	if j.Request == nil || len(j.parts) > 0 {
		return
	}
	s.queue.Push(queue.Item[*Job]{Key: j.key, Tenant: j.Tenant, Priority: j.Request.Priority, Seq: j.seq, Value: j})
}

// event builds a job event of type typ for j, checks the transition, moves
// j to the new state and returns false when the state machine refuses.
func (s *Store) emit(j *Job, typ contracts.JobEventType, seq int, fill func(*contracts.JobEvent)) bool {
	to, err := contracts.Transition(j.State, typ)
	if err != nil {
		s.log.Error("refusing to publish an invalid job event", "tenant", j.Tenant, "job_id", j.ID, "err", err)
		return false
	}
	ev := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: typ, Tenant: j.Tenant, JobID: j.ID,
		Attempt: j.Attempt, State: to, Time: s.cfg.Now().UTC()}
	if fill != nil {
		fill(&ev)
	}
	j.State = to
	s.out = append(s.out, Publish{Subject: contracts.SubjectJobEvents(j.Tenant, j.ID), Key: j.key, Msg: ev,
		ID: contracts.JobEventID(j.Tenant, j.ID, typ, ev.Attempt, seq)})
	return true
}

// setPending records j's reason for waiting and publishes a pending event
// when its code changed, at most once per PendingEventInterval (the code
// can flip with every freed GPU), or when only its message changed, at
// most once per PendingRefreshInterval: the message's facts (queue
// position, free blocks, a reservation's start, rounded) go stale
// otherwise, but moving every cycle they are not worth an event each
// time. preempting is a step of its own, always shown when it begins.
func (s *Store) setPending(j *Job, p placement.Pending) { s.publishPending(j, p, false) }

// publishPending is setPending; now publishes a changed reason at once
// (a new fact worth telling, such as when preemption will make room).
func (s *Store) publishPending(j *Job, p placement.Pending, now bool) {
	j.Pending = p
	if !s.live || j.State != contracts.StateQueued {
		return
	}
	at := s.cfg.Now()
	since := at.Sub(j.pubPendingAt)
	if !now && j.pubPending != "" && p.Code == j.pubPending && since < PendingRefreshInterval {
		// The switch below returns whatever the message: its key is not
		// needed (most of a steady cycle's ~87,000 waiting jobs, each
		// with a message of its own, hashed for nothing).
		return
	}
	msg := msgKey(p.Message)
	if p.Code == j.pubPending && msg == j.pubMessage {
		return
	}
	switch {
	case j.pubPending == "", now:
	case p.Code == contracts.PendingPreempting && j.pubPending != p.Code:
	case p.Code != j.pubPending && since < PendingEventInterval:
		return // a later cycle publishes the reason current then
	case p.Code == j.pubPending && since < PendingRefreshInterval:
		return
	}
	j.pendingSeq++
	j.pubPending, j.pubPendingAt, j.pubMessage = p.Code, at, msg
	s.emit(j, contracts.EventPending, j.pendingSeq, func(ev *contracts.JobEvent) {
		ev.Reason, ev.Message = p.Code, p.Message
	})
}

// fly records the parts of a plan for j's current attempt as in flight.
// The parts take items over: the caller must not change or reuse them.
func (s *Store) fly(j *Job, items []*contracts.Allocation) {
	j.parts = make([]*part, len(items))
	for i, item := range items {
		j.parts[i] = &part{alloc: item, inFlight: true}
		s.flying[item.ID] = j
		s.cluster.assume(item)
	}
	s.queue.Remove(j.key)
	delete(s.cluster.claims, j.key) // the plan holds the devices now
	// Cycles offer only queued jobs: a placed one's memo (~130 bytes with
	// its pools) would sit unread while it runs. A requeue derives it
	// afresh (memoFor), as for a new request.
	j.memo = nil
	// Concatenation, not Sprintf: a burst cycle sets thousands of these.
	j.Pending = placement.Pending{Code: contracts.PendingPlanInFlight,
		Message: "proposed on " + items[0].NodeID + " in plan " + items[0].PlanID + "; waiting for the resource manager to commit"}
}

// land marks p answered.
func (s *Store) land(p *part) {
	if p.inFlight {
		delete(s.flying, p.alloc.ID)
		p.inFlight = false
	}
}

func (s *Store) landAll(j *Job) {
	for _, p := range j.parts {
		s.land(p)
	}
}

func (s *Store) resetAttempt(j *Job, attempt int) {
	s.landAll(j)
	j.Attempt = attempt
	j.parts, j.evict = nil, ""
	j.endAttemptMoves()
	delete(s.evicting, j.key)
	j.pubPending, j.pendingSeq, j.Pending, j.pubPendingAt, j.pubMessage = "", 0, placement.Pending{}, time.Time{}, 0
}

// finish forgets what a terminal job no longer needs; the hash stays so a
// resubmit of the same ID is still recognised.
func (s *Store) finish(j *Job) {
	s.queue.Remove(j.key)
	s.landAll(j)
	s.unpinDeps(j)
	j.Request, j.parts, j.later, j.mv, j.memo = nil, nil, nil, nil, nil
	delete(s.evicting, j.key)
	delete(s.cluster.claims, j.key)
	j.Pending = placement.Pending{}
	s.noteEnded(j, s.cfg.Now())
	// Jobs that depend on this one may now run, or must be cancelled.
	s.cfg.Wake()
}
