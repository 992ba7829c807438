package bus_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// TestSubjectMsgsReadsOneSubjectInOrder: SubjectMsgs hands every message
// of one subject, in stream order, and no other subject's, stops when
// told, and hands nothing (without an error) for a subject with none.
func TestSubjectMsgsReadsOneSubjectInOrder(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := b.EnsureStreams(ctx); err != nil {
		t.Fatal(err)
	}
	mine, other := contracts.SubjectJobEvents("acme", "mine"), contracts.SubjectJobEvents("acme", "other")
	var want []uint64
	for i := range 5 {
		for _, subj := range []string{other, mine} {
			ack, err := b.Publish(ctx, subj, fmt.Sprintf("%s-%d", subj, i), map[string]int{"n": i})
			if err != nil {
				t.Fatal(err)
			}
			if subj == mine {
				want = append(want, ack.Sequence)
			}
		}
	}
	read := func(subject string, stopAfter int) []uint64 {
		t.Helper()
		var got []uint64
		err := b.SubjectMsgs(ctx, contracts.StreamJobEvents, subject, func(m *bus.Msg) bool {
			if m.Subject != subject || m.Stream != contracts.StreamJobEvents {
				t.Fatalf("read %s: a message of %s/%s", subject, m.Stream, m.Subject)
			}
			got = append(got, m.StreamSeq)
			return len(got) == stopAfter
		})
		if err != nil {
			t.Fatalf("read %s: %v", subject, err)
		}
		return got
	}
	if got := read(mine, -1); !slices.Equal(got, want) {
		t.Fatalf("read all: sequences %v, want %v", got, want)
	}
	if got := read(mine, 2); !slices.Equal(got, want[:2]) {
		t.Fatalf("stopped after 2: sequences %v, want %v", got, want[:2])
	}
	if got := read(contracts.SubjectJobEvents("acme", "none"), -1); len(got) != 0 {
		t.Fatalf("a subject without messages: %v", got)
	}
}
