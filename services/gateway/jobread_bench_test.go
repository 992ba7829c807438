package gateway

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// BenchmarkJobEventRead measures the CPU the gateway spends reading
// JOB_EVENTS for its read model and its event streams' tail, per job
// event, the in-process NATS server's share included: GPUPLANE_JOBREAD_JOBS
// jobs (3,000 by default, the burst's) queued, scheduled and running, read
// from the stream's start by a fresh ingester and tail each iteration.
// one-read is the gateway's way (the fold feeds the tail); two-reads is a
// JetStream read each, as before, the same run's baseline.
func BenchmarkJobEventRead(b *testing.B) {
	jobs := 3000
	if v := os.Getenv("GPUPLANE_JOBREAD_JOBS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			b.Fatalf("GPUPLANE_JOBREAD_JOBS=%q: want a positive number", v)
		}
		jobs = n
	}
	srv := natstest.Start(b)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	pub, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "test-scheduler", CredsFile: natstest.Operator(b, srv)})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = pub.Close(context.Background()) }()
	if err := pub.EnsureStreams(ctx); err != nil {
		b.Fatal(err)
	}
	gw, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: Name, CredsFile: natstest.Service(b, srv, contracts.BusGateway)})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = gw.Close(context.Background()) }()
	var last uint64
	for i := range jobs {
		tenant, id := "t"+strconv.Itoa(i%20), fmt.Sprintf("job-%06d", i)
		q := queued(tenant, id, t0)
		p := &contracts.Placement{AllocationID: "a-" + id, NodeID: "node-" + strconv.Itoa(i%100), Pool: "east"}
		for _, ev := range []contracts.JobEvent{q,
			{Type: contracts.EventScheduled, State: contracts.StateScheduled, Tenant: tenant, JobID: id, Attempt: 1, Time: t0, Placement: p},
			{Type: contracts.EventRunning, State: contracts.StateRunning, Tenant: tenant, JobID: id, Attempt: 1, Time: t0, Placement: p, StartedAt: &t0}} {
			ev.SchemaVersion = contracts.SchemaVersion
			ack, err := pub.Publish(ctx, contracts.SubjectJobEvents(tenant, id), contracts.JobEventID(tenant, id, ev.Type, 1, 0), ev)
			if err != nil {
				b.Fatal(err)
			}
			last = ack.Sequence
		}
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, mode := range []string{"two-reads", "one-read"} {
		b.Run(mode, func(b *testing.B) {
			var cpu time.Duration
			for range b.N {
				rctx, stop := context.WithCancel(ctx)
				tail := newEventTail(gw, SSEConfig{}, quiet)
				in := &ingester{bus: gw, model: newMemoryModel(), log: quiet}
				done := make(chan struct{}, 2)
				before := processCPU(b)
				if mode == "one-read" {
					in.tail = tail
				} else {
					go func() { _ = tail.run(rctx); done <- struct{}{} }()
				}
				go func() { _ = in.followJobEvents(rctx); done <- struct{}{} }()
				for in.folded.Load() < last || tail.stats().last < last {
					if rctx.Err() != nil {
						b.Fatalf("not caught up: folded %d, tail %+v, want %d", in.folded.Load(), tail.stats(), last)
					}
					time.Sleep(time.Millisecond)
				}
				cpu += processCPU(b) - before
				stop()
				<-done
				if mode != "one-read" {
					<-done
				}
			}
			b.ReportMetric(float64(cpu.Microseconds())/float64(b.N)/float64(last), "cpu-us/event")
			b.ReportMetric(float64(cpu.Microseconds())/float64(b.N)/float64(jobs)/1000, "cpu-ms/job")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// processCPU is the CPU time the process used so far, user and system.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
