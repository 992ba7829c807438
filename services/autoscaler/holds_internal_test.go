package autoscaler

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// The autoscaler's holds (an idle drain, a spot drain) change only the
// autoscaler's own fields of a node's hold document: the scheduler's holds
// on single GPUs, and an administrator's cordon, survive both the hold and
// its lifting.
func TestAutoscalerHoldsKeepOtherWritersHolds(t *testing.T) {
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// The holds are written with the autoscaler's own identity; the test's
	// client, which sets the other writers' holds and reads the result,
	// is the operator.
	open := func(name, creds string) (*bus.Bus, jetstream.KeyValue) {
		b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: name, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
			CredsFile: creds})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = b.Close(context.Background()) })
		kv, err := b.KeyValue(ctx, contracts.BucketNodeAdmin)
		if err != nil {
			t.Fatal(err)
		}
		return b, kv
	}
	_, kv := open("test", natstest.Operator(t, srv))
	b, asKV := open("autoscaler", natstest.Service(t, srv, contracts.BusAutoscaler))
	now := func() time.Time { return time.Date(2026, 11, 22, 8, 0, 0, 0, time.UTC) }
	holds := kvHolds{kv: asKV, now: now}
	spot := spotReaction{kv: asKV, bus: b, now: now, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	gpuHold := map[string]contracts.GPUHold{"GPU-1": {Cordoned: true, Drain: true, Cause: contracts.ReasonGPUUnhealthy}}
	put := func(node string, h contracts.NodeAdmin) {
		data, _ := json.Marshal(h)
		if _, err := kv.Put(ctx, node, data); err != nil {
			t.Fatal(err)
		}
	}
	get := func(node string) *contracts.NodeAdmin {
		e, err := kv.Get(ctx, node)
		if err != nil {
			return nil
		}
		var h contracts.NodeAdmin
		if err := json.Unmarshal(e.Value(), &h); err != nil {
			t.Fatal(err)
		}
		return &h
	}
	deadline := now().Add(2 * time.Minute)
	tests := []struct {
		name  string
		start *contracts.NodeAdmin
		hold  func(node string) error
		held  func(*contracts.NodeAdmin) bool
		lift  func(node string) error
		after func(*contracts.NodeAdmin) bool
	}{
		{"idle drain over GPU holds", &contracts.NodeAdmin{GPUs: gpuHold},
			func(n string) error { return holds.Drain(ctx, n, "idle") },
			func(h *contracts.NodeAdmin) bool { return h.Drain && h.Cordoned && len(h.GPUs) == 1 },
			func(n string) error { return holds.Lift(ctx, n) },
			func(h *contracts.NodeAdmin) bool { return h != nil && !h.Drain && !h.Cordoned && len(h.GPUs) == 1 }},
		{"spot drain over GPU holds", &contracts.NodeAdmin{GPUs: gpuHold},
			func(n string) error { return spot.hold(ctx, n, deadline) },
			func(h *contracts.NodeAdmin) bool {
				return h.Drain && h.Cause == contracts.ReasonSpotInterruption && len(h.GPUs) == 1
			},
			func(n string) error { return spot.release(ctx, n) },
			func(h *contracts.NodeAdmin) bool { return h != nil && !h.Drain && h.Cause == "" && len(h.GPUs) == 1 }},
		{"spot drain over an administrator's cordon", &contracts.NodeAdmin{Cordoned: true, Reason: "bad fan"},
			func(n string) error { return spot.hold(ctx, n, deadline) },
			func(h *contracts.NodeAdmin) bool { return h.Drain && h.Reason == "bad fan" && h.Deadline != nil },
			func(n string) error { return spot.release(ctx, n) },
			func(h *contracts.NodeAdmin) bool {
				return h != nil && h.Cordoned && h.Reason == "bad fan" && h.Cause == "" && h.Deadline == nil
			}},
		{"idle drain leaves an administrator's cordon alone", &contracts.NodeAdmin{Cordoned: true, Reason: "bad fan"},
			func(n string) error { return holds.Drain(ctx, n, "idle") },
			func(h *contracts.NodeAdmin) bool { return h.Cordoned && !h.Drain && h.Reason == "bad fan" },
			func(n string) error { return holds.Lift(ctx, n) },
			func(h *contracts.NodeAdmin) bool { return h != nil && h.Cordoned && h.Reason == "bad fan" }},
		{"nothing else held: the document goes", nil,
			func(n string) error { return holds.Drain(ctx, n, "idle") },
			func(h *contracts.NodeAdmin) bool { return h.Drain },
			func(n string) error { return holds.Lift(ctx, n) },
			func(h *contracts.NodeAdmin) bool { return h == nil }},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			node := "n" + string(rune('0'+i))
			if tc.start != nil {
				tc.start.NodeID = node
				put(node, *tc.start)
			}
			if err := tc.hold(node); err != nil {
				t.Fatal(err)
			}
			if h := get(node); h == nil || !tc.held(h) {
				t.Fatalf("held: %+v", h)
			}
			if err := tc.lift(node); err != nil {
				t.Fatal(err)
			}
			if h := get(node); !tc.after(h) {
				t.Fatalf("after: %+v", h)
			}
		})
	}
}
