package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
)

// TestGatewayRestartAnswersAsBefore: through the HTTP API, a gateway
// whose ended jobs are all retired answers as a replica that keeps them
// whole, and a gateway started from the first one's snapshot answers as
// both (jobs, pages, describe, tenants, queues, usage).
func TestGatewayRestartAnswersAsBefore(t *testing.T) {
	retiring := func(c *Config) {
		c.Retention = RetentionConfig{RetainEnded: time.Nanosecond, RetainEndedMax: 1, CachedJobs: 2, SnapshotInterval: time.Nanosecond}
	}
	h := startGateway(t, retiring, nil)
	usage := func(i int, alloc string) {
		r := contracts.UsageRecord{SchemaVersion: 1, ID: contracts.UsageID(alloc), AllocationID: alloc, Tenant: "acme",
			JobID: "done", Attempt: 1, GPUs: 2, Start: t0, End: t0.Add(time.Duration(i+1) * time.Hour), GPUMillis: int64(i+1) * 7200_000,
			GPUSeconds: float64(i+1) * 7200, Time: t0}
		// Distinct Nats-Msg-Ids: the repeat is the read model's to drop.
		if _, err := h.bus.Publish(context.Background(), contracts.SubjectUsage("acme"), fmt.Sprintf("%s/%d", r.ID, i), r); err != nil {
			t.Fatal(err)
		}
	}
	records := func(g *harness, n int) {
		g.eventually(fmt.Sprintf("%d usage records", n), func() bool {
			var sum contracts.UsageSummary
			g.do(http.MethodGet, "/v1/tenants/acme/usage", "", &sum)
			return sum.Records == n
		})
	}
	usage(0, "a1")
	usage(1, "a2")
	usage(0, "a1")
	records(h, 2) // before the job events: the snapshots hold them
	at := t0
	ev := func(typ contracts.JobEventType, tenant, id string, fill func(*contracts.JobEvent)) uint64 {
		at = at.Add(time.Second)
		e := contracts.JobEvent{Type: typ, Tenant: tenant, JobID: id, Attempt: 1, Time: at}
		if typ == contracts.EventQueued {
			e = queued(tenant, id, at)
		}
		if fill != nil {
			fill(&e)
		}
		return h.publishEvent(e)
	}
	p := &contracts.Placement{AllocationID: "a1", NodeID: "node-1", Pool: "east", Devices: []contracts.DeviceRef{}}
	for _, id := range []string{"done", "failed", "preempted", "running", "waiting"} {
		ev(contracts.EventQueued, "acme", id, nil)
	}
	for _, id := range []string{"done", "failed", "preempted", "running"} {
		ev(contracts.EventScheduled, "acme", id, func(e *contracts.JobEvent) { e.Placement, e.State = p, contracts.StateScheduled })
		ev(contracts.EventRunning, "acme", id, func(e *contracts.JobEvent) { e.Placement, e.State = p, contracts.StateRunning })
	}
	exit := 1
	ev(contracts.EventSucceeded, "acme", "done", func(e *contracts.JobEvent) { e.ExitCode, e.State = new(int), contracts.StateSucceeded })
	ev(contracts.EventFailed, "acme", "failed", func(e *contracts.JobEvent) {
		e.ExitCode, e.Reason, e.State = &exit, contracts.ReasonExitNonZero, contracts.StateFailed
	})
	ev(contracts.EventCancelled, "acme", "preempted", func(e *contracts.JobEvent) {
		e.Reason, e.State = contracts.ReasonPreempted, contracts.StateCancelled
	})
	// A tenant whose every job is retired.
	ev(contracts.EventRejected, "umbrella", "bad", func(e *contracts.JobEvent) {
		e.State, e.Reason, e.Message = contracts.StateRejected, contracts.ReasonInvalidValue, "no"
	})
	ev(contracts.EventQueued, "umbrella", "gone", nil)
	last := ev(contracts.EventCancelled, "umbrella", "gone", func(e *contracts.JobEvent) { e.State = contracts.StateCancelled })

	// Wait for a snapshot covering every event: one is offered after
	// each event, dropped while another is written, so a refused event
	// (a duplicate's rejection) is sent until one covers the last.
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	kv, err := h.bus.KeyValue(ctx, contracts.BucketSnapshots)
	if err != nil {
		t.Fatal(err)
	}
	filler := 1
	h.eventually("a snapshot of every event", func() bool {
		if e, err := kv.Get(ctx, contracts.GatewaySnapshotHeadKey()); err == nil {
			var head kvsnap.Head
			if json.Unmarshal(e.Value(), &head) == nil && head.Seq >= last {
				return true
			}
		}
		time.Sleep(20 * time.Millisecond)
		filler++ // its own message ID: not a duplicate the stream drops
		last = ev(contracts.EventRejected, "acme", "done", func(e *contracts.JobEvent) {
			e.State, e.Reason, e.Attempt = contracts.StateRejected, contracts.ReasonDuplicateJobID, filler
		})
		return false
	})
	usage(2, "a3") // after the snapshot: read from USAGE
	records(h, 3)
	keepAll := h.replica(func(c *Config) {
		c.Retention = RetentionConfig{RetainEnded: 100 * 365 * 24 * time.Hour, RetainEndedMax: 1 << 30, SnapshotInterval: -1}
	})
	restarted := h.replica(retiring)
	if logs := restarted.logs.String(); !strings.Contains(logs, "read model snapshot loaded") || strings.Contains(logs, "usage_seq=0 ") {
		t.Fatal("the restarted gateway did not load the snapshot with the usage records")
	}
	paths := []string{"/v1/tenants", "/v1/queues", "/v1/tenants/umbrella/jobs", "/v1/tenants/umbrella/jobs/bad",
		"/v1/tenants/acme/jobs", "/v1/tenants/acme/jobs?state=succeeded", "/v1/tenants/acme/jobs?state=running",
		"/v1/tenants/acme/jobs?limit=2", "/v1/tenants/acme/jobs?limit=2&after=failed", "/v1/tenants/acme/jobs?after=done",
		"/v1/tenants/acme/jobs?after=nope", "/v1/tenants/acme/jobs/nope", "/v1/tenants/acme/usage",
		"/v1/tenants/acme/usage/series?step=hour", "/v1/tenants/umbrella/usage"}
	for _, id := range []string{"done", "failed", "preempted", "running", "waiting"} {
		paths = append(paths, "/v1/tenants/acme/jobs/"+id, "/v1/tenants/acme/jobs/"+id+"/describe")
	}
	// untimed drops the time a response was made at.
	untimed := func(b []byte) string {
		var v map[string]any
		if json.Unmarshal(b, &v) != nil {
			return string(b)
		}
		delete(v, "time")
		out, _ := json.Marshal(v)
		return string(out)
	}
	for _, path := range paths {
		ws, want := keepAll.do(http.MethodGet, path, "", nil)
		for name, g := range map[string]*harness{"retiring": h, "restarted from its snapshot": restarted} {
			gs, got := g.do(http.MethodGet, path, "", nil)
			if gs != ws || untimed(got) != untimed(want) {
				t.Errorf("GET %s from the %s gateway: %d %s\nwant %d %s", path, name, gs, got, ws, want)
			}
		}
	}
}
