package bus

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/gpuplane/gpuplane/contracts"
)

// headerBlock is the header section of m as NATS sends it.
func headerBlock(h nats.Header) []byte {
	var b bytes.Buffer
	b.WriteString("NATS/1.0\r\n")
	for k, vs := range h {
		for _, v := range vs {
			b.WriteString(k + ": " + v + "\r\n")
		}
	}
	b.WriteString("\r\n")
	return b.Bytes()
}

func cloneHeader(h nats.Header) nats.Header {
	c := nats.Header{}
	for k, vs := range h {
		c[k] = append([]string(nil), vs...)
	}
	return c
}

// BenchmarkHeaderDecode decodes the headers of a traced ledger entry (a
// compare-and-set: the fullest message of a burst) as each of its
// readers' nats.go does, as published now and with the two headers no
// longer sent (content-type, ce-time): the cost per delivery.
func BenchmarkHeaderDecode(b *testing.B) {
	bus := &Bus{name: "resource-manager", tracer: noop.NewTracerProvider().Tracer(""), prop: propagation.TraceContext{}}
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5, 6}, TraceFlags: trace.FlagsSampled})
	ctx := trace.ContextWithSpanContext(context.Background(), sc)
	id := contracts.LedgerEntryID(contracts.LedgerCommitted, "acme/bench-0001/1")
	out, err := bus.prepare(ctx, contracts.SubjectLedger("n-0042"), id, []byte(`{}`), []PublishOption{CESubject("acme/bench-0001/1"), CEType("io.gpuplane.allocation.committed.v1")})
	if err != nil {
		b.Fatal(err)
	}
	out.span.End()
	now := cloneHeader(out.msg.Header)
	// What jetstream.PublishMsg adds for WithMsgID and the compare-and-set.
	now.Set(contracts.HeaderMsgID, id)
	now.Set("Nats-Expected-Last-Subject-Sequence", "4242")
	before := cloneHeader(now)
	before.Set(contracts.HeaderContentType, contracts.ContentTypeJSON)
	before.Set(contracts.HeaderCETime, time.Date(2026, 11, 27, 5, 25, 36, 123456789, time.UTC).Format(time.RFC3339Nano))
	for _, c := range []struct {
		name string
		h    nats.Header
	}{{"before-10-headers", before}, {"now-8-headers", now}} {
		blk := headerBlock(c.h)
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := nats.DecodeHeadersMsg(blk); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
