package gpuctl

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/gateway"
)

// waitFor bounds every wait of these tests.
const waitFor = 10 * time.Second

// harness is a real gateway in front of a real embedded JetStream, and a
// bus client that plays the scheduler and billing.
type harness struct {
	t       *testing.T
	natsURL string
	// natsCreds is tenant acme's bus identity, for --via bus; adminCreds
	// a platform administrator's.
	natsCreds, adminCreds string
	gateway               string
	bus                   *bus.Bus
	// token is a platform admin's API token, sent as GPUPLANE_TOKEN;
	// configDir is GPUPLANE_CONFIG_DIR, so no test touches the user's.
	token     string
	configDir string
}

func start(t *testing.T) *harness {
	t.Helper()
	return startWith(t, nil)
}

// startWith starts the harness with the gateway's config adjusted by
// mutate (login methods).
func startWith(t *testing.T, mutate func(*gateway.Config)) *harness {
	t.Helper()
	srv := natstest.Start(t)
	h := &harness{t: t, natsURL: srv.URL(), natsCreds: natstest.Tenant(t, srv, "acme"), configDir: t.TempDir(),
		adminCreds: natstest.Creds(t, srv, contracts.Identity{Name: "admin", Role: contracts.BusAdmin})}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	// The test's client plays the scheduler and billing: the operator may
	// publish everything.
	b, err := bus.Connect(ctx, bus.Config{URL: h.natsURL, Name: "test-scheduler", CredsFile: natstest.Operator(t, srv)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	h.bus = b
	h.token, err = gateway.IssueToken(ctx, b, gateway.Grant{ID: "test-admin", Name: "test-admin",
		Bindings: []contracts.Binding{{Role: contracts.RolePlatformAdmin}}})
	if err != nil {
		t.Fatal(err)
	}

	cfg := gateway.DefaultConfig()
	cfg.Bus.NATSURL, cfg.Bus.OTLPEndpoint, cfg.Bus.Replicas = h.natsURL, "", 1
	cfg.Bus.Creds = natstest.Service(t, srv, contracts.BusGateway)
	cfg.Addr = "127.0.0.1:0"
	addrs := make(chan string, 1)
	cfg.OnListen = func(a string) { addrs <- a }
	if mutate != nil {
		mutate(&cfg)
	}
	runCtx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	go func() { done <- gateway.Run(runCtx, cfg, log) }()
	t.Cleanup(func() {
		stop()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("gateway: %v", err)
			}
		case <-time.After(waitFor):
			t.Error("gateway did not stop")
		}
	})
	select {
	case a := <-addrs:
		h.gateway = "http://" + a
	case err := <-done:
		t.Fatalf("gateway: %v", err)
	case <-time.After(waitFor):
		t.Fatal("gateway did not listen")
	}
	// Ready when the read model answers: list succeeds.
	h.eventually("gateway ready", func() bool { code, _, _ := h.run("list"); return code == ExitOK })
	return h
}

// syncBuffer is a bytes.Buffer safe to read while a command writes it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func (h *harness) env(k string) string {
	return map[string]string{
		"GPUPLANE_GATEWAY":    h.gateway,
		"GPUPLANE_TENANT":     "acme",
		"GPUPLANE_NATS_URL":   h.natsURL,
		"GPUPLANE_NATS_CREDS": h.natsCreds,
		"GPUPLANE_TOKEN":      h.token,
		"GPUPLANE_CONFIG_DIR": h.configDir,
	}[k]
}

// run runs gpuctl with args and returns its exit code, stdout and stderr.
func (h *harness) run(args ...string) (int, string, string) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	var stdout, stderr syncBuffer
	code := Run(ctx, args, &stdout, &stderr, h.env)
	return code, stdout.String(), stderr.String()
}

