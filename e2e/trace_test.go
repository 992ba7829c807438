package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// traceFleet is one machine of two GPUs.
const traceFleet = `machineTypes:
  box:
    gpuModel: A100-80GB
    gpuCount: 2
    nvlink: false
pools:
  - name: p
    machineType: box
    count: 1
    priceClass: on-demand
`

// jobServices are the services whose spans one job's trace must hold: the
// node agents of the in-process stack run as "node-agent-fleet".
var jobServices = []string{"gateway", "scheduler", "resource-manager", "node-agent", "billing"}

func serviceOf(name string) string {
	if strings.HasPrefix(name, "node-agent") {
		return "node-agent"
	}
	return name
}

// TestJobIsOneTraceInJaeger submits jobs through the gateway with a W3C
// traceparent (as gpuctl sends one), with the whole platform exporting to
// a real Jaeger, waits until they succeeded and were billed, and reads
// their traces back through Jaeger's API. Each job is one trace, the
// caller's, holding spans of the gateway, scheduler, resource manager,
// node agent and billing; found by the job's ID and tenant in every one of
// those services and by no other trace; the only span whose parent is not
// in it is the gateway's server span (its parent is the caller's). The
// submit's first delivery is refused once (bus.EnvNakOnce): its
// redelivery is a child of the gateway's publish with a link to the
// refused attempt, not a new root. The second job is hit by an XID on its
// GPU while it runs, moves and succeeds: still one trace. Telemetry and
// heartbeat publishes are not traced at all.
func TestJobIsOneTraceInJaeger(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Jaeger and the whole platform")
	}
	j := startJaeger(t)
	fl, err := fleet.Parse([]byte(traceFleet))
	if err != nil {
		t.Fatal(err)
	}
	// Read by every bus of this process as it connects.
	t.Setenv(bus.EnvNakOnce, "gp.jobs.submit.")
	start := time.Now()
	s := startStack(t, &fl, func(c *gpuplane.Config) {
		c.OTLPEndpoint = j.otlp
	})
	h := s.watchHistory(t)
	const tenant, plain, faulted = "acme", "traced-1", "traced-xid"
	billed := map[string]chan struct{}{plain: make(chan struct{}), faulted: make(chan struct{})}
	s.tail(t, contracts.StreamUsage, []string{contracts.SubjectUsage(tenant)}, func(m jetstream.Msg) {
		var rec contracts.UsageRecord
		if json.Unmarshal(m.Data(), &rec) != nil || !rec.Final {
			return
		}
		if ch, ok := billed[rec.JobID]; ok {
			select {
			case <-ch:
			default:
				close(ch)
			}
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	plainTrace, callerSpan := submitTraced(t, ctx, s, tenant, plain, "1s")
	faultedTrace, _ := submitTraced(t, ctx, s, tenant, faulted, "6s")
	run := h.awaitState(t, time.Minute, tenant+"/"+faulted, contracts.StateRunning)
	injectFault(t, ctx, s, run.Placement.NodeID, contracts.Fault{ID: "trace-xid", Kind: contracts.FaultXID,
		GPU: run.Placement.Devices[0].UUID, Code: contracts.DefaultFaultXID})
	for _, job := range []string{plain, faulted} {
		h.awaitState(t, time.Minute, tenant+"/"+job, contracts.StateSucceeded)
		select {
		case <-billed[job]:
		case <-ctx.Done():
			t.Fatalf("%s: its usage was never billed", job)
		}
	}
	var attempts []int
	for _, ev := range h.of(tenant + "/" + faulted) {
		if ev.Type == contracts.EventRunning {
			attempts = append(attempts, ev.Attempt)
		}
	}
	if len(attempts) < 2 {
		t.Errorf("%s ran %d times (%v): the XID did not move it", faulted, len(attempts), h.types(tenant+"/"+faulted))
	}

	tr := wholeTrace(t, j, plainTrace, tenant)
	ftr := wholeTrace(t, j, faultedTrace, tenant)
	for _, c := range []struct {
		job string
		tr  jTrace
	}{{plain, tr}, {faulted, ftr}} {
		oneRoot(t, c.tr)
		searchFindsOnly(t, j, tenant, c.job, c.tr.TraceID, start)
		t.Logf("%s: trace %s, %d spans, per service %v", c.job, c.tr.TraceID, len(c.tr.Spans), perService(c.tr))
	}

	// The refused submit and its redelivery: both children of the
	// gateway's publish; the redelivery links to the refused attempt.
	byID := spansByID(tr)
	var deliveries []jSpan
	for _, sp := range tr.Spans {
		if sp.OperationName == "process "+contracts.SubjectSubmit(tenant) {
			deliveries = append(deliveries, sp)
		}
	}
	if len(deliveries) != 2 {
		t.Fatalf("%d scheduler deliveries of the submit, want 2 (the first refused by %s)", len(deliveries), bus.EnvNakOnce)
	}
	slices.SortFunc(deliveries, func(a, b jSpan) int {
		return strings.Compare(a.tag("messaging.nats.delivered"), b.tag("messaging.nats.delivered"))
	})
	first, second := deliveries[0], deliveries[1]
	if first.tag("messaging.nats.delivered") != "1" || second.tag("messaging.nats.delivered") != "2" {
		t.Errorf("deliveries %q and %q, want 1 and 2", first.tag("messaging.nats.delivered"), second.tag("messaging.nats.delivered"))
	}
	for _, d := range deliveries {
		if p, ok := byID[parentID(d)]; !ok || p.OperationName != "publish "+contracts.SubjectSubmit(tenant) ||
			tr.Processes[p.ProcessID].ServiceName != "gateway" {
			t.Errorf("delivery %s: parent %q, want the gateway's publish", d.tag("messaging.nats.delivered"), parentID(d))
		}
	}
	linked := false
	for _, r := range second.References {
		linked = linked || (r.RefType == "FOLLOWS_FROM" && r.SpanID == first.SpanID)
	}
	if !linked {
		t.Errorf("redelivery references %+v: no link to the refused delivery %s", second.References, first.SpanID)
	}
	if root := rootOf(tr); !strings.Contains(root, callerSpan) {
		t.Errorf("root %s: want the gateway's server span under the caller's span %s", root, callerSpan)
	}

	// Telemetry and heartbeats are sampled away.
	services, err := j.services()
	if err != nil {
		t.Fatal(err)
	}
	for _, svc := range services {
		ops, err := j.operations(svc)
		if err != nil {
			t.Fatal(err)
		}
		for _, op := range ops {
			if strings.Contains(op, "gp.telemetry.") || strings.Contains(op, "gp.heartbeat.") ||
				strings.HasSuffix(op, " TELEMETRY") || strings.HasSuffix(op, " HEARTBEATS") {
				t.Errorf("service %s traced %q", svc, op)
			}
		}
	}
}

// submitTraced submits a one-GPU job of duration d through the gateway in
// a new trace of the caller's; it returns the trace ID and the caller's
// span ID.
func submitTraced(t *testing.T, ctx context.Context, s *stack, tenant, jobID, d string) (traceID, callerSpan string) {
	t.Helper()
	var tid [16]byte
	var sid [8]byte
	_, _ = rand.Read(tid[:])
	_, _ = rand.Read(sid[:])
	traceID, callerSpan = hex.EncodeToString(tid[:]), hex.EncodeToString(sid[:])
	body := fmt.Sprintf(`{"id":%q,"resources":{"gpu":{"count":1,"model":"any"}},"run":{"duration":%q}}`, jobID, d)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.ep.GatewayURL+"/v1/tenants/"+tenant+"/jobs", bytes.NewReader([]byte(body)))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("traceparent", "00-"+traceID+"-"+callerSpan+"-01")
	resp, err := authClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	rb, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("submit %s: %s %s", jobID, resp.Status, rb)
	}
	return traceID, callerSpan
}

