package bus_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// BenchmarkReplayRead measures the read path a rebuild rests on: N stored
// messages (with the bus's envelope headers, as services publish them)
// read by bus.Replay, beside the raw ceiling of a plain nats.go ordered
// consumer with large pull batches on the same server and stream.
// GPUPLANE_REPLAY_MSGS sets N (default 50,000).
func BenchmarkReplayRead(b *testing.B) {
	n := 50000
	if v, err := strconv.Atoi(os.Getenv("GPUPLANE_REPLAY_MSGS")); err == nil && v > 0 {
		n = v
	}
	srv := natstest.Start(b)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	bs, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "bench", CredsFile: natstest.Operator(b, srv)})
	if err != nil {
		b.Fatalf("connect: %v", err)
	}
	defer func() { _ = bs.Close(context.Background()) }()
	subject := contracts.SubjectAlert("replay-bench")
	payload := map[string]any{"job": "j-0000000000", "state": "running", "node": "n-0001", "gpus": []int{0, 1}}
	const window = 2000
	pend := make([]*bus.Pending, 0, window)
	flush := func() {
		for _, p := range pend {
			if _, err := p.Wait(ctx); err != nil {
				b.Fatalf("publish: %v", err)
			}
		}
		pend = pend[:0]
	}
	for i := 0; i < n; i++ {
		p, err := bs.PublishAsync(ctx, subject, fmt.Sprint("replay-bench-", i), payload)
		if err != nil {
			b.Fatalf("publish: %v", err)
		}
		if pend = append(pend, p); len(pend) == window {
			flush()
		}
	}
	flush()
	spec := bus.FollowSpec{Stream: contracts.StreamOps, FilterSubjects: []string{subject}}

	b.Run("bus.Replay", func(b *testing.B) {
		for range b.N {
			start := time.Now()
			count := 0
			if _, err := bs.Replay(ctx, spec, func(context.Context, *bus.Msg) error { count++; return nil }); err != nil {
				b.Fatal(err)
			}
			if count != n {
				b.Fatalf("replayed %d of %d", count, n)
			}
			b.ReportMetric(float64(n)/time.Since(start).Seconds(), "msgs/s")
		}
	})
	for _, batch := range []int{500, 4096} {
		// 500 is nats.go's default batch (what bus.Replay asks for).
		b.Run(fmt.Sprintf("raw-ordered-batch%d", batch), func(b *testing.B) { rawOrdered(b, bs, spec, n, batch) })
	}
}

// rawOrdered reads the n messages of spec with a plain nats.go ordered
// consumer pulling batch messages at a time, headers and metadata parsed
// as bus.Replay parses them.
func rawOrdered(b *testing.B, bs *bus.Bus, spec bus.FollowSpec, n, batch int) {
	ctx := context.Background()
	{
		for range b.N {
			start := time.Now()
			cons, err := bs.JetStream().OrderedConsumer(ctx, spec.Stream,
				jetstream.OrderedConsumerConfig{FilterSubjects: spec.FilterSubjects})
			if err != nil {
				b.Fatal(err)
			}
			it, err := cons.Messages(jetstream.PullMaxMessages(batch))
			if err != nil {
				b.Fatal(err)
			}
			for count := 0; count < n; count++ {
				m, err := it.Next()
				if err != nil {
					b.Fatal(err)
				}
				_, _ = m.Metadata()
				_ = m.Headers()
			}
			it.Stop()
			b.ReportMetric(float64(n)/time.Since(start).Seconds(), "msgs/s")
		}
	}
}