// runAsync starts gpuctl; the returned func waits for its exit code.
func (h *harness) runAsync(args ...string) (stdout *syncBuffer, wait func() (int, string)) {
	var out, errOut syncBuffer
	codes := make(chan int, 1)
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	go func() { codes <- Run(ctx, args, &out, &errOut, h.env) }()
	return &out, func() (int, string) {
		defer cancel()
		select {
		case c := <-codes:
			return c, errOut.String()
		case <-time.After(waitFor + time.Second):
			h.t.Fatalf("gpuctl %v did not return", args)
			return 0, ""
		}
	}
}

func (h *harness) eventually(what string, cond func() bool) {
	h.t.Helper()
	deadline := time.Now().Add(waitFor)
	for !cond() {
		if time.Now().After(deadline) {
			h.t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (h *harness) messages(filter string) []*bus.Msg {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	var got []*bus.Msg
	if _, err := h.bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamJobs, FilterSubjects: []string{filter}}, func(_ context.Context, m *bus.Msg) error {
		got = append(got, m)
		return nil
	}); err != nil {
		h.t.Fatal(err)
	}
	return got
}

// submitted returns the one request published for job id of tenant acme.
func (h *harness) submitted(id string) contracts.JobRequest {
	h.t.Helper()
	for _, m := range h.messages(contracts.SubjectSubmit("acme")) {
		if m.ID() == contracts.SubmitMsgID("acme", id) {
			req, err := contracts.DecodeJobRequest(m.Data, "acme")
			if err != nil {
				h.t.Fatalf("published request does not decode: %v", err)
			}
			return req
		}
	}
	h.t.Fatalf("no submit with Nats-Msg-Id %s", contracts.SubmitMsgID("acme", id))
	return contracts.JobRequest{}
}

func (h *harness) publishEvent(ev contracts.JobEvent) uint64 {
	h.t.Helper()
	ev.SchemaVersion = contracts.SchemaVersion
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	ack, err := h.bus.Publish(ctx, contracts.SubjectJobEvents(ev.Tenant, ev.JobID), contracts.JobEventID(ev.Tenant, ev.JobID, ev.Type, ev.Attempt, 0), ev)
	if err != nil {
		h.t.Fatal(err)
	}
	return ack.Sequence
}

var t0 = time.Date(2026, 11, 22, 12, 0, 1, 234e6, time.UTC)

// queue publishes the queued event the scheduler would for a request.
func (h *harness) queue(req contracts.JobRequest, at time.Time) {
	n := req.Normalized("acme")
	h.publishEvent(contracts.JobEvent{Type: contracts.EventQueued, State: contracts.StateQueued, Tenant: "acme", JobID: req.ID, Attempt: 1, Time: at, Request: &n})
}

func TestSubmitFromFlags(t *testing.T) {
	h := start(t)
	code, out, errOut := h.run("submit", "--id", "train-1", "--name", "resnet", "--gpus", "2", "--model", "H100-80GB",
		"--gpu-memory", "40000", "--priority", "high", "--pool", "h100", "--duration", "45s", "--exit-code", "3", "--checkpoint")
	if code != ExitOK || !strings.Contains(out, "job train-1 submitted (tenant acme, JOBS #") {
		t.Fatalf("submit: code %d, stdout %q, stderr %q", code, out, errOut)
	}
	want := contracts.JobRequest{ID: "train-1", Name: "resnet", Priority: contracts.PriorityHigh, Pool: "h100",
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 2, Model: "H100-80GB", MemoryMiB: 40000}},
		Run:       contracts.RunSpec{Duration: contracts.Duration(45 * time.Second), ExitCode: 3, Checkpoint: true}}
	if diff := cmp.Diff(want, h.submitted("train-1")); diff != "" {
		t.Fatalf("published request (-want +got):\n%s", diff)
	}

	// Again with the same ID: a duplicate, said so.
	if code, out, _ := h.run("submit", "--id", "train-1", "--name", "resnet", "--gpus", "2", "--model", "H100-80GB",
		"--gpu-memory", "40000", "--priority", "high", "--pool", "h100", "--duration", "45s", "--exit-code", "3"); code != ExitOK || !strings.Contains(out, "already submitted") {
		t.Fatalf("resubmit: code %d, stdout %q", code, out)
	}

	// A command after --, flags after it untouched, and a generated ID.
	code, out, errOut = h.run("submit", "-o", "json", "--gpus", "1", "--", "python", "train.py", "--epochs", "3")
	var res contracts.SubmitResponse
	if code != ExitOK || json.Unmarshal([]byte(out), &res) != nil || contracts.ValidateID(res.JobID) != nil {
		t.Fatalf("submit command: code %d, stdout %q, stderr %q", code, out, errOut)
	}
	got := h.submitted(res.JobID)
	if diff := cmp.Diff(contracts.RunSpec{Command: []string{"python", "train.py", "--epochs", "3"}}, got.Run); diff != "" {
		t.Fatalf("run spec (-want +got):\n%s", diff)
	}

	// Invalid flags are refused before anything is sent, with the reasons.
	before := len(h.messages(contracts.SubjectSubmitAll))
	code, _, errOut = h.run("submit", "--gpus", "0", "--model", "Z100")
	if code != ExitError {
		t.Fatalf("invalid submit: code %d, want %d", code, ExitError)
	}
	for _, want := range []string{"invalid_request", "resources.gpu.count: out_of_range", "resources.gpu.model: unknown_gpu_model"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr %q lacks %q", errOut, want)
		}
	}
	if code, _, errOut := h.run("submit", "--tenant", "Bad.Tenant"); code != ExitError || !strings.Contains(errOut, "invalid_tenant") {
		t.Errorf("bad tenant: code %d, stderr %q", code, errOut)
	}
	if code, _, errOut := h.run("submit", "--duration", "soon"); code != ExitError || !strings.Contains(errOut, "run.duration: invalid_duration") {
		t.Errorf("bad duration: code %d, stderr %q", code, errOut)
	}
	if after := len(h.messages(contracts.SubjectSubmitAll)); after != before {
		t.Fatalf("invalid submits published %d messages", after-before)
	}
}

