package bus

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/gpuplane/gpuplane/contracts"
)

// BenchmarkUntracedSpans is the span work of one delivery and one
// publish on a bus whose tracer is the no-op one (no OTLP endpoint, as in
// BenchmarkBurst), with the names and attributes built as for a real
// tracer (traced) and without (untraced, what Connect picks for it).
func BenchmarkUntracedSpans(b *testing.B) {
	m := &Msg{Subject: contracts.SubjectLedger("n-0042"), Stream: contracts.StreamAllocations, StreamSeq: 4242, NumDelivered: 1,
		Header: nats.Header{contracts.HeaderMsgID: {"ledger/committed/acme/bench-0001/1"}, contracts.HeaderCESubject: {"acme/bench-0001/1"},
			"traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}}
	spec := ConsumerSpec{Stream: contracts.StreamAllocations, Durable: "billing-ledger"}
	for _, traced := range []bool{true, false} {
		bus := &Bus{name: "billing", tracer: noop.NewTracerProvider().Tracer(""), prop: propagation.TraceContext{}, traced: traced}
		name := map[bool]string{true: "traced", false: "untraced"}[traced]
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				ctx, span := bus.startProcess(context.Background(), spec, m)
				out, err := bus.prepare(ctx, contracts.SubjectRuns("n-0042"), "run/started/acme/bench-0001/1", []byte(`{}`),
					[]PublishOption{CESubject("acme/bench-0001/1"), CEType("io.gpuplane.run.v1")})
				if err != nil {
					b.Fatal(err)
				}
				out.span.End()
				span.End()
			}
		})
	}
}
