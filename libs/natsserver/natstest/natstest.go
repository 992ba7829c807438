// Package natstest starts a real embedded NATS JetStream server for a test:
// a random port on 127.0.0.1 and a t.TempDir() store, stopped by t.Cleanup.
package natstest

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/libs/natsserver"
)

// Start starts a server for t and returns it; it is shut down when t ends.
func Start(t testing.TB) *natsserver.Server {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	s, err := natsserver.Start(ctx, natsserver.Options{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatalf("start embedded nats: %v", err)
	}
	t.Cleanup(s.Shutdown)
	return s
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
