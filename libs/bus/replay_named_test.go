package bus_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// TestNamedReplayClearsLeftovers: a node agent that crashed mid-replay may
// leave consumers <prefix>_1 ... _n behind (n counts resets). The next
// replay under the node's own identity removes all of them, reads every
// message, and leaves none behind.
func TestNamedReplayClearsLeftovers(t *testing.T) {
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	log := slog.New(slog.DiscardHandler)
	op, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "operator", CredsFile: natstest.Operator(t, srv), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer op.Close(context.Background())
	for i := range 5 {
		if _, err := op.Publish(ctx, contracts.SubjectRuns("n1"), "run-"+string(rune('a'+i)), map[string]int{"i": i}); err != nil {
			t.Fatal(err)
		}
	}
	prefix := contracts.NodeReplayPrefix("n1")
	for _, n := range []string{"_1", "_3", "_8"} {
		if _, err := op.JetStream().CreateOrUpdateConsumer(ctx, contracts.StreamRuns, jetstream.ConsumerConfig{
			Name: prefix + n, FilterSubject: contracts.SubjectRuns("n1"), AckPolicy: jetstream.AckNonePolicy,
			DeliverPolicy: jetstream.DeliverNewPolicy, InactiveThreshold: time.Minute}); err != nil {
			t.Fatal(err)
		}
	}
	node, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "node-n1", CredsFile: natstest.Node(t, srv, "n1"), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer node.Close(context.Background())
	got := 0
	if _, err := node.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamRuns, FilterSubjects: []string{contracts.SubjectRuns("n1")},
		NamePrefix: prefix}, func(context.Context, *bus.Msg) error { got++; return nil }); err != nil {
		t.Fatal(err)
	}
	if got != 5 {
		t.Fatalf("replayed %d messages, want 5", got)
	}
	s, err := op.JetStream().Stream(ctx, contracts.StreamRuns)
	if err != nil {
		t.Fatal(err)
	}
	names := s.ConsumerNames(ctx)
	for name := range names.Name() {
		if strings.HasPrefix(name, prefix) {
			t.Errorf("consumer %s left behind", name)
		}
	}
}
