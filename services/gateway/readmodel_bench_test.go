package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// BenchmarkReadModelRebuild measures the gateway's read model at start:
// the time its ingester takes to fold JOB_EVENTS holding
// GPUPLANE_REBUILD_JOBS jobs' events (50,000 by default: queued,
// scheduled, running, succeeded, 1 in 10 also pending; 1 % still
// running) until it is ready, and the heap the model then holds per
// 100,000 jobs. The model keeps every job it ever saw (issue 17's figure
// to beat: memory grows with history).
func BenchmarkReadModelRebuild(b *testing.B) {
	n := 50_000
	if v := os.Getenv("GPUPLANE_REBUILD_JOBS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil {
			b.Fatal(err)
		}
	}
	srv := natstest.Start(b)
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ob, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "bench", CredsFile: natstest.Operator(b, srv), Logger: log})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = ob.Close(context.Background()) }()
	if err := ob.EnsureStreams(ctx); err != nil {
		b.Fatal(err)
	}
	js := ob.JetStream()
	at := time.Now().UTC().Add(-24 * time.Hour)
	for i := range n {
		tenant, id := fmt.Sprintf("t%d", i%8), fmt.Sprintf("j%07d", i)
		req := contracts.JobRequest{ID: id, Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB"}},
			Run: contracts.RunSpec{Duration: contracts.Duration(time.Minute)}}.Normalized(tenant)
		ev := func(typ contracts.JobEventType, state contracts.JobState, seq int, fill func(*contracts.JobEvent)) {
			e := contracts.JobEvent{SchemaVersion: contracts.SchemaVersion, Type: typ, Tenant: tenant, JobID: id, Attempt: 1, State: state, Time: at}
			if fill != nil {
				fill(&e)
			}
			data, err := json.Marshal(e)
			if err != nil {
				b.Fatal(err)
			}
			m := nats.NewMsg(contracts.SubjectJobEvents(tenant, id))
			m.Data = data
			m.Header.Set(contracts.HeaderMsgID, contracts.JobEventID(tenant, id, typ, 1, seq))
			for {
				if _, err = js.PublishMsgAsync(m); err == nil {
					return
				}
				<-js.PublishAsyncComplete()
			}
		}
		ev(contracts.EventQueued, contracts.StateQueued, 0, func(e *contracts.JobEvent) { e.Request, e.SubmitSeq = &req, uint64(i+1) })
		if i%10 == 0 {
			ev(contracts.EventPending, contracts.StateQueued, 1, func(e *contracts.JobEvent) {
				e.Reason, e.Message = contracts.PendingInsufficientGPUs, "no free H100 in pool east"
			})
		}
		ev(contracts.EventScheduled, contracts.StateScheduled, 0, nil)
		ev(contracts.EventRunning, contracts.StateRunning, 0, nil)
		if i < n-n/100 {
			ev(contracts.EventSucceeded, contracts.StateSucceeded, 0, nil)
		}
	}
	<-js.PublishAsyncComplete()
	heapNow := func() float64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return float64(m.HeapAlloc)
	}
	var took time.Duration
	var heap float64
	for range b.N {
		before := heapNow()
		in := &ingester{bus: ob, model: newMemoryModel(), log: log}
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		start := time.Now()
		go func() { done <- in.followJobEvents(rctx) }()
		for !in.jobsReady.Load() {
			time.Sleep(time.Millisecond)
		}
		took += time.Since(start)
		cancel()
		<-done
		heap += heapNow() - before
		runtime.KeepAlive(in.model)
	}
	b.ReportMetric(took.Seconds()/float64(b.N), "s-to-ready")
	b.ReportMetric(heap/float64(b.N)/float64(n)*100_000/(1<<20), "MiB/100k-jobs")
	b.ReportMetric(float64(n), "jobs")
	b.ReportMetric(0, "ns/op")
}