// wholeTrace waits until Jaeger holds the trace with a span of every one
// of jobServices and billing's usage publish (the last step), and with
// the parent of every span but one (the gateway's server span, whose
// parent is the caller's), and returns it. The services' batch processors
// flush every half second.
func wholeTrace(t *testing.T, j *jaeger, traceID, tenant string) jTrace {
	t.Helper()
	var tr jTrace
	waitFor(t, 30*time.Second, "trace "+traceID+" whole in Jaeger", func() (bool, string) {
		var err error
		tr, err = j.trace(traceID)
		if err != nil {
			return false, err.Error()
		}
		have := map[string]bool{}
		usage := false
		for _, sp := range tr.Spans {
			have[serviceOf(tr.Processes[sp.ProcessID].ServiceName)] = true
			usage = usage || strings.HasPrefix(sp.OperationName, "publish "+contracts.SubjectUsage(tenant))
		}
		for _, svc := range jobServices {
			if !have[svc] {
				return false, fmt.Sprintf("no %s span yet among %d", svc, len(tr.Spans))
			}
		}
		if !usage {
			return false, "no usage publish yet"
		}
		// Each service's batch processor flushes on its own: a consumer's
		// span can reach Jaeger before the publish span it is a child of
		// (the publisher's span ends only at the ack). Wait until every
		// parent is in; oneRoot then fails a span whose parent never came.
		if r := roots(tr); len(r) > 1 {
			return false, fmt.Sprintf("spans whose parent is not in yet: %v", r)
		}
		return true, ""
	})
	for _, sp := range tr.Spans {
		if sp.TraceID != traceID {
			t.Errorf("span %s %q is in trace %s", sp.SpanID, sp.OperationName, sp.TraceID)
		}
	}
	return tr
}

