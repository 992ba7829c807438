package gateway

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// Following a run's output.
const (
	// logEOFGrace is how long a follow waits for an attempt's EOF chunk
	// after the job's events say the attempt is over: the agent ships
	// the last chunks and the run fact independently, so the job event
	// can overtake them. A run that never sends one (its machine died)
	// ends the follow after this.
	logEOFGrace = 5 * time.Second
	// logPoll is how often a follow re-reads the job's state.
	logPoll = 250 * time.Millisecond
)

// logQuery is what GET .../logs asks for.
type logQuery struct {
	attempt int  // the attempt to show; 0 with all
	all     bool // every attempt, in order
	follow  bool
	// rank is the machine of a multi-machine job whose output to show
	// (GangPart.Rank); 0, the only one, for a single-machine job.
	rank int
}

// parseLogQuery reads ?attempt=N|all, ?rank=N and ?follow=; it answers
// 400 and returns false on a bad value. Whether the job has a machine of
// that rank is checked against its request later (jobLogs).
func parseLogQuery(w http.ResponseWriter, r *http.Request) (logQuery, bool) {
	var q logQuery
	var fields []contracts.FieldError
	switch v := r.URL.Query().Get("attempt"); v {
	case "", "latest":
	case "all":
		q.all = true
	default:
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			fields = append(fields, contracts.FieldError{Field: "attempt", Reason: contracts.ReasonInvalidValue,
				Message: fmt.Sprintf("attempt %q; want a number from 1, latest or all", v)})
		}
		q.attempt = n
	}
	if v := r.URL.Query().Get("rank"); v != "" {
		// A gang has at most MaxNodesPerJob machines, ranked from 0.
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n >= contracts.MaxNodesPerJob {
			fields = append(fields, contracts.FieldError{Field: "rank", Reason: contracts.ReasonInvalidValue,
				Message: fmt.Sprintf("rank %q; want a machine's rank, a number from 0 to %d", v, contracts.MaxNodesPerJob-1)})
		}
		q.rank = n
	}
	if v := r.URL.Query().Get("follow"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			fields = append(fields, contracts.FieldError{Field: "follow", Reason: contracts.ReasonInvalidValue,
				Message: fmt.Sprintf("follow %q; want true or false", v)})
		}
		q.follow = b
	}
	if len(fields) > 0 {
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, "invalid query parameters", fields)
		return q, false
	}
	return q, true
}

