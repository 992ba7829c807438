package resourcemanager

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// TestStreamLivesOutlivesALostAnswer: a new term's look at the snapshot
// streams, sent to a NATS server that dies before it answers, is sent
// again on the connection that comes back, instead of waiting for the
// term's context (CI's TestNATSNodeLossStopsNoRun: epoch 2 stuck in
// startSnapshots for a minute, no plan handled).
func TestStreamLivesOutlivesALostAnswer(t *testing.T) {
	srv := natstest.Start(t)
	p := natstest.NewLossyProxy(t, srv)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // a far deadline, as e2e's
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: p.URL(), Name: "test",
		CredsFile: natstest.Service(t, srv, contracts.BusResourceManager)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	s := newServer(DefaultConfig(), b, slog.Default())

	p.Silence()
	type result struct {
		n   int
		err error
	}
	done := make(chan result, 1)
	asked := time.Now()
	go func() {
		lives, err := s.streamLives(ctx)
		done <- result{len(lives), err}
	}()
	time.Sleep(200 * time.Millisecond) // the first look is sent into the silence
	p.Die()

	limit := probeTimeout + 5*time.Second
	select {
	case r := <-done:
		if r.err != nil || r.n != len(snapshotStreams) {
			t.Fatalf("streamLives = %d streams, %v; want %d, nil", r.n, r.err, len(snapshotStreams))
		}
	case <-time.After(limit):
		t.Fatalf("streamLives still waiting %s after a lost answer", time.Since(asked).Round(time.Millisecond))
	}
}