func TestSubmitFromFile(t *testing.T) {
	h := start(t)
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	yamlFile := write("job.yaml", `
id: from-yaml
name: bert
priority: best-effort
resources:
  gpu:
    count: 4
    model: A100-80GB
  cpuMilli: 8000
run:
  command: [torchrun, --nproc-per-node, "4", train.py]
  env:
    EPOCHS: "3"
  duration: 2h
labels:
  team: nlp
`)
	if code, out, errOut := h.run("submit", "-f", yamlFile); code != ExitOK || !strings.Contains(out, "job from-yaml submitted") {
		t.Fatalf("submit -f yaml: code %d, stdout %q, stderr %q", code, out, errOut)
	}
	want := contracts.JobRequest{ID: "from-yaml", Name: "bert", Priority: contracts.PriorityBestEffort,
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 4, Model: "A100-80GB"}, CPUMilli: 8000},
		Run: contracts.RunSpec{Command: []string{"torchrun", "--nproc-per-node", "4", "train.py"}, Env: map[string]string{"EPOCHS": "3"},
			Duration: contracts.Duration(2 * time.Hour)},
		Labels: map[string]string{"team": "nlp"}}
	if diff := cmp.Diff(want, h.submitted("from-yaml")); diff != "" {
		t.Fatalf("published request (-want +got):\n%s", diff)
	}

	// --id overrides the file's; JSON files are read as JSON.
	jsonFile := write("job.json", `{"id":"ignored","resources":{"gpu":{"count":1}},"run":{"duration":"10s"}}`)
	if code, _, errOut := h.run("submit", "-f", jsonFile, "--id", "from-json"); code != ExitOK {
		t.Fatalf("submit -f json: code %d, stderr %q", code, errOut)
	}
	if got := h.submitted("from-json"); got.Run.Duration.D() != 10*time.Second {
		t.Fatalf("json request: %+v", got)
	}

	before := len(h.messages(contracts.SubjectSubmitAll))
	tests := map[string]struct {
		content string
		code    int
		stderr  []string
	}{
		"wrong type in yaml": {"resources:\n  gpu:\n    count: two\nrun:\n  duration: 1s\n", ExitError, []string{"invalid_type", "resources.gpu.count"}},
		"unknown field":      {"gpus: 2\nresources:\n  gpu:\n    count: 1\nrun:\n  duration: 1s\n", ExitError, []string{"unknown_field", "gpus"}},
		"tenant mismatch":    {"tenant: other\nresources:\n  gpu:\n    count: 1\nrun:\n  duration: 1s\n", ExitError, []string{"tenant_mismatch"}},
		"missing run":        {"resources:\n  gpu:\n    count: 1\n", ExitError, []string{"missing_field", "run"}},
		"not yaml":           {"resources: [unclosed\n", ExitError, []string{"invalid YAML"}},
		"non-string key":     {"resources:\n  gpu:\n    1: x\n", ExitError, []string{"not a string"}},
		"empty file":         {"", ExitError, []string{"empty_body"}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			code, _, errOut := h.run("submit", "-f", write(strings.ReplaceAll(name, " ", "-")+".yaml", tt.content))
			if code != tt.code {
				t.Fatalf("code %d, want %d; stderr %q", code, tt.code, errOut)
			}
			for _, s := range tt.stderr {
				if !strings.Contains(errOut, s) {
					t.Errorf("stderr %q lacks %q", errOut, s)
				}
			}
		})
	}
	if code, _, errOut := h.run("submit", "-f", yamlFile, "--gpus", "2"); code != ExitUsage || !strings.Contains(errOut, "--gpus") {
		t.Errorf("-f with --gpus: code %d, stderr %q", code, errOut)
	}
	if after := len(h.messages(contracts.SubjectSubmitAll)); after != before {
		t.Fatalf("invalid files published %d messages", after-before)
	}
}

