package gateway

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// streamInactiveThreshold lets the server remove an event stream's
// consumer by itself if the gateway dies before deleting it.
const streamInactiveThreshold = 30 * time.Second

// jobEvents streams one job's events as server-sent events: its history,
// then live events, ending after the event that makes it terminal. Events
// the state machine refuses (a rejected duplicate submit of an accepted
// job) are not sent: the stream tells the job's own story. With
// Last-Event-ID (header, or ?lastEventId= for clients that cannot set it)
// the events up to that stream sequence are skipped; the job's state is
// still folded from its first event, so the stream ends at once when the
// client already saw the terminal event.
func (s *server) jobEvents(w http.ResponseWriter, r *http.Request) {
	tenant, id, ok := tenantJob(w, r)
	if !ok {
		return
	}
	after, ok := lastEventID(w, r)
	if !ok {
		return
	}
	var st contracts.JobStatus
	s.serveEvents(w, r, jobFilter(tenant, id), 0, func(e *tailEvent) (send, end bool) {
		ev, err := e.decode()
		if err != nil || ev.Tenant != tenant || ev.JobID != id || st.Apply(ev, e.seq) != nil {
			return false, false
		}
		return e.seq > after, st.State.Terminal()
	})
}

// tenantEvents streams every JobEvent of a tenant, history first then
// live, without end. Last-Event-ID resumes after that stream sequence.
func (s *server) tenantEvents(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenant(w, r)
	if !ok {
		return
	}
	after, ok := lastEventID(w, r)
	if !ok {
		return
	}
	s.serveEvents(w, r, tenantFilter(tenant), after, func(e *tailEvent) (send, end bool) {
		return e.bodyTenant == tenant, false
	})
}

// lastEventID reads the sequence a client resumes after; 0 when none.
func lastEventID(w http.ResponseWriter, r *http.Request) (uint64, bool) {
	v := r.Header.Get("Last-Event-ID")
	if v == "" {
		v = r.URL.Query().Get("lastEventId")
	}
	if v == "" {
		return 0, true
	}
	n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
	if err != nil {
		msg := fmt.Sprintf("Last-Event-ID %q is not a stream sequence", v)
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, msg,
			[]contracts.FieldError{{Field: "Last-Event-ID", Reason: contracts.ReasonInvalidValue, Message: msg}})
		return 0, false
	}
	return n, true
}

// serveEvents relays the JOB_EVENTS messages of f after stream sequence
// from as server-sent events:
//
//	event: <type>
//	id: <stream sequence>
//	data: <the JobEvent, JSON on one line>
//
// keep decides for each event whether it is sent and whether the stream
// ends after it. A comment line goes out every Heartbeat while idle. The
// stream ends when the client goes away, keep says so, the history cannot
// be read (a comment says why; the client resumes with Last-Event-ID), or
// the gateway shuts down. The events come from the process's shared tail
// (tail.go): a stream holds no JetStream consumer of its own, except for
// one batch at a time while it reads history older than the tail's ring.
func (s *server) serveEvents(w http.ResponseWriter, r *http.Request, f eventFilter, from uint64,
	keep func(e *tailEvent) (send, end bool)) {
	if s.tail == nil || s.cfg.SSE.PerSubscriberConsumers {
		s.serveEventsFromConsumer(w, r, f, from, keep)
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	stopOnShutdown := context.AfterFunc(s.streams, cancel)
	defer stopOnShutdown()
	rd := s.tail.reader(f, from)
	defer rd.close()

	rc := http.NewResponseController(w)
	writeStreamHeader(w)
	if _, err := fmt.Fprint(w, ": stream open\n\n"); err != nil || rc.Flush() != nil {
		return
	}
	heartbeat := time.NewTicker(s.cfg.Heartbeat)
	defer heartbeat.Stop()
	var batch []byte
	for {
		e, err := rd.next(ctx, heartbeat.C)
		switch {
		case err != nil && ctx.Err() != nil:
			return
		case err != nil:
			s.log.Warn("event stream ends: its history cannot be read", "subject", f.subject, "after_seq", rd.from, "err", err)
			_, _ = w.Write(batch)
			_, _ = fmt.Fprintf(w, ": stream ends: history cannot be read now; resume with Last-Event-ID %d\n\n", rd.from)
			_ = rc.Flush()
			return
		case e == nil:
			if _, err := fmt.Fprint(w, ": heartbeat\n\n"); err != nil || rc.Flush() != nil {
				return
			}
			continue
		}
		send, end := keep(e)
		// Write what is at hand in one piece, up to sseWriteBatch: a
		// history of a thousand events goes out in a few large writes
		// (the response's own buffer is 4 KiB: a write each). A live
		// event alone is written as it is, and an idle stream keeps no
		// buffer.
		now := end || !rd.buffered()
		if send {
			if now && len(batch) == 0 {
				if _, err := w.Write(e.frame); err != nil {
					return
				}
			} else {
				batch = append(batch, e.frame...)
			}
		}
		if now || len(batch) >= sseWriteBatch {
			if len(batch) > 0 {
				if _, err := w.Write(batch); err != nil {
					return
				}
				batch = batch[:0]
			}
			if now {
				batch = nil
			}
			if rc.Flush() != nil {
				return
			}
		}
		if end {
			return
		}
	}
}

// sseWriteBatch is the most a stream gathers before it writes.
const sseWriteBatch = 32 << 10

// writeStreamHeader starts a text/event-stream response.
func writeStreamHeader(w http.ResponseWriter) {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no") // nginx: do not buffer the stream
	w.WriteHeader(http.StatusOK)
}
