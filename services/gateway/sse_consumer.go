package gateway

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// serveEventsFromConsumer is serveEvents as it was before the shared tail:
// one JetStream ordered consumer per HTTP subscriber, replaying its
// history from the server. It serves a server built without a tail, and
// SSEConfig.PerSubscriberConsumers: the baseline of BenchmarkSSEFanout.
// The stream's consumer is deleted when it ends, not left to expire.
func (s *server) serveEventsFromConsumer(w http.ResponseWriter, r *http.Request, f eventFilter, from uint64,
	keep func(e *tailEvent) (send, end bool)) {
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	stopOnShutdown := context.AfterFunc(s.streams, cancel)
	defer stopOnShutdown()

	cfg := jetstream.OrderedConsumerConfig{
		FilterSubjects:    []string{f.subject},
		DeliverPolicy:     jetstream.DeliverAllPolicy,
		InactiveThreshold: streamInactiveThreshold,
	}
	if from > 0 {
		cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, from+1
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
	writeStreamHeader(w)
	if _, err := fmt.Fprint(w, ": stream open\n\n"); err != nil || rc.Flush() != nil {
		return
	}
	heartbeat := time.NewTicker(s.cfg.Heartbeat)
	defer heartbeat.Stop()
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
			e, err := parseTailEvent(m.Subject(), md.Sequence.Stream, m.Data())
			if err != nil {
				s.log.Warn("event stream skips a malformed job event", "subject", m.Subject(), "stream_seq", md.Sequence.Stream)
				continue
			}
			send, end := keep(e)
			if send {
				if _, err := w.Write(e.frame); err != nil || rc.Flush() != nil {
					return
				}
			}
			if end {
				return
			}
		}
	}
}