func TestGetListCancelUsage(t *testing.T) {
	h := start(t)
	for _, id := range []string{"j1", "j2"} {
		if code, _, errOut := h.run("submit", "--id", id, "--gpus", "2", "--model", "H100-80GB"); code != ExitOK {
			t.Fatalf("submit %s: %s", id, errOut)
		}
	}
	h.queue(h.submitted("j1"), t0)
	h.queue(h.submitted("j2"), t0.Add(time.Second))
	placement := &contracts.Placement{AllocationID: "alloc-j1", NodeID: "node-7", Pool: "h100",
		Devices: []contracts.DeviceRef{{Index: 2, UUID: "GPU-2", Model: "H100-80GB"}, {Index: 3, UUID: "GPU-3", Model: "H100-80GB"}}}
	h.publishEvent(contracts.JobEvent{Type: contracts.EventScheduled, State: contracts.StateScheduled, Tenant: "acme", JobID: "j1", Attempt: 1, Time: t0.Add(2 * time.Second), Placement: placement})
	h.publishEvent(contracts.JobEvent{Type: contracts.EventPending, State: contracts.StateQueued, Tenant: "acme", JobID: "j2", Attempt: 1, Time: t0.Add(3 * time.Second), Reason: contracts.PendingInsufficientGPUs})

	h.eventually("j1 scheduled", func() bool {
		_, out, _ := h.run("get", "j1")
		return strings.Contains(out, "scheduled")
	})
	_, out, _ := h.run("get", "j1")
	for _, want := range []string{"ID:", "j1", "State:", "scheduled", "Node:", "node-7 (pool h100)", "2 × H100-80GB [2,3]", "Requested:"} {
		if !strings.Contains(out, want) {
			t.Errorf("get j1 output lacks %q:\n%s", want, out)
		}
	}
	code, out, _ := h.run("get", "j1", "-o", "json")
	var st contracts.JobStatus
	if code != ExitOK || json.Unmarshal([]byte(out), &st) != nil || st.State != contracts.StateScheduled || st.Placement.NodeID != "node-7" {
		t.Fatalf("get -o json: code %d, %q", code, out)
	}

	h.eventually("j2 pending reason", func() bool {
		_, out, _ := h.run("list")
		return strings.Contains(out, string(contracts.PendingInsufficientGPUs))
	})
	_, out, _ = h.run("list")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "ID") || !strings.HasPrefix(lines[1], "j2") || !strings.HasPrefix(lines[2], "j1") {
		t.Fatalf("list: want a header then j2 (newest) and j1:\n%s", out)
	}
	if !strings.Contains(lines[2], "node-7") || !strings.Contains(lines[1], "2 × H100-80GB") {
		t.Errorf("list rows lack node or GPUs:\n%s", out)
	}
	if _, out, _ := h.run("list", "--state", "queued"); strings.Contains(out, "j1") || !strings.Contains(out, "j2") {
		t.Errorf("list --state queued:\n%s", out)
	}
	if code, _, errOut := h.run("list", "--state", "sleeping"); code != ExitError || !strings.Contains(errOut, "invalid_value") || !strings.Contains(errOut, "state:") {
		t.Errorf("list --state sleeping: code %d, stderr %q", code, errOut)
	}

	if code, _, errOut := h.run("get", "nope"); code != ExitError || !strings.Contains(errOut, "unknown_job") || !strings.Contains(errOut, "HTTP 404") {
		t.Errorf("get nope: code %d, stderr %q", code, errOut)
	}
	if code, _, errOut := h.run("cancel", "nope"); code != ExitError || !strings.Contains(errOut, "unknown_job") {
		t.Errorf("cancel nope: code %d, stderr %q", code, errOut)
	}
	if code, out, errOut := h.run("cancel", "j2", "--reason", "not needed"); code != ExitOK || !strings.Contains(out, "cancel of job j2 requested") {
		t.Fatalf("cancel j2: code %d, stdout %q, stderr %q", code, out, errOut)
	}
	cancels := h.messages(contracts.SubjectCancel("acme"))
	if len(cancels) != 1 || cancels[0].ID() != contracts.CancelMsgID("acme", "j2") {
		t.Fatalf("cancel messages: %d", len(cancels))
	}

	rec := contracts.UsageRecord{SchemaVersion: 1, ID: contracts.UsageID("alloc-j1"), AllocationID: "alloc-j1", Tenant: "acme", JobID: "j1",
		Attempt: 1, NodeID: "node-7", GPUModel: "H100-80GB", GPUs: 2, Start: t0, End: t0.Add(90 * time.Second), GPUMillis: 180000, GPUSeconds: 180, Time: t0}
	if _, err := h.bus.Publish(context.Background(), contracts.SubjectUsage("acme"), rec.ID, rec); err != nil {
		t.Fatal(err)
	}
	h.eventually("usage", func() bool {
		_, out, _ := h.run("usage")
		return strings.Contains(out, "tenant acme: 180 GPU-seconds in 1 records") && strings.Contains(out, "node-7")
	})
}

