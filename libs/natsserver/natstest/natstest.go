// Package natstest starts a real embedded NATS JetStream server for a test:
// a random port on 127.0.0.1 and a t.TempDir() store, stopped by t.Cleanup.
package natstest

import (
	"context"
	"encoding/json"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/libs/natsserver"
)

// Start starts a server for t and returns it; it is shut down when t ends.
// Authentication is on, as everywhere: connect with the credentials of
// Creds, Operator or Service.
func Start(t testing.TB) *natsserver.Server {
	t.Helper()
	return StartWith(t, natsserver.Options{})
}

// StartWith starts a server with o (a fresh trust and a t.TempDir() store
// unless o sets them).
func StartWith(t testing.TB, o natsserver.Options) *natsserver.Server {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if o.StoreDir == "" {
		o.StoreDir = t.TempDir()
	}
	if o.OnViolation == nil {
		// A service under test that lacks a permission its work needs is
		// a defect of contracts.Access: fail the test that saw it.
		o.OnViolation = failOnViolation(t)
	}
	if o.Trust == nil {
		tr, err := natsauth.New()
		if err != nil {
			t.Fatal(err)
		}
		o.Trust = tr
	}
	s, err := natsserver.Start(ctx, o)
	if err != nil {
		t.Fatalf("start embedded nats: %v", err)
	}
	t.Cleanup(s.Shutdown)
	return s
}

// Creds returns the path of a creds file of id on s (a server or a
// cluster).
func Creds(t testing.TB, s Minter, id contracts.Identity) string {
	t.Helper()
	p, err := s.Creds(id)
	if err != nil {
		t.Fatalf("creds of %s: %v", id.Name, err)
	}
	return p
}

// Operator returns the operator's creds on s: every subject and the
// stream administration, for a test's own set-up and observation.
func Operator(t testing.TB, s Minter) string {
	t.Helper()
	return Creds(t, s, contracts.Identity{Name: "operator", Role: contracts.BusOperator})
}

// Service returns the creds of the service identity of role (named after
// it) on s.
func Service(t testing.TB, s Minter, role contracts.BusRole) string {
	t.Helper()
	return Creds(t, s, contracts.Identity{Name: string(role), Role: role})
}

// Node returns the creds of node's agent on s.
func Node(t testing.TB, s Minter, node string) string {
	t.Helper()
	return Creds(t, s, contracts.Identity{Name: "node-" + node, Role: contracts.BusNode, Scope: node})
}

// Tenant returns the creds of a client of tenant on s.
func Tenant(t testing.TB, s Minter, tenant string) string {
	t.Helper()
	return Creds(t, s, contracts.Identity{Name: "tenant-" + tenant, Role: contracts.BusTenant, Scope: tenant})
}

// ForgetMsgIDs shortens a stream's duplicate window to its 100 ms minimum
// and lets it pass, so a message republished under an old Nats-Msg-Id is
// stored again. It is the only way to see whether a service itself avoids
// repeats beyond the window, which production sets to 2 minutes. JetStream
// forgets IDs on its own timer, so there is nothing to poll: this waits.
func ForgetMsgIDs(t testing.TB, js jetstream.JetStream, stream string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	cfg.Duplicates = 100 * time.Millisecond
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatalf("shorten duplicate window of %s: %v", stream, err)
	}
	time.Sleep(400 * time.Millisecond)
}

// RunService runs a service's Run in the background until stop is called
// or the test ends; stop cancels it and fails the test unless Run returns
// nil within 15 s (a clean shutdown is part of every service's contract).
func RunService(t testing.TB, name string, run func(ctx context.Context) error) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("%s stopped with %v, want nil", name, err)
				}
			case <-time.After(15 * time.Second):
				t.Errorf("%s did not stop within 15s", name)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// CaughtUp waits, bounded by two minutes, until every consumer of each
// stream has been delivered every message it takes and acknowledged it,
// then 200 ms more for the last deliveries to be handled: what a
// benchmark measures after it is what a service keeps, not what its
// consumers lag by.
func CaughtUp(tb testing.TB, js jetstream.JetStream, streams ...string) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, name := range streams {
		for {
			st, err := js.Stream(ctx, name)
			if err != nil {
				tb.Fatal(err)
			}
			behind := false
			for info := range st.ListConsumers(ctx).Info() {
				behind = behind || info.NumPending > 0 || info.NumAckPending > 0
			}
			if !behind {
				break
			}
			select {
			case <-ctx.Done():
				tb.Fatalf("consumers of %s not caught up in 2 minutes", name)
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
	time.Sleep(200 * time.Millisecond)
}

// Publisher publishes JSON bodies with their message IDs asynchronously,
// as the services' writers do, from any goroutine: a benchmark that
// feeds a service thousands of messages a second. Publish waits for
// acknowledgements when too many are in flight; Flush waits, bounded,
// for all of them.
type Publisher struct {
	tb testing.TB
	js jetstream.JetStream
	mu sync.Mutex
}

// NewPublisher returns a Publisher on js that fails tb on an error.
func NewPublisher(tb testing.TB, js jetstream.JetStream) *Publisher {
	return &Publisher{tb: tb, js: js}
}

// Publish sends v, JSON-encoded, on subject with message ID id.
func (p *Publisher) Publish(subject, id string, v any) {
	data, err := json.Marshal(v)
	if err != nil {
		p.tb.Fatal(err)
	}
	m := nats.NewMsg(subject)
	m.Data = data
	m.Header.Set(contracts.HeaderMsgID, id)
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		if _, err = p.js.PublishMsgAsync(m); err == nil {
			return
		}
		<-p.js.PublishAsyncComplete()
	}
}

// Flush waits, at most 30 s, until every publish so far is acknowledged.
func (p *Publisher) Flush() {
	select {
	case <-p.js.PublishAsyncComplete():
	case <-time.After(30 * time.Second):
		p.tb.Fatal("publishes not acknowledged in 30 s")
	}
}

// BlockCacheSettle is how long a benchmark that measures a service's heap
// beside an embedded server waits before a measurement: the server, in
// the same heap, keeps a stream's recently used blocks cached (megabytes
// each, from a sync.Pool two GCs do not empty) for 10 s after their last
// use, so a measurement taken sooner may count them on one side only.
// 11 s, or the duration in the environment variable env.
func BlockCacheSettle(tb testing.TB, env string) time.Duration {
	d := 11 * time.Second
	if v := os.Getenv(env); v != "" {
		var err error
		if d, err = time.ParseDuration(v); err != nil {
			tb.Fatalf("%s: %v", env, err)
		}
	}
	return d
}
