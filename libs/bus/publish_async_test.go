package bus_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// PublishAsync sends many messages before any ack: each is stored once, in
// the order sent, with the envelope Publish gives, and one sent again is a
// duplicate of the first.
func TestPublishAsyncStoresEachOnceInOrder(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const n = 300
	pending := make([]*bus.Pending, n)
	for i := range pending {
		req := contracts.JobRequest{ID: fmt.Sprintf("j%d", i), Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}}}
		var err error
		if pending[i], err = b.PublishAsync(ctx, contracts.SubjectSubmit("acme"), fmt.Sprintf("id-%d", i), req, bus.CESubject(req.ID)); err != nil {
			t.Fatal(err)
		}
	}
	seqs := make([]uint64, n)
	for i, p := range pending {
		ack, err := p.Wait(ctx)
		if err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
		seqs[i] = ack.Sequence
	}
	again, err := b.PublishAsync(ctx, contracts.SubjectSubmit("acme"), "id-7", contracts.JobRequest{ID: "j7"})
	if err != nil {
		t.Fatal(err)
	}
	ack, err := again.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !ack.Duplicate || ack.Sequence != seqs[7] {
		t.Fatalf("the same ID again: duplicate=%v seq=%d, want a duplicate of seq %d", ack.Duplicate, ack.Sequence, seqs[7])
	}
	var got []*bus.Msg
	if _, err := b.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamJobs}, func(_ context.Context, m *bus.Msg) error {
		got = append(got, m)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(got) != n {
		t.Fatalf("stream holds %d messages, want %d", len(got), n)
	}
	for i, m := range got {
		if want := fmt.Sprintf("id-%d", i); m.ID() != want || m.Header.Get(contracts.HeaderCEID) != want || m.StreamSeq != seqs[i] {
			t.Fatalf("message %d: id %q ce-id %q seq %d, want %q at seq %d", i, m.ID(), m.Header.Get(contracts.HeaderCEID), m.StreamSeq, want, seqs[i])
		}
		if got, want := m.Header.Get(contracts.HeaderCEType), "io.gpuplane.job.request.v1"; got != want {
			t.Fatalf("message %d: ce-type %q, want %q", i, got, want)
		}
		if got, want := m.Header.Get(contracts.HeaderCESubject), fmt.Sprintf("j%d", i); got != want {
			t.Fatalf("message %d: ce-subject %q, want %q", i, got, want)
		}
	}
}

// Wait reports a lost compare-and-set as ErrWrongLastSequence, without
// retrying it, and a publish no stream takes fails (with NoRetry at once)
// instead of hanging.
func TestPublishAsyncFailures(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	subj := contracts.SubjectLedger("n1")
	first, err := b.PublishAsync(ctx, subj, "e1", contracts.LedgerEntry{Kind: contracts.LedgerCommitted}, bus.ExpectLastSubjectSeq(0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := first.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		subject string
		opts    []bus.PublishOption
		want    error
	}{
		{"stale compare-and-set", subj, []bus.PublishOption{bus.ExpectLastSubjectSeq(0)}, bus.ErrWrongLastSequence},
		{"no stream", "gp.nowhere.x", []bus.PublishOption{bus.NoRetry()}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := b.PublishAsync(ctx, tc.subject, "e-"+tc.name, contracts.LedgerEntry{Kind: contracts.LedgerCommitted}, tc.opts...)
			if err != nil {
				t.Fatal(err)
			}
			_, err = p.Wait(ctx)
			if err == nil {
				t.Fatal("Wait succeeded; want an error")
			}
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
		})
	}
}