// lineRE is one watch line: "12:00:01.234 queued attempt=1".
var lineRE = regexp.MustCompile(`^\d\d:\d\d:\d\d\.\d{3} [a-z]+ attempt=\d+`)

func TestWatchUntilTerminal(t *testing.T) {
	h := start(t)
	zero, one := 0, 1
	tests := map[string]struct {
		via      string
		terminal contracts.JobEvent
		code     int
	}{
		"gateway, succeeded": {"gateway", contracts.JobEvent{Type: contracts.EventSucceeded, State: contracts.StateSucceeded, ExitCode: &zero}, ExitOK},
		"gateway, failed":    {"gateway", contracts.JobEvent{Type: contracts.EventFailed, State: contracts.StateFailed, ExitCode: &one, Reason: contracts.ReasonExitNonZero}, ExitError},
		"bus, succeeded":     {"bus", contracts.JobEvent{Type: contracts.EventSucceeded, State: contracts.StateSucceeded, ExitCode: &zero}, ExitOK},
		"bus, cancelled":     {"bus", contracts.JobEvent{Type: contracts.EventCancelled, State: contracts.StateCancelled, Reason: contracts.ReasonCancelled}, ExitError},
	}
	n := 0
	for name, tt := range tests {
		n++
		id := "w" + string(rune('0'+n))
		t.Run(name, func(t *testing.T) {
			req := contracts.JobRequest{ID: id, Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 2}}, Run: contracts.RunSpec{Duration: contracts.Duration(time.Second)}}
			h.queue(req, t0)
			args := []string{"watch", id, "--via", tt.via}
			if tt.via == "bus" {
				// As an administrator: watch follows the job with an
				// ordered consumer, whose generated names a tenant's
				// permissions do not allow (only its tenant_<t> consumer).
				args = append(args, "--creds", h.adminCreds)
			}
			out, wait := h.runAsync(args...)
			// History first: the queued line, before anything else is published.
			h.eventually("the queued line", func() bool { return strings.Contains(out.String(), " queued attempt=1") })
			placement := &contracts.Placement{AllocationID: "a-" + id, NodeID: "node-1", Pool: "p", Devices: []contracts.DeviceRef{{Index: 0}, {Index: 1}}}
			// A rejected duplicate submit of the accepted job is not its story.
			h.publishEvent(contracts.JobEvent{Type: contracts.EventRejected, State: contracts.StateRejected, Tenant: "acme", JobID: id, Time: t0, Reason: contracts.ReasonDuplicateJobID})
			h.publishEvent(contracts.JobEvent{Type: contracts.EventScheduled, State: contracts.StateScheduled, Tenant: "acme", JobID: id, Attempt: 1, Time: t0.Add(time.Second), Placement: placement})
			h.publishEvent(contracts.JobEvent{Type: contracts.EventRunning, State: contracts.StateRunning, Tenant: "acme", JobID: id, Attempt: 1, Time: t0.Add(2 * time.Second), Placement: placement})
			term := tt.terminal
			term.Tenant, term.JobID, term.Attempt, term.Time = "acme", id, 1, t0.Add(3*time.Second)
			h.publishEvent(term)
			code, errOut := wait()
			if code != tt.code {
				t.Fatalf("watch exit code %d, want %d; stderr %q", code, tt.code, errOut)
			}
			lines := strings.Split(strings.TrimSpace(out.String()), "\n")
			wantTypes := []string{"queued", "scheduled", "running", string(term.Type)}
			if len(lines) != len(wantTypes) {
				t.Fatalf("watch printed %d lines, want %d:\n%s", len(lines), len(wantTypes), out.String())
			}
			for i, l := range lines {
				if !lineRE.MatchString(l) || strings.Fields(l)[1] != wantTypes[i] {
					t.Errorf("line %d %q: want %s in the watch format", i, l, wantTypes[i])
				}
			}
			if !strings.Contains(lines[1], "node=node-1 gpus=0,1") {
				t.Errorf("scheduled line lacks the placement: %q", lines[1])
			}
			if wantTime := t0.Local().Format("15:04:05.000"); !strings.HasPrefix(lines[0], wantTime) {
				t.Errorf("queued line %q does not start with the event time %s", lines[0], wantTime)
			}
		})
	}
}