// jobLogs answers the output of a job's runs as text/plain, read from the
// LOGS stream (subjects SubjectJobLogs(tenant, job)): by default of its latest
// attempt, with ?attempt=N of another, with ?attempt=all of every attempt
// one after the other. A job that spans several machines (a gang) has one
// output per machine, each shipped under its part's allocation ID
// (contracts.AllocationPartID): ?rank=N picks the machine, 0 by default;
// a single-machine job has only rank 0. Everything below then applies to
// that machine's output alone, its own EOF and exit code included.
// Chunks are de-duplicated by (attempt, offset) and
// written in offset order (runLog). With ?follow=true the answer goes on
// as output is written and ends at the EOF chunk of the attempt (of the
// latest attempt with all), when the attempt is over and no EOF came
// within logEOFGrace, or when the client goes away. A job that has not
// started yet answers an empty body (or, following, waits).
//
// What is known only at the end travels in trailers: TrailerLogComplete,
// TrailerExitCode and TrailerLogGaps.
func (s *server) jobLogs(w http.ResponseWriter, r *http.Request) {
	tenant, id, ok := tenantJob(w, r)
	if !ok {
		return
	}
	q, ok := parseLogQuery(w, r)
	if !ok || !s.modelReady(w) {
		return
	}
	st, err := s.model.Job(r.Context(), tenant, id)
	if !s.jobFound(w, tenant, id, err) {
		return
	}
	switch {
	case q.all:
		q.attempt = 0
	case q.attempt == 0:
		q.attempt = max(st.Attempt, 1) // a rejected job has attempt 0 and no output
	case q.attempt > max(st.Attempt, 1):
		msg := fmt.Sprintf("job %s has had %d attempts; want 1 to %d, latest or all", id, st.Attempt, max(st.Attempt, 1))
		writeError(w, http.StatusBadRequest, contracts.ReasonOutOfRange, msg,
			[]contracts.FieldError{{Field: "attempt", Reason: contracts.ReasonOutOfRange, Message: msg}})
		return
	}
	machines := jobMachines(st)
	if q.rank >= machines {
		msg := fmt.Sprintf("job %s runs on one machine; want rank 0", id)
		if machines > 1 {
			msg = fmt.Sprintf("job %s runs on %d machines; want rank 0 to %d", id, machines, machines-1)
		}
		writeError(w, http.StatusBadRequest, contracts.ReasonOutOfRange, msg,
			[]contracts.FieldError{{Field: "rank", Reason: contracts.ReasonOutOfRange, Message: msg}})
		return
	}

	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	stopOnShutdown := context.AfterFunc(s.streams, cancel)
	defer stopOnShutdown()

	h := w.Header()
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	h.Set("Trailer", strings.Join([]string{contracts.TrailerLogComplete, contracts.TrailerExitCode, contracts.TrailerLogGaps}, ", "))
	shown := "all"
	if !q.all {
		shown = strconv.Itoa(q.attempt)
	}
	h.Set(contracts.HeaderLogAttempt, shown)

	body := &lazyBody{w: w}
	ls := &logStream{w: body, tenant: tenant, job: id, gang: machines > 1, rank: q.rank, all: q.all, cur: max(q.attempt, 1),
		runs: map[int]*runLog{}}
	spec := bus.FollowSpec{Stream: contracts.StreamLogs, FilterSubjects: []string{contracts.SubjectJobLogs(tenant, id)}}
	if q.follow {
		body.start() // the client learns at once that the stream is open
		err = s.followLogs(ctx, w, ls, spec, st)
	} else {
		_, err = s.bus.Replay(ctx, spec, func(_ context.Context, m *bus.Msg) error {
			return ls.offer(m, func(a int) bool { return a < st.Attempt || st.State.Terminal() }, s)
		})
		if err == nil {
			err = ls.finishAll()
		}
	}
	if err != nil && ctx.Err() == nil {
		if !body.started {
			h.Del("Trailer")
			h.Del(contracts.HeaderLogAttempt)
			writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("reading the job's output: %v", err), nil)
			return
		}
		// The status line has gone: the trailers say the output is
		// incomplete, and the log says why.
		s.log.Warn("log stream ended early", "tenant", tenant, "job_id", id, "err", err)
	}
	body.start()
	ls.trailers(h)
	if gaps := h.Get(contracts.TrailerLogGaps); gaps != "" {
		s.log.Warn("run output has gaps", "tenant", tenant, "job_id", id, "gaps", gaps)
	}
}

// jobMachines is the number of machines each attempt of the job runs on:
// its request's, or, should the request be unknown, the placements of its
// current attempt. Every attempt of a job has the same shape, so one
// number serves ?attempt=all too.
func jobMachines(st contracts.JobStatus) int {
	n := max(1, len(st.Placements))
	if st.Request != nil {
		n = max(n, st.Request.Resources.GPU.Machines())
	}
	return n
}

