package gateway

import (
	"context"
	"fmt"
	"net/http"
	"slices"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// describeJob answers everything known about one job (a
// contracts.JobDescription): its history is read from JOB_EVENTS at the
// time of the request, so the answer is as fresh as the stream; the read
// model only decides whether the job exists.
func (s *server) describeJob(w http.ResponseWriter, r *http.Request) {
	tenant, id, st, ok := s.knownJob(w, r)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	var f describeFold
	spec := bus.FollowSpec{Stream: contracts.StreamJobEvents, FilterSubjects: []string{contracts.SubjectJobEvents(tenant, id)}}
	_, err := s.bus.Replay(ctx, spec, func(_ context.Context, m *bus.Msg) error {
		var ev contracts.JobEvent
		if err := m.Decode(&ev); err != nil || ev.Tenant != tenant || ev.JobID != id {
			s.log.Warn("describe skips a malformed job event", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
			return nil
		}
		f.apply(ev, m.StreamSeq)
		return nil
	})
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("reading the job's events: %v", err), nil)
		return
	}
	writeJSON(w, http.StatusOK, f.description(st))
}

// describeFold folds a job's events, in stream order, into its
// description. It keeps only the latest contracts.MaxDescribeEvents
// summaries, so a job pending for weeks costs bounded memory.
type describeFold struct {
	st      contracts.JobStatus
	events  []contracts.EventSummary
	omitted int
	pending *contracts.PendingStatus
}

// apply folds one event. An event the state machine refuses (a replayed
// one, or a rejected duplicate submit of an accepted job) is not the
// job's story and is left out, as the event stream leaves it out.
func (f *describeFold) apply(ev contracts.JobEvent, seq uint64) {
	if f.st.Apply(ev, seq) != nil {
		return
	}
	sum := contracts.EventSummary{Seq: seq, Type: ev.Type, Attempt: ev.Attempt, Time: ev.Time, Reason: ev.Reason, Message: ev.Message}
	if len(f.events) == contracts.MaxDescribeEvents {
		copy(f.events, f.events[1:])
		f.events[len(f.events)-1] = sum
		f.omitted++
	} else {
		f.events = append(f.events, sum)
	}
	switch ev.Type {
	case contracts.EventQueued, contracts.EventRequeued:
		// A new attempt: the previous one's reasons are history (its
		// places too: JobStatus.Apply clears them).
		f.pending = nil
	case contracts.EventPending:
		if f.pending != nil && f.pending.Reason == ev.Reason {
			f.pending.Message = ev.Message
		} else {
			f.pending = &contracts.PendingStatus{Reason: ev.Reason, Message: ev.Message, Since: ev.Time}
		}
	}
}

// description is the fold's result; st (the read model's status) stands
// in when the stream held none of the job's events any more.
func (f *describeFold) description(st contracts.JobStatus) contracts.JobDescription {
	if f.st.State != contracts.StateNew {
		st = f.st
	}
	d := contracts.JobDescription{Tenant: st.Tenant, JobID: st.JobID, Name: st.Name, State: st.State, Attempt: st.Attempt,
		Reason: st.Reason, Message: st.Message, Errors: st.Errors, Request: st.Request, ExitCode: st.ExitCode,
		CreatedAt: st.CreatedAt, UpdatedAt: st.UpdatedAt, StartedAt: st.StartedAt, EndedAt: st.EndedAt,
		Placements: slices.Clone(st.Placements), Events: f.events, EventsOmitted: f.omitted}
	if d.Events == nil {
		d.Events = []contracts.EventSummary{}
	}
	if st.Request != nil {
		d.DependsOn = st.Request.DependsOn
	}
	if len(d.Placements) == 0 && st.Placement != nil {
		d.Placements = []contracts.Placement{*st.Placement}
	}
	if st.State == contracts.StateQueued {
		d.Pending = f.pending
	}
	return d
}
