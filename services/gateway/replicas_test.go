package gateway

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// replica starts a second gateway on h's NATS server with h's settings
// and returns a harness for it (same bus, same admin token).
func (h *harness) replica(mutate func(*Config)) *harness {
	h.t.Helper()
	r := &harness{t: h.t, nats: h.nats, bus: h.bus, token: h.token, hc: h.hc}
	cfg := DefaultConfig()
	cfg.Bus.NATSURL = h.nats.URL()
	cfg.Bus.Creds = natstest.Service(h.t, h.nats, contracts.BusGateway)
	cfg.Bus.OTLPEndpoint = ""
	cfg.Bus.Replicas = 1
	cfg.Addr = "127.0.0.1:0"
	addrs := make(chan string, 1)
	cfg.OnListen = func(a string) { addrs <- a }
	if mutate != nil {
		mutate(&cfg)
	}
	runCtx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	log := slog.New(slog.NewTextHandler(io.MultiWriter(h.t.Output(), &r.logs), &slog.HandlerOptions{Level: slog.LevelInfo}))
	go func() { done <- Run(runCtx, cfg, log) }()
	h.t.Cleanup(func() {
		stop()
		select {
		case err := <-done:
			if err != nil {
				h.t.Errorf("replica Run returned %v after shutdown, want nil", err)
			}
		case <-time.After(waitFor):
			h.t.Errorf("replica Run did not return within %s of shutdown", waitFor)
		}
	})
	select {
	case a := <-addrs:
		r.url = "http://" + a
	case err := <-done:
		h.t.Fatalf("replica Run returned before listening: %v", err)
	case <-time.After(waitFor):
		h.t.Fatal("replica did not listen in time")
	}
	r.eventually("replica healthz 200", func() bool {
		status, _ := r.do(http.MethodGet, "/healthz", "", nil)
		return status == http.StatusOK
	})
	return r
}

// TestTwoReplicasServeOneTenant runs two gateways on one bus, as behind a
// load balancer: a token created through one authenticates on the other
// at once, a job submitted through one is read through the other, a
// revocation through one is refused by the other, and each replica bounds
// a tenant's rate on its own (per replica, as FLOWS says: the total is
// shared out by giving each replica its part).
func TestTwoReplicasServeOneTenant(t *testing.T) {
	limits := func(c *Config) { c.Limits.RequestsPerSecond, c.Limits.Burst = 0.001, 4 }
	a := startGateway(t, limits, nil)
	b := a.replica(limits)

	var created contracts.TokenCreated
	if status, ae := a.as(a.token, http.MethodPost, "/v1/tokens",
		`{"name":"ci","bindings":[{"role":"member","tenant":"acme"}]}`, &created); status != http.StatusCreated {
		t.Fatalf("create through a: %d %+v", status, ae)
	}
	if status, ae := b.as(created.Secret, http.MethodGet, "/v1/whoami", "", nil); status != http.StatusOK {
		t.Fatalf("a token created through a, on b at once: %d %+v", status, ae)
	}

	if status, ae := a.as(created.Secret, http.MethodPost, "/v1/tenants/acme/jobs", validBody("rep-1"), nil); status != http.StatusAccepted {
		t.Fatalf("submit through a: %d %+v", status, ae)
	}
	a.publishEvent(queued("acme", "rep-1", time.Now()))
	b.eventually("the job on b", func() bool {
		status, _ := b.as(created.Secret, http.MethodGet, "/v1/tenants/acme/jobs/rep-1", "", nil)
		return status == http.StatusOK
	})

	// Each replica keeps its own bucket of 4 for globex, untouched so far.
	for _, r := range []*harness{a, b} {
		got := 0
		for range 6 {
			if status, _ := r.as(a.token, http.MethodGet, "/v1/tenants/globex/jobs", "", nil); status == http.StatusOK {
				got++
			}
		}
		if got != 4 {
			t.Errorf("%s let %d of 6 requests for globex through, want its own burst of 4", r.url, got)
		}
	}

	if status, ae := a.as(a.token, http.MethodDelete, "/v1/tokens/"+created.Token, "", nil); status/100 != 2 {
		t.Fatalf("revoke through a: %d %+v", status, ae)
	}
	b.eventually("the revoked token refused on b", func() bool {
		status, _ := b.as(created.Secret, http.MethodGet, "/v1/whoami", "", nil)
		return status == http.StatusUnauthorized
	})
}
