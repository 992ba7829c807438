package gpuplane_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
	platform "github.com/gpuplane/gpuplane/services/gpuplane"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// The examples and tests run against one embedded stack, started once:
// the all-in-one platform of services/gpuplane (every service on an
// embedded JetStream, with a simulated fleet of two 4 × L4 machines,
// l4-01 and l4-02) on free ports.
var (
	// gatewayURL is the stack's gateway.
	gatewayURL string
	// adminToken is an API token of a platform admin; demoToken one of a
	// member of tenant acme.
	adminToken, demoToken string
)

// waitFor bounds every wait of these tests.
const waitFor = 30 * time.Second

func TestMain(m *testing.M) {
	// A job's command runs under a shim: this binary, started again.
	nodeagent.MaybeRunShim()
	os.Exit(runStack(m))
}

func runStack(m *testing.M) int {
	fl, err := fleet.Parse([]byte(`
machineTypes:
  l4x4: {gpuModel: L4, gpuCount: 4}
pools:
  - {name: l4, machineType: l4x4, count: 2}
`))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	dir, err := os.MkdirTemp("", "gpuplane-sdk-*")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	cfg := platform.Config{NATSPort: -1, GatewayAddr: "127.0.0.1:0", MetricsAddr: "127.0.0.1:0", Fleet: &fl,
		DataDir: dir, Identities: natsauth.DefaultDescription()}
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan platform.Endpoints, 1)
	done := make(chan error, 1)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	go func() { done <- platform.Run(ctx, cfg, log, func(ep platform.Endpoints) { ready <- ep }) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			fmt.Fprintln(os.Stderr, "platform:", err)
		}
	}()
	select {
	case ep := <-ready:
		gatewayURL, adminToken, demoToken = ep.GatewayURL, ep.AdminToken, ep.DemoToken
	case err := <-done:
		fmt.Fprintln(os.Stderr, "platform did not start:", err)
		return 1
	case <-time.After(waitFor):
		fmt.Fprintln(os.Stderr, "platform did not start within", waitFor)
		return 1
	}
	// Ready when the gateway's read models have caught up and both
	// machines have registered.
	c, err := gpuplane.New(gatewayURL, gpuplane.WithToken(adminToken))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	for deadline := time.Now().Add(waitFor); ; time.Sleep(50 * time.Millisecond) {
		nodes, err := c.Nodes(ctx, "")
		if c.Health(ctx) == nil && err == nil && len(nodes.Nodes) == 2 && len(nodes.Nodes[0].GPUs) == 4 && len(nodes.Nodes[1].GPUs) == 4 {
			break
		}
		if time.Now().After(deadline) {
			fmt.Fprintln(os.Stderr, "platform not ready:", c.Health(ctx), err)
			return 1
		}
	}
	return m.Run()
}

// admin is a client of the stack as its platform admin; opts come after
// the token (a shorter retry policy).
func admin(t *testing.T, opts ...gpuplane.Option) *gpuplane.Client {
	t.Helper()
	return client(t, gatewayURL, append([]gpuplane.Option{gpuplane.WithToken(adminToken)}, opts...)...)
}

func client(t *testing.T, base string, opts ...gpuplane.Option) *gpuplane.Client {
	t.Helper()
	c, err := gpuplane.New(base, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	t.Cleanup(cancel)
	return ctx
}

// eventually waits, bounded, until cond holds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(waitFor); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, waitFor)
		}
	}
}

// fault is what the proxy does to one request that matches.
type fault int

const (
	pass         fault = iota
	unavailable        // answer 503 itself, sending nothing on
	rateLimited        // answer 429 with Retry-After: 1, sending nothing on
	dropRequest        // close the connection, sending nothing on
	dropAnswer         // send it on, then close the connection instead of answering: it acted, the client does not know
	cutStream          // send it on and relay the answer, cutting the connection midway through its third event
	sseEventsCut = 2   // cutStream relays this many whole events, and part of the next
)

// proxy stands between a client and the stack's gateway and breaks the
// requests its rules name, as a network or a load balancer would.
type proxy struct {
	t      *testing.T
	target *url.URL
	srv    *httptest.Server
	mu     sync.Mutex
	// rules: method+" "+path -> the faults of the next requests, in turn.
	rules map[string][]fault
	// seen: every request, method+" "+path, and its Last-Event-ID.
	seen        []string
	lastEventID []string
}

