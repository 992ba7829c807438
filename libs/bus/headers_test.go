package bus_test

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// TestPublishedHeadersFitOneMapGroup: the fullest messages the platform
// publishes (a ledger entry's compare-and-set, in a trace or not; a job
// event in a trace, published at once and asynchronously) are read back
// with the
// CloudEvents binding's attributes, their ID and trace context, in at
// most 8 headers: what a reader's header map holds in one group (a ninth
// doubles its bytes, see maxHeaders).
func TestPublishedHeadersFitOneMapGroup(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5, 6}, TraceFlags: trace.FlagsSampled})
	traced := trace.ContextWithSpanContext(ctx, sc)

	if _, err := b.Publish(ctx, contracts.SubjectLedger("n1"), "ledger-1", contracts.LedgerEntry{Kind: contracts.LedgerCommitted},
		bus.ExpectLastSubjectSeq(0), bus.CESubject("acme/j1/1")); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Publish(traced, contracts.SubjectLedger("n2"), "ledger-2", contracts.LedgerEntry{Kind: contracts.LedgerCommitted},
		bus.ExpectLastSubjectSeq(0), bus.CESubject("acme/j2/1")); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Publish(traced, contracts.SubjectJobEvents("acme", "j1"), "event-1",
		contracts.JobEvent{Type: contracts.EventQueued, Tenant: "acme", JobID: "j1"}, bus.CESubject("acme/j1")); err != nil {
		t.Fatal(err)
	}
	fut, err := b.PublishAsync(traced, contracts.SubjectJobEvents("acme", "j2"), "event-2",
		contracts.JobEvent{Type: contracts.EventQueued, Tenant: "acme", JobID: "j2"}, bus.CESubject("acme/j2"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fut.Wait(ctx); err != nil {
		t.Fatal(err)
	}

	var got []*bus.Msg
	for _, stream := range []string{contracts.StreamAllocations, contracts.StreamJobEvents} {
		if _, err := b.Replay(ctx, bus.FollowSpec{Stream: stream}, func(_ context.Context, m *bus.Msg) error {
			got = append(got, m)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	if len(got) != 4 {
		t.Fatalf("read %d messages back, want 4", len(got))
	}
	for _, m := range got {
		for _, k := range []string{contracts.HeaderCESpecVersion, contracts.HeaderCEType, contracts.HeaderCESource,
			contracts.HeaderCEID, contracts.HeaderCESubject, contracts.HeaderMsgID} {
			if m.Header.Get(k) == "" {
				t.Errorf("%s (%s): no %s", m.Subject, m.ID(), k)
			}
		}
		if m.ID() != "ledger-1" && m.Header.Get("traceparent") == "" {
			t.Errorf("%s (%s): no traceparent", m.Subject, m.ID())
		}
		if m.Timestamp.IsZero() {
			t.Errorf("%s (%s): no stream timestamp (what ce-time said)", m.Subject, m.ID())
		}
		if len(m.Header) > 8 {
			t.Errorf("%s (%s): %d headers, want at most 8: %v", m.Subject, m.ID(), len(m.Header), m.Header)
		}
	}
}
