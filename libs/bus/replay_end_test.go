package bus_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// TestReplayReadsToItsTargetWhateverTheConsumerCounts: a message comes
// with nothing pending by its consumer's count, short of the stream's
// last message when the replay began: as a member cut off while the
// others stored the last messages counts. The replay reads on to its
// target. (The chaos suite saw a new scheduler leader's rebuild end early
// there, after a partition, and the jobs queued last were never placed.)
// The test's handler sets the count on the message it is handed, before
// the replay reads it: no member can be made stale on demand.
func TestReplayReadsToItsTargetWhateverTheConsumerCounts(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var want []uint64
	for i := range 10 {
		ack, err := b.Publish(ctx, contracts.SubjectCancel("acme"), fmt.Sprintf("c%d", i), contracts.CancelRequest{JobID: fmt.Sprintf("j%d", i)})
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, ack.Sequence)
	}
	var got []uint64
	last, err := b.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamJobs}, func(_ context.Context, m *bus.Msg) error {
		got = append(got, m.StreamSeq)
		if len(got) == 4 {
			m.NumPending = 0 // a stale member's count
		}
		return nil
	})
	if err != nil || last != want[len(want)-1] || !slices.Equal(got, want) {
		t.Fatalf("Replay = %d, %v, read %v; want every message %v", last, err, got, want)
	}
}

// TestReplayEndsWhenItsTargetIsDeleted: the last message the replay aims
// at is deleted while it reads: it ends at the last message left, not
// waiting for one that will never come.
func TestReplayEndsWhenItsTargetIsDeleted(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// A stream of its own: the platform's logs of record deny deletes.
	stream, err := b.JetStream().CreateStream(ctx, jetstream.StreamConfig{Name: "REPLAY_END", Subjects: []string{"replay.end.>"}})
	if err != nil {
		t.Fatal(err)
	}
	// Enough that the read has not fetched the last when it deletes it.
	var seqs []uint64
	for i := range 5000 {
		ack, err := b.JetStream().Publish(ctx, fmt.Sprintf("replay.end.%d", i%2), []byte("m"))
		if err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, ack.Sequence)
	}
	var got []uint64
	last, err := b.Replay(ctx, bus.FollowSpec{Stream: "REPLAY_END", FilterSubjects: []string{"replay.end.>"}},
		func(ctx context.Context, m *bus.Msg) error {
			if len(got) == 0 {
				if err := stream.DeleteMsg(ctx, seqs[len(seqs)-1]); err != nil {
					return err
				}
			}
			got = append(got, m.StreamSeq)
			return nil
		})
	if left := seqs[:len(seqs)-1]; err != nil || last != left[len(left)-1] || !slices.Equal(got, left) {
		t.Fatalf("Replay = %d, %v, read %d messages ending %v; want %d ending %d", last, err, len(got), got[max(0, len(got)-3):],
			len(left), left[len(left)-1])
	}
}
