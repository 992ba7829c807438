package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// EnvRequireJaeger makes the trace test fail instead of skipping when the
// Jaeger binary is missing (.ci/run sets it after building Jaeger).
const EnvRequireJaeger = "GPUPLANE_REQUIRE_JAEGER"

// jaegerBinary is the Jaeger v2 binary tilt/install-tools.sh builds
// (GPUPLANE_JAEGER_BIN overrides it), or "" when there is none.
func jaegerBinary(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("GPUPLANE_JAEGER_BIN")
	if bin == "" {
		bin = filepath.Join("..", ".tools", "bin", "jaeger")
	}
	if _, err := os.Stat(bin); err != nil {
		if os.Getenv(EnvRequireJaeger) == "1" {
			t.Fatalf("%s=1 and no Jaeger binary at %s (build it with `make tools` or tilt/install-tools.sh --with-jaeger)", EnvRequireJaeger, bin)
		}
		t.Skipf("no Jaeger binary at %s: build it with tilt/install-tools.sh --with-jaeger", bin)
	}
	abs, err := filepath.Abs(bin)
	if err != nil {
		t.Fatal(err)
	}
	return abs
}

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
}

// jaeger is a running Jaeger: OTLP/HTTP at otlp (host:port), the query
// API at api (a base URL).
type jaeger struct {
	otlp, api string
}

