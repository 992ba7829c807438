package bus_test

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/telemetry"
)

// TestUntracedBusCarriesTheTraceOn: a bus without a tracer provider (no
// OTLP endpoint) starts no spans of its own, yet what a handler publishes
// carries the trace context of the message it handles, whether handled
// alone or pipelined, so a traced service downstream continues the
// trace. A message with no trace context gives none.
func TestUntracedBusCarriesTheTraceOn(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{9, 8, 7}, SpanID: trace.SpanID{6, 5, 4}, TraceFlags: trace.FlagsSampled})
	traced := trace.ContextWithSpanContext(ctx, sc)
	want := telemetry.TraceParent(traced)

	// Each handler answers a cancel with a ledger entry on its own node.
	answer := func(node string) bus.Handler {
		return func(ctx context.Context, m *bus.Msg) error {
			_, err := b.Publish(ctx, contracts.SubjectLedger(node), "answer-"+node+"-"+m.ID(),
				contracts.LedgerEntry{Kind: contracts.LedgerCommitted})
			return err
		}
	}
	go func() {
		_ = b.Consume(ctx, bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "alone",
			FilterSubjects: []string{contracts.SubjectCancelAll}}, answer("alone"))
	}()
	go func() {
		_ = b.ConsumePipelined(ctx, bus.ConsumerSpec{Stream: contracts.StreamJobs, Durable: "pipelined",
			FilterSubjects: []string{contracts.SubjectCancelAll}}, func(ctx context.Context, m *bus.Msg) func() error {
			err := answer("pipelined")(ctx, m)
			return func() error { return err }
		})
	}()
	if _, err := b.Publish(traced, contracts.SubjectCancel("acme"), "in-trace", contracts.CancelRequest{JobID: "j1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Publish(ctx, contracts.SubjectCancel("acme"), "no-trace", contracts.CancelRequest{JobID: "j2"}); err != nil {
		t.Fatal(err)
	}

	got := map[string]string{}
	deadline := time.Now().Add(20 * time.Second)
	for len(got) < 4 && time.Now().Before(deadline) {
		if _, err := b.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamAllocations}, func(_ context.Context, m *bus.Msg) error {
			got[m.ID()] = m.Header.Get("traceparent")
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if len(got) < 4 {
			time.Sleep(50 * time.Millisecond)
		}
	}
	for _, node := range []string{"alone", "pipelined"} {
		if tp, ok := got["answer-"+node+"-in-trace"]; !ok || tp != want {
			t.Errorf("%s: answer to the traced message has traceparent %q (read: %v), want %q", node, tp, ok, want)
		}
		if tp, ok := got["answer-"+node+"-no-trace"]; !ok || tp != "" {
			t.Errorf("%s: answer to the untraced message has traceparent %q (read: %v), want none", node, tp, ok)
		}
	}
}