func newProxy(t *testing.T) *proxy {
	u, err := url.Parse(gatewayURL)
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{t: t, target: u, rules: map[string][]fault{}}
	p.srv = httptest.NewServer(http.HandlerFunc(p.serve))
	t.Cleanup(p.srv.Close)
	return p
}

// on makes the next requests to method and path meet faults, in turn.
func (p *proxy) on(method, path string, faults ...fault) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rules[method+" "+path] = append(p.rules[method+" "+path], faults...)
}

// count is how many requests to method and path came.
func (p *proxy) count(method, path string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, s := range p.seen {
		if s == method+" "+path {
			n++
		}
	}
	return n
}

func (p *proxy) lastEventIDs() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.lastEventID...)
}

func (p *proxy) serve(w http.ResponseWriter, r *http.Request) {
	key := r.Method + " " + r.URL.Path
	p.mu.Lock()
	p.seen = append(p.seen, key)
	if r.Header.Get("Accept") == "text/event-stream" {
		p.lastEventID = append(p.lastEventID, r.Header.Get("Last-Event-ID"))
	}
	f := pass
	if rs := p.rules[key]; len(rs) > 0 {
		f, p.rules[key] = rs[0], rs[1:]
	}
	p.mu.Unlock()
	switch f {
	case unavailable:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = io.WriteString(w, `{"error":{"reason":"unavailable","message":"the proxy says so"}}`)
		return
	case rateLimited:
		w.Header().Set("Retry-After", "1")
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusTooManyRequests)
		_, _ = io.WriteString(w, `{"error":{"reason":"rate_limited","message":"the proxy says so"}}`)
		return
	case dropRequest:
		p.hangUp(w)
		return
	}
	out := r.Clone(r.Context())
	out.RequestURI = ""
	out.URL.Scheme, out.URL.Host, out.Host = p.target.Scheme, p.target.Host, p.target.Host
	res, err := http.DefaultTransport.RoundTrip(out)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer res.Body.Close()
	if f == dropAnswer {
		_, _ = io.Copy(io.Discard, res.Body)
		p.hangUp(w)
		return
	}
	for k, vs := range res.Header {
		w.Header()[k] = vs
	}
	w.WriteHeader(res.StatusCode)
	flusher := w.(http.Flusher)
	flusher.Flush()
	var relayed bytes.Buffer
	written := 0
	buf := make([]byte, 4096)
	for {
		n, err := res.Body.Read(buf)
		if n > 0 && f == cutStream {
			relayed.Write(buf[:n])
			// Past the whole events, relay a few bytes of the next and
			// cut: the client holds half an event it must not use.
			if idx := nthEventEnd(relayed.Bytes(), sseEventsCut); idx >= 0 && relayed.Len() >= idx+2+10 {
				_, _ = w.Write(relayed.Bytes()[written : idx+2+10])
				flusher.Flush()
				panic(http.ErrAbortHandler)
			}
		}
		if n > 0 {
			_, _ = w.Write(buf[:n])
			written += n
			flusher.Flush()
		}
		if err != nil {
			return
		}
	}
}

// hangUp closes the client's connection without an answer.
func (p *proxy) hangUp(w http.ResponseWriter) {
	conn, _, err := w.(http.Hijacker).Hijack()
	if err != nil {
		p.t.Errorf("hijack: %v", err)
		return
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.SetLinger(0) // a reset, not a polite close
	}
	_ = conn.Close()
}

// nthEventEnd is the index of the blank line that ends the n-th (from 1)
// event of an SSE stream in b (comments are not events), -1 when b holds
// fewer.
func nthEventEnd(b []byte, n int) int {
	off := 0
	for n > 0 {
		j := bytes.Index(b[off:], []byte("\n\n"))
		if j < 0 {
			return -1
		}
		if bytes.HasPrefix(b[off:], []byte("event:")) {
			if n--; n == 0 {
				return off + j
			}
		}
		off += j + 2
	}
	return -1
}
