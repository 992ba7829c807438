package bus_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// TestPublishRefusedFailsForGood: a publish the server refuses the
// identity fails with ErrPermissionDenied instead of being retried as a
// slow server until the caller's context ends.
func TestPublishRefusedFailsForGood(t *testing.T) {
	srv := natstest.StartWith(t, natsserver.Options{OnViolation: func(string) {}})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	op, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "operator", CredsFile: natstest.Operator(t, srv), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer op.Close(context.Background())
	tenant, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "tenant-acme", CredsFile: natstest.Tenant(t, srv, "acme"), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer tenant.Close(context.Background())
	if _, err := tenant.Publish(ctx, contracts.SubjectSubmit("acme"), "ok-1", map[string]string{"id": "ok-1"}); err != nil {
		t.Fatalf("own subject: %v", err)
	}
	_, err = tenant.Publish(ctx, contracts.SubjectCancel("other"), "x-1", map[string]string{"jobId": "x"})
	if !errors.Is(err, bus.ErrPermissionDenied) {
		t.Fatalf("another tenant's subject: %v, want ErrPermissionDenied", err)
	}
	if ctx.Err() != nil {
		t.Fatal("the refused publish ran until the context ended")
	}
}