func TestViaBusNeedsNoGateway(t *testing.T) {
	h := start(t)
	h.gateway = "http://127.0.0.1:1" // nothing listens there
	code, out, errOut := h.run("--via", "bus", "submit", "--id", "direct", "--gpus", "1", "--duration", "5s")
	if code != ExitOK || !strings.Contains(out, "job direct submitted (tenant acme, JOBS #") {
		t.Fatalf("submit via bus: code %d, stdout %q, stderr %q", code, out, errOut)
	}
	msgs := h.messages(contracts.SubjectSubmit("acme"))
	if len(msgs) != 1 || msgs[0].ID() != contracts.SubmitMsgID("acme", "direct") || msgs[0].Header.Get(contracts.HeaderCESource) != "/gpuplane/gpuctl" {
		t.Fatalf("submit via bus: %d messages", len(msgs))
	}
	if req := h.submitted("direct"); req.Run.Duration.D() != 5*time.Second {
		t.Fatalf("request %+v", req)
	}
	if code, _, errOut := h.run("cancel", "direct", "--via", "bus"); code != ExitOK {
		t.Fatalf("cancel via bus: %d %q", code, errOut)
	}
	cancels := h.messages(contracts.SubjectCancel("acme"))
	if len(cancels) != 1 || cancels[0].ID() != contracts.CancelMsgID("acme", "direct") {
		t.Fatalf("cancel via bus: %d messages", len(cancels))
	}
	if code, _, errOut := h.run("get", "direct"); code != ExitError || !strings.Contains(errOut, "unreachable") {
		t.Fatalf("get without a gateway: code %d, stderr %q", code, errOut)
	}
}

