package scheduler

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

// refusingPublisher fails every publish the way a permission or size error
// does: not transient, so the bus does not retry it.
type refusingPublisher struct{}

func (refusingPublisher) Publish(context.Context, string, string, any, ...bus.PublishOption) (*jetstream.PubAck, error) {
	return nil, errors.New("permissions violation for publish")
}

// TestOutboxStopsTheSchedulerRatherThanDropping: an event that cannot be
// published stops the outbox with an error, so the scheduler exits and
// rebuilds from the streams; it is never dropped while memory moves on.
func TestOutboxStopsTheSchedulerRatherThanDropping(t *testing.T) {
	o := newOutbox(refusingPublisher{}, 4, slog.New(slog.DiscardHandler))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- o.run(ctx) }()
	o.enqueue([]state.Publish{{Subject: contracts.SubjectJobEvents("acme", "j1"), Key: "acme/j1", ID: "job/acme/j1/running/1",
		Msg: contracts.JobEvent{Type: contracts.EventRunning}}}, false)
	select {
	case err := <-done:
		if err == nil || ctx.Err() != nil {
			t.Fatalf("outbox ended with %v; want an error naming the unpublished event", err)
		}
	case <-ctx.Done():
		t.Fatal("outbox kept running after a publish failed for good")
	}
}
