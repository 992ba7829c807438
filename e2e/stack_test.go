package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// stack is a running all-in-one with a client connection.
type stack struct {
	ep gpuplane.Endpoints
	nc *nats.Conn
	js jetstream.JetStream
}

// startStack runs the whole platform in this process on an embedded NATS
// server with random ports and a temporary store, and stops it when the
// test ends. Each tune, in order, adjusts the configuration first (a
// test's scheduler flags, for instance).
func startStack(t testing.TB, fl *fleet.Fleet, tune ...func(*gpuplane.Config)) *stack {
	t.Helper()
	level := slog.LevelWarn
	if os.Getenv("GPUPLANE_E2E_DEBUG") != "" {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	cfg := gpuplane.Config{
		DataDir:     t.TempDir(),
		NATSPort:    -1,
		GatewayAddr: "127.0.0.1:0",
		MetricsAddr: "127.0.0.1:0",
		Fleet:       fl,
		AgentLogDir: t.TempDir(),
		Identities:  natsauth.DefaultDescription(),
	}
	for _, f := range tune {
		f(&cfg)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan gpuplane.Endpoints, 1)
	done := make(chan error, 1)
	go func() { done <- gpuplane.Run(ctx, cfg, log, func(ep gpuplane.Endpoints) { ready <- ep }) }()
	var ep gpuplane.Endpoints
	select {
	case ep = <-ready:
		authorize(ep.GatewayURL, ep.AdminToken)
	case err := <-done:
		cancel()
		t.Fatalf("stack exited before ready: %v", err)
	case <-time.After(60 * time.Second):
		cancel()
		t.Fatal("stack not ready after 60s")
	}
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("stack stopped with error: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("stack did not stop within 30s of cancellation")
		}
	})
	// The stack is ready once the gateway listens; it authenticates
	// requests only once it has read its identity buckets.
	waitFor(t, 30*time.Second, "the gateway to authenticate", func() (bool, string) {
		resp, err := authClient.Get(ep.GatewayURL + "/v1/whoami")
		if err != nil {
			return false, err.Error()
		}
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status
	})
	s := connectClient(t, ep.NATSURL, ep.Creds["operator"], "e2e-client")
	s.ep = ep
	return s
}

// submitBus publishes a raw request body as a bus client would.
func (s *stack) submitBus(ctx context.Context, tenant, msgID string, body []byte) (*jetstream.PubAck, error) {
	msg := nats.NewMsg(contracts.SubjectSubmit(tenant))
	msg.Data = body
	if msgID != "" {
		msg.Header.Set(contracts.HeaderMsgID, msgID)
	}
	return s.js.PublishMsg(ctx, msg)
}

// submitAPI posts a raw request body to the gateway.
func (s *stack) submitAPI(ctx context.Context, tenant string, body []byte) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.ep.GatewayURL+"/v1/tenants/"+tenant+"/jobs", bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := authClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// jobWatcher follows JOB_EVENTS and records the last event of every job.
type jobWatcher struct {
	mu     sync.Mutex
	last   map[string]contracts.JobEvent // tenant/job -> last event
	counts map[contracts.JobEventType]int
}

// tail hands every message of stream (on subjects; all when none) to fn,
// in stream order from the first, until the test ends.
func (s *stack) tail(t testing.TB, stream string, subjects []string, fn func(jetstream.Msg)) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	cons, err := s.js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{FilterSubjects: subjects})
	if err != nil {
		t.Fatal(err)
	}
	cc, err := cons.Consume(fn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cc.Stop)
}

func (s *stack) watchJobs(t testing.TB) *jobWatcher {
	t.Helper()
	w := &jobWatcher{last: map[string]contracts.JobEvent{}, counts: map[contracts.JobEventType]int{}}
	s.tail(t, contracts.StreamJobEvents, nil, func(m jetstream.Msg) {
		var ev contracts.JobEvent
		if err := json.Unmarshal(m.Data(), &ev); err != nil {
			return
		}
		w.mu.Lock()
		defer w.mu.Unlock()
		w.counts[ev.Type]++
		key := ev.Tenant + "/" + ev.JobID
		// A rejected duplicate does not change the accepted job.
		if ev.Type == contracts.EventRejected && ev.Reason == contracts.ReasonDuplicateJobID {
			w.last[key+"#duplicate"] = ev
			return
		}
		w.last[key] = ev
	})
	return w
}

func (w *jobWatcher) get(key string) (contracts.JobEvent, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	ev, ok := w.last[key]
	return ev, ok
}

// waitFor polls cond every 50 ms until it holds or the deadline passes.
func waitFor(t testing.TB, d time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(d)
	var status string
	for time.Now().Before(deadline) {
		var ok bool
		if ok, status = cond(); ok {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("timed out after %s waiting for %s: %s", d, what, status)
}

// apiError decodes a gateway error body.
func apiError(b []byte) (contracts.APIError, error) {
	var e contracts.APIError
	err := json.Unmarshal(b, &e)
	if err == nil && e.Error.Reason == "" {
		err = fmt.Errorf("no reason in %s", strings.TrimSpace(string(b)))
	}
	return e, err
}

// submitted is a job a test submitted.
type submitted struct {
	tenant, id string
	viaAPI     bool
	req        contracts.JobRequest
}

// progress reports whether every job succeeded and, for a wait's status,
// the count by last state and up to ten jobs that have not succeeded, each
// with its shape, last event and reason.
func (w *jobWatcher) progress(jobs []submitted) (bool, string) {
	states := map[contracts.JobState]int{}
	var stuck []string
	for _, j := range jobs {
		ev, ok := w.get(j.tenant + "/" + j.id)
		if !ok {
			states["unseen"]++
			continue
		}
		states[ev.State]++
		if ev.State != contracts.StateSucceeded && len(stuck) < 10 {
			g := j.req.Resources.GPU
			stuck = append(stuck, fmt.Sprintf("%s/%s (%d×%s, %s) last %s attempt %d: %s %s",
				j.tenant, j.id, g.Count, g.Model, j.req.Priority, ev.Type, ev.Attempt, ev.Reason, ev.Message))
		}
	}
	return states[contracts.StateSucceeded] == len(jobs), fmt.Sprintf("%v\n  %s", states, strings.Join(stuck, "\n  "))
}