func spansByID(tr jTrace) map[string]jSpan {
	byID := map[string]jSpan{}
	for _, sp := range tr.Spans {
		byID[sp.SpanID] = sp
	}
	return byID
}

func parentID(sp jSpan) string {
	for _, r := range sp.References {
		if r.RefType == "CHILD_OF" {
			return r.SpanID
		}
	}
	return ""
}

func perService(tr jTrace) map[string]int {
	n := map[string]int{}
	for _, sp := range tr.Spans {
		n[tr.Processes[sp.ProcessID].ServiceName]++
	}
	return n
}

// roots are the spans of tr whose parent is not in it.
func roots(tr jTrace) []string {
	byID := spansByID(tr)
	var out []string
	for _, sp := range tr.Spans {
		if _, ok := byID[parentID(sp)]; !ok {
			out = append(out, fmt.Sprintf("%s %q (parent %q)", tr.Processes[sp.ProcessID].ServiceName, sp.OperationName, parentID(sp)))
		}
	}
	return out
}

func rootOf(tr jTrace) string {
	if r := roots(tr); len(r) > 0 {
		return r[0]
	}
	return ""
}

// oneRoot: the only span whose parent is not in the trace is the
// gateway's server span of the submit.
func oneRoot(t *testing.T, tr jTrace) {
	t.Helper()
	r := roots(tr)
	if len(r) != 1 || !strings.Contains(r[0], `gateway "POST /v1/tenants/{tenant}/jobs"`) {
		t.Errorf("trace %s: spans whose parent is not in it: %v; want only the gateway's server span", tr.TraceID, r)
	}
}