// followLogs relays the job's chunks, history first, until the stream is
// done (logStream.done) or ctx ends. It re-reads the job's state every
// logPoll to notice an attempt that ended without an EOF chunk.
func (s *server) followLogs(ctx context.Context, w http.ResponseWriter, ls *logStream, spec bus.FollowSpec, st contracts.JobStatus) error {
	ctx, cancel := context.WithCancel(ctx)
	msgs := make(chan *bus.Msg)
	caughtUp := make(chan struct{})
	readErr := make(chan error, 1)
	go func() {
		readErr <- s.bus.Follow(ctx, spec, func(ctx context.Context, m *bus.Msg) error {
			select {
			case msgs <- m:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}, func() { close(caughtUp) })
	}()
	// history is caughtUp until it fires, then nil: a closed channel
	// would be ready in every select.
	history := (<-chan struct{})(caughtUp)
	defer func() {
		cancel()
		<-readErr
	}()

	rc := http.NewResponseController(w)
	if err := rc.Flush(); err != nil {
		return err
	}
	// overAt is when each attempt was first seen over (finished,
	// superseded by a later attempt, or the job ended). One already over
	// when the request came is dated by the job's last event, so an old
	// run without an EOF does not make the client wait.
	overAt := map[int]time.Time{}
	over := func(a int) bool { return a < st.Attempt || st.State.Terminal() }
	startSt := st
	tick := time.NewTicker(logPoll)
	defer tick.Stop()
	caught := false
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-readErr:
			readErr <- err // for the deferred wait
			return err
		case <-history:
			caught, history = true, nil
		case m := <-msgs:
			if err := ls.offer(m, over, s); err != nil {
				return err
			}
		case <-tick.C:
			if cur, err := s.model.Job(ctx, ls.tenant, ls.job); err == nil {
				st = cur
			}
		}
		if caught {
			now := s.now()
			for a := ls.cur; over(a) && !ls.done(st.Attempt); a = ls.cur {
				if _, ok := overAt[a]; !ok {
					overAt[a] = now
					if wasOver := a < startSt.Attempt || startSt.State.Terminal(); wasOver {
						overAt[a] = minTime(startSt.UpdatedAt, now)
					}
				}
				if now.Sub(overAt[a]) < logEOFGrace {
					break
				}
				if err := ls.finishCurrent(); err != nil {
					return err
				}
			}
		}
		if ls.done(st.Attempt) {
			return nil
		}
		if err := rc.Flush(); err != nil {
			return err
		}
	}
}

// lazyBody sends the status line with the first byte of the body, so a
// replay that fails before writing anything can still answer an error.
type lazyBody struct {
	w       http.ResponseWriter
	started bool
}

func (b *lazyBody) start() {
	if !b.started {
		b.started = true
		b.w.WriteHeader(http.StatusOK)
	}
}

