// Package natstest starts a real embedded NATS JetStream server for a test:
// a random port on 127.0.0.1 and a t.TempDir() store, stopped by t.Cleanup.
package natstest

import (
	"context"
	"testing"
	"time"

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