// searchFindsOnly: Jaeger's tag search by job (and by job and tenant)
// finds exactly the job's trace in every service of the job.
func searchFindsOnly(t *testing.T, j *jaeger, tenant, jobID, traceID string, since time.Time) {
	t.Helper()
	services, err := j.services()
	if err != nil {
		t.Fatal(err)
	}
	searched := 0
	for _, svc := range services {
		if !slices.Contains(jobServices, serviceOf(svc)) {
			continue
		}
		searched++
		for _, tags := range []map[string]string{{"gpuplane.job_id": jobID}, {"gpuplane.job_id": jobID, "gpuplane.tenant": tenant}} {
			found, err := j.findTraces(svc, tags, since)
			if err != nil {
				t.Fatal(err)
			}
			var ids []string
			for _, f := range found {
				ids = append(ids, f.TraceID)
			}
			if len(ids) != 1 || ids[0] != traceID {
				t.Errorf("search %s %v: traces %v, want only %s", svc, tags, ids, traceID)
			}
		}
	}
	if searched < len(jobServices) {
		t.Errorf("Jaeger knows services %v: want all of %v", services, jobServices)
	}
}

// TestScaleDecisionIsTraced: a burst that does not fit a pool makes the
// autoscaler decide a scale-up, and the decision is a span in Jaeger (with
// the pool, the direction, the node counts and the reason), the child of
// the scheduler's demand it was taken on (at once or on a later tick) and
// the parent of the decision's publish: one trace from demand to decision.
func TestScaleDecisionIsTraced(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Jaeger and the whole platform")
	}
	j := startJaeger(t)
	const pool = "traced"
	start := time.Now()
	s := startStack(t, autoscaledFleet(pool, cloud.OnDemand), withScheduler(time.Second, time.Second),
		withAutoscale(5*time.Second, gpuplane.AutoscalePool{Name: pool, MachineType: "hgx-h100-4", PriceClass: cloud.OnDemand,
			Min: 1, Max: 2, ProvisionDelay: 500 * time.Millisecond, UpCooldown: 2 * time.Second, DownCooldown: time.Second, IdleFor: 2 * time.Second}),
		func(c *gpuplane.Config) { c.OTLPEndpoint = j.otlp })
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for i := range 2 {
		s.submitJob(t, ctx, "acme", fourH100(fmt.Sprintf("scale-%d", i), pool, 5*time.Second, false))
	}
	// Every decision is a span; one prompted by a demand (not by the
	// periodic re-evaluation) is that demand's child, in its trace.
	var decisions int
	var problems []string
	waitFor(t, 45*time.Second, "a scale-up decision traced from the demand that prompted it", func() (bool, string) {
		found, err := j.findTraces("autoscaler", map[string]string{"gpuplane.pool": pool, "gpuplane.direction": "up"}, start)
		if err != nil {
			return false, err.Error()
		}
		decisions, problems = 0, nil
		for _, tr := range found {
			byID := map[string]jSpan{}
			for _, sp := range tr.Spans {
				byID[sp.SpanID] = sp
			}
			parentOf := func(sp jSpan) (jSpan, bool) {
				for _, r := range sp.References {
					if r.RefType == "CHILD_OF" {
						p, ok := byID[r.SpanID]
						return p, ok
					}
				}
				return jSpan{}, false
			}
			for _, d := range tr.Spans {
				if d.OperationName != "scale up "+pool {
					continue
				}
				decisions++
				if d.tag("gpuplane.decision_id") == "" || d.tag("gpuplane.why") == "" || d.tag("gpuplane.desired_nodes") <= d.tag("gpuplane.current_nodes") {
					problems = append(problems, fmt.Sprintf("decision span tags %+v: want its ID, reason and growing node counts", d.Tags))
				}
				published := false
				for _, sp := range tr.Spans {
					if p, ok := parentOf(sp); ok && p.SpanID == d.SpanID && sp.OperationName == "publish "+contracts.SubjectScale(pool) {
						published = true
					}
				}
				if !published {
					problems = append(problems, "no publish of decision "+d.tag("gpuplane.decision_id")+" under its span")
				}
				cause, ok := parentOf(d)
				if ok && cause.OperationName == "publish "+contracts.SubjectDemand(pool) && tr.Processes[cause.ProcessID].ServiceName == "scheduler" {
					return len(problems) == 0, strings.Join(problems, "; ")
				}
			}
		}
		return false, fmt.Sprintf("%d decision spans, none the child of the scheduler's demand publish; %v", decisions, problems)
	})
}