// startJaeger runs Jaeger with tilt/jaeger.yaml (loopback, in memory) on
// free ports until the test ends.
func startJaeger(t *testing.T) *jaeger {
	t.Helper()
	bin := jaegerBinary(t)
	cfg, err := os.ReadFile(filepath.Join("..", "tilt", "jaeger.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	ports := map[string]string{}
	text := string(cfg)
	for _, p := range []string{"4317", "4318", "16685", "16686"} {
		ports[p] = freePort(t)
		text = strings.ReplaceAll(text, "127.0.0.1:"+p, "127.0.0.1:"+ports[p])
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "jaeger.yaml")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	logf, err := os.Create(filepath.Join(dir, "jaeger.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--config=file:"+path)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		_ = logf.Close()
		if t.Failed() {
			if b, err := os.ReadFile(logf.Name()); err == nil {
				t.Logf("jaeger log:\n%s", tail(string(b), 4000))
			}
		}
	})
	j := &jaeger{otlp: "127.0.0.1:" + ports["4318"], api: "http://127.0.0.1:" + ports["16686"]}
	waitFor(t, 60*time.Second, "Jaeger's query API", func() (bool, string) {
		select {
		case err := <-exited:
			b, _ := os.ReadFile(logf.Name())
			t.Fatalf("jaeger exited: %v\n%s", err, tail(string(b), 4000))
		default:
		}
		resp, err := http.Get(j.api + "/api/services")
		if err != nil {
			return false, err.Error()
		}
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status
	})
	return j
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// The Jaeger query API's model (v1 JSON, what /api/traces returns).
type jTrace struct {
	TraceID   string              `json:"traceID"`
	Spans     []jSpan             `json:"spans"`
	Processes map[string]jProcess `json:"processes"`
}

type jSpan struct {
	TraceID       string `json:"traceID"`
	SpanID        string `json:"spanID"`
	OperationName string `json:"operationName"`
	References    []struct {
		RefType string `json:"refType"`
		TraceID string `json:"traceID"`
		SpanID  string `json:"spanID"`
	} `json:"references"`
	Tags      []jTag `json:"tags"`
	ProcessID string `json:"processID"`
}

type jTag struct {
	Key   string `json:"key"`
	Value any    `json:"value"`
}

type jProcess struct {
	ServiceName string `json:"serviceName"`
}

func (s jSpan) tag(key string) string {
	for _, t := range s.Tags {
		if t.Key == key {
			return fmt.Sprint(t.Value)
		}
	}
	return ""
}

func (j *jaeger) get(path string, q url.Values, out any) error {
	resp, err := http.Get(j.api + path + "?" + q.Encode())
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s: %s", path, resp.Status, b)
	}
	return json.Unmarshal(b, out)
}

// findTraces is Jaeger's search: the traces with a span of service tagged
// with every tag.
func (j *jaeger) findTraces(service string, tags map[string]string, since time.Time) ([]jTrace, error) {
	tj, _ := json.Marshal(tags)
	var res struct {
		Data []jTrace `json:"data"`
	}
	err := j.get("/api/traces", url.Values{"service": {service}, "tags": {string(tj)}, "limit": {"100"},
		"start": {strconv.FormatInt(since.UnixMicro(), 10)}, "end": {strconv.FormatInt(time.Now().Add(time.Minute).UnixMicro(), 10)}}, &res)
	return res.Data, err
}

func (j *jaeger) trace(id string) (jTrace, error) {
	var res struct {
		Data []jTrace `json:"data"`
	}
	if err := j.get("/api/traces/"+id, nil, &res); err != nil {
		return jTrace{}, err
	}
	if len(res.Data) != 1 {
		return jTrace{}, fmt.Errorf("trace %s: %d traces", id, len(res.Data))
	}
	return res.Data[0], nil
}

func (j *jaeger) services() ([]string, error) {
	var res struct {
		Data []string `json:"data"`
	}
	err := j.get("/api/services", nil, &res)
	return res.Data, err
}

func (j *jaeger) operations(service string) ([]string, error) {
	var res struct {
		Data []string `json:"data"`
	}
	err := j.get("/api/services/"+url.PathEscape(service)+"/operations", nil, &res)
	return res.Data, err
}

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

// TestJobIsOneTraceInJaeger submits a job through the gateway with a W3C
// traceparent (as gpuctl sends one), with the whole platform exporting to
// a real Jaeger, waits until it succeeded and was billed, and reads its
// trace back through Jaeger's API: one trace, the caller's, holding spans
// of the gateway, scheduler, resource manager, node agent and billing;
// found by the job's ID and tenant in every one of those services and by
// no other trace; the submit's first delivery is refused once
// (bus.EnvNakOnce) and its redelivery is a child of the gateway's publish
// with a link to the refused attempt, not a new root; the only span
// whose parent is not in the trace is the gateway's server span (its
// parent is the caller's); and telemetry and heartbeat publishes are not
// traced at all.
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
	jobs := s.watchJobs(t)
	const tenant, jobID = "acme", "traced-1"
	billed := make(chan struct{})
	var once bool
	s.tail(t, contracts.StreamUsage, []string{contracts.SubjectUsage(tenant)}, func(m jetstream.Msg) {
		var rec contracts.UsageRecord
		if json.Unmarshal(m.Data(), &rec) == nil && rec.JobID == jobID && rec.Final && !once {
			once = true
			close(billed)
		}
	})

	var tid [16]byte
	var sid [8]byte
	_, _ = rand.Read(tid[:])
	_, _ = rand.Read(sid[:])
	traceID, callerSpan := hex.EncodeToString(tid[:]), hex.EncodeToString(sid[:])
	body := fmt.Sprintf(`{"id":%q,"resources":{"gpu":{"count":1,"model":"any"}},"run":{"duration":"1s"}}`, jobID)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
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
		t.Fatalf("submit: %s %s", resp.Status, rb)
	}
	waitFor(t, 60*time.Second, "the job to succeed", func() (bool, string) {
		ev, ok := jobs.get(tenant + "/" + jobID)
		return ok && ev.State == contracts.StateSucceeded, fmt.Sprintf("%+v", ev)
	})
	select {
	case <-billed:
	case <-ctx.Done():
		t.Fatal("the job's usage was never billed")
	}

	// The batch processors flush every half second; wait until the trace
	// holds the last step (billing's usage publish).
	var tr jTrace
	waitFor(t, 30*time.Second, "the job's whole trace in Jaeger", func() (bool, string) {
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
		return usage, "no usage publish yet"
	})

	// One trace, the caller's, everything under the gateway's span.
	byID := map[string]jSpan{}
	perService := map[string]int{}
	for _, sp := range tr.Spans {
		byID[sp.SpanID] = sp
		perService[tr.Processes[sp.ProcessID].ServiceName]++
	}
	var roots []string
	for _, sp := range tr.Spans {
		if sp.TraceID != traceID {
			t.Errorf("span %s %q is in trace %s", sp.SpanID, sp.OperationName, sp.TraceID)
		}
		parent := ""
		for _, r := range sp.References {
			if r.RefType == "CHILD_OF" {
				parent = r.SpanID
			}
		}
		if _, ok := byID[parent]; !ok {
			roots = append(roots, fmt.Sprintf("%s %q (parent %q)", tr.Processes[sp.ProcessID].ServiceName, sp.OperationName, parent))
		}
	}
	if len(roots) != 1 || !strings.Contains(roots[0], `gateway "POST /v1/tenants/{tenant}/jobs"`) || !strings.Contains(roots[0], callerSpan) {
		t.Errorf("spans whose parent is not in the trace: %v; want only the gateway's server span, child of the caller's", roots)
	}
	t.Logf("trace %s: %d spans, per service %v", traceID, len(tr.Spans), perService)

	// Found by job and tenant in every service, and no other trace is.
	services, err := j.services()
	if err != nil {
		t.Fatal(err)
	}
	for _, svc := range services {
		if !slices.Contains(jobServices, serviceOf(svc)) {
			continue
		}
		for _, tags := range []map[string]string{{"gpuplane.job_id": jobID}, {"gpuplane.job_id": jobID, "gpuplane.tenant": tenant}} {
			found, err := j.findTraces(svc, tags, start)
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

	// The refused submit and its redelivery: both children of the
	// gateway's publish; the redelivery links to the refused attempt.
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
		var parent string
		for _, r := range d.References {
			if r.RefType == "CHILD_OF" {
				parent = r.SpanID
			}
		}
		if p, ok := byID[parent]; !ok || p.OperationName != "publish "+contracts.SubjectSubmit(tenant) ||
			tr.Processes[p.ProcessID].ServiceName != "gateway" {
			t.Errorf("delivery %s: parent %q, want the gateway's publish", d.tag("messaging.nats.delivered"), parent)
		}
	}
	linked := false
	for _, r := range second.References {
		linked = linked || (r.RefType == "FOLLOWS_FROM" && r.SpanID == first.SpanID)
	}
	if !linked {
		t.Errorf("redelivery references %+v: no link to the refused delivery %s", second.References, first.SpanID)
	}

	// Telemetry and heartbeats are sampled away.
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
