package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

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
	s.serveEvents(w, r, contracts.SubjectJobEvents(tenant, id), 0, func(ev contracts.JobEvent, seq uint64) (send, end bool) {
		if ev.Tenant != tenant || ev.JobID != id || st.Apply(ev, seq) != nil {
			return false, false
		}
		return seq > after, st.State.Terminal()
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
	s.serveEvents(w, r, contracts.SubjectTenantJobEvents(tenant), after+1, func(ev contracts.JobEvent, _ uint64) (send, end bool) {
		return ev.Tenant == tenant, false
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

// serveEvents relays the JOB_EVENTS messages on filter, from stream
// sequence startSeq (0: the first), as server-sent events:
//
//	event: <type>
//	id: <stream sequence>
//	data: <the JobEvent, JSON on one line>
//
// keep decides for each event whether it is sent and whether the stream
// ends after it. A comment line goes out every Heartbeat while idle. The
// stream ends when the client goes away, keep says so, or the gateway
// shuts down; its ordered consumer is deleted then, not left to expire.
func (s *server) serveEvents(w http.ResponseWriter, r *http.Request, filter string, startSeq uint64,
	keep func(ev contracts.JobEvent, seq uint64) (send, end bool)) {
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	stopOnShutdown := context.AfterFunc(s.streams, cancel)
	defer stopOnShutdown()

	cfg := jetstream.OrderedConsumerConfig{
		FilterSubjects:    []string{filter},
		DeliverPolicy:     jetstream.DeliverAllPolicy,
		InactiveThreshold: streamInactiveThreshold,
	}
	if startSeq > 1 {
		cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, startSeq
	}
	js := s.bus.JetStream()
	cons, err := js.OrderedConsumer(ctx, contracts.StreamJobEvents, cfg)
	var it jetstream.MessagesContext
	if err == nil {
		it, err = cons.Messages()
	}
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("reading job events: %v", err), nil)
		return
	}
	msgs := make(chan jetstream.Msg)
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		for {
			m, err := it.Next(jetstream.NextContext(ctx))
			if err != nil {
				if ctx.Err() != nil || errors.Is(err, jetstream.ErrMsgIteratorClosed) {
					return
				}
				continue // the ordered consumer recreates itself after a gap
			}
			select {
			case msgs <- m:
			case <-ctx.Done():
				return
			}
		}
	}()
	defer func() {
		cancel()
		<-readerDone
		it.Stop()
		if info := cons.CachedInfo(); info != nil {
			dctx, dcancel := context.WithTimeout(context.WithoutCancel(r.Context()), 2*time.Second)
			defer dcancel()
			if err := js.DeleteConsumer(dctx, contracts.StreamJobEvents, info.Name); err != nil &&
				!errors.Is(err, jetstream.ErrConsumerNotFound) {
				s.log.Debug("event stream consumer not deleted; it expires by itself", "consumer", info.Name, "err", err)
			}
		}
	}()

	rc := http.NewResponseController(w)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no") // nginx: do not buffer the stream
	w.WriteHeader(http.StatusOK)
	if _, err := fmt.Fprint(w, ": stream open\n\n"); err != nil || rc.Flush() != nil {
		return
	}
	heartbeat := time.NewTicker(s.cfg.Heartbeat)
	defer heartbeat.Stop()
	var buf bytes.Buffer
	for {
		select {
		case <-ctx.Done():
			return
		case <-heartbeat.C:
			if _, err := fmt.Fprint(w, ": heartbeat\n\n"); err != nil || rc.Flush() != nil {
				return
			}
		case m := <-msgs:
			md, err := m.Metadata()
			if err != nil {
				continue
			}
			seq := md.Sequence.Stream
			var ev contracts.JobEvent
			buf.Reset()
			if err := json.Unmarshal(m.Data(), &ev); err != nil || json.Compact(&buf, m.Data()) != nil ||
				ev.Type == "" || strings.ContainsAny(string(ev.Type), "\r\n") {
				s.log.Warn("event stream skips a malformed job event", "subject", m.Subject(), "stream_seq", seq)
				continue
			}
			send, end := keep(ev, seq)
			if send {
				if _, err := fmt.Fprintf(w, "event: %s\nid: %d\ndata: %s\n\n", ev.Type, seq, buf.Bytes()); err != nil || rc.Flush() != nil {
					return
				}
			}
			if end {
				return
			}
		}
	}
}
