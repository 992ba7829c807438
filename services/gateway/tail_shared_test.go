package gateway

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// readConsumers returns the JOB_EVENTS consumers that read (not paused),
// leaving out the event streams' short-lived history consumers.
func (h *harness) readConsumers() []*jetstream.ConsumerInfo {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	s, err := h.bus.JetStream().Stream(ctx, contracts.StreamJobEvents)
	if err != nil {
		h.t.Fatalf("stream: %v", err)
	}
	lister := s.ListConsumers(ctx)
	var out []*jetstream.ConsumerInfo
	for info := range lister.Info() {
		if !info.Paused && !strings.HasPrefix(info.Name, "gw-sse-") {
			out = append(out, info)
		}
	}
	if err := lister.Err(); err != nil {
		h.t.Fatalf("consumers: %v", err)
	}
	return out
}

// TestOneJobEventReadFeedsModelAndStreams: the gateway reads JOB_EVENTS
// once, for its read model and its event streams alike (one delivery per
// event, not one per reader; issue 17). With history before it starts, a
// stream opened after, and its one consumer stalled (paused on the
// server, as one on a dead NATS node) or deleted, the read model and a
// tenant's stream still see every event once and in order, and the
// gateway holds one reading consumer again.
func TestOneJobEventReadFeedsModelAndStreams(t *testing.T) {
	for _, tc := range []struct {
		name string
		// replace makes the gateway's consumer go away or stall.
		replace func(ctx context.Context, js jetstream.JetStream, name string) error
	}{
		{"paused", func(ctx context.Context, js jetstream.JetStream, name string) error {
			_, err := js.PauseConsumer(ctx, contracts.StreamJobEvents, name, time.Now().Add(time.Hour))
			return err
		}},
		{"deleted", func(ctx context.Context, js jetstream.JetStream, name string) error {
			return js.DeleteConsumer(ctx, contracts.StreamJobEvents, name)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var want []string
			h := startGateway(t, func(c *Config) { c.Limits.StreamsPerTenant, c.Limits.RequestsPerSecond = 0, 0 }, func(h *harness) {
				for i := range 5 {
					want = append(want, itoa(h.publishEvent(queued("acme", "j"+strconv.Itoa(i), t0))))
				}
			})
			for i := 5; i < 10; i++ {
				want = append(want, itoa(h.publishEvent(queued("acme", "j"+strconv.Itoa(i), t0))))
				h.publishEvent(queued("other", "j"+strconv.Itoa(i), t0))
			}
			h.waitState("j9", contracts.StateQueued, 1)
			cons := h.readConsumers()
			if len(cons) != 1 {
				t.Fatalf("%d consumers read %s for the gateway, want 1 (read model and event streams): %v",
					len(cons), contracts.StreamJobEvents, consumerNames(cons))
			}
			frames, _ := h.openStream("/v1/tenants/acme/events")
			if n := len(h.readConsumers()); n != 1 {
				t.Fatalf("%d consumers with a stream open, want 1", n)
			}
			var got []string
			next := func() {
				t.Helper()
				f, ok := nextEvent(t, frames)
				if !ok {
					t.Fatalf("stream ended after %v; want %v", got, want)
				}
				got = append(got, f.ID)
			}
			for len(got) < len(want) {
				next()
			}

			ctx, cancel := context.WithTimeout(context.Background(), waitFor)
			defer cancel()
			if err := tc.replace(ctx, h.bus.JetStream(), cons[0].Name); err != nil {
				t.Fatalf("replace consumer %s: %v", cons[0].Name, err)
			}
			for i := range 10 {
				at := t0.Add(time.Duration(i+1) * time.Second)
				want = append(want, itoa(h.publishEvent(contracts.JobEvent{Type: contracts.EventScheduled, Tenant: "acme",
					JobID: "j" + strconv.Itoa(i), Attempt: 1, Time: at})))
				want = append(want, itoa(h.publishEvent(queued("acme", "k"+strconv.Itoa(i), at))))
			}
			for len(got) < len(want) {
				next()
			}
			if strings.Join(got, ",") != strings.Join(want, ",") {
				t.Fatalf("stream sent %v, want %v", got, want)
			}
			for i := range 10 {
				h.waitState("j"+strconv.Itoa(i), contracts.StateScheduled, 1)
				h.waitState("k"+strconv.Itoa(i), contracts.StateQueued, 1)
			}
			h.eventually("one reading consumer", func() bool { return len(h.readConsumers()) == 1 })
			if n := len(h.readConsumers()); n != 1 {
				t.Fatalf("%d consumers read %s after the replacement, want 1", n, contracts.StreamJobEvents)
			}
		})
	}
}

func consumerNames(infos []*jetstream.ConsumerInfo) []string {
	var names []string
	for _, c := range infos {
		names = append(names, c.Name)
	}
	return names
}
