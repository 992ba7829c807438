package bus_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// syncBuffer is a log sink the bus's goroutines may write at once.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.Write(p)
}

func (s *syncBuffer) lines() []map[string]any {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(s.buf.String()), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil {
			out = append(out, m)
		}
	}
	return out
}

// TestSettleLogsNameTheMessage: a delivery that fails is logged with its
// subject, stream sequence and consumer (the settle's logger, built only
// when it logs); one handled logs nothing.
func TestSettleLogsNameTheMessage(t *testing.T) {
	srv := natstest.Start(t)
	var sink syncBuffer
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "test", CredsFile: natstest.Operator(t, srv),
		Logger: slog.New(slog.NewJSONHandler(&sink, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	ack, err := b.Publish(ctx, contracts.SubjectCancel("acme"), "flaky", contracts.CancelRequest{JobID: "flaky"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), "fine", contracts.CancelRequest{JobID: "fine"}); err != nil {
		t.Fatal(err)
	}
	var tries, handled atomic.Int32
	go func() {
		_ = b.Consume(ctx, bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "settle-log",
			FilterSubjects: []string{contracts.SubjectCancelAll}, Backoff: []time.Duration{10 * time.Millisecond}, MaxDeliver: 5},
			func(_ context.Context, m *bus.Msg) error {
				if m.ID() == "flaky" && tries.Add(1) == 1 {
					return errors.New("transient")
				}
				handled.Add(1)
				return nil
			})
	}()
	eventually(t, 20*time.Second, func() bool { return handled.Load() == 2 }, "both handled")
	var settles []map[string]any
	for _, l := range sink.lines() {
		if l["subject"] != nil || strings.Contains(l["msg"].(string), "handler failed") {
			settles = append(settles, l)
		}
	}
	if len(settles) != 1 {
		t.Fatalf("%d settle logs, want one (the failed delivery): %v", len(settles), settles)
	}
	l := settles[0]
	if l["msg"] != "handler failed; will retry" || l["subject"] != contracts.SubjectCancel("acme") ||
		l["stream_seq"] != float64(ack.Sequence) || l["consumer"] != "settle-log" || l["component"] != "bus" {
		t.Errorf("settle log %v, want the retry of %s #%d by settle-log", l, contracts.SubjectCancel("acme"), ack.Sequence)
	}
}
