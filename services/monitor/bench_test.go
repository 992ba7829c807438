package monitor_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/monitor"
)

// BenchmarkIngestBus measures the monitor's ingest through the bus: a
// fleet of 100 machines of 8 GPUs publishes telemetry to the embedded
// JetStream server as fast as it accepts it, and the clock stops when the
// monitor has taken in every message (decoded, read model, windows; the
// rules evaluated every 100 ms meanwhile). The barrier is a last message
// whose GPU raised an XID: the follower reads in order, so its gpu_xid alert
// (seen by a core subscription, at most one evaluation later) means every
// message before it was ingested. The publisher and the server share the
// process, so with -cpu 1 the figure is a floor for the monitor alone.
func BenchmarkIngestBus(b *testing.B) {
	const machines, gpusPer = 100, 8
	srv := natstest.Start(b)
	bb := connect(b, srv)
	cfg := monitor.DefaultConfig()
	cfg.SilentAfter = time.Hour
	cfg.EvalInterval = 100 * time.Millisecond
	addr, _ := startMonitorWith(b, srv, cfg)
	waitHealthy(b, addr)

	msgs := max(b.N/gpusPer, 1)
	data := make([][]byte, machines)
	for i := range data {
		node := fmt.Sprintf("n%d", i)
		t := contracts.Telemetry{SchemaVersion: 1, NodeID: node, Hostname: "host-" + node, Pool: fmt.Sprintf("pool%d", i%4), Time: time.Now()}
		for j := range gpusPer {
			t.GPUs = append(t.GPUs, contracts.GPUSample{Index: j, UUID: fmt.Sprintf("GPU-%d-%d", i, j), Model: "H100-80GB",
				GPUUtil: float64((i + j) % 100), FBUsedMiB: 40000, FBFreeMiB: 41920, TempC: 60, PowerW: 400, SMClockMHz: 1980,
				PowerLimitW: 700, Healthy: true})
		}
		var err error
		if data[i], err = json.Marshal(t); err != nil {
			b.Fatal(err)
		}
	}
	sentinel := contracts.Telemetry{SchemaVersion: 1, NodeID: "sentinel", Pool: "pool0", Time: time.Now(),
		GPUs: []contracts.GPUSample{{UUID: "GPU-sentinel", LastXID: 79, Healthy: true}}}
	sentinelData, err := json.Marshal(sentinel)
	if err != nil {
		b.Fatal(err)
	}
	done, err := bb.Conn().SubscribeSync(contracts.SubjectAlert("gpu_xid"))
	if err != nil {
		b.Fatal(err)
	}
	js := bb.JetStream()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	b.ResetTimer()
	start := time.Now()
	for i := range msgs {
		node := i % machines
		if _, err := js.PublishAsync(contracts.SubjectTelemetry(fmt.Sprintf("n%d", node)), data[node],
			jetstream.WithMsgID("bench/"+strconv.Itoa(i))); err != nil {
			b.Fatalf("publish: %v", err)
		}
	}
	if _, err := js.PublishAsync(contracts.SubjectTelemetry("sentinel"), sentinelData, jetstream.WithMsgID("bench/sentinel")); err != nil {
		b.Fatalf("publish: %v", err)
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-ctx.Done():
		b.Fatal("publishes not acknowledged")
	}
	if _, err := done.NextMsgWithContext(ctx); err != nil {
		b.Fatalf("no gpu_xid alert for the last message: %v", err)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	if n := telemetryCount(b, addr); n != msgs+1 {
		b.Fatalf("monitor counted %d telemetry messages, want %d", n, msgs+1)
	}
	b.ReportMetric(float64(msgs*gpusPer)/elapsed.Seconds(), "samples/s")
	b.ReportMetric(float64(msgs)/elapsed.Seconds(), "msgs/s")
	b.ReportMetric(0, "ns/op")
}

func telemetryCount(t testing.TB, addr string) int {
	for _, l := range scrape(t, addr) {
		if v, ok := strings.CutPrefix(l, "gpuplane_telemetry_messages_total "); ok {
			n, _ := strconv.ParseFloat(v, 64)
			return int(n)
		}
	}
	return 0
}