func TestCommandLineErrors(t *testing.T) {
	h := &harness{t: t, gateway: "http://127.0.0.1:1", natsURL: "nats://127.0.0.1:1"}
	tests := map[string]struct {
		args   []string
		code   int
		stderr string
	}{
		"no command":      {nil, ExitUsage, "Commands:"},
		"help":            {[]string{"help"}, ExitOK, "Commands:"},
		"unknown command": {[]string{"frobnicate"}, ExitUsage, `unknown command "frobnicate"`},
		"get without id":  {[]string{"get"}, ExitUsage, "want exactly one job ID"},
		"get two ids":     {[]string{"get", "a", "b"}, ExitUsage, "want exactly one job ID"},
		"bad output":      {[]string{"list", "-o", "yaml"}, ExitUsage, "table, json or csv"},
		"bad via":         {[]string{"--via", "pigeon", "list"}, ExitUsage, "gateway or bus"},
		"unknown flag":    {[]string{"list", "--colour"}, ExitUsage, "flag provided but not defined"},
		"bad id":          {[]string{"watch", "a.b"}, ExitUsage, "invalid id"},
		"submit args":     {[]string{"submit", "python"}, ExitUsage, "after --"},
		"command help":    {[]string{"submit", "-h"}, ExitOK, "-gpu-memory"},
		"file and flag":   {[]string{"submit", "-f", "job.yaml", "--gpus", "2"}, ExitUsage, "-f cannot be combined with --gpus"},
		"file and late flag": {[]string{"submit", "-f", "job.yaml", "--checkpoint", "--placement-timeout", "1m"}, ExitUsage,
			"-f cannot be combined with --checkpoint --placement-timeout"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			code, _, errOut := h.run(tt.args...)
			if code != tt.code || !strings.Contains(errOut, tt.stderr) {
				t.Fatalf("code %d, stderr %q; want %d and %q", code, errOut, tt.code, tt.stderr)
			}
		})
	}
}

func TestYAMLToJSON(t *testing.T) {
	got, err := yamlToJSON([]byte("id: a\nrun:\n  duration: 30s\n  exitCode: 2\nlabels:\n  when: 2026-01-02\n"))
	if err != nil {
		t.Fatal(err)
	}
	var v map[string]any
	if err := json.Unmarshal(got, &v); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"id": "a", "run": map[string]any{"duration": "30s", "exitCode": float64(2)}, "labels": map[string]any{"when": "2026-01-02"}}
	if diff := cmp.Diff(want, v); diff != "" {
		t.Fatalf("(-want +got):\n%s", diff)
	}
}
