package e2e

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// TestMeasureTraces prints how many traces one job makes, and one hit by
// an XID, and how many of all traces are telemetry and heartbeat noise,
// with `make run`'s default fleet exporting to a real Jaeger. It asserts
// nothing: it is the figure behind the trace work (issue 13), run by hand
// (GPUPLANE_TRACE_MEASURE=1) on this tree and on an older one.
func TestMeasureTraces(t *testing.T) {
	if os.Getenv("GPUPLANE_TRACE_MEASURE") != "1" {
		t.Skip("a measurement: GPUPLANE_TRACE_MEASURE=1 runs it")
	}
	j := startJaeger(t)
	data, err := os.ReadFile("../deploy/fleet/default.yaml")
	if err != nil {
		t.Fatal(err)
	}
	fl, err := fleet.Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	s := startStack(t, &fl, func(c *gpuplane.Config) { c.OTLPEndpoint = j.otlp })
	h := s.watchHistory(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const tenant = "acme"
	jobs := []string{"measure-plain", "measure-xid"}
	submitTraced(t, ctx, s, tenant, jobs[0], "1s")
	submitTraced(t, ctx, s, tenant, jobs[1], "6s")
	run := h.awaitState(t, time.Minute, tenant+"/"+jobs[1], contracts.StateRunning)
	injectFault(t, ctx, s, run.Placement.NodeID, contracts.Fault{ID: "fault-1", Kind: contracts.FaultXID,
		GPU: run.Placement.Devices[0].UUID, Code: contracts.DefaultFaultXID})
	for _, job := range jobs {
		h.awaitState(t, time.Minute, tenant+"/"+job, contracts.StateSucceeded)
	}
	time.Sleep(5 * time.Second) // billing, then the exporters' last batches
	services, err := j.services()
	if err != nil {
		t.Fatal(err)
	}
	all := map[string]jTrace{}
	for _, svc := range services {
		found, err := j.findTraces(svc, nil, start)
		if err != nil {
			t.Fatal(err)
		}
		for _, tr := range found {
			all[tr.TraceID] = tr
		}
	}
	noise := 0
	for _, tr := range all {
		quiet := true
		for _, sp := range tr.Spans {
			quiet = quiet && (strings.Contains(sp.OperationName, "gp.telemetry.") || strings.Contains(sp.OperationName, "gp.heartbeat.") ||
				strings.HasSuffix(sp.OperationName, "TELEMETRY") || strings.HasSuffix(sp.OperationName, "HEARTBEATS"))
		}
		if quiet {
			noise++
		}
	}
	for _, job := range jobs {
		var ids []string
		spans := 0
		for id, tr := range all {
			mine := false
			for _, sp := range tr.Spans {
				for _, tag := range sp.Tags {
					if v, ok := tag.Value.(string); ok && (v == job || strings.Contains(v, "/"+job+"/") || strings.HasSuffix(v, "/"+job) ||
						strings.Contains(v, "."+job)) {
						mine = true
					}
				}
				mine = mine || strings.HasSuffix(sp.OperationName, "."+job)
			}
			if mine {
				if os.Getenv("GPUPLANE_TRACE_MEASURE_DEBUG") != "" {
					var ops []string
					for _, sp := range tr.Spans {
						ops = append(ops, tr.Processes[sp.ProcessID].ServiceName+":"+sp.OperationName)
					}
					t.Logf("DEBUG %s trace %s: %v", job, id, ops)
				}
				ids = append(ids, id)
				spans += len(tr.Spans)
			}
		}
		t.Logf("MEASURE %s: %d traces, %d spans", job, len(ids), spans)
	}
	if os.Getenv("GPUPLANE_TRACE_MEASURE_DEBUG") != "" {
		kinds := map[string]int{}
		for _, tr := range all {
			if r := roots(tr); len(r) > 0 {
				kinds[r[0]]++
			}
		}
		t.Logf("DEBUG roots: %v", kinds)
	}
	t.Logf("MEASURE all traces over %s: %d, of which telemetry/heartbeat only: %d; services %v", time.Since(start).Round(time.Second), len(all), noise, services)
}