func (b *lazyBody) Write(p []byte) (int, error) {
	b.start()
	return b.w.Write(p)
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// logStream writes the chunks of the attempts a request shows, one
// attempt after the other: cur is the attempt being written; chunks of
// later attempts wait in their runLog, chunks of earlier ones come too
// late and are dropped.
type logStream struct {
	w           io.Writer
	tenant, job string
	// gang says the job runs on several machines: its chunks carry part
	// IDs, and only those of rank are shown.
	gang bool
	rank int
	all  bool
	cur  int
	runs map[int]*runLog
	// seen is the highest attempt a chunk was taken of.
	seen int
	// finished are the attempts written to their end, in order.
	finished []int
}

// offer takes one message of the job's logs subject. Chunks of later
// attempts wait for the current one to end; over says whether it is over
// by the job's events, and when it is and the waiting output passes
// maxPendingBytes, its EOF is given up for lost (its machine died) rather
// than holding more. Otherwise the current attempt ends at its EOF chunk,
// at the end of a replay, or by the follow's grace timer.
func (ls *logStream) offer(m *bus.Msg, over func(int) bool, s *server) error {
	var c contracts.LogChunk
	if err := m.Decode(&c); err != nil {
		s.log.Warn("skipping an undecodable log chunk", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
		return nil
	}
	if c.Tenant != ls.tenant || c.JobID != ls.job || c.Attempt < 1 || c.Offset < 0 || !ls.shown(c.AllocationID, c.Attempt) {
		// Another machine of the gang is expected (another request shows
		// it); anything else is not.
		if c.Tenant != ls.tenant || c.JobID != ls.job || !ls.otherPart(c.AllocationID, c.Attempt) {
			s.log.Warn("skipping a log chunk that names another run", "subject", m.Subject, "stream_seq", m.StreamSeq,
				"tenant", c.Tenant, "job_id", c.JobID, "attempt", c.Attempt, "allocation_id", c.AllocationID)
		}
		return nil
	}
	if c.Attempt < ls.cur || !ls.all && c.Attempt != ls.cur {
		return nil
	}
	ls.run(c.Attempt).add(c)
	ls.seen = max(ls.seen, c.Attempt)
	if c.Attempt > ls.cur && over(ls.cur) && ls.held() > maxPendingBytes {
		for ls.cur < c.Attempt {
			if err := ls.finishCurrent(); err != nil {
				return err
			}
		}
	}
	return ls.drain()
}

// shown reports whether a chunk of attempt shipped under allocation id is
// of the run this stream shows. An empty ID (an agent older than the field)
// can only be a single-machine job's: it does not say which part it is.
func (ls *logStream) shown(id string, attempt int) bool {
	if ls.gang {
		return id == contracts.AllocationPartID(ls.tenant, ls.job, attempt, ls.rank)
	}
	return id == "" || id == contracts.AllocationID(ls.tenant, ls.job, attempt)
}

// otherPart reports whether id is a part of attempt of the gang other than
// the one shown: expected, and no reason to warn.
func (ls *logStream) otherPart(id string, attempt int) bool {
	return ls.gang && contracts.IsAllocationPart(id, ls.tenant, ls.job, attempt) && !ls.shown(id, attempt)
}

// held is the output of later attempts waiting for the current one.
func (ls *logStream) held() int {
	n := 0
	for a, l := range ls.runs {
		if a > ls.cur {
			n += l.pendingBytes
		}
	}
	return n
}

func (ls *logStream) run(a int) *runLog {
	l := ls.runs[a]
	if l == nil {
		l = newRunLog()
		ls.runs[a] = l
	}
	return l
}

// drain writes what the current attempt can write; when its output is
// complete (EOF) and every attempt is shown, it moves to the next one.
func (ls *logStream) drain() error {
	for {
		l := ls.run(ls.cur)
		if err := l.drain(ls.w, false); err != nil {
			return err
		}
		if !l.eof || !ls.all {
			return nil
		}
		ls.finished = append(ls.finished, ls.cur)
		ls.cur++
	}
}

// finishCurrent writes everything the current attempt holds, gaps and
// all, and moves on to the next attempt.
func (ls *logStream) finishCurrent() error {
	if err := ls.run(ls.cur).drain(ls.w, true); err != nil {
		return err
	}
	ls.finished = append(ls.finished, ls.cur)
	ls.cur++
	return ls.drain()
}

// finishAll ends a replay: the attempt shown, or with all every attempt
// up to the last one that wrote something, is written out.
func (ls *logStream) finishAll() error {
	for len(ls.finished) == 0 || ls.all && ls.cur <= ls.seen {
		if err := ls.finishCurrent(); err != nil {
			return err
		}
	}
	return nil
}

// done reports whether a follow has shown everything: the selected
// attempt has ended, or with all, the latest attempt has.
func (ls *logStream) done(latest int) bool {
	if !ls.all {
		return len(ls.finished) > 0 || ls.run(ls.cur).eof
	}
	return ls.cur > max(latest, 1)
}

// trailers sets the trailers from the attempts written.
func (ls *logStream) trailers(h http.Header) {
	var last *runLog
	var gaps []string
	shown := append([]int(nil), ls.finished...)
	if !ls.all && len(shown) == 0 {
		shown = []int{ls.cur}
	}
	for _, a := range shown {
		l := ls.runs[a]
		if l == nil {
			last = nil
			continue
		}
		last = l
		if len(l.gaps) > 0 {
			gaps = append(gaps, fmt.Sprintf("attempt %d: %s", a, l.gapText()))
		}
	}
	h.Set(contracts.TrailerLogComplete, strconv.FormatBool(last != nil && last.eof))
	if last != nil && last.eof {
		h.Set(contracts.TrailerExitCode, strconv.Itoa(last.exitCode))
	}
	if len(gaps) > 0 {
		h.Set(contracts.TrailerLogGaps, strings.Join(gaps, "; "))
	}
}
