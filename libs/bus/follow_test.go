package bus_test

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// TestFollowReplacesAConsumerThatDeliversNothing: a Follow whose ordered
// consumer stops delivering while its stream goes on (here the consumer
// is paused on the server, as a consumer on a lost member or one whose
// pulls go unanswered is stuck) replaces it after StallAfter and goes on
// from the next sequence, each message once and in order, whatever the
// read's start. nats.go alone does not notice: the paused consumer still
// answers its pulls with heartbeats, and the read hangs.
// GPUPLANE_BUS_NO_STALL=1 turns the replacement off to see it hang.
func TestFollowReplacesAConsumerThatDeliversNothing(t *testing.T) {
	const (
		first, total = 5, 12
		stallAfter   = time.Second
		// Liveness only: a replacement takes about StallAfter.
		bound = 20 * time.Second
	)
	stall := stallAfter
	if os.Getenv("GPUPLANE_BUS_NO_STALL") != "" {
		stall = time.Hour
	}
	for _, tc := range []struct {
		name string
		spec func(subject string) bus.FollowSpec
		// from is the first message the read delivers.
		from int
		// before are published before the read starts.
		before int
	}{
		{"all", func(s string) bus.FollowSpec { return bus.FollowSpec{FilterSubjects: []string{s}} }, 1, 2},
		{"from a sequence", func(s string) bus.FollowSpec { return bus.FollowSpec{FilterSubjects: []string{s}, StartSeq: 2} }, 2, 2},
		{"new only", func(s string) bus.FollowSpec { return bus.FollowSpec{FilterSubjects: []string{s}, New: true} }, 3, 2},
		{"last per subject", func(s string) bus.FollowSpec {
			return bus.FollowSpec{FilterSubjects: []string{s}, LastPerSubject: true}
		}, 2, 2},
		{"unfiltered", func(string) bus.FollowSpec { return bus.FollowSpec{} }, 1, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := connect(t)
			subject := contracts.SubjectAlert("stall")
			ctx, cancel := context.WithTimeout(context.Background(), 2*bound)
			defer cancel()
			publish := func(n int) {
				t.Helper()
				if _, err := b.Publish(ctx, subject, fmt.Sprint("stall-", n), n); err != nil {
					t.Fatalf("publish %d: %v", n, err)
				}
			}
			for n := 1; n <= tc.before; n++ {
				publish(n)
			}
			var mu sync.Mutex
			var got []int
			delivered := make(chan struct{}, 1)
			spec := tc.spec(subject)
			spec.Stream, spec.StallAfter = contracts.StreamOps, stall
			fctx, fcancel := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() {
				done <- b.Follow(fctx, spec, func(_ context.Context, m *bus.Msg) error {
					var n int
					if err := m.Decode(&n); err != nil {
						return err
					}
					mu.Lock()
					got = append(got, n)
					mu.Unlock()
					select {
					case delivered <- struct{}{}:
					default:
					}
					return nil
				}, nil)
			}()
			defer func() {
				fcancel()
				if err := <-done; err != nil {
					t.Errorf("Follow: %v", err)
				}
			}()
			waitFor := func(n int) {
				t.Helper()
				timeout := time.After(bound)
				for {
					mu.Lock()
					k := len(got)
					mu.Unlock()
					if k >= n {
						return
					}
					select {
					case <-delivered:
					case <-timeout:
						t.Fatalf("%d of %d messages delivered in %s: the read hangs", k, n, bound)
					}
				}
			}
			// A New read starts once its consumer exists: the first
			// message after the read starts may be published before.
			if tc.before > 0 && tc.from <= tc.before {
				waitFor(tc.before - tc.from + 1)
			} else {
				eventually(t, bound, func() bool { return len(consumers(t, b)) == 1 }, "the read's consumer")
			}
			for n := tc.before + 1; n <= first; n++ {
				publish(n)
			}
			waitFor(first - tc.from + 1)
			names := consumers(t, b)
			if len(names) != 1 {
				t.Fatalf("consumers %v, want the read's alone", names)
			}
			if _, err := b.JetStream().PauseConsumer(ctx, contracts.StreamOps, names[0], time.Now().Add(time.Hour)); err != nil {
				t.Fatalf("pause: %v", err)
			}
			stalled := time.Now()
			for n := first + 1; n <= total; n++ {
				publish(n)
			}
			waitFor(total - tc.from + 1)
			t.Logf("consumer paused: every message delivered %s later", time.Since(stalled).Round(time.Millisecond))
			mu.Lock()
			defer mu.Unlock()
			for i, n := range got {
				if n != tc.from+i {
					t.Fatalf("delivered %v: want %d to %d, each once, in order", got, tc.from, total)
				}
			}
		})
	}
}

// consumers names the consumers of the OPS stream.
func consumers(t *testing.T, b *bus.Bus) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := b.JetStream().Stream(ctx, contracts.StreamOps)
	if err != nil {
		t.Fatalf("stream: %v", err)
	}
	lister := s.ConsumerNames(ctx)
	var names []string
	for name := range lister.Name() {
		names = append(names, name)
	}
	if err := lister.Err(); err != nil {
		t.Fatalf("consumer names: %v", err)
	}
	return names
}

// TestFollowWaitsForASlowHandler: a handler that takes longer than
// StallAfter while the stream holds more messages is not a stall: its
// context does not end under it and no message is handed over twice.
func TestFollowWaitsForASlowHandler(t *testing.T) {
	const total = 4
	b := connect(t)
	subject := contracts.SubjectAlert("slow")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for n := 1; n <= total; n++ {
		if _, err := b.Publish(ctx, subject, fmt.Sprint("slow-", n), n); err != nil {
			t.Fatalf("publish %d: %v", n, err)
		}
	}
	var got []int
	caught := make(chan struct{})
	fctx, fcancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- b.Follow(fctx, bus.FollowSpec{Stream: contracts.StreamOps, FilterSubjects: []string{subject},
			StallAfter: 100 * time.Millisecond}, func(hctx context.Context, m *bus.Msg) error {
			var n int
			if err := m.Decode(&n); err != nil {
				return err
			}
			got = append(got, n)
			if n == 1 {
				// Slow work: ten times StallAfter, the stream ahead.
				time.Sleep(time.Second)
				if hctx.Err() != nil {
					t.Errorf("the handler's context ended under it: %v", hctx.Err())
				}
			}
			return nil
		}, func() { close(caught) })
	}()
	select {
	case <-caught:
	case <-ctx.Done():
		t.Fatal("the read did not catch up")
	}
	fcancel()
	if err := <-done; err != nil {
		t.Fatalf("Follow: %v", err)
	}
	if want := []int{1, 2, 3, 4}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("delivered %v, want %v", got, want)
	}
}
