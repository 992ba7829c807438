package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// Bounds of GET /v1/nodes/{node}/telemetry.
const (
	defaultTelemetryWindow = 10 * time.Minute
	maxTelemetryWindow     = time.Hour
	defaultTelemetryPoints = 120
	maxTelemetryPoints     = 600
	// maxTelemetryRead bounds the batches read for one answer: an hour of
	// one machine's 1 s batches.
	maxTelemetryRead = 3600
)

// nodeTelemetry serves GET /v1/nodes/{node}/telemetry?since=10m&points=120:
// the machine's telemetry batches on the TELEMETRY stream since then (a
// duration back from now, at most an hour; the stream keeps what its max
// age allows), read by an ordered consumer of its one subject from that
// time and thinned evenly to at most points, the latest kept. It is what
// the console's sparklines start from before the fleet stream moves them.
func (s *server) nodeTelemetry(w http.ResponseWriter, r *http.Request) {
	id, ok := nodeID(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	window, points := defaultTelemetryWindow, defaultTelemetryPoints
	if v := q.Get("since"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 || d > maxTelemetryWindow {
			msg := fmt.Sprintf("since %q: want a duration back from now, up to %s", v, maxTelemetryWindow)
			writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, msg,
				[]contracts.FieldError{{Field: "since", Reason: contracts.ReasonInvalidValue, Message: msg}})
			return
		}
		window = d
	}
	if v := q.Get("points"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxTelemetryPoints {
			msg := fmt.Sprintf("points %q: want 1 to %d", v, maxTelemetryPoints)
			writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, msg,
				[]contracts.FieldError{{Field: "points", Reason: contracts.ReasonInvalidValue, Message: msg}})
			return
		}
		points = n
	}
	if !s.nodeModelReady(w) {
		return
	}
	if _, ok := s.knownNode(w, id); !ok {
		return
	}
	since := s.now().UTC().Add(-window)
	samples, err := s.readTelemetry(r.Context(), id, since)
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("reading telemetry: %v", err), nil)
		return
	}
	writeJSON(w, http.StatusOK, contracts.NodeTelemetry{NodeID: id, Since: since, Samples: thin(samples, points), Read: len(samples)})
}

// readTelemetry reads node's batches from since to the stream's end.
func (s *server) readTelemetry(ctx context.Context, node string, since time.Time) ([]contracts.Telemetry, error) {
	ctx, cancel := context.WithTimeout(ctx, publishTimeout)
	defer cancel()
	js := s.bus.JetStream()
	cons, err := js.OrderedConsumer(ctx, contracts.StreamTelemetry, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{contracts.SubjectTelemetry(node)}, DeliverPolicy: jetstream.DeliverByStartTimePolicy,
		OptStartTime: &since, InactiveThreshold: streamInactiveThreshold,
	})
	if err != nil {
		return nil, err
	}
	defer func() {
		if info := cons.CachedInfo(); info != nil {
			dctx, dcancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			defer dcancel()
			_ = js.DeleteConsumer(dctx, contracts.StreamTelemetry, info.Name)
		}
	}()
	info, err := cons.Info(ctx)
	if err != nil {
		return nil, err
	}
	pending := min(int(info.NumPending), maxTelemetryRead)
	out := make([]contracts.Telemetry, 0, pending)
	for read := 0; read < pending; {
		batch, err := cons.Fetch(min(pending-read, 256), jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return nil, err
		}
		got := 0
		for m := range batch.Messages() {
			got++
			var t contracts.Telemetry
			if json.Unmarshal(m.Data(), &t) == nil && t.NodeID == node {
				out = append(out, t)
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return nil, err
		}
		if got == 0 {
			break // the stream aged out what it counted: answer what was read
		}
		read += got
	}
	return out, nil
}

// thin keeps at most n of samples, evenly spaced, the last always.
func thin(samples []contracts.Telemetry, n int) []contracts.Telemetry {
	if len(samples) <= n {
		return samples
	}
	if n == 1 {
		return samples[len(samples)-1:]
	}
	out := make([]contracts.Telemetry, 0, n)
	for i := range n {
		// The i-th of n points, counted back from the last.
		out = append(out, samples[len(samples)-1-(n-1-i)*(len(samples)-1)/(n-1)])
	}
	return out
}
